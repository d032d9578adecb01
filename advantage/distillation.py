"""On-policy distillation's advantages: the teacher's per-token verdict on the student's own
samples (Agarwal et al. 2024; Thinking Machines, "On-Policy Distillation", 2025)."""

from __future__ import annotations

import mlx.core as mx

from token_attribution.extractor import check_token_arrays, valid_mask


def distillation_advantages(
    kl: mx.array, scores: mx.array, mask: mx.array, kl_coef: float, reward_coef: float = 1.0
) -> mx.array:
    """Per-token advantages ``A_t = -kl_coef * (log pi(y_t) - log pi_teacher(y_t)) + reward_coef
    * s`` on the action tokens, 0 elsewhere.

    ``log pi - log pi_teacher`` at the sampled token is the one-sample estimate of the reverse
    KL ``KL(pi || pi_teacher)`` at that position; each token is credited with its own term only
    (no discounting across tokens), so the student is pushed toward the teacher where the teacher
    disagrees. ``s`` is the sequence's score (a verifiable reward, 0 without one), the same for
    every token of the sequence. Inputs are constants (rollout quantities).

    Args:
        kl: (B, T) per-token ``log pi - log pi_teacher`` at the sampled tokens (the k1
            estimator, the rollout's).
        scores: (B,) sequence scores.
        mask: (B, T) 1 on the action tokens.
        kl_coef: the weight of the teacher's term.
        reward_coef: the weight of the score.

    Returns:
        (B, T) float32.
    """
    check_token_arrays("kl", kl, mask=mask)
    if not kl_coef >= 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    score = score_advantages(scores, mask, reward_coef)  # (B, T)
    return mx.where(valid_mask(mask), -kl_coef * kl.astype(mx.float32) + score, 0.0)


def score_advantages(scores: mx.array, mask: mx.array, reward_coef: float) -> mx.array:
    """Per-token advantages ``A_t = reward_coef * s`` on the action tokens, 0 elsewhere: each
    sequence's score on every one of its tokens (GKD's policy-gradient term; the score part of
    :func:`distillation_advantages`). Inputs are constants (rollout quantities).

    Args:
        scores: (B,) sequence scores.
        mask: (B, T) 1 on the action tokens.
        reward_coef: the weight of the score.

    Returns:
        (B, T) float32.
    """
    if scores.shape != (mask.shape[0],):
        raise ValueError(f"scores must have shape ({mask.shape[0]},), got {tuple(scores.shape)}")
    per_token = reward_coef * scores.astype(mx.float32)[:, None] * mx.ones(mask.shape)  # (B, T)
    return mx.where(valid_mask(mask), per_token, 0.0)
