"""token_attribution/: selective log-softmax, entropy, dropping truncated completions."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from token_attribution.extractor import mask_truncated_completions
from token_attribution.logprob_computer import entropy_from_logits, selective_log_softmax

SHAPES = [(1, 1, 2), (2, 3, 7), (3, 9, 50), (2, 16, 257)]


def np_log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def naive_mx_selective(logits: mx.array, tokens: mx.array) -> mx.array:
    """The naive equivalent named in the docstring (materialises a second (B, T, V) array)."""
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return mx.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("shape", SHAPES)
def test_selective_log_softmax_float32(seed, shape):
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=shape) * 4).astype(np.float32)
    tokens = rng.integers(0, shape[-1], size=shape[:2])
    got = selective_log_softmax(mx.array(logits), mx.array(tokens))
    assert got.dtype == mx.float32 and got.shape == shape[:2]
    expected = np.take_along_axis(np_log_softmax(logits), tokens[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(np.array(got), expected, rtol=1e-5, atol=1e-5)
    naive = naive_mx_selective(mx.array(logits), mx.array(tokens))
    np.testing.assert_allclose(np.array(got), np.array(naive), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_selective_log_softmax_half(dtype, shape):
    rng = np.random.default_rng(3)
    logits = mx.array((rng.normal(size=shape) * 4).astype(np.float32)).astype(dtype)
    tokens = mx.array(rng.integers(0, shape[-1], size=shape[:2]).astype(np.int32))
    got = selective_log_softmax(logits, tokens)
    assert got.dtype == mx.float32
    # Exact reference on the (rounded) half-precision values: only float32 rounding separates them.
    exact = np_log_softmax(np.array(logits.astype(mx.float32)))
    expected = np.take_along_axis(exact, np.array(tokens)[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(np.array(got), expected, rtol=1e-5, atol=1e-5)
    # The naive computation done in half precision agrees only loosely.
    naive = naive_mx_selective(logits, tokens).astype(mx.float32)
    np.testing.assert_allclose(np.array(got), np.array(naive), rtol=5e-2, atol=1e-1)


def test_selective_log_softmax_gradient():
    rng = np.random.default_rng(4)
    logits = mx.array(rng.normal(size=(2, 3, 5)).astype(np.float32))
    tokens = mx.array(rng.integers(0, 5, size=(2, 3)))
    weights = mx.array(rng.normal(size=(2, 3)).astype(np.float32))
    grad = mx.grad(lambda z: mx.sum(selective_log_softmax(z, tokens) * weights))(logits)
    # d log p_k / d l = onehot(k) - softmax(l)
    probs = np.exp(np_log_softmax(np.array(logits)))
    onehot = np.eye(5)[np.array(tokens)]
    expected = np.array(weights)[..., None] * (onehot - probs)
    np.testing.assert_allclose(np.array(grad), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_entropy_from_logits(dtype, shape):
    rng = np.random.default_rng(5)
    logits = mx.array((rng.normal(size=shape) * 3).astype(np.float32)).astype(dtype)
    got = entropy_from_logits(logits)
    assert got.dtype == mx.float32 and got.shape == shape[:2]
    logp = np_log_softmax(np.array(logits.astype(mx.float32)))
    expected = -(np.exp(logp) * logp).sum(axis=-1)
    np.testing.assert_allclose(np.array(got), expected, rtol=1e-5, atol=1e-5)


def test_entropy_extremes():
    uniform = mx.zeros((1, 2, 8))
    np.testing.assert_allclose(np.array(entropy_from_logits(uniform)), np.log(8), rtol=1e-6)
    peaked = mx.array([[[0.0, 100.0, 0.0]]])
    assert entropy_from_logits(peaked).item() == pytest.approx(0.0, abs=1e-6)


def test_logprob_shape_errors():
    with pytest.raises(ValueError, match=r"tokens has shape \(2, 4\) but logits has \(2, 3, 5\)"):
        selective_log_softmax(mx.zeros((2, 3, 5)), mx.zeros((2, 4), dtype=mx.int32))
    with pytest.raises(ValueError, match="integer"):
        selective_log_softmax(mx.zeros((2, 3, 5)), mx.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"\(B, T, V\)"):
        selective_log_softmax(mx.zeros((3, 5)), mx.zeros((3,), dtype=mx.int32))
    with pytest.raises(ValueError, match=r"\(B, T, V\)"):
        entropy_from_logits(mx.zeros((3, 5)))


# ----------------------------------------------------------------------------- mask_truncated_completions


@pytest.mark.parametrize("dtype", [mx.bool_, mx.int32, mx.float32])
def test_mask_truncated_completions(dtype):
    rng = np.random.default_rng(0)
    mask = rng.random((5, 7)) < 0.7
    ended = np.array([True, False, True, False, False])
    got = mask_truncated_completions(mx.array(mask).astype(dtype), mx.array(ended))
    assert got.dtype == dtype
    want = np.array([[mask[b, t] and ended[b] for t in range(7)] for b in range(5)])
    np.testing.assert_array_equal(np.array(got).astype(bool), want)
    # A response cut after its stop token keeps its mask; one that ran out of budget loses it.
    cut_mask = mx.array([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=mx.float32)
    flags = mx.array([True, False])
    np.testing.assert_array_equal(
        np.array(mask_truncated_completions(cut_mask, flags)), [[1, 1, 0, 0], [0, 0, 0, 0]]
    )
    with pytest.raises(ValueError, match=r"one flag per row"):
        mask_truncated_completions(mx.array(mask), mx.array(ended[:3]))
