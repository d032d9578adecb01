"""REINFORCE++ (Hu et al. 2025): critic-free per-token advantages from discounted returns,
whitened over the whole batch; and its ``-baseline`` variant (group-mean baseline first).

As OpenRLHF's experience maker computes them (``--advantage_estimator reinforce`` and
``reinforce_baseline``): the score lands on the last action token, every action token carries
``-kl_coef * kl_t`` (:func:`reward_kl.reward_computer.per_token_rewards`), the return-to-go
``G_t = sum_{k >= 0} gamma^k r_{t+k}`` over the action tokens is the advantage, and the
advantages are whitened over every action token of the batch. Where this differs from OpenRLHF:

* Whitening uses :func:`advantage.whitening.masked_whiten` (the batch's mean and its
  Bessel-corrected variance, ``(G - mean) / sqrt(var + 1e-8)``, as PPO's advantages here and
  TRL's ``masked_whiten``); OpenRLHF divides by ``sqrt(max(var, 1e-8))`` with the biased
  variance, a factor ``sqrt(n / (n - 1))`` apart for ``n`` action tokens (negligible at batch
  sizes; it does not change the direction of an update).
* The per-token KL is the caller's estimator, unclamped; OpenRLHF clamps it to [-10, 10].
* OpenRLHF silently resets ``gamma`` to 1 for ``reinforce_baseline``; here
  :func:`reinforce_pp_baseline_advantages` has no ``gamma`` (always 1) and the config refuses
  another value.
"""

from __future__ import annotations

import mlx.core as mx

from advantage.group_advantage import group_advantages
from advantage.reward_to_go import reward_to_go
from advantage.whitening import masked_whiten
from base_setup.distributed import Group
from reward_kl.reward_computer import per_token_rewards


def reinforce_pp_advantages(
    scores: mx.array,
    kl: mx.array,
    mask: mx.array,
    kl_coef: float | mx.array,
    gamma: float,
    *,
    group: Group | None = None,
) -> tuple[mx.array, mx.array]:
    """REINFORCE++ advantages and returns.

    ``r_t = -kl_coef * kl_t + score * [t == last action token]``,
    ``G_t = r_t + gamma * G_{t'}`` (``t'`` the next action token; :func:`reward_to_go`),
    ``A = masked_whiten(G)`` over every action token of the batch (of all ranks of ``group``).

    Args:
        scores: (B,) sequence scores (constants).
        kl: (B, T) per-token KL estimates (constants; any estimator of
            :func:`reward_kl.kl_divergence.kl_estimate`).
        mask: (B, T), nonzero on action tokens (every row needs one: the score lands on it; one
            host sync checks this).
        kl_coef: the KL coefficient (a Python float, or a scalar array from a KL controller).
        gamma: discount in [0, 1].
        group: data-parallel ranks holding the other rows of the batch: the whitening uses the
            global mean and variance. None: the local batch is the whole batch.

    Returns:
        ``(advantages, returns)``: (B, T) float32 each, 0 on invalid tokens; ``returns`` are the
        un-whitened ``G_t``.
    """
    rewards, _ = per_token_rewards(scores, kl, mask, kl_coef)  # (B, T)
    returns = reward_to_go(rewards, mask, gamma)  # (B, T)
    return masked_whiten(returns, mask, group=group), returns


def reinforce_pp_baseline_advantages(
    scores: mx.array,
    kl: mx.array,
    mask: mx.array,
    kl_coef: float | mx.array,
    group_size: int,
    *,
    group: Group | None = None,
) -> tuple[mx.array, mx.array]:
    """REINFORCE++-baseline: each score minus its prompt group's mean, then
    :func:`reinforce_pp_advantages` with ``gamma = 1``.

    ``score'_b = score_b - mean_{group of b}(score)`` (no division by the std: the batch
    whitening does the scaling), then ``r_t``, ``G_t`` (undiscounted) and the batch whitening as
    in :func:`reinforce_pp_advantages`.

    Args:
        scores: (B,) sequence scores (constants), B = P * group_size, group by group.
        kl: (B, T) per-token KL estimates (constants).
        mask: (B, T), nonzero on action tokens.
        kl_coef: the KL coefficient.
        group_size: g, samples per prompt (>= 2).
        group: data-parallel ranks (whole prompt groups on each), for the whitening.

    Returns:
        ``(advantages, returns)`` as in :func:`reinforce_pp_advantages`.
    """
    centred = group_advantages(scores, group_size, "none")  # (B,)
    return reinforce_pp_advantages(centred, kl, mask, kl_coef, 1.0, group=group)
