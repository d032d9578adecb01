"""The optimisation every trainer shares: AdamW, the learning-rate schedule, and one optimiser
step (gradient accumulation, data-parallel averaging, clipping, a non-finite guard).

AdamW with each parameter's update compiled into one fused loop: ``mlx.optimizers.AdamW``
evaluates its update as about a dozen separate element-wise operations per parameter, each writing
a fresh array, which on the CPU makes the optimiser step a visible part of a PPO update.
:class:`AdamW` is ``mlx.optimizers.AdamW`` (same arguments, state, schedules and results) with
:meth:`AdamW.apply_single` going through ``mx.compile``; the compiled function is traced once per
parameter shape and dtype.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, cast

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map

from base_setup.backend import evaluate_in_groups, release_cached_buffers
from base_setup.plain import speed_tricks
from models.offload import drop_read_weights


@mx.compile
def _adamw_update(
    gradient: mx.array,
    parameter: mx.array,
    m: mx.array,
    v: mx.array,
    lr: mx.array,
    hyper: mx.array,
) -> tuple[mx.array, mx.array, mx.array]:
    """One AdamW step without bias correction, as ``mlx.optimizers.AdamW`` computes it.

    ``hyper`` = (b1, 1 - b1, b2, 1 - b2, eps, weight_decay), (6,) float32, computed in double
    precision first as MLX's Python floats are, and passed as an array so that changing them
    does not retrace. Returns ``(parameter, m, v)``::

        p <- p * (1 - lr * wd);  m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
        p <- p - lr * m / (sqrt(v) + eps)
    """
    b1, c1, b2, c2, eps, weight_decay = (hyper[i].astype(gradient.dtype) for i in range(6))
    parameter = parameter * (1 - lr * weight_decay)
    m = b1 * m + c1 * gradient
    v = b2 * v + c2 * mx.square(gradient)
    return parameter - lr * m / (mx.sqrt(v) + eps), m, v


@mx.compile
def _adamw_update_corrected(
    gradient: mx.array,
    parameter: mx.array,
    m: mx.array,
    v: mx.array,
    lr: mx.array,
    step_size: mx.array,
    rsqrt_correction2: mx.array,
    hyper: mx.array,
) -> tuple[mx.array, mx.array, mx.array]:
    """One AdamW step with bias correction (PyTorch's ``torch.optim.AdamW``), as
    ``mlx.optimizers.AdamW(bias_correction=True)`` computes it.

    ``step_size = lr / (1 - b1^t)`` and ``rsqrt_correction2 = 1 / sqrt(1 - b2^t)`` at step ``t``
    (scalars in the gradient's dtype, computed outside as MLX does); ``hyper`` as in
    :func:`_adamw_update`. Returns ``(parameter, m, v)``::

        p <- p * (1 - lr * wd);  m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
        p <- p - step_size * m / (sqrt(v) * rsqrt_correction2 + eps)

    which is ``p - lr * m_hat / (sqrt(v_hat) + eps)`` with ``m_hat = m / (1 - b1^t)`` and
    ``v_hat = v / (1 - b2^t)``, in MLX's order of operations.
    """
    b1, c1, b2, c2, eps, weight_decay = (hyper[i].astype(gradient.dtype) for i in range(6))
    parameter = parameter * (1 - lr * weight_decay)
    m = b1 * m + c1 * gradient
    v = b2 * v + c2 * mx.square(gradient)
    return parameter - step_size * m / (mx.sqrt(v) * rsqrt_correction2 + eps), m, v


class AdamW(optim.AdamW):
    """``mlx.optimizers.AdamW`` with a compiled per-parameter update (see the module docstring),
    with and without bias correction; ``mlx.optimizers.AdamW``'s own update under plain MLX and
    off the CPU (:func:`base_setup.plain.speed_tricks`, checked at each update).

    Note MLX's default is ``bias_correction=False``, while PyTorch's ``torch.optim.AdamW`` (which
    TRL and published PPO/GRPO learning rates assume) corrects: uncorrected, the first updates
    are several times larger. The trainers of this project pass
    :attr:`config.training_config.OptimConfig.adam_bias_correction` (True by default).
    """

    def apply_single(self, gradient: mx.array, parameter: mx.array, state: dict) -> mx.array:
        if not speed_tricks():  # plain MLX, or a GPU: mlx.optimizers.AdamW's own update
            return cast(mx.array, super().apply_single(gradient, parameter, state))
        lr = self.learning_rate.astype(gradient.dtype)
        b1, b2 = self.betas
        hyper = mx.array([b1, 1 - b1, b2, 1 - b2, self.eps, self.weight_decay], dtype=mx.float32)
        if self.bias_correction:
            # The two scalars exactly as mlx.optimizers.Adam computes them (bit-identical).
            step = self.step
            step_size = (lr / (1 - b1**step)).astype(gradient.dtype)
            rsqrt_correction2 = mx.rsqrt(1 - b2**step).astype(gradient.dtype)
            new_parameter, state["m"], state["v"] = _adamw_update_corrected(
                gradient,
                parameter,
                state["m"],
                state["v"],
                lr,
                step_size,
                rsqrt_correction2,
                hyper,
            )
            return new_parameter
        new_parameter, state["m"], state["v"] = _adamw_update(
            gradient, parameter, state["m"], state["v"], lr, hyper
        )
        return new_parameter


def make_adamw(
    learning_rate: float | Callable[[mx.array], mx.array],
    *,
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    plain: bool = False,
) -> optim.Optimizer:
    """The trainers' AdamW: :class:`AdamW`, or ``mlx.optimizers.AdamW`` itself when ``plain``
    (a config's ``plain_mlx``). Both have the same arguments, state and results."""
    cls = optim.AdamW if plain else AdamW
    return cls(
        learning_rate=learning_rate,
        eps=eps,
        weight_decay=weight_decay,
        bias_correction=bias_correction,
    )


def lr_schedule(
    learning_rate: float, scheduler: str, warmup_steps: int, total_steps: int
) -> Callable[[mx.array], mx.array]:
    """The learning rate at each optimiser update: linear warm-up from 0 over ``warmup_steps``
    updates, then ``"constant"``, ``"linear"`` decay to 0, or ``"cosine"`` decay to 0 at update
    ``total_steps``. (PPO counts these in optimiser updates: iterations times updates per
    iteration.)"""
    warmup = min(warmup_steps, total_steps - 1) if total_steps > 1 else 0
    decay_steps = max(total_steps - warmup, 1)
    if scheduler == "constant":
        main: Any = lambda step: mx.array(learning_rate)  # noqa: E731
    elif scheduler == "linear":
        main = optim.linear_schedule(learning_rate, 0.0, decay_steps)
    elif scheduler == "cosine":
        main = optim.cosine_decay(learning_rate, decay_steps)
    else:
        raise ValueError(
            f"lr_scheduler must be 'constant', 'linear' or 'cosine', got {scheduler!r}"
        )
    if warmup == 0:
        return cast(Callable[[mx.array], mx.array], main)
    return optim.join_schedules([optim.linear_schedule(0.0, learning_rate, warmup), main], [warmup])


@dataclass(frozen=True)
class SchedulePlan:
    """A run's learning-rate schedule, in optimiser updates; kept in its checkpoints so that a
    resumed run can tell whether (and how) the schedule changed, and follow the same one.

    ``continued_from`` and ``continued_lr`` mark a run made longer on resume: from update
    ``continued_from`` on, ``continued_lr`` decays to 0 at ``total_steps``
    (:func:`continued_schedule`). Its checkpoints keep them, so a later resume continues that
    schedule rather than the configured one from its start."""

    learning_rate: float
    scheduler: str
    warmup_steps: int
    total_steps: int
    continued_from: int | None = None
    continued_lr: float | None = None

    def schedule(self) -> Callable[[mx.array], mx.array]:
        """The schedule (:func:`lr_schedule`, or :func:`continued_schedule` once continued)."""
        if self.continued_from is not None and self.continued_lr is not None:
            return continued_schedule(
                self.continued_lr, self.scheduler, self.continued_from, self.total_steps
            )
        return lr_schedule(self.learning_rate, self.scheduler, self.warmup_steps, self.total_steps)

    def configured(self) -> SchedulePlan:
        """The plan as the config gives it, without a continuation."""
        return dataclasses.replace(self, continued_from=None, continued_lr=None)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def resumed_plan(
    saved: Mapping[str, Any] | None, plan: SchedulePlan, step: int
) -> tuple[SchedulePlan, str | None]:
    """The schedule of a run resumed at optimiser update ``step`` whose config gives ``plan``,
    given the plan its checkpoint was written with (None: a checkpoint that recorded none), and
    what changed (None when nothing did), for the resume's warning
    (:func:`training.checkpoint.warn_changed_settings`).

    The same configuration continues exactly (a continuation recorded in the checkpoint
    included). A run whose length changed (``total_steps``, e.g. extended) continues from the
    learning rate it had reached and decays, in the plan's shape, to 0 at the new end, instead of
    restarting its schedule (a jump of the learning rate). A run extended after it finished (its
    schedule at its end, the learning rate decayed to about 0) starts a new segment instead: the
    configured ``learning_rate`` decaying to 0 at the new end. Any other change (learning rate,
    scheduler, warm-up) applies as configured.
    """
    if saved is None:
        return plan, None
    before = SchedulePlan(**saved)
    if before.configured() == plan:
        return before, None
    lr_now = float(np.asarray(before.schedule()(mx.array(step))))
    same_but_length = dataclasses.replace(before.configured(), total_steps=plan.total_steps)
    if same_but_length == plan and step >= before.total_steps and plan.total_steps > step:
        note = (
            f"the run had finished its schedule of {before.total_steps} updates (learning rate "
            f"{lr_now:.3g}) and is extended to {plan.total_steps}: a new segment starts at the "
            f"configured learning_rate {plan.learning_rate:.3g} and decays ({plan.scheduler}) to "
            f"0 at update {plan.total_steps}"
        )
        return dataclasses.replace(plan, continued_from=step, continued_lr=plan.learning_rate), note
    if same_but_length == plan:
        note = (
            f"the run was planned for {before.total_steps} updates and now for "
            f"{plan.total_steps}: the learning rate continues from {lr_now:.3g} (update {step}) "
            f"and decays ({plan.scheduler}) to 0 at update {plan.total_steps}"
        )
        return dataclasses.replace(plan, continued_from=step, continued_lr=lr_now), note
    lr_new = float(np.asarray(plan.schedule()(mx.array(step))))
    note = (
        f"the learning-rate schedule changed: at update {step} the learning rate goes from "
        f"{lr_now:.3g} to {lr_new:.3g}"
    )
    return plan, note


def continued_schedule(
    lr_now: float, scheduler: str, start: int, total_steps: int
) -> Callable[[mx.array], mx.array]:
    """From update ``start`` on, ``lr_now`` decaying to 0 at update ``total_steps`` ("linear",
    "cosine"), or staying ("constant")."""
    span = max(total_steps - start, 1)

    def schedule(step: mx.array) -> mx.array:
        x = mx.clip((step - start) / span, 0.0, 1.0)
        if scheduler == "linear":
            return lr_now * (1.0 - x)
        if scheduler == "cosine":
            return lr_now * 0.5 * (1.0 + mx.cos(math.pi * x))
        return mx.array(lr_now) * mx.ones_like(x)

    return schedule


#: ``value_and_grad(model, batch) -> ((loss, metrics), grads)``, as ``nn.value_and_grad`` makes it
#: from a ``loss_fn(model, batch) -> (loss, metrics)``.
ValueAndGrad = Callable[[nn.Module, Any], tuple[tuple[mx.array, dict[str, mx.array]], Any]]


def optimizer_step(
    model: nn.Module,
    optimizer: optim.Optimizer,
    value_and_grad: ValueAndGrad,
    micro_batches: Sequence[Any],
    weights: Sequence[float | mx.array],
    *,
    max_grad_norm: float,
    step: int,
    what: str = "the loss",
    group: Any = None,
) -> dict[str, mx.array]:
    """One optimiser update of ``model`` from gradients accumulated over ``micro_batches``.

    The gradient is ``sum_k weights[k] * grad(loss_k)`` (averaged over the ranks of ``group`` in
    a data-parallel run), clipped to global norm ``max_grad_norm`` (``inf``: no clipping). The
    weights say how each micro-batch's loss (a mean over its own targets) counts: its share of
    the batch's targets for a target-weighted mean, ``1 / n`` for a plain mean of n parts.

    Before the optimiser applies anything, the loss and the gradient norm must be finite:
    otherwise ``ValueError`` names ``what``, the ``step`` and the likely causes, and the model
    and optimiser state are untouched (so the last checkpoint and the weights in memory are
    both the state before this step).

    Returns:
        ``{"loss": ..., <each metric>: ..., "grad_norm": ...}``: weighted means as scalar arrays,
        already evaluated, as are the new weights and optimiser state.
    """
    from base_setup import distributed as dist

    if len(weights) != len(micro_batches) or not micro_batches:
        raise ValueError(
            f"optimizer_step needs one weight per micro-batch, got {len(weights)} weights for "
            f"{len(micro_batches)} micro-batches"
        )
    grads: Any = None
    totals: dict[str, mx.array] = {}
    for weight, batch in zip(weights, micro_batches):
        (loss, metrics), g = value_and_grad(model, batch)
        if not (isinstance(weight, float) and weight == 1.0):
            g = tree_map(lambda x: x * weight, g)
        grads = g if grads is None else tree_map(mx.add, grads, g)
        for key, value in {"loss": loss, **metrics}.items():
            totals[key] = totals[key] + weight * value if key in totals else weight * value
    # Only ``grads`` may hold the gradients from here: the update frees each group's as it goes
    # (a name left holding the last micro-batch's would keep them all to the end).
    del g
    grads = dist.average_gradients(grads, group)
    # The gradients on their own first: evaluated only as inputs of the norm, MLX orders the
    # backward pass so that far more of it is alive at once (a higher peak memory).
    mx.eval(totals["loss"], grads)
    grads, grad_norm = optim.clip_grad_norm(grads, max_grad_norm)
    mx.eval(grad_norm)
    loss_value, norm_value = _to_float(totals["loss"]), _to_float(grad_norm)
    if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
        raise ValueError(
            f"{what} is {loss_value} with gradient norm {norm_value} at step {step}; no update "
            "was made. Likely causes: rewards or scores too large (scale or clip them), a "
            "learning rate too high (lower learning_rate, add warmup_steps), or a model in "
            "float16 overflowing (use bfloat16 or float32)"
        )
    optimizer.update(model, grads)
    del grads
    # The new weights (and with each its optimiser state: one compiled update makes both) a
    # group of parameters at a time. Evaluated in one go, MLX would run each operation of the
    # update for every parameter before the next one, holding the clipped gradients and the new
    # weights and moments of the whole model beside the old ones; a group at a time, one
    # group's. Same values.
    new_weights = cast(list[tuple[str, mx.array]], tree_flatten(model.trainable_parameters()))
    evaluate_in_groups(largest_last([w for _, w in new_weights]), UPDATE_GROUP_BYTES)
    mx.eval(optimizer.state, totals)
    totals["grad_norm"] = grad_norm
    drop_read_weights()  # a frozen model kept on disk (a teacher in the loss) lets go of it
    release_cached_buffers()  # the end of a phase (base_setup.backend.setup_cpu_buffer_cache)
    return totals


#: About how many bytes of parameters :func:`optimizer_step` updates per evaluation.
UPDATE_GROUP_BYTES = 64 << 20


def largest_last(arrays: Sequence[mx.array]) -> list[mx.array]:
    """``arrays`` by size, smallest first (ties in their order): the order in which
    :func:`optimizer_step` evaluates the new weights.

    Each group's evaluation frees that group's gradients, and a parameter's update holds its
    new weight and moments beside the old ones. Updated last, the largest parameter (an
    embedding, a group of its own) finds every other gradient already freed; updated first, as
    a model's parameters are listed, it found all of them alive: at Qwen3-0.6B's full-weight
    value model that made the PPO update's peak (docs/performance.md).
    """
    return sorted(arrays, key=lambda a: a.nbytes)


def _to_float(x: mx.array) -> float:
    """A scalar array as a Python float (a host sync)."""
    return float(x.astype(mx.float32).item())  # type: ignore[arg-type]
