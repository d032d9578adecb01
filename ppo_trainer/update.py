"""Phase 5 of an iteration: ``num_ppo_epochs`` passes over shuffled minibatches of the rollout.

Each minibatch (split into ``gradient_accumulation_steps`` micro-batches) gets one optimiser step
of the policy (clipped PPO, or GRPO's loss) and, for PPO, one of the value model (clipped value
loss), through the one optimiser step every trainer shares
(:func:`training.optimizer.optimizer_step`). The losses call the models inside the
differentiated functions; every other input is a rollout constant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from base_setup import distributed as dist
from experience_buffer.buffer import RolloutBatch, iterate_minibatches, split_micro_batches
from token_attribution.sequences import gather_positions, response_positions, token_logprobs
from training.optimizer import ValueAndGrad, optimizer_step
from training.policy_loss import grpo_policy_loss, ppo_policy_loss
from training.value_loss import clipped_value_loss

LossFn = Callable[[nn.Module, RolloutBatch], tuple[mx.array, dict[str, mx.array]]]


def policy_loss_fn(config: Any) -> LossFn:
    """``loss(policy, minibatch) -> (loss, metrics)``: PPO's clipped surrogate, or GRPO's loss
    with its k3 KL term, at the sampling temperature."""

    def loss(policy: nn.Module, mb: RolloutBatch) -> tuple[mx.array, dict[str, mx.array]]:
        # The model call is inside the differentiated function; every mb.* array is a rollout
        # constant (old log-probs, reference log-probs, advantages): no gradient flows into them.
        positions = response_positions(mb.prompt_lengths, mb.responses.shape[1])  # (b, T)
        logprobs, _ = token_logprobs(
            policy.logits_at(mb.query_responses, positions), mb.responses, config.temperature
        )
        if config.algorithm == "grpo":
            return grpo_policy_loss(
                logprobs,
                mb.logprobs,
                mb.ref_logprobs,
                mb.advantages,
                mb.mask,
                config.clip_epsilon,
                config.beta,
            )
        return ppo_policy_loss(logprobs, mb.logprobs, mb.advantages, mb.mask, config.clip_epsilon)

    return loss


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
    """One trained model: its optimiser, the gradient of its loss, and its metric prefix
    ("policy" or "val")."""

    model: nn.Module
    optimizer: optim.Optimizer
    value_and_grad: ValueAndGrad
    prefix: str


def token_weights(micro_batches: list[RolloutBatch], group: Any) -> list[float | mx.array]:
    """Each micro-batch's gradient weight: ``1 / n`` on one process.

    In a data-parallel run the losses are means over the action tokens of a micro-batch, and
    ranks hold different numbers of them: a plain mean of the ranks' gradients would weigh a
    token more on a rank with few. With ``w_k = N c_k / sum_r c_{r,k} / n`` (``c_k``: this rank's
    action tokens in micro-batch ``k``), ``sum_r w_{r,k} g_{r,k} / N`` is the gradient of the
    token mean over the union of the ranks' ``k``-th micro-batches, what one process computes
    on that global micro-batch.
    """
    n = len(micro_batches)
    world = group.size() if group is not None else 1
    if world == 1:
        return [1.0 / n] * n
    counts = mx.stack([(mb.mask != 0).sum().astype(mx.float32) for mb in micro_batches])  # (n,)
    weights = world * counts / dist.all_sum(counts, group) / n  # (n,)
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
            weights = token_weights(micro, group)
            metrics: dict[str, mx.array] = {}
            for learner in learners:
                out = optimizer_step(
                    learner.model,
                    learner.optimizer,
                    learner.value_and_grad,
                    micro,
                    weights,
                    max_grad_norm=max_grad_norm,
                    step=step,
                    what="the policy loss" if learner.prefix == "policy" else "the value loss",
                    group=group,
                )
                loss_key = "loss/policy" if learner.prefix == "policy" else "loss/value"
                metrics[loss_key] = out.pop("loss")  # TRL's names
                metrics.update({f"{learner.prefix}/{k}": v for k, v in out.items()})
            step_metrics.append(metrics)
    return step_metrics
