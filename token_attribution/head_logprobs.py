"""Log-probs of the chosen tokens straight from the last hidden states and a frozen LM head, a
block of positions at a time, never holding the (B, T, V) logits.

At a real vocabulary (49k-152k) the LM head's output dwarfs the rest of a training step: 16 x 128
positions x 49,152 is 100M logits, 400 MB in float32, and their log-softmax and its gradient are
element-wise passes over all of it. For the chosen token ``y_t`` at a position with hidden state
``h_t`` and head ``W`` (V, D), at temperature ``tau``::

    x_t        = W h_t / tau                          (V,)  logits
    logprob_t  = x_t[y_t] - logsumexp(x_t)
    d logprob_t / d h_t = (W[y_t] - softmax(x_t) @ W) / tau     (D,)

The gradient of ``logprob_t`` depends on ``h_t`` alone, and the loss reaches it through one scalar
cotangent ``c_t``; so the forward pass computes that (D,) Jacobian row ``J_t`` with the log-prob,
from the same ``exp`` pass (``softmax @ W`` is the head's own backward matmul), and the backward
pass is ``c_t * J_t``. Per block of rows: one matmul for the logits, a max, one ``exp`` pass and a
sum over the vocabulary, one matmul back (the same two matmuls as autodiff's path), against
autodiff's logits, ``logsumexp`` (max, ``exp``, sum), a second ``exp`` pass for the softmax, a put
of the one-hot along the vocabulary and the matmul; and the block's (rows, V) arrays are freed
before the next block's. The same trick as fused linear cross-entropy kernels (Liger-Kernel's
``FusedLinearCrossEntropy``), here for a per-token log-prob whose cotangent the PPO loss supplies.

Only a frozen head: the head's weight gets no gradient here (a LoRA policy's head is frozen; a
fully fine-tuned policy with a trainable head goes through autodiff, ``FrozenHead.of`` says
which). Quantized heads (``QuantizedLinear``, a tied ``QuantizedEmbedding``) multiply through
``mx.quantized_matmul`` both ways; the chosen rows ``W[y_t]`` are dequantized alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from base_setup import fast_math

#: Logits per block (rows x V): 4M float32 values, 16 MB; at a 49,152 vocabulary 85 positions.
BLOCK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class FrozenHead:
    """An LM head ``x = head(h)`` (D -> V) with what its input gradient needs.

    Attributes:
        call: the head as the model applies it (``lm_head`` or the tied embedding's
            ``as_linear``): (..., D) -> (..., V) logits.
        weight: (V, D) weight, or the packed quantized one.
        scales: quantization scales (None for a float weight).
        biases: quantization biases (None for a float weight or a mode without them).
        group_size: quantization group size.
        bits: quantization bits.
        mode: quantization mode (``mx.quantize``'s).
    """

    call: Callable[[mx.array], mx.array]
    weight: mx.array
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
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            return cls(
                head,
                module["weight"],
                module["scales"],
                module.get("biases"),
                module.group_size,
                module.bits,
                getattr(module, "mode", "affine"),
            )
        return cls(head, module["weight"])

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

    def backward(self, cotangent: mx.array) -> mx.array:
        """(N, V) -> (N, D) float32 ``cotangent @ W``: the head's input gradient."""
        if self.scales is None:
            return (cotangent.astype(self.weight.dtype) @ self.weight).astype(mx.float32)
        out = mx.quantized_matmul(
            cotangent.astype(self.scales.dtype),
            self.weight,
            self.scales,
            self.biases,
            transpose=False,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )
        return out.astype(mx.float32)


def _block_rows(vocab: int, rows: int, block_elements: int) -> int:
    """Rows per block: ``block_elements`` logits, at least one row, at most all."""
    return max(1, min(rows, block_elements // max(vocab, 1)))


def _block(
    head: FrozenHead,
    hidden: mx.array,
    tokens: mx.array,
    inv_temperature: float,
    with_entropy: bool,
    with_jacobian: bool,
) -> tuple[mx.array, mx.array | None, mx.array | None]:
    """One block: (n, D) hidden, (n,) tokens -> (n,) log-probs, (n,) entropy or None, (n, D)
    Jacobian rows or None; every (n, V) array is local to the block."""
    x = head.call(hidden).astype(mx.float32)  # (n, V)
    if inv_temperature != 1.0:
        x = x * inv_temperature
    # w = exp(x - max) with its sum: softmax = w / total, from the one exp pass.
    lse, w, total = fast_math.logsumexp_parts(x, axis=-1)  # (n, 1), (n, V), (n, 1)
    logprobs = (mx.take_along_axis(x, tokens[:, None], axis=-1) - lse)[:, 0]  # (n,)
    entropy = (lse - (w * x).sum(axis=-1, keepdims=True) / total)[:, 0] if with_entropy else None
    jacobian = None
    if with_jacobian:
        jacobian = head.rows(tokens) - head.backward(w) / total  # (n, D)
        if inv_temperature != 1.0:
            jacobian = jacobian * inv_temperature
    return logprobs, entropy, jacobian


def _blocks(
    head: FrozenHead,
    hidden: mx.array,
    tokens: mx.array,
    inv_temperature: float,
    with_entropy: bool,
    with_jacobian: bool,
    block_elements: int,
) -> tuple[mx.array, mx.array | None, mx.array | None]:
    """:func:`_block` over (N, D) hidden in blocks of rows, concatenated."""
    step = _block_rows(head.weight.shape[0], hidden.shape[0], block_elements)
    parts = [
        _block(
            head,
            hidden[s : s + step],
            tokens[s : s + step],
            inv_temperature,
            with_entropy,
            with_jacobian,
        )
        for s in range(0, hidden.shape[0], step)
    ]
    logprobs = mx.concatenate([p[0] for p in parts])  # (N,)
    entropy = mx.concatenate([p[1] for p in parts if p[1] is not None]) if with_entropy else None
    jacobian = None
    if with_jacobian:
        jacobian = mx.concatenate([p[2] for p in parts if p[2] is not None])  # (N, D)
    return logprobs, entropy, jacobian


def head_token_logprobs(
    hidden: mx.array,
    head: FrozenHead,
    tokens: mx.array,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    differentiable: bool = True,
    block_elements: int = BLOCK_ELEMENTS,
) -> tuple[mx.array, mx.array | None]:
    """Log-probs of ``tokens`` under ``softmax(head(hidden) / temperature)``, blockwise.

    Naive equivalent (which holds the (B, T, V) logits and, for the gradient, their softmax)::

        token_logprobs(head.call(hidden), tokens, temperature, with_entropy)

    Args:
        hidden: (B, T, D) last hidden states at the positions that predict ``tokens``.
        head: the frozen LM head (:meth:`FrozenHead.of`).
        tokens: (B, T) integer ids, each in ``[0, V)``.
        temperature: the sampling temperature (> 0).
        with_entropy: also return the (B, T) entropy of the scaled distribution, a constant.
        differentiable: give the log-probs their gradient w.r.t. ``hidden`` (the Jacobian rows
            cost one more matmul per block; False for scoring passes that need none).
        block_elements: logits per block of positions (rows x V).

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

    if not differentiable:
        logprobs, entropy, _ = _blocks(
            head, flat_hidden, flat_tokens, inv_temperature, with_entropy, False, block_elements
        )
    else:

        @mx.custom_function
        def fused(h: mx.array, t: mx.array) -> tuple[mx.array, ...]:
            lp, ent, jac = _blocks(head, h, t, inv_temperature, with_entropy, True, block_elements)
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
