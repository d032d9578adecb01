"""The native CPU kernels (base_setup/native.py): built and loaded, the same bits as the fast
functions they stand for (values and gradients, whatever the thread count), and off with a reason
wherever they cannot be built or loaded."""

from __future__ import annotations

import io
import logging
import os
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Iterator

import mlx.core as mx
import numpy as np
import pytest

from base_setup import backend, fast_math, native

BUILDABLE = native.build_inputs()
needs_kernels = pytest.mark.skipif(
    isinstance(BUILDABLE, str), reason=f"the native kernels cannot be built here: {BUILDABLE}"
)


@pytest.fixture
def kernels() -> Iterator[Any]:
    module = native.kernels()
    assert module is not None, "the native kernels did not load (see the log)"
    threads = module.threads()
    yield module
    module.set_threads(threads)


def _without_native(monkeypatch: pytest.MonkeyPatch, fn: Callable[[], Any]) -> Any:
    """``fn()`` with the fast functions as they are without the native kernels."""
    with monkeypatch.context() as m:
        m.setitem(native._STATE, "module", None)
        out = fn()
        mx.eval(out)
        return out


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return bool(mx.array_equal(a, b, equal_nan=True).item())


def _gate_and_up(shape: tuple[int, ...], seed: int = 0) -> tuple[mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    gate = (rng.standard_normal(shape) * 8).astype(np.float32)
    flat = gate.reshape(-1)
    flat[:6] = [np.nan, np.inf, -np.inf, 100.0, -100.0, 0.0]  # saturating and special values
    up = rng.standard_normal(shape).astype(np.float32)
    return mx.array(gate), mx.array(up)


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_swiglu_is_the_fast_swiglu_bit_for_bit(
    kernels: Any, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    kernels.set_threads(threads)
    gate, up = _gate_and_up((3, 131, 257))  # odd sizes: uneven parts per thread

    def run() -> Any:
        value = fast_math.swiglu(gate, up)
        grads = mx.grad(lambda g, u: (fast_math.swiglu(g, u) * up).sum(), argnums=(0, 1))(gate, up)
        return value, grads

    got, want = run(), _without_native(monkeypatch, run)
    assert _equal(got, want)
    g64, u64 = np.array(gate, dtype=np.float64), np.array(up, dtype=np.float64)
    finite = np.isfinite(g64)
    with np.errstate(over="ignore"):
        reference = g64[finite] / (1.0 + np.exp(-g64[finite])) * u64[finite]
    np.testing.assert_allclose(np.array(got[0])[finite], reference, rtol=2e-6, atol=1e-30)


@needs_kernels
def test_swiglu_takes_views_and_refuses_other_dtypes(kernels: Any) -> None:
    gate, up = _gate_and_up((64, 96), seed=1)
    got = kernels.swiglu(gate.T, up.T)  # transposed views: copied when the kernel runs
    want = kernels.swiglu(_copy(gate.T), _copy(up.T))
    assert _equal(got, want)
    x = mx.array(np.random.default_rng(2).standard_normal((48, 40)).astype(np.float32))
    weight = mx.array(np.linspace(0.5, 1.5, 48, dtype=np.float32))
    assert _equal(kernels.rms_norm(x.T, weight, 1e-5), kernels.rms_norm(_copy(x.T), weight, 1e-5))
    rows = mx.broadcast_to(x[:1], (5, 40))  # one row at stride 0
    assert _equal(kernels.row_exp(rows), kernels.row_exp(_copy(rows)))
    with pytest.raises(ValueError, match="float32"):
        kernels.swiglu(gate.astype(mx.float16), up.astype(mx.float16))
    with pytest.raises(ValueError, match="one shape"):
        kernels.swiglu(gate, up[:, :5])


def _copy(a: mx.array) -> mx.array:
    """A row-contiguous copy of ``a``."""
    return mx.array(np.ascontiguousarray(np.array(a)))


def _attention_inputs(seed: int) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    q = mx.array(rng.standard_normal((2, 4, 37, 16)).astype(np.float32))
    k = mx.array(rng.standard_normal((2, 2, 37, 16)).astype(np.float32))
    v = mx.array(rng.standard_normal((2, 2, 37, 8)).astype(np.float32))
    mask = rng.uniform(size=(2, 1, 37, 37)) > 0.4
    mask[0, 0, 3] = False  # a fully masked row (a left-padding position)
    return q, k, v, mx.array(mask)


@needs_kernels
@pytest.mark.parametrize("mask_kind", ["causal", "boolean", "additive", "none"])
@pytest.mark.parametrize("threads", [1, 2])
def test_attention_is_the_fast_attention_bit_for_bit(
    kernels: Any, monkeypatch: pytest.MonkeyPatch, mask_kind: str, threads: int
) -> None:
    kernels.set_threads(threads)
    q, k, v, boolean = _attention_inputs(seed=2)
    mask: Any = {
        "causal": "causal",
        "boolean": boolean,
        "additive": mx.where(boolean, 0.0, -3.0),
        "none": None,
    }[mask_kind]
    weights = mx.array(np.random.default_rng(3).standard_normal((2, 4, 37, 8)).astype(np.float32))

    def attend(q: mx.array, k: mx.array, v: mx.array) -> mx.array:
        return fast_math.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)

    def run() -> Any:
        loss = lambda q, k, v: (attend(q, k, v) * weights).sum()  # noqa: E731
        return attend(q, k, v), mx.grad(loss, argnums=(0, 1, 2))(q, k, v)

    got, want = run(), _without_native(monkeypatch, run)
    assert _equal(got, want)


def _rms_norm_reference(
    x: np.ndarray, weight: np.ndarray, cot: np.ndarray, eps: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """RMSNorm's value and its gradients (x's, the weight's) in float64, written out naively."""
    x64, w64, g64 = (a.astype(np.float64) for a in (x, weight, cot))
    n = 1.0 / np.sqrt((x64**2).mean(-1, keepdims=True) + eps)
    gw = g64 * w64
    dx = gw * n - x64 * (gw * x64).mean(-1, keepdims=True) * n**3
    dw = (g64 * x64 * n).reshape(-1, x.shape[-1]).sum(0)
    return x64 * n * w64, dx, dw


@needs_kernels
@pytest.mark.parametrize("shape", [(3, 57, 576), (2, 37, 16, 64)])  # a hidden state; q_norm's
def test_rms_norm_is_mlxs_value_and_its_gradient_at_any_thread_count(
    kernels: Any, shape: tuple[int, ...]
) -> None:
    """The value is MLX's bit for bit. The gradient is the native kernel's (MLX's formula, its
    own order of sums): as close to a float64 reference as MLX's own, and the same bits at 1, 2
    and 3 threads (the weight's sums over rows in fixed blocks)."""
    rng = np.random.default_rng(8)
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    x.reshape(-1, shape[-1])[5] = 0.0  # a zero row: its scale is 1 / sqrt(eps)
    weight = rng.standard_normal(shape[-1]).astype(np.float32)
    cot = rng.standard_normal(shape).astype(np.float32)
    assert x.size > fast_math._MAX_COMPILED_RMS_NORM  # the size where the kernel runs

    def run(norm: Callable[..., mx.array]) -> Any:
        value, grads = mx.vjp(
            lambda x, w: norm(x, w, 1e-5), [mx.array(x), mx.array(weight)], [mx.array(cot)]
        )
        return value[0], grads[0], grads[1]

    runs = []
    for threads in (1, 2, 3):
        kernels.set_threads(threads)
        runs.append(run(fast_math.rms_norm))
    assert all(_equal(got, runs[0]) for got in runs[1:])
    mlx = run(mx.fast.rms_norm)
    assert _equal(runs[0][0], mlx[0])
    reference = _rms_norm_reference(x, weight, cot, 1e-5)
    for got, theirs, want in zip(runs[0][1:], mlx[1:], reference[1:]):
        scale = np.abs(want).max()
        ours_err = np.abs(np.array(got, dtype=np.float64) - want).max() / scale
        mlx_err = np.abs(np.array(theirs, dtype=np.float64) - want).max() / scale
        assert ours_err < 1e-6 and ours_err <= 2 * mlx_err + 1e-7, (ours_err, mlx_err)
    # Inside a compiled function too (a compiled training gradient), the same bits.
    compiled = mx.compile(
        lambda x, w, g: mx.vjp(lambda a, b: fast_math.rms_norm(a, b, 1e-5), [x, w], [g])[1]
    )
    grads = compiled(mx.array(x), mx.array(weight), mx.array(cot))
    assert _equal(grads[0], runs[0][1]) and _equal(grads[1], runs[0][2])


def _rope_inputs(shape: tuple[int, ...], seed: int) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array((rng.standard_normal(shape) * 2).astype(np.float32))


ROPE_CASES = {
    # (x's shape as the attention makes it, transposed or not, rotated dims, offset, scale)
    "decoding step, batched cache": ((16, 1, 9, 64), True, 64, "per-row", 1.0),
    "scoring, transposed view": ((3, 45, 4, 64), True, 64, 7, 1.0),
    "partial rotary, scaled": ((2, 5, 33, 48), False, 32, "array", 0.25),
    "far positions (libm's range)": ((2, 3, 4, 16), False, 16, 9_000_000, 1.0),
}


@needs_kernels
@pytest.mark.parametrize("case", list(ROPE_CASES))
@pytest.mark.parametrize("threads", [1, 2])
def test_rope_is_the_fast_ropes_and_mlxs_bit_for_bit(
    kernels: Any, monkeypatch: pytest.MonkeyPatch, case: str, threads: int
) -> None:
    """Value and gradient equal the fast RoPE's (a compiled rotation; its gradient the rotation
    by the opposite angle) and mx.fast.rope's value, whatever x's layout and offsets."""
    shape, transposed, dims, offset_kind, scale = ROPE_CASES[case]
    kernels.set_threads(threads)
    x = _rope_inputs(shape, seed=len(case))
    if transposed:  # (B, L, H, D) -> (B, H, L, D), as mlx-lm's attention hands it over
        x = x.transpose(0, 2, 1, 3)
    if offset_kind == "per-row":
        offset: Any = mx.array(np.arange(x.shape[0], dtype=np.int32) * 3 - 2)  # left padding
    elif offset_kind == "array":
        offset = mx.array(5, dtype=mx.int32)
    else:
        offset = offset_kind
    cot = _rope_inputs(x.shape, seed=99)
    settings = dict(traditional=False, base=10000.0, scale=scale, offset=offset)

    def run() -> Any:
        value, grads = mx.vjp(lambda a: fast_math.rope(a, dims, **settings), [x], [cot])
        return value[0], grads[0]

    graph = io.StringIO()
    mx.export_to_dot(graph, fast_math.rope(x, dims, **settings))
    assert "NativeRope" in graph.getvalue()  # the kernel computes it
    got = run()
    mx.eval(got)
    want = _without_native(monkeypatch, run)
    assert _equal(got, want), case
    assert _equal(got[0], mx.fast.rope(x, dims, **settings))
    # Inside a compiled gradient (the training step's), the same bits.
    compiled = mx.compile(
        lambda a, c: mx.vjp(lambda b: fast_math.rope(b, dims, **settings), [a], [c])[1][0]
    )
    assert _equal(compiled(x, cot), got[1])


@needs_kernels
def test_rope_runs_native_and_checks_its_inputs(kernels: Any) -> None:
    x = _rope_inputs((2, 3, 4, 8), seed=1)
    freqs = mx.ones((4,))
    native_out = kernels.rope(x, mx.array([0, 3], dtype=mx.int32), freqs)
    assert native_out.shape == x.shape
    with pytest.raises(ValueError, match="int32 offsets"):
        kernels.rope(x, mx.array([0.0, 1.0]), freqs)
    with pytest.raises(ValueError, match="one per index"):
        kernels.rope(x, mx.array([0, 1, 2], dtype=mx.int32), freqs)
    with pytest.raises(ValueError, match="at most D / 2"):
        kernels.rope(x, mx.array(0, dtype=mx.int32), mx.ones((5,)))
    with pytest.raises(ValueError, match="float32"):
        kernels.rope(x.astype(mx.float16), mx.array(0, dtype=mx.int32), freqs)


@needs_kernels
@pytest.mark.parametrize("head_kind", ["scoring", "frozen", "trained"])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_heads_log_probs_are_the_fast_paths_bit_for_bit(
    kernels: Any, monkeypatch: pytest.MonkeyPatch, head_kind: str, threads: int
) -> None:
    """The LM head's online softmax by vocabulary blocks (an uneven last block), with the
    entropy: the scoring pass, a frozen head's gradient (its Jacobians) and a trained head's."""
    from token_attribution.head_logprobs import LinearHead, head_token_scores

    kernels.set_threads(threads)
    rng = np.random.default_rng(9)
    weight = mx.array((rng.standard_normal((1000, 24)) * 2).astype(np.float32))
    hidden = mx.array(rng.standard_normal((3, 11, 24)).astype(np.float32))
    tokens = mx.array(rng.integers(0, 1000, (3, 11)).astype(np.int32))
    c_lp, c_ent = (mx.array(rng.standard_normal((3, 11)).astype(np.float32)) for _ in range(2))
    head = LinearHead(weight, trained=head_kind == "trained")

    def scores(h: mx.array, w: mx.array, differentiable: bool) -> Any:
        return head_token_scores(
            h,
            LinearHead(w, trained=head.trained),
            tokens,
            temperature=0.7,
            with_entropy=True,
            differentiable=differentiable,
            block_rows=300,
        )

    def run() -> Any:
        if head_kind == "scoring":
            return tuple(scores(hidden, weight, False))

        def loss(h: mx.array, w: mx.array) -> mx.array:
            out = scores(h, w, True)
            return (out.logprobs * c_lp + out.entropy * c_ent).sum()

        argnums = (0, 1) if head.trained else 0
        return mx.value_and_grad(loss, argnums=argnums)(hidden, weight)

    got, want = run(), _without_native(monkeypatch, run)
    assert _equal(got, want)


@needs_kernels
@pytest.mark.parametrize("keyed", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_sampling_is_the_generators_bit_for_bit(
    kernels: Any, monkeypatch: pytest.MonkeyPatch, keyed: bool, threads: int
) -> None:
    """The draw, its log-prob and the entropy of ppo_trainer.generator._sample (no top-k /
    top-p), for rows with banned tokens (-inf) and a row with one token left."""
    from ppo_trainer.generator import _sample

    kernels.set_threads(threads)
    rng = np.random.default_rng(10)
    logits = (rng.standard_normal((37, 5003)) * 4).astype(np.float32)
    logits[1, ::3] = -np.inf
    logits[2, 1:] = -np.inf
    keys = mx.random.split(mx.random.key(3), 37) if keyed else None

    def run() -> Any:
        mx.random.seed(11)
        return _sample(mx.array(logits), 0.7, 1.0, 0, keys, with_entropy=True)

    got, want = run(), _without_native(monkeypatch, run)
    assert _equal(got, want)
    assert int(got[0][2]) == 0 and float(got[1][2]) == 0.0
    assert not np.isin(np.array(got[0][1]) % 3, [0]).any()  # a banned token is never drawn


@needs_kernels
def test_row_kernels_match_their_formulas(kernels: Any) -> None:
    rng = np.random.default_rng(4)
    scores = rng.standard_normal((5, 3, 70)).astype(np.float32) * 20
    scores[0, 0, :] = np.float32(np.finfo(np.float32).min)  # every score masked
    scores[1, 1, 7] = np.nan
    e, row_max = kernels.row_exp(mx.array(scores))
    assert row_max.shape == (5, 3, 1)
    want_max = scores.max(axis=-1, keepdims=True)
    np.testing.assert_array_equal(np.array(row_max), want_max)  # NaN where the row has one
    finite = ~np.isnan(want_max[..., 0])
    want_e = np.exp((scores - want_max).astype(np.float64))  # the float32 difference's exp
    # y = (x - m) log2(e) rounds to float32 too: at |y| ~ 100 its ulp is a few 1e-6 of 2^y
    np.testing.assert_allclose(np.array(e)[finite], want_e[finite], rtol=1e-5, atol=1e-37)
    assert np.isnan(np.array(e)[1, 1]).all()

    w = rng.standard_normal((5, 3, 70)).astype(np.float32)
    e32 = np.array(e)
    e32[1, 1] = 1.0  # the NaN row of the exp above, made finite
    inv_total = (1.0 / e32.sum(axis=-1, keepdims=True)).astype(np.float32)
    seen = (rng.uniform(size=(5, 3, 1)) > 0.3).astype(np.float32)
    got = kernels.attention_scores_grad(
        mx.array(e32), mx.array(w), mx.array(inv_total), mx.array(seen)
    )
    delta = (e32.astype(np.float64) * w).sum(axis=-1, keepdims=True) * inv_total
    np.testing.assert_allclose(np.array(got), e32 * (w - delta) * seen, rtol=1e-5, atol=1e-6)


@needs_kernels
def test_the_kernels_run_inside_a_compiled_gradient(
    kernels: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate, up = _gate_and_up((8, 40, 64), seed=5)
    gate = mx.nan_to_num(gate)

    @mx.compile
    def step(gate: mx.array, up: mx.array) -> Any:
        loss = lambda g, u: (fast_math.swiglu(g, u) ** 2).mean()  # noqa: E731
        return mx.value_and_grad(loss, argnums=(0, 1))(gate, up)

    got = step(gate, up)
    mx.eval(got)
    want = _without_native(
        monkeypatch,
        lambda: mx.value_and_grad(
            lambda g, u: (fast_math.swiglu(g, u) ** 2).mean(), argnums=(0, 1)
        )(gate, up),
    )
    assert _equal(got[1], want[1])
    np.testing.assert_allclose(np.array(got[0]), np.array(want[0]), rtol=1e-6)


@needs_kernels
def test_the_kernels_take_the_runs_blas_threads(kernels: Any) -> None:
    if backend.blas_threads() is None:
        pytest.skip("no OpenBLAS loaded")
    saved = backend.blas_threads()
    try:
        backend.run_blas_threads(saved=1)
        assert kernels.threads() == 1
        backend.run_blas_threads(saved=2)
        assert kernels.threads() == min(2, backend._OPENBLAS["max_threads"])
    finally:
        backend.run_blas_threads(saved=saved)


# ------------------------------------------------------------------ the few-row matmul


def _float32_nearest(value: Fraction) -> np.float32:
    """The float32 nearest ``value``, ties to even: exactly, not through a float64 rounding."""
    guess = np.float32(float(value))
    around = [
        np.nextafter(guess, np.float32(-np.inf)),
        guess,
        np.nextafter(guess, np.float32(np.inf)),
    ]
    return min(around, key=lambda c: (abs(Fraction(float(c)) - value), int(c.view(np.int32)) & 1))


def _fma_chain(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The naive reference: out[m, n] = fma(x[m, K-1], w[n, K-1], ... fma(x[m, 0], w[n, 0], 0)),
    each step's exact product and sum rounded once to float32."""
    out = np.zeros((x.shape[0], w.shape[0]), dtype=np.float32)
    for m in range(x.shape[0]):
        for n in range(w.shape[0]):
            acc = np.float32(0.0)
            for k in range(x.shape[1]):
                exact = Fraction(float(x[m, k])) * Fraction(float(w[n, k])) + Fraction(float(acc))
                acc = _float32_nearest(exact)
            out[m, n] = acc
    return out


def _few_row_inputs(rows: int, n: int, k: int, seed: int = 0) -> tuple[mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    return mx.array(x), mx.array(w)


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_few_row_matmul_is_an_fma_chain_at_any_thread_count(kernels: Any, threads: int) -> None:
    kernels.set_threads(threads)
    # 14 columns: a full block of columns and a remainder on every instruction set
    x, w = _few_row_inputs(5, 14, 9)
    got = np.array(kernels.few_row_matmul(x, w))
    np.testing.assert_array_equal(got, _fma_chain(np.array(x), np.array(w)))
    # enough columns for every thread: the same bits as one thread, near float64's product
    x, w = _few_row_inputs(16, 2050, 64, seed=1)
    got = kernels.few_row_matmul(x.reshape(16, 1, 64), w)
    assert got.shape == (16, 1, 2050)
    mx.eval(got)  # at `threads`: the kernel reads the count when it runs
    kernels.set_threads(1)
    assert _equal(got, kernels.few_row_matmul(x.reshape(16, 1, 64), w))
    reference = np.array(x, dtype=np.float64) @ np.array(w, dtype=np.float64).T
    np.testing.assert_allclose(np.array(got).reshape(16, 2050), reference, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_few_row_matmul_takes_views_and_checks_its_inputs(kernels: Any) -> None:
    x, w = _few_row_inputs(17, 30, 40, seed=2)  # 17 rows: two groups of rows
    want = kernels.few_row_matmul(x, w)
    assert _equal(want[:16], kernels.few_row_matmul(x[:16], w))  # each row on its own
    assert _equal(want[16:], kernels.few_row_matmul(x[16:], w))
    x_view = mx.array(np.ascontiguousarray(np.array(x).T)).T  # a transposed view
    w_view = mx.array(np.ascontiguousarray(np.array(w).T)).T
    assert _equal(kernels.few_row_matmul(x_view, w_view), want)
    assert _equal(kernels.few_row_matmul(x[::2], w), want[::2])
    with pytest.raises(ValueError, match="float32"):
        kernels.few_row_matmul(x.astype(mx.float16), w)
    with pytest.raises(ValueError, match=r"x \(..., K\) and a weight \(N, K\)"):
        kernels.few_row_matmul(x, w[:, :39])


@needs_kernels
def test_few_row_matmul_gradients_are_the_matmuls(kernels: Any) -> None:
    x, w = _few_row_inputs(6, 50, 24, seed=3)
    x = x.reshape(2, 3, 24)
    cotangent = mx.array(np.random.default_rng(4).standard_normal((2, 3, 50)).astype(np.float32))

    def loss(fn: Callable[[mx.array, mx.array], mx.array]) -> Any:
        return mx.grad(lambda a, b: (fn(a, b) * cotangent).sum(), argnums=(0, 1))(x, w)

    got = loss(lambda a, b: kernels.few_row_matmul(a, b))
    want = loss(lambda a, b: a @ b.T)
    for g, r in zip(got, want):
        assert g.shape == r.shape
        np.testing.assert_allclose(np.array(g), np.array(r), rtol=1e-5, atol=1e-6)


@needs_kernels
def test_few_row_matmul_runs_only_where_it_pays(
    kernels: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    x, w = _few_row_inputs(16, 24, 8, seed=5)
    if kernels.few_row_isa == "scalar":
        assert fast_math.few_row_matmul(x, w) is None
        return
    assert _equal(fast_math.few_row_matmul(x, w), kernels.few_row_matmul(x, w))
    many, _ = _few_row_inputs(fast_math.MAX_FEW_ROWS + 1, 24, 8)
    assert fast_math.few_row_matmul(many, w) is None  # a GEMM's rows: OpenBLAS
    assert fast_math.few_row_matmul(x.astype(mx.float16), w.astype(mx.float16)) is None
    assert fast_math.few_row_matmul(mx.zeros((2, 0)), mx.zeros((3, 0))) is None  # nothing to sum
    monkeypatch.setattr(kernels, "few_row_isa", "scalar")  # a build without AVX2 / AVX-512
    assert fast_math.few_row_matmul(x, w) is None


def _attention_reference(
    q: mx.array, keys: mx.array, values: mx.array, mask: mx.array | None, scale: float
) -> np.ndarray:
    """softmax(q k^T * scale + mask) v in float64, grouped queries q (B, G, R, D)."""
    qn, kn, vn = (np.array(a, dtype=np.float64) for a in (q, keys, values))
    scores = np.einsum("bgrd,bgsd->bgrs", qn * scale, kn)
    if mask is not None:
        m = np.array(mask)
        scores = np.where(m, scores, np.finfo(np.float32).min) if m.dtype == bool else scores + m
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return np.asarray(np.einsum("bgrs,bgsd->bgrd", e / e.sum(axis=-1, keepdims=True), vn))


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "shape", [(5, 3, 3, 37, 64, 64), (2, 2, 2, 130, 128, 96), (3, 1, 4, 9, 20, 7)]
)
def test_one_query_attention_is_the_softmax_of_the_cache(
    kernels: Any, threads: int, shape: tuple[int, ...]
) -> None:
    """The kernel against float64 over keys and values as a KV cache holds them (slices of a
    longer buffer), with no mask, a boolean mask per sequence or per head, and an additive one;
    head sizes with and without a remainder of the vector width; the same bits at any thread
    count."""
    b, g, r, s, d, dv = shape
    rng = np.random.default_rng(sum(shape))
    q = mx.array(rng.standard_normal((b, g, r, d)).astype(np.float32))
    buffer = mx.array(rng.standard_normal((2, b, g, s + 11, max(d, dv))).astype(np.float32))
    keys, values = buffer[0, :, :, 4 : s + 4, :d], buffer[1, :, :, 2 : s + 2, :dv]
    seen = rng.uniform(size=(b, 1, 1, s)) > 0.4
    seen[..., -1] = True  # the step's own position
    per_head = rng.uniform(size=(b, g, r, s)) > 0.4
    per_head[..., 0] = True
    masks: list[mx.array | None] = [
        None,
        mx.array(seen),
        mx.array(per_head),
        mx.array(rng.standard_normal((1, 1, r, s)).astype(np.float32)),
    ]
    kernels.set_threads(threads)
    for mask in masks:
        got = kernels.one_query_attention(q, keys, values, mask, scale=0.3)
        assert got.shape == (b, g, r, dv) and got.dtype == mx.float32
        want = _attention_reference(q, keys, values, mask, 0.3)
        np.testing.assert_allclose(np.array(got), want, rtol=2e-5, atol=2e-6)
        mx.eval(got)
        kernels.set_threads(1)
        assert _equal(got, kernels.one_query_attention(q, keys, values, mask, scale=0.3))
        kernels.set_threads(threads)


@needs_kernels
def test_one_query_attention_takes_any_layout_and_checks_its_inputs(kernels: Any) -> None:
    rng = np.random.default_rng(8)
    q = mx.array(rng.standard_normal((2, 2, 3, 16)).astype(np.float32))
    keys = mx.array(rng.standard_normal((2, 2, 16, 5)).astype(np.float32)).swapaxes(-1, -2)
    values = mx.array(rng.standard_normal((2, 2, 5, 16)).astype(np.float32))
    q_view = mx.array(np.ascontiguousarray(np.array(q).swapaxes(-1, -2))).swapaxes(-1, -2)
    want = _attention_reference(q, keys, values, None, 0.25)
    for query in (q, q_view):  # the keys' and this query's last axis not at stride 1
        got = kernels.one_query_attention(query, keys, values, None, scale=0.25)
        np.testing.assert_allclose(np.array(got), want, rtol=2e-5, atol=2e-6)
    with pytest.raises(ValueError, match="float32"):
        kernels.one_query_attention(q.astype(mx.float16), keys, values, None, scale=1.0)
    with pytest.raises(ValueError, match=r"keys \(B, G, S, D\)"):
        kernels.one_query_attention(q, keys[..., :15], values, None, scale=1.0)
    with pytest.raises(ValueError, match="differ in B or G"):
        kernels.one_query_attention(q, keys[:1], values[:1], None, scale=1.0)
    with pytest.raises(ValueError, match="mask of 4 axes"):
        kernels.one_query_attention(q, keys, values, mx.ones((2, 5), dtype=mx.bool_), scale=1.0)
    with pytest.raises(ValueError, match="mask of 4 axes"):
        kernels.one_query_attention(
            q, keys, values, mx.ones((2, 1, 1, 4), dtype=mx.bool_), scale=1.0
        )


def _spy_native_attention(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each call of fast_math.native_one_query_attention from now on ran the kernel."""
    calls: list[bool] = []
    original = fast_math.native_one_query_attention

    def spy(*args: Any) -> mx.array | None:
        out = original(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(fast_math, "native_one_query_attention", spy)
    return calls


@needs_kernels
def test_native_one_query_attention_routes_and_differentiates(
    kernels: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fast_math.one_query_attention with ``native``: the kernel where it runs (float32, an AVX2
    or AVX-512 build), MLX's graph elsewhere; values and gradients as MLX's own attention."""
    rng = np.random.default_rng(9)
    q = mx.array(rng.standard_normal((3, 6, 1, 16)).astype(np.float32))
    buffer = mx.array(rng.standard_normal((2, 3, 2, 12, 16)).astype(np.float32))
    keys, values = buffer[0, :, :, :9], buffer[1, :, :, :9]
    mask = mx.array(rng.uniform(size=(3, 1, 1, 9)) > 0.3)
    mask[..., -1] = True
    calls = _spy_native_attention(monkeypatch)
    for m in (None, mask):
        got = fast_math.one_query_attention(q, keys, values, scale=0.25, mask=m, native=True)
        want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.25, mask=m)
        np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-6)

        def total(fn: Any, **kw: Any) -> Any:
            return lambda a, k, v: fn(a, k, v, scale=0.25, mask=m, **kw).sum()

        grads = mx.grad(total(fast_math.one_query_attention, native=True), argnums=(0, 1, 2))
        grads_want = mx.grad(total(mx.fast.scaled_dot_product_attention), argnums=(0, 1, 2))
        for g, gw in zip(grads(q, keys, values), grads_want(q, keys, values)):
            np.testing.assert_allclose(np.array(g), np.array(gw), atol=1e-5)
    assert calls and all(calls) == (kernels.few_row_isa != "scalar")
    calls.clear()
    fast_math.one_query_attention(q, keys, values, scale=0.25, mask=mask)  # not asked: MLX's
    fast_math.one_query_attention(
        q.astype(mx.bfloat16),
        keys.astype(mx.bfloat16),
        values.astype(mx.bfloat16),
        scale=0.25,
        native=True,
    )
    assert calls == [False]


@needs_kernels
def test_a_large_models_decoding_steps_run_the_few_row_kernel(
    kernels: Any, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model of FEW_ROW_MIN_PARAMETERS or more decodes through the kernel (its linear
    layers, its tied head, a LoRA policy's merged and unmerged layers) and its attention
    through the native one-query kernel, sampling the tokens MLX's own functions sample, on one
    core fewer than the process has (the run's count restored after); smaller models (the test,
    golden and demo models) keep MLX's functions and the run's count."""
    from base_setup import backend, fast_layers
    from base_setup.lora_setup import LoraSettings, adapters_merged, lora_modules
    from models.policy_model import PolicyModel
    from ppo_trainer.rollout import SamplingSettings, few_row_model, sample_responses

    if kernels.few_row_isa == "scalar":
        pytest.skip("a build without AVX2 or AVX-512: the kernel does not run")
    few_row_kinds = (fast_layers._FewRowLinear, fast_layers._FewRowEmbedding)
    small = PolicyModel.from_pretrained(tiny_model_dir, dtype="float32")
    assert not any(isinstance(m, few_row_kinds) for _, m in small.model.named_modules())
    assert not few_row_model(small)  # it decodes on the run's threads
    attention_kinds = {type(m).__name__ for _, m in small.model.named_modules()}
    assert "FastAttention" in attention_kinds and "FastFewRowAttention" not in attention_kinds

    monkeypatch.setattr(fast_layers, "FEW_ROW_MIN_PARAMETERS", 0)  # the tiny model as a large one
    policy = PolicyModel.from_pretrained(
        tiny_model_dir, dtype="float32", lora=LoraSettings(r=4, alpha=8.0, dropout=0.0)
    )
    key = mx.random.key(3)
    for _, module in lora_modules(policy.model):
        key, sub = mx.random.split(key)
        module.lora_b = 0.1 * mx.random.normal(module.lora_b.shape, key=sub)
    kinds = {type(m) for _, m in policy.model.named_modules()}
    assert set(few_row_kinds) <= kinds
    assert "FastFewRowAttention" in {kind.__name__ for kind in kinds}
    with adapters_merged(policy.model) as merged:
        calls = [
            type(m).__call__
            for _, m in merged.named_modules()
            if type(m).__name__ == "FewRow_MergedLinear"
        ]
        assert calls == [fast_layers._FewRowLinear.__call__] * 14

    ran: list[bool] = []
    threads: set[int | None] = set()
    original = fast_math.few_row_matmul

    def spy(x: mx.array, weight: mx.array) -> mx.array | None:
        out = original(x, weight)
        ran.append(out is not None)
        threads.add(backend.blas_threads())
        return out

    monkeypatch.setattr(fast_math, "few_row_matmul", spy)
    attended = _spy_native_attention(monkeypatch)
    ids = [[5, 17, 42, 99, 7, 8, 21, 60], [3, 8, 250], [11, 64, 9, 30]]  # 24 prompt rows
    for merge in (True, False):
        sampling = SamplingSettings(
            max_new_tokens=6,
            temperature=0.0,
            top_p=1.0,
            top_k=0,
            stop_token_ids=[],
            pad_token_id=0,
            merge_adapters=merge,
        )
        ran.clear()
        attended.clear()
        run_threads = backend.blas_threads()
        got = sample_responses(policy, ids, sampling)
        assert any(ran) and not all(ran)  # decoding steps: the kernel; the prompts: OpenBLAS
        assert len(attended) == 5 * 2 and all(attended)  # each decoding step's layers
        if run_threads is not None:  # one core left to the Python thread, the count restored
            assert threads == {max(1, min(run_threads, native.process_cpus() - 1))}
            assert backend.blas_threads() == run_threads
        want = _without_native(monkeypatch, lambda: sample_responses(policy, ids, sampling))
        assert got.logprobs is not None and want.logprobs is not None
        assert mx.array_equal(got.responses, want.responses).item()
        assert mx.allclose(got.logprobs, want.logprobs, atol=1e-4).item()

    assert fast_layers.accelerate_model(policy.model, enabled=False) is False
    assert not any(isinstance(m, few_row_kinds) for _, m in policy.model.named_modules())


def _fresh_load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delitem(native._STATE, "module", raising=False)


@needs_kernels
def test_a_failed_build_turns_them_off_once_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = tmp_path / "broken.cpp"
    source.write_text("this is not C++\n")
    monkeypatch.setattr(native, "SOURCE", source)
    _fresh_load(monkeypatch, tmp_path)
    with caplog.at_level(logging.WARNING, logger="ppo_mlx"):
        assert native.kernels() is None
    assert "native CPU kernels are off: the build failed" in caplog.text
    failed = list((tmp_path / "ppo_mlx" / "native").glob("*.failed"))
    assert len(failed) == 1 and "g++ failed" in failed[0].read_text()
    # the fast functions run without them
    gate, up = _gate_and_up((4, 600), seed=7)
    assert fast_math.swiglu(gate, up).shape == (4, 600)
    # a later process does not build again: it reads the note
    monkeypatch.delitem(native._STATE, "module")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ppo_mlx"):
        assert native.kernels() is None
    assert "their build failed before" in caplog.text


@needs_kernels
def test_a_module_of_another_nanobind_domain_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """What MLX's bindings built with another nanobind ABI look like: the module cannot take
    ``mx.array``. The load check catches it and the kernels stay off."""
    flags = tuple(f for f in native.FLAGS if not f.startswith("-DNB_DOMAIN"))
    monkeypatch.setattr(native, "FLAGS", (*flags, "-DNB_DOMAIN=not_mlx"))
    _fresh_load(monkeypatch, tmp_path)
    with caplog.at_level(logging.WARNING, logger="ppo_mlx"):
        assert native.kernels() is None
    assert "another nanobind ABI" in caplog.text


def test_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PPO_MLX_NATIVE", "0")
    assert native.kernels() is None
    monkeypatch.setenv("PPO_MLX_NATIVE", "maybe")
    with pytest.raises(ValueError, match="PPO_MLX_NATIVE"):
        native.kernels()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="built on Linux only")
def test_without_a_compiler_they_are_off_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    why = native.build_inputs()
    assert isinstance(why, str) and "g++" in why


def test_the_source_ships_with_the_package() -> None:
    import tomllib

    root = Path(__file__).resolve().parents[1]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert native.SOURCE.name in data["package-data"]["base_setup"]
    assert native.SOURCE.is_file()
    assert os.path.dirname(native.SOURCE) == os.path.dirname(native.__file__)
