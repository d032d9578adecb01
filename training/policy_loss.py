"""Clipped surrogate policy losses: PPO (Schulman et al. 2017) and GRPO (Shao et al. 2024).

Both run inside the differentiated (and possibly compiled) training step, so they never sync with
the host: the masked means are unvalidated (the reward stage already rejected empty rows) and the
metrics are scalar ``mx.array`` values the trainer evaluates with the loss.
"""

from __future__ import annotations

import mlx.core as mx

from advantage.whitening import masked_mean
from reward_kl.kl_divergence import kl_estimate
from token_attribution.extractor import check_token_arrays, valid_mask


def _check_cliprange(cliprange: float) -> None:
    if not cliprange >= 0:
        raise ValueError(f"cliprange must be >= 0, got {cliprange}")


def _clipped_surrogate(
    logprobs: mx.array, old_logprobs: mx.array, advantages: mx.array, cliprange: float
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """Per-token ``max(-A r, -A clip(r))``, the clipped-chosen indicator, ``0.5 d^2`` and ``r``."""
    log_ratio = logprobs - old_logprobs  # (B, T)
    ratio = mx.exp(log_ratio)  # (B, T)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * mx.clip(ratio, 1.0 - cliprange, 1.0 + cliprange)
    per_token = mx.maximum(pg_losses, pg_losses2)  # (B, T)
    clipped = (pg_losses2 > pg_losses).astype(mx.float32)  # (B, T)
    return per_token, clipped, 0.5 * log_ratio * log_ratio, ratio


def ppo_policy_loss(
    logprobs: mx.array,
    old_logprobs: mx.array,
    advantages: mx.array,
    mask: mx.array,
    cliprange: float,
) -> tuple[mx.array, dict[str, mx.array]]:
    """PPO clipped surrogate loss, averaged over the action tokens of the minibatch.

    ``r_t = exp(logp_t - old_logp_t)``,
    ``loss = masked_mean(max(-A_t r_t, -A_t clip(r_t, 1 - cliprange, 1 + cliprange)))``.

    ``old_logprobs`` (rollout policy) and ``advantages`` are constants: they are wrapped in
    ``mx.stop_gradient`` here, so only ``logprobs`` carries a gradient.

    Args:
        logprobs: (B, T) log-probs of the taken tokens under the current policy (differentiated).
        old_logprobs: (B, T) log-probs under the policy that generated the rollout.
        advantages: (B, T) per-token advantages (usually whitened GAE).
        mask: (B, T), nonzero on action tokens (at least one, not checked: no host sync).
        cliprange: epsilon of the ratio clip.

    Returns:
        ``(loss, metrics)``: scalar float32 loss; metrics (scalar float32 arrays) ``clipfrac``
        (fraction of tokens where the clipped term was chosen, ``pg_losses2 > pg_losses``),
        ``approxkl`` (``masked_mean(0.5 (logp - old_logp)^2)``) and ``ratio`` (masked mean of r).
    """
    check_token_arrays("logprobs", logprobs, old_logprobs=old_logprobs, advantages=advantages)
    check_token_arrays("logprobs", logprobs, mask=mask)
    _check_cliprange(cliprange)
    valid = valid_mask(mask)
    # Rollout quantities enter as constants.
    old_logprobs = mx.stop_gradient(old_logprobs.astype(mx.float32))
    advantages = mx.stop_gradient(advantages.astype(mx.float32))
    per_token, clipped, approxkl, ratio = _clipped_surrogate(
        logprobs.astype(mx.float32), old_logprobs, advantages, cliprange
    )
    loss = masked_mean(per_token, valid, validate=False)
    metrics = {
        "clipfrac": masked_mean(clipped, valid, validate=False),
        "approxkl": masked_mean(approxkl, valid, validate=False),
        "ratio": masked_mean(ratio, valid, validate=False),
    }
    return loss, metrics


def grpo_policy_loss(
    logprobs: mx.array,
    old_logprobs: mx.array,
    ref_logprobs: mx.array,
    advantages: mx.array,
    mask: mx.array,
    cliprange: float,
    beta: float,
) -> tuple[mx.array, dict[str, mx.array]]:
    """GRPO loss: clipped surrogate with one advantage per sequence, plus a k3 KL penalty per token.

    ``r_t = exp(logp_t - old_logp_t)``, ``A_t = A_b`` for every token of row ``b``,
    ``k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1``,
    ``loss = sum_{b,t} m_bt [max(-A_b r_t, -A_b clip(r_t, 1 - eps, 1 + eps)) + beta k3_t] / sum m``:
    the mean over all action tokens of the batch (token-level, as DAPO and TRL's ``"dapo"`` /
    ``"bnpo"``; long responses weigh more than in the per-sequence mean of the GRPO paper).

    ``old_logprobs``, ``ref_logprobs`` and ``advantages`` are constants (wrapped in
    ``mx.stop_gradient`` here); only ``logprobs`` carries a gradient.

    Args:
        logprobs: (B, T) log-probs of the taken tokens under the current policy (differentiated).
        old_logprobs: (B, T) log-probs under the policy that generated the rollout.
        ref_logprobs: (B, T) log-probs under the frozen reference model.
        advantages: (B,) group-relative advantages, broadcast over each row's tokens.
        mask: (B, T), nonzero on action tokens (at least one, not checked: no host sync).
        cliprange: epsilon of the ratio clip.
        beta: weight of the KL term (0 disables it; ``kl`` is still reported).

    Returns:
        ``(loss, metrics)``: scalar float32 loss; metrics (scalar float32 arrays) ``kl`` (masked
        mean of k3), ``clipfrac``, ``approxkl`` and ``ratio`` as in :func:`ppo_policy_loss`.
    """
    check_token_arrays(
        "logprobs", logprobs, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, mask=mask
    )
    if tuple(advantages.shape) != (logprobs.shape[0],):
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)} but logprobs has "
            f"{tuple(logprobs.shape)}; GRPO takes one advantage per row, shape (B,)"
        )
    _check_cliprange(cliprange)
    if not beta >= 0:
        raise ValueError(f"beta (KL weight) must be >= 0, got {beta}")
    valid = valid_mask(mask)
    logprobs = logprobs.astype(mx.float32)
    # Rollout, reference and advantage values enter as constants.
    old_logprobs = mx.stop_gradient(old_logprobs.astype(mx.float32))
    ref_logprobs = mx.stop_gradient(ref_logprobs.astype(mx.float32))
    advantages = mx.stop_gradient(advantages.astype(mx.float32))[:, None]  # (B, 1)
    per_token, clipped, approxkl, ratio = _clipped_surrogate(
        logprobs, old_logprobs, advantages, cliprange
    )
    kl = kl_estimate(logprobs, ref_logprobs, "k3")  # (B, T)
    if beta != 0:
        per_token = per_token + beta * kl
    loss = masked_mean(per_token, valid, validate=False)
    metrics = {
        "kl": masked_mean(kl, valid, validate=False),
        "clipfrac": masked_mean(clipped, valid, validate=False),
        "approxkl": masked_mean(approxkl, valid, validate=False),
        "ratio": masked_mean(ratio, valid, validate=False),
    }
    return loss, metrics
