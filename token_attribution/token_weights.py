"""Per-token weights of the policy loss: the think and answer regions of a reasoning completion
(``think_loss_weight`` / ``answer_loss_weight``) and the high-entropy tokens of the 80/20 paper
(Wang et al. 2025, TRL's ``top_entropy_quantile``).

Both are functions of rollout constants (token ids, the current policy's entropy taken as a
constant), so the weights carry no gradient. Shapes: ``B`` sequences, ``L`` prompt + response
positions, ``T`` response tokens.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx

from token_attribution.extractor import check_token_arrays, valid_mask

THINK_START = "<think>"
THINK_END = "</think>"


def _tag_ends(tokens: mx.array, tag: Sequence[int]) -> mx.array:
    """(B, L) bool: True at the last token of each occurrence of the id sequence ``tag``."""
    k, (rows, length) = len(tag), tokens.shape
    if k > length:
        return mx.zeros((rows, length), dtype=mx.bool_)
    match = mx.ones((rows, length - k + 1), dtype=mx.bool_)  # match[:, s]: tag starts at s
    for i, token in enumerate(tag):
        match = mx.logical_and(match, tokens[:, i : length - k + 1 + i] == token)
    return mx.concatenate([mx.zeros((rows, k - 1), dtype=mx.bool_), match], axis=1)


def think_region_mask(
    tokens: mx.array, think_start: Sequence[int], think_end: Sequence[int]
) -> mx.array:
    """Which tokens lie in a think block: from an opening tag to the next closing tag, both tags'
    tokens included.

    The tags are token-id sequences (one id for models whose vocabulary holds ``<think>``, as
    Qwen3 and the R1 distills; the tokenizer's encoding of the text otherwise). Position ``p`` is
    inside when the last tag that ends before ``p`` is an opening one, or ``p`` is a token of an
    opening tag: ``think[p] = (last_start(p - 1) > last_end(p - 1)) or p in an opening tag``,
    with ``last_x(p)`` the end position of the last ``x`` tag at or before ``p`` (-1: none).
    Run over prompt + response, a prompt whose template opened the block (Qwen3 thinking, R1)
    makes its completion start inside; a closing tag with no block open is not inside.

    Args:
        tokens: (B, L) int token ids (e.g. ``RolloutBatch.query_responses``).
        think_start: ids of the opening tag (non-empty).
        think_end: ids of the closing tag (non-empty).

    Returns:
        (B, L) bool.
    """
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be (B, L), got shape {tuple(tokens.shape)}")
    if not think_start or not think_end:
        raise ValueError("think_start and think_end must be non-empty token-id sequences")
    length = tokens.shape[1]
    starts = _tag_ends(tokens, think_start)  # (B, L)
    ends = _tag_ends(tokens, think_end)  # (B, L)
    index = mx.arange(length)[None, :]  # (1, L)
    last_start = mx.cummax(mx.where(starts, index, -1), axis=1)  # (B, L)
    last_end = mx.cummax(mx.where(ends, index, -1), axis=1)
    open_after = last_start > last_end  # (B, L): inside a block after position p
    open_before = mx.concatenate(
        [mx.zeros((tokens.shape[0], 1), dtype=mx.bool_), open_after[:, :-1]], axis=1
    )
    in_start_tag = starts
    for shift in range(1, len(think_start)):  # the opening tag's earlier tokens
        in_start_tag = mx.logical_or(
            in_start_tag,
            mx.concatenate(
                [starts[:, shift:], mx.zeros((tokens.shape[0], shift), dtype=mx.bool_)], axis=1
            ),
        )
    return mx.logical_or(open_before, in_start_tag)


def response_region_weights(
    query_responses: mx.array,
    prompt_lengths: mx.array,
    num_tokens: int,
    think_tags: tuple[Sequence[int], Sequence[int]],
    think_weight: float,
    answer_weight: float,
) -> mx.array:
    """(B, T) float32 weight of each response token: ``think_weight`` inside a think block
    (:func:`think_region_mask` over prompt + response), ``answer_weight`` elsewhere.

    Args:
        query_responses: (B, L) prompt + response ids, right-padded, ``L >= prompt_lengths + T``
            (:func:`token_attribution.sequences.build_query_responses`).
        prompt_lengths: (B,) prompt tokens of each row; response token ``t`` is at
            ``prompt_lengths + t``.
        num_tokens: ``T``, the response width.
        think_tags: (opening ids, closing ids).
        think_weight, answer_weight: the two weights.
    """
    think = think_region_mask(query_responses, *think_tags)  # (B, L)
    index = (prompt_lengths[:, None] + mx.arange(num_tokens)[None, :]).astype(mx.int32)  # (B, T)
    in_think = mx.take_along_axis(think, index, axis=1)  # (B, T)
    return mx.where(in_think, think_weight, answer_weight).astype(mx.float32)


def top_entropy_mask(entropy: mx.array, mask: mx.array, quantile: float) -> mx.array:
    """Keep only the highest-entropy action tokens (TRL's ``top_entropy_quantile``).

    ``threshold = Q(1 - quantile)``, the ``(1 - quantile)``-quantile (linear interpolation, as
    ``torch.quantile``) of the entropies of the action tokens; ``keep = mask and entropy >=
    threshold``. ``quantile = 1.0`` keeps every action token, ``0.2`` about the 20% with the
    highest entropy (the 80/20 paper's forking tokens). TRL gathers the entropies of every rank;
    here the quantile is over the micro-batch of one process.

    Args:
        entropy: (B, T) per-token entropy of the current policy (a constant here).
        mask: (B, T), nonzero on action tokens.
        quantile: in (0, 1].

    Returns:
        (B, T) float32, 1 on the kept tokens, 0 elsewhere.
    """
    check_token_arrays("entropy", entropy, mask=mask)
    if not 0.0 < quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in (0, 1], got {quantile}")
    valid = valid_mask(mask)
    if quantile == 1.0:
        return valid.astype(mx.float32)
    entropy = mx.stop_gradient(entropy.astype(mx.float32))
    ordered = mx.sort(mx.where(valid, entropy, mx.inf).reshape(-1))  # valid values first
    count = mx.sum(valid.astype(mx.int32))
    position = (1.0 - quantile) * mx.maximum(count - 1, 0).astype(mx.float32)
    low = mx.floor(position).astype(mx.int32)
    high = mx.minimum(low + 1, mx.maximum(count - 1, 0))
    lower, upper = ordered[low], ordered[high]  # finite but for count 0 (then nothing is kept)
    threshold = lower + (position - low.astype(mx.float32)) * (upper - lower)
    return mx.logical_and(valid, entropy >= threshold).astype(mx.float32)


def think_tag_ids(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The token ids of ``<think>`` and ``</think>``: one id each when the vocabulary holds the
    tag (Qwen3, the R1 distills), else the tokenizer's encoding of the text (no special tokens).
    """

    def ids(tag: str) -> list[int]:
        vocab = tokenizer.get_vocab()
        if tag in vocab:
            return [int(vocab[tag])]
        return [int(i) for i in tokenizer.encode(tag, add_special_tokens=False)]

    return ids(THINK_START), ids(THINK_END)


def has_think_tags(tokenizer: Any, system_prompt: str | None = None) -> bool:
    """Whether think blocks can be told apart for this model: its vocabulary holds ``<think>``
    and ``</think>``, or its chat template or the run's ``system_prompt`` writes ``<think>``."""
    vocab = tokenizer.get_vocab()
    if THINK_START in vocab and THINK_END in vocab:
        return True
    template = getattr(tokenizer, "chat_template", None)
    texts = [t for t in (template, system_prompt) if isinstance(t, str)]
    return any(THINK_START in text for text in texts)
