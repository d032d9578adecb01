"""Fast exp, sigmoid, SiLU, softmax, logsumexp, attention, RMSNorm and RoPE for MLX's CPU backend.

Why: on Linux, MLX's CPU backend evaluates transcendental functions (``exp``, ``sigmoid``,
``softmax``, ``logsumexp``, ``tanh``, ``sqrt``) one element at a time through scalar library
calls, dozens of times slower per element than ``+`` or ``*``, so in a small transformer the
SwiGLU activation and the attention softmax take much of a forward pass (docs/performance.md).

How: ``exp`` is rebuilt from operations MLX evaluates fast, fused by ``mx.compile`` into three
C++ loops (the clamp, ``2^f``, the bits of ``2^n``) and a multiply that fuses with the consumer::

    exp(x) = 2^y,  y = clip(x * log2(e), -127, 127),  n = round(y),  f = y - n in [-1/2, 1/2]
    2^f    = sum_{k=0..7} (f ln 2)^k / k!        (Taylor; truncation error < 6e-9 relative)
    2^n    = the float32 whose exponent bits are n + 127 (0 for n = -127: exp(-inf) = 0)

Within 2e-7 relative error of float64's ``exp`` (float32 rounding is 6e-8; the tests check
both), at a fraction of ``mx.exp``'s time on the CPU (docs/performance.md). NaN stays NaN;
``+inf`` saturates at about 1.7e38, and results below 2^-127 (x < -88, float32's denormals) are
0. Every function built on this ``exp`` computes in float32 and returns the input's dtype; its
gradient is written out (``mx.custom_function``), not differentiated through the bit tricks.

RMSNorm and RoPE have no CPU kernels in MLX, only composed fallbacks of many small ops; here
each is one compiled function of MLX's own formula (:func:`rms_norm`, :func:`rope`: the same bits
and dtypes, differentiated by MLX itself), which matters where per-op overhead dominates: a
decoding step of a small model.

Faster still: on Linux the SwiGLU, the attention's softmax (forward and gradient) and a large
RMSNorm run through native kernels (:mod:`base_setup.native`), the same float32 arithmetic in
one pass over the run's threads, the same bits (RMSNorm's gradient is MLX's formula with its
own order of sums: float rounding against MLX's).

Where: :func:`base_setup.fast_layers.accelerate_model` gives the layers of one model instance (the models this project
loads: ``PolicyModel``, ``ScalarHeadModel``) fast subclasses of their classes: mlx-lm's MLP and
attention layers call :func:`swiglu` and :func:`scaled_dot_product_attention` (at one query
position, a decoding step, :func:`one_query_attention`: one compiled function, or in a model the
few-row kernel serves one native kernel), ``nn.RMSNorm`` /
``nn.RoPE`` :func:`rms_norm` / :func:`rope` (all fall back to MLX's own functions on a GPU
device). No module of mlx-lm is changed, so a model loaded with ``mlx_lm.load`` runs mlx-lm's own
code. The log-prob code calls :func:`logsumexp` / :func:`softmax`. Only on the CPU backend of a
Linux/x86 build is it worth it; :func:`fast_math_enabled` decides, ``PPO_MLX_FAST_MATH=0`` turns
every function off (MLX's own functions everywhere), and a config's ``fast_math: false`` keeps
the run's models on mlx-lm's layers (docs/environment.md).
"""

from __future__ import annotations

import logging
import math
import os
from contextlib import AbstractContextManager
from typing import Any, Callable, cast

import mlx.core as mx
import numpy as np

from base_setup.plain import counted_scope, speed_tricks

logger = logging.getLogger("ppo_mlx")

_LOG2E = 1.4426950408889634
# Adding then subtracting 1.5 * 2^23 rounds a float32 of magnitude < 2^22 to the nearest integer.
_ROUND_MAGIC = 12582912.0
# Taylor coefficients of 2^f = exp(f ln 2): (ln 2)^k / k!, k = 0..7.
_EXP2_COEFFS = tuple(math.log(2.0) ** k / math.factorial(k) for k in range(8))
_ENV = "PPO_MLX_FAST_MATH"
# Below these many elements MLX's own SwiGLU / attention are used: the slow exp costs little there,
# and one native kernel beats the fast versions' several (crossovers in
# benchmarks/results/HISTORY.md).
_MIN_FAST_SWIGLU = 1 << 11
_MIN_FAST_ATTENTION = 1 << 12
# From these many elements RoPE is a custom function whose gradient is written out (the rotation
# by the opposite angle); below (a decoding step, never differentiated) MLX differentiates the
# compiled rotation.
_MIN_ROPE_CUSTOM_GRAD = 1 << 16
# What a masked attention score becomes, as in MLX: finite, so a fully masked row is uniform.
_FLOAT32_MIN = float(np.finfo(np.float32).min)


@mx.compile
def _exp2_exponent(x: mx.array) -> mx.array:
    """``y = clip(x * log2(e), -127, 127)`` in float32 (the exponent of ``exp(x) = 2^y``)."""
    y = x.astype(mx.float32) * _LOG2E
    # Clamp with selects, not mx.clip: MLX's maximum / minimum test for NaN in the element loop,
    # which slows the kernel (NaN stays NaN either way). The selects keep gcc
    # from vectorizing the loop, so they are a kernel of their own, ahead of the arithmetic.
    y = mx.where(y > 127.0, 127.0, y)
    return mx.where(y < -127.0, -127.0, y)


@mx.compile
def _exp2_fraction(y: mx.array) -> mx.array:
    """``2^f`` for ``f = y - round(y)`` in [-1/2, 1/2]: the Taylor polynomial as pairs
    ``c_k + c_(k+1) f`` in powers of ``f^2``, a shallower graph than Horner's scheme (MLX fuses a
    graph only up to a depth; Horner's becomes two loops)."""
    f = y - ((y + _ROUND_MAGIC) - _ROUND_MAGIC)
    f2 = f * f
    c = _EXP2_COEFFS
    q = c[6] + c[7] * f
    for k in (4, 2, 0):
        q = (c[k] + c[k + 1] * f) + q * f2
    return q


@mx.compile
def _exp2_bits(y: mx.array) -> mx.array:
    """The int32 bits of the float32 ``2^round(y)`` for ``y`` in [-127, 127]: the exponent field
    ``round(y) + 127`` (0 for -127: exp(-inf) = 0). It rounds ``y`` again rather than take the
    rounding from :func:`_exp2_fraction`: an array with a consumer outside its loop ends MLX's
    fusion, and one more pass over memory costs more than the two additions."""
    return (((y + _ROUND_MAGIC) - _ROUND_MAGIC).astype(mx.int32) + 127) << 23


def _exp2_parts(x: mx.array) -> tuple[mx.array, mx.array]:
    """``(2^f, 2^n)``, float32, with ``exp(x) = 2^f * 2^n`` (module docstring): three loops, each
    a compiled function of its own. MLX fuses an element-wise graph only up to a depth and only
    through arrays whose every consumer is in the same loop, and no loop through the bit view;
    one compiled function for all of it becomes four loops with the selects in the longest, which
    gcc then leaves scalar."""
    y = _exp2_exponent(x)
    return _exp2_fraction(y), _exp2_bits(y).view(mx.float32)


# The consumers of the parts: fused loops of their own (the bit view ends a fused loop).
_exp_c = mx.compile(lambda p, s: p * s)
_sigmoid_c = mx.compile(lambda p, s: 1.0 / (1.0 + p * s))  # from the parts of exp(-x)
_swiglu_c = mx.compile(lambda g, u, p, s: g.astype(mx.float32) * u / (1.0 + p * s))


@mx.compile
def _swiglu_grad(
    g: mx.array, u: mx.array, p: mx.array, s: mx.array, cot: mx.array
) -> tuple[mx.array, ...]:
    """d/dg and d/du of silu(g) * u, with sigmoid(g) = 1 / (1 + p s) from the parts ``(p, s)`` of
    exp(-g) (one loop): silu'(g) = sigmoid (1 + g (1 - sigmoid))."""
    g32 = g.astype(mx.float32)
    sig = 1.0 / (1.0 + p * s)
    d_gate = cot * u * sig * (1.0 + g32 * (1.0 - sig))
    d_up = cot * g32 * sig
    return d_gate.astype(g.dtype), d_up.astype(u.dtype)


def exp(x: mx.array) -> mx.array:
    """``exp(x)`` elementwise (float32 math, ``x``'s float dtype out); ``mx.exp`` where fast math
    is off (off the CPU, ``PPO_MLX_FAST_MATH=0``, or no compiler for MLX's kernels). Not
    differentiable: use it on constants, or inside a function with its own vjp."""
    if not fast_math_enabled():
        return mx.exp(x.astype(mx.float32)).astype(_float_dtype(x))
    return _fast_exp(x)


def _fast_exp(x: mx.array) -> mx.array:
    return _exp_c(*_exp2_parts(x)).astype(_float_dtype(x))


@mx.compile
def _shifted_exponent(x: mx.array, m: mx.array) -> mx.array:
    """``y = max((x - m) log2(e), -127)``: the exponent of ``exp(x - m) = 2^y`` for ``x <= m``
    (a row's max or logsumexp: no upper clamp), fused with the subtraction (one loop)."""
    y = (x - m) * _LOG2E
    return mx.where(y < -127.0, -127.0, y)


@mx.compile
def _exp2_fraction_times(y: mx.array, s: mx.array) -> mx.array:
    """``2^f * s`` (:func:`_exp2_fraction` times the float ``2^n``): the polynomial and the
    product in one loop."""
    return _exp2_fraction(y) * s


def _exp_shifted(x: mx.array, m: mx.array) -> mx.array:
    """``exp(x - m)`` for float32 ``x <= m`` (``m`` broadcast: a row's max) in three loops, the
    same polynomial as :func:`exp`."""
    y = _shifted_exponent(x, m)
    return _exp2_fraction_times(y, _exp2_bits(y).view(mx.float32))


def exp_shifted(x: mx.array, m: mx.array) -> mx.array:
    """``exp(x - m)`` elementwise for ``x <= m`` (``m`` broadcast: a row's max or logsumexp),
    float32 math, ``x``'s float dtype out: :func:`exp` of the difference bit for bit, one pass
    fewer (the subtraction is fused into the exponent's loop). Where ``x - m`` is NaN (``m``
    infinite) the result is NaN, as with :func:`exp`. Not differentiable (see :func:`exp`)."""
    if not fast_math_enabled():
        return exp(x - m)
    return _exp_shifted(x, m).astype(_float_dtype(x))


def sigmoid(x: mx.array) -> mx.array:
    """``1 / (1 + exp(-x))`` elementwise, float32. Not differentiable (see :func:`exp`)."""
    return _sigmoid_c(*_exp2_parts(-x.astype(mx.float32)))


@mx.custom_function
def _swiglu_fast(gate: mx.array, x: mx.array) -> mx.array:
    kernels = _native(gate, x)
    if kernels is not None:  # the same arithmetic in one pass over the run's threads
        return cast(mx.array, kernels.swiglu(gate, x))
    return _swiglu_c(gate, x, *_exp2_parts(-gate.astype(mx.float32))).astype(x.dtype)


@_swiglu_fast.vjp
def _swiglu_fast_vjp(primals: Any, cotangent: mx.array, output: mx.array) -> tuple[mx.array, ...]:
    gate, x = primals
    kernels = _native(gate, x, cotangent)
    if kernels is not None:
        return tuple(kernels.swiglu_grad(gate, x, cotangent))
    return _swiglu_grad(
        gate, x, *_exp2_parts(-gate.astype(mx.float32)), cotangent.astype(mx.float32)
    )


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """``silu(gate) * x`` (mlx-lm's ``swiglu``), differentiable; MLX's own off the CPU."""
    if gate.size < _MIN_FAST_SWIGLU or not fast_math_enabled():
        return _mlx_swiglu(gate, x)
    return cast(mx.array, _swiglu_fast(gate, x))


def _softmax_impl(x: mx.array, axis: int) -> mx.array:
    x32 = x.astype(mx.float32)
    e = _exp_shifted(x32, mx.max(x32, axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def softmax(x: mx.array, axis: int = -1) -> mx.array:
    """``softmax(x)`` along ``axis`` in float32 (differentiable); MLX's own off the CPU.

    A row of ``-inf`` only gives NaN, as ``mx.softmax`` does; attention masks use a finite
    minimum instead (see :func:`scaled_dot_product_attention`).
    """
    if not fast_math_enabled():
        return mx.softmax(x.astype(mx.float32), axis=axis)
    return _softmax_fn(axis)(x)


def logsumexp(x: mx.array, axis: int = -1, keepdims: bool = False) -> mx.array:
    """``log(sum(exp(x)))`` along ``axis`` in float32 (differentiable); MLX's own off the CPU.

    Gradient: ``softmax(x)`` times the cotangent. The ``log`` of the reduced sum stays MLX's
    (it runs on one value per row).
    """
    if not fast_math_enabled():
        return mx.logsumexp(x.astype(mx.float32), axis=axis, keepdims=keepdims)
    out = _logsumexp_fn(axis)(x)
    return out if keepdims else out.squeeze(axis)


_SOFTMAX_FNS: dict[int, Callable[[mx.array], mx.array]] = {}
_LOGSUMEXP_FNS: dict[int, Callable[[mx.array], mx.array]] = {}


def _softmax_fn(axis: int) -> Callable[[mx.array], mx.array]:
    """The differentiable fast softmax along ``axis`` (one custom function per axis)."""
    if axis not in _SOFTMAX_FNS:

        @mx.custom_function
        def fn(x: mx.array) -> mx.array:
            return _softmax_impl(x, axis)

        @fn.vjp
        def fn_vjp(primals: Any, cotangent: mx.array, output: mx.array) -> mx.array:
            x = _single(primals)
            c = cotangent.astype(mx.float32)
            grad = output * (c - (c * output).sum(axis=axis, keepdims=True))
            return grad.astype(_float_dtype(x))

        _SOFTMAX_FNS[axis] = cast(Callable[[mx.array], mx.array], fn)
    return _SOFTMAX_FNS[axis]


def _logsumexp_parts(x32: mx.array, axis: int) -> tuple[mx.array, mx.array, mx.array]:
    """(logsumexp, exp(x - m), their sum), keepdims, of float32 ``x32``; ``m`` is the row max
    (0 for a row of -inf: -inf - -inf would be NaN)."""
    m = mx.stop_gradient(mx.max(x32, axis=axis, keepdims=True))
    m = mx.where(mx.isinf(m), 0.0, m)
    shifted_exp = exp(x32 - m)
    total = shifted_exp.sum(axis=axis, keepdims=True)
    return m + mx.log(total), shifted_exp, total


def logsumexp_parts(x: mx.array, axis: int = -1) -> tuple[mx.array, mx.array, mx.array]:
    """``(logsumexp(x), w, w.sum(axis))``, keepdims, in float32, where ``w = exp(x - max)`` is
    proportional to ``softmax(x)``: for code that needs the log-probs (``x - lse``) and the
    probabilities both, with one ``exp`` pass. Not differentiable.

    ``lse`` is bit for bit :func:`logsumexp` (MLX's own off the CPU), so ``x[i] - lse`` equals
    what the training losses compute from the same logits.
    """
    x32 = x.astype(mx.float32)
    if not fast_math_enabled():
        lse = mx.logsumexp(x32, axis=axis, keepdims=True)
        probs = mx.exp(x32 - lse)
        return lse, probs, probs.sum(axis=axis, keepdims=True)
    return _logsumexp_parts(x32, axis)


def _logsumexp_fn(axis: int) -> Callable[[mx.array], mx.array]:
    """The differentiable fast logsumexp along ``axis``, keepdims (one per axis)."""
    if axis not in _LOGSUMEXP_FNS:

        @mx.custom_function
        def fn(x: mx.array) -> mx.array:
            return _logsumexp_parts(x.astype(mx.float32), axis)[0]

        @fn.vjp
        def fn_vjp(primals: Any, cotangent: mx.array, output: mx.array) -> mx.array:
            x = _single(primals)
            probs = exp_shifted(x.astype(mx.float32), output)  # softmax(x)
            return (cotangent.astype(mx.float32) * probs).astype(_float_dtype(x))

        _LOGSUMEXP_FNS[axis] = cast(Callable[[mx.array], mx.array], fn)
    return _LOGSUMEXP_FNS[axis]


def scaled_dot_product_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    mask: mx.array | str | None = None,
) -> mx.array:
    """``softmax(q k^T * scale + mask) v`` with grouped keys/values, softmax in float32.

    The same contract as ``mx.fast.scaled_dot_product_attention`` (without sinks): ``queries``
    (B, H, L, D), ``keys`` (B, Hkv, S, D), ``values`` (B, Hkv, S, Dv) with ``H`` a multiple of
    ``Hkv``; ``mask`` None, ``"causal"`` (query ``i`` sees keys ``j <= i + S - L``), a boolean
    array (True: attend) or an additive float array, broadcastable to (B, H, L, S). Masked
    scores become float32's finite minimum, as in MLX, so a fully masked row (a left-padding
    position) averages the values instead of giving NaN. Returns (B, H, L, Dv).

    In float32 with the fast math on, the mask is added by the scores' matmul itself
    (``addmm``) and the softmax is not normalised before the values' matmul, which sums the
    weights too (a column of ones beside the values): :func:`_attention_fn`, fewer passes over
    the (L, S) scores. With it off, MLX's own softmax (as :func:`softmax`).
    """
    b, h, length, d = queries.shape
    hkv, s = keys.shape[1], keys.shape[2]
    if h % hkv:
        raise ValueError(f"{h} query heads is not a multiple of {hkv} key/value heads")
    rep = h // hkv
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"mask must be None, 'causal' or an array, got {mask!r}")
        rows = mx.arange(length)[:, None] + (s - length)  # (L, 1)
        mask = rows >= mx.arange(s)[None, :]  # (L, S)
    m = None
    if mask is not None:
        m = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))  # (B|1, H|1, L|1, S)
        if m.shape[1] == 1:
            m = m[:, :, None]  # (B|1, 1, 1, L|1, S)
        else:
            m = m.reshape(m.shape[0], hkv, rep, *m.shape[2:])  # (B|1, Hkv, R, L|1, S)
    if fast_math_enabled() and queries.dtype == keys.dtype == values.dtype == mx.float32:
        if m is None:
            bias = mx.zeros((1, 1, 1, 1, 1))
        elif m.dtype == mx.bool_:
            bias = mx.where(m, 0.0, _FLOAT32_MIN)
        else:
            bias = m.astype(mx.float32)
        q = queries.reshape(b, hkv, rep, length, d)  # (B, Hkv, R, L, D)
        out = _attention_fn(float(scale))(q, keys, values, bias)[0]  # (B, Hkv, R, L, Dv)
        return cast(mx.array, out).reshape(b, h, length, values.shape[-1])
    q = (queries * scale).reshape(b, hkv, rep, length, d)  # (B, Hkv, R, L, D)
    scores = (q @ keys[:, :, None].swapaxes(-1, -2)).astype(mx.float32)  # (B, Hkv, R, L, S)
    if m is not None:
        if m.dtype == mx.bool_:
            scores = mx.where(m, scores, _FLOAT32_MIN)
        else:
            scores = scores + m.astype(mx.float32)
    weights = softmax(scores, axis=-1).astype(values.dtype)  # (B, Hkv, R, L, S)
    out = weights @ values[:, :, None]  # (B, Hkv, R, L, Dv)
    return out.reshape(b, h, length, values.shape[-1])


@mx.compile
def _attention_scores_grad(
    e: mx.array, d_weighted: mx.array, delta: mx.array, seen: mx.array
) -> mx.array:
    """``e * (d_weighted - delta) * seen``: the softmax's input gradient from unnormalised
    weights ``e`` and the cotangent divided by their sum, 0 on rows not ``seen`` (one loop)."""
    return e * (d_weighted - delta) * seen


_ATTENTION_FNS: dict[float, Callable[..., Any]] = {}


def _attention_fn(scale: float) -> Callable[..., Any]:
    """The float32 attention core for ``scale`` (one custom function per scale):
    ``(q, keys, values, bias) -> (out, e, 1 / total, row_max)``.

    ``q`` (B, Hkv, R, L, D), ``keys`` (B, Hkv, S, D), ``values`` (B, Hkv, S, Dv), ``bias``
    additive, broadcastable to (B, Hkv, R, L, S). Forward::

        scores = addmm(bias, q, k^T, alpha=scale)       (B, Hkv, R, L, S)
        e      = exp(scores - rowmax(scores))            unnormalised weights
        [o | total] = e @ [v | 1]                         the values' sums and the weights' sum
        out    = o * (1 / total)                         (B, Hkv, R, L, Dv)

    The gradient flows through ``out`` only (the other outputs are what its vjp reads; the
    bias is a constant), written out from ``e`` as flash attention's backward does::

        d' = d_out / total,  w = d' v^T,  delta = rowsum(e * w) / total  (= rowsum(d' * out))
        dv = e^T d',  d_scores = e * (w - delta),  dq = scale d_scores k,  dk = scale d_scores^T q

    with the grouped heads ``R`` folded into the rows (so dk and dv sum over them), and
    ``d_scores`` 0 on rows whose every score is masked (``row_max`` the mask's minimum), as
    MLX's select-masked softmax gives. For its vjp it keeps ``e``, as a softmax keeps its
    weights, and not ``out`` (``delta`` from ``out`` would save a pass over ``e``, but keep
    ``out`` of every layer until the backward: 4% more memory at SmolLM2-135M's gradient).
    """
    if scale not in _ATTENTION_FNS:

        @mx.custom_function
        def fn(
            q: mx.array, keys: mx.array, values: mx.array, bias: mx.array
        ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
            scores = mx.addmm(bias, q, keys[:, :, None].swapaxes(-1, -2), alpha=scale)
            kernels = _native(scores)
            if kernels is not None:  # the row max and the exp in one pass over each row
                e, row_max = kernels.row_exp(scores)
            else:
                row_max = mx.max(scores, axis=-1, keepdims=True)  # (B, Hkv, R, L, 1)
                e = _exp_shifted(scores, row_max)  # (B, Hkv, R, L, S)
            ones = mx.ones((*values.shape[:-1], 1), dtype=values.dtype)  # (B, Hkv, S, 1)
            summed = e @ mx.concatenate([values, ones], axis=-1)[:, :, None]  # (B, Hkv, R, L, Dv+1)
            # 1 / sum, a new array: a slice of ``summed`` would keep all of it for the vjp
            inv_total = 1.0 / summed[..., -1:]  # (B, Hkv, R, L, 1)
            return summed[..., :-1] * inv_total, e, inv_total, row_max

        @fn.vjp
        def fn_vjp(
            primals: Any, cotangents: Any, outputs: Any
        ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
            q, keys, values, bias = primals
            _, e, inv_total, row_max = outputs
            b, hkv, rep, length, s = e.shape
            d, dv = q.shape[-1], values.shape[-1]
            d_scaled = cotangents[0].astype(mx.float32) * inv_total  # (B, Hkv, R, L, Dv)
            # A row whose every score was masked (its max is the mask's minimum) averages the
            # values whatever the scores: no gradient reaches them, as with a select.
            seen = (row_max > _FLOAT32_MIN).astype(mx.float32)  # (B, Hkv, R, L, 1)
            rows = rep * length
            e_rows = e.reshape(b, hkv, rows, s)
            d_rows = d_scaled.reshape(b, hkv, rows, dv)
            d_values = e_rows.swapaxes(-1, -2) @ d_rows  # (B, Hkv, S, Dv)
            d_weighted = d_rows @ values.swapaxes(-1, -2)  # (B, Hkv, R*L, S)
            inv_rows, seen_rows = inv_total.reshape(b, hkv, rows, 1), seen.reshape(b, hkv, rows, 1)
            # (B, Hkv, R*L, S), without the scale: it multiplies the smaller (., D) products
            kernels = _native(e_rows, d_weighted)
            if kernels is not None:  # delta and d_scores in one pass over each row
                d_scores = kernels.attention_scores_grad(e_rows, d_weighted, inv_rows, seen_rows)
            else:
                # rowsum(d' * out) from e, so that out is not kept for the vjp (docstring)
                delta = (e_rows * d_weighted).sum(axis=-1, keepdims=True) * inv_rows
                d_scores = _attention_scores_grad(e_rows, d_weighted, delta, seen_rows)
            d_q = ((d_scores @ keys) * scale).reshape(b, hkv, rep, length, d)
            q_rows = q.reshape(b, hkv, rows, d) * scale
            d_keys = d_scores.swapaxes(-1, -2) @ q_rows  # (B, Hkv, S, D)
            return d_q, d_keys, d_values, mx.zeros_like(bias)

        _ATTENTION_FNS[scale] = fn
    return _ATTENTION_FNS[scale]


def _one_query_scores(q: mx.array, keys: mx.array, mask: mx.array, scale: mx.array) -> mx.array:
    """``q k^T * scale + mask``, float32 (B, Hkv, R, S), for grouped queries ``q`` (B, Hkv, R, D)
    and ``keys`` (B, Hkv, S, D); ``mask`` boolean (True: attend) or additive, broadcastable."""
    scores = ((q * scale) @ keys.swapaxes(-1, -2)).astype(mx.float32)  # (B, Hkv, R, S)
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, _FLOAT32_MIN)
    return scores + mask.astype(mx.float32)


@mx.compile
def _one_query_core(
    q: mx.array, keys: mx.array, values: mx.array, mask: mx.array, scale: mx.array
) -> mx.array:
    """``softmax(scores) v`` (B, Hkv, R, Dv) with :func:`softmax`'s arithmetic, fused; values
    (B, Hkv, S, Dv)."""
    scores = _one_query_scores(q, keys, mask, scale)  # (B, Hkv, R, S)
    e = _exp_shifted(scores, mx.max(scores, axis=-1, keepdims=True))
    weights = (e / e.sum(axis=-1, keepdims=True)).astype(values.dtype)  # (B, Hkv, R, S)
    return weights @ values  # (B, Hkv, R, Dv)


@mx.custom_function
def _one_query(
    q: mx.array, keys: mx.array, values: mx.array, mask: mx.array, scale: mx.array
) -> mx.array:
    return _one_query_core(q, keys, values, mask, scale)


def _one_query_grads(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    mask: mx.array,
    scale: mx.array,
    cotangent: mx.array,
) -> tuple[mx.array, ...]:
    """The gradients of the one-query attention (q, keys, values) through the differentiable
    :func:`softmax` (the fused exp's bit view has none)."""

    def attend(q: mx.array, keys: mx.array, values: mx.array) -> mx.array:
        weights = softmax(_one_query_scores(q, keys, mask, scale), axis=-1)
        return weights.astype(values.dtype) @ values

    _, grads = mx.vjp(attend, [q, keys, values], [cotangent])
    return tuple(grads)


@_one_query.vjp
def _one_query_vjp(primals: Any, cotangent: mx.array, output: mx.array) -> tuple[mx.array, ...]:
    q, keys, values, mask, scale = primals
    grads = _one_query_grads(q, keys, values, mask, scale, cotangent)
    return (*grads, mx.zeros_like(mask), mx.zeros_like(scale))


def one_query_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    mask: mx.array | None = None,
    native: bool = False,
) -> mx.array:
    """:func:`scaled_dot_product_attention` for one query position (``L == 1``: a decoding
    step), as one compiled function of a few kernels instead of a dozen small ops, or with
    ``native`` one native kernel (:func:`native_one_query_attention`).

    ``queries`` (B, H, 1, D), ``keys`` (B, Hkv, S, D), ``values`` (B, Hkv, S, Dv); ``mask`` None,
    a boolean array (True: attend) or an additive float array, broadcastable to (B, H, 1, S)
    (a causal mask is all True at one query: pass None). Grouped heads by reshaping the queries
    to (B, Hkv, R, D), so keys and values are not repeated. Returns (B, H, 1, Dv).
    """
    b, h, length, d = queries.shape
    hkv = keys.shape[1]
    if length != 1:
        raise ValueError(f"one_query_attention takes one query position, got {length}")
    if h % hkv:
        raise ValueError(f"{h} query heads is not a multiple of {hkv} key/value heads")
    q = queries.reshape(b, hkv, h // hkv, d)  # (B, Hkv, R, D)
    if mask is None:
        mask = mx.array(True)  # where(True, ...) keeps every score
    else:
        mask = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))  # (B|1, H|1, 1, S)
        if mask.shape[1] != 1:
            mask = mask.reshape(mask.shape[0], hkv, h // hkv, mask.shape[-1])  # (B|1, Hkv, R, S)
    out = native_one_query_attention(q, keys, values, mask, scale) if native else None
    if out is None:
        # Traced once per cache length (a step's layers share it): cheaper than a shapeless
        # trace around separately compiled exp pieces.
        out = cast(mx.array, _one_query(q, keys, values, mask, mx.array(scale, dtype=q.dtype)))
    return out.reshape(b, h, 1, values.shape[-1])  # (B, H, 1, Dv)


_NATIVE_ONE_QUERY_FNS: dict[float, Callable[..., Any]] = {}


def native_one_query_attention(
    q: mx.array, keys: mx.array, values: mx.array, mask: mx.array, scale: float
) -> mx.array | None:
    """``softmax(q k^T * scale + mask) v`` (B, Hkv, R, Dv) for grouped queries ``q``
    (B, Hkv, R, D), as :func:`one_query_attention` computes it (``mask`` a 0-d True for none,
    else 4 axes, each 1 or full), in one native kernel (:mod:`base_setup.native`), or None where
    it does not run: another dtype, the fast math or the kernels off, or a build without AVX2 or
    AVX-512.

    The kernel reads the cached keys and values at their strides, each once, and runs the
    scores, the softmax and the weighted sum per key/value head in registers: MLX's graph is
    about a dozen nodes a layer, two of them batched matmuls that OpenBLAS runs as one tiny GEMM
    per (sequence, head), each packing its operands. The same function up to float32 rounding
    (its dot products and sums run in another order). Differentiable, with the MLX graph's
    gradient."""
    kernels = _vector_kernels(q, keys, values)
    if kernels is None or mask.dtype not in (mx.bool_, mx.float32) or mask.ndim not in (0, 4):
        return None
    if scale not in _NATIVE_ONE_QUERY_FNS:

        @mx.custom_function
        def fn(q: mx.array, keys: mx.array, values: mx.array, mask: mx.array) -> mx.array:
            return cast(
                mx.array,
                kernels.one_query_attention(
                    q, keys, values, None if mask.ndim == 0 else mask, scale=scale
                ),
            )

        @fn.vjp
        def fn_vjp(primals: Any, cotangent: mx.array, output: mx.array) -> tuple[mx.array, ...]:
            q, keys, values, mask = primals
            scale_array = mx.array(scale, dtype=q.dtype)
            grads = _one_query_grads(q, keys, values, mask, scale_array, cotangent)
            return (*grads, mx.zeros_like(mask))

        _NATIVE_ONE_QUERY_FNS[scale] = fn
    return cast(mx.array, _NATIVE_ONE_QUERY_FNS[scale](q, keys, values, mask))


# ------------------------------------------------------------------ RMSNorm and RoPE
# On the CPU, MLX has no kernels for these two: mx.fast.rms_norm and mx.fast.rope build their
# composed fallbacks, 11 and ~30 graph nodes a call (RoPE recomputes its frequencies with exp, cos
# and sin every time). In a decoding step of a small model, where each node costs a few
# microseconds of scheduling whatever its size, that is more than half of the step's ~720 nodes.

#: Up to these many elements RMSNorm is one compiled function (4 nodes, a win at a decoding step's
#: small shapes); above, MLX's own (the compiled kernel broadcasts the row scale slowly, which loses
#: at prompt-sized shapes).
_MAX_COMPILED_RMS_NORM = 1 << 13
_RMS_NORM_FNS: dict[float, Callable[[mx.array, mx.array], mx.array]] = {}
_ROPE_FREQS: dict[tuple[int, float], mx.array] = {}


def _rms_norm_fn(eps: float) -> Callable[[mx.array, mx.array], mx.array]:
    """The compiled RMSNorm for ``eps`` (shapeless: one trace for every shape)."""
    if eps not in _RMS_NORM_FNS:

        def fn(x: mx.array, weight: mx.array) -> mx.array:
            x32 = x.astype(mx.float32)
            normed = x32 * mx.rsqrt(mx.mean(mx.square(x32), axis=-1, keepdims=True) + eps)
            return normed.astype(x.dtype) * weight

        _RMS_NORM_FNS[eps] = mx.compile(fn, shapeless=True)
    return _RMS_NORM_FNS[eps]


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """``mx.fast.rms_norm(x, weight, eps)``: ``x / sqrt(mean(x^2, -1) + eps) * weight``, the
    normalisation in float32, then ``x``'s dtype times ``weight`` (MLX's own formula, bit for
    bit). Differentiable; MLX's own off the CPU, and above a few thousand elements MLX's own or,
    in float32, the native kernel's (:mod:`base_setup.native`), whose gradient is MLX's formula
    summed in its own order."""
    if not fast_math_enabled():
        return mx.fast.rms_norm(x, weight, eps)
    if x.size > _MAX_COMPILED_RMS_NORM:
        kernels = _native(x, weight)
        if kernels is not None and weight.ndim == 1:
            return cast(mx.array, kernels.rms_norm(x, weight, eps))
        return mx.fast.rms_norm(x, weight, eps)
    return _rms_norm_fn(eps)(x, weight)


@mx.compile
def _rotate_half(x: mx.array, positions: mx.array, inv_freqs: mx.array) -> mx.array:
    """Non-traditional RoPE of ``x`` (..., L, D) at float32 ``positions`` broadcastable to
    (..., L): the first ``2 * len(inv_freqs)`` features as two rotated halves, the rest kept."""
    half = inv_freqs.shape[0]
    theta = positions[..., None] * inv_freqs  # (..., L, D/2)
    cos, sin = mx.cos(theta).astype(x.dtype), mx.sin(theta).astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    parts = [x1 * cos - x2 * sin, x1 * sin + x2 * cos]
    if 2 * half < x.shape[-1]:
        parts.append(x[..., 2 * half :])
    return mx.concatenate(parts, axis=-1)


def rope(
    x: mx.array,
    dims: int,
    *,
    traditional: bool,
    base: float,
    scale: float,
    offset: int | mx.array,
) -> mx.array:
    """``mx.fast.rope(x, dims, traditional=..., base=..., scale=..., offset=...)`` (bit for bit).

    ``x`` is (B, ..., L, D); ``offset`` an int, a scalar array, or a (B,) array of per-sequence
    offsets (mlx-lm's batched KV caches). Position ``p`` rotates feature pair ``i < dims / 2``
    by ``scale * p * base^(-2i / dims)``. The frequencies are computed once per (dims, base).
    In float32 with int32 offsets the native kernel computes it (:mod:`base_setup.native`: one
    graph node where the composed rotation takes about fifteen, which at a decoding step cost
    more than their arithmetic; the same bits, its gradient the rotation by the opposite
    angle); else the rotation is one compiled function. Differentiable; MLX's own for
    ``traditional`` (interleaved pairs) and off the CPU.
    """
    if traditional or not fast_math_enabled():
        return mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset)
    half = dims // 2
    key = (dims, float(base))
    if key not in _ROPE_FREQS:  # mx.fast.rope's own expression, for the same bits
        _ROPE_FREQS[key] = mx.exp(mx.arange(0.0, -half, -1.0) * (math.log(base) / half))
    start = offset if isinstance(offset, mx.array) else mx.array(offset)
    kernels = _native(x)
    if kernels is not None and _native_rope_offsets(start, x):
        return cast(mx.array, kernels.rope(x, start, _ROPE_FREQS[key], scale=scale))
    if start.ndim:  # (B,) -> (B, 1, ..., 1): one offset per sequence
        start = start.reshape((-1,) + (1,) * (x.ndim - 2))
    positions = (start + mx.arange(x.shape[-2])).astype(mx.float32) * scale  # (B|1, ..., L)
    if x.size < _MIN_ROPE_CUSTOM_GRAD:  # a decoding step: one compiled call, MLX differentiates it
        return _rotate_half(x, positions, _ROPE_FREQS[key])
    return cast(mx.array, _rope_rotation(x, positions, _ROPE_FREQS[key]))


def _native_rope_offsets(start: mx.array, x: mx.array) -> bool:
    """Whether the native RoPE takes ``start`` for ``x`` (..., L, D): int32, one offset or one
    per index of ``x``'s first axis (mlx-lm's batched caches)."""
    if start.dtype != mx.int32 or x.ndim < 2 or start.ndim > 1:
        return False
    return start.size == 1 or start.size == x.shape[0]


@mx.custom_function
def _rope_rotation(x: mx.array, positions: mx.array, inv_freqs: mx.array) -> mx.array:
    """:func:`_rotate_half` with its gradient written out: the rotation by the opposite angle."""
    return _rotate_half(x, positions, inv_freqs)


@_rope_rotation.vjp
def _rope_rotation_vjp(primals: Any, cotangent: mx.array, output: mx.array) -> tuple[mx.array, ...]:
    # A rotation's transpose is the rotation by the opposite angle: positions negated.
    x, positions, inv_freqs = primals
    grad = _rotate_half(cotangent.astype(x.dtype), -positions, inv_freqs)
    return grad, mx.zeros_like(positions), mx.zeros_like(inv_freqs)


# ------------------------------------------------------------------ helpers and the switch
def _mlx_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    from mlx_lm.models.activations import swiglu as mlx_swiglu

    return mlx_swiglu(gate, x)


def native_kernels(*arrays: mx.array) -> Any:
    """The native kernels' module (:mod:`base_setup.native`) where the fast functions run and
    ``arrays`` are float32; None elsewhere (fast math off, the kernels off, another dtype)."""
    return _native(*arrays) if fast_math_enabled() else None


#: Up to these many rows (a decoding step's sequences), :func:`few_row_matmul` runs.
MAX_FEW_ROWS = 16


def few_row_matmul(x: mx.array, weight: mx.array) -> mx.array | None:
    """``x @ weight.T`` (x (..., K), weight (N, K), float32) through the native few-row kernel
    (:mod:`base_setup.native`), or None where it does not run: more than :data:`MAX_FEW_ROWS`
    rows, another dtype, the fast math or the kernels off, or a build without AVX2 or AVX-512.

    At a decoding step's few rows a GEMM (OpenBLAS) spends as much time packing the weights as
    multiplying them; the kernel reads each weight once, straight from its row, and ran the
    matmuls of a SmolLM2-135M decoding step at 16 rows in about two thirds of OpenBLAS's time
    (docs/performance.md). Its sums are fma chains over k in order, not OpenBLAS's blocked
    order: the same function up to float32 rounding. Differentiable (the gradients are MLX's
    matmuls)."""
    if x.ndim == 0 or x.shape[-1] == 0 or x.size > MAX_FEW_ROWS * x.shape[-1]:
        return None
    kernels = _vector_kernels(x, weight)
    return None if kernels is None else cast(mx.array, kernels.few_row_matmul(x, weight))


def _vector_kernels(*arrays: mx.array) -> Any:
    """:func:`native_kernels` where their build has vector lanes (AVX2 or AVX-512), else None:
    the decoding-step kernels (few-row matmul, one-query attention) are correct in the scalar
    build but not faster, so Python does not route to them there."""
    kernels = native_kernels(*arrays)
    return None if kernels is None or kernels.few_row_isa == "scalar" else kernels


def _native(*arrays: mx.array) -> Any:
    """The native kernels (:mod:`base_setup.native`) for float32 ``arrays``, or None: another
    dtype, or the kernels are off (their build or ``PPO_MLX_NATIVE=0``). Called where the fast
    functions already run, so the fast math is on."""
    if any(a.dtype != mx.float32 for a in arrays):
        return None
    from base_setup import native

    return native.kernels()


def _single(primals: Any) -> mx.array:
    """The one primal of a one-argument custom function's vjp (MLX passes it bare or in a
    sequence, depending on the version)."""
    return primals[0] if isinstance(primals, (tuple, list)) else primals


def _float_dtype(x: mx.array) -> mx.Dtype:
    return x.dtype if mx.issubdtype(x.dtype, mx.floating) else mx.float32


_STATE: dict[str, bool | None] = {"enabled": None}


#: How many :func:`mlx_math_scope` blocks are open (nesting counts).
_MLX_MATH_DEPTH = [0]


def mlx_math_scope(enabled: bool = True) -> AbstractContextManager[None]:
    """Within the block (when ``enabled``), MLX's own functions replace the fast ones: where the
    fast functions, traced for a gradient, cost more than they save (a training step)."""
    return counted_scope(_MLX_MATH_DEPTH, enabled)


def fast_math_enabled() -> bool:
    """Whether the fast functions replace MLX's: on the CPU device, unless ``PPO_MLX_FAST_MATH=0``
    or plain MLX is asked for (:mod:`base_setup.plain`) or within :func:`mlx_math_scope`, and
    only if MLX can compile them here (checked once: ``mx.compile`` on the CPU builds its kernels
    with the system C++ compiler, and a machine without one gets MLX's functions)."""
    if _MLX_MATH_DEPTH[0] or os.environ.get(_ENV, "1") == "0" or not speed_tricks():
        return False
    if _STATE["enabled"] is None:
        _STATE["enabled"] = _probe()
    return bool(_STATE["enabled"])


def _probe() -> bool:
    x = mx.array([-np.inf, -100.0, -1.0, 0.0, 0.5, 3.0, 80.0], dtype=mx.float32)
    try:
        got = np.array(_fast_exp(x))
    except RuntimeError as err:  # MLX reports a failed kernel build as a RuntimeError
        logger.warning(
            "fast CPU math is off: MLX could not compile its kernels (%s); install a C++ "
            "compiler (g++) for faster CPU forward passes",
            str(err).splitlines()[0] if str(err) else type(err).__name__,
        )
        return False
    want = np.exp(np.array(x, dtype=np.float64))
    if not np.allclose(got, want, rtol=1e-6, atol=1e-37):
        raise RuntimeError(f"fast exp is wrong on this machine: {got} != {want}; set {_ENV}=0")
    return True
