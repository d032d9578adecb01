"""Multi-turn generation that keeps each sequence's KV cache across turns (agents, tools).

An episode alternates the policy's turns with context from outside (a tool's result rendered by
the chat template, ending with the next assistant prompt). When a sequence samples a stop token,
``continue_fn(row, turn_tokens)`` may return that context; its tokens are then fed into *that
row's* cache and the row samples again after them. Nothing is re-prefilled: the history stays in
the cache, and a turn costs only its own tokens.

How, with one batched cache (mlx-lm's ``BatchKVCache``, as :func:`ppo_trainer.generator.generate`):
every row advances one position per decoding step. A row with context pending feeds its next
context token instead of a sampled one (its sample is discarded); a row that is done feeds pad.
So each row's positions are those it would have alone, and the attention never sees a gap. When
*every* live row has context pending, the shortest pending run of ``k`` tokens is fed as one
``(B, k)`` chunk (a prefill, not ``k`` decoding steps). The host learns each step's tokens (one
sync per step, overlapped with the next step's forward pass, which is queued first): it has to,
since ``continue_fn`` runs on the host.

``max_new_tokens`` bounds everything after the prompt, the policy's and the context's tokens
alike (TRL's ``max_completion_length``). Context that would leave no room for a policy token ends
the episode there, as cut by the budget (``ended_with_stop`` False).
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from models.policy_model import PolicyModel
from ppo_trainer.generator import (
    GenerationOutput,
    _sample,
    ends_in_stop_string,
    per_step_keys,
    prompt_batch,
    stop_string_window,
)

#: ``continue_fn(row, turn_tokens) -> context tokens | None``: called when row ``row`` ends a turn
#: with a stop token or a stop string; ``turn_tokens`` are that turn's sampled tokens (the stop
#: token last, or the token that completed the stop string). The returned ids (non-empty) are fed
#: before the policy's next turn; None ends the episode.
ContinueFn = Callable[[int, list[int]], "list[int] | None"]


def generate_turns(
    model: nn.Module,
    prompts: list[list[int]],
    *,
    continue_fn: ContinueFn,
    max_new_tokens: int,
    temperature: float,
    stop_token_ids: Sequence[int],
    pad_token_id: int,
    top_p: float = 1.0,
    top_k: int = 0,
    max_turns: int | None = None,
    keys: mx.array | None = None,
    prefill_once: bool | None = None,
    stop_strings: Sequence[str] = (),
    decode: Callable[[list[int]], str] | None = None,
) -> GenerationOutput:
    """Sample multi-turn episodes after each prompt, all at once, keeping the KV cache.

    Args:
        model: a :class:`~models.policy_model.PolicyModel` or an mlx-lm model (run in eval mode).
        prompts: ``B`` non-empty lists of token ids.
        continue_fn: see :data:`ContinueFn`.
        max_new_tokens: the most tokens after each prompt, policy and context tokens together.
        temperature, top_p, top_k: as :func:`ppo_trainer.generator.generate`.
        stop_token_ids: a policy token among these ends its turn (and is part of it).
        pad_token_id: written after each episode's end.
        max_turns: the most policy turns per episode (None: until ``continue_fn`` returns None).
        keys: ``(B, 2)`` uint32 PRNG keys, one per row: the token at column ``t`` of row ``b`` is
            drawn with the ``t``-th split of ``keys[b]``, whatever the other rows do.
        prefill_once: prefill each distinct prompt once (None: unless under plain MLX).
        stop_strings: a policy token that completes one of these in its turn's text also ends
            the turn (as :func:`~ppo_trainer.generator.generate`'s: the turn's last
            :func:`~ppo_trainer.generator.stop_string_window` tokens decoded with ``decode``;
            context tokens never end a turn).
        decode: token ids to text; needed with ``stop_strings``.

    Returns:
        A :class:`~ppo_trainer.generator.GenerationOutput` with ``action_mask`` (1 on the
        policy's tokens), ``logprobs`` and ``entropy`` (0 on context tokens) and ``turn_spans``;
        with ``stop_strings``, ``stopped_by_string`` (``True`` where a stop string ended the
        episode's last turn).

    Raises:
        ValueError: bad arguments (as :func:`~ppo_trainer.generator.generate`), or a
            ``continue_fn`` that returns an empty list.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token-id lists")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if stop_strings and decode is None:
        raise ValueError("stop_strings needs decode, the function from token ids to text")
    if max_turns is not None and max_turns < 1:
        raise ValueError(f"max_turns must be >= 1 (or None), got {max_turns}")
    B = len(prompts)
    if keys is not None and (tuple(keys.shape) != (B, 2) or keys.dtype != mx.uint32):
        raise ValueError(f"keys must be a ({B}, 2) uint32 array, one PRNG key per prompt")
    lm = model.model if isinstance(model, PolicyModel) else model
    max_len = max(len(p) for p in prompts)
    context = getattr(getattr(lm, "args", None), "max_position_embeddings", None)
    if isinstance(context, int) and max_len + max_new_tokens > context:
        raise ValueError(
            f"the longest prompt ({max_len} tokens) plus max_new_tokens ({max_new_tokens}) "
            f"exceeds the model's context of {context} tokens"
        )
    batch, cache, rows = prompt_batch(lm, prompts, pad_token_id, prefill_once)
    stops = set(int(t) for t in stop_token_ids)
    step_keys = per_step_keys(keys, temperature, max_new_tokens)
    sample_top_p = top_p if temperature > 0 else 1.0
    sample_top_k = top_k if temperature > 0 else 0

    tokens: list[list[int]] = [[] for _ in range(B)]
    action: list[list[int]] = [[] for _ in range(B)]
    logprobs: list[list[float]] = [[] for _ in range(B)]
    entropy: list[list[float]] = [[] for _ in range(B)]
    pending: list[deque[int]] = [deque() for _ in range(B)]  # context still to feed
    spans: list[list[tuple[int, int]]] = [[] for _ in range(B)]
    turn_start = [0] * B
    done = [False] * B
    ended = [False] * B
    by_string = [False] * B  # the row's last turn ended at a stop string
    window = stop_string_window(stop_strings) if stop_strings else 0

    def completes_stop_string(i: int) -> bool:
        """Whether row ``i``'s last token completes a stop string in its turn's text."""
        if not stop_strings:
            return False
        assert decode is not None
        tail = tokens[i][max(turn_start[i], len(tokens[i]) - window) :]
        return ends_in_stop_string(decode(tail), stop_strings)

    def emit_context(i: int, token: int) -> None:
        tokens[i].append(token)
        action[i].append(0)
        logprobs[i].append(0.0)
        entropy[i].append(0.0)

    def end_turn(i: int) -> None:
        """Row ``i`` ended a turn (a stop token or string): ask for context, or end the episode."""
        end = len(tokens[i])
        spans[i].append((turn_start[i], end))
        if max_turns is not None and len(spans[i]) >= max_turns:
            done[i] = ended[i] = True
            return
        ctx = continue_fn(i, tokens[i][turn_start[i] :])
        if ctx is None:
            done[i] = ended[i] = True
            return
        if len(ctx) == 0:
            raise ValueError(
                f"continue_fn returned no tokens for row {i}; return None to end the episode"
            )
        if end + len(ctx) >= max_new_tokens:  # no room for the policy's next token
            done[i] = True
            return
        pending[i].extend(int(t) for t in ctx)
        turn_start[i] = end + len(ctx)

    was_training = lm.training
    lm.eval()
    try:
        logits = lm(batch, cache=cache)[:, -1, :]  # (U, V)
        if rows is not None:
            for layer_cache in cache:
                layer_cache.filter(rows)
            logits = logits[rows]  # (B, V)
        while not all(done):
            live = [i for i in range(B) if not done[i]]
            if all(pending[i] for i in live):
                # Every live row feeds context: the shortest pending run as one chunk.
                k = min(len(pending[i]) for i in live)
                chunk = np.full((B, k), pad_token_id, dtype=np.int32)  # (B, k)
                for i in live:
                    for j in range(k):
                        chunk[i, j] = pending[i].popleft()
                        emit_context(i, int(chunk[i, j]))
                logits = lm(mx.array(chunk), cache=cache)[:, -1, :]  # (B, V)
                continue
            step_key = None
            if step_keys is not None:
                columns = mx.array([min(len(t), max_new_tokens - 1) for t in tokens])
                step_key = step_keys[mx.arange(B), columns]  # (B, 2)
            sampled, token_logprobs, token_entropy = _sample(
                logits, temperature, sample_top_p, sample_top_k, step_key, with_entropy=True
            )
            forced = [pending[i][0] if pending[i] else pad_token_id for i in range(B)]
            use_forced = mx.array([done[i] or bool(pending[i]) for i in range(B)])
            inputs = mx.where(use_forced, mx.array(forced, dtype=mx.int32), sampled)  # (B,)
            logits = lm(inputs[:, None], cache=cache)[:, -1, :]  # (B, V), queued
            mx.async_eval(logits)
            assert token_entropy is not None
            host_tokens = np.asarray(sampled).tolist()  # the step's one sync
            host_logprobs = np.asarray(token_logprobs).tolist()
            host_entropy = np.asarray(token_entropy).tolist()
            for i in live:
                if pending[i]:
                    emit_context(i, pending[i].popleft())
                    continue
                token = int(host_tokens[i])
                tokens[i].append(token)
                action[i].append(1)
                logprobs[i].append(float(host_logprobs[i]))
                entropy[i].append(float(host_entropy[i]))
                if token in stops or completes_stop_string(i):
                    by_string[i] = token not in stops
                    end_turn(i)
                elif len(tokens[i]) >= max_new_tokens:  # cut by the budget mid-turn
                    spans[i].append((turn_start[i], len(tokens[i])))
                    done[i] = True
                    by_string[i] = False
    finally:
        lm.train(was_training)

    width = max(len(t) for t in tokens)  # T
    responses = np.full((B, width), pad_token_id, dtype=np.int32)
    mask = np.zeros((B, width), dtype=np.float32)
    lp = np.zeros((B, width), dtype=np.float32)
    ent = np.zeros((B, width), dtype=np.float32)
    for i in range(B):
        n = len(tokens[i])
        responses[i, :n] = tokens[i]
        mask[i, :n] = action[i]
        lp[i, :n] = logprobs[i]
        ent[i, :n] = entropy[i]
    return GenerationOutput(
        responses=mx.array(responses),
        lengths=mx.array([len(t) for t in tokens], dtype=mx.int32),
        ended_with_stop=mx.array(ended),
        logprobs=mx.array(lp),
        entropy=mx.array(ent),
        stopped_by_string=mx.array(by_string) if stop_strings else None,
        action_mask=mx.array(mask),
        turn_spans=spans,
    )


def turn_ends(turn_spans: list[list[tuple[int, int]]]) -> mx.array:
    """``(B, K)`` int32: the column of each policy turn's last token, ``-1`` where a row has
    fewer than ``K`` (the most turns of any row) turns. Where per-action rewards land."""
    K = max((len(s) for s in turn_spans), default=0)
    out = np.full((len(turn_spans), max(K, 1)), -1, dtype=np.int32)
    for i, row in enumerate(turn_spans):
        for k, (_, end) in enumerate(row):
            out[i, k] = end - 1
    return mx.array(out)
