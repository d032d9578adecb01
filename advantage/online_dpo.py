"""Online DPO's per-sequence weights: the DPO loss's gradient on pairs of the policy's own
samples, as advantages of a sequence-level policy-gradient loss (Guo et al. 2024, "Direct
Language Model Alignment from Online AI Feedback"; TRL's ``OnlineDPOTrainer``)."""

from __future__ import annotations

import mlx.core as mx

from token_attribution.extractor import check_token_arrays, valid_mask


def online_dpo_advantages(
    scores: mx.array, log_ratio: mx.array, mask: mx.array, beta: float
) -> mx.array:
    """Per-sequence advantages ``A`` (B,) whose REINFORCE loss ``-(1/B) sum_b A_b log pi(y_b)``
    has, at the rollout's policy, the gradient of DPO's sigmoid loss on the pairs.

    Rows ``2p`` and ``2p + 1`` are the two samples of prompt ``p``; the better-scored one is
    chosen (``c``), the other rejected (``r``). With ``h = sum_t (log pi - log pi_ref)`` over a
    response's tokens and ``Delta_p = h_c - h_r``, DPO's loss is
    ``(1/P) sum_p -log sigmoid(beta Delta_p)``, whose gradient is
    ``-(1/P) sum_p beta sigmoid(-beta Delta_p) (grad log pi(y_c) - grad log pi(y_r))``. So
    ``A_c = 2 beta sigmoid(-beta Delta_p)`` and ``A_r = -A_c`` (the 2: ``B = 2P``). A pair whose
    scores tie prefers nothing: both get 0. Inputs are constants (rollout quantities).

    Args:
        scores: (B,) the samples' scores, ``B`` even.
        log_ratio: (B, T) ``log pi_rollout - log pi_ref`` at the sampled tokens.
        mask: (B, T) 1 on the action tokens.
        beta: DPO's temperature (> 0).

    Returns:
        (B,) float32.
    """
    check_token_arrays("log_ratio", log_ratio, mask=mask)
    B = log_ratio.shape[0]
    if scores.shape != (B,) or B % 2:
        raise ValueError(
            f"online DPO needs an even number of samples, two per prompt, and one score each: "
            f"got scores {tuple(scores.shape)} for {B} samples"
        )
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    h = mx.where(valid_mask(mask), log_ratio.astype(mx.float32), 0.0).sum(axis=1)  # (B,)
    s = scores.astype(mx.float32).reshape(-1, 2)  # (P, 2)
    h = h.reshape(-1, 2)  # (P, 2)
    first, second = s[:, 0] > s[:, 1], s[:, 1] > s[:, 0]  # (P,) which sample is chosen
    delta = mx.where(first, h[:, 0] - h[:, 1], h[:, 1] - h[:, 0])  # (P,) h_c - h_r
    weight = 2.0 * beta * mx.sigmoid(-beta * delta)  # (P,)
    a_first = mx.where(first, weight, mx.where(second, -weight, 0.0))  # (P,)
    return mx.stack([a_first, -a_first], axis=1).reshape(B)
