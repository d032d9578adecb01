"""A training step's loss and gradient as one compiled function, on the CPU, for large models.

Why: under ``nn.value_and_grad`` every activation is a tracer, and MLX runs a compiled function
on tracer inputs as its original graph. So inside a gradient the fast CPU functions
(``base_setup/fast_math.py``) run as many separate element-wise passes, and the updates run
MLX's own functions instead (``fast_math.mlx_math_scope``). MLX's ``exp``, ``sigmoid`` and
softmax on Linux run element by element through scalar library calls on one thread, and at real
shapes they are most of a training step's time (docs/performance.md). Compiling the whole loss and gradient (``mx.compile`` with the model's
state and the random state as implicit inputs and outputs) fuses them: the fast functions'
arithmetic becomes kernels the system compiler vectorizes.

What it costs:

* A trace for each new batch shape.
* The kernels, built once per machine by the system C++ compiler the first time a model's
  graph is compiled (a few dozen, one compiler run each). MLX keeps them in its cache folder
  under the temporary directory.
* Inside the trace, the frozen LM head's vocabulary blocks have :data:`BLOCK_ROWS` rows whatever
  the batch shape (``token_attribution.head_logprobs.fixed_block_rows``), so the kernels' sources
  do not depend on it.

Results agree with the eager gradient's within float32 rounding: the fast ``exp`` is not MLX's,
and the head's blocks split the vocabulary differently. A batch that is not a dataclass of
arrays takes the eager gradient.

When (:func:`use_compiled_gradient`), set by ``PPO_MLX_COMPILED_GRADIENT``:

* ``auto`` (the default): the fast CPU math is on (``fast_math.fast_math_enabled``: MLX's CPU
  device, a C++ compiler, no plain MLX), and the model has at least :data:`MIN_PARAMETERS`
  parameters. Small models, this project's test and golden models among them, keep the eager
  gradient: there the kernels' one-time build costs more than the run saves.
* ``1``: whenever the fast CPU math is on.
* ``0``: never.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import fields, is_dataclass
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from base_setup import fast_math
from base_setup.backend import parameter_count
from base_setup.plain import env_mode
from token_attribution.head_logprobs import fixed_block_rows

ENV = "PPO_MLX_COMPILED_GRADIENT"
_MODES = {"auto": "auto", "1": "on", "on": "on", "0": "off", "off": "off"}
#: Parameters from which ``auto`` compiles a model's gradient: SmolLM2-135M's size is well
#: above; the test models (a few million) are below.
MIN_PARAMETERS = 50_000_000
#: Vocabulary rows per LM-head block inside a compiled gradient.
BLOCK_ROWS = 1024
#: Token columns that the supervised stages round their batches' widths up to when their
#: gradient is compiled (``pad_to_multiple_of``): every new batch shape is a new trace, which
#: costs a fraction of a step and keeps its graph in memory (docs/performance.md), so an SFT run
#: with max_length 1024 meets at most 32 of them, for at most 31 padding columns per batch.
WIDTH_MULTIPLE = 32

#: ``value_and_grad(model, batch) -> ((loss, metrics), gradients)``, as
#: ``training.optimizer.optimizer_step`` calls it.
GradientFn = Callable[[nn.Module, Any], Any]


def compiled_gradient_mode() -> str:
    """``PPO_MLX_COMPILED_GRADIENT``: "auto" (the default), "on" ("1") or "off" ("0")."""
    return env_mode(ENV, _MODES, "auto, 1 or 0")


def use_compiled_gradient(model: nn.Module) -> bool:
    """Whether ``model``'s training steps take the compiled gradient (the module doc's rule)."""
    mode = compiled_gradient_mode()
    if mode == "off" or not fast_math.fast_math_enabled():
        return False
    return mode == "on" or parameter_count(model) >= MIN_PARAMETERS


def is_array_batch(batch: Any) -> bool:
    """Whether ``batch`` is a dataclass instance whose fields are arrays or None."""
    if not is_dataclass(batch) or isinstance(batch, type):
        return False
    return all(
        value is None or isinstance(value, mx.array)
        for value in (getattr(batch, f.name) for f in fields(batch))
    )


class EagerGradient:
    """A model's gradient as ``nn.value_and_grad`` traces it, with MLX's own functions (the
    fast ones, traced, cost more than they save)."""

    def __init__(self, value_and_grad: GradientFn) -> None:
        self.value_and_grad = value_and_grad

    def __call__(self, model: nn.Module, batch: Any) -> Any:
        """``((loss, metrics), gradients)`` of ``batch``."""
        with fast_math.mlx_math_scope():
            return self.value_and_grad(model, batch)


class CompiledGradient:
    """``model``'s gradient (``value_and_grad``, from ``nn.value_and_grad``) compiled whole,
    one compiled function per batch class and training mode; the fast CPU functions run fused
    inside (outside any ``fast_math.mlx_math_scope``). Another model, or a batch that is not a
    dataclass of arrays, gets the :class:`EagerGradient`."""

    def __init__(self, model: nn.Module, value_and_grad: GradientFn) -> None:
        self.model = model
        self.eager = EagerGradient(value_and_grad)
        self.value_and_grad = value_and_grad
        self._compiled: dict[tuple[type, bool], Callable[[dict[str, mx.array]], Any]] = {}

    def __call__(self, model: nn.Module, batch: Any) -> Any:
        """``((loss, metrics), gradients)`` of ``batch``."""
        if model is not self.model or not is_array_batch(batch):
            return self.eager(model, batch)
        key = (type(batch), bool(model.training))
        if key not in self._compiled:
            self._compiled[key] = self._compile(type(batch))
        arrays = {f.name: getattr(batch, f.name) for f in fields(batch)}
        return self._compiled[key]({k: v for k, v in arrays.items() if v is not None})

    def _compile(self, kind: type) -> Callable[[dict[str, mx.array]], Any]:
        """The compiled gradient of batches of class ``kind``, from their arrays by field."""
        output_head = getattr(self.model, "output_head", None)
        if callable(output_head):
            output_head()  # its one-time check (models.policy_model.lm_head) evaluates arrays

        def traced(arrays: dict[str, mx.array]) -> Any:
            with fixed_block_rows(BLOCK_ROWS):
                return self.value_and_grad(self.model, kind(**arrays))

        state = [self.model.state, mx.random.state]
        return mx.compile(traced, inputs=state, outputs=state)


def batch_width_multiple(gradient: GradientFn) -> int | None:
    """What a batch's width should be a multiple of for ``gradient`` (``pad_to_multiple_of``):
    :data:`WIDTH_MULTIPLE` for a :class:`CompiledGradient` (each new width is a new trace),
    None (any width) otherwise."""
    return WIDTH_MULTIPLE if isinstance(gradient, CompiledGradient) else None


def gradient_arithmetic(gradient: GradientFn) -> AbstractContextManager[None]:
    """A scope for passes outside ``gradient`` whose results are compared with its (a DPO
    reference's log-probs against the policy's): inside it they take the same functions (MLX's
    own for an :class:`EagerGradient`) and the same LM-head blocks (:data:`BLOCK_ROWS` for a
    :class:`CompiledGradient`), so that equal weights give equal log-probs."""
    if isinstance(gradient, CompiledGradient):
        return fixed_block_rows(BLOCK_ROWS)
    if isinstance(gradient, EagerGradient):
        return fast_math.mlx_math_scope()
    return nullcontext()


def training_gradient(model: nn.Module, loss: Callable[..., Any]) -> GradientFn:
    """``model``'s gradient of ``loss(model, batch)`` for the optimiser step: compiled where
    :func:`use_compiled_gradient` says so, else eager."""
    value_and_grad = nn.value_and_grad(model, loss)
    if use_compiled_gradient(model):
        return CompiledGradient(model, value_and_grad)
    return EagerGradient(value_and_grad)
