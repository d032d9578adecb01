"""Per-token log-probabilities of the chosen tokens, and per-token entropy, from logits.

Both functions take logits the caller has already scaled: sampling at temperature ``tau`` means the
policy is ``softmax(logits / tau)``, so divide by ``tau`` before calling (TRL and OpenRLHF do the same).
"""

from __future__ import annotations

import mlx.core as mx

from token_attribution.extractor import check_ndim

_HALF_DTYPES = (mx.float16, mx.bfloat16)


def _check_logits_tokens(logits: mx.array, tokens: mx.array) -> None:
    check_ndim("logits", logits, 3, "(B, T, V)")
    check_ndim("tokens", tokens, 2, "(B, T)")
    if tuple(tokens.shape) != tuple(logits.shape[:2]):
        raise ValueError(
            f"tokens has shape {tuple(tokens.shape)} but logits has {tuple(logits.shape)}; "
            f"tokens must be logits.shape[:2]"
        )
    if not mx.issubdtype(tokens.dtype, mx.integer):
        raise ValueError(f"tokens must be an integer array, got dtype {tokens.dtype}")


def _row_log_softmax_gather(row_logits: mx.array, row_tokens: mx.array) -> mx.array:
    """(T, V) logits, (T,) tokens -> (T,) float32 ``log_softmax(row_logits)[t, tokens[t]]``."""
    row = row_logits.astype(mx.float32)  # (T, V), the only float32 copy alive for this row
    chosen = mx.take_along_axis(row, row_tokens[:, None], axis=-1)[:, 0]  # (T,)
    return chosen - mx.logsumexp(row, axis=-1)


def selective_log_softmax(logits: mx.array, tokens: mx.array) -> mx.array:
    """Log-probability of each chosen token: ``log_softmax(logits)[b, t, tokens[b, t]]``.

    Naive equivalent (which materialises a second (B, T, V) array)::

        mx.take_along_axis(logits - mx.logsumexp(logits, -1, keepdims=True),
                           tokens[..., None], axis=-1)[..., 0]

    Here: ``logit[tokens] - logsumexp(logits)``, gathering one logit per position. float32 logits are
    handled in one shot; float16/bfloat16 logits are upcast to float32 one row (T, V) at a time, so the
    float32 copy never exceeds one sequence (logsumexp in half precision loses too much, as TRL notes).
    Temperature is the caller's job: pass ``logits / temperature``.

    Args:
        logits: (B, T, V) logits (any float dtype) at the positions that predict ``tokens``.
        tokens: (B, T) integer ids of the chosen tokens, each in ``[0, V)`` (not checked: that would
            need a host sync).

    Returns:
        (B, T) float32 log-probabilities. Differentiable w.r.t. ``logits``.
    """
    _check_logits_tokens(logits, tokens)
    if logits.dtype in _HALF_DTYPES:
        rows = [_row_log_softmax_gather(logits[b], tokens[b]) for b in range(logits.shape[0])]
        return mx.stack(rows, axis=0)  # (B, T)
    logits = logits.astype(mx.float32)
    chosen = mx.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0]  # (B, T)
    return chosen - mx.logsumexp(logits, axis=-1)  # (B, T)


def _row_entropy(row_logits: mx.array) -> mx.array:
    """(..., V) logits -> (...) float32 entropy ``logsumexp(l) - sum softmax(l) * l``."""
    row = row_logits.astype(mx.float32)
    probs = mx.softmax(row, axis=-1)
    return mx.logsumexp(row, axis=-1) - mx.sum(probs * row, axis=-1)


def entropy_from_logits(logits: mx.array) -> mx.array:
    """Entropy of the categorical distribution at each position.

    ``H = -sum_v p_v log p_v = logsumexp(l) - sum_v softmax(l)_v * l_v`` for logits ``l``.
    float16/bfloat16 logits are upcast to float32 one row (T, V) at a time. Temperature is the
    caller's job: pass ``logits / temperature`` to get the entropy of the sampling distribution.

    Args:
        logits: (B, T, V) logits, any float dtype.

    Returns:
        (B, T) float32 entropies (nats). Differentiable w.r.t. ``logits``.
    """
    check_ndim("logits", logits, 3, "(B, T, V)")
    if logits.dtype in _HALF_DTYPES:
        return mx.stack([_row_entropy(logits[b]) for b in range(logits.shape[0])], axis=0)
    return _row_entropy(logits)  # (B, T)
