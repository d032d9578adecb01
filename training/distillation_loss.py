"""Distillation losses: the student's next-token distribution moved toward a teacher's.

:func:`generalized_jsd_loss` is TRL's ``GKDTrainer.generalized_jsd_loss`` (Agarwal et al. 2024,
"On-Policy Distillation of Language Models", eq. 1) with its signature and semantics: per
vocabulary entry, then masked and reduced as TRL reduces. The teacher's logits are constants (a
frozen model's outputs, computed outside the differentiated function); the gradient flows into
the student's.

:func:`chunked_generalized_jsd` is the same divergence per position, computed from the two models'
last hidden states and LM heads a chunk of positions at a time, so that only one chunk's (chunk,
V) logits of either model exist at once (forward and backward): GKD's loss over a batch's
completion tokens without a (B, T, V) array.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Sequence, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

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
    jsd = _jsd_elements(log_s, log_t, beta)  # (B, T, V)
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


#: Logits per chunk of :func:`chunked_generalized_jsd` (positions x vocabulary) when no chunk
#: size is given: 2M float32 values, 8 MiB per (chunk, V) array; a chunk's element-wise
#: divergence holds a couple of dozen such arrays at its peak.
CHUNK_ELEMENTS = 1 << 21


def chunked_generalized_jsd(
    student_states: mx.array,
    teacher_states: mx.array,
    student_head: Callable[[mx.array], mx.array],
    teacher_head: Callable[[mx.array], mx.array],
    labels: mx.array | None = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> tuple[mx.array, mx.array | None]:
    """Per position, :func:`generalized_jsd_loss`'s divergence summed over the vocabulary, with
    the logits made from hidden states a chunk of positions at a time.

    For position ``n``, ``x_n = student_head(student_states[n])`` and ``z_n =
    teacher_head(teacher_states[n])`` are (V,) logits; ``jsd[n] = sum_v JSD_beta(softmax(z_n /
    temperature), softmax(x_n / temperature))_v`` (the elements of
    :func:`generalized_jsd_loss`), so ``jsd.mean()`` is its ``"batchmean"`` over those
    positions. The chunks run one after the other, forward and backward, and the backward pass
    recomputes a chunk's logits rather than keeping them (as ``mx.checkpoint`` does): peak
    memory grows with ``chunk_size * V``, not ``N * V``.

    Args:
        student_states: (N, D) the student's last hidden states (differentiated).
        teacher_states: (N, D') the teacher's (constants: no gradient flows into them).
        student_head: (c, D) -> (c, V) logits; a head with parameters must be an ``nn.Module``
            or a bound method of one (a tied embedding's ``as_linear``), whose trainable
            parameters then get their gradient through the checkpoint.
        teacher_head: (c, D') -> (c, V) logits (frozen).
        labels: (N,) token ids; also return the student's log-prob of each at ``temperature``
            (a policy-gradient term's). None: not.
        beta: 0 = forward KL, 1 = reverse KL, between them the generalized JSD.
        temperature: divides both models' logits before the softmax.
        chunk_size: positions per chunk; None = :data:`CHUNK_ELEMENTS` / V.

    Returns:
        ``(jsd, logprobs)``: (N,) float32, and (N,) float32 or None without ``labels``.
    """
    if student_states.ndim != 2 or teacher_states.ndim != 2:
        raise ValueError(
            f"hidden states must be (N, D), got {tuple(student_states.shape)} and "
            f"{tuple(teacher_states.shape)}"
        )
    n = student_states.shape[0]
    if teacher_states.shape[0] != n or (labels is not None and labels.shape != (n,)):
        raise ValueError(
            f"student states {tuple(student_states.shape)}, teacher states "
            f"{tuple(teacher_states.shape)} and labels "
            f"{None if labels is None else tuple(labels.shape)} must give the same N positions"
        )
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (0 forward KL, 1 reverse KL), got {beta}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}")
    teacher_states = mx.stop_gradient(teacher_states)
    targets = labels if labels is not None else mx.zeros((n,), dtype=mx.int32)

    def chunk(s: mx.array, t: mx.array, y: mx.array) -> tuple[mx.array, mx.array]:
        log_s = _log_softmax(student_head(s).astype(mx.float32) / temperature)  # (c, V)
        # The teacher's logits are constants.
        z = mx.stop_gradient(teacher_head(t).astype(mx.float32))  # (c, V)
        log_t = _log_softmax(z / temperature)  # (c, V)
        if log_s.shape != log_t.shape:
            raise ValueError(
                f"student logits {tuple(log_s.shape)} and teacher logits {tuple(log_t.shape)} "
                "differ: the two models must score the same vocabulary"
            )
        jsd = _jsd_elements(log_s, log_t, beta).sum(axis=-1)  # (c,)
        chosen = mx.take_along_axis(log_s, mx.stop_gradient(y)[:, None], axis=-1)[:, 0]  # (c,)
        return jsd, chosen

    if chunk_size is None:
        vocab = student_head(student_states[:1]).shape[-1]  # one row: the vocabulary's size
        chunk_size = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    if n == 0:
        empty = mx.zeros((0,), mx.float32)
        return empty, (None if labels is None else empty)
    spans = [(a, min(a + chunk_size, n)) for a in range(0, n, chunk_size)]
    run = _one_chunk_at_a_time(chunk, _module_of(student_head), spans)
    jsd_all, chosen_all = run(student_states, teacher_states, targets)
    return jsd_all, (chosen_all if labels is not None else None)


Chunk = Callable[[mx.array, mx.array, mx.array], tuple[mx.array, mx.array]]


def _one_chunk_at_a_time(
    chunk: Chunk, owner: Any, spans: list[tuple[int, int]]
) -> Callable[[mx.array, mx.array, mx.array], tuple[mx.array, mx.array]]:
    """``chunk`` over the rows ``spans`` of its three inputs, outputs concatenated, as a
    function whose forward and backward passes each run the chunks one after the other
    (``mx.depends`` orders them; MLX would otherwise evaluate them side by side) and keep
    none of a chunk's intermediates: the backward pass recomputes each chunk's forward, as
    ``mx.checkpoint`` does. The trainable parameters of ``owner`` (the student's head, an
    ``nn.Module``; None: none) are inputs, so they get their gradient."""
    flat = [] if owner is None else _flat(owner.trainable_parameters())
    names = [k for k, _ in flat]

    def call(values: list[mx.array], s: mx.array, t: mx.array, y: mx.array) -> Any:
        if names:  # the traced parameters, as nn.utils.checkpoint passes them
            owner.update(tree_unflatten(list(zip(names, values))))
        return chunk(s, t, y)

    @mx.custom_function
    def run(values: list[mx.array], s: mx.array, t: mx.array, y: mx.array) -> Any:
        outs: list[tuple[mx.array, mx.array]] = []
        for a, b in spans:
            rows = [s[a:b], t[a:b]]
            if outs:  # both models' rows wait for the chunk before
                rows = _after(rows, list(outs[-1]))
            outs.append(call(values, rows[0], rows[1], y[a:b]))
        return mx.concatenate([o[0] for o in outs]), mx.concatenate([o[1] for o in outs])

    @run.vjp
    def run_vjp(primals: Any, cotangents: Any, outputs: Any) -> Any:
        values, s, t, y = primals
        c_jsd, c_chosen = cotangents
        grads = [mx.zeros_like(v) for v in values]
        grad_rows: list[mx.array] = []
        for a, b in spans:
            rows, t_rows = s[a:b], t[a:b]
            if grad_rows:
                rows, t_rows = _after([rows, t_rows], [grad_rows[-1], *grads])
            y_rows = y[a:b]

            def piece(*args: mx.array) -> Any:
                return call(list(args[:-1]), args[-1], t_rows, y_rows)

            _, vjps = mx.vjp(piece, [*values, rows], [c_jsd[a:b], c_chosen[a:b]])
            grads = [g + d for g, d in zip(grads, vjps[:-1])]
            grad_rows.append(vjps[-1])
        return grads, mx.concatenate(grad_rows), mx.zeros_like(t), mx.zeros_like(y)

    values = [v for _, v in flat]

    def over_chunks(s: mx.array, t: mx.array, y: mx.array) -> tuple[mx.array, mx.array]:
        return cast(tuple[mx.array, mx.array], run(values, s, t, y))

    return over_chunks


def _flat(tree: Any) -> list[tuple[str, mx.array]]:
    return cast(list[tuple[str, mx.array]], tree_flatten(tree))


def _after(arrays: list[mx.array], before: list[mx.array]) -> list[mx.array]:
    """``arrays`` as they are, computed only once ``before`` are (``mx.depends``)."""
    return list(cast(Sequence[mx.array], mx.depends(arrays, before)))


def _module_of(head: Callable[[mx.array], mx.array]) -> Any:
    """The ``nn.Module`` whose parameters ``head`` uses: itself, or the owner of a bound
    method (a tied embedding's ``as_linear``); None for a plain function."""
    if isinstance(head, nn.Module):
        return head
    owner = getattr(head, "__self__", None)
    return owner if isinstance(owner, nn.Module) else None


def _jsd_elements(log_s: mx.array, log_t: mx.array, beta: float) -> mx.array:
    """The generalized JSD per vocabulary entry from the two log-softmaxes (shape of either)."""
    if beta == 0.0:
        return _kl_elements(log_t, log_s)
    if beta == 1.0:
        return _kl_elements(log_s, log_t)
    log_m = mx.logaddexp(log_s + np.log1p(-beta), log_t + np.log(beta))
    return beta * _kl_elements(log_t, log_m) + (1.0 - beta) * _kl_elements(log_s, log_m)


def _log_softmax(x: mx.array) -> mx.array:
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def _reduce(jsd: mx.array, reduction: str) -> mx.array:
    if reduction == "sum":
        return jsd.sum()
    if reduction == "mean":
        return jsd.mean()
    return jsd
