"""TRL's data shapes at the trainer's edges: a ``train_dataset`` as prompt records, and a reward
function called with what TRL's ``GRPOTrainer`` passes it.

TRL calls a reward function ``fn(prompts=..., completions=..., completion_ids=...,
trainer_state=..., **columns)``, with every dataset column but ``prompt``. For a *standard*
dataset (text prompts) ``prompts`` and ``completions`` are text; for a *conversational* one
(prompts are chat messages) ``prompts`` are the message lists as given and each completion is
one assistant message, ``[{"role": "assistant", "content": text}]``, so that TRL's documented
rewards read ``completion[0]["content"]``. :func:`trl_reward` wraps a function to be called so.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ppo_trainer.prompt_records import (
    COMPLETION_IDS,
    PROMPT_KEY,
    PromptInput,
    missing_parameters,
    prompt_record,
)


def dataset_records(dataset: Iterable[Any], name: str = "train_dataset") -> list[PromptInput]:
    """The rows of ``dataset`` as prompts: a ``datasets.Dataset`` (any iterable of rows) or a
    list of records ``{"prompt": text or messages, <column>: ...}`` or ``{"messages": [...],
    <column>: ...}`` (:func:`ppo_trainer.prompt_records.prompt_record`), or of bare prompts.

    Raises:
        ValueError: a row without ``prompt`` or ``messages``, or with a malformed prompt,
            naming the row; an empty dataset.
    """
    rows: list[PromptInput] = []
    for i, row in enumerate(dataset):
        rows.append(prompt_record(row, f"{name} row {i}") if isinstance(row, Mapping) else row)
    if not rows:
        raise ValueError(f"{name} is empty: give it at least one prompt")
    return rows


@dataclass(frozen=True)
class TrainerState:
    """What TRL's ``trainer_state`` argument of a reward holds that a reward reads
    (``transformers.TrainerState``'s names).

    Attributes:
        global_step: optimiser iterations done (the step being scored is ``global_step + 1``).
        max_steps: the run's last step (0 before ``train()`` starts one).
        epoch: passes over the prompts done.
    """

    global_step: int
    max_steps: int
    epoch: float


def trl_reward(
    fn: Callable[..., Any], state: Callable[[], TrainerState]
) -> Callable[..., list[float | None]]:
    """``fn`` as a reward of this trainer that calls it as TRL does (module doc): ``prompts``
    and ``completions`` in TRL's shapes (messages where the prompt is chat messages),
    ``completion_ids`` (also as ``completions_ids``, the spelling of TRL's documentation, when
    ``fn`` names it), ``trainer_state`` (``state()``) and every column but ``prompt``; each
    passed by keyword if ``fn`` names it, all with ``**kwargs`` (:func:`keyword_arguments`).
    An ``async def`` function is awaited (:func:`run_awaitable`).

    The wrapper keeps ``fn``'s name (its metrics' ``rewards/<name>/``) and, as ``__wrapped__``,
    its source (a resume compares it); its ``trainer_state`` attribute is ``state``.
    """

    def reward(prompts: list[str], completions: list[str], **columns: Any) -> list[float | None]:
        given = columns.get(PROMPT_KEY, prompts)  # the prompts as the dataset gave them
        conversational = any(isinstance(p, list) for p in given)
        if conversational:
            texts: list[Any] = [[{"role": "assistant", "content": c}] for c in completions]
        else:
            texts = list(completions)
        extra = {k: v for k, v in columns.items() if k != PROMPT_KEY}
        extra["trainer_state"] = reward.trainer_state()  # type: ignore[attr-defined]
        if "completions_ids" in _named(fn) and COMPLETION_IDS in extra:
            extra["completions_ids"] = extra[COMPLETION_IDS]
        available = {"prompts": list(given), "completions": texts, **extra}
        out = fn(**keyword_arguments(fn, available))
        if inspect.isawaitable(out):  # an async def reward (TRL's Example 5)
            out = run_awaitable(out)
        return list(out)

    reward.__name__ = getattr(fn, "__name__", "reward")
    reward.__qualname__ = getattr(fn, "__qualname__", reward.__name__)
    reward.__doc__ = fn.__doc__
    # Its own signature for the keyword call (inspect.signature would follow __wrapped__).
    reward.__signature__ = inspect.signature(reward)  # type: ignore[attr-defined]
    reward.__wrapped__ = fn  # type: ignore[attr-defined]
    # Where trainer_state comes from; a trainer built later with the same function sets it.
    reward.trainer_state = state  # type: ignore[attr-defined]
    return reward


def run_awaitable(awaitable: Awaitable[Any]) -> Any:
    """The result of ``awaitable``, run to completion on an event loop of its own in a helper
    thread (so it also works where a loop already runs, as in a notebook)."""

    async def wait() -> Any:
        return await awaitable

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, wait()).result()


def keyword_arguments(fn: Callable[..., Any], available: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments TRL would call ``fn`` with: all of ``available`` if ``fn`` takes
    ``**kwargs``, else those it names.

    Raises:
        ValueError: ``fn`` has a required parameter that nothing fills, or one that can only
            be passed by position.
    """
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no inspectable signature: pass everything
        return dict(available)
    missing = missing_parameters(params, available)
    if missing:
        name = getattr(fn, "__qualname__", repr(fn))
        raise ValueError(
            f"the reward {name} needs {missing}, but TRL's call passes it "
            f"{sorted(available)} (prompts, completions, completion_ids, trainer_state and "
            "the dataset's columns but prompt): add the column to the dataset or give the "
            "parameter a default"
        )
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return dict(available)
    return {p.name: available[p.name] for p in params if p.name in available}


def _named(fn: Callable[..., Any]) -> set[str]:
    """The parameter names of ``fn`` (none when it has no inspectable signature)."""
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature
        return set()
