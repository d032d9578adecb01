"""Per-token log-probabilities of the chosen tokens, and per-token entropy, from logits.

Both functions take logits the caller has already scaled: sampling at temperature ``tau`` means the
policy is ``softmax(logits / tau)``, so divide by ``tau`` before calling (TRL and OpenRLHF do the same).
"""

from __future__ import annotations

from typing import cast

import mlx.core as mx

from base_setup import fast_math
from base_setup.plain import speed_tricks
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


@mx.custom_function
def _log_softmax_gather(logits: mx.array, tokens: mx.array) -> mx.array:
    """(..., V) logits, (...) tokens -> (...) float32 ``logits[tokens] - logsumexp(logits)``.

    Its gradient is written out, ``cot * (onehot(tokens) - softmax(logits))``, from the saved
    output (``softmax = exp(logits - logits[tokens] + out)``): one exp pass and a put along the
    token axis, instead of autodiff's second reduction and a scatter of the gather's cotangent
    into a (..., V) array of zeros (which made the backward pass of the LM head's log-probs
    three times its forward on the CPU).
    """
    x = logits.astype(mx.float32)  # (..., V), the only float32 copy alive
    chosen = mx.take_along_axis(x, tokens[..., None], axis=-1)  # (..., 1)
    return (chosen - fast_math.logsumexp(x, axis=-1, keepdims=True))[..., 0]


@_log_softmax_gather.vjp
def _log_softmax_gather_vjp(
    primals: list[mx.array], cotangent: mx.array, output: mx.array
) -> tuple[mx.array, mx.array]:
    logits, tokens = primals
    x = logits.astype(mx.float32)
    index = tokens[..., None]  # (..., 1)
    lse = mx.take_along_axis(x, index, axis=-1) - output[..., None]  # (..., 1)
    cot = cotangent.astype(mx.float32)[..., None]  # (..., 1)
    grad = -cot * fast_math.exp_shifted(x, lse)  # (..., V): -cot * softmax
    grad = mx.put_along_axis(grad, index, mx.take_along_axis(grad, index, axis=-1) + cot, axis=-1)
    return grad.astype(logits.dtype), mx.zeros_like(tokens)


def _row_log_softmax_gather(row_logits: mx.array, row_tokens: mx.array) -> mx.array:
    """(T, V) logits, (T,) tokens -> (T,) float32 ``log_softmax(row_logits)[t, tokens[t]]``."""
    return cast(mx.array, _log_softmax_gather(row_logits, row_tokens))


def selective_log_softmax(logits: mx.array, tokens: mx.array) -> mx.array:
    """Log-probability of each chosen token: ``log_softmax(logits)[b, t, tokens[b, t]]``.

    Naive equivalent (which materialises a second (B, T, V) array)::

        mx.take_along_axis(logits - mx.logsumexp(logits, -1, keepdims=True),
                           tokens[..., None], axis=-1)[..., 0]

    Here: ``logit[tokens] - logsumexp(logits)``, gathering one logit per position, with a
    hand-written gradient ``cot * (onehot(tokens) - softmax(logits))``. float32 logits are
    handled in one shot; float16/bfloat16 logits are upcast to float32 one row (T, V) at a time,
    so the float32 copy never exceeds one sequence (logsumexp in half precision loses too much,
    as TRL notes). Under plain MLX and off the CPU (:func:`base_setup.plain.speed_tricks`) it is
    the naive equivalent, in float32. Temperature is the caller's job: pass
    ``logits / temperature``.

    Args:
        logits: (B, T, V) logits (any float dtype) at the positions that predict ``tokens``.
        tokens: (B, T) integer ids of the chosen tokens, each in ``[0, V)`` (not checked: that would
            need a host sync).

    Returns:
        (B, T) float32 log-probabilities. Differentiable w.r.t. ``logits``.
    """
    _check_logits_tokens(logits, tokens)
    if not speed_tricks():  # plain MLX, a GPU: log_softmax, gather, autodiff's gradient
        x = logits.astype(mx.float32)  # (B, T, V)
        logp = x - mx.logsumexp(x, axis=-1, keepdims=True)
        return mx.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]  # (B, T)
    if logits.dtype in _HALF_DTYPES:
        rows = [_row_log_softmax_gather(logits[b], tokens[b]) for b in range(logits.shape[0])]
        return mx.stack(rows, axis=0)  # (B, T)
    return cast(mx.array, _log_softmax_gather(logits, tokens))  # (B, T)


def _row_entropy(row_logits: mx.array) -> mx.array:
    """(..., V) logits -> (...) float32 entropy ``logsumexp(l) - sum softmax(l) * l``."""
    row = row_logits.astype(mx.float32)
    probs = fast_math.softmax(row, axis=-1)
    return fast_math.logsumexp(row, axis=-1) - mx.sum(probs * row, axis=-1)


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
