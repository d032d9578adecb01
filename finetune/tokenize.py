"""SFT demonstrations and preference pairs as token ids, and their batches (formats:
:mod:`finetune.records`).

Tokenisation matches PPO: the tokenizer's BOS token is prepended when it adds one, no other
special token (:func:`base_setup.tokenizer_setup.encode_text`, as PPO encodes prompts), and the prompt/completion boundary is where the tokens of
``prompt + completion`` stop agreeing with the tokens of ``prompt`` alone (TRL's rule), so the
context is what PPO's prompt encoding gives whenever the prompt's tokens are a prefix.

Each side of a preference pair is scored as ``prompt + answer + EOS``, the token sequence PPO's
reward model sees (prompt, response, stop token); a conversational pair as the prompt in the chat
template with a generation prompt, then the reply through the template's end-of-turn token.
Batches are right-padded; masks come from lengths, never from the pad id.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import mlx.core as mx
import numpy as np

from base_setup.tokenizer_setup import apply_chat_template, encode_text, eos_token_ids
from finetune.records import check_preference_record, check_sft_record, sft_tools

logger = logging.getLogger("ppo_mlx")


# --------------------------------------------------------------------------- tokenisation


@dataclass(frozen=True)
class SFTExample:
    """One tokenised SFT example.

    Attributes:
        input_ids: (L,) token ids: context and answer tokens (and EOS for text records).
        loss_mask: (L,) 1 where the token is a target (answer tokens), 0 for context. Token 0 is
            never a target (nothing predicts it).
    """

    input_ids: list[int]
    loss_mask: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_targets(self) -> int:
        """Number of tokens the loss covers."""
        return sum(self.loss_mask[1:])


@dataclass(frozen=True)
class PreferenceExample:
    """One tokenised preference pair (each side ``prompt + answer + EOS``).

    Attributes:
        chosen_ids: token ids of the preferred sequence.
        rejected_ids: token ids of the other sequence.
        margin: the pair's own margin, or None to use the trainer's.
    """

    chosen_ids: list[int]
    rejected_ids: list[int]
    margin: float | None = None

    def __len__(self) -> int:
        return max(len(self.chosen_ids), len(self.rejected_ids))


def _encode(tokenizer: Any, text: str) -> list[int]:
    return encode_text(tokenizer, text)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _eos_id(tokenizer: Any) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError(
            "the tokenizer has no eos_token_id: completions must end with an end-of-sequence "
            "token so the model learns to stop; use a tokenizer with an EOS token"
        )
    return int(eos)


def prompt_completion_tokens(
    tokenizer: Any, prompt: str, completion: str
) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of ``prompt + completion + EOS``, loss on completion and EOS.

    The boundary is the length of the common prefix of ``encode(prompt)`` and
    ``encode(prompt + completion)``: all of ``encode(prompt)`` when the prompt's tokens are a
    prefix of the whole (the usual case), else the token that straddles the boundary is counted
    as completion.
    """
    full = _encode(tokenizer, prompt + completion)
    boundary = _common_prefix(_encode(tokenizer, prompt), full)
    ids = full + [_eos_id(tokenizer)]
    mask = [0] * boundary + [1] * (len(ids) - boundary)
    return ids, mask


def chat_tokens(
    tokenizer: Any,
    messages: Sequence[Mapping[str, str]],
    where: str = "conversation",
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of a conversation in the chat template, loss on assistant turns.

    ``tools`` (JSON schemas, TRL's ``tools`` column) are rendered by the template as in a
    tool-calling rollout's prompt; ``tool`` messages are context like user turns.

    Each assistant turn ``i`` covers the tokens between the template of ``messages[:i]`` with a
    generation prompt and the template of ``messages[:i + 1]`` (its content and end-of-turn
    tokens). A template that renders earlier turns differently once later turns follow (e.g.
    one that drops the reasoning of past turns) only lets the last turn be found: earlier
    assistant turns whose tokens do not line up are left as context.

    Raises:
        ValueError: the tokenizer has no chat template, or the last assistant turn cannot be
            located in the rendered conversation.
    """
    dicts = [
        {"role": m["role"], "content": m["content"], **({"name": m["name"]} if "name" in m else {})}
        for m in messages
    ]
    kwargs = {"tools": [dict(t) for t in tools]} if tools else None
    try:
        ids = apply_chat_template(
            tokenizer, dicts, add_generation_prompt=False, template_kwargs=kwargs
        )
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from err
    mask = [0] * len(ids)
    last = max(i for i, m in enumerate(dicts) if m["role"] == "assistant")
    for i, message in enumerate(dicts):
        if message["role"] != "assistant" or i == 0:
            continue
        before = apply_chat_template(
            tokenizer, dicts[:i], add_generation_prompt=True, template_kwargs=kwargs
        )
        through = apply_chat_template(
            tokenizer, dicts[: i + 1], add_generation_prompt=False, template_kwargs=kwargs
        )
        start, end = len(before), len(through)
        lines_up = through[:start] == before and ids[:end] == through and end > start
        if not lines_up:
            if i == last:
                raise ValueError(
                    f"{where}: cannot find the last assistant turn in the chat template's output "
                    "(the template does not render the conversation up to it as a prefix of the "
                    "whole); use prompt/completion records instead"
                )
            logger.debug("%s: assistant turn %d does not line up; trained as context", where, i)
            continue
        mask[start:end] = [1] * (end - start)
    return ids, mask


def chat_response_tokens(
    tokenizer: Any,
    prompt: Sequence[Mapping[str, str]],
    answer: str | Sequence[Mapping[str, str]],
    where: str = "conversation",
) -> list[int]:
    """The ids PPO's reward model sees for a chat prompt and its answer: the prompt in the chat
    template with a generation prompt, then the answer's tokens up to and including the first end
    token (an EOS id or the template's end-of-turn token), where PPO's responses stop.

    ``answer`` is the assistant's text, or messages ending with the assistant turn to score.
    A template that writes no end token after the turn gets the EOS token appended.
    """
    answer_messages = (
        [{"role": "assistant", "content": answer}] if isinstance(answer, str) else list(answer)
    )
    dicts = [{"role": m["role"], "content": m["content"]} for m in [*prompt, *answer_messages]]
    try:
        context = apply_chat_template(tokenizer, dicts[:-1], add_generation_prompt=True)
        ids = apply_chat_template(tokenizer, dicts, add_generation_prompt=False)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from err
    if ids[: len(context)] != context:
        raise ValueError(
            f"{where}: the chat template does not render the prompt as a prefix of the prompt "
            "with its answer, so the answer cannot be located; use text records instead"
        )
    ends = set(eos_token_ids(tokenizer))
    for index in range(len(context), len(ids)):
        if ids[index] in ends:
            return ids[: index + 1]
    return ids + [_eos_id(tokenizer)]


def tokenize_sft(
    records: Iterable[Mapping[str, Any]], tokenizer: Any, max_length: int
) -> list[SFTExample]:
    """Check and tokenise SFT records (see the module docstring for the formats).

    Examples longer than ``max_length`` are truncated on the right (a warning counts them).

    Raises:
        ValueError: a malformed record (named by its index), an example left with no target
            token after truncation (the prompt fills ``max_length``), or no records.
    """
    examples: list[SFTExample] = []
    truncated = 0
    for i, record in enumerate(records):
        where = f"SFT record {i}"
        check_sft_record(record, where)
        messages = record.get("messages")
        if messages is None and record.get("system") is not None:
            messages = [
                {"role": "system", "content": record["system"]},
                {"role": "user", "content": record["prompt"]},
                {"role": "assistant", "content": record["completion"]},
            ]
        if messages is not None:
            ids, mask = chat_tokens(tokenizer, messages, where, tools=sft_tools(record))
        else:
            ids, mask = prompt_completion_tokens(tokenizer, record["prompt"], record["completion"])
        if len(ids) > max_length:
            ids, mask = ids[:max_length], mask[:max_length]
            truncated += 1
        example = SFTExample(ids, mask)
        if example.num_targets == 0:
            context = mask.index(1) if 1 in mask else len(mask)
            raise ValueError(
                f"{where}: its context takes {context} tokens, so max_length={max_length} leaves "
                "no completion token to learn; raise max_length or shorten the prompt"
            )
        examples.append(example)
    if not examples:
        raise ValueError("no SFT records to train on: the data is empty")
    if truncated:
        logger.warning(
            "%d of %d SFT examples are longer than max_length=%d tokens and were truncated",
            truncated,
            len(examples),
            max_length,
        )
    return examples


def tokenize_preferences(
    records: Iterable[Mapping[str, Any]], tokenizer: Any, max_length: int
) -> list[PreferenceExample]:
    """Check and tokenise preference records: ``prompt + chosen + EOS`` and
    ``prompt + rejected + EOS`` for text, :func:`chat_response_tokens` for conversations.

    A pair with a side longer than ``max_length`` is dropped (a warning counts them): truncating
    would move the scored last token away from the EOS that PPO's reward model is read at.

    Raises:
        ValueError: a malformed record (named by its index), or no pair left.
    """
    eos = _eos_id(tokenizer)
    examples: list[PreferenceExample] = []
    seen = dropped = 0
    for i, record in enumerate(records):
        where = f"preference record {i}"
        check_preference_record(record, where)
        seen += 1
        if isinstance(record["prompt"], list):
            chosen = chat_response_tokens(tokenizer, record["prompt"], record["chosen"], where)
            rejected = chat_response_tokens(tokenizer, record["prompt"], record["rejected"], where)
        else:
            chosen = _encode(tokenizer, record["prompt"] + record["chosen"]) + [eos]
            rejected = _encode(tokenizer, record["prompt"] + record["rejected"]) + [eos]
        if max(len(chosen), len(rejected)) > max_length:
            dropped += 1
            continue
        margin = record.get("margin")
        examples.append(PreferenceExample(chosen, rejected, None if margin is None else margin))
    if not examples:
        if seen == 0:
            raise ValueError("no preference records to train on: the data is empty")
        raise ValueError(
            f"all {seen} preference pairs are longer than max_length={max_length} tokens; "
            "raise max_length"
        )
    if dropped:
        logger.warning(
            "dropped %d of %d preference pairs longer than max_length=%d tokens",
            dropped,
            seen,
            max_length,
        )
    return examples


# --------------------------------------------------------------------------- batching


def length_bucketed_batches(
    lengths: Sequence[int], batch_size: int, *, window: int, seed: int, epoch: int
) -> list[list[int]]:
    """One epoch's batches of example indices, similar lengths batched together.

    The indices are shuffled with ``(seed, epoch)``, cut into windows of ``window * batch_size``,
    sorted by length within each window and cut into batches of ``batch_size``; the order of the
    batches is then shuffled, so short and long batches alternate. Every index appears once; only
    the last batch of the last window can be smaller. ``window == 1`` gives plain shuffled
    batches. Deterministic in ``(seed, epoch)``, so a resumed run recomputes the same epoch.
    """
    if batch_size < 1 or window < 1:
        raise ValueError(f"batch_size and window must be >= 1, got {batch_size} and {window}")
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths)).tolist()
    span = batch_size * window
    batches: list[list[int]] = []
    for start in range(0, len(order), span):
        chunk = sorted(order[start : start + span], key=lambda i: lengths[i])  # stable
        batches += [chunk[j : j + batch_size] for j in range(0, len(chunk), batch_size)]
    if window > 1:
        batches = [batches[i] for i in rng.permutation(len(batches)).tolist()]
    return batches


@dataclass
class SFTBatch:
    """A right-padded SFT micro-batch.

    Attributes:
        input_ids: (B, L) int32 token ids, padded with the pad token.
        loss_mask: (B, L) float32, 1 where the token is a target (0 at padding).

    Only arrays, so that a compiled gradient (``training.compiled_gradient``) takes it whole.
    """

    input_ids: mx.array
    loss_mask: mx.array

    @property
    def num_targets(self) -> int:
        """The number of target tokens, ``loss_mask[:, 1:].sum()``."""
        return int(np.asarray(self.loss_mask[:, 1:].sum()))


def padded_width(width: int, pad_to_multiple_of: int | None) -> int:
    """``width`` rounded up to a multiple of ``pad_to_multiple_of`` (None: ``width``), as
    transformers' collators' ``pad_to_multiple_of`` does: a compiled gradient then meets a few
    batch widths, not one per batch (each new width is a new trace)."""
    if pad_to_multiple_of is None:
        return width
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    return -(-width // pad_to_multiple_of) * pad_to_multiple_of


def collate_sft(
    examples: Sequence[SFTExample], pad_token_id: int, pad_to_multiple_of: int | None = None
) -> SFTBatch:
    """Pad SFT examples on the right into one :class:`SFTBatch` (its width a multiple of
    ``pad_to_multiple_of`` when given: :func:`padded_width`)."""
    width = padded_width(max(len(e) for e in examples), pad_to_multiple_of)
    ids = np.full((len(examples), width), pad_token_id, dtype=np.int32)  # (B, L)
    mask = np.zeros((len(examples), width), dtype=np.float32)  # (B, L)
    for row, example in enumerate(examples):
        ids[row, : len(example)] = example.input_ids
        mask[row, : len(example)] = example.loss_mask
    return SFTBatch(mx.array(ids), mx.array(mask))


@dataclass
class PreferenceBatch:
    """A right-padded micro-batch of preference pairs, both sides in one array.

    Attributes:
        input_ids: (2B, L) int32: rows 0..B-1 the chosen sequences, rows B..2B-1 the rejected
            ones of the same pairs, padded with the pad token.
        lengths: (2B,) int32 tokens per row (the reward is read at ``lengths - 1``).
        margins: (B,) float32 margin of each pair.
    """

    input_ids: mx.array
    lengths: mx.array
    margins: mx.array

    @property
    def num_pairs(self) -> int:
        """B, the number of pairs."""
        return int(self.margins.shape[0])


def collate_preferences(
    examples: Sequence[PreferenceExample],
    pad_token_id: int,
    default_margin: float = 0.0,
    pad_to_multiple_of: int | None = None,
) -> PreferenceBatch:
    """Pad preference pairs into one :class:`PreferenceBatch` (chosen rows, then rejected rows;
    the width a multiple of ``pad_to_multiple_of`` when given: :func:`padded_width`); a pair
    without its own margin gets ``default_margin``."""
    rows = [e.chosen_ids for e in examples] + [e.rejected_ids for e in examples]
    width = padded_width(max(len(r) for r in rows), pad_to_multiple_of)
    ids = np.full((len(rows), width), pad_token_id, dtype=np.int32)  # (2B, L)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
    lengths = np.array([len(r) for r in rows], dtype=np.int32)  # (2B,)
    margins = np.array(
        [default_margin if e.margin is None else e.margin for e in examples], dtype=np.float32
    )  # (B,)
    return PreferenceBatch(mx.array(ids), mx.array(lengths), mx.array(margins))


# --------------------------------------------------------------------------- DPO pairs


@dataclass(frozen=True)
class DPOExample:
    """One tokenised preference pair for DPO: each side ``prompt + answer (+ EOS)`` and where its
    answer starts, and the reference's log-probs of the answers once they are computed.

    Attributes:
        chosen_ids: token ids of the prompt and the preferred answer.
        chosen_start: index of the chosen answer's first token in ``chosen_ids``.
        rejected_ids: token ids of the prompt and the other answer.
        rejected_start: index of the rejected answer's first token.
        ref_chosen: the reference's log-prob of the chosen answer (summed over its tokens), or
            None before it is computed (or for reference-free losses).
        ref_rejected: the same for the rejected answer.
    """

    chosen_ids: list[int]
    chosen_start: int
    rejected_ids: list[int]
    rejected_start: int
    ref_chosen: float | None = None
    ref_rejected: float | None = None

    def __len__(self) -> int:
        return max(len(self.chosen_ids), len(self.rejected_ids))


def _answer_tokens(tokenizer: Any, prompt: Any, answer: Any, where: str) -> tuple[list[int], int]:
    """``(ids, start)`` of one side of a pair: text as :func:`prompt_completion_tokens` (answer
    and EOS after the prompt), a conversation as :func:`chat_response_tokens`."""
    if isinstance(prompt, list):
        ids = chat_response_tokens(tokenizer, prompt, answer, where)
        dicts = [{"role": m["role"], "content": m["content"]} for m in prompt]
        context = apply_chat_template(tokenizer, dicts, add_generation_prompt=True)
        if not isinstance(answer, str):  # earlier turns of the answer's messages are context
            context = apply_chat_template(
                tokenizer,
                dicts + [{"role": m["role"], "content": m["content"]} for m in answer[:-1]],
                add_generation_prompt=True,
            )
        return ids, min(len(context), len(ids) - 1)
    ids, mask = prompt_completion_tokens(tokenizer, prompt, answer)
    return ids, mask.index(1)


def tokenize_dpo_pairs(
    records: Iterable[Mapping[str, Any]], tokenizer: Any, max_length: int
) -> list[DPOExample]:
    """Check and tokenise preference records for DPO (formats: :mod:`finetune.records`).

    A side longer than ``max_length`` loses answer tokens on the right (a warning counts them),
    as TRL truncates; the log-prob then covers the answer's first tokens.

    Raises:
        ValueError: a malformed record (a missing field, chosen equal to rejected: named by its
            index), a pair whose two sides tokenise identically, a prompt that leaves no answer
            token within ``max_length``, or no records.
    """
    examples: list[DPOExample] = []
    truncated = 0
    for i, record in enumerate(records):
        where = f"preference record {i}"
        check_preference_record(record, where)
        chosen, chosen_start = _answer_tokens(tokenizer, record["prompt"], record["chosen"], where)
        rejected, rejected_start = _answer_tokens(
            tokenizer, record["prompt"], record["rejected"], where
        )
        if chosen == rejected:
            raise ValueError(
                f"{where}: 'chosen' and 'rejected' give the same tokens, so the pair prefers "
                "nothing; drop it"
            )
        start = max(chosen_start, rejected_start)
        if start >= max_length:
            raise ValueError(
                f"{where}: its prompt takes {start} tokens, so max_length={max_length} leaves no "
                "answer token to compare; raise max_length or shorten the prompt"
            )
        if max(len(chosen), len(rejected)) > max_length:
            truncated += 1
            chosen, rejected = chosen[:max_length], rejected[:max_length]
        examples.append(DPOExample(chosen, chosen_start, rejected, rejected_start))
    if not examples:
        raise ValueError("no preference records to train on: the data is empty")
    if truncated:
        logger.warning(
            "%d of %d preference pairs are longer than max_length=%d tokens: their answers were "
            "truncated on the right",
            truncated,
            len(examples),
            max_length,
        )
    return examples


@dataclass
class DPOBatch:
    """A right-padded micro-batch of DPO pairs, both sides in one array.

    Attributes:
        input_ids: (2B, L) int32: rows 0..B-1 the chosen sequences, rows B..2B-1 the rejected
            ones of the same pairs, padded with the pad token.
        answer_mask: (2B, L) float32, 1 at the answer's tokens (the log-prob's targets), 0 at
            the prompt and padding.
        ref_logps: (2B,) float32 reference log-probs (chosen, then rejected), or None.
    """

    input_ids: mx.array
    answer_mask: mx.array
    ref_logps: mx.array | None = None

    @property
    def num_pairs(self) -> int:
        """B, the number of pairs."""
        return int(self.input_ids.shape[0]) // 2


def collate_dpo(
    examples: Sequence[DPOExample], pad_token_id: int, pad_to_multiple_of: int | None = None
) -> DPOBatch:
    """Pad DPO pairs into one :class:`DPOBatch` (chosen rows, then rejected rows; the width a
    multiple of ``pad_to_multiple_of`` when given: :func:`padded_width`)."""
    sides = [(e.chosen_ids, e.chosen_start) for e in examples] + [
        (e.rejected_ids, e.rejected_start) for e in examples
    ]
    width = padded_width(max(len(ids) for ids, _ in sides), pad_to_multiple_of)
    ids = np.full((len(sides), width), pad_token_id, dtype=np.int32)  # (2B, L)
    mask = np.zeros((len(sides), width), dtype=np.float32)  # (2B, L)
    for row, (tokens, start) in enumerate(sides):
        ids[row, : len(tokens)] = tokens
        mask[row, start : len(tokens)] = 1.0
    refs = [e.ref_chosen for e in examples] + [e.ref_rejected for e in examples]
    ref_logps = None
    if all(r is not None for r in refs):
        ref_logps = mx.array(np.array(refs, dtype=np.float32))  # (2B,)
    return DPOBatch(mx.array(ids), mx.array(mask), ref_logps)
