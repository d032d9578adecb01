"""Distillation losses: the student's next-token distribution moved toward a teacher's.

:func:`generalized_jsd_loss` is TRL's ``GKDTrainer.generalized_jsd_loss`` (Agarwal et al. 2024,
"On-Policy Distillation of Language Models", eq. 1) with its signature and semantics: per
vocabulary entry, then masked and reduced as TRL reduces. The teacher's logits are constants (a
frozen model's outputs, computed outside the differentiated function); the gradient flows into
the student's.
"""

from __future__ import annotations

from typing import Literal

import mlx.core as mx
import numpy as np

#: TRL's ignore index: a label of -100 leaves its position out of the loss.
IGNORE_INDEX = -100

JSDReduction = Literal["batchmean", "sum", "mean", "none"]


def _kl_elements(log_p: mx.array, log_q: mx.array) -> mx.array:
    """``p (log p - log q)`` per vocabulary entry (torch's ``kl_div(log_q, log_p,
    log_target=True)``): summed over the last axis it is ``KL(p || q)``."""
    return mx.exp(log_p) * (log_p - log_q)


def generalized_jsd_loss(
    student_logits: mx.array,
    teacher_logits: mx.array,
    labels: mx.array | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: JSDReduction = "batchmean",
) -> mx.array:
    """Generalized Jensen-Shannon divergence between the teacher's and the student's token
    distributions, TRL's ``GKDTrainer.generalized_jsd_loss``.

    With ``S = softmax(student_logits / temperature)``, ``T = softmax(teacher_logits /
    temperature)`` and the mixture ``M = beta T + (1 - beta) S``, per position and vocabulary
    entry ``v``::

        beta = 0:   T_v (log T_v - log S_v)                      (summed over v: KL(T || S), forward)
        beta = 1:   S_v (log S_v - log T_v)                      (KL(S || T), reverse)
        otherwise:  beta T_v log(T_v / M_v) + (1 - beta) S_v log(S_v / M_v)

    Args:
        student_logits: (B, T, V) the student's logits at the positions that predict the tokens.
        teacher_logits: (B, T, V) the teacher's, same positions and vocabulary (constants).
        labels: (B, T) token ids with ``-100`` where a position is left out (padding, the
            prompt); None: every position counts.
        beta: 0 = forward KL, 1 = reverse KL, between them the generalized JSD.
        temperature: divides both models' logits before the softmax.
        reduction: ``"batchmean"`` (the sum over kept positions and the vocabulary divided by
            the number of kept positions, at least 1; without labels by ``B``), ``"sum"``,
            ``"mean"`` (over every kept element, vocabulary entries included, as torch's
            ``mean``), ``"none"`` (the per-entry divergence: (N, V) for the N kept positions
            with labels, else (B, T, V)).

    Returns:
        A float32 scalar, or the per-entry array with ``reduction="none"``.

    Raises:
        ValueError: shapes that differ, ``beta`` outside [0, 1], a temperature <= 0 or an
            unknown reduction.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits "
            f"{tuple(teacher_logits.shape)} differ: the two models must score the same "
            "positions over the same vocabulary"
        )
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (0 forward KL, 1 reverse KL), got {beta}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if reduction not in ("batchmean", "sum", "mean", "none"):
        raise ValueError(f"reduction must be batchmean, sum, mean or none, got {reduction!r}")
    log_s = _log_softmax(student_logits.astype(mx.float32) / temperature)  # (B, T, V)
    log_t = _log_softmax(teacher_logits.astype(mx.float32) / temperature)  # (B, T, V)
    if beta == 0.0:
        jsd = _kl_elements(log_t, log_s)
    elif beta == 1.0:
        jsd = _kl_elements(log_s, log_t)
    else:
        log_m = mx.logaddexp(log_s + np.log1p(-beta), log_t + np.log(beta))
        jsd = beta * _kl_elements(log_t, log_m) + (1.0 - beta) * _kl_elements(log_s, log_m)
    if labels is None:
        if reduction == "batchmean":
            return jsd.sum() / max(jsd.shape[0], 1)
        return _reduce(jsd, reduction)
    if labels.shape != jsd.shape[:2]:
        raise ValueError(f"labels {tuple(labels.shape)} do not match logits {tuple(jsd.shape)}")
    keep = labels != IGNORE_INDEX  # (B, T)
    if reduction == "none":  # TRL's jsd[mask]: the kept positions' rows, in order
        rows = np.flatnonzero(np.asarray(keep).reshape(-1))
        return jsd.reshape(-1, jsd.shape[-1])[mx.array(rows)]
    masked = jsd * keep[..., None].astype(jsd.dtype)
    kept = keep.astype(mx.float32).sum()
    if reduction == "batchmean":
        return masked.sum() / mx.maximum(kept, 1.0)
    if reduction == "sum":
        return masked.sum()
    return masked.sum() / (kept * jsd.shape[-1])  # mean over kept elements (NaN if none, as torch)


def _log_softmax(x: mx.array) -> mx.array:
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def _reduce(jsd: mx.array, reduction: str) -> mx.array:
    if reduction == "sum":
        return jsd.sum()
    if reduction == "mean":
        return jsd.mean()
    return jsd
