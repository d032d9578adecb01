"""Log-probs of the chosen tokens straight from the last hidden states and a frozen LM head, a
block of the vocabulary at a time, never holding the (B, T, V) logits.

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
with one ``exp`` pass instead of two and no one-hot put along the vocabulary.

Only a frozen head: the head's weight gets no gradient here (a LoRA policy's head is frozen; a
fully fine-tuned policy with a trainable head goes through autodiff, ``FrozenHead.of`` says
which). Quantized heads (``QuantizedLinear``, a tied ``QuantizedEmbedding``) multiply each block
through ``mx.quantized_matmul``; the chosen rows ``W[y_t]`` are dequantized alone.
``benchmarks/head_logprobs.py`` measures it against the logits path.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, cast

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
class FrozenHead:
    """A frozen LM head ``x = W h (+ bias)`` (D -> V), float or quantized, by blocks of its rows.

    Attributes:
        weight: (V, D) weight, or the packed quantized one (V, D * bits / 32).
        bias: (V,) bias of an ``nn.Linear`` head, or None.
        scales: quantization scales (None for a float weight).
        biases: quantization biases (None for a float weight or a mode without them).
        group_size: quantization group size.
        bits: quantization bits.
        mode: quantization mode (``mx.quantize``'s).
    """

    weight: mx.array
    bias: mx.array | None = None
    scales: mx.array | None = None
    biases: mx.array | None = None
    group_size: int = 0
    bits: int = 0
    mode: str = "affine"

    @classmethod
    def of(cls, head: Any, *, require_frozen: bool = True) -> "FrozenHead | None":
        """The :class:`FrozenHead` of an ``nn.Linear`` / ``nn.QuantizedLinear`` or a tied
        ``nn.Embedding`` / ``nn.QuantizedEmbedding``'s bound ``as_linear``; None for any other
        head (a LoRA-wrapped or custom layer), or, with ``require_frozen``, for one that has
        trainable parameters (its gradient would be lost)."""
        module = head
        if getattr(head, "__name__", None) == "as_linear":
            module = getattr(head, "__self__", None)
            if not isinstance(module, (nn.Embedding, nn.QuantizedEmbedding)):
                return None
        elif not isinstance(head, (nn.Linear, nn.QuantizedLinear)):
            return None
        if require_frozen and tree_flatten(module.trainable_parameters()):
            return None
        bias = module.get("bias") if isinstance(module, (nn.Linear, nn.QuantizedLinear)) else None
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            return cls(
                module["weight"],
                bias,
                module["scales"],
                module.get("biases"),
                module.group_size,
                module.bits,
                getattr(module, "mode", "affine"),
            )
        return cls(module["weight"], bias)

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


def _online_softmax(
    head: FrozenHead,
    hidden: mx.array,
    tokens: mx.array,
    inv_temperature: float,
    with_entropy: bool,
    with_jacobian: bool,
    block_rows: int,
) -> tuple[mx.array, mx.array | None, mx.array | None]:
    """(N, D) hidden, (N,) tokens -> (N,) log-probs, (N,) entropy or None, (N, D) Jacobian rows
    or None, over blocks of the vocabulary (module docstring); every (N, V_b) array is local to
    its block."""
    vocab = head.vocab_size
    col = tokens[:, None]  # (N, 1)
    n = hidden.shape[0]
    # Running row max, sum of exp(x - max), chosen logit, sum of exp(x - max) * x, and
    # exp(x - max) @ W; each block rescales them by exp(old max - new max) (0 at the start).
    m = mx.full((n, 1), -mx.inf)
    s = mx.zeros((n, 1))
    chosen = mx.zeros((n, 1))
    xsum = mx.zeros((n, 1))
    acc = mx.zeros((n, hidden.shape[1]))
    for start in range(0, vocab, block_rows):
        stop = min(start + block_rows, vocab)
        x = head.logits(hidden, start, stop)  # (N, V_b)
        if inv_temperature != 1.0:
            x = x * inv_temperature
        new_m = mx.maximum(m, x.max(axis=-1, keepdims=True))  # (N, 1)
        # The exps' reference: the running max, or 0 for a row of -inf so far (no NaN); the
        # running max itself stays -inf there, so that later blocks subtract their own max.
        ref = mx.where(mx.isinf(new_m), 0.0, new_m)  # (N, 1)
        rescale = fast_math.exp(m - ref)  # (N, 1)
        e = fast_math.exp(x - ref)  # (N, V_b)
        s = s * rescale + e.sum(axis=-1, keepdims=True)
        here = (col >= start) & (col < stop)  # (N, 1): the chosen token is in this block
        picked = mx.take_along_axis(x, mx.clip(col - start, 0, stop - start - 1), axis=-1)
        chosen = mx.where(here, picked, chosen)
        if with_entropy:
            xsum = xsum * rescale + (e * x).sum(axis=-1, keepdims=True)
        if with_jacobian:
            acc = acc * rescale + head.backward(e, start, stop)  # (N, D)
        m = new_m
    lse = m + mx.log(s)  # (N, 1)
    logprobs = (chosen - lse)[:, 0]  # (N,)
    entropy = (lse - xsum / s)[:, 0] if with_entropy else None
    jacobian = None
    if with_jacobian:
        jacobian = head.rows(tokens) - acc / s  # (N, D)
        if inv_temperature != 1.0:
            jacobian = jacobian * inv_temperature
    return logprobs, entropy, jacobian


def head_token_logprobs(
    hidden: mx.array,
    head: FrozenHead,
    tokens: mx.array,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    differentiable: bool = True,
    block_rows: int | None = None,
) -> tuple[mx.array, mx.array | None]:
    """Log-probs of ``tokens`` under ``softmax(head(hidden) / temperature)``, by vocabulary blocks.

    Naive equivalent (which holds the (B, T, V) logits and, for the gradient, their softmax)::

        token_logprobs(hidden @ W.T, tokens, temperature, with_entropy)  # W: the head's weight

    Args:
        hidden: (B, T, D) last hidden states at the positions that predict ``tokens``.
        head: the frozen LM head (:meth:`FrozenHead.of`).
        tokens: (B, T) integer ids, each in ``[0, V)``.
        temperature: the sampling temperature (> 0).
        with_entropy: also return the (B, T) entropy of the scaled distribution, a constant.
        differentiable: give the log-probs their gradient w.r.t. ``hidden`` (the Jacobian rows
            cost the input gradient's matmul); False for scoring passes that need none (the
            outputs are then constants).
        block_rows: vocabulary rows per block (default: :func:`default_block_rows`).

    Returns:
        ``(logprobs, entropy)``: (B, T) float32 each; ``entropy`` is None unless asked for.
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
        logprobs, entropy, _ = _online_softmax(
            head, flat_hidden, flat_tokens, inv_temperature, with_entropy, False, block_rows
        )
        logprobs = mx.stop_gradient(logprobs)
        entropy = None if entropy is None else mx.stop_gradient(entropy)
    else:

        @mx.custom_function
        def fused(h: mx.array, t: mx.array) -> tuple[mx.array, ...]:
            lp, ent, jac = _online_softmax(
                head, h, t, inv_temperature, with_entropy, True, block_rows
            )
            assert jac is not None
            return (lp, jac) if ent is None else (lp, jac, ent)

        @fused.vjp
        def fused_vjp(
            primals: tuple[mx.array, mx.array],
            cotangents: tuple[mx.array, ...],
            outputs: tuple[mx.array, ...],
        ) -> tuple[mx.array, mx.array]:
            # d logprob_t / d h_t = J_t, and no other position's log-prob depends on h_t.
            h, t = primals
            grad = cotangents[0].astype(mx.float32)[:, None] * outputs[1]  # (N, D)
            return grad.astype(h.dtype), mx.zeros_like(t)

        out = cast(tuple[mx.array, ...], fused(flat_hidden, flat_tokens))
        logprobs = out[0]
        entropy = mx.stop_gradient(out[2]) if with_entropy else None
    logprobs = logprobs.reshape(batch, num_tokens)
    if entropy is not None:
        entropy = entropy.reshape(batch, num_tokens)
    return logprobs, entropy
