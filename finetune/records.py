"""The records of the first RLHF stages: their formats, their checks, and loading them.

Formats, one JSON object per line (a local JSONL file), or the same columns in a Hugging Face Hub
dataset:

* SFT, text: ``{"prompt": "Review of the laptop:", "completion": " The screen is superb."}``. The
  model reads ``prompt + completion + EOS``; the loss covers the completion and the EOS only.
* SFT, text with a system message: ``{"system": ..., "prompt": ..., "completion": ...}`` is the
  conversation system / user (prompt) / assistant (completion), rendered with the tokenizer's
  chat template (so the tokenizer needs one).
* SFT, chat: ``{"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}]}``,
  rendered with the chat template; the loss covers every assistant turn (its content and the
  template's end-of-turn tokens), the rest is context. The conversation must end with an
  assistant turn. A ``"tools"`` field (TRL's column: the tools' JSON schemas, a list or its
  JSON text) is passed to the template, which describes the tools as in a tool-calling
  rollout's prompt; ``{"role": "tool", "content": ...}`` turns are context.
* Preferences: ``{"prompt": ..., "chosen": ..., "rejected": ..., "margin": 0.5}`` (``margin``
  optional). Each side is scored as ``prompt + answer + EOS``, the token sequence PPO's reward
  model sees (prompt, response, stop token). Conversational (TRL's format): ``prompt`` is a list
  of chat messages and ``chosen`` / ``rejected`` the assistant's reply (a string or messages);
  each side is the prompt in the chat template with a generation prompt, then the reply through
  the template's end-of-turn token, as PPO generates it.

Loading (:func:`load_sft_data`, :func:`load_preference_data`) goes through the ``datasets``
library, so a local file and a Hub dataset name both work. A local file is first checked line by
line, so a malformed line fails with ``<file>:<line>: <what is wrong>`` (the ``datasets`` JSON
reader does not name the line).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import numpy as np

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger("ppo_mlx")

#: What a record check does: raise ValueError naming ``where`` if the record is malformed (what
#: it returns is ignored, so a function that converts a record can serve as its check).
RecordCheck = Callable[[Any, str], object]

# "name" or "namespace/name", as the Hugging Face Hub accepts them.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")
_LOCAL_SUFFIXES = (".json", ".jsonl", ".jsonlines")


# --------------------------------------------------------------------------- record checks


def require_text(record: Mapping[str, Any], key: str, where: str, what: str) -> str:
    """``record[key]`` if it is a non-empty string, else ``ValueError("<where>: ...")`` saying
    whether it is missing (naming ``what`` the record should hold), not a string, or empty."""
    value = record.get(key)
    if value is None:
        raise ValueError(f"{where}: missing field {key!r} ({what})")
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"{where}: field {key!r} is empty; give it some text or drop the record")
    return value


def require_object(record: Any, where: str, what: str) -> Mapping[str, Any]:
    """``record`` if it is a JSON object (a mapping), else ``ValueError("<where>: ...")`` naming
    ``what`` it should hold and showing what it is."""
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: expected a JSON object ({what}), got {record!r:.60}")
    return record


_SFT_FIELDS = "an SFT record has 'prompt' and 'completion' (optionally 'system'), or 'messages'"
_PREFERENCE_FIELDS = "a preference record has 'prompt', 'chosen' and 'rejected'"


def check_sft_record(record: Any, where: str) -> None:
    """Raise ``ValueError("<where>: ...")`` unless ``record`` is a valid SFT record.

    Valid: ``prompt`` and ``completion`` non-empty strings (``system``, if present and not null,
    a non-empty string), or ``messages``: a non-empty list of ``{"role", "content"}`` objects
    with string roles and contents, at least one assistant turn, not first, and an assistant
    turn last.
    """
    record = require_object(record, where, _SFT_FIELDS)
    messages = record.get("messages")
    if messages is None:
        require_text(record, "prompt", where, _SFT_FIELDS)
        require_text(record, "completion", where, _SFT_FIELDS)
        if record.get("system") is not None:
            require_text(record, "system", where, "a system message")
        return
    _check_messages(messages, where, "messages")
    for i, message in enumerate(messages):
        if message["role"] == "assistant" and not message["content"].strip():
            raise ValueError(f"{where}: messages[{i}] is an empty assistant turn; nothing to learn")
    if messages[-1]["role"] != "assistant":
        raise ValueError(
            f"{where}: the last message has role {messages[-1]['role']!r}; a conversation for SFT "
            "must end with an assistant turn (drop the trailing messages)"
        )
    if messages[0]["role"] == "assistant":
        raise ValueError(
            f"{where}: the conversation starts with an assistant turn; put the user (or system) "
            "message it answers before it"
        )
    if record.get("tools") is not None:
        sft_tools(record, where)


def sft_tools(record: Mapping[str, Any], where: str = "SFT record") -> list[dict[str, Any]] | None:
    """The ``tools`` of a chat SFT record (a list of JSON schemas, or its JSON text), or None.

    Raises:
        ValueError: tools that are not a list of objects.
    """
    tools = record.get("tools")
    if tools is None:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: 'tools' is not valid JSON ({err.msg})") from None
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
        raise ValueError(
            f"{where}: 'tools' must be a list of the tools' JSON schemas "
            '({"type": "function", "function": {...}}), got ' + f"{tools!r:.80}"
        )
    return [dict(t) for t in tools]


def _check_messages(messages: Any, where: str, field: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f'{where}: {field!r} must be a non-empty list of {{"role": ..., "content": ...}} '
            f"objects, got {messages!r:.80}"
        )
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not all(
            isinstance(message.get(k), str) for k in ("role", "content")
        ):
            raise ValueError(
                f"{where}: {field}[{i}] must be an object with string 'role' and 'content', "
                f"got {message!r:.80}"
            )


def check_preference_record(record: Any, where: str) -> None:
    """Raise ``ValueError("<where>: ...")`` unless ``record`` is a valid preference record.

    Text: non-empty strings ``prompt``, ``chosen``, ``rejected`` (chosen != rejected).
    Conversational (TRL's format): ``prompt`` a list of chat messages, ``chosen`` and
    ``rejected`` each a list of messages ending with an assistant turn (or a string: the
    assistant's reply). Either way ``margin``, if present and not null, is a finite number.
    """
    record = require_object(record, where, _PREFERENCE_FIELDS)
    if isinstance(record.get("prompt"), list):
        _check_messages(record["prompt"], where, "prompt")
        for key in ("chosen", "rejected"):
            answer = record.get(key)
            if isinstance(answer, str):
                require_text(record, key, where, _PREFERENCE_FIELDS)
                continue
            _check_messages(answer, where, key)
            if answer[-1]["role"] != "assistant" or not answer[-1]["content"].strip():
                raise ValueError(
                    f"{where}: {key!r} must end with a non-empty assistant turn (the answer "
                    "the reward model scores)"
                )
    else:
        for key in ("prompt", "chosen", "rejected"):
            require_text(record, key, where, _PREFERENCE_FIELDS)
    if record["chosen"] == record["rejected"]:
        raise ValueError(
            f"{where}: 'chosen' and 'rejected' are the same text, so the pair prefers nothing; "
            "drop it"
        )
    margin = record.get("margin")
    if margin is not None and (
        isinstance(margin, bool)
        or not isinstance(margin, (int, float))
        or not np.isfinite(float(margin))
    ):
        raise ValueError(f"{where}: 'margin' must be a finite number or null, got {margin!r}")


# --------------------------------------------------------------------------- loading


def check_jsonl_file(path: str | Path, check: RecordCheck) -> int:
    """Check every line of a JSON Lines file with ``check``; return the number of records.

    Blank lines are skipped (as the ``datasets`` JSON reader skips them).

    Raises:
        FileNotFoundError: no such file.
        ValueError: ``"<path>:<line>: ..."`` for a line that is not UTF-8, not valid JSON, or
            fails ``check``; ``"<path>: ..."`` when the file holds no record.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist (or is not a file)")
    count = 0
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{where}: not UTF-8 text ({err.reason}); save as UTF-8") from err
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{where}: not valid JSON ({err.msg} at column {err.colno}); each line must "
                    "be one JSON object"
                ) from err
            check(record, where)
            count += 1
    if count == 0:
        raise ValueError(f"{path}: the file holds no records; write one JSON object per line")
    return count


def load_records(
    source: str | Path, check: RecordCheck, *, split: str = "train"
) -> datasets.Dataset:
    """Load a local JSONL file or a Hub dataset through ``datasets``, every record checked.

    Args:
        source: a local JSON Lines file, or a Hugging Face Hub dataset name ("owner/name").
        check: the record check (:func:`check_sft_record`, :func:`check_preference_record`).
        split: the split of a Hub dataset (a local file is read as its one "train" split).

    Raises:
        FileNotFoundError: a path that does not exist, or a Hub name that cannot be fetched.
        ValueError: a malformed record, named by ``<file>:<line>`` (local) or
            ``<name>[<split>] row <i>`` (Hub).
    """
    import datasets

    text = str(source)
    path = Path(text).expanduser()
    if path.exists():
        if path.is_dir():
            raise FileNotFoundError(f"{path} is a directory; pass a JSONL file (one JSON per line)")
        check_jsonl_file(path, check)
        return datasets.load_dataset("json", data_files=str(path), split="train")
    looks_local = path.suffix in _LOCAL_SUFFIXES or text.startswith((".", "/", "~"))
    if looks_local or not _HUB_ID.match(text):
        raise FileNotFoundError(f"data file {text} does not exist")
    try:
        dataset = datasets.load_dataset(text, split=split)
    except OSError as err:  # offline, unknown or gated repository: all OSErrors in datasets
        first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise FileNotFoundError(
            f"{text} is not a local file and the Hugging Face Hub could not provide it "
            f"({type(err).__name__}: {first_line}); check the path, or load the dataset while "
            "online (it is then read from the datasets cache)"
        ) from err
    for i, record in enumerate(dataset):
        check(record, f"{text}[{split}] row {i}")
    if len(dataset) == 0:
        raise ValueError(f"{text}[{split}] holds no records")
    return dataset


def load_sft_data(source: str | Path, *, split: str = "train") -> datasets.Dataset:
    """SFT records (prompt/completion, optionally system, or messages) from a JSONL file or a Hub
    dataset; see :func:`load_records` and :func:`check_sft_record`."""
    return load_records(source, check_sft_record, split=split)


def load_preference_data(source: str | Path, *, split: str = "train") -> datasets.Dataset:
    """Preference records (prompt, chosen, rejected, optional margin) from a JSONL file or a Hub
    dataset; see :func:`load_records` and :func:`check_preference_record`."""
    return load_records(source, check_preference_record, split=split)


def train_eval_split(
    records: Iterable[Mapping[str, Any]], eval_fraction: float, seed: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Split records into (train, held-out) with a seeded permutation.

    ``round(n * eval_fraction)`` records (at least one when ``eval_fraction > 0``) are held out;
    both parts keep the records' original order. ``eval_fraction == 0`` holds out nothing.

    Raises:
        ValueError: ``eval_fraction`` outside [0, 1), or too few records to leave both parts
            non-empty.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    rows = [dict(r) for r in records]  # iterating is much faster than indexing a Dataset
    n = len(rows)
    n_eval = max(1, round(n * eval_fraction)) if eval_fraction > 0 else 0
    if n_eval >= n:
        raise ValueError(
            f"cannot hold out {n_eval} of {n} records and still train: give more data, lower "
            "eval_fraction, or set it to 0"
        )
    held_out = set(np.random.default_rng(seed).permutation(n)[:n_eval].tolist())
    train = [row for i, row in enumerate(rows) if i not in held_out]
    evaluation = [rows[i] for i in sorted(held_out)]
    return train, evaluation
