"""Which positions of a prompt+response sequence are actions, and their per-token log-probs.

Sequences are right-padded: row ``i`` holds its ``p_i`` prompt tokens, then its ``T`` response
columns (response tokens, then pad), then pad up to ``L = max_i p_i + T``. A causal model's logits at
position ``t`` score the token at ``t + 1``, so response token ``j`` of row ``i`` is scored by the
logits (and valued by the value model) at position ``p_i - 1 + j``. Padding after a row's content
never influences earlier positions of a causal model, so right padding is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import mlx.core as mx
import numpy as np

from base_setup.plain import speed_tricks
from token_attribution.head_logprobs import (
    HeadScores,
    LinearHead,
    head_token_logprobs,
    head_token_scores,
)
from token_attribution.logprob_computer import entropy_from_logits, selective_log_softmax


def build_query_responses(
    prompts: Sequence[Sequence[int]], responses: mx.array, pad_token_id: int
) -> tuple[mx.array, mx.array]:
    """Concatenate each prompt with its response columns, right-padded.

    Args:
        prompts: B token-id lists (lengths may differ, each >= 1).
        responses: (B, T) int response tokens (already padded after the stop token).
        pad_token_id: id used for padding.

    Returns:
        ``(query_responses, prompt_lengths)``: (B, L) int32 with ``L = max p_i + T``, and (B,) int32.
    """
    if len(prompts) != responses.shape[0]:
        raise ValueError(f"{len(prompts)} prompts but {responses.shape[0]} response rows")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    num_tokens = responses.shape[1]
    lengths = np.array([len(p) for p in prompts], dtype=np.int32)
    out = np.full((len(prompts), int(lengths.max()) + num_tokens), pad_token_id, dtype=np.int32)
    resp = np.array(responses, dtype=np.int32)
    for i, prompt in enumerate(prompts):
        out[i, : lengths[i]] = prompt
        out[i, lengths[i] : lengths[i] + num_tokens] = resp[i]
    return mx.array(out), mx.array(lengths)


def response_positions(prompt_lengths: mx.array, num_tokens: int) -> mx.array:
    """(B, T) int32 positions whose outputs score (or value) response tokens 0..T-1."""
    return (prompt_lengths[:, None] - 1 + mx.arange(num_tokens)[None, :]).astype(mx.int32)


def gather_positions(x: mx.array, positions: mx.array) -> mx.array:
    """Rows of ``x`` (B, L, ...) at ``positions`` (B, T): returns (B, T, ...)."""
    index = positions.reshape(*positions.shape, *([1] * (x.ndim - 2)))
    return mx.take_along_axis(x, index, axis=1)


def token_logprobs(
    scored: mx.array,
    responses: mx.array,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[mx.array, mx.array | None]:
    """Per-token log-probs of the responses under ``scored / temperature``.

    Args:
        scored: (B, T, V) logits at the response positions (``response_positions``), e.g. from
            ``PolicyModel.logits_at``, which runs the LM head on those positions only.
        responses: (B, T) response tokens.
        temperature: the sampling temperature.
        with_entropy: also return the (B, T) entropy of the scaled distribution.

    Returns:
        ``(logprobs, entropy)``, (B, T) float32 each; ``entropy`` is None unless asked for.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score log-probs, got {temperature}")
    if temperature != 1.0:
        scored = scored / temperature
    logprobs = selective_log_softmax(scored, responses)
    entropy = entropy_from_logits(scored) if with_entropy else None
    return logprobs, entropy


class ScoringModel(Protocol):
    """What :func:`response_logprobs` needs of a model (``PolicyModel``, ``ReferenceModel``)."""

    def logits_at(self, input_ids: mx.array, positions: mx.array) -> mx.array: ...

    def hidden_at(self, input_ids: mx.array, positions: mx.array) -> mx.array: ...

    def output_head(self) -> Any: ...


@dataclass(frozen=True)
class ScoringInputs:
    """What a model's per-token log-probs are computed from (:func:`scoring_inputs`).

    Attributes:
        states: (B, T, D) last hidden states where ``head`` is set (the blockwise path), else
            (B, T, V) logits.
        head: the model's linear LM head (frozen or trained), or None (``states`` are logits).
    """

    states: mx.array
    head: LinearHead | None


def scoring_inputs(
    model: ScoringModel, query_responses: mx.array, positions: mx.array
) -> ScoringInputs:
    """The first half of :func:`response_logprobs`: the model's pass over the sequences, up to
    the hidden states where its LM head is a linear or tied-embedding layer (float or
    quantized; :meth:`LinearHead.of`), else up to the logits (always under plain MLX and off
    the CPU: :func:`base_setup.plain.speed_tricks`). A caller can evaluate it apart from the
    head's work (the rollout runs it beside other models' passes)."""
    head = model.output_head() if speed_tricks() else None  # plain MLX, a GPU: the logits
    linear = None if head is None else LinearHead.of(head)
    if linear is None:
        return ScoringInputs(model.logits_at(query_responses, positions), None)
    return ScoringInputs(model.hidden_at(query_responses, positions), linear)


def logprobs_from(
    inputs: ScoringInputs,
    responses: mx.array,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    differentiable: bool = True,
    entropy_gradient: bool = True,
) -> tuple[mx.array, mx.array | None]:
    """The second half of :func:`response_logprobs`: the log-probs (and entropy) of
    ``responses`` from :func:`scoring_inputs`' output, blockwise from the hidden states
    (:func:`token_attribution.head_logprobs.head_token_logprobs`) or from the logits."""
    if inputs.head is None:
        logprobs, entropy = token_logprobs(inputs.states, responses, temperature, with_entropy)
        if entropy is not None and not (differentiable and entropy_gradient):
            entropy = mx.stop_gradient(entropy)
        return logprobs, entropy
    return head_token_logprobs(
        inputs.states,
        inputs.head,
        responses,
        temperature,
        with_entropy=with_entropy,
        differentiable=differentiable,
        entropy_gradient=entropy_gradient,
    )


def response_logprobs(
    model: ScoringModel,
    query_responses: mx.array,
    positions: mx.array,
    responses: mx.array,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    differentiable: bool = True,
    entropy_gradient: bool = True,
) -> tuple[mx.array, mx.array | None]:
    """Per-token log-probs (and entropy) of the responses under ``model``, at ``temperature``.

    The same values as ``token_logprobs(model.logits_at(query_responses, positions), responses,
    temperature, with_entropy)``. Where the model's LM head is a linear or tied-embedding layer
    (float or quantized, frozen or trained), they come blockwise from the hidden states
    (:func:`token_attribution.head_logprobs.head_token_logprobs`), without the (B, T, V)
    logits; otherwise (a LoRA-adapted head, a model with scaled or capped logits) through the
    logits. (:func:`scoring_inputs` then :func:`logprobs_from`.)

    Args:
        model: the policy or reference model.
        query_responses: (B, L) prompt + response tokens (:func:`build_query_responses`).
        positions: (B, T) positions that score the response tokens (:func:`response_positions`).
        responses: (B, T) response tokens.
        temperature: the sampling temperature.
        with_entropy: also return the (B, T) entropy.
        differentiable: False for scoring passes that take no gradient (skips the blockwise
            path's gradient work; the outputs are constants).
        entropy_gradient: with ``differentiable``, differentiate the entropy too (an entropy
            bonus); False: a constant (a mask by entropy), one matmul less on the blockwise path.

    Returns:
        ``(logprobs, entropy)``, (B, T) float32 each; ``entropy`` is None unless asked for.
    """
    inputs = scoring_inputs(model, query_responses, positions)
    return logprobs_from(
        inputs,
        responses,
        temperature,
        with_entropy=with_entropy,
        differentiable=differentiable,
        entropy_gradient=entropy_gradient,
    )


def next_token_scores(
    model: Any, input_ids: mx.array, *, differentiable: bool = True
) -> HeadScores:
    """Each position's log-prob of the token that follows it, under ``model`` at temperature 1:
    what next-token cross-entropy (SFT) and sequence log-probs (DPO) are made of.

    ``logprobs[b, t] = log p(input_ids[b, t + 1] | input_ids[b, : t + 1])``, (B, L-1) float32,
    and ``top[b, t]`` the highest log-prob of that distribution, a constant (the next token is
    the model's argmax where ``logprobs >= top``); ``entropy`` is None. A :class:`ScoringModel`
    (``PolicyModel``, ``ReferenceModel``) with a linear LM head gets them blockwise from its last
    hidden states (:func:`scoring_inputs`, :func:`token_attribution.head_logprobs.
    head_token_scores`), never holding the (B, L-1, V) logits; any other model (a callable
    ``input_ids -> logits``) through its logits.

    Args:
        model: the model, a :class:`ScoringModel` or a callable ``(B, L) ids -> (B, L, V)``.
        input_ids: (B, L) token ids, L >= 2.
        differentiable: False when no gradient is taken (the outputs are then constants).
    """
    if input_ids.ndim != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must be (B, L) with L >= 2, got {tuple(input_ids.shape)}")
    context, targets = input_ids[:, :-1], input_ids[:, 1:]  # (B, L-1) each
    if hasattr(model, "output_head") and hasattr(model, "hidden_at"):
        num_positions = context.shape[1]
        positions = mx.broadcast_to(
            mx.arange(num_positions, dtype=mx.int32)[None, :], context.shape
        )  # (B, L-1): every position
        inputs = scoring_inputs(model, context, positions)
        if inputs.head is not None:
            return head_token_scores(
                inputs.states, inputs.head, targets, differentiable=differentiable
            )
        logits = inputs.states  # (B, L-1, V)
    else:
        logits = model(context)  # (B, L-1, V)
    logits = logits.astype(mx.float32)
    logprobs = selective_log_softmax(logits, targets)  # (B, L-1)
    # top = max - lse, with lse = chosen logit - log-prob: no second pass of exp over V, and
    # exactly the log-prob where the target is the argmax.
    chosen = mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # (B, L-1)
    top = mx.stop_gradient(logits.max(axis=-1) - chosen + logprobs)  # (B, L-1)
    if not differentiable:
        logprobs = mx.stop_gradient(logprobs)
    return HeadScores(logprobs, None, top)
