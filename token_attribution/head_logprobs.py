"""Log-probs of the chosen tokens straight from the last hidden states and the LM head, a block
of the vocabulary at a time, never holding the (B, T, V) logits.

At a real vocabulary (49k-152k) the LM head's output dwarfs the rest of a training step: 16 x 128
positions x 49,152 is 100M float32 logits (three times as many at Qwen3's 151,936), and their
log-softmax and its gradient are element-wise passes over all of it. For the chosen token
``y_t`` at a position with hidden state ``h_t`` and head ``W`` (V, D), at temperature ``tau``::

    x_t        = W h_t / tau                          (V,)  logits
    logprob_t  = x_t[y_t] - logsumexp(x_t)
    d logprob_t / d h_t = (W[y_t] - softmax(x_t) @ W) / tau     (D,)

The gradient of ``logprob_t`` depends on ``h_t`` alone, and the loss reaches it through one scalar
cotangent ``c_t``; so the forward pass computes that (D,) Jacobian row ``J_t`` with the log-prob,
and the backward pass is ``c_t * J_t``. The same idea as fused linear cross-entropy kernels
(Liger-Kernel's ``FusedLinearCrossEntropy``, Apple's Cut Cross-Entropy), here for a per-token
log-prob whose cotangent the PPO loss supplies.

It runs over blocks of the vocabulary, all positions at once, with an online softmax (Milakov &
Gimelshein 2018): per block ``W_b`` of a few thousand rows, ``x_b = h W_b^T`` (N, V_b), the running
row max ``m``, the running sum ``s = s e^(m_old - m) + sum exp(x_b - m)`` and the running
``A = A e^(m_old - m) + exp(x_b - m) @ W_b`` (N, D), so that at the end ``lse = m + log s`` and
``softmax @ W = A / s``. The head's weight is read once, each block's (N, V_b) arrays stay small
(and in cache), and the work is the two matmuls autodiff's path does (logits, input gradient)
with one ``exp`` pass instead of two and no one-hot put along the vocabulary. The blocks are
ordered (``mx.depends``: a block's logits wait for the block before to be folded in), since MLX
evaluates independent parts of a graph side by side and would otherwise hold most blocks' arrays
at once, more than the whole logits.

A trained head (a fully fine-tuned policy's, tied or not) needs the gradient of its weight as
well, ``dW = sum_t c_t (onehot(y_t) - softmax(x_t)) h_t^T / tau``, which takes the cotangents:
the forward pass keeps ``lse`` (and the entropy's mean logit) and the backward pass recomputes each
block's logits, then takes its share of ``dh`` and ``dW`` (Liger-Kernel's and Cut Cross-Entropy's
backward). That is one matmul more than autodiff's three, and no (N, V) array. The entropy, when
asked for in a differentiated pass, is differentiated too (an entropy bonus trains through it):
``dH/dx_j = -p_j (x_j - E_p[x])``, so the frozen head's pass accumulates ``exp(x - max) * x @ W``
beside ``exp(x - max) @ W`` (one more matmul, only then).

Quantized heads (``QuantizedLinear``, a tied ``QuantizedEmbedding``, always frozen) multiply
each block through ``mx.quantized_matmul``; the chosen rows ``W[y_t]`` are dequantized alone.
``benchmarks/head_logprobs.py`` measures it against the logits path.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from base_setup import fast_math

#: Logits per block (N positions x V_b vocabulary rows): 2M float32 values (2,048 positions x
#: 1,024 vocabulary rows), small enough to stay in cache (benchmarks/head_logprobs.py --blocks).
BLOCK_ELEMENTS = 1 << 21
#: The fewest vocabulary rows per block (bounds the number of blocks for many positions).
MIN_BLOCK_ROWS = 256


@dataclass(frozen=True)
class LinearHead:
    """An LM head ``x = W h (+ bias)`` (D -> V), float or quantized, by blocks of its rows.

    Attributes:
        weight: (V, D) weight, or the packed quantized one (V, D * bits / 32).
        bias: (V,) bias of an ``nn.Linear`` head, or None.
        scales: quantization scales (None for a float weight).
        biases: quantization biases (None for a float weight or a mode without them).
        group_size: quantization group size.
        bits: quantization bits.
        mode: quantization mode (``mx.quantize``'s).
        trained: whether the head has trainable parameters (a fully fine-tuned policy's): a
            differentiated pass then gives ``weight`` (and ``bias``) their gradient.
    """

    weight: mx.array
    bias: mx.array | None = None
    scales: mx.array | None = None
    biases: mx.array | None = None
    group_size: int = 0
    bits: int = 0
    mode: str = "affine"
    trained: bool = False

    @classmethod
    def of(cls, head: Any) -> "LinearHead | None":
        """The :class:`LinearHead` of an ``nn.Linear`` / ``nn.QuantizedLinear`` or a tied
        ``nn.Embedding`` / ``nn.QuantizedEmbedding``'s bound ``as_linear``; None for any other
        head (a LoRA-wrapped or custom layer) and for a quantized head with trainable
        parameters (its gradient is autodiff's)."""
        module = head
        if getattr(head, "__name__", None) == "as_linear":
            module = getattr(head, "__self__", None)
            if not isinstance(module, (nn.Embedding, nn.QuantizedEmbedding)):
                return None
        elif not isinstance(head, (nn.Linear, nn.QuantizedLinear)):
            return None
        trained = bool(tree_flatten(module.trainable_parameters()))
        bias = module.get("bias") if isinstance(module, (nn.Linear, nn.QuantizedLinear)) else None
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            if trained:
                return None
            return cls(
                module["weight"],
                bias,
                module["scales"],
                module.get("biases"),
                module.group_size,
                module.bits,
                getattr(module, "mode", "affine"),
            )
        return cls(module["weight"], bias, trained=trained)

    @property
    def vocab_size(self) -> int:
        """V, the head's output rows."""
        return int(self.weight.shape[0])

    def _quantized(self, x: mx.array, start: int, stop: int, transpose: bool) -> mx.array:
        assert self.scales is not None
        # Affine scales carry the model's float dtype; the mx* modes' scales are uint8 exponents,
        # so the input keeps its own float dtype there.
        floating = mx.issubdtype(self.scales.dtype, mx.floating)
        return mx.quantized_matmul(
            x.astype(self.scales.dtype) if floating else x,
            self.weight[start:stop],
            self.scales[start:stop],
            None if self.biases is None else self.biases[start:stop],
            transpose=transpose,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )

    def logits(self, hidden: mx.array, start: int, stop: int) -> mx.array:
        """(N, D) -> (N, stop - start) float32 logits of vocabulary rows ``start:stop``."""
        if self.scales is None:
            out = hidden @ self.weight[start:stop].T
        else:
            out = self._quantized(hidden, start, stop, transpose=True)
        if self.bias is not None:
            out = out + self.bias[start:stop]
        return out.astype(mx.float32)

    def backward(self, cotangent: mx.array, start: int, stop: int) -> mx.array:
        """(N, stop - start) -> (N, D) float32 ``cotangent @ W[start:stop]``: that block's part of
        the head's input gradient."""
        if self.scales is None:
            weight = self.weight[start:stop]
            return (cotangent.astype(weight.dtype) @ weight).astype(mx.float32)
        return self._quantized(cotangent, start, stop, transpose=False).astype(mx.float32)

    def rows(self, tokens: mx.array) -> mx.array:
        """(N,) tokens -> (N, D) float32 rows ``W[tokens]`` (dequantized)."""
        if self.scales is None:
            return self.weight[tokens].astype(mx.float32)
        biases = None if self.biases is None else self.biases[tokens]
        return mx.dequantize(
            self.weight[tokens],
            self.scales[tokens],
            biases,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        ).astype(mx.float32)


#: Vocabulary rows per block set by :func:`fixed_block_rows` (0: none, the default rule).
_FIXED_ROWS = [0]


def default_block_rows(vocab: int, positions: int) -> int:
    """Vocabulary rows per block: :data:`BLOCK_ELEMENTS` logits over ``positions`` rows, at least
    :data:`MIN_BLOCK_ROWS`, at most ``vocab``; within :func:`fixed_block_rows`, its rows (at most
    ``vocab``) whatever the positions."""
    if _FIXED_ROWS[0]:
        return min(vocab, _FIXED_ROWS[0])
    return min(vocab, max(MIN_BLOCK_ROWS, BLOCK_ELEMENTS // max(positions, 1)))


@contextmanager
def fixed_block_rows(rows: int) -> Iterator[None]:
    """Within the block, every block of the vocabulary has ``rows`` rows whatever the number of
    positions: a compiled gradient (``training.compiled_gradient``) then traces the same block
    bounds, so the same kernels, for every batch shape."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    previous, _FIXED_ROWS[0] = _FIXED_ROWS[0], rows
    try:
        yield
    finally:
        _FIXED_ROWS[0] = previous


def _scaled(a: mx.array, inv_temperature: float) -> mx.array:
    """``a * inv_temperature``, without the pass at temperature 1."""
    return a if inv_temperature == 1.0 else a * inv_temperature


class HeadScores(NamedTuple):
    """What :func:`head_token_scores` computes of each position, each (N,) or (B, T) float32.

    Attributes:
        logprobs: the chosen token's log-prob.
        entropy: the entropy of the distribution, or None when not asked for.
        top: the highest log-prob of the distribution (its argmax token's), a constant: the
            chosen token is the most likely one where ``logprobs >= top`` (a token accuracy).
    """

    logprobs: mx.array
    entropy: mx.array | None
    top: mx.array


class _Pass(NamedTuple):
    """What :func:`_online_softmax` computed of (N) positions; the optional parts are None
    unless asked for."""

    logprobs: mx.array  # (N,) log-prob of each chosen token
    top: mx.array  # (N,) the highest log-prob of each position (its argmax token's)
    lse: mx.array  # (N, 1) logsumexp of each position's logits
    mean: mx.array | None  # (N, 1) E_p[x], the mean logit under the softmax: H = lse - mean
    jacobian: mx.array | None  # (N, D) d logprob / d h
    entropy_jacobian: mx.array | None  # (N, D) d H / d h


def _online_softmax(
    head: LinearHead,
    hidden: mx.array,
    tokens: mx.array,
    inv_temperature: float,
    block_rows: int,
    *,
    entropy: bool = False,
    jacobian: bool = False,
    entropy_jacobian: bool = False,
) -> _Pass:
    """(N, D) hidden, (N,) tokens -> the log-probs and what ``entropy``, ``jacobian`` and
    ``entropy_jacobian`` ask for (:class:`_Pass`), over blocks of the vocabulary (module
    docstring); every (N, V_b) array is local to its block."""
    vocab = head.vocab_size
    col = tokens[:, None]  # (N, 1)
    # The chosen token's column in every block at once, the blocks' starts an array: inside
    # ``mx.compile`` (the compiled gradient) a start written as a number is a constant of its
    # block's clip and mask, which makes them a kernel of their own per block, each built with the
    # system compiler at the first step (about a second each: 48 blocks at SmolLM2's vocabulary,
    # 149 at Qwen3's); as an input, every block but the last shares one.
    local = col - mx.arange(0, vocab, block_rows, dtype=col.dtype)[None, :]  # (N, blocks)
    n, dims = hidden.shape
    entropy = entropy or entropy_jacobian
    # Running row max, sum of exp(x - max), chosen logit, sum of exp(x - max) * x,
    # exp(x - max) @ W and (exp(x - max) * x) @ W; each block rescales them by
    # exp(old max - new max) (0 at the start).
    m = mx.full((n, 1), -mx.inf)
    s = mx.zeros((n, 1))
    chosen = mx.zeros((n, 1))
    xsum = mx.zeros((n, 1))
    acc = mx.zeros((n, dims))
    acc_x = mx.zeros((n, dims))
    for block, start in enumerate(range(0, vocab, block_rows)):
        stop = min(start + block_rows, vocab)
        # Each block's logits wait for the block before to be folded in, or MLX would compute
        # the blocks side by side and hold the logits of most of the vocabulary at once.
        h_in = mx.depends(hidden, [m, s, chosen, xsum, acc, acc_x]) if block else hidden
        x = head.logits(cast(mx.array, h_in), start, stop)  # (N, V_b)
        if inv_temperature != 1.0:
            x = x * inv_temperature
        kernels = fast_math.native_kernels(x, m)
        e = ex = None
        if kernels is not None:  # the same arithmetic, one pass over the block's rows
            want_e, want_ex = jacobian or entropy_jacobian, entropy_jacobian
            new_m, ref, e_sum, ex_sum, *rest = kernels.softmax_block(
                x, m, with_e=want_e, with_ex=want_ex
            )
            e = rest[0] if want_e else None
            ex = rest[1] if want_ex else None
        else:
            new_m = mx.maximum(m, x.max(axis=-1, keepdims=True))  # (N, 1)
            # The exps' reference: the running max, or 0 for a row of -inf so far (no NaN); the
            # running max itself stays -inf there, so that later blocks subtract their own max.
            ref = mx.where(mx.isinf(new_m), 0.0, new_m)  # (N, 1)
            e = fast_math.exp(x - ref)  # (N, V_b)
            e_sum = e.sum(axis=-1, keepdims=True)
            if entropy:
                ex = e * x  # (N, V_b)
                ex_sum = ex.sum(axis=-1, keepdims=True)
        rescale = fast_math.exp(m - ref)  # (N, 1)
        s = s * rescale + e_sum
        at = local[:, block : block + 1]  # (N, 1): col - start
        here = (at >= 0) & (at < stop - start)  # (N, 1): the chosen token is in this block
        picked = mx.take_along_axis(x, mx.clip(at, 0, stop - start - 1), axis=-1)
        chosen = mx.where(here, picked, chosen)
        if entropy:
            xsum = xsum * rescale + ex_sum
            if entropy_jacobian:
                assert ex is not None
                acc_x = acc_x * rescale + head.backward(ex, start, stop)  # (N, D)
        if jacobian or entropy_jacobian:
            assert e is not None
            acc = acc * rescale + head.backward(e, start, stop)  # (N, D)
        m = new_m
    lse = m + mx.log(s)  # (N, 1)
    mean = xsum / s if entropy else None  # (N, 1)
    jac = jac_h = None
    if jacobian or entropy_jacobian:
        softmax_w = acc / s  # (N, D) E_p[W_j]
    if jacobian:
        jac = _scaled(head.rows(tokens) - softmax_w, inv_temperature)  # (N, D)
    if entropy_jacobian:
        assert mean is not None
        # dH/dh = -sum_j p_j (x_j - E_p[x]) W_j / tau
        jac_h = _scaled(mean * softmax_w - acc_x / s, inv_temperature)  # (N, D)
    return _Pass((chosen - lse)[:, 0], (m - lse)[:, 0], lse, mean, jac, jac_h)


def _frozen_head_logprobs(
    head: LinearHead,
    hidden: mx.array,
    tokens: mx.array,
    inv_temperature: float,
    block_rows: int,
    with_entropy: bool,
    entropy_gradient: bool,
) -> HeadScores:
    """(N,) log-probs (and entropy) of a frozen head, differentiated w.r.t. the (N, D) hidden
    states through the Jacobian rows the forward pass computes; the top log-probs a constant."""
    entropy_jacobian = with_entropy and entropy_gradient

    @mx.custom_function
    def fused(h: mx.array, t: mx.array) -> tuple[mx.array, ...]:
        out = _online_softmax(
            head,
            h,
            t,
            inv_temperature,
            block_rows,
            entropy=with_entropy,
            jacobian=True,
            entropy_jacobian=entropy_jacobian,
        )
        assert out.jacobian is not None
        if not with_entropy:
            return out.logprobs, out.jacobian, out.top
        assert out.mean is not None
        entropy = (out.lse - out.mean)[:, 0]  # (N,)
        if not entropy_jacobian:
            return out.logprobs, out.jacobian, out.top, entropy
        assert out.entropy_jacobian is not None
        return out.logprobs, out.jacobian, out.top, entropy, out.entropy_jacobian

    @fused.vjp
    def fused_vjp(
        primals: tuple[mx.array, mx.array],
        cotangents: tuple[mx.array, ...],
        outputs: tuple[mx.array, ...],
    ) -> tuple[mx.array, mx.array]:
        # d logprob_t / d h_t = J_t (and d H_t / d h_t = J^H_t); no other position's outputs
        # depend on h_t. The top log-probs are constants.
        h, t = primals
        grad = cotangents[0].astype(mx.float32)[:, None] * outputs[1]  # (N, D)
        if entropy_jacobian:
            grad = grad + cotangents[3].astype(mx.float32)[:, None] * outputs[4]
        return grad.astype(h.dtype), mx.zeros_like(t)

    out = cast(tuple[mx.array, ...], fused(hidden, tokens))
    top = mx.stop_gradient(out[2])
    if not with_entropy:
        return HeadScores(out[0], None, top)
    return HeadScores(out[0], out[3] if entropy_jacobian else mx.stop_gradient(out[3]), top)


def _trained_head_logprobs(
    head: LinearHead,
    hidden: mx.array,
    tokens: mx.array,
    inv_temperature: float,
    block_rows: int,
    with_entropy: bool,
) -> HeadScores:
    """(N,) log-probs (and entropy) of a trained float head, differentiated w.r.t. the (N, D)
    hidden states, the head's weight and its bias: the forward pass keeps the logsumexp (and
    the mean logit), the backward pass recomputes each block's logits (module docstring). The
    top log-probs are constants."""
    has_bias = head.bias is not None

    def as_head(weight: mx.array, bias: mx.array | None) -> LinearHead:
        return LinearHead(weight, bias, trained=True)

    @mx.custom_function
    def fused(h: mx.array, t: mx.array, weight: mx.array, *bias: mx.array) -> tuple[mx.array, ...]:
        out = _online_softmax(
            as_head(weight, bias[0] if bias else None),
            h,
            t,
            inv_temperature,
            block_rows,
            entropy=with_entropy,
        )
        if not with_entropy:
            return out.logprobs, out.lse, out.top
        assert out.mean is not None
        return out.logprobs, out.lse, out.top, (out.lse - out.mean)[:, 0], out.mean

    @fused.vjp
    def fused_vjp(
        primals: tuple[mx.array, ...],
        cotangents: tuple[mx.array, ...],
        outputs: tuple[mx.array, ...],
    ) -> tuple[mx.array, ...]:
        h, t, weight = primals[:3]
        bias = primals[3] if has_bias else None
        trained = as_head(weight, bias)
        lse = outputs[1]  # (N, 1)
        c_lp = cotangents[0].astype(mx.float32)[:, None]  # (N, 1)
        c_ent = cotangents[3].astype(mx.float32)[:, None] if with_entropy else None
        mean = outputs[4] if with_entropy else None
        grad_h = mx.zeros(h.shape, dtype=mx.float32)  # (N, D)
        grad_w: list[mx.array] = []
        grad_b: list[mx.array] = []
        for start in range(0, trained.vocab_size, block_rows):
            stop = min(start + block_rows, trained.vocab_size)
            # One block after the other, as in the forward pass (_online_softmax).
            h_in = mx.depends(h, [grad_h, *grad_w[-1:], *grad_b[-1:]]) if grad_w else h
            x = trained.logits(cast(mx.array, h_in), start, stop)  # (N, V_b)
            if inv_temperature != 1.0:
                x = x * inv_temperature
            p = fast_math.exp_shifted(x, lse)  # (N, V_b) the softmax
            # dL/dx_j = c_lp (onehot_j - p_j) - c_H p_j (x_j - E_p[x]); the one-hot part after
            # the loop. A masked row (x = -inf) has p = 0 and no gradient.
            g = c_lp * p
            if c_ent is not None:
                assert mean is not None
                g = g + c_ent * p * mx.where(p > 0, x - mean, 0.0)
            g = -g  # (N, V_b)
            grad_h = grad_h + trained.backward(g, start, stop)
            grad_w.append(g.T.astype(h.dtype) @ h)  # (V_b, D)
            if bias is not None:
                grad_b.append(g.sum(axis=0))  # (V_b,)
        grad_h = _scaled(grad_h + c_lp * trained.rows(t), inv_temperature)
        dw = mx.concatenate(grad_w, axis=0).astype(mx.float32)
        dw = _scaled(dw.at[t].add(c_lp * h.astype(mx.float32)), inv_temperature)  # (V, D)
        grads = [grad_h.astype(h.dtype), mx.zeros_like(t), dw.astype(weight.dtype)]
        if bias is not None:
            db = _scaled(mx.concatenate(grad_b, axis=0).at[t].add(c_lp[:, 0]), inv_temperature)
            grads.append(db.astype(bias.dtype))
        return tuple(grads)

    extra = [head.bias] if head.bias is not None else []
    out = cast(tuple[mx.array, ...], fused(hidden, tokens, head.weight, *extra))
    return HeadScores(out[0], out[3] if with_entropy else None, mx.stop_gradient(out[2]))


def head_token_scores(
    hidden: mx.array,
    head: LinearHead,
    tokens: mx.array,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    differentiable: bool = True,
    entropy_gradient: bool = True,
    block_rows: int | None = None,
) -> HeadScores:
    """Log-probs of ``tokens`` under ``softmax(head(hidden) / temperature)``, by vocabulary blocks,
    with the entropy (when asked for) and the top log-prob of each position (:class:`HeadScores`).

    Naive equivalent (which holds the (B, T, V) logits and, for the gradient, their softmax)::

        token_logprobs(hidden @ W.T, tokens, temperature, with_entropy)  # W: the head's weight

    Args:
        hidden: (B, T, D) last hidden states at the positions that predict ``tokens``.
        head: the LM head (:meth:`LinearHead.of`); a trained one's weight (and bias) get their
            gradient in a differentiated pass.
        tokens: (B, T) integer ids, each in ``[0, V)``.
        temperature: the sampling temperature (> 0).
        with_entropy: also return the (B, T) entropy of the scaled distribution.
        differentiable: give the log-probs (and the entropy) their gradient; False for scoring
            passes that need none (the outputs are then constants).
        entropy_gradient: with ``differentiable``, also differentiate the entropy (an entropy
            bonus); False makes it a constant (a mask by entropy), which saves the frozen
            head's pass one matmul.
        block_rows: vocabulary rows per block (default: :func:`default_block_rows`).

    Returns:
        :class:`HeadScores`, each (B, T) float32.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score log-probs, got {temperature}")
    if hidden.ndim != 3 or tuple(tokens.shape) != tuple(hidden.shape[:2]):
        raise ValueError(
            f"hidden must be (B, T, D) and tokens (B, T), got {tuple(hidden.shape)} and "
            f"{tuple(tokens.shape)}"
        )
    batch, num_tokens, dims = hidden.shape
    flat_hidden = hidden.reshape(batch * num_tokens, dims)  # (N, D)
    flat_tokens = tokens.reshape(batch * num_tokens)  # (N,)
    inv_temperature = 1.0 / temperature
    if block_rows is None:
        block_rows = default_block_rows(head.vocab_size, batch * num_tokens)
    if block_rows < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")

    if not differentiable:
        # Constants: autodiff through the fast exp would be wrong, and no one asked for it.
        out = _online_softmax(
            head, flat_hidden, flat_tokens, inv_temperature, block_rows, entropy=with_entropy
        )
        entropy = None
        if with_entropy:
            assert out.mean is not None
            entropy = mx.stop_gradient((out.lse - out.mean)[:, 0])
        scores = HeadScores(mx.stop_gradient(out.logprobs), entropy, mx.stop_gradient(out.top))
    elif head.trained:
        scores = _trained_head_logprobs(
            head, flat_hidden, flat_tokens, inv_temperature, block_rows, with_entropy
        )
        if scores.entropy is not None and not entropy_gradient:
            scores = scores._replace(entropy=mx.stop_gradient(scores.entropy))
    else:
        scores = _frozen_head_logprobs(
            head,
            flat_hidden,
            flat_tokens,
            inv_temperature,
            block_rows,
            with_entropy,
            entropy_gradient,
        )
    shape = (batch, num_tokens)
    entropy = None if scores.entropy is None else scores.entropy.reshape(shape)
    return HeadScores(scores.logprobs.reshape(shape), entropy, scores.top.reshape(shape))


def head_token_logprobs(
    hidden: mx.array,
    head: LinearHead,
    tokens: mx.array,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    differentiable: bool = True,
    entropy_gradient: bool = True,
    block_rows: int | None = None,
) -> tuple[mx.array, mx.array | None]:
    """``(logprobs, entropy)`` of :func:`head_token_scores` (the same arguments): (B, T) float32
    each, ``entropy`` None unless asked for."""
    scores = head_token_scores(
        hidden,
        head,
        tokens,
        temperature,
        with_entropy=with_entropy,
        differentiable=differentiable,
        entropy_gradient=entropy_gradient,
        block_rows=block_rows,
    )
    return scores.logprobs, scores.entropy
