"""Phases 3-4 of an iteration: from a rollout to what the update learns from.

:func:`make_experience` turns scores and log-probs into per-token KL and per-token rewards
(``reward_kl/``), then asks the run's algorithm (:mod:`algorithms`) for the advantages (GAE with
a value model for PPO; group-relative for GRPO; leave-one-out for RLOO; whitened returns for
REINFORCE++), which it makes with the math of ``advantage/``. Whitening and group statistics use the global batch of a
data-parallel run (``group``).
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from algorithms.base import AdvantageInputs, AlgorithmMetrics
from algorithms.registry import get_algorithm
from config.ppo_config import Algorithm, GRPOAdvantageScale, KLEstimator
from experience_buffer.buffer import RolloutBatch
from ppo_trainer.rollout import Rollout
from reward_kl.kl_divergence import kl_estimate
from reward_kl.reward_normalization import RunningMoments, normalize_scores, update_moments
from reward_kl.reward_computer import (
    add_action_rewards,
    apply_missing_eos_penalty,
    per_token_rewards,
)
from token_attribution.extractor import mask_truncated_completions


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
    mask_truncated_completions: bool = False
    loss_type: str = "bnpo"
    reward_coef: float = 1.0

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
            mask_truncated_completions=config.mask_truncated_completions,
            loss_type=config.loss_type,
            reward_coef=config.reward_coef,
        )


def kl_per_token(rollout: Rollout, settings: ExperienceSettings) -> mx.array:
    """The per-token KL to the reference the algorithm penalises, (B, T), 0 after each response:
    ``kl_estimator`` where it is a penalty in the reward, else k3 (the term of GRPO's loss).
    Training and evaluation both report its sum over a response as ``objective/kl`` /
    ``eval/kl``."""
    in_reward = get_algorithm(settings.algorithm).kl_in_reward
    estimator: KLEstimator = settings.kl_estimator if in_reward else "k3"
    return kl_estimate(rollout.logprobs, rollout.ref_logprobs, estimator) * rollout.mask


def penalized_scores(rollout: Rollout, settings: ExperienceSettings) -> mx.array:
    """The rollout's scores (B,) less ``missing_eos_penalty`` where a response has no stop token:
    the scores the update learns from (and that ``normalize_reward``'s statistics follow)."""
    if settings.missing_eos_penalty is None:
        return rollout.scores
    ended = rollout.generation.ended_with_stop
    return apply_missing_eos_penalty(rollout.scores, ended, settings.missing_eos_penalty)


def make_experience(
    rollout: Rollout,
    settings: ExperienceSettings,
    kl_coef: float,
    *,
    step: int,
    group: Any = None,
    score_moments: RunningMoments | None = None,
) -> tuple[RolloutBatch, dict[str, mx.array]]:
    """The rollout batch the update learns from, and per-token statistics for the metrics.

    Scores first lose ``missing_eos_penalty`` for responses without a stop token and, with
    ``score_moments`` (``normalize_reward``: the running statistics, this batch included), are
    normalised by them for what follows (``batch.scores`` keeps them unnormalised, for the
    metrics); ``kl`` is :func:`kl_per_token`; the per-token rewards are ``-coef * kl`` plus the
    score at the last token, ``coef`` = ``kl_coef`` where the algorithm's KL is in the reward,
    else ``beta``. Then the algorithm (:mod:`algorithms`) makes the advantages and returns:
    GAE for PPO, group-relative for GRPO, leave-one-out for RLOO, whitened returns for
    REINFORCE++.

    ``mask_truncated_completions`` (group methods) then drops responses without a stop token from
    the loss (``batch.mask`` all 0 for them); they still count in their group's baseline.

    Agents (multi-turn episodes): ``r.mask`` holds the policy's tokens only, so the KL, the
    losses and GAE skip the tool tokens (GAE's next state after a turn is the next turn's first
    token). Per-action rewards (``r.action_rewards``) land on each turn's last token for PPO,
    and are summed into the episode's score for the others (no value model: sequence-level
    credit).

    Returns:
        ``(batch, stats)`` with ``stats``: ``kl`` (B, T), ``non_score`` (B, T) the KL part of the
        reward, and ``rewards`` (B, T) the per-token rewards (before any whitening; for GRPO the
        score minus ``beta * kl``, what its loss optimises), and the algorithm's own metrics,
        scalars (``AlgorithmMetrics``: online DPO's ``rewards/chosen`` ...).

    Raises:
        ValueError: the advantages or returns are not finite (scores too large for float32),
            naming ``step``: no update is made from them; an unknown algorithm.
    """
    r = rollout
    algorithm = get_algorithm(settings.algorithm)
    ended = r.generation.ended_with_stop
    scores = raw_scores = penalized_scores(r, settings)  # (B,)
    per_token_actions = algorithm.value_model
    if r.action_rewards is not None and not per_token_actions:
        scores = raw_scores = scores + r.action_rewards.sum(axis=1)  # (B,) the episode's total
    if score_moments is not None:
        _check_finite_moments(score_moments, raw_scores, step)
        scores = normalize_scores(scores, score_moments)  # (B,)
    kl = kl_per_token(r, settings)  # (B, T)
    coef = kl_coef if algorithm.kl_in_reward else settings.beta
    rewards, non_score = per_token_rewards(scores, kl, r.mask, coef)  # (B, T) each
    if r.action_rewards is not None and per_token_actions:
        assert r.turn_ends is not None, "per-action rewards come with their turns' ends"
        rewards = add_action_rewards(rewards, r.action_rewards, r.turn_ends)  # (B, T)
    stats = {"kl": kl, "non_score": non_score, "rewards": rewards}  # rewards before whitening
    # Rollout arrays (scores, KL, values) are constants: no gradient flows through advantages.
    log_ratio = mx.where(r.mask > 0, r.logprobs - r.ref_logprobs, 0.0)  # (B, T)
    inputs = AdvantageInputs(
        scores,
        kl,
        rewards,
        r.mask,
        r.values,
        kl_coef,
        group,
        log_ratio,
        logprobs=r.logprobs,
        ended_with_stop=ended,
    )
    advantages, returns = algorithm.advantages(inputs, settings)  # (B,) or (B, T); (B, T)
    if isinstance(algorithm, AlgorithmMetrics):  # scalars: the algorithm's own metrics, if any
        stats.update(algorithm.metrics(inputs, settings))
    mask = r.mask
    if settings.mask_truncated_completions:
        mask = mask_truncated_completions(mask, ended)
    batch = RolloutBatch(
        query_responses=r.query_responses,
        prompt_lengths=r.prompt_lengths,
        responses=r.generation.responses,
        mask=mask,
        logprobs=r.logprobs,
        ref_logprobs=r.ref_logprobs,
        scores=raw_scores,
        advantages=advantages,
        values=r.values,
        returns=returns,
    )
    mx.eval(batch.advantages, batch.returns, batch.mask, stats)
    _check_finite(batch, step)
    return batch, stats


def experience_phase(
    rollout: Rollout,
    settings: ExperienceSettings,
    kl_coef: float,
    moments: RunningMoments | None,
    *,
    step: int,
    group: Any = None,
) -> tuple[RolloutBatch, dict[str, mx.array], RunningMoments | None]:
    """Phase 4 of a step: with ``moments`` (``normalize_reward``'s running statistics), they
    take this batch's scores (over every rank) in first and the scores are normalised by them;
    then :func:`make_experience`. Returns ``(batch, stats, moments)``, the moments updated
    (None when none were given)."""
    if moments is not None:
        moments = update_moments(moments, penalized_scores(rollout, settings), group)
    batch, stats = make_experience(
        rollout, settings, kl_coef, step=step, group=group, score_moments=moments
    )
    return batch, stats, moments


def _check_finite_moments(moments: RunningMoments, scores: mx.array, step: int) -> None:
    """Scores whose squares overflow float32 (|score| > ~1e19) give an infinite running
    variance, which would normalise every score to 0 in silence: stop instead."""
    if not (math.isfinite(moments.mean) and math.isfinite(moments.var)):
        largest = float(np.abs(np.asarray(scores)).max())
        raise ValueError(
            f"the scores' running mean and variance (normalize_reward) of step {step} are not "
            f"finite (the largest |score| is {largest:.3g}): the scores are too large for float32 "
            "arithmetic. Scale or clip the reward (e.g. into [-10, 10]); no update was made "
            "from this batch"
        )


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
