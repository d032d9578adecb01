"""Rollout records: what one iteration sampled and how PPO/GRPO scored it, token by token.

Every ``log_rollouts_every`` steps (and at each evaluation) the trainer writes one JSON Lines file
in the run folder, ``rollouts/step_NNNNNN.jsonl`` (an evaluation: ``step_NNNNNN_eval.jsonl``), with
at most ``rollout_records_per_step`` responses, each kept whole. ``python main.py inspect RUN``
renders the files as a page (:mod:`ppo_trainer.inspector`).

One JSON object per line, one per sampled response. Per-token lists have one entry per response
token, up to and including the stop token (pad positions after it are not written). Numbers are
rounded to 6 significant digits; a non-finite number is written as the string ``"NaN"``,
``"Infinity"`` or ``"-Infinity"`` (JSON has no literal for them).

    format: 1, the version of this record format
    step: the PPO iteration (counted from 1) whose rollout this is
    source: "train" (a rollout the update learned from) or "eval" (an evaluation sample)
    algorithm: the run's algorithm ("ppo", "grpo", "rloo", "reinforce_pp", ...)
    index: the response's row in the (rank's) rollout batch
    group: the index of the response's prompt in the batch (row // group_size) when
        group_size > 1, else null
    prompt: the prompt text, as formatted for the policy
    response: the response text, special tokens included: the concatenation of ``tokens``
    token_ids: the response's token ids
    tokens: one text piece per token; the pieces concatenate to the response text. A token that
        holds only part of a multi-byte character (byte-level BPE) has the piece "" and the token
        that completes the character carries it whole
    length: the number of response tokens, the stop token included
    ended_with_stop: whether the response ended with a stop token (false: cut at max_new_tokens)
    score: the sequence score (reward model or function, after the missing-EOS penalty)
    sequence_advantage: GRPO and RLOO: the response's (sequence-level) advantage; null for the
        token-level advantages of PPO and REINFORCE++
    logprob: per token, the log-prob under the rollout policy
    ref_logprob: per token, the log-prob under the reference model
    kl: per token, the KL term (PPO: the reward's kl_estimator; GRPO: the loss's k3)
    entropy: per token, the entropy (nats) of the policy's sampling distribution; null if not given
    value: per token, the value estimate at rollout time (PPO); null for GRPO
    reward: per token, the reward: -kl_coef * kl, plus the score at the last token; null if not
        given
    advantage: per token, the advantage the policy loss used (PPO: GAE, whitened when
        whiten_advantages; GRPO: the sequence advantage on every token); null if not given
    return: per token, the value target (PPO's GAE return); null for GRPO
    actions: multi-turn episodes (agents): per token, 1 where the policy sampled it, 0 where it
        came from a tool or the environment (context the model read); the per-token numbers
        above are null on context tokens (they are not actions). Null for single-turn rollouts
    turns: multi-turn episodes: the ``[start, end)`` token ranges of the policy's turns; null
        for single-turn rollouts
    details: what the rewards logged beside the score (TRL's ``log_extra``), as
        ``{"<reward>/<column>": value}``; null when nothing was logged. A judge
        (``rewards.judge``) logs ``prompt`` (the judge's prompt text, the template filled in,
        before its chat template), ``score`` (its expected reply on the scale: 0-10, or P(yes);
        the reward is this over the scale's top), ``distribution`` (each reply's probability
        among the scale's) and ``mass`` (the probability that its reply is one of them);
        ``group_judge`` also ``response`` (the completion's number in its group) and logs its
        prompt, which shows the whole group, on the group's first completion only (null on
        the others, whose prompts differ only in the number asked about)
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence, Union

import mlx.core as mx
import numpy as np

from training.checkpoint import named_write

RECORD_FORMAT = 1
ROLLOUTS_DIR = "rollouts"
Source = Literal["train", "eval"]
Array = Union[np.ndarray, mx.array]
"""A numpy array, or an ``mx.array`` (copied to the host when a :class:`RolloutArrays` is made)."""

_FILE_PATTERN = re.compile(r"^step_(\d{6,})(_eval)?\.jsonl$")
# Tokens before the response that the incremental decoder sees, so that a response's first piece
# keeps its leading space (SentencePiece drops the space of a sequence's first word).
_DECODE_CONTEXT = 5
_SIGNIFICANT_DIGITS = 6


@dataclass
class RolloutArrays:
    """One iteration's rollout as host-side numpy arrays: ``B`` responses, ``L`` prompt+response
    positions, ``T`` response tokens. ``mx.array`` inputs are copied to numpy on construction
    (bfloat16 as float32).

    Attributes:
        step: the PPO iteration (from 1) whose rollout this is.
        algorithm: the run's algorithm ("ppo", "grpo", "rloo", ...).
        prompts: B prompt texts (as formatted for the policy; repeated within a group).
        query_responses: (B, L) int, prompt then response then padding.
        prompt_lengths: (B,) int, prompt tokens of each row.
        responses: (B, T) int, the response tokens, padded after the stop token.
        mask: (B, T), nonzero on the response's tokens (up to and including the stop token).
        ended_with_stop: (B,) bool, whether each response ended with a stop token.
        scores: (B,) float, sequence scores.
        logprobs: (B, T) float, log-probs under the rollout policy.
        ref_logprobs: (B, T) float, log-probs under the reference model.
        kl: (B, T) float, the per-token KL term (:func:`reward_kl.kl_divergence.kl_estimate`).
        entropy: (B, T) float, entropy of the sampling distribution, or None.
        values: (B, T) float value estimates (PPO), or None.
        rewards: (B, T) float per-token rewards
            (:func:`reward_kl.reward_computer.per_token_rewards`, before any whitening), or None.
        advantages: (B, T) float (PPO) or (B,) float (GRPO, one per sequence), or None.
        returns: (B, T) float value targets (PPO), or None.
        group_size: responses per prompt; rows ``g * group_size ... (g+1) * group_size - 1``
            answer prompt ``g``.
        source: "train" for a training rollout, "eval" for evaluation samples.
        actions: (B, T) multi-turn episodes: nonzero on the policy's tokens (``mask`` then
            covers every token of the episode, context included), or None.
        turns: multi-turn episodes: per row, the ``(start, end)`` ranges of the policy's turns.
        details: column -> B values the rewards logged (``Rollout.reward_details``), or None.
    """

    step: int
    algorithm: str
    prompts: Sequence[str]
    query_responses: Array
    prompt_lengths: Array
    responses: Array
    mask: Array
    ended_with_stop: Array
    scores: Array
    logprobs: Array
    ref_logprobs: Array
    kl: Array
    entropy: Array | None = None
    values: Array | None = None
    rewards: Array | None = None
    advantages: Array | None = None
    returns: Array | None = None
    group_size: int = 1
    source: Source = "train"
    actions: Array | None = None
    turns: Sequence[Sequence[tuple[int, int]]] | None = None
    details: Mapping[str, Sequence[Any]] | None = None

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, mx.array):
                if value.dtype == mx.bfloat16:  # numpy has no bfloat16
                    value = value.astype(mx.float32)
                setattr(self, field.name, np.asarray(value))
        if not self.algorithm:
            raise ValueError("algorithm must name the algorithm (e.g. 'ppo' or 'grpo')")
        if self.source not in ("train", "eval"):
            raise ValueError(f"source must be 'train' or 'eval', got {self.source!r}")
        if self.step < 0:
            raise ValueError(f"step must be >= 0, got {self.step}")
        responses = _host(self.responses)
        if responses.ndim != 2:
            raise ValueError(f"responses must be (B, T), got shape {responses.shape}")
        batch, tokens = responses.shape
        if len(self.prompts) != batch:
            raise ValueError(
                f"{len(self.prompts)} prompts for {batch} responses: give one prompt text per "
                "response row (repeat it for each sample of a group)"
            )
        expected: dict[str, tuple[int, ...]] = {
            "prompt_lengths": (batch,),
            "mask": (batch, tokens),
            "ended_with_stop": (batch,),
            "scores": (batch,),
            "logprobs": (batch, tokens),
            "ref_logprobs": (batch, tokens),
            "kl": (batch, tokens),
            "entropy": (batch, tokens),
            "values": (batch, tokens),
            "rewards": (batch, tokens),
            "returns": (batch, tokens),
            "actions": (batch, tokens),
        }
        for name, shape in expected.items():
            value = getattr(self, name)
            if value is not None and _host(value).shape != shape:
                raise ValueError(
                    f"{name} has shape {_host(value).shape}, expected {shape} (B={batch} "
                    f"responses of T={tokens} tokens, as responses)"
                )
        if self.advantages is not None and _host(self.advantages).shape not in (
            (batch,),
            (batch, tokens),
        ):
            raise ValueError(
                f"advantages has shape {_host(self.advantages).shape}, expected ({batch}, "
                f"{tokens}) per token (PPO) or ({batch},) per sequence (GRPO)"
            )
        for column, values in (self.details or {}).items():
            if len(values) != batch:
                raise ValueError(
                    f"details {column!r} has {len(values)} values for {batch} responses: one "
                    "per response"
                )
        query_responses = _host(self.query_responses)
        if query_responses.ndim != 2 or query_responses.shape[0] != batch:
            raise ValueError(
                f"query_responses has shape {query_responses.shape}, expected ({batch}, L)"
            )
        if np.any(_host(self.prompt_lengths) > query_responses.shape[1]):
            raise ValueError(
                "prompt_lengths exceed the width L of query_responses: pass each row's number of "
                "prompt tokens (the response starts there)"
            )
        if self.group_size < 1 or batch % self.group_size:
            raise ValueError(
                f"group_size={self.group_size} must be >= 1 and divide the {batch} responses"
            )


def _host(x: Array) -> np.ndarray:
    """``x`` as a numpy array (already one after :class:`RolloutArrays` construction)."""
    return np.asarray(x)


def rollouts_due(step: int, every: int, last_step: int | None = None) -> bool:
    """Whether iteration ``step`` (counted from 1) writes rollout records: never when ``every``
    is 0; else at the first step (the policy before any update), every ``every``-th step, and at
    ``last_step`` (the run's last, when known)."""
    if every <= 0:
        return False
    return step == 1 or step % every == 0 or step == last_step


def select_rows(batch: int, group_size: int, limit: int) -> list[int]:
    """Which of ``batch`` responses to record when at most ``limit`` may be: all if they fit;
    else whole groups of ``group_size`` (when ``limit >= group_size > 1``) or single rows,
    spread evenly over the batch (the first and the last included); when ``limit < group_size``
    the first ``limit`` responses of the first group."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if limit >= batch:
        return list(range(batch))
    if group_size > 1:
        if limit < group_size:
            return list(range(limit))
        groups = _spread(batch // group_size, limit // group_size)
        return [g * group_size + k for g in groups for k in range(group_size)]
    return _spread(batch, limit)


def _spread(n: int, k: int) -> list[int]:
    """``k`` distinct indices of ``range(n)`` (``k <= n``), evenly spaced, 0 and ``n - 1`` first
    and last (spacing ``(n - 1) / (k - 1) >= 1``, so rounding keeps them distinct)."""
    return [int(i) for i in np.round(np.linspace(0, n - 1, k)).astype(np.int64)]


def token_pieces(tokenizer: Any, context: Sequence[int], tokens: Sequence[int]) -> list[str]:
    """One text piece per token of ``tokens``, such that the pieces concatenate to the text of
    ``tokens`` as it reads after ``context`` (the prompt's ids; special tokens are kept).

    Decoding tokens one by one breaks byte-level BPE: a multi-byte UTF-8 character split over two
    tokens decodes to two replacement characters. This decodes incrementally instead (as
    streaming detokenizers do, e.g. vLLM's): a token's piece is the new text of a short window of
    ids that ends with it, emitted only once the text no longer ends in an incomplete character;
    the tokens before get "". The window starts a few tokens into ``context`` so that the first
    piece keeps its leading space.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=False)`` (a Hugging Face or
            mlx-lm tokenizer).
        context: the token ids before ``tokens`` (the prompt), possibly empty.
        tokens: the response's token ids.
    """

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=False))

    ids = [int(t) for t in context[-_DECODE_CONTEXT:]] + [int(t) for t in tokens]
    prefix_offset, read_offset = 0, len(ids) - len(tokens)
    prefix_text = decode(ids[prefix_offset:read_offset])
    pieces: list[str] = []
    for end in range(read_offset + 1, len(ids) + 1):
        new_text = decode(ids[prefix_offset:end])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            pieces.append(new_text[len(prefix_text) :])
            prefix_offset, read_offset = read_offset, end
            prefix_text = decode(ids[prefix_offset:read_offset])
        else:
            pieces.append("")
    if read_offset < len(ids):
        # The response ends inside a character (or with tokens that add no text): what they
        # decode to (replacement characters) goes to the last token.
        pieces[-1] = decode(ids[prefix_offset:])[len(prefix_text) :]
    return pieces


def _number(x: float) -> float | str:
    """A JSON-safe number: 6 significant digits, non-finite values as strings."""
    x = float(x)
    if math.isfinite(x):
        return float(f"{x:.{_SIGNIFICANT_DIGITS}g}")
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def _numbers(row: np.ndarray) -> list[float | str | None]:
    return [_number(x) for x in row.tolist()]


def _json_value(x: Any) -> Any:
    """A logged detail as JSON: numbers as :func:`_number` writes them, containers item by
    item, text and None as they are, anything else as its text."""
    if x is None or isinstance(x, (str, bool)):
        return x
    if isinstance(x, (int, float, np.number)):
        return int(x) if isinstance(x, (int, np.integer)) else _number(float(x))
    if isinstance(x, Mapping):
        return {str(k): _json_value(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, np.ndarray)):
        return [_json_value(v) for v in (x.tolist() if isinstance(x, np.ndarray) else x)]
    return str(x)


def rollout_records(
    arrays: RolloutArrays, tokenizer: Any, rows: Sequence[int] | None = None
) -> list[dict[str, Any]]:
    """The JSON-able records (format in the module docstring) of ``rows`` of ``arrays``
    (default: every row), in that order.

    Args:
        arrays: one iteration's rollout.
        tokenizer: decodes the token pieces (see :func:`token_pieces`).
        rows: which responses, e.g. :func:`select_rows`.
    """
    batch = len(arrays.prompts)
    rows = list(range(batch)) if rows is None else [int(r) for r in rows]
    bad = [r for r in rows if not 0 <= r < batch]
    if bad:
        raise ValueError(f"rows {bad} are outside the batch of {batch} responses")
    mask = _host(arrays.mask) != 0
    lengths = mask.sum(axis=1)  # (B,)
    if np.any(mask.cumsum(axis=1) != np.minimum(np.arange(1, mask.shape[1] + 1), lengths[:, None])):
        raise ValueError(
            "mask must be 1 on a prefix of each row (the response up to its stop token) and 0 "
            "after: records keep tokens 0 .. length-1"
        )
    responses = _host(arrays.responses)
    query_responses = _host(arrays.query_responses)
    prompt_lengths = _host(arrays.prompt_lengths)
    ended = _host(arrays.ended_with_stop)
    scores = _host(arrays.scores)
    advantages = None if arrays.advantages is None else _host(arrays.advantages)
    actions = None if arrays.actions is None else _host(arrays.actions) != 0
    per_token = {
        "logprob": arrays.logprobs,
        "ref_logprob": arrays.ref_logprobs,
        "kl": arrays.kl,
        "entropy": arrays.entropy,
        "value": arrays.values,
        "reward": arrays.rewards,
        "advantage": advantages,
        "return": arrays.returns,
    }
    records: list[dict[str, Any]] = []
    for row in rows:
        n = int(lengths[row])
        token_ids = [int(t) for t in responses[row, :n]]
        prompt_ids = query_responses[row, : int(prompt_lengths[row])].tolist()
        pieces = token_pieces(tokenizer, prompt_ids, token_ids)
        record: dict[str, Any] = {
            "format": RECORD_FORMAT,
            "step": int(arrays.step),
            "source": arrays.source,
            "algorithm": arrays.algorithm,
            "index": row,
            "group": row // arrays.group_size if arrays.group_size > 1 else None,
            "prompt": arrays.prompts[row],
            "response": "".join(pieces),
            "token_ids": token_ids,
            "tokens": pieces,
            "length": n,
            "ended_with_stop": bool(ended[row]),
            "score": _number(scores[row]),
            "sequence_advantage": None,
            "actions": None if actions is None else actions[row, :n].astype(int).tolist(),
            "turns": None if arrays.turns is None else [list(t) for t in arrays.turns[row]],
            "details": (
                {column: _json_value(values[row]) for column, values in arrays.details.items()}
                if arrays.details
                else None
            ),
        }
        if advantages is not None and advantages.ndim == 1:
            record["sequence_advantage"] = _number(advantages[row])
        for name, values in per_token.items():
            if values is None:
                record[name] = None
                continue
            values = _host(values)
            if values.ndim == 1:  # a sequence-level advantage applies to every token
                numbers = _numbers(np.full(n, values[row], dtype=np.float64))
            else:
                numbers = _numbers(values[row, :n])
            if actions is not None:  # a tool's token is no action: no numbers of its own
                numbers = [x if a else None for x, a in zip(numbers, actions[row, :n])]
            record[name] = numbers
        records.append(record)
    return records


def rollout_file_name(step: int, source: Source = "train") -> str:
    """``step_NNNNNN.jsonl``, or ``step_NNNNNN_eval.jsonl`` for evaluation records."""
    return f"step_{step:06d}{'_eval' if source == 'eval' else ''}.jsonl"


def write_rollout_records(
    run_dir: str | Path, step: int, records: Sequence[dict[str, Any]], source: Source = "train"
) -> Path:
    """Write ``records`` to ``<run_dir>/rollouts/step_NNNNNN[_eval].jsonl`` atomically (a temporary
    file in the same folder, flushed to disk, then renamed over the target): a reader never sees
    a half-written file, and a crash leaves the previous version. Returns the path."""
    folder = Path(run_dir) / ROLLOUTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / rollout_file_name(step, source)
    tmp = folder / f".{path.name}.tmp-{os.getpid()}"
    try:
        with named_write(path):  # a full disk names the file and the free space
            with open(tmp, "w", encoding="utf-8") as f:
                for record in records:
                    f.write(json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # no stray temporary file; the error propagates
        raise
    return path


def log_rollouts(run_dir: str | Path, arrays: RolloutArrays, tokenizer: Any, limit: int) -> Path:
    """Record at most ``limit`` responses of ``arrays`` (:func:`select_rows`) in the run folder
    (:func:`write_rollout_records`); returns the file's path. What the trainer calls every
    ``log_rollouts_every`` steps and at each evaluation, with ``rollout_records_per_step``."""
    rows = select_rows(len(arrays.prompts), arrays.group_size, limit)
    records = rollout_records(arrays, tokenizer, rows)
    return write_rollout_records(run_dir, arrays.step, records, arrays.source)


def log_step_rollouts(
    run_dir: str | Path,
    rollout: Any,
    batch: Any,
    stats: Mapping[str, Any],
    step: int,
    last_step: int | None,
    config: Any,
    tokenizer: Any,
) -> Path | None:
    """A training step's records (:func:`rollout_arrays`, :func:`log_rollouts`) when
    ``config.log_rollouts_every`` says so (:func:`rollouts_due`; ``last_step``: the run's last,
    recorded too), at most ``config.rollout_records_per_step`` of them; returns the file's path,
    None when none is due."""
    if not rollouts_due(step, config.log_rollouts_every, last_step):
        return None
    arrays = rollout_arrays(rollout, batch, stats, step, config.algorithm, config.group_size)
    return log_rollouts(run_dir, arrays, tokenizer, config.rollout_records_per_step)


@dataclass
class StepRecords:
    """The records of one file: ``step``, ``source`` ("train" or "eval") and the ``records``."""

    step: int
    source: Source
    records: list[dict[str, Any]]


def read_rollout_records(run_dir: str | Path) -> list[StepRecords]:
    """Every ``rollouts/step_*.jsonl`` of ``run_dir``, by step (training before evaluation).

    Raises:
        FileNotFoundError: no records (with how to get some).
        ValueError: a malformed line (file and line named).
    """
    folder = Path(run_dir) / ROLLOUTS_DIR
    found = []
    if folder.is_dir():
        for path in folder.iterdir():
            match = _FILE_PATTERN.match(path.name)
            if match:
                found.append((int(match.group(1)), "eval" if match.group(2) else "train", path))
    if not found:
        raise FileNotFoundError(
            f"no rollout records in {folder}: train with log_rollouts_every > 0 (e.g. --set "
            "log_rollouts_every=10) and output_dir set to this run folder, then inspect it"
        )
    steps = []
    for step, source, path in sorted(found, key=lambda f: (f[0], f[1] == "eval")):
        records = read_records_file(path)
        steps.append(StepRecords(step, "eval" if source == "eval" else "train", records))
    return steps


def read_records_file(path: str | Path) -> list[dict[str, Any]]:
    """The records of one ``step_NNNNNN[_eval].jsonl`` file.

    Raises:
        ValueError: a malformed line (file and line named).
    """
    path = Path(path)
    records = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from err
        if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
            raise ValueError(
                f"{path}:{lineno}: not a rollout record of format {RECORD_FORMAT}; "
                "write it again with this version of the trainer"
            )
        records.append(record)
    return records


def rollout_arrays(
    rollout: Any,
    batch: Any,
    stats: Mapping[str, Any],
    step: int,
    algorithm: str,
    group_size: int = 1,
    source: Source = "train",
) -> RolloutArrays:
    """What the records of one step are made of, from the trainer's rollout
    (:class:`ppo_trainer.rollout.Rollout`), its batch (:class:`RolloutBatch`) and the experience
    phase's per-token ``stats`` (``kl``, and ``rewards`` when there are any). An evaluation
    (``source="eval"``) records no advantages. Multi-turn episodes record every token up to
    each episode's end, with the policy's ``actions`` and ``turns``; what the rewards logged
    per response is its ``details``."""
    gen = rollout.generation
    multi_turn = gen.action_mask is not None
    mask = batch.mask
    if multi_turn:  # the whole episode: the policy's tokens and the tools'
        mask = mx.arange(gen.responses.shape[1])[None, :] < gen.lengths[:, None]  # (B, T)
    return RolloutArrays(
        step=step,
        algorithm=algorithm,
        prompts=rollout.texts,
        query_responses=batch.query_responses,
        prompt_lengths=batch.prompt_lengths,
        responses=batch.responses,
        mask=mask,
        ended_with_stop=rollout.generation.ended_with_stop,
        scores=batch.scores,
        logprobs=batch.logprobs,
        ref_logprobs=batch.ref_logprobs,
        kl=stats["kl"],
        entropy=rollout.entropy,
        values=batch.values,
        rewards=stats.get("rewards"),
        advantages=batch.advantages if source == "train" else None,
        returns=batch.returns,
        group_size=group_size if source == "train" else 1,
        source=source,
        actions=gen.action_mask if multi_turn else None,
        turns=gen.turn_spans if multi_turn else None,
        details=rollout.reward_details or None,
    )
