"""Sequence scores -> per-token rewards with a KL penalty (Ziegler et al. 2019; Stiennon et al. 2020)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from token_attribution.extractor import check_ndim, check_token_arrays, valid_mask


def per_token_rewards(
    scores: mx.array, kl: mx.array, mask: mx.array, kl_coef: float | mx.array
) -> tuple[mx.array, mx.array]:
    """Per-token rewards: a KL penalty on every action token, the score on the last one.

    ``non_score_t = -kl_coef * kl_t`` on action tokens, 0 elsewhere;
    ``rewards_t = non_score_t + score * [t == last action token of the row]``.
    The last action token is the stop token when the response has one (never the pad after it).

    Every row must have at least one action token; this is checked with one host sync (once per
    rollout) and an empty row raises ``ValueError`` - its score would have nowhere to go.

    Args:
        scores: (B,) sequence scores from the reward model or function (constants).
        kl: (B, T) per-token KL estimates (:func:`reward_kl.kl_divergence.kl_estimate`; constants).
        mask: (B, T), nonzero on action tokens.
        kl_coef: the KL coefficient (a Python float, or a scalar array).

    Returns:
        ``(rewards, non_score_rewards)``, each (B, T) float32.
    """
    check_ndim("scores", scores, 1, "(B,)")
    check_token_arrays("kl", kl, mask=mask)
    if scores.shape[0] != kl.shape[0]:
        raise ValueError(
            f"scores has shape {tuple(scores.shape)} but kl has {tuple(kl.shape)}; "
            f"scores needs one entry per row of kl"
        )
    valid = valid_mask(mask)
    counts = mx.sum(valid.astype(mx.int32), axis=1)  # (B,)
    if not bool(mx.all(counts >= 1).item()):
        empty = np.flatnonzero(np.array(counts) == 0).tolist()
        raise ValueError(
            f"rows {empty} of mask have no action token, so their score has no token to land on; "
            f"drop empty responses before computing rewards"
        )
    T = kl.shape[1]
    non_score = mx.where(valid, -kl_coef * kl.astype(mx.float32), 0.0)  # (B, T)
    positions = mx.arange(T, dtype=mx.int32)[None, :]  # (1, T)
    last = mx.max(mx.where(valid, positions, -1), axis=1)  # (B,)
    at_last = positions == last[:, None]  # (B, T) one-hot
    rewards = non_score + mx.where(at_last, scores.astype(mx.float32)[:, None], 0.0)  # (B, T)
    return rewards, non_score


def sequence_rewards(
    scores: mx.array, kl: mx.array, mask: mx.array, kl_coef: float | mx.array
) -> mx.array:
    """Sequence rewards with the KL penalty summed over each response (RLOO, as TRL's RLOOTrainer).

    ``R_b = score_b - kl_coef * sum_t m_bt kl_bt``: the sum over the row of
    :func:`per_token_rewards` (TRL's RLOO and its earlier ``token_level_kl`` option both reduce to
    this number before the leave-one-out baseline).

    Args:
        scores: (B,) sequence scores (constants).
        kl: (B, T) per-token KL estimates (constants; TRL's RLOO uses ``"k1"``, the rollout
            policy's log-probs minus the reference's).
        mask: (B, T), nonzero on action tokens.
        kl_coef: the KL coefficient (a Python float, or a scalar array).

    Returns:
        (B,) float32.
    """
    check_ndim("scores", scores, 1, "(B,)")
    check_token_arrays("kl", kl, mask=mask)
    if scores.shape[0] != kl.shape[0]:
        raise ValueError(
            f"scores has shape {tuple(scores.shape)} but kl has {tuple(kl.shape)}; "
            f"scores needs one entry per row of kl"
        )
    kl_sum = mx.sum(mx.where(valid_mask(mask), kl.astype(mx.float32), 0.0), axis=1)  # (B,)
    return scores.astype(mx.float32) - kl_coef * kl_sum


def apply_missing_eos_penalty(
    scores: mx.array, ended_with_stop: mx.array, penalty: float
) -> mx.array:
    """Subtract ``penalty`` from the score of every response that did not end with a stop token.

    ``scores_b - penalty * [not ended_with_stop_b]`` (TRL's ``missing_eos_penalty``: ``penalty`` is a
    non-negative amount that is subtracted, e.g. 1.0 lowers the score by 1).

    Args:
        scores: (B,) sequence scores.
        ended_with_stop: (B,) bool (or 0/1), from
            the generator's ``ended_with_stop``.
        penalty: >= 0.

    Returns:
        (B,) float32.
    """
    check_ndim("scores", scores, 1, "(B,)")
    if tuple(ended_with_stop.shape) != tuple(scores.shape):
        raise ValueError(
            f"ended_with_stop has shape {tuple(ended_with_stop.shape)} but scores has "
            f"{tuple(scores.shape)}; they must match"
        )
    if penalty < 0:
        raise ValueError(
            f"penalty must be >= 0 (it is subtracted from the score), got {penalty}; "
            f"pass {-penalty} to lower the score of responses without a stop token"
        )
    missing = mx.logical_not(valid_mask(ended_with_stop))  # (B,)
    return scores.astype(mx.float32) - mx.where(missing, penalty, 0.0)


def add_action_rewards(
    rewards: mx.array, action_rewards: mx.array, turn_ends: mx.array
) -> mx.array:
    """Per-action rewards of multi-turn episodes added on each action's last token.

    ``out[b, t] = rewards[b, t] + sum_k action_rewards[b, k] * [t == turn_ends[b, k]]``: the
    reward of assistant turn ``k`` (an environment's ``get_reward()`` list) lands on that turn's
    last policy token, as the episode's score lands on the last one (:func:`per_token_rewards`).
    GAE then credits it to the turn's tokens and, discounted, to the turns before.

    Args:
        rewards: (B, T) per-token rewards (constants).
        action_rewards: (B, K) one reward per assistant turn (0 past a row's turns).
        turn_ends: (B, K) int, the column of turn ``k``'s last token, -1 past a row's turns.

    Returns:
        (B, T) float32.
    """
    check_ndim("rewards", rewards, 2, "(B, T)")
    check_ndim("action_rewards", action_rewards, 2, "(B, K)")
    if tuple(turn_ends.shape) != tuple(action_rewards.shape):
        raise ValueError(
            f"turn_ends has shape {tuple(turn_ends.shape)} but action_rewards has "
            f"{tuple(action_rewards.shape)}; they must match (one end per assistant turn)"
        )
    if action_rewards.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"action_rewards has {action_rewards.shape[0]} rows but rewards has "
            f"{rewards.shape[0]}; one row per episode"
        )
    T = rewards.shape[1]
    positions = mx.arange(T, dtype=mx.int32)[None, None, :]  # (1, 1, T)
    at_end = positions == turn_ends.astype(mx.int32)[:, :, None]  # (B, K, T); -1 matches none
    landed = mx.where(at_end, action_rewards.astype(mx.float32)[:, :, None], 0.0).sum(axis=1)
    return rewards.astype(mx.float32) + landed  # (B, T)
