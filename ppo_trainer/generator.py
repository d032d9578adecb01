"""Batched sampling of responses for prompts of different lengths, with a KV cache.

How: the prompts are left-padded into one ``(B, L)`` array and run through the model once with
mlx-lm's ``BatchKVCache`` (``BatchRotatingKVCache`` for sliding-window layers). Those caches keep a
per-sequence offset, so every sequence's tokens get the positions they would have alone (RoPE
starts at 0 at its first real token) and the attention mask hides the padding. Each decoding step
then feeds one token per sequence. Greedy outputs therefore equal one-prompt-at-a-time decoding
(up to float rounding of different matmul shapes; the tests check token equality).

Why not mlx-lm's ``BatchGenerator``: it is built for serving (continuous batching, per-token
Python lists and a ``tolist()`` per step, text-level stop sequences); PPO needs fixed batches, token
ids, log-probs of the sampled tokens, and few host syncs. Here the only host sync per step is the
"has every sequence stopped?" check, overlapped with the next step's forward pass (the next step
is queued with ``mx.async_eval`` before the check blocks), plus one at the end.

The loop itself, :func:`decode_loop`, is shared with multi-turn episodes
(:func:`ppo_trainer.multi_turn.generate_turns`): what each row feeds next and when a row ends is
its rows object's (:class:`DecodeRows`; :class:`ResponseRows` here), so a tool's turn is tokens
forced into the same loop.

Prompts that occur several times in a batch (GRPO's and RLOO's ``group_size`` samples of each
prompt) are prefilled once: the distinct prompts run through the model, then their caches' rows
and last logits are repeated to the full batch (mlx-lm's ``filter`` with repeated indices) before
decoding. Each row's prefill is the same computation either way, so the samples are those of a
full prefill and the log-probs equal them to float32 rounding (a matmul rounds by its row count);
plain MLX (:func:`base_setup.plain.speed_tricks`) prefills every row.

Randomness comes from ``mx.random``'s global state, which :func:`base_setup.seed_everything`
seeds, so a run is reproducible. With ``keys`` (one PRNG key per prompt) each row samples from its
own key instead: its response then does not depend on the other rows of the batch, which lets
data-parallel ranks generate any slice of a global batch and get the samples one process would.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterator, Protocol, Sequence, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from base_setup import fast_math
from base_setup.plain import speed_tricks
from models.policy_model import PolicyModel


@dataclass
class GenerationOutput:
    """Sampled responses as token ids (never re-tokenised text).

    Attributes:
        responses: ``(B, T)`` int32, padded with ``pad_token_id`` after each sequence's end;
            ``T`` is the longest response of the batch (``<= max_new_tokens``).
        lengths: ``(B,)`` int32 tokens per response, including the stop token when there is one.
        ended_with_stop: ``(B,)`` bool, ``True`` where the response ends with a stop token
            (``False``: cut at ``max_new_tokens``).
        logprobs: ``(B, T)`` float32 log-prob of each sampled token under
            ``log_softmax(logits / temperature)`` (``temperature`` taken as 1 when greedy), before
            top-k / top-p filtering; 0 after the end. ``None`` unless requested.
        entropy: ``(B, T)`` float32 entropy (nats) of that distribution at each step; 0 after
            the end. ``None`` unless log-probs are requested.
        stopped_by_string: ``(B,)`` bool, ``True`` where a stop string ended the response:
            its last token completes the string, even if that token is also a stop token
            (``ended_with_stop`` is then ``True`` too); for a multi-turn episode, its last
            turn (``ended_with_stop`` true unless the episode was then cut by the budget).
            ``None`` when generation had no stop strings.
        action_mask: ``(B, T)`` float32, multi-turn episodes only
            (:func:`ppo_trainer.multi_turn.generate_turns`): 1 on the tokens the policy sampled,
            0 on the tools' and environment's context tokens and after the end. ``None``: every
            token up to ``lengths`` is the policy's.
        turn_spans: multi-turn only: per row, the ``(start, end)`` columns (end exclusive) of
            each of the policy's turns, in order.
    """

    responses: mx.array
    lengths: mx.array
    ended_with_stop: mx.array
    logprobs: mx.array | None = None
    entropy: mx.array | None = None
    stopped_by_string: mx.array | None = None
    action_mask: mx.array | None = None
    turn_spans: list[list[tuple[int, int]]] | None = None


def stop_string_window(stop_strings: Sequence[str]) -> int:
    """How many of a response's last tokens are decoded to look for ``stop_strings``: 4 per
    character of the longest (a token carries at least one byte, a character at most 4) plus 4
    for tokens that decode to nothing (special tokens)."""
    return 4 * max(len(s) for s in stop_strings) + 4


def ends_in_stop_string(text: str, stop_strings: Sequence[str]) -> bool:
    """Whether ``text`` (a response's decoded tail) contains one of ``stop_strings``."""
    return any(s in text for s in stop_strings)


def cut_after_stop_string(text: str, stop_strings: Sequence[str], last: bool = False) -> str:
    """``text`` up to and including the stop string that ends first in it (the text a token
    carried past it dropped); with ``last``, the one that ends last (an episode's last turn,
    after earlier turns' stop strings); ``text`` itself when none occurs."""
    if last:
        ends = [text.rfind(s) + len(s) for s in stop_strings if s in text]
        return text[: max(ends)] if ends else text
    ends = [text.find(s) + len(s) for s in stop_strings if s in text]
    return text[: min(ends)] if ends else text


def _batch_cache(model: nn.Module, left_padding: list[int]) -> list[Any]:
    """One batched cache per layer, for left-padded prompts, from the model's own cache layout."""
    from mlx_lm.models.cache import (
        BatchKVCache,
        BatchRotatingKVCache,
        KVCache,
        RotatingKVCache,
        make_prompt_cache,
    )

    caches: list[Any] = []
    for layer_cache in make_prompt_cache(model):
        if type(layer_cache) is KVCache:
            caches.append(BatchKVCache(left_padding))
        elif type(layer_cache) is RotatingKVCache and layer_cache.keep == 0:
            caches.append(BatchRotatingKVCache(layer_cache.max_size, left_padding))
        else:
            raise ValueError(
                f"batched generation supports attention KV caches; {type(model).__name__} uses "
                f"{type(layer_cache).__name__}, which mlx-lm cannot batch with left padding"
            )
    return caches


def _sample(
    logits: mx.array,
    temperature: float,
    top_p: float,
    top_k: int,
    keys: mx.array | None = None,
    with_entropy: bool = False,
) -> tuple[mx.array, mx.array, mx.array | None]:
    """Next tokens ``(B,)``, their log-probs ``(B,)`` and, if asked, the entropy ``(B,)`` of the
    distribution they were scored under, from last-position ``logits`` ``(B, V)``.

    Sampling is by inverse CDF: row ``b`` takes the first token whose cumulative weight exceeds
    ``u_b`` times the row's total, with one uniform ``u_b`` per row (from ``keys[b]`` when given,
    else from the global random state). That is an exact draw from the (filtered) softmax, and it
    needs one uniform number per row and the probabilities the entropy needs anyway:
    ``mx.random.categorical`` would draw ``V`` Gumbel numbers per row, two scalar ``log`` calls
    each, which on the CPU cost more than the rest of a small model's decoding step. Tokens the
    filters removed (weight 0) are never drawn.

    The log-prob is ``log_softmax(logits / temperature)[token]`` (temperature 1 when greedy),
    before filtering: that is the distribution the trainer recomputes from a forward pass, so the
    rollout's old log-probs and the trainer's new ones are the same function of the logits. (The
    truncated top-k / top-p distribution, which actually sampled the token, would make every PPO
    ratio start away from 1.)
    """
    from mlx_lm.sample_utils import apply_top_k, apply_top_p

    scaled = logits.astype(mx.float32) * (1.0 / temperature if temperature > 0 else 1.0)
    truncated = 0 < top_k < scaled.shape[-1] or top_p < 1.0
    kernels = fast_math.native_kernels(scaled) if temperature > 0 and not truncated else None
    if kernels is not None:  # all of the below in one kernel, the same bits
        tokens, token_logprobs, entropy = kernels.sample(scaled, _uniform(scaled, keys))
        return tokens, token_logprobs, entropy if with_entropy else None
    lse, weights, total = fast_math.logsumexp_parts(scaled)  # (B, 1), (B, V), (B, 1)
    if temperature == 0:
        tokens = mx.argmax(scaled, axis=-1)
    else:
        sampling_weights = weights
        if truncated:
            filtered = scaled - lse  # (B, V) log-probs; the filters set -inf, exp gives 0
            if 0 < top_k < scaled.shape[-1]:
                filtered = apply_top_k(filtered, top_k)
            if top_p < 1.0:
                filtered = apply_top_p(filtered, top_p)
            sampling_weights = fast_math.exp(filtered)
        tokens = inverse_cdf(sampling_weights, _uniform(scaled, keys))
    tokens = tokens.astype(mx.int32)
    # scaled[token] - lse: the trainer's log_softmax gather (selective_log_softmax) bit for bit,
    # so the rollout's log-probs and the first PPO epoch's differ only where the logits do.
    token_logprobs = mx.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0] - lse[:, 0]
    entropy = _entropy(weights, scaled, total, lse)[:, 0] if with_entropy else None
    return tokens, token_logprobs, entropy


def _uniform(scaled: mx.array, keys: mx.array | None) -> mx.array:
    """(B, 1) uniform numbers, one per row: from ``keys[b]`` when given, else the global random
    state."""
    if keys is None:
        return mx.random.uniform(shape=(scaled.shape[0], 1))
    return mx.vmap(lambda key: mx.random.uniform(shape=(1,), key=key))(keys)


@mx.compile
def _entropy(weights: mx.array, scaled: mx.array, total: mx.array, lse: mx.array) -> mx.array:
    """``-sum p log p`` with ``p = weights / total`` and ``log p = scaled - lse``, as
    ``lse - sum(p * scaled)`` (keepdims); a weight-0 entry (a -inf logit) adds 0."""
    expected = mx.where(weights > 0, weights * scaled, 0.0).sum(axis=-1, keepdims=True) / total
    return lse - expected


def inverse_cdf(weights: mx.array, uniform: mx.array) -> mx.array:
    """Row ``b``: the first index whose cumulative ``weights`` exceed ``uniform[b] * total_b``,
    i.e. index ``i`` with probability ``weights[b, i] / total_b``; ``weights`` (B, V) >= 0 with a
    positive total, ``uniform`` (B, 1) in [0, 1). A weight-0 index is never returned."""
    cdf = mx.cumsum(weights, axis=-1)  # (B, V)
    total = cdf[:, -1:]  # (B, 1)
    # uniform * total can round up to total, and then every index would be "below". Capped at
    # the largest float under total (total > 0: one bit less), the count stops at the first
    # index where the CDF reaches its total, a positive weight; below the cap nothing changes.
    # (Instead of a second pass over V for that index.)
    cap = (total.view(mx.int32) - 1).view(mx.float32)  # (B, 1)
    return (cdf <= mx.minimum(uniform * total, cap)).sum(axis=-1)  # (B,)


def distinct_prompts(prompts: list[list[int]]) -> tuple[list[list[int]], mx.array | None]:
    """The distinct prompts, in order of first appearance, and ``rows`` (B,) int32 with
    ``prompts[b] == distinct[rows[b]]``; ``rows`` is None when every prompt is distinct."""
    index: dict[tuple[int, ...], int] = {}
    rows = [index.setdefault(tuple(p), len(index)) for p in prompts]
    if len(index) == len(prompts):
        return prompts, None
    return [list(p) for p in index], mx.array(rows, dtype=mx.int32)


def prompt_batch(
    lm: nn.Module, prompts: list[list[int]], pad_token_id: int, prefill_once: bool | None
) -> tuple[mx.array, list[Any], mx.array | None]:
    """``(batch (U, L), cache, rows)``: the distinct prompts (all of them when ``prefill_once``
    is off; None: the speed tricks' setting) left-padded to the longest, their batched cache,
    and per row which of them it is (None: one per row)."""
    if prefill_once is None:
        prefill_once = speed_tricks()
    distinct, rows = distinct_prompts(prompts) if prefill_once else (prompts, None)
    max_len = max(len(p) for p in distinct)
    left_padding = [max_len - len(p) for p in distinct]
    batch = mx.array(
        [[pad_token_id] * pad + list(p) for pad, p in zip(left_padding, distinct)], dtype=mx.int32
    )  # (U, L)
    return batch, _batch_cache(lm, left_padding), rows


def per_step_keys(
    keys: mx.array | None, temperature: float, max_new_tokens: int
) -> mx.array | None:
    """One PRNG key per row and decoding step, ``(B, max_new_tokens, 2)``: row b's t-th token
    uses ``[b, t]``; None when sampling is greedy or ``keys`` is None."""
    if keys is None or temperature <= 0:
        return None
    return mx.vmap(lambda key: mx.random.split(key, max_new_tokens))(keys)


def check_generation(
    model: nn.Module,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    keys: mx.array | None,
    stop_strings: Sequence[str],
    decode: Callable[[list[int]], str] | None,
) -> nn.Module:
    """The mlx-lm model of ``model`` (a :class:`PolicyModel`'s, or itself), after checking a
    generation's arguments (see :func:`generate`'s ``Raises``)."""
    if not prompts:
        raise ValueError("prompts is empty; pass at least one list of token ids")
    empty = [i for i, p in enumerate(prompts) if len(p) == 0]
    if empty:
        raise ValueError(f"prompts {empty[:10]} are empty; every prompt needs at least one token")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 is off), got {top_k}")
    if stop_strings and decode is None:
        raise ValueError("stop_strings needs decode, the function from token ids to text")
    if keys is not None and (tuple(keys.shape) != (len(prompts), 2) or keys.dtype != mx.uint32):
        raise ValueError(
            f"keys must be a ({len(prompts)}, 2) uint32 array, one PRNG key per prompt (e.g. "
            f"mx.random.split(mx.random.key(seed), {len(prompts)})); got {keys.dtype} "
            f"{tuple(keys.shape)}"
        )
    lm = model.model if isinstance(model, PolicyModel) else model
    max_len = max(len(p) for p in prompts)
    context = getattr(getattr(lm, "args", None), "max_position_embeddings", None)
    if isinstance(context, int) and max_len + max_new_tokens > context:
        raise ValueError(
            f"the longest prompt ({max_len} tokens) plus max_new_tokens ({max_new_tokens}) "
            f"exceeds the model's context of {context} tokens; shorten the prompts or "
            "lower max_new_tokens"
        )
    return lm


@contextmanager
def eval_mode(lm: nn.Module) -> Iterator[None]:
    """``lm`` in eval mode (no dropout) within the block, then back in its previous mode."""
    was_training = lm.training
    lm.eval()
    try:
        yield
    finally:
        lm.train(was_training)


def prefill(
    lm: nn.Module, prompts: list[list[int]], pad_token_id: int, prefill_once: bool | None
) -> tuple[mx.array, list[Any]]:
    """The last logits ``(B, V)`` of ``prompts`` and their batched cache, each distinct prompt
    prefilled once with ``prefill_once`` (:func:`prompt_batch`) and repeated to its rows."""
    batch, cache, rows = prompt_batch(lm, prompts, pad_token_id, prefill_once)
    logits = lm(batch, cache=cache)[:, -1, :]  # (U, V)
    if rows is not None:  # each distinct prompt's cache and logits to its rows
        for layer_cache in cache:
            layer_cache.filter(rows)
        logits = logits[rows]  # (B, V)
    return logits, cache


def generate(
    model: nn.Module,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_token_ids: Sequence[int],
    pad_token_id: int,
    return_logprobs: bool = False,
    keys: mx.array | None = None,
    prefill_once: bool | None = None,
    stop_strings: Sequence[str] = (),
    decode: Callable[[list[int]], str] | None = None,
) -> GenerationOutput:
    """Sample up to ``max_new_tokens`` tokens after each prompt, all prompts at once.

    Args:
        model: a :class:`~models.policy_model.PolicyModel` or an mlx-lm model. It runs in eval
            mode (no LoRA dropout) and is put back in its previous mode afterwards.
        prompts: ``B`` lists of token ids, of any (non-zero) lengths.
        max_new_tokens: the most tokens per response.
        temperature: softmax temperature; ``0`` means greedy (argmax).
        top_p: nucleus sampling on the temperature-scaled distribution; ``1.0`` is off.
        top_k: sample among the ``top_k`` most likely tokens; ``0`` (or >= vocabulary) is off.
            Applied before ``top_p``, as in transformers.
        stop_token_ids: a response ends at (and includes) the first of these; may be empty.
        pad_token_id: fills ``responses`` after each end. Masks come from ``lengths``, never
            from comparing ids with this value.
        return_logprobs: also return the sampled tokens' log-probs and the entropy of each
            step's distribution (see :class:`GenerationOutput`).
        keys: ``(B, 2)`` uint32 PRNG keys (``mx.random.key`` / ``mx.random.split``), one per
            prompt: row ``b``'s samples then depend only on ``keys[b]`` (and its prompt), not on
            the other rows or the global random state. None: the global state. Unused if greedy.
        prefill_once: prefill each distinct prompt once and repeat its cache to the rows that
            repeat it (see the module doc); None = unless under plain MLX.
        stop_strings: a response also ends at the token that completes one of these (as
            transformers' ``stop_strings``): each step decodes each running row's last
            :func:`stop_string_window` tokens with ``decode`` (one host read of the step's
            tokens), not its whole text.
        decode: token ids to text; needed with ``stop_strings``.

    Decoding stops as soon as every sequence has produced a stop token.

    Raises:
        ValueError: empty ``prompts`` or an empty prompt, non-positive ``max_new_tokens``,
            ``temperature < 0``, ``top_p`` outside (0, 1], ``top_k < 0``, or prompt plus
            ``max_new_tokens`` longer than the model's ``max_position_embeddings``.
    """
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
    sample = partial(
        _sample, temperature=temperature, top_p=top_p, top_k=top_k, with_entropy=return_logprobs
    )
    watch = StopStringWatch(len(prompts), stop_strings, decode) if stop_strings else None
    rows = ResponseRows(
        len(prompts),
        max_new_tokens=max_new_tokens,
        step_keys=per_step_keys(keys, temperature, max_new_tokens),
        stop_token_ids=stop_token_ids,
        pad_token_id=pad_token_id,
        watch=watch,
    )
    with eval_mode(lm):
        logits, cache = prefill(lm, prompts, pad_token_id, prefill_once)  # (B, V)
        decode_loop(lm, logits, cache, rows, sample)
    return rows.output(return_logprobs)


#: ``sample(logits (B, V), keys (B, 2) | None) -> (tokens, log-probs, entropy | None)``, each
#: ``(B,)``: :func:`_sample` with a generation's temperature, top-p and top-k.
SampleFn = Callable[..., tuple[mx.array, mx.array, "mx.array | None"]]


class DecodeRows(Protocol):
    """What :func:`decode_loop` asks of the rows it decodes: single responses
    (:class:`ResponseRows`) or multi-turn episodes (:class:`ppo_trainer.multi_turn.TurnRows`,
    whose tool and environment turns are tokens forced into the same loop)."""

    def context(self) -> np.ndarray | None:
        """``(B, k)`` tokens to feed as one chunk, without sampling, when every running row has
        context pending (a prefill of ``k`` tokens, not ``k`` decoding steps); else None."""

    def step_keys(self) -> mx.array | None:
        """``(B, 2)``: each row's PRNG key for this step's sample; None: the global state."""

    def feed(
        self, sampled: mx.array, logprobs: mx.array, entropy: mx.array | None
    ) -> mx.array | None:
        """Take this step's samples (lazy ``(B,)`` arrays) and return the ``(B,)`` tokens the
        next forward pass feeds (a sample, a forced context token, or pad after a row's end);
        None when no further pass is needed (the budget's last step)."""

    def queued(self) -> tuple[mx.array, ...]:
        """This step's arrays to compute along with the next forward pass."""

    def settle(self) -> bool:
        """The host's part of the step, run while the next forward pass computes: which rows
        ended; whether every row has (the loop then stops)."""


def decode_loop(
    lm: nn.Module, logits: mx.array, cache: list[Any], rows: DecodeRows, sample: SampleFn
) -> None:
    """Decode ``rows`` from the prompts' last ``logits`` ``(B, V)`` and their batched ``cache``
    (:func:`prefill`), one token per row and step, until ``rows.settle()`` says every row ended.

    Each step samples from the logits, asks the rows what to feed, queues the next forward pass
    (``mx.async_eval``), and only then lets the rows read on the host what they need, so that
    the host's work and its one sync overlap the pass.
    """
    while True:
        chunk = rows.context()
        if chunk is not None:
            logits = lm(mx.array(chunk), cache=cache)[:, -1, :]  # (B, V)
            continue
        sampled, logprobs, entropy = sample(logits, keys=rows.step_keys())
        inputs = rows.feed(sampled, logprobs, entropy)
        if inputs is not None:
            logits = lm(inputs[:, None], cache=cache)[:, -1, :]  # (B, V), queued
            mx.async_eval(logits, *rows.queued())
        if rows.settle():
            return


class ResponseRows:
    """:func:`generate`'s rows: one response each, ended by a stop token, a stop string or the
    budget. The steps stay on the device (:class:`DecodedSteps`); the host reads, per step,
    whether every row has stopped (and, with stop strings, the step's tokens)."""

    def __init__(
        self,
        rows: int,
        *,
        max_new_tokens: int,
        step_keys: mx.array | None,
        stop_token_ids: Sequence[int],
        pad_token_id: int,
        watch: StopStringWatch | None,
    ) -> None:
        self.max_new_tokens = max_new_tokens
        self.keys = step_keys  # (B, max_new_tokens, 2) or None
        self.stop_ids = mx.array(list(stop_token_ids), dtype=mx.int32)
        self.pad = mx.array(pad_token_id, dtype=mx.int32)
        self.watch = watch
        self.t = 0  # the step being decoded
        self.done = mx.zeros((rows,), dtype=mx.bool_)  # stopped before this step
        self.steps = DecodedSteps()
        self.alive = self.done
        self.tokens = self.done
        self.logprobs = self.done

    def context(self) -> np.ndarray | None:
        """A single response takes no context."""
        return None

    def step_keys(self) -> mx.array | None:
        """Row ``b``'s key for step ``t``: ``keys[b, t]``."""
        return None if self.keys is None else self.keys[:, self.t]

    def feed(
        self, sampled: mx.array, logprobs: mx.array, entropy: mx.array | None
    ) -> mx.array | None:
        """The samples of running rows, pad in stopped ones; None at the budget's last step."""
        self.alive = mx.logical_not(self.done)  # this step's token belongs to the response
        self.tokens = mx.where(self.alive, sampled, self.pad)
        self.logprobs = logprobs
        stopped = (self.tokens[:, None] == self.stop_ids[None, :]).any(axis=1)
        self.done = mx.logical_or(self.done, stopped)
        self.steps.add(self.alive, self.tokens, logprobs, entropy)
        return None if self.t == self.max_new_tokens - 1 else self.tokens

    def queued(self) -> tuple[mx.array, ...]:
        """The step's state, and its entropy: left lazy, each step's would hold its ``(B, V)``
        probabilities until the end (two ``(B, T, V)`` arrays' worth at the last step)."""
        return (self.done, self.tokens, self.logprobs, *self.steps.entropy[-1:])

    def settle(self) -> bool:
        """Stop strings read (while the next forward runs); every row stopped or the budget
        spent: the step's one host sync."""
        if self.watch is not None:
            self.done = self.watch.update(self.alive, self.tokens, self.done)
        if self.t == self.max_new_tokens - 1:
            return True
        self.t += 1
        return bool((self.stop_ids.size or self.watch is not None) and self.done.all().item())

    def output(self, with_logprobs: bool) -> GenerationOutput:
        """The responses, cut to the longest."""
        by_string = None if self.watch is None else self.watch.by_string
        return self.steps.output(self.done, with_logprobs, by_string)


class StopStringWatch:
    """:func:`generate`'s stop strings: per row, the running response's tokens on the host,
    and whether a stop string ended it."""

    def __init__(
        self,
        rows: int,
        stop_strings: Sequence[str],
        decode: Callable[[list[int]], str] | None,
    ) -> None:
        assert decode is not None, "checked by check_generation"
        self.stop_strings = stop_strings
        self.decode = decode
        self.window = stop_string_window(stop_strings)
        self.rows: list[list[int]] = [[] for _ in range(rows)]
        self.by_string = [False] * rows

    def update(self, alive: mx.array, tokens: mx.array, done: mx.array) -> mx.array:
        """``done`` (B,) after this step's ``tokens`` (B,) of the ``alive`` rows, with the
        rows a stop string now ends (one host read of the step's tokens)."""
        hits = _stop_string_hits(
            self.rows,
            self.by_string,
            cast(list[bool], alive.tolist()),
            cast(list[int], tokens.tolist()),
            self.stop_strings,
            self.decode,
            self.window,
        )
        return mx.logical_or(done, mx.array(self.by_string)) if hits else done


@dataclass
class DecodedSteps:
    """:func:`generate`'s decoding steps so far, each a ``(B,)`` array per step: the tokens
    (pad after a row's end), whether the row was still running, and the tokens' log-probs and
    entropies (0 after the end)."""

    tokens: list[mx.array] = field(default_factory=list)
    alive: list[mx.array] = field(default_factory=list)
    logprobs: list[mx.array] = field(default_factory=list)
    entropy: list[mx.array] = field(default_factory=list)

    def add(
        self, alive: mx.array, tokens: mx.array, logprobs: mx.array, entropy: mx.array | None
    ) -> None:
        """One step: ``tokens`` already padded where not ``alive``."""
        self.tokens.append(tokens)
        self.logprobs.append(mx.where(alive, logprobs, 0.0))
        if entropy is not None:
            self.entropy.append(mx.where(alive, entropy, 0.0))
        self.alive.append(alive)

    def output(
        self, done: mx.array, with_logprobs: bool, by_string: list[bool] | None
    ) -> GenerationOutput:
        """The generation, cut to the longest response (``T``)."""
        alive_all = mx.stack(self.alive, axis=1)  # (B, T_run)
        response_lengths = alive_all.sum(axis=1).astype(mx.int32)  # (B,)
        responses = mx.stack(self.tokens, axis=1)  # (B, T_run)
        logprobs = mx.stack(self.logprobs, axis=1).astype(mx.float32) if with_logprobs else None
        entropies = mx.stack(self.entropy, axis=1) if with_logprobs else None
        mx.eval(response_lengths, responses, done, logprobs, entropies)
        width = cast(int, response_lengths.max().item())  # T: the longest response
        return GenerationOutput(
            responses=responses[:, :width],
            lengths=response_lengths,
            ended_with_stop=done,
            logprobs=None if logprobs is None else logprobs[:, :width],
            entropy=None if entropies is None else entropies[:, :width],
            stopped_by_string=None if by_string is None else mx.array(by_string),
        )


def _stop_string_hits(
    rows: list[list[int]],
    by_string: list[bool],
    alive: list[bool],
    tokens: list[int],
    stop_strings: Sequence[str],
    decode: Callable[[list[int]], str],
    window: int,
) -> bool:
    """Append this step's ``tokens`` to the ``alive`` ``rows`` and mark in ``by_string`` (in
    place) those whose last ``window`` tokens now contain a stop string; whether any did. A
    row stops at its first match, so a match found is the new token's."""
    hit = False
    for b, (live, token) in enumerate(zip(alive, tokens)):
        if not live or by_string[b]:
            continue
        rows[b].append(token)
        if ends_in_stop_string(decode(rows[b][-window:]), stop_strings):
            by_string[b] = hit = True
    return hit
