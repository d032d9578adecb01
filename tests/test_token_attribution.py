"""token_attribution/: selective log-softmax, entropy, dropping truncated completions."""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from token_attribution.extractor import (
    check_ndim,
    check_same_shape,
    check_token_arrays,
    mask_truncated_completions,
    valid_mask,
)
from token_attribution.head_logprobs import (
    BLOCK_ELEMENTS,
    MIN_BLOCK_ROWS,
    LinearHead,
    default_block_rows,
    head_token_logprobs,
)
from base_setup.plain import plain_mlx_scope
from token_attribution.sequences import (
    next_token_scores,
    ScoringInputs,
    build_query_responses,
    gather_positions,
    logprobs_from,
    response_logprobs,
    response_positions,
    scoring_inputs,
    token_logprobs,
)
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
    with pytest.raises(
        ValueError, match=r"^tokens has shape \(2, 4\) but logits has \(2, 3, 5\); tokens must be"
    ):
        selective_log_softmax(mx.zeros((2, 3, 5)), mx.zeros((2, 4), dtype=mx.int32))
    with pytest.raises(
        ValueError, match=r"^tokens must be an integer array, got dtype mlx.core.float32$"
    ):
        selective_log_softmax(mx.zeros((2, 3, 5)), mx.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"^logits must have shape \(B, T, V\), got \(3, 5\)$"):
        selective_log_softmax(mx.zeros((3, 5)), mx.zeros((3,), dtype=mx.int32))
    with pytest.raises(ValueError, match=r"^tokens must have shape \(B, T\), got \(2, 3, 1\)$"):
        selective_log_softmax(mx.zeros((2, 3, 5)), mx.zeros((2, 3, 1), dtype=mx.int32))
    with pytest.raises(ValueError, match=r"^logits must have shape \(B, T, V\), got \(3, 5\)$"):
        entropy_from_logits(mx.zeros((3, 5)))
    with pytest.raises(ValueError, match=r"\(B, T, V\)"):
        selective_log_softmax(mx.zeros((3, 5)), mx.zeros((3,), dtype=mx.int32))
    with pytest.raises(ValueError, match=r"\(B, T, V\)"):
        entropy_from_logits(mx.zeros((3, 5)))


@pytest.mark.parametrize("tricks", [True, False])
def test_log_probs_and_entropy_paths(monkeypatch, tricks):
    """With the speed tricks, log-probs come from the hand-written-gradient gather, in one shot
    for float32 logits and a row (T, V) at a time for half precision (entropy too); without them
    (plain MLX, a GPU), from MLX's log_softmax. The values agree either way."""
    import token_attribution.logprob_computer as computer

    seen: list[tuple[str, tuple[int, ...]]] = []
    gather: Any = computer._log_softmax_gather  # an mx.custom_function
    row_entropy = computer._row_entropy
    monkeypatch.setattr(computer, "speed_tricks", lambda: tricks)

    def spy_gather(x: mx.array, t: mx.array) -> mx.array:
        seen.append(("gather", tuple(x.shape)))
        return gather(x, t)

    def spy_entropy(x: mx.array) -> mx.array:
        seen.append(("entropy", tuple(x.shape)))
        return row_entropy(x)

    monkeypatch.setattr(computer, "_log_softmax_gather", spy_gather)
    monkeypatch.setattr(computer, "_row_entropy", spy_entropy)
    rng = np.random.default_rng(8)
    logits = mx.array(rng.normal(size=(2, 3, 5)).astype(np.float32))
    tokens = mx.array(rng.integers(0, 5, size=(2, 3)))
    for dtype in (mx.float32, mx.bfloat16):
        seen.clear()
        x = logits.astype(dtype)
        got = selective_log_softmax(x, tokens)
        entropy_from_logits(x)
        rows = dtype == mx.bfloat16
        want_gather = [("gather", (3, 5))] * 2 if rows else [("gather", (2, 3, 5))]
        want_entropy = [("entropy", (3, 5))] * 2 if rows else [("entropy", (2, 3, 5))]
        assert seen == (want_gather if tricks else []) + want_entropy
        logp = np_log_softmax(np.array(x.astype(mx.float32)))
        want = np.take_along_axis(logp, np.array(tokens)[..., None], axis=-1)[..., 0]
        assert got.dtype == mx.float32
        np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- extractor


def test_shape_checks_name_both_arrays_and_pass_matching_ones():
    a, b = mx.zeros((2, 3)), mx.zeros((2, 4))
    check_same_shape("mask", a, "logprobs", mx.ones((2, 3)))  # same shape: no error
    with pytest.raises(
        ValueError, match=r"^mask has shape \(2, 3\) but logprobs has \(2, 4\); they must match$"
    ):
        check_same_shape("mask", a, "logprobs", b)
    check_ndim("x", a, 2, "(B, T)")
    with pytest.raises(ValueError, match=r"^x must have shape \(B, T\), got \(2, 3\)$"):
        check_ndim("x", a, 3, "(B, T)")
    check_token_arrays("rewards", a, values=mx.ones((2, 3)), mask=mx.ones((2, 3), dtype=mx.bool_))
    with pytest.raises(ValueError, match=r"^rewards must have shape \(B, T\), got \(6,\)$"):
        check_token_arrays("rewards", mx.zeros((6,)))
    with pytest.raises(ValueError, match=r"^mask has shape \(2, 4\) but rewards has \(2, 3\)"):
        check_token_arrays("rewards", a, values=a, mask=b)


@pytest.mark.parametrize("dtype", [mx.bool_, mx.int32, mx.float32])
def test_valid_mask_is_nonzero_as_bool(dtype):
    mask = mx.array([[0, 1, 2], [1, 0, 0]]).astype(dtype)
    got = valid_mask(mask)
    assert got.dtype == mx.bool_
    assert got.tolist() == [[False, True, True], [True, False, False]]
    # Float masks: any nonzero weight is valid, a fraction included.
    assert valid_mask(mx.array([0.0, 0.5, -1.0])).tolist() == [False, True, True]


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
    with pytest.raises(
        ValueError,
        match=r"^ended_with_stop has shape \(3,\) but mask has \(5, 7\); pass one flag per row",
    ):
        mask_truncated_completions(mx.array(mask), mx.array(ended[:3]))
    with pytest.raises(ValueError, match=r"^mask must have shape \(B, T\), got \(7,\)$"):
        mask_truncated_completions(mx.array(mask[0]), mx.array(ended[:1]))
    # 0/1 flags of another dtype read as bools.
    np.testing.assert_array_equal(
        np.array(mask_truncated_completions(cut_mask, mx.array([1, 0]))), [[1, 1, 0, 0], [0] * 4]
    )


# ------------------------------------------------------------- log-probs from hidden states


def _heads(dims: int, vocab: int) -> dict[str, tuple[nn.Module, Any]]:
    """Each head layout LinearHead takes: (module, head callable), frozen."""
    linear = nn.Linear(dims, vocab, bias=False)
    with_bias = nn.Linear(dims, vocab)
    embedding = nn.Embedding(vocab, dims)
    quantized = nn.QuantizedLinear(dims, vocab, bias=False, group_size=32, bits=4)
    quantized_embedding = nn.QuantizedEmbedding(vocab, dims, group_size=32, bits=4)
    quantized_8bit = nn.QuantizedLinear(dims, vocab, bias=True, group_size=64, bits=8)
    quantized_8bit.bias = mx.random.normal((vocab,))  # initialised to zeros
    mxfp4 = nn.QuantizedLinear(dims, vocab, bias=False, group_size=32, bits=4, mode="mxfp4")
    mxfp4_embedding = nn.QuantizedEmbedding(vocab, dims, group_size=32, bits=4, mode="mxfp4")
    heads = {
        "quantized_bias_8bit": (quantized_8bit, quantized_8bit),
        "mxfp4": (mxfp4, mxfp4),
        "mxfp4_tied": (mxfp4_embedding, mxfp4_embedding.as_linear),
        "linear": (linear, linear),
        "linear_bias": (with_bias, with_bias),
        "tied": (embedding, embedding.as_linear),
        "quantized": (quantized, quantized),
        "quantized_tied": (quantized_embedding, quantized_embedding.as_linear),
    }
    for module, _ in heads.values():
        module.freeze()
    return heads


@pytest.mark.parametrize("kind", ["linear", "linear_bias", "tied", "quantized", "quantized_tied"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("block_rows", [1, 7, None])
def test_head_token_logprobs_match_the_logits_path(kind, temperature, block_rows):
    """Values, entropy and the gradient w.r.t. the hidden states equal token_logprobs over the
    head's full logits (the naive path), for blocks of one vocabulary row, uneven blocks and one
    block."""
    mx.random.seed(0)
    dims, vocab = 64, 50
    _, head = _heads(dims, vocab)[kind]
    frozen = LinearHead.of(head)
    assert frozen is not None
    hidden = mx.random.normal((3, 7, dims))
    tokens = mx.random.randint(0, vocab, (3, 7))
    cot = mx.random.normal((3, 7))

    def fused(h: mx.array) -> mx.array:
        lp, _ = head_token_logprobs(h, frozen, tokens, temperature, block_rows=block_rows)
        return (cot * lp).sum()

    def naive(h: mx.array) -> mx.array:
        return (cot * token_logprobs(head(h), tokens, temperature)[0]).sum()

    got, got_grad = mx.value_and_grad(fused)(hidden)
    want, want_grad = mx.value_and_grad(naive)(hidden)
    np.testing.assert_allclose(got.item(), want.item(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(got_grad), np.array(want_grad), rtol=1e-4, atol=1e-6)
    assert float(mx.abs(got_grad).max()) > 0.0
    for differentiable in (True, False):
        lp, entropy = head_token_logprobs(
            hidden,
            frozen,
            tokens,
            temperature,
            with_entropy=True,
            differentiable=differentiable,
            block_rows=block_rows,
        )
        want_lp, want_entropy = token_logprobs(head(hidden), tokens, temperature, True)
        assert lp.shape == (3, 7) and lp.dtype == mx.float32
        np.testing.assert_allclose(np.array(lp), np.array(want_lp), rtol=1e-5, atol=1e-5)
        assert entropy is not None and want_entropy is not None
        np.testing.assert_allclose(np.array(entropy), np.array(want_entropy), atol=1e-5)

    # The entropy is differentiated too (an entropy bonus trains through it), unless
    # entropy_gradient=False makes it a constant (a mask by entropy).
    cot_h = mx.random.normal((3, 7))

    def with_bonus(h: mx.array, entropy_gradient: bool = True) -> mx.array:
        lp, ent = head_token_logprobs(
            h,
            frozen,
            tokens,
            temperature,
            with_entropy=True,
            entropy_gradient=entropy_gradient,
            block_rows=block_rows,
        )
        assert ent is not None
        return (cot * lp).sum() + (cot_h * ent).sum()

    def naive_bonus(h: mx.array) -> mx.array:
        lp, ent = token_logprobs(head(h), tokens, temperature, True)
        assert ent is not None
        return (cot * lp).sum() + (cot_h * ent).sum()

    got, got_grad = mx.value_and_grad(with_bonus)(hidden)
    want, want_grad = mx.value_and_grad(naive_bonus)(hidden)
    np.testing.assert_allclose(got.item(), want.item(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(got_grad), np.array(want_grad), rtol=1e-4, atol=1e-5)
    lp_only = mx.grad(fused)(hidden)
    assert float(mx.abs(got_grad - lp_only).max()) > 1e-3  # the entropy's share is there
    constant = mx.grad(lambda h: with_bonus(h, entropy_gradient=False))(hidden)
    np.testing.assert_allclose(np.array(constant), np.array(lp_only), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["linear", "linear_bias", "tied"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("block_rows", [1, 7, None])
def test_trained_head_token_logprobs_match_the_logits_path(kind, temperature, block_rows):
    """A trained head (a fully fine-tuned policy's): the values and the gradients w.r.t. the
    hidden states, the head's weight and its bias, of log-probs and entropy, equal autodiff's
    through the full logits; with entropy_gradient=False the entropy is a constant."""
    mx.random.seed(1)
    dims, vocab = 64, 37  # _heads builds quantized heads too: D a multiple of 64
    module, head = _heads(dims, vocab)[kind]
    module.unfreeze()
    hidden = mx.random.normal((2, 5, dims))
    tokens = mx.random.randint(0, vocab, (2, 5))
    cot, cot_h = mx.random.normal((2, 5)), mx.random.normal((2, 5))

    def loss(params: Any, h: mx.array, blockwise: bool, entropy_gradient: bool = True) -> Any:
        module.update(params)
        if blockwise:
            trained = LinearHead.of(head)
            assert trained is not None and trained.trained
            lp, ent = head_token_logprobs(
                h,
                trained,
                tokens,
                temperature,
                with_entropy=True,
                entropy_gradient=entropy_gradient,
                block_rows=block_rows,
            )
        else:
            lp, ent = token_logprobs(head(h), tokens, temperature, True)
            assert ent is not None
            if not entropy_gradient:
                ent = mx.stop_gradient(ent)
        assert ent is not None
        return (cot * lp).sum() + (cot_h * ent).sum()

    params = module.trainable_parameters()
    assert sorted(params) == (["bias", "weight"] if kind == "linear_bias" else ["weight"])
    for entropy_gradient in (True, False):
        grad_fn = mx.value_and_grad(loss, argnums=(0, 1))
        got, got_grads = grad_fn(params, hidden, True, entropy_gradient)
        want, want_grads = grad_fn(params, hidden, False, entropy_gradient)
        np.testing.assert_allclose(got.item(), want.item(), rtol=1e-5, atol=1e-5)
        got_flat = cast(list[tuple[str, mx.array]], tree_flatten(got_grads))
        want_flat = cast(list[tuple[str, mx.array]], tree_flatten(want_grads))
        assert [k for k, _ in got_flat] == [k for k, _ in want_flat]
        for (name, g), (_, w) in zip(got_flat, want_flat):
            assert float(mx.abs(w).max()) > 0.0, name
            np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-4, atol=1e-5, err_msg=name)


def test_trained_head_with_masked_vocabulary_rows():
    """A trained head whose bias is -inf on some rows: finite log-probs, entropy and gradients
    (the masked rows' weights get none), equal to the logits path's."""
    head = nn.Linear(8, 30)
    head.bias = mx.where(mx.arange(30) < 10, -mx.inf, 0.0)
    hidden = mx.random.normal((2, 3, 8), key=mx.random.key(3))
    tokens = mx.random.randint(10, 30, (2, 3), key=mx.random.key(4))

    def loss(weight: mx.array, h: mx.array) -> mx.array:
        head.weight = weight
        trained = LinearHead.of(head)
        assert trained is not None and trained.trained
        lp, _ = head_token_logprobs(h, trained, tokens, block_rows=6)
        return lp.sum()

    def naive(weight: mx.array, h: mx.array) -> mx.array:
        head.weight = weight
        return token_logprobs(head(h), tokens)[0].sum()

    weight = head.weight
    got, got_grads = mx.value_and_grad(loss, argnums=(0, 1))(weight, hidden)
    want, want_grads = mx.value_and_grad(naive, argnums=(0, 1))(weight, hidden)
    assert np.isfinite(got.item())
    np.testing.assert_allclose(got.item(), want.item(), rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        assert np.isfinite(np.array(g)).all()
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-4, atol=1e-6)
    assert float(mx.abs(got_grads[0][:10]).max()) == 0.0


@pytest.mark.parametrize("kind", ["quantized_bias_8bit", "mxfp4", "mxfp4_tied"])
def test_head_token_logprobs_match_the_logits_path_of_other_quantized_heads(kind):
    """A biased 8-bit head (group 64), and mxfp4 heads (no quantization biases), as above."""
    test_head_token_logprobs_match_the_logits_path(kind, 0.7, 7)


def test_head_token_logprobs_with_masked_vocabulary_rows():
    """A head whose bias is -inf on some rows (a masked vocabulary), the first block entirely:
    finite log-probs and gradients equal to the logits path's."""
    head = nn.Linear(8, 30)
    head.bias = mx.where(mx.arange(30) < 10, -mx.inf, 0.0)
    head.freeze()
    frozen = LinearHead.of(head)
    assert frozen is not None
    hidden = mx.random.normal((2, 3, 8), key=mx.random.key(3))
    tokens = mx.random.randint(10, 30, (2, 3), key=mx.random.key(4))
    got, grad = mx.value_and_grad(
        lambda h: head_token_logprobs(h, frozen, tokens, block_rows=6)[0].sum()
    )(hidden)
    want, want_grad = mx.value_and_grad(lambda h: token_logprobs(head(h), tokens)[0].sum())(hidden)
    assert np.isfinite(got.item()) and np.isfinite(np.array(grad)).all()
    np.testing.assert_allclose(got.item(), want.item(), rtol=1e-5)
    np.testing.assert_allclose(np.array(grad), np.array(want_grad), rtol=1e-4, atol=1e-6)


def test_head_token_logprobs_of_logits_in_the_hundreds():
    """Logits far past exp's float32 range (about 88): each block's exp is taken after the
    running max is subtracted, so the log-probs and entropy stay exact."""
    rng = np.random.default_rng(9)
    weight = rng.normal(size=(12, 4)).astype(np.float32) * 100  # logits of a few hundred
    hidden = rng.normal(size=(1, 3, 4)).astype(np.float32)
    hidden[0, 0] = 0.0  # logits 0 beside rows in the hundreds: each row subtracts its own max
    tokens = rng.integers(0, 12, size=(1, 3))
    head = nn.Linear(4, 12, bias=False)
    head.weight = mx.array(weight)
    head.freeze()
    frozen = LinearHead.of(head)
    assert frozen is not None
    lp, entropy = head_token_logprobs(
        mx.array(hidden), frozen, mx.array(tokens), with_entropy=True, block_rows=5
    )
    logp = np_log_softmax(hidden @ weight.T)
    assert np.abs(hidden @ weight.T).max() > 100
    want = np.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(np.array(lp), want, rtol=1e-4, atol=1e-3)
    assert entropy is not None
    np.testing.assert_allclose(
        np.array(entropy), -(np.exp(logp) * logp).sum(-1), rtol=1e-4, atol=1e-3
    )


def test_head_token_logprobs_after_a_masked_block_of_very_negative_logits():
    """A first block of -inf logits (a masked vocabulary), then logits near -200: the later
    blocks subtract their own max, not the 0 that stood in for the masked block's."""
    head = nn.Linear(4, 12)
    head.weight = mx.array(np.random.default_rng(10).normal(size=(12, 4)).astype(np.float32))
    head.bias = mx.where(mx.arange(12) < 5, -mx.inf, -200.0)
    head.freeze()
    frozen = LinearHead.of(head)
    assert frozen is not None
    hidden, tokens = mx.ones((1, 2, 4)), mx.array([[5, 11]])
    lp, _ = head_token_logprobs(hidden, frozen, tokens, block_rows=5)
    logits = np.array(hidden) @ np.array(head.weight).T - 200.0  # (1, 2, 12)
    logp = np_log_softmax(logits[..., 5:])
    want = np.take_along_axis(logp, np.array(tokens)[..., None] - 5, axis=-1)[..., 0]
    np.testing.assert_allclose(np.array(lp), want, rtol=1e-5, atol=1e-5)


def test_head_token_logprobs_defaults_and_temperature_half(monkeypatch):
    """No entropy unless asked for (differentiable or not); the default block covers the B * T
    positions; at temperature 0.5 the gradient is scaled by 2 as the logits are."""
    import token_attribution.head_logprobs as module

    head = nn.Linear(4, 9, bias=False)
    head.freeze()
    frozen = LinearHead.of(head)
    assert frozen is not None
    hidden = mx.random.normal((2, 3, 4), key=mx.random.key(11))
    tokens = mx.array([[0, 4, 8], [1, 2, 3]])
    asked: list[tuple[int, int]] = []
    real = module.default_block_rows

    def spy(vocab: int, positions: int) -> int:
        asked.append((vocab, positions))
        return real(vocab, positions)

    monkeypatch.setattr(module, "default_block_rows", spy)
    assert head_token_logprobs(hidden, frozen, tokens)[1] is None
    assert head_token_logprobs(hidden, frozen, tokens, differentiable=False)[1] is None
    assert asked == [(9, 6), (9, 6)]
    grad = mx.grad(lambda h: head_token_logprobs(h, frozen, tokens, 0.5)[0].sum())(hidden)
    want = mx.grad(lambda h: token_logprobs(head(h), tokens, 0.5)[0].sum())(hidden)
    np.testing.assert_allclose(np.array(grad), np.array(want), rtol=1e-4, atol=1e-6)


def test_head_token_logprobs_against_numpy_in_bfloat16():
    """bfloat16 hidden states and weight: float32 log-probs near float64 numpy's, gradient in the
    hidden states' dtype."""
    rng = np.random.default_rng(1)
    weight = rng.normal(size=(40, 16)).astype(np.float32)
    hidden = rng.normal(size=(2, 5, 16)).astype(np.float32)
    tokens = rng.integers(0, 40, size=(2, 5))
    head = nn.Linear(16, 40, bias=False)
    head.weight = mx.array(weight).astype(mx.bfloat16)
    head.freeze()
    frozen = LinearHead.of(head)
    assert frozen is not None
    h = mx.array(hidden).astype(mx.bfloat16)
    lp, _ = head_token_logprobs(h, frozen, mx.array(tokens), block_rows=16)
    logits = np.array(h.astype(mx.float32)) @ np.array(head.weight.astype(mx.float32)).T
    want = np.take_along_axis(np_log_softmax(logits), tokens[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(np.array(lp), want, atol=0.1)
    grad = mx.grad(lambda x: head_token_logprobs(x, frozen, mx.array(tokens))[0].sum())(h)
    assert grad.dtype == mx.bfloat16 and grad.shape == h.shape


def test_head_token_logprobs_for_scoring_are_constants():
    """differentiable=False returns constants: no gradient flows back (autodiff through the fast
    exp would be wrong)."""
    head = nn.Linear(8, 20, bias=False)
    head.freeze()
    frozen = LinearHead.of(head)
    assert frozen is not None
    tokens = mx.zeros((1, 3), mx.int32)

    def loss(h: mx.array) -> mx.array:
        lp, ent = head_token_logprobs(h, frozen, tokens, with_entropy=True, differentiable=False)
        assert ent is not None
        return lp.sum() + ent.sum()

    grad = mx.grad(loss)(mx.ones((1, 3, 8)))
    assert float(mx.abs(grad).max()) == 0.0


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("trained", [False, True], ids=["frozen", "trained"])
def test_head_blocks_run_one_after_the_other(trained: bool, compiled: bool) -> None:
    """A pass and its gradient hold a few vocabulary blocks at a time, whatever the vocabulary:
    doubling it adds only the trained head's weight gradient. (MLX computes independent blocks
    side by side: before the blocks were ordered, the memory held was 2.5-3x the whole (N, V)
    logits', and doubling the vocabulary added 36-93 blocks.)"""
    n, dims, rows = 128, 16, 256
    block = 4 * n * rows  # bytes of one block's (N, rows) logits

    def held(vocab: int) -> int:
        linear = nn.Linear(dims, vocab, bias=False)
        hidden = mx.random.normal((1, n, dims), key=mx.random.key(0))
        tokens = mx.random.randint(0, vocab, (1, n), key=mx.random.key(1))
        mx.eval(linear.parameters(), hidden, tokens)

        def loss(h: mx.array, weight: mx.array) -> mx.array:
            head = LinearHead(weight, trained=trained)  # the weight an input, as compiling asks
            lp, ent = head_token_logprobs(h, head, tokens, with_entropy=True, block_rows=rows)
            assert ent is not None
            return lp.sum() + ent.sum()

        gradient = mx.value_and_grad(loss, argnums=[0, 1] if trained else 0)
        if compiled:
            gradient = mx.compile(gradient)
        mx.eval(gradient(hidden, linear.weight))  # a compiled function's trace outside the count
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        mx.eval(gradient(hidden, linear.weight))
        return mx.get_peak_memory() - base

    small, large = held(32 * rows), held(64 * rows)
    weight_gradient = 4 * 32 * rows * dims if trained else 0  # what doubling adds to it, bytes
    assert large - small < 4 * weight_gradient + 4 * block, ((large - small) / block, small / block)
    if not trained:
        assert small < 24 * block, small / block  # the 32 blocks' logits: 32


def test_linear_head_takes_linear_and_tied_heads_and_says_whether_they_train():
    """A linear or tied head, frozen or trained (``trained`` says which); a trained quantized
    head (autodiff's gradient), a LoRA-wrapped head or any other function is refused (None), so
    callers take the logits path."""
    linear = nn.Linear(8, 20, bias=False)
    head = LinearHead.of(linear)
    assert head is not None and head.trained
    embedding = nn.Embedding(20, 8)
    head = LinearHead.of(embedding.as_linear)
    assert head is not None and head.trained
    embedding.freeze()
    head = LinearHead.of(embedding.as_linear)
    assert head is not None and not head.trained
    quantized = nn.QuantizedLinear(32, 20, bias=True, group_size=32, bits=4)
    head = LinearHead.of(quantized)
    assert head is not None and not head.trained
    quantized.unfreeze(keys=["bias"], strict=True)
    assert LinearHead.of(quantized) is None
    assert LinearHead.of(lambda h: h) is None

    def as_linear(h: mx.array) -> mx.array:  # named as a tied head's method, but no method
        return h

    assert LinearHead.of(as_linear) is None
    assert LinearHead.of(nn.Sequential(nn.Linear(8, 20))) is None


def test_head_token_logprobs_rejects_bad_input():
    head = nn.Linear(4, 6, bias=False)
    head.freeze()
    frozen = LinearHead.of(head)
    assert frozen is not None
    tokens = mx.zeros((1, 2), mx.int32)
    with pytest.raises(ValueError, match=r"^temperature must be > 0 to score log-probs, got 0.0$"):
        head_token_logprobs(mx.zeros((1, 2, 4)), frozen, tokens, 0.0)
    with pytest.raises(
        ValueError,
        match=r"^hidden must be \(B, T, D\) and tokens \(B, T\), got \(1, 2, 4\) and \(1, 3\)$",
    ):
        head_token_logprobs(mx.zeros((1, 2, 4)), frozen, mx.zeros((1, 3), mx.int32))
    with pytest.raises(ValueError, match=r"^hidden must be \(B, T, D\)"):
        head_token_logprobs(mx.zeros((1, 2)), frozen, tokens)
    with pytest.raises(ValueError, match=r"^block_rows must be >= 1, got 0$"):
        head_token_logprobs(mx.zeros((1, 2, 4)), frozen, tokens, block_rows=0)
    head_token_logprobs(mx.zeros((1, 2, 4)), frozen, tokens, block_rows=1)  # the smallest block


def test_default_block_rows():
    """BLOCK_ELEMENTS logits per block, at least MIN_BLOCK_ROWS rows, at most the vocabulary."""
    assert (BLOCK_ELEMENTS, MIN_BLOCK_ROWS) == (1 << 21, 256)
    assert default_block_rows(50_000, 4096) == (1 << 21) // 4096 == 512
    assert default_block_rows(50_000, 5000) == (1 << 21) // 5000 == 419
    assert default_block_rows(50_000, 100_000) == 256  # at least MIN_BLOCK_ROWS
    assert default_block_rows(100, 16) == 100  # at most the vocabulary
    assert default_block_rows(10**7, 0) == 1 << 21  # no positions: as one
    assert default_block_rows(10**7, 1) == 1 << 21


# ----------------------------------------------------------------------------- sequences


def test_build_query_responses_right_pads_each_prompt_and_response():
    responses = mx.array([[7, 8, 0], [9, 0, 0]])
    seqs, lengths = build_query_responses([[1, 2], [3, 4, 5]], responses, pad_token_id=0)
    assert seqs.dtype == mx.int32 and lengths.dtype == mx.int32
    assert seqs.tolist() == [[1, 2, 7, 8, 0, 0], [3, 4, 5, 9, 0, 0]]
    assert lengths.tolist() == [2, 3]
    # Response token j of row i is scored at position p_i - 1 + j.
    positions = response_positions(lengths, 3)
    assert positions.dtype == mx.int32
    assert positions.tolist() == [[1, 2, 3], [2, 3, 4]]
    assert build_query_responses([[5]], mx.array([[6]]), pad_token_id=9)[0].tolist() == [[5, 6]]
    with pytest.raises(ValueError, match=r"^1 prompts but 2 response rows$"):
        build_query_responses([[1]], responses, pad_token_id=0)
    with pytest.raises(ValueError, match=r"^every prompt needs at least one token$"):
        build_query_responses([[1], []], responses, pad_token_id=0)


def test_gather_positions_takes_rows_of_any_trailing_shape():
    x = mx.arange(2 * 4 * 3).reshape(2, 4, 3)  # (B, L, V)
    positions = mx.array([[1, 3], [0, 2]])
    want = np.take_along_axis(np.array(x), np.array(positions)[..., None], axis=1)
    assert np.array_equal(np.array(gather_positions(x, positions)), want)
    flat = mx.arange(8).reshape(2, 4)  # (B, L)
    assert gather_positions(flat, positions).tolist() == [[1, 3], [4, 6]]


def test_token_logprobs_scale_by_the_temperature():
    rng = np.random.default_rng(6)
    logits = mx.array(rng.normal(size=(2, 3, 5)).astype(np.float32))
    tokens = mx.array(rng.integers(0, 5, size=(2, 3)))
    for temperature in (1.0, 0.5, 2.0):
        lp, ent = token_logprobs(logits, tokens, temperature, with_entropy=True)
        assert ent is not None
        logp = np_log_softmax(np.array(logits) / temperature)
        want = np.take_along_axis(logp, np.array(tokens)[..., None], axis=-1)[..., 0]
        np.testing.assert_allclose(np.array(lp), want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(
            np.array(ent), -(np.exp(logp) * logp).sum(-1), rtol=1e-5, atol=1e-6
        )
    lp, ent = token_logprobs(logits, tokens)  # temperature 1, no entropy by default
    assert ent is None
    np.testing.assert_allclose(np.array(lp), np.array(selective_log_softmax(logits, tokens)))
    with pytest.raises(ValueError, match=r"^temperature must be > 0 to score log-probs, got 0$"):
        token_logprobs(logits, tokens, 0)


class _TableModel:
    """A ScoringModel whose hidden state at a position is a table row of the token there, with a
    linear head; records which pass was asked for."""

    def __init__(self, trainable_head: bool = False) -> None:
        rng = np.random.default_rng(7)
        self.table = mx.array(rng.normal(size=(11, 4)).astype(np.float32))  # (vocab, D)
        self.head = nn.Linear(4, 11, bias=False)
        if not trainable_head:
            self.head.freeze()
        self.calls: list[str] = []

    def hidden_at(self, input_ids: mx.array, positions: mx.array) -> mx.array:
        self.calls.append("hidden_at")
        return self.table[gather_positions(input_ids, positions)]  # (B, T, D)

    def logits_at(self, input_ids: mx.array, positions: mx.array) -> mx.array:
        self.calls.append("logits_at")
        return self.head(self.table[gather_positions(input_ids, positions)])  # (B, T, V)

    def output_head(self) -> Any:
        return self.head


@pytest.mark.parametrize("trainable_head", [False, True])
@pytest.mark.parametrize("differentiable", [True, False])
@pytest.mark.parametrize("plain", [False, True])
def test_response_logprobs_take_the_blockwise_path_where_they_may(
    trainable_head, differentiable, plain
):
    """The same log-probs and entropy as the logits path; the hidden states wherever the speed
    tricks are on (a frozen head, or a trained one, differentiated or not)."""
    model = _TableModel(trainable_head)
    seqs, lengths = build_query_responses([[1, 2], [3]], mx.array([[4, 5], [6, 0]]), 0)
    positions = response_positions(lengths, 2)
    responses = mx.array([[4, 5], [6, 0]])
    want_lp, want_ent = token_logprobs(model.logits_at(seqs, positions), responses, 0.7, True)
    model.calls.clear()
    with plain_mlx_scope(plain):
        lp, ent = response_logprobs(
            model,
            seqs,
            positions,
            responses,
            0.7,
            with_entropy=True,
            differentiable=differentiable,
        )
    assert ent is not None and want_ent is not None
    np.testing.assert_allclose(np.array(lp), np.array(want_lp), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array(ent), np.array(want_ent), rtol=1e-5, atol=1e-6)
    blockwise = not plain
    assert model.calls == ["hidden_at" if blockwise else "logits_at"]
    # Scoring passes (differentiable=False) are constants on the blockwise path.
    if blockwise:

        def total(table: mx.array) -> mx.array:
            model.table = table
            got = response_logprobs(
                model, seqs, positions, responses, differentiable=differentiable
            )
            return got[0].sum()

        grad = mx.grad(total)(model.table)
        assert (float(mx.abs(grad).max()) > 0) == differentiable


def test_response_logprobs_defaults():
    """Temperature 1, no entropy, differentiable: a trained head goes blockwise too, and its
    weight gets the logits path's gradient."""
    seqs, lengths = build_query_responses([[1, 2], [3]], mx.array([[4, 5], [6, 0]]), 0)
    positions, responses = response_positions(lengths, 2), mx.array([[4, 5], [6, 0]])
    trainable = _TableModel(trainable_head=True)
    want, _ = token_logprobs(trainable.logits_at(seqs, positions), responses)
    trainable.calls.clear()
    inputs = scoring_inputs(trainable, seqs, positions)
    assert inputs.head is not None and inputs.head.trained
    lp, ent = response_logprobs(trainable, seqs, positions, responses)
    assert ent is None and trainable.calls == ["hidden_at", "hidden_at"]
    np.testing.assert_allclose(np.array(lp), np.array(want), rtol=1e-5, atol=1e-6)

    def total(weight: mx.array, blockwise: bool) -> mx.array:
        trainable.head.weight = weight
        if blockwise:
            return response_logprobs(trainable, seqs, positions, responses)[0].sum()
        return token_logprobs(trainable.logits_at(seqs, positions), responses)[0].sum()

    weight = trainable.head.weight
    got, want_grad = mx.grad(total)(weight, True), mx.grad(total)(weight, False)
    assert float(mx.abs(want_grad).max()) > 0
    np.testing.assert_allclose(np.array(got), np.array(want_grad), rtol=1e-4, atol=1e-6)
    trainable.head.weight = weight
    trainable.head.freeze()  # the same head, frozen: the blockwise path without its gradient
    inputs = scoring_inputs(trainable, seqs, positions)
    assert inputs.head is not None and not inputs.head.trained
    lp, ent = logprobs_from(inputs, responses)
    assert ent is None
    np.testing.assert_allclose(np.array(lp), np.array(want), rtol=1e-5, atol=1e-6)
    grad = mx.grad(lambda h: logprobs_from(ScoringInputs(h, inputs.head), responses)[0].sum())(
        inputs.states
    )
    assert float(mx.abs(grad).max()) > 0


@pytest.mark.parametrize("model_kind", ["frozen_head", "trained_head", "plain_mlx", "callable"])
def test_next_token_scores_match_a_naive_reference(model_kind):
    """Each position's log-prob of the next token and its top log-prob equal NumPy's log-softmax
    of the logits, on the blockwise path (frozen or trained head), on the logits path (plain
    MLX) and through a callable's logits; the log-probs' gradient is the logits path's, the top
    log-probs are constants, and differentiable=False gives constants."""
    table_model = _TableModel(trainable_head=model_kind == "trained_head")
    ids = mx.array([[1, 4, 2, 9, 3], [5, 5, 0, 7, 10]])  # (B, L)

    def full_logits(table: mx.array) -> mx.array:
        return table_model.head(table[ids])  # (B, L, V)

    model: Any = table_model
    if model_kind == "callable":
        model = lambda context: table_model.head(table_model.table[context])  # noqa: E731
    logp = np_log_softmax(np.array(full_logits(table_model.table))[:, :-1].astype(np.float64))
    want = np.take_along_axis(logp, np.array(ids)[:, 1:, None], axis=-1)[..., 0]  # (B, L-1)
    with plain_mlx_scope(model_kind == "plain_mlx"):
        scores = next_token_scores(model, ids)
        assert scores.entropy is None
        np.testing.assert_allclose(np.array(scores.logprobs), want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.array(scores.top), logp.max(-1), rtol=1e-5, atol=1e-6)
        weights = mx.array(np.random.default_rng(3).normal(size=want.shape).astype(np.float32))

        def total(table: mx.array, differentiable: bool = True, top: bool = False) -> mx.array:
            table_model.table = table
            got = next_token_scores(model, ids, differentiable=differentiable)
            return ((got.top if top else got.logprobs) * weights).sum()

        def naive(table: mx.array) -> mx.array:
            logits = full_logits(table)[:, :-1]
            chosen = mx.take_along_axis(logits, ids[:, 1:, None], axis=-1)[..., 0]
            return ((chosen - mx.logsumexp(logits, axis=-1)) * weights).sum()

        table = table_model.table
        grad = mx.grad(total)(table)
        np.testing.assert_allclose(
            np.array(grad), np.array(mx.grad(naive)(table)), rtol=1e-4, atol=1e-6
        )
        assert float(mx.abs(grad).max()) > 0
        assert float(mx.abs(mx.grad(lambda t: total(t, top=True))(table)).max()) == 0
        assert float(mx.abs(mx.grad(lambda t: total(t, False))(table)).max()) == 0
    with pytest.raises(ValueError, match=r"L >= 2, got \(2, 1\)"):
        next_token_scores(model, ids[:, :1])
