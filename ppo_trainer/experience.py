"""Phases 3-4 of an iteration: from a rollout to what the update learns from.

:func:`make_experience` turns scores and log-probs into per-token KL, per-token rewards and
advantages (GAE with a value model for PPO; group-relative for GRPO), with the math of the stage
folders (``reward_kl/``, ``advantage/``). Whitening and group statistics use the global batch of a
data-parallel run (``group``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from advantage.gae_advantage import compute_gae
from advantage.group_advantage import group_advantages
from advantage.whitening import masked_whiten
from config.ppo_config import Algorithm, GRPOAdvantageScale, KLEstimator
from experience_buffer.buffer import RolloutBatch
from ppo_trainer.rollout import Rollout
from reward_kl.kl_divergence import kl_estimate
from reward_kl.reward_computer import apply_missing_eos_penalty, per_token_rewards


@dataclass(frozen=True)
class ExperienceSettings:
    """The algorithm's choices that shape rewards and advantages (see ``PPOConfig``)."""

    algorithm: Algorithm
    kl_estimator: KLEstimator
    gamma: float
    lam: float
    whiten_rewards: bool
    whiten_advantages: bool
    group_size: int
    beta: float
    grpo_advantage_scale: GRPOAdvantageScale
    missing_eos_penalty: float | None

    @classmethod
    def from_config(cls, config: Any) -> ExperienceSettings:
        """The settings of a ``PPOConfig``."""
        return cls(
            algorithm=config.algorithm,
            kl_estimator=config.kl_estimator,
            gamma=config.gamma,
            lam=config.lam,
            whiten_rewards=config.whiten_rewards,
            whiten_advantages=config.whiten_advantages,
            group_size=config.group_size,
            beta=config.beta,
            grpo_advantage_scale=config.grpo_advantage_scale,
            missing_eos_penalty=config.missing_eos_penalty,
        )


def kl_per_token(rollout: Rollout, settings: ExperienceSettings) -> mx.array:
    """The per-token KL to the reference the algorithm penalises, (B, T), 0 after each response:
    GRPO's k3 (the term of its loss), else PPO's ``kl_estimator``. Training and evaluation both
    report its sum over a response as ``objective/kl`` / ``eval/kl``."""
    estimator: KLEstimator = "k3" if settings.algorithm == "grpo" else settings.kl_estimator
    return kl_estimate(rollout.logprobs, rollout.ref_logprobs, estimator) * rollout.mask


def make_experience(
    rollout: Rollout,
    settings: ExperienceSettings,
    kl_coef: float,
    *,
    step: int,
    group: Any = None,
) -> tuple[RolloutBatch, dict[str, mx.array]]:
    """The rollout batch the update learns from, and per-token statistics for the metrics.

    * scores: minus ``missing_eos_penalty`` for responses without a stop token;
    * PPO: ``kl = kl_estimate(logprobs, ref_logprobs)`` per token; rewards ``-kl_coef * kl`` per
      token plus the score at the last token (optionally whitened); GAE advantages and returns
      over the values (advantages optionally whitened over the batch);
    * GRPO: the k3 KL per token (the loss's penalty, weighted by ``beta``); the scores'
      group-relative advantages.

    Returns:
        ``(batch, stats)`` with ``stats``: ``kl`` (B, T), ``non_score`` (B, T) the KL part of the
        reward, and ``rewards`` (B, T) the per-token rewards (before any whitening; for GRPO the
        score minus ``beta * kl``, what its loss optimises).

    Raises:
        ValueError: the rewards or advantages are not finite (scores too large to whiten or to
            regress on), naming ``step``: no update is made from them.
    """
    r = rollout
    scores = r.scores
    if settings.missing_eos_penalty is not None:
        scores = apply_missing_eos_penalty(
            scores, r.generation.ended_with_stop, settings.missing_eos_penalty
        )
    returns = None
    kl = kl_per_token(r, settings)  # (B, T)
    if settings.algorithm == "grpo":
        advantages = group_advantages(
            scores, settings.group_size, settings.grpo_advantage_scale, group=group
        )  # (B,)
        # GRPO's loss penalises beta * kl; as per-token rewards (for the records), that reads
        # score at the last token minus beta * kl.
        rewards, non_score = per_token_rewards(scores, kl, r.mask, settings.beta)
        stats = {"kl": kl, "non_score": non_score, "rewards": rewards}
    else:
        assert r.values is not None, "PPO needs the rollout's values"
        rewards, non_score = per_token_rewards(scores, kl, r.mask, kl_coef)  # (B, T) each
        stats = {"kl": kl, "non_score": non_score, "rewards": rewards}  # before whitening
        if settings.whiten_rewards:
            rewards = masked_whiten(rewards, r.mask, shift_mean=False, group=group)
        advantages, returns = compute_gae(rewards, r.values, r.mask, settings.gamma, settings.lam)
        if settings.whiten_advantages:
            advantages = masked_whiten(advantages, r.mask, group=group)
    batch = RolloutBatch(
        query_responses=r.query_responses,
        prompt_lengths=r.prompt_lengths,
        responses=r.generation.responses,
        mask=r.mask,
        logprobs=r.logprobs,
        ref_logprobs=r.ref_logprobs,
        scores=scores,
        advantages=advantages,
        values=r.values,
        returns=returns,
    )
    mx.eval(batch.advantages, batch.returns, stats)
    _check_finite(batch, step)
    return batch, stats


def _check_finite(batch: RolloutBatch, step: int) -> None:
    for name in ("advantages", "returns"):
        value = getattr(batch, name)
        if name == "returns" and value is not None:
            value = mx.square(value)  # the value loss squares them: they must stay finite too
        if value is not None and not bool(mx.all(mx.isfinite(value)).item()):
            largest = float(np.abs(np.asarray(batch.scores)).max())
            raise ValueError(
                f"the {name} of step {step} are not finite (the largest |score| is "
                f"{largest:.3g}): the scores are too large for float32 arithmetic. Scale or clip "
                "the reward (e.g. into [-10, 10]); no update was made from this batch"
            )
