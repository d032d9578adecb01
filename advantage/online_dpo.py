"""Online DPO's per-sequence weights: the gradient of a DPO-family loss on pairs of the
policy's own samples, as advantages of a sequence-level policy-gradient loss (Guo et al. 2024,
"Direct Language Model Alignment from Online AI Feedback"; TRL's ``OnlineDPOTrainer``), and
TRL's metrics of the pairs."""

from __future__ import annotations

import mlx.core as mx

from token_attribution.extractor import check_token_arrays, valid_mask

#: The losses online DPO learns with (``loss_type``): those of ``training.preference_loss``
#: that compare with the reference and need no setting beyond ``beta``.
ONLINE_DPO_LOSSES: tuple[str, ...] = ("sigmoid", "ipo", "hinge")


def _pairs(scores: mx.array, mask: mx.array, rows: int) -> tuple[mx.array, mx.array]:
    """``(first, second)`` (P,) booleans: which sample of each pair scores higher (both
    False: a tie), after checking the shapes."""
    if scores.shape != (rows,) or rows % 2:
        raise ValueError(
            f"online DPO needs an even number of samples, two per prompt, and one score each: "
            f"got scores {tuple(scores.shape)} for {rows} samples"
        )
    s = scores.astype(mx.float32).reshape(-1, 2)  # (P, 2)
    return s[:, 0] > s[:, 1], s[:, 1] > s[:, 0]


def online_dpo_advantages(
    scores: mx.array,
    log_ratio: mx.array,
    mask: mx.array,
    beta: float,
    loss_type: str = "sigmoid",
) -> mx.array:
    """Per-sequence advantages ``A`` (B,) whose REINFORCE loss ``-(1/B) sum_b A_b log pi(y_b)``
    has, at the rollout's policy, the gradient of DPO's ``loss_type`` loss on the pairs.

    Rows ``2p`` and ``2p + 1`` are the two samples of prompt ``p``; the better-scored one is
    chosen (``c``), the other rejected (``r``). With ``h = sum_t (log pi - log pi_ref)`` over a
    response's ``n`` tokens and ``Delta = h_c - h_r``, the loss is ``(1/P) sum_p l_p`` and
    ``A_b = -(B/P) dl_p/dlog pi(y_b) = -2 dl_p/dlog pi(y_b)``:

    * ``"sigmoid"`` (DPO): ``l = -log sigmoid(beta Delta)``, ``A_c = 2 beta sigmoid(-beta
      Delta)``, ``A_r = -A_c``;
    * ``"hinge"`` (SLiC): ``l = relu(1 - beta Delta)``, ``A_c = 2 beta [beta Delta < 1]``,
      ``A_r = -A_c``;
    * ``"ipo"``: ``l = (h_c / n_c - h_r / n_r - 1 / (2 beta))^2`` (the per-token averaged
      log-ratios of finetune's DPO; TRL's online DPO sums them), ``A_c = -4 m / n_c``,
      ``A_r = 4 m / n_r`` with ``m = h_c / n_c - h_r / n_r - 1 / (2 beta)``.

    A pair whose scores tie prefers nothing: both get 0. Inputs are constants (rollout
    quantities).

    Args:
        scores: (B,) the samples' scores, ``B`` even.
        log_ratio: (B, T) ``log pi_rollout - log pi_ref`` at the sampled tokens.
        mask: (B, T) 1 on the action tokens.
        beta: DPO's temperature (> 0).
        loss_type: one of :data:`ONLINE_DPO_LOSSES`.

    Returns:
        (B,) float32.
    """
    check_token_arrays("log_ratio", log_ratio, mask=mask)
    B = log_ratio.shape[0]
    first, second = _pairs(scores, mask, B)  # (P,) each
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if loss_type not in ONLINE_DPO_LOSSES:
        raise ValueError(
            f"online DPO's loss_type must be one of {ONLINE_DPO_LOSSES}, got {loss_type!r}"
        )
    valid = valid_mask(mask)
    h = mx.where(valid, log_ratio.astype(mx.float32), 0.0).sum(axis=1).reshape(-1, 2)  # (P, 2)
    n = mx.maximum(valid.astype(mx.float32).sum(axis=1), 1.0).reshape(-1, 2)  # (P, 2)
    sign = mx.where(first, 1.0, mx.where(second, -1.0, 0.0))  # (P,) +1: the first is chosen
    if loss_type == "ipo":
        avg = h / n  # (P, 2)
        margin = sign * (avg[:, 0] - avg[:, 1]) - 1.0 / (2.0 * beta)  # (P,)
        # dl/dlog pi of the first sample: 2 m sign / n_0; of the second: -2 m sign / n_1.
        a = mx.stack([-4.0 * margin * sign / n[:, 0], 4.0 * margin * sign / n[:, 1]], axis=1)
        return mx.where(sign[:, None] != 0, a, 0.0).reshape(B)
    delta = sign * (h[:, 0] - h[:, 1])  # (P,) h_c - h_r (0 for ties, whose weight sign zeroes)
    if loss_type == "sigmoid":
        weight = 2.0 * beta * mx.sigmoid(-beta * delta)  # (P,)
    else:  # hinge
        weight = 2.0 * beta * (beta * delta < 1.0).astype(mx.float32)  # (P,)
    a_first = sign * weight  # (P,)
    return mx.stack([a_first, -a_first], axis=1).reshape(B)


def online_dpo_metrics(
    scores: mx.array,
    logprobs: mx.array,
    log_ratio: mx.array,
    mask: mx.array,
    ended_with_stop: mx.array,
    beta: float,
) -> dict[str, mx.array]:
    """TRL's ``OnlineDPOTrainer`` metrics of the pairs (means over the ``P`` pairs), as TRL
    ranks them: the first sample is chosen when its score is at least the second's.

    ``rewards/chosen`` / ``rewards/rejected``: ``beta h`` of the chosen / rejected samples
    (``h = sum_t m (log pi - log pi_ref)``); ``rewards/margins`` their difference;
    ``rewards/accuracies`` the share of pairs whose margin is > 0; ``logps/chosen`` /
    ``logps/rejected``: ``sum_t m log pi``; ``objective/scores_margin``: chosen score minus
    rejected score; ``val/contain_eos_token``: the share of samples that ended with a stop
    token; ``beta``.

    Args:
        scores: (B,) scores, two samples per prompt (rows ``2p``, ``2p + 1``).
        logprobs: (B, T) the rollout policy's log-probs; log_ratio: (B, T) minus the
            reference's; mask: (B, T) 1 on the action tokens; ended_with_stop: (B,) bool.
    """
    rows = logprobs.shape[0]
    _pairs(scores, mask, rows)
    valid = valid_mask(mask)
    s = scores.astype(mx.float32).reshape(-1, 2)  # (P, 2)
    h = mx.where(valid, log_ratio.astype(mx.float32), 0.0).sum(axis=1).reshape(-1, 2)  # (P, 2)
    lp = mx.where(valid, logprobs.astype(mx.float32), 0.0).sum(axis=1).reshape(-1, 2)  # (P, 2)
    first = s[:, 0] >= s[:, 1]  # (P,) TRL: ties go to the first sample

    def pick(x: mx.array) -> tuple[mx.array, mx.array]:
        return mx.where(first, x[:, 0], x[:, 1]), mx.where(first, x[:, 1], x[:, 0])

    chosen_h, rejected_h = pick(h)
    chosen_lp, rejected_lp = pick(lp)
    chosen_s, rejected_s = pick(s)
    margin = beta * (chosen_h - rejected_h)  # (P,)
    return {
        "rewards/chosen": (beta * chosen_h).mean(),
        "rewards/rejected": (beta * rejected_h).mean(),
        "rewards/margins": margin.mean(),
        "rewards/accuracies": (margin > 0).astype(mx.float32).mean(),
        "logps/chosen": chosen_lp.mean(),
        "logps/rejected": rejected_lp.mean(),
        "objective/scores_margin": (chosen_s - rejected_s).mean(),
        "val/contain_eos_token": ended_with_stop.astype(mx.float32).mean(),
        "beta": mx.array(beta, dtype=mx.float32),
    }
