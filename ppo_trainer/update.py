"""Phase 5 of an iteration: ``num_ppo_epochs`` passes over shuffled minibatches of the rollout.

Each minibatch (split into ``gradient_accumulation_steps`` micro-batches) gets one optimiser step
of the value model (PPO: clipped value loss) and one of the policy (PPO's or REINFORCE++'s clipped
surrogate, GRPO's loss, RLOO's sequence loss), through the one optimiser step every trainer shares
(:func:`training.optimizer.optimizer_step`). The losses call the models inside the
differentiated functions; every other input is a rollout constant. With ``sft_coef`` the
policy's update also takes one batch of SFT examples (an extra micro-batch of weight 1 whose
loss is ``sft_coef * NLL``).
"""

from __future__ import annotations


import logging
from dataclasses import dataclass
from typing import Any, Callable, cast

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from algorithms.base import PolicyLoss
from base_setup import fast_math
from algorithms.registry import get_algorithm
from base_setup import distributed as dist
from experience_buffer.buffer import RolloutBatch, iterate_minibatches, split_micro_batches
from finetune.sft_trainer import sft_loss
from finetune.tokenize import SFTBatch
from ppo_trainer.components import RunModels
from ppo_trainer.gkd import check_split_heads, gkd_policy_loss
from ppo_trainer.run_state import RunState
from ppo_trainer.sft_mix import load_sft_mix
from token_attribution.sequences import (
    ScoringModel,
    gather_positions,
    next_token_scores,
    response_logprobs,
    response_positions,
)
from token_attribution.token_weights import (
    has_think_tags,
    response_region_weights,
    think_tag_ids,
    top_entropy_mask,
)
from training.compiled_gradient import (
    CompiledGradient,
    batch_width_multiple,
    training_gradient,
)
from training.optimizer import ValueAndGrad, optimizer_step
from config.ppo_config import LossType
from training.policy_loss import (
    entropy_bonus,
    grpo_policy_loss,
    micro_batch_weights,
    ppo_policy_loss,
    rloo_policy_loss,
)
from training.value_loss import clipped_value_loss

logger = logging.getLogger("ppo_mlx")

LossFn = Callable[[nn.Module, RolloutBatch], tuple[mx.array, dict[str, mx.array]]]
PolicyLossFn = Callable[[nn.Module, RolloutBatch | SFTBatch], tuple[mx.array, dict[str, mx.array]]]
ThinkTags = tuple[list[int], list[int]]


def think_tags_for(config: Any, tokenizer: Any) -> ThinkTags | None:
    """The ``<think>`` / ``</think>`` token ids the region weights need (None when
    ``think_loss_weight`` and ``answer_loss_weight`` are both 1: no regions).

    Raises:
        ValueError: a weight other than 1 for a model with no think tag in its vocabulary, chat
            template or ``system_prompt`` (the regions could never be found).
    """
    if config.think_loss_weight == 1.0 and config.answer_loss_weight == 1.0:
        return None
    if config.think_loss_weight == 0.0 and config.answer_loss_weight == 0.0:
        logger.warning(
            "think_loss_weight and answer_loss_weight are both 0: they weigh every response "
            "token 0 in the policy loss, so the rewards train nothing (only sft_coef and "
            "entropy_coef terms move the policy): set one of them above 0"
        )
    if not has_think_tags(tokenizer, config.system_prompt):
        raise ValueError(
            f"think_loss_weight={config.think_loss_weight} and answer_loss_weight="
            f"{config.answer_loss_weight} weigh the tokens inside and after <think> ... "
            "</think>, but this model's vocabulary has no <think> token and neither its chat "
            "template nor system_prompt writes <think>: use a thinking model (Qwen3, an R1 "
            "distill), ask for the tags in system_prompt, or set both weights to 1.0"
        )
    return think_tag_ids(tokenizer)


def policy_loss_fn(
    config: Any, think_tags: ThinkTags | None = None, teacher: ScoringModel | None = None
) -> PolicyLossFn:
    """``loss(policy, minibatch) -> (loss, metrics)`` at the sampling temperature: the
    algorithm's ``policy_loss`` (:data:`algorithms.base.PolicyLoss`): the clipped surrogate on
    token advantages (PPO, REINFORCE++), GRPO's loss with its k3 KL term and its ``loss_type`` /
    ``importance_sampling_level``, RLOO's clipped sequence loss, or GKD's divergence to
    ``teacher`` over the vocabulary (:func:`ppo_trainer.gkd.gkd_policy_loss`); each with the
    upper clip ``clip_epsilon_high`` when set, the per-token weights of the think / answer
    regions (``think_tags`` from :func:`think_tags_for`) and of ``top_entropy_quantile``, and the
    entropy bonus when ``entropy_coef`` > 0. An :class:`SFTBatch` (``sft_coef``) gets
    ``sft_coef * NLL`` of its completions (:func:`finetune.sft_trainer.sft_loss`, temperature
    1), with ``policy/sft_loss`` = NLL."""
    kind = get_algorithm(config.algorithm).policy_loss
    if kind == "gkd":
        if teacher is None:
            raise ValueError("GKD's loss compares the student with its teacher: pass teacher=")
        check_split_heads({"teacher": teacher})  # the student's, at its first update

    def loss(
        policy: nn.Module, mb: RolloutBatch | SFTBatch
    ) -> tuple[mx.array, dict[str, mx.array]]:
        if isinstance(mb, SFTBatch):
            scores = next_token_scores(policy, mb.input_ids)  # (b, L-1) each
            nll, _ = sft_loss(scores.logprobs, scores.top, mb.loss_mask[:, 1:])
            return config.sft_coef * nll, {"sft_loss": nll}
        if kind == "gkd":  # the models are called inside: the teacher's outputs are constants
            assert teacher is not None
            return gkd_policy_loss(
                cast(ScoringModel, policy),
                teacher,
                mb,
                beta=config.beta,
                temperature=config.temperature,
                cliprange=config.clip_epsilon,
                cliprange_high=config.clip_epsilon_high,
            )
        # The model call is inside the differentiated function; every mb.* array is a rollout
        # constant (old log-probs, reference log-probs, advantages): no gradient flows into them.
        positions = response_positions(mb.prompt_lengths, mb.responses.shape[1])  # (b, T)
        bonus = config.entropy_coef > 0
        by_entropy = config.top_entropy_quantile < 1.0
        logprobs, entropy = response_logprobs(
            policy,
            mb.query_responses,
            positions,
            mb.responses,
            config.temperature,
            with_entropy=bonus or by_entropy,
            entropy_gradient=bonus,  # the bonus trains through it; a mask by entropy does not
        )
        weights = token_weights(config, think_tags, mb, entropy if by_entropy else None)
        loss, metrics = algorithm_loss(config, kind, logprobs, mb, weights)
        if bonus:
            assert entropy is not None
            return entropy_bonus(loss, metrics, entropy, mb.mask, config.entropy_coef)
        return loss, metrics

    return loss


def algorithm_loss(
    config: Any, kind: PolicyLoss, logprobs: mx.array, mb: RolloutBatch, weights: mx.array | None
) -> tuple[mx.array, dict[str, mx.array]]:
    """The algorithm's policy loss (``kind``, :data:`algorithms.base.PolicyLoss`) of a
    minibatch's ``logprobs`` (B, T), differentiated, against its rollout constants, with the
    per-token ``weights`` (B, T) (None: 1)."""
    high = config.clip_epsilon_high
    if kind == "grpo":
        return grpo_policy_loss(
            logprobs,
            mb.logprobs,
            mb.ref_logprobs,
            mb.advantages,
            mb.mask,
            config.clip_epsilon,
            config.beta,
            cliprange_high=high,
            loss_type=config.loss_type,
            importance_sampling_level=config.importance_sampling_level,
            max_completion_length=config.max_new_tokens,
            weights=weights,
        )
    if kind == "sequence":
        return rloo_policy_loss(
            logprobs,
            mb.logprobs,
            mb.advantages,
            mb.mask,
            config.clip_epsilon,
            cliprange_high=high,
            weights=weights,
        )
    return ppo_policy_loss(
        logprobs,
        mb.logprobs,
        mb.advantages,
        mb.mask,
        config.clip_epsilon,
        cliprange_high=high,
        weights=weights,
    )


def token_weights(
    config: Any, think_tags: ThinkTags | None, mb: RolloutBatch, entropy: mx.array | None
) -> mx.array | None:
    """(B, T) per-token loss weights, constants: the think / answer regions' (``think_tags``)
    times the ``top_entropy_quantile`` mask of ``entropy`` (None: not by entropy); None = 1."""
    weights = None
    if think_tags is not None:
        weights = response_region_weights(
            mb.query_responses,
            mb.prompt_lengths,
            mb.responses.shape[1],
            think_tags,
            config.think_loss_weight,
            config.answer_loss_weight,
        )
    if entropy is not None:
        keep = top_entropy_mask(entropy, mb.mask, config.top_entropy_quantile)  # (B, T)
        weights = keep if weights is None else weights * keep
    return weights


def policy_weighting(config: Any) -> LossType:
    """How the policy loss's micro-batches are weighted in an update
    (:func:`training.policy_loss.micro_batch_weights`), by the algorithm's ``policy_loss``:
    GRPO's ``loss_type``; RLOO's sequence mean as ``"grpo"``; the token means of PPO and
    REINFORCE++ as ``"bnpo"``."""
    kind = get_algorithm(config.algorithm).policy_loss
    if kind == "grpo":
        return cast(LossType, config.loss_type)
    return "grpo" if kind == "sequence" else "bnpo"


def value_loss_fn(config: Any) -> LossFn:
    """``loss(value_model, minibatch) -> (vf_coef * clipped value loss, metrics)``."""

    def loss(value_model: nn.Module, mb: RolloutBatch) -> tuple[mx.array, dict[str, mx.array]]:
        assert mb.values is not None and mb.returns is not None
        positions = response_positions(mb.prompt_lengths, mb.responses.shape[1])
        vpred = gather_positions(value_model(mb.query_responses), positions)  # (b, T)
        # mb.values (rollout values) and mb.returns (GAE targets) are constants.
        value, metrics = clipped_value_loss(
            vpred, mb.values, mb.returns, mb.mask, config.cliprange_value
        )
        return config.vf_coef * value, metrics

    return loss


@dataclass
class Learner:
    """One trained model: its optimiser, the gradient of its loss, its metric prefix ("policy"
    or "val"), how its micro-batches are weighted (a token mean is ``"bnpo"``), and
    ``extra_batch``: None, or a function that gives each update one more micro-batch, of weight
    1 (the policy's SFT batch, ``sft_coef``)."""

    model: nn.Module
    optimizer: optim.Optimizer
    value_and_grad: ValueAndGrad
    prefix: str
    weighting: LossType = "bnpo"
    extra_batch: Callable[[], Any] | None = None


def update_weights(
    micro_batches: list[RolloutBatch], weighting: LossType, group: Any
) -> list[float | mx.array]:
    """Each micro-batch's gradient weight in one update, so that the accumulated (and, in a
    data-parallel run, rank-averaged) gradient is that of the whole update's loss
    (:func:`training.policy_loss.micro_batch_weights`; on one process with a token-mean loss,
    ``1 / n``). Ranks hold different numbers of action tokens, so the token counts are
    all-reduced: the update is the one a single process would make on the global batch."""
    n = len(micro_batches)
    world = group.size() if group is not None else 1
    if world == 1 and weighting in ("bnpo", "grpo", "dr_grpo"):
        return [1.0 / n] * n  # no host sync: the common case
    counts = mx.stack([(mb.mask != 0).sum().astype(mx.float32) for mb in micro_batches])  # (n,)
    totals = dist.all_sum(counts, group) if world > 1 else None
    weights = micro_batch_weights(weighting, counts, totals, world)  # (n,)
    return [weights[k] for k in range(n)]


def ppo_epochs(
    batch: RolloutBatch,
    learners: list[Learner],
    *,
    num_ppo_epochs: int,
    num_mini_batches: int,
    gradient_accumulation_steps: int,
    max_grad_norm: float,
    rng: np.random.Generator,
    step: int,
    group: Any = None,
) -> list[dict[str, mx.array]]:
    """Phase 5: the optimiser steps of one iteration; returns each minibatch's metrics
    (``loss/policy``, ``policy/clipfrac``, ..., ``loss/value``, ``val/...``), evaluated.

    ``rng`` orders the minibatches (a resumed run restores it from ``(seed, step)``).
    """
    step_metrics: list[dict[str, mx.array]] = []
    for _ in range(num_ppo_epochs):
        for minibatch in iterate_minibatches(batch, num_mini_batches, rng):
            micro = split_micro_batches(minibatch, gradient_accumulation_steps)
            metrics: dict[str, mx.array] = {}
            for learner in learners:
                batches: list[Any] = list(micro)
                weights = update_weights(micro, learner.weighting, group)
                if learner.extra_batch is not None:  # its loss adds to the minibatch's
                    batches.append(learner.extra_batch())
                    weights.append(1.0)
                out = optimizer_step(
                    learner.model,
                    learner.optimizer,
                    learner.value_and_grad,
                    batches,
                    weights,
                    max_grad_norm=max_grad_norm,
                    step=step,
                    what="the policy loss" if learner.prefix == "policy" else "the value loss",
                    group=group,
                )
                loss_key = "loss/policy" if learner.prefix == "policy" else "loss/value"
                metrics[loss_key] = out.pop("loss")  # TRL's names
                for key, value in out.items():  # TRL logs clip_ratio/* without a prefix
                    metrics[key if key.startswith("clip_ratio/") else f"{learner.prefix}/{key}"] = (
                        value
                    )
            step_metrics.append(metrics)
    return step_metrics


class Updater:
    """Phase 5 of a run, built once: the gradients of the policy's loss and (with a value model)
    of the value loss, and the SFT examples mixed into the policy's updates (``sft_coef``).

    Building it checks, before any rollout, the think tags the region weights need
    (:func:`think_tags_for`) and loads the SFT data (:func:`~ppo_trainer.sft_mix.load_sft_mix`).
    """

    def __init__(self, config: Any, models: RunModels) -> None:
        self.config = config
        policy, value_model = models.policy, models.value_model
        self.policy, self.value_model = policy, value_model
        think_tags = think_tags_for(config, models.tokenizer)
        # GKD's loss reads the teacher (the run's reference) inside the differentiated function.
        loss = policy_loss_fn(config, think_tags, models.ref_model)
        # Each gradient compiled whole for a large model on the CPU, else eager with MLX's
        # own functions (training/compiled_gradient.py).
        self.policy_grad = training_gradient(policy, loss)
        #: The SFT examples mixed into the policy's updates (sft_coef), with their cursor; in
        #: a few widths when compiled (each new width is a new trace).
        self.sft_mix = load_sft_mix(
            config, models.tokenizer, batch_width_multiple(self.policy_grad)
        )
        self.value_grad = (
            training_gradient(value_model, value_loss_fn(config))
            if value_model is not None
            else None
        )

    @property
    def compiled(self) -> bool:
        """Whether a gradient of the update is compiled whole."""
        return any(isinstance(g, CompiledGradient) for g in (self.policy_grad, self.value_grad))

    def learners(self, run: RunState) -> list[Learner]:
        """The value model (PPO), then the policy: the models are independent, and a value loss
        that overflows (huge rewards) then stops the step before the policy has moved. During
        the first ``value_warmup_steps`` steps, the value model alone."""
        assert run.policy_optimizer is not None
        learners = [
            Learner(
                self.policy,
                run.policy_optimizer,
                self.policy_grad,
                "policy",
                policy_weighting(self.config),
                self.sft_mix.next_batch if self.sft_mix is not None else None,
            )
        ]
        if self.value_model is not None:
            assert run.value_optimizer is not None and self.value_grad is not None
            value = Learner(self.value_model, run.value_optimizer, self.value_grad, "val")
            if run.global_step < self.config.value_warmup_steps:
                return [value]
            learners.insert(0, value)
        return learners

    def update(
        self, batch: RolloutBatch, run: RunState, step: int, group: Any = None
    ) -> list[dict[str, mx.array]]:
        """Phase 5 of step ``step``: the PPO epochs of its learners (:meth:`learners`), in an
        order that is a function of seed and step; the run counts as updating meanwhile (a
        failure then does not save a half-updated state)."""
        run.updating = True
        # MLX's own functions: traced for the gradient, the fast ones cost more than they save
        # (MLX runs a compiled function's original graph on tracer inputs: ~20 element-wise
        # passes; docs/performance.md, "What stands in the way"), unless a gradient is
        # compiled whole (training/compiled_gradient.py).
        with fast_math.mlx_math_scope(not self.compiled):
            update_metrics = self._epochs(batch, run, step, group)
        run.updating = False
        return update_metrics

    def _epochs(
        self, batch: RolloutBatch, run: RunState, step: int, group: Any
    ) -> list[dict[str, mx.array]]:
        """:func:`ppo_epochs` over ``batch`` with the run's learners and settings."""
        cfg = self.config
        return ppo_epochs(
            batch,
            self.learners(run),
            num_ppo_epochs=cfg.num_ppo_epochs,
            num_mini_batches=cfg.num_mini_batches,
            gradient_accumulation_steps=cfg.gradient_accumulation_steps,
            max_grad_norm=cfg.max_grad_norm,
            rng=np.random.default_rng([cfg.seed, run.global_step, 1]),
            step=step,
            group=group,
        )
