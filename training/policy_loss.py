"""Clipped surrogate policy losses: PPO (Schulman et al. 2017), GRPO (Shao et al. 2024) with its
loss variants (Dr. GRPO, DAPO, GSPO), and RLOO's sequence-level loss (Ahmadian et al. 2024).

They run inside the differentiated (and possibly compiled) training step, so they never sync with
the host: the masked means are unvalidated (the reward stage already rejected empty rows) and the
metrics are scalar ``mx.array`` values the trainer evaluates with the loss.

Shapes: ``B`` sequences of one micro-batch, ``T`` response tokens. A loss is computed per
micro-batch; :func:`micro_batch_weights` says how the micro-batches of one optimiser update (and
the ranks of a data-parallel run) are weighted so that the update optimises the loss of the whole
batch for each ``loss_type``.

Clipping (DAPO's "clip-higher", Yu et al. 2025): the ratio is clipped to
``[1 - cliprange, 1 + cliprange_high]``; ``cliprange_high=None`` means ``cliprange`` (symmetric).
Every clipped loss reports TRL's clip metrics: ``clip_ratio/low_mean`` (fraction with
``r < 1 - cliprange`` and ``A < 0``), ``clip_ratio/high_mean`` (``r > 1 + cliprange_high`` and
``A > 0``) and ``clip_ratio/region_mean`` (either: the entries whose gradient the clip removes;
the same set as ``clipfrac`` up to float ties).

Per-token weights ``w`` (``weights=``, (B, T); None = 1 everywhere, the unweighted loss bit for
bit): the think / answer region weights and the high-entropy mask
(:mod:`token_attribution.token_weights`). ``w`` multiplies each token's loss ``l_bt`` (GRPO's KL
term included) before the normalisation, whose denominators still count the action tokens
(``n_b``, ``sum m``, ``B * L``), not the weights: a weight scales its tokens' share of the
gradient and leaves the other tokens' as they were (TRL's entropy mask does the same). Per
``loss_type``: ``"grpo"`` ``(1/B) sum_b sum_t m w l / n_b``; ``"dr_grpo"`` ``sum m w l / (B L)``;
``"dapo"``/``"bnpo"`` (and PPO, REINFORCE++) ``sum m w l / sum m``. Sequence-level ratios (GSPO,
RLOO) weight each token's log-ratio inside the sequence's, ``sum_t m w (logp - old_logp)``
(over ``n_b`` for GSPO), so that at ``r = 1`` each token's gradient is scaled by its weight, as
in the token-level losses.
"""

from __future__ import annotations

import math

import mlx.core as mx

from advantage.whitening import masked_mean
from config.ppo_config import ImportanceSamplingLevel, LossType
from reward_kl.kl_divergence import kl_estimate
from token_attribution.extractor import check_token_arrays, valid_mask

LOSS_TYPES: tuple[str, ...] = ("grpo", "dr_grpo", "dapo", "bnpo")


def _check_cliprange(cliprange: float, name: str = "cliprange") -> None:
    if not cliprange >= 0:
        raise ValueError(f"{name} must be >= 0, got {cliprange}")


def _upper_cliprange(cliprange: float, cliprange_high: float | None) -> float:
    """The upper clip range: ``cliprange_high``, else ``cliprange`` (checked)."""
    _check_cliprange(cliprange)
    if cliprange_high is None:
        return cliprange
    _check_cliprange(cliprange_high, "cliprange_high")
    return cliprange_high


def _token_mean(x: mx.array, valid: mx.array) -> mx.array:
    """``sum(x over valid) / max(count, 1)``: :func:`masked_mean` (the same value, bit for bit,
    when a token is valid), and 0 rather than NaN for a micro-batch whose every row was masked
    out (``mask_truncated_completions``), as TRL clamps its counts."""
    count = mx.sum(valid.astype(mx.float32))
    total = mx.sum(mx.where(valid, x.astype(mx.float32), 0.0))
    return total / mx.maximum(count, 1.0)


def _clipped_surrogate(
    log_ratio: mx.array, advantages: mx.array, cliprange: float, cliprange_high: float
) -> tuple[mx.array, mx.array, mx.array]:
    """``max(-A r, -A clip(r, 1 - eps, 1 + eps_high))``, the clipped-chosen indicator and ``r``,
    elementwise (``(B, T)`` per token or ``(B, 1)`` per sequence)."""
    ratio = mx.exp(log_ratio)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * mx.clip(ratio, 1.0 - cliprange, 1.0 + cliprange_high)
    per_token = mx.maximum(pg_losses, pg_losses2)
    clipped = (pg_losses2 > pg_losses).astype(mx.float32)
    return per_token, clipped, ratio


def _clip_indicators(
    ratio: mx.array, advantages: mx.array, cliprange: float, cliprange_high: float
) -> dict[str, mx.array]:
    """TRL's clip indicators (float 0/1, elementwise): low, high and region."""
    low = mx.logical_and(ratio < 1.0 - cliprange, advantages < 0)
    high = mx.logical_and(ratio > 1.0 + cliprange_high, advantages > 0)
    return {
        "clip_ratio/low_mean": low.astype(mx.float32),
        "clip_ratio/high_mean": high.astype(mx.float32),
        "clip_ratio/region_mean": mx.logical_or(low, high).astype(mx.float32),
    }


def aggregate_loss(
    per_token: mx.array,
    mask: mx.array,
    loss_type: LossType,
    max_completion_length: int | None = None,
) -> mx.array:
    """One micro-batch's loss from per-token losses ``l_bt`` (TRL 1.12 GRPOTrainer's
    ``loss_type``).

    With ``m`` the mask, ``n_b = sum_t m_bt`` and ``L = max_completion_length``:

    * ``"grpo"``: ``(1/B) sum_b [sum_t m_bt l_bt / max(n_b, 1)]``, the mean over sequences of
      each sequence's token mean (the GRPO paper; a row with no valid token counts as 0, as TRL).
    * ``"dr_grpo"``: ``sum_bt m_bt l_bt / (B * L)``, a constant normaliser (Dr. GRPO).
    * ``"dapo"`` and ``"bnpo"``: ``sum_bt m_bt l_bt / max(sum_bt m_bt, 1)``, the token mean of the
      micro-batch. They differ only in how micro-batches and ranks are combined: see
      :func:`micro_batch_weights` (``"dapo"`` ends as the token mean of the whole batch).

    Args:
        per_token: (B, T) per-token losses (differentiated).
        mask: (B, T), nonzero on the tokens that count.
        loss_type: ``"grpo"``, ``"dr_grpo"``, ``"dapo"`` or ``"bnpo"``.
        max_completion_length: ``L``, the most response tokens a rollout can have (the generation
            budget, ``max_new_tokens``; not this batch's ``T``); needed for ``"dr_grpo"`` only.

    Returns:
        Scalar float32.
    """
    check_token_arrays("per_token", per_token, mask=mask)
    valid = valid_mask(mask)
    if loss_type in ("dapo", "bnpo"):
        return _token_mean(per_token, valid)
    if loss_type == "grpo":
        row_sums = mx.sum(mx.where(valid, per_token.astype(mx.float32), 0.0), axis=1)  # (B,)
        row_counts = mx.sum(valid.astype(mx.float32), axis=1)  # (B,)
        return mx.mean(row_sums / mx.maximum(row_counts, 1.0))
    if loss_type == "dr_grpo":
        if max_completion_length is None or max_completion_length < 1:
            raise ValueError(
                f'loss_type "dr_grpo" divides by batch size * max_completion_length; pass '
                f"max_completion_length >= 1 (the max_new_tokens budget), got "
                f"{max_completion_length}"
            )
        total = mx.sum(mx.where(valid, per_token.astype(mx.float32), 0.0))
        return total / (per_token.shape[0] * max_completion_length)
    raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}; got {loss_type!r}")


def micro_batch_weights(
    loss_type: LossType,
    token_counts: mx.array,
    global_token_counts: mx.array | None = None,
    world_size: int = 1,
) -> mx.array:
    """The weight of each micro-batch's loss (:func:`aggregate_loss`) in one optimiser update, so
    that ``(1/R) sum_ranks sum_k w_k grad(loss_k)`` (the gradient
    :func:`training.optimizer.optimizer_step` forms with ``weights=w`` and averages over ``R``
    ranks) is the gradient of the whole batch's loss. Every rank holds ``n`` micro-batches of
    ``b`` sequences (``S = R n b`` in all); ``c_k`` are this rank's valid tokens in micro-batch
    ``k``, ``C_k = sum_ranks c_k``, ``N = sum_k C_k``.

    * ``"grpo"``: ``w_k = 1/n``. Whole batch: mean over the ``S`` sequences of their token
      means. (TRL divides by its gradient-accumulation steps and averages ranks: the same.)
    * ``"dr_grpo"``: ``w_k = 1/n``. Whole batch: ``sum of all token losses / (S * L)``. (TRL:
      the same.)
    * ``"dapo"``: ``w_k = R c_k / N``. Whole batch: ``sum of all token losses / N``, the token
      mean over every token of the update. (TRL 1.12 divides each micro-batch's sum by
      ``num_items_in_batch * GA / (R * steps_per_generation)``, the generation batch's tokens
      across ranks per update: the same when a generation batch is one update, TRL's default;
      with several updates per generation, their average token count instead of each one's.)
    * ``"bnpo"``: ``w_k = (R c_k / C_k) / n``. Whole batch: the mean over the ``n`` accumulation
      steps of the token mean of step ``k``'s micro-batches of all ranks together. On one process
      this is TRL's ``"bnpo"`` (local token mean, divided by the accumulation steps). On several
      ranks TRL averages each rank's own token mean, which changes with the per-rank split; here
      the result is what one process holding the same micro-batch computes.

    :func:`ppo_policy_loss` (a token mean) is weighted as ``"bnpo"``; :func:`rloo_policy_loss` (a
    sequence mean) as ``"grpo"``.

    Args:
        loss_type: as in :func:`aggregate_loss`.
        token_counts: (n,) this rank's valid tokens in each of its micro-batches.
        global_token_counts: (n,) the same counts summed over the ranks (an all-reduce the caller
            makes); None on one process (= ``token_counts``).
        world_size: ``R``, the number of data-parallel ranks.

    Returns:
        (n,) float32 weights.
    """
    counts = token_counts.astype(mx.float32)  # (n,)
    if counts.ndim != 1 or counts.shape[0] < 1:
        raise ValueError(f"token_counts must have shape (n,), n >= 1, got {tuple(counts.shape)}")
    total = counts if global_token_counts is None else global_token_counts.astype(mx.float32)
    if total.shape != counts.shape:
        raise ValueError(
            f"global_token_counts has shape {tuple(total.shape)} but token_counts has "
            f"{tuple(counts.shape)}; pass the all-reduced sum of token_counts"
        )
    n = counts.shape[0]
    if loss_type in ("grpo", "dr_grpo"):
        return mx.full((n,), 1.0 / n, dtype=mx.float32)
    if loss_type == "bnpo":
        return world_size * counts / mx.maximum(total, 1.0) / n
    if loss_type == "dapo":
        return world_size * counts / mx.maximum(mx.sum(total), 1.0)
    raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}; got {loss_type!r}")


def ppo_policy_loss(
    logprobs: mx.array,
    old_logprobs: mx.array,
    advantages: mx.array,
    mask: mx.array,
    cliprange: float,
    *,
    cliprange_high: float | None = None,
    weights: mx.array | None = None,
) -> tuple[mx.array, dict[str, mx.array]]:
    """PPO clipped surrogate loss, averaged over the action tokens of the minibatch.

    ``r_t = exp(logp_t - old_logp_t)``,
    ``loss = masked_mean(max(-A_t r_t, -A_t clip(r_t, 1 - cliprange, 1 + cliprange_high)))``.
    Also REINFORCE++'s loss, with its per-token advantages.

    ``old_logprobs`` (rollout policy) and ``advantages`` are constants: they are wrapped in
    ``mx.stop_gradient`` here, so only ``logprobs`` carries a gradient.

    Args:
        logprobs: (B, T) log-probs of the taken tokens under the current policy (differentiated).
        old_logprobs: (B, T) log-probs under the policy that generated the rollout.
        advantages: (B, T) per-token advantages (usually whitened GAE).
        mask: (B, T), nonzero on action tokens (at least one, not checked: no host sync).
        cliprange: epsilon of the ratio clip (the lower one when ``cliprange_high`` is given).
        cliprange_high: upper epsilon (DAPO clip-higher); None = ``cliprange``.
        weights: (B, T) per-token loss weights (module docstring); None = 1.

    Returns:
        ``(loss, metrics)``: scalar float32 loss; metrics (scalar float32 arrays) ``clipfrac``
        (fraction of tokens where the clipped term was chosen, ``pg_losses2 > pg_losses``),
        ``approxkl`` (``masked_mean(0.5 (logp - old_logp)^2)``), ``ratio`` (masked mean of r) and
        the ``clip_ratio/*`` fractions of the module docstring.
    """
    check_token_arrays("logprobs", logprobs, old_logprobs=old_logprobs, advantages=advantages)
    check_token_arrays("logprobs", logprobs, mask=mask)
    upper = _upper_cliprange(cliprange, cliprange_high)
    valid = valid_mask(mask)
    # Rollout quantities enter as constants.
    old_logprobs = mx.stop_gradient(old_logprobs.astype(mx.float32))
    advantages = mx.stop_gradient(advantages.astype(mx.float32))
    log_ratio = logprobs.astype(mx.float32) - old_logprobs  # (B, T)
    per_token, clipped, ratio = _clipped_surrogate(log_ratio, advantages, cliprange, upper)
    loss = masked_mean(_weighted(per_token, weights), valid, validate=False)
    metrics = {
        "clipfrac": masked_mean(clipped, valid, validate=False),
        "approxkl": masked_mean(0.5 * log_ratio * log_ratio, valid, validate=False),
        "ratio": masked_mean(ratio, valid, validate=False),
    }
    for key, indicator in _clip_indicators(ratio, advantages, cliprange, upper).items():
        metrics[key] = masked_mean(indicator, valid, validate=False)
    return loss, metrics


def entropy_bonus(
    loss: mx.array,
    metrics: dict[str, mx.array],
    entropy: mx.array,
    mask: mx.array,
    entropy_coef: float,
) -> tuple[mx.array, dict[str, mx.array]]:
    """A policy loss minus an entropy bonus: ``loss - entropy_coef * H`` with
    ``H = sum(m * entropy) / max(sum m, 1)``, the mean over the action tokens of the current
    policy's entropy (OpenRLHF's ``entropy_loss_coef``); ``H`` is differentiated, so the update
    also raises the entropy. A micro-batch with no action token (every row dropped by
    ``mask_truncated_completions``) has ``H = 0``, as the GRPO losses count it, not NaN.

    Args:
        loss: scalar policy loss; metrics: its metrics (``entropy`` is added).
        entropy: (B, T) per-token entropy of the current policy (differentiated).
        mask: (B, T), nonzero on action tokens.
        entropy_coef: finite, >= 0 (0: no bonus).

    Returns:
        ``(loss - entropy_coef * H, metrics + {"entropy": H})``.
    """
    check_token_arrays("entropy", entropy, mask=mask)
    if not 0.0 <= entropy_coef < math.inf:
        raise ValueError(
            f"entropy_coef must be a finite number >= 0 (0 for no entropy bonus), got "
            f"{entropy_coef}"
        )
    mean_entropy = _token_mean(entropy, valid_mask(mask))
    return loss - entropy_coef * mean_entropy, {**metrics, "entropy": mean_entropy}


def _weighted(per_token: mx.array, weights: mx.array | None) -> mx.array:
    """``w * l`` (the weights are rollout constants), or ``l`` itself when ``weights`` is None."""
    if weights is None:
        return per_token
    check_token_arrays("per_token", per_token, weights=weights)
    return per_token * mx.stop_gradient(weights.astype(mx.float32))


def _check_sequence_advantages(advantages: mx.array, logprobs: mx.array, what: str) -> None:
    if tuple(advantages.shape) != (logprobs.shape[0],):
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)} but logprobs has "
            f"{tuple(logprobs.shape)}; {what} takes one advantage per row, shape (B,)"
        )


def grpo_policy_loss(
    logprobs: mx.array,
    old_logprobs: mx.array,
    ref_logprobs: mx.array,
    advantages: mx.array,
    mask: mx.array,
    cliprange: float,
    beta: float,
    *,
    cliprange_high: float | None = None,
    loss_type: LossType = "bnpo",
    importance_sampling_level: ImportanceSamplingLevel = "token",
    max_completion_length: int | None = None,
    weights: mx.array | None = None,
) -> tuple[mx.array, dict[str, mx.array]]:
    """GRPO loss: clipped surrogate with one advantage per sequence, plus a k3 KL penalty per token.

    ``A_t = A_b`` for every token of row ``b``; the importance ratio is

    * ``importance_sampling_level="token"``: ``r_bt = exp(logp_bt - old_logp_bt)``;
    * ``"sequence"`` (GSPO, Zheng et al. 2025, as TRL): ``r_b = exp(sum_t m_bt (logp_bt -
      old_logp_bt) / n_b)``, the geometric mean of the token ratios, shared by the row's tokens;

    ``k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1``,
    ``l_bt = max(-A_b r, -A_b clip(r, 1 - cliprange, 1 + cliprange_high)) + beta k3_t``, and the
    loss is :func:`aggregate_loss` of ``l`` for ``loss_type``. The default (``"bnpo"``) is the
    mean over all action tokens of the micro-batch (long responses weigh more than in the
    per-sequence mean of the GRPO paper, ``"grpo"``). With ``"sequence"``, the token-summing
    types (``"dapo"``, ``"bnpo"``, ``"dr_grpo"``) weigh each sequence's loss by its length (TRL
    warns about this; the GSPO paper pairs it with ``"grpo"``).

    ``old_logprobs``, ``ref_logprobs`` and ``advantages`` are constants (wrapped in
    ``mx.stop_gradient`` here); only ``logprobs`` carries a gradient.

    Args:
        logprobs: (B, T) log-probs of the taken tokens under the current policy (differentiated).
        old_logprobs: (B, T) log-probs under the policy that generated the rollout.
        ref_logprobs: (B, T) log-probs under the frozen reference model.
        advantages: (B,) group-relative advantages, broadcast over each row's tokens.
        mask: (B, T), nonzero on action tokens (at least one, not checked: no host sync).
        cliprange: epsilon of the ratio clip (the lower one when ``cliprange_high`` is given).
        beta: weight of the KL term (0 disables it; ``kl`` is still reported).
        cliprange_high: upper epsilon (DAPO clip-higher, e.g. 0.28); None = ``cliprange``.
        loss_type: how token losses become the micro-batch's loss (:func:`aggregate_loss`).
        importance_sampling_level: ``"token"`` or ``"sequence"`` ratios (see above).
        max_completion_length: the generation budget, for ``loss_type="dr_grpo"``.
        weights: (B, T) per-token loss weights (module docstring); None = 1.

    Returns:
        ``(loss, metrics)``: scalar float32 loss; metrics (scalar float32 arrays) ``kl`` (masked
        mean of k3), ``clipfrac``, ``approxkl`` and ``ratio`` as in :func:`ppo_policy_loss`, and the
        ``clip_ratio/*`` fractions. Ratio metrics (``clipfrac``, ``ratio``, ``clip_ratio/*``) are
        token means, or with ``"sequence"`` means over the rows that have a valid token.
    """
    check_token_arrays(
        "logprobs", logprobs, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, mask=mask
    )
    _check_sequence_advantages(advantages, logprobs, "GRPO")
    upper = _upper_cliprange(cliprange, cliprange_high)
    if not beta >= 0:
        raise ValueError(f"beta (KL weight) must be >= 0, got {beta}")
    valid = valid_mask(mask)
    logprobs = logprobs.astype(mx.float32)
    # Rollout, reference and advantage values enter as constants.
    old_logprobs = mx.stop_gradient(old_logprobs.astype(mx.float32))
    ref_logprobs = mx.stop_gradient(ref_logprobs.astype(mx.float32))
    advantages = mx.stop_gradient(advantages.astype(mx.float32))[:, None]  # (B, 1)
    log_ratio = logprobs - old_logprobs  # (B, T)
    kl = kl_estimate(logprobs, ref_logprobs, "k3")  # (B, T)
    if importance_sampling_level == "token":
        per_token, clipped, ratio = _clipped_surrogate(log_ratio, advantages, cliprange, upper)
        if beta != 0:
            per_token = per_token + beta * kl
        per_token = _weighted(per_token, weights)
        ratio_rows = valid  # ratio metrics: means over the action tokens
    elif importance_sampling_level == "sequence":
        counts = mx.sum(valid.astype(mx.float32), axis=1, keepdims=True)  # (B, 1)
        token_log_ratio = mx.where(valid, _weighted(log_ratio, weights), 0.0)  # (B, T)
        seq_log_ratio = mx.sum(token_log_ratio, axis=1, keepdims=True) / mx.maximum(counts, 1.0)
        per_seq, clipped, ratio = _clipped_surrogate(seq_log_ratio, advantages, cliprange, upper)
        per_token = mx.broadcast_to(per_seq, log_ratio.shape)  # (B, T): each token its row's
        if beta != 0:
            per_token = per_token + _weighted(beta * kl, weights)
        ratio_rows = counts > 0  # (B, 1): ratio metrics are means over the rows with tokens
    else:
        raise ValueError(
            f"importance_sampling_level must be 'token' or 'sequence', got "
            f"{importance_sampling_level!r}"
        )
    indicators = _clip_indicators(ratio, advantages, cliprange, upper)
    loss = aggregate_loss(per_token, valid, loss_type, max_completion_length)
    metrics = {
        "kl": _token_mean(kl, valid),
        "clipfrac": _token_mean(clipped, ratio_rows),
        "approxkl": _token_mean(0.5 * log_ratio * log_ratio, valid),
        "ratio": _token_mean(ratio, ratio_rows),
    }
    metrics.update({key: _token_mean(value, ratio_rows) for key, value in indicators.items()})
    return loss, metrics


def rloo_policy_loss(
    logprobs: mx.array,
    old_logprobs: mx.array,
    advantages: mx.array,
    mask: mx.array,
    cliprange: float,
    *,
    cliprange_high: float | None = None,
    weights: mx.array | None = None,
) -> tuple[mx.array, dict[str, mx.array]]:
    """RLOO's loss as TRL's RLOOTrainer computes it: a clipped surrogate on whole sequences.

    ``r_b = exp(sum_t m_bt (logp_bt - old_logp_bt))``, the ratio of the sequence probabilities
    (a sum of log-ratios, not GSPO's mean), and
    ``loss = (1/B) sum_b max(-A_b r_b, -A_b clip(r_b, 1 - cliprange, 1 + cliprange_high))``. At
    ``r = 1`` its gradient is ``-(1/B) sum_b A_b grad log pi(y_b | x_b)``, the REINFORCE
    estimator with the leave-one-out baseline.

    ``old_logprobs`` and ``advantages`` are constants (wrapped in ``mx.stop_gradient`` here).

    Args:
        logprobs: (B, T) log-probs of the taken tokens under the current policy (differentiated).
        old_logprobs: (B, T) log-probs under the policy that generated the rollout.
        advantages: (B,) RLOO advantages (:func:`advantage.group_advantage.rloo_advantages`).
        mask: (B, T), nonzero on action tokens.
        cliprange: epsilon of the ratio clip (the lower one when ``cliprange_high`` is given).
        cliprange_high: upper epsilon; None = ``cliprange``.
        weights: (B, T) per-token weights of the log-ratios (module docstring); None = 1.

    Returns:
        ``(loss, metrics)``: scalar float32 loss; metrics (scalar float32 arrays): ``clipfrac``,
        ``ratio`` and ``clip_ratio/*`` over the sequences, ``approxkl`` (token mean of
        ``0.5 (logp - old_logp)^2``).
    """
    check_token_arrays("logprobs", logprobs, old_logprobs=old_logprobs, mask=mask)
    _check_sequence_advantages(advantages, logprobs, "RLOO")
    upper = _upper_cliprange(cliprange, cliprange_high)
    valid = valid_mask(mask)
    # Rollout quantities enter as constants.
    old_logprobs = mx.stop_gradient(old_logprobs.astype(mx.float32))
    advantages = mx.stop_gradient(advantages.astype(mx.float32))  # (B,)
    log_ratio = logprobs.astype(mx.float32) - old_logprobs  # (B, T)
    seq_log_ratio = mx.sum(mx.where(valid, _weighted(log_ratio, weights), 0.0), axis=1)  # (B,)
    per_seq, clipped, ratio = _clipped_surrogate(seq_log_ratio, advantages, cliprange, upper)
    metrics = {
        "clipfrac": mx.mean(clipped),
        "approxkl": _token_mean(0.5 * log_ratio * log_ratio, valid),
        "ratio": mx.mean(ratio),
    }
    for key, indicator in _clip_indicators(ratio, advantages, cliprange, upper).items():
        metrics[key] = mx.mean(indicator)
    return mx.mean(per_seq), metrics
