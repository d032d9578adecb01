"""Multi-turn generation that keeps each sequence's KV cache across turns (agents, tools).

An episode alternates the policy's turns with context from outside (a tool's result rendered by
the chat template, ending with the next assistant prompt). When a sequence samples a stop token,
``continue_fn(row, turn_tokens)`` may return that context; its tokens are then fed into *that
row's* cache and the row samples again after them. Nothing is re-prefilled: the history stays in
the cache, and a turn costs only its own tokens.

How: single responses' decoding loop (:func:`ppo_trainer.generator.decode_loop`, one batched
mlx-lm ``BatchKVCache``), with :class:`TurnRows` deciding what each row feeds. Every row advances
one position per decoding step. A row with context pending feeds its next context token instead
of a sampled one (its sample is discarded); a row that is done feeds pad. So each row's
positions are those it would have alone, and the attention never sees a gap. When *every* live
row has context pending, the shortest pending run of ``k`` tokens is fed as one ``(B, k)`` chunk
(a prefill, not ``k`` decoding steps). The host learns each step's tokens (one sync per step,
overlapped with the next step's forward pass, which is queued first): it has to, since
``continue_fn`` runs on the host.

``max_new_tokens`` bounds everything after the prompt, the policy's and the context's tokens
alike (TRL's ``max_completion_length``). Context that would leave no room for a policy token ends
the episode there, as cut by the budget (``ended_with_stop`` False).
"""

from __future__ import annotations

from collections import deque
from functools import partial
from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ppo_trainer.generator import (
    GenerationOutput,
    _sample,
    check_generation,
    decode_loop,
    ends_in_stop_string,
    eval_mode,
    per_step_keys,
    prefill,
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
    if max_turns is not None and max_turns < 1:
        raise ValueError(f"max_turns must be >= 1 (or None), got {max_turns}")
    lm = check_generation(
        model,
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        keys=keys,
        stop_strings=stop_strings,
        decode=decode,
    )
    rows = TurnRows(
        len(prompts),
        continue_fn,
        max_new_tokens=max_new_tokens,
        step_keys=per_step_keys(keys, temperature, max_new_tokens),
        stop_token_ids=stop_token_ids,
        pad_token_id=pad_token_id,
        max_turns=max_turns,
        stop_strings=stop_strings,
        decode=decode,
    )
    sample = partial(_sample, temperature=temperature, top_p=top_p, top_k=top_k, with_entropy=True)
    with eval_mode(lm):
        logits, cache = prefill(lm, prompts, pad_token_id, prefill_once)  # (B, V)
        decode_loop(lm, logits, cache, rows, sample)
    return rows.output()


class TurnRows:
    """:func:`generate_turns`'s rows (a :class:`~ppo_trainer.generator.DecodeRows`) on the host:
    per row, its tokens after the prompt (the policy's and the context's), which are the
    policy's, their log-probs and entropies, the context still to feed, its turns, and whether
    it is done. A row with context pending feeds it instead of its sample; a done row feeds pad."""

    def __init__(
        self,
        rows: int,
        continue_fn: ContinueFn,
        *,
        max_new_tokens: int,
        step_keys: mx.array | None,
        stop_token_ids: Sequence[int],
        pad_token_id: int,
        max_turns: int | None,
        stop_strings: Sequence[str],
        decode: Callable[[list[int]], str] | None,
    ) -> None:
        self.continue_fn = continue_fn
        self.max_new_tokens = max_new_tokens
        self.keys = step_keys  # (B, max_new_tokens, 2) or None
        self.pad_token_id = pad_token_id
        self.stops = set(int(t) for t in stop_token_ids)
        self.max_turns = max_turns
        self.stop_strings = stop_strings
        self.decode = decode
        self.window = stop_string_window(stop_strings) if stop_strings else 0
        self.tokens: list[list[int]] = [[] for _ in range(rows)]
        self.action: list[list[int]] = [[] for _ in range(rows)]
        self.logprobs: list[list[float]] = [[] for _ in range(rows)]
        self.entropy: list[list[float]] = [[] for _ in range(rows)]
        self.pending: list[deque[int]] = [deque() for _ in range(rows)]  # context still to feed
        self.spans: list[list[tuple[int, int]]] = [[] for _ in range(rows)]
        self.turn_start = [0] * rows
        self.done = [False] * rows
        self.ended = [False] * rows
        self.by_string = [False] * rows  # the row's last turn ended at a stop string
        self.step: tuple[mx.array, mx.array, mx.array] | None = None  # the step's samples

    def live(self) -> list[int]:
        """The rows not done."""
        return [i for i, done in enumerate(self.done) if not done]

    def context(self) -> np.ndarray | None:
        """``(B, k)`` when every live row has context pending: the next ``k`` (the fewest
        pending) of each, taken from their queues, pad in the other rows; else None."""
        live = self.live()
        if not all(self.pending[i] for i in live):
            return None
        k = min(len(self.pending[i]) for i in live)
        chunk = np.full((len(self.tokens), k), self.pad_token_id, dtype=np.int32)  # (B, k)
        for i in live:
            for j in range(k):
                chunk[i, j] = self.pending[i].popleft()
                self.emit_context(i, int(chunk[i, j]))
        return chunk

    def step_keys(self) -> mx.array | None:
        """Row ``b``'s key for the token at its column ``t``: ``keys[b, t]``, whatever the other
        rows do (a done row's column is capped; its sample is discarded)."""
        if self.keys is None:
            return None
        columns = mx.array([min(len(t), self.max_new_tokens - 1) for t in self.tokens])
        return self.keys[mx.arange(len(self.tokens)), columns]  # (B, 2)

    def feed(
        self, sampled: mx.array, logprobs: mx.array, entropy: mx.array | None
    ) -> mx.array | None:
        """Each row's next context token where it has one pending, pad where it is done, else
        its sample."""
        assert entropy is not None, "generate_turns samples with the entropy"
        self.step = (sampled, logprobs, entropy)
        B = len(self.tokens)
        forced = [self.pending[i][0] if self.pending[i] else self.pad_token_id for i in range(B)]
        use_forced = mx.array([self.done[i] or bool(self.pending[i]) for i in range(B)])
        return mx.where(use_forced, mx.array(forced, dtype=mx.int32), sampled)  # (B,)

    def queued(self) -> tuple[mx.array, ...]:
        """The step's samples, which :meth:`settle` reads."""
        assert self.step is not None
        return self.step

    def settle(self) -> bool:
        """The step's samples read (the step's one sync) and each live row advanced; whether
        every row is done."""
        assert self.step is not None
        tokens, logprobs, entropy = (np.asarray(a).tolist() for a in self.step)
        for i in self.live():
            self.advance(i, int(tokens[i]), logprobs[i], entropy[i])
        return all(self.done)

    def advance(self, i: int, token: int, logprob: float, entropy: float) -> None:
        """Row ``i`` (live) after a decoding step: its next context token when it has one
        pending (the sample discarded), else the sampled ``token``, which may end its turn
        (a stop token or string) or its budget."""
        if self.pending[i]:
            self.emit_context(i, self.pending[i].popleft())
            return
        self.tokens[i].append(token)
        self.action[i].append(1)
        self.logprobs[i].append(float(logprob))
        self.entropy[i].append(float(entropy))
        # A stop string's end wins over a stop token's, as in a single response: its text is
        # decoded whole and cut after the string (ppo_trainer.rollout.decode_completions).
        by_string = self.completes_stop_string(i)
        if token in self.stops or by_string:
            self.by_string[i] = by_string
            self.end_turn(i)
        elif len(self.tokens[i]) >= self.max_new_tokens:  # cut by the budget mid-turn
            self.spans[i].append((self.turn_start[i], len(self.tokens[i])))
            self.done[i] = True
            self.by_string[i] = False

    def completes_stop_string(self, i: int) -> bool:
        """Whether row ``i``'s last token completes a stop string in its turn's text."""
        if not self.stop_strings:
            return False
        assert self.decode is not None
        tail = self.tokens[i][max(self.turn_start[i], len(self.tokens[i]) - self.window) :]
        return ends_in_stop_string(self.decode(tail), self.stop_strings)

    def emit_context(self, i: int, token: int) -> None:
        """Row ``i`` fed a context token: not an action, log-prob and entropy 0."""
        self.tokens[i].append(token)
        self.action[i].append(0)
        self.logprobs[i].append(0.0)
        self.entropy[i].append(0.0)

    def end_turn(self, i: int) -> None:
        """Row ``i`` ended a turn (a stop token or string): ask for context, or end the episode."""
        end = len(self.tokens[i])
        self.spans[i].append((self.turn_start[i], end))
        if self.max_turns is not None and len(self.spans[i]) >= self.max_turns:
            self.done[i] = self.ended[i] = True
            return
        ctx = self.continue_fn(i, self.tokens[i][self.turn_start[i] :])
        if ctx is None:
            self.done[i] = self.ended[i] = True
            return
        if len(ctx) == 0:
            raise ValueError(
                f"continue_fn returned no tokens for row {i}; return None to end the episode"
            )
        if end + len(ctx) >= self.max_new_tokens:  # no room for the policy's next token
            self.done[i] = True
            return
        self.pending[i].extend(int(t) for t in ctx)
        self.turn_start[i] = end + len(ctx)

    def output(self) -> GenerationOutput:
        """The episodes as one generation, right-padded to the longest (``T``)."""
        B = len(self.tokens)
        width = max(len(t) for t in self.tokens)  # T
        responses = np.full((B, width), self.pad_token_id, dtype=np.int32)
        mask = np.zeros((B, width), dtype=np.float32)
        lp = np.zeros((B, width), dtype=np.float32)
        ent = np.zeros((B, width), dtype=np.float32)
        for i in range(B):
            n = len(self.tokens[i])
            responses[i, :n] = self.tokens[i]
            mask[i, :n] = self.action[i]
            lp[i, :n] = self.logprobs[i]
            ent[i, :n] = self.entropy[i]
        return GenerationOutput(
            responses=mx.array(responses),
            lengths=mx.array([len(t) for t in self.tokens], dtype=mx.int32),
            ended_with_stop=mx.array(self.ended),
            logprobs=mx.array(lp),
            entropy=mx.array(ent),
            stopped_by_string=mx.array(self.by_string) if self.stop_strings else None,
            action_mask=mx.array(mask),
            turn_spans=self.spans,
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
