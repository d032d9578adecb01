"""Prompts that carry their dataset record through to the reward.

A prompt given to :class:`ppo_trainer.ppo_trainer.PPOTrainer` (``train``, ``step``,
``evaluate``) is plain text, chat messages, or a *record*: a mapping with a ``"prompt"`` (text or
chat messages) and any other fields (a reference summary, unit tests, ...). The record's fields
reach the reward as *columns*, as dataset columns reach reward functions in TRL's
``GRPOTrainer``: a reward function is called ``fn(prompts, completions, **columns)``, where
``prompts`` are the formatted prompt texts the policy continued and each column is a list aligned
with the completions (a prompt's entry repeated ``group_size`` times, like the prompt). The
``"prompt"`` column holds the prompts as given (before :meth:`PPOTrainer.format_prompt`), so
even plain prompts have one.

A reward function is called by keyword, as TRL calls one (:func:`reward_arguments`):
``fn(prompts=..., completions=..., completion_ids=..., **columns)``, each argument passed if the
function names it (all of them if it takes ``**kwargs``), so both ``fn(completions, **kwargs)``
and ``fn(prompts, completions, answer)`` work. A function that names no ``completions`` parameter
(``lambda p, c: ...``) is called the classic way, ``fn(prompts, completions, **columns)`` with the
columns it names (:func:`columns_for`). A parameter without a default that nothing fills is an
error raised before any generation. :meth:`PPOTrainer.compute_scores` and its overrides are called by the same rule after
their four positional arguments.

::

    def passed(prompts, completions, tests):  # records {"prompt": stub, "tests": [...]}
        return [run_tests(c, t) for c, t in zip(completions, tests)]
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, Sequence, Union

PROMPT_KEY = "prompt"
"""The record field that holds the prompt itself."""

COMPLETION_IDS = "completion_ids"
"""The column the trainer adds for the reward: each completion's token ids (the stop token
included, no padding), as TRL passes ``completion_ids``."""

LOG_EXTRA = "log_extra"
"""The argument the trainer adds for the reward, as TRL's ``GRPOTrainer`` does:
``log_extra(column, values)`` records one value per completion beside the scores (a judge's
prompt and verdict), in the rollout records' ``details`` (:class:`ExtraColumns`)."""

LOG_METRIC = "log_metric"
"""The other argument TRL adds: ``log_metric(name, value)`` logs a scalar of the step beside its
metrics (values logged more than once in a step are averaged), under ``name`` as given."""

RESERVED_COLUMNS = frozenset(
    {
        "prompts",
        "completions",
        "query_responses",
        "sequence_lengths",
        COMPLETION_IDS,
        LOG_EXTRA,
        LOG_METRIC,
    }
)
"""Names of the arguments of rewards and ``compute_scores``: not usable as record fields."""

Prompt = Union[str, list[dict[str, str]]]
"""A prompt: plain text, or chat messages ``[{"role": ..., "content": ...}, ...]``."""

PromptRecord = Mapping[str, Any]
"""A dataset row: ``{"prompt": Prompt, <column>: value, ...}``."""

PromptInput = Union[Prompt, PromptRecord]
"""What the trainer accepts per prompt: a :data:`Prompt` or a :data:`PromptRecord`."""

Columns = dict[str, list[Any]]
"""Column name -> one value per prompt (or per completion, after :func:`repeat_columns`)."""


def prompt_problem(prompt: Any) -> str | None:
    """What is wrong with ``prompt`` as a :data:`Prompt` (text, or chat messages each a
    mapping with a text ``"role"`` and ``"content"``), or None when it is one."""
    if isinstance(prompt, str):
        return None
    if not isinstance(prompt, list):
        return (
            f"is {type(prompt).__name__} {prompt!r:.40}: a prompt must be text, chat messages "
            '[{"role": ..., "content": ...}, ...], or a record {"prompt": ..., <column>: ...}'
        )
    if not prompt:
        return "is an empty list of chat messages"
    for k, message in enumerate(prompt):
        if not isinstance(message, Mapping):
            return f'has message {k} of type {type(message).__name__}, not {{"role", "content"}}'
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                found = "no" if key not in message else f"a {type(message[key]).__name__}"
                return f"has message {k} with {found} {key!r}: every message needs text there"
    return None


def prompt_record(record: Any, where: str) -> PromptInput:
    """A dataset row as a prompt: its ``"prompt"`` (text or chat messages), else its chat
    ``"messages"``, with its other fields as the record's columns (a bare prompt when it has
    none). How the command line reads JSONL and Hub rows, and ``GRPOTrainer`` a
    ``train_dataset``'s.

    Raises:
        ValueError: ``where`` and what is wrong: no ``"prompt"`` or ``"messages"``, or a
            prompt that is not text or chat messages (:func:`prompt_problem`).
    """
    if isinstance(record, Mapping) and PROMPT_KEY in record:
        key = PROMPT_KEY
    elif isinstance(record, Mapping) and isinstance(record.get("messages"), list):
        key = "messages"
    else:
        found = f"the fields {sorted(record)}" if isinstance(record, Mapping) else repr(record)
        raise ValueError(
            f"{where}: expected an object with 'prompt' (text or chat messages) or 'messages' "
            f"(chat messages), got {found:.200}"
        )
    prompt = record[key]
    problem = prompt_problem(prompt)
    if problem is not None:
        raise ValueError(f"{where}: {key!r} {problem}")
    columns = {k: v for k, v in record.items() if k != key}
    return {PROMPT_KEY: prompt, **columns} if columns else prompt


def split_records(items: Sequence[PromptInput]) -> tuple[list[Prompt], Columns]:
    """The prompts of ``items`` and their columns, aligned with them: ``"prompt"`` (the prompts
    themselves) and every other field of the records.

    Raises:
        ValueError: a prompt that is not text or chat messages (:func:`prompt_problem`), a
            record without ``"prompt"``, records with different fields (or plain
            prompts mixed with records that have other fields), or a field named like a
            positional argument of the reward (:data:`RESERVED_COLUMNS`).
    """
    rows: list[Mapping[str, Any]] = []
    for i, item in enumerate(items):
        given = item if not isinstance(item, Mapping) else item.get(PROMPT_KEY, "")
        problem = prompt_problem(given)
        if problem is not None:
            raise ValueError(f"prompt {i} {problem}")
        if not isinstance(item, Mapping):
            rows.append({PROMPT_KEY: item})
        elif PROMPT_KEY not in item:
            raise ValueError(
                f"prompt record {i} has no {PROMPT_KEY!r} field (it has {sorted(item)}): give "
                f"each record the text or chat messages to continue under {PROMPT_KEY!r}; its "
                "other fields reach the reward as columns"
            )
        else:
            rows.append(item)
    names = sorted(rows[0]) if rows else [PROMPT_KEY]
    for i, row in enumerate(rows):
        if sorted(row) != names:
            raise ValueError(
                f"prompt {i} has the fields {sorted(row)} but prompt 0 has {names}: give every "
                "prompt record the same fields"
            )
    reserved = sorted(RESERVED_COLUMNS.intersection(names))
    if reserved:
        raise ValueError(
            f"the prompt records have fields named {reserved}, which the reward receives from "
            "the trainer: rename those fields"
        )
    columns = {name: [row[name] for row in rows] for name in names}
    return list(columns[PROMPT_KEY]), columns


def repeat_columns(columns: Mapping[str, list[Any]], times: int) -> Columns:
    """Each entry repeated ``times`` times in place (prompt ``i``'s value at ``i * times`` to
    ``(i + 1) * times - 1``), as the trainer repeats a prompt for its ``group_size`` samples."""
    return {k: [v for v in values for _ in range(times)] for k, values in columns.items()}


def slice_columns(columns: Mapping[str, list[Any]], start: int, stop: int) -> Columns:
    """Entries ``start:stop`` of every column (a rank's share, an evaluation chunk)."""
    return {k: list(values[start:stop]) for k, values in columns.items()}


def columns_for(
    fn: Callable[..., Any], columns: Mapping[str, list[Any]], *, positional: int
) -> Columns:
    """The columns to pass to ``fn`` as keyword arguments, after its first ``positional``
    arguments: every column if it takes ``**kwargs``, else those it names as parameters.

    Raises:
        ValueError: ``fn`` takes fewer than ``positional`` positional arguments, or has a
            parameter without a default (after the positional ones) that no column fills.
    """
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (ValueError, TypeError):
        # Some builtins have no inspectable signature: call them the classic way.
        return {}
    takes = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(takes) < positional and not any(p.kind is p.VAR_POSITIONAL for p in params):
        name = getattr(fn, "__qualname__", repr(fn))
        raise ValueError(
            f"{name}{inspect.signature(fn)} takes {len(takes)} positional argument(s) but is "
            f"called with {positional}: a reward function is fn(prompts, completions, "
            "**columns) -> list[float]"
        )
    rest = params
    for _ in range(positional):
        if not rest or rest[0].kind not in (rest[0].POSITIONAL_ONLY, rest[0].POSITIONAL_OR_KEYWORD):
            break
        rest = rest[1:]
    if any(p.kind is p.VAR_KEYWORD for p in rest):
        return dict(columns)
    named = [p for p in rest if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    missing = [
        p.name
        for p in rest
        if p.default is p.empty
        and p.kind is not p.VAR_POSITIONAL
        and (p.kind is p.POSITIONAL_ONLY or p.name not in columns)
    ]
    if missing:
        name = getattr(fn, "__qualname__", repr(fn))
        raise ValueError(
            f"{name} needs the column(s) {missing}, but the prompts carry "
            f"{sorted(columns) or 'no columns'}: pass prompt records "
            f'{{"{PROMPT_KEY}": ..., "{missing[0]}": ...}} or give the parameter a default'
        )
    return {p.name: columns[p.name] for p in named if p.name in columns}


def missing_parameters(
    params: Sequence[inspect.Parameter], available: Mapping[str, Any]
) -> list[str]:
    """The parameters a call by keyword with ``available`` leaves unset: those without a
    default that are positional-only or not among ``available`` (``*args`` and ``**kwargs``
    aside)."""
    return [
        p.name
        for p in params
        if p.default is p.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        and (p.kind is p.POSITIONAL_ONLY or p.name not in available)
    ]


def reward_arguments(
    fn: Callable[..., Any],
    prompts: list[str],
    completions: list[str],
    columns: Mapping[str, list[Any]],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` to call the reward function ``fn`` with: by keyword, as TRL's trainers
    call reward functions, when ``fn`` names a ``completions`` parameter or takes only
    ``**kwargs`` (``prompts``, ``completions`` and every column, ``completion_ids`` included,
    each passed if named, all with ``**kwargs``); otherwise the classic positional call
    ``fn(prompts, completions, **columns_for(fn, columns, positional=2))``.

    Raises:
        ValueError: ``fn`` has a required parameter that nothing fills (a column the prompts do
            not carry), so a wrong signature fails before any generation.
    """
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (ValueError, TypeError):
        # Some builtins have no inspectable signature: call them the classic way.
        return (prompts, completions), {}
    named = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    var_keyword = any(p.kind is p.VAR_KEYWORD for p in params)
    only_kwargs = var_keyword and all(p.kind is p.VAR_KEYWORD for p in params)
    if "completions" not in named and not only_kwargs:
        return (prompts, completions), columns_for(fn, columns, positional=2)
    available = {"prompts": prompts, "completions": completions, **columns}
    missing = missing_parameters(params, available)
    if missing:
        name = getattr(fn, "__qualname__", repr(fn))
        raise ValueError(
            f"{name} needs the column(s) {missing}, but a reward function receives prompts, "
            f"completions and the columns {sorted(columns)}: pass prompt records "
            f'{{"{PROMPT_KEY}": ..., "{missing[0]}": ...}} or give the parameter a default'
        )
    if var_keyword:
        return (), dict(available)
    return (), {name: value for name, value in available.items() if name in named}


def check_reward_function(fn: Callable[..., Any], column_names: Sequence[str]) -> None:
    """Raise ``ValueError`` now (before any model loads or generates) if the reward function
    ``fn`` cannot be called with the prompts' columns ``column_names`` (plus
    ``completion_ids`` and ``log_extra``), by :func:`reward_arguments`'s rule."""
    columns: dict[str, list[Any]] = {name: [] for name in column_names}
    columns[COMPLETION_IDS] = []
    columns[LOG_EXTRA] = []
    columns[LOG_METRIC] = []
    reward_arguments(fn, [], [], columns)


class ExtraColumns:
    """What the rewards of one scoring call logged with ``log_extra(column, values)`` (the
    object is that function: :meth:`log`): column
    name -> one value per completion (JSON-able: text, numbers, lists, dicts, None), in
    ``columns``; and with ``log_metric(name, value)`` (:meth:`metric`), scalars in ``metrics``.

    Raises (from :meth:`log`, :meth:`metric`):
        ValueError: a column without a name, or not one value per completion; a metric without
            a name, or whose value is not a number.
    """

    def __init__(self, count: int) -> None:
        self.count = count
        self.columns: dict[str, list[Any]] = {}
        self.metrics: dict[str, list[float]] = {}

    def metric(self, name: str, value: float) -> None:
        """``log_metric``: record the scalar ``value`` under ``name`` (TRL's name, unprefixed)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"log_metric needs a metric name, got {name!r}")
        try:
            number = float(value)
        except (TypeError, ValueError) as err:
            raise ValueError(f"log_metric({name!r}, ...) needs a number, got {value!r}") from err
        self.metrics.setdefault(name, []).append(number)

    def metric_means(self) -> dict[str, float]:
        """Each logged metric's mean over the values logged in this call."""
        return {name: sum(values) / len(values) for name, values in self.metrics.items()}

    def log(self, column: str, values: Sequence[Any]) -> None:
        """Record ``values`` (one per completion) as ``column``; a column logged again is
        replaced."""
        if not isinstance(column, str) or not column:
            raise ValueError(f"log_extra needs a column name, got {column!r}")
        values = list(values)
        if len(values) != self.count:
            raise ValueError(
                f"log_extra({column!r}, ...) got {len(values)} values for {self.count} "
                "completions: log one value per completion (None where there is none)"
            )
        self.columns[column] = values

    __call__ = log  # the trainer passes the object itself as ``log_extra``

    def prefixed(self, prefix: str) -> Callable[[str, Sequence[Any]], None]:
        """``log_extra`` for one reward: its columns are named ``<prefix>/<column>``."""
        return lambda column, values: self.log(f"{prefix}/{column}", values)
