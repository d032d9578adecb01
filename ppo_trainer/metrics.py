"""Phase 6 of an iteration: the metrics of the global batch, under TRL's names.

Per-rank means of rows (every rank holds the same number) and of minibatch metrics (token-weighted
in the update) average over the ranks and counts add up, in one all-reduce; spreads (the scores'
standard deviation, the value model's explained variance) use all-reduced statistics.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
import numpy as np

from advantage.whitening import masked_var
from base_setup import distributed as dist
from config.ppo_config import PPOConfig
from experience_buffer.buffer import RolloutBatch
from ppo_trainer.agent_rollout import agent_count_sums, agent_metrics
from ppo_trainer.rollout import Rollout
from reward_kl.kl_divergence import AdaptiveKLController, FixedKLController


def reduce_over_ranks(
    means: dict[str, mx.array], sums: dict[str, mx.array], group: Any
) -> dict[str, float]:
    """Scalar ``means`` averaged over the ranks of ``group`` and ``sums`` added up, as host
    floats (one all-reduce; the local values on one process)."""
    world = group.size() if group is not None else 1
    local = mx.stack([*means.values(), *sums.values()]).astype(mx.float32)  # (K,)
    scale = mx.array([1.0 / world] * len(means) + [1.0] * len(sums))  # (K,)
    values = np.array(dist.all_sum(local, group) * scale).tolist()
    return dict(zip([*means, *sums], values))


def agent_metrics_over_ranks(counts: dict[str, float], group: Any) -> dict[str, float]:
    """The ``agent/`` metrics of the global batch: each rank's episode sums
    (:func:`ppo_trainer.agent_rollout.agent_counts`) added over the ranks of ``group``, then
    divided, so that ``agent/tool_call_success`` is the global successful calls / calls, not
    a mean of the ranks' rates."""
    totals = reduce_over_ranks({}, {k: mx.array(v) for k, v in counts.items()}, group)
    return agent_metrics(totals)


def rollout_metrics(rollout: Rollout, group: Any) -> dict[str, float]:
    """What a rollout adds to its step's metrics: several rewards' means and spreads, its
    source's (dynamic sampling's over every group generated, not only those kept), and the
    ``agent/`` metrics of the global batch's episodes (counts added over the ranks)."""
    metrics: dict[str, float] = {}
    if rollout.reward_metrics:
        metrics.update(reduce_over_ranks(rollout.reward_metrics, {}, group))
    metrics.update(rollout.source_metrics)
    if rollout.agent_counts:
        sums = agent_count_sums(rollout.agent_counts)
        metrics.update(agent_metrics_over_ranks(sums, group))
    return metrics


def frac_reward_zero_std(scores: mx.array, group_size: int) -> mx.array:
    """The share of groups whose ``group_size`` scores are all equal (TRL's
    ``frac_reward_zero_std``): their group-relative advantages are 0, so they teach nothing.

    Args:
        scores: (B,) with ``B = groups * group_size``, a group's responses adjacent.

    Returns:
        Scalar float32 in [0, 1].
    """
    grouped = scores.reshape(-1, group_size)  # (B / G, G)
    same = mx.max(grouped, axis=1) == mx.min(grouped, axis=1)  # (B / G,)
    return same.astype(mx.float32).mean()


def explained_variance(
    returns: mx.array, values: mx.array, mask: mx.array, group: Any = None
) -> mx.array:
    """``1 - Var[R - V] / Var[R]`` over the valid tokens (cleanrl's ``explained_var``): 1 when
    the values predict the returns, 0 when they do no better than their mean; NaN when
    ``Var[R] = 0`` (all returns equal, e.g. all 0), where it is undefined: the old
    ``+ 1e-8`` made a constant value on such a batch read as a perfect 1.0.

    Args:
        returns, values: (B, T) float.
        mask: (B, T), nonzero on valid tokens.
        group: the ranks the batch is split over (:func:`masked_var`); None: local.

    Returns:
        float32 scalar.
    """
    residual = masked_var(returns - values, mask, unbiased=False, group=group)
    target = masked_var(returns, mask, unbiased=False, group=group)
    return mx.where(target > 0, 1.0 - residual / mx.maximum(target, 1e-30), mx.array(mx.nan))


def iteration_metrics(
    rollout: Rollout,
    batch: RolloutBatch,
    stats: dict[str, mx.array],
    update_metrics: list[dict[str, mx.array]],
    group: Any = None,
    group_size: int = 1,
) -> dict[str, float]:
    """``objective/kl``, ``objective/entropy``, ``objective/non_score_reward``,
    ``objective/rlhf_reward``, ``objective/scores`` (and ``_std``), ``episode/response_length``,
    ``val/num_eos_tokens``, ``val/explained_variance`` (PPO), ``frac_reward_zero_std`` (groups
    of ``group_size`` > 1), the means of the update's metrics (``loss/policy``,
    ``policy/clipfrac``, ...), the algorithm's own (the scalars of ``stats``), and
    ``num_generated`` (tokens)."""
    mask = batch.mask
    kl_sum = stats["kl"].sum(axis=1)  # (B,)
    non_score_sum = stats["non_score"].sum(axis=1)  # (B,)
    means = {
        "objective/kl": kl_sum.mean(),
        "objective/entropy": (rollout.entropy * mask).sum(axis=1).mean(),
        "objective/non_score_reward": non_score_sum.mean(),
        "objective/rlhf_reward": (batch.scores + non_score_sum).mean(),
        "objective/scores": batch.scores.mean(),
        "episode/response_length": rollout.generation.lengths.astype(mx.float32).mean(),
    }
    if group_size > 1:  # each rank holds whole groups, so the mean over ranks is the share
        means["frac_reward_zero_std"] = frac_reward_zero_std(batch.scores, group_size)
    for key in update_metrics[0]:
        means[key] = mx.stack([m[key] for m in update_metrics]).mean()
    # The algorithm's own metrics (make_experience's scalar stats): means over each rank's rows.
    means.update({key: value for key, value in stats.items() if value.ndim == 0})
    sums = {
        "val/num_eos_tokens": rollout.generation.ended_with_stop.astype(mx.float32).sum(),
        "num_generated": mask.sum(),
    }
    result = reduce_over_ranks(means, sums, group)
    spreads = {
        "objective/scores_std": mx.sqrt(
            masked_var(batch.scores, mx.ones_like(batch.scores), unbiased=False, group=group)
        )
    }
    if batch.values is not None and batch.returns is not None:
        spreads["val/explained_variance"] = explained_variance(
            batch.returns, batch.values, mask, group
        )
    result.update({k: float(np.asarray(v)) for k, v in spreads.items()})
    return result


def step_metrics(
    rollout: Rollout,
    batch: RolloutBatch,
    stats: dict[str, mx.array],
    update_metrics: list[dict[str, mx.array]],
    config: PPOConfig,
    kl_ctl: FixedKLController | AdaptiveKLController,
    group: Any = None,
) -> dict[str, float]:
    """Phase 6: the global batch's metrics (:func:`iteration_metrics`, :func:`rollout_metrics`).
    Where the algorithm's KL is in the reward, the KL controller ``kl_ctl`` follows the measured
    KL and its coefficient is logged (``objective/kl_coef``); else its weight is ``beta``, in
    the loss."""
    metrics = iteration_metrics(rollout, batch, stats, update_metrics, group, config.group_size)
    metrics.update(rollout_metrics(rollout, group))
    if config.algorithm_object.kl_in_reward:
        kl_ctl.update(metrics["objective/kl"], config.rollout_batch_size)
        metrics["objective/kl_coef"] = float(kl_ctl.value)
    return metrics


def step_timings(
    t0: float,
    t_rollout: float,
    t_advantages: float,
    t_update: float,
    metrics: dict[str, float],
    lr: float,
) -> dict[str, float]:
    """A step's clock readings as metrics (its end is now): ``time/rollout``,
    ``time/advantages``, ``time/update``, ``time/step``, ``tokens_per_second`` (taking
    ``num_generated`` out of ``metrics``), with ``lr`` and ``avg_reward`` (the mean score)."""
    t_end = time.perf_counter()
    return {
        "lr": lr,
        "avg_reward": metrics["objective/scores"],
        "time/rollout": t_rollout - t0,
        "time/advantages": t_advantages - t_rollout,
        "time/update": t_update - t_advantages,
        "time/step": t_end - t0,
        "tokens_per_second": metrics.pop("num_generated") / max(t_end - t0, 1e-9),
    }
