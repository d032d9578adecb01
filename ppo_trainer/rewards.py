"""The run's reward, whichever kind it is: a reward model scoring token ids, a Python function
scoring texts (with the columns of prompt records it names), or several of either weighted
together (``reward_funcs`` + ``reward_weights``, TRL's GRPO)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
import numpy as np

from models.reward_model import RewardFunction, RewardModel
from ppo_trainer.components import NamedReward
from ppo_trainer.prompt_records import (
    COMPLETION_IDS,
    LOG_EXTRA,
    LOG_METRIC,
    Columns,
    ExtraColumns,
    check_reward_function,
    reward_arguments,
)
from ppo_trainer.rollout import check_scores
from reward_kl.combined_reward import combine_rewards, reward_matrix, reward_metrics
from rewards import check_reward_columns
from training.fingerprints import source_fingerprint


def _is_built_in(fn: Any) -> bool:
    """Whether ``fn`` is a reward of this package's registry (``rewards.builtin``)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__module__", None) == "rewards.builtin"


@dataclass
class Rewards:
    """A run's reward (exactly one of ``model``, ``fn``, ``funcs`` is set, or none when the
    trainer overrides ``compute_scores``).

    Attributes:
        model: a reward model.
        fn: a function ``(prompts, completions, **columns) -> list[float]``, called by keyword
            (:func:`ppo_trainer.prompt_records.reward_arguments`).
        funcs: several named rewards, summed with ``weights`` (None: 1 each).
    """

    model: RewardModel | None = None
    fn: RewardFunction | None = None
    funcs: list[NamedReward] = field(default_factory=list)
    weights: list[float] | None = None

    @property
    def source(self) -> str:
        """What computes the scores, for error messages."""
        if self.fn is not None:
            return f"the reward function {getattr(self.fn, '__qualname__', self.fn)}"
        if self.funcs:
            return "the combined reward_funcs"
        return "the reward model"

    def source_fingerprint(self) -> str | None:
        """The fingerprint of the source code of the reward functions a user gave (the
        registered built-ins are named, not fingerprinted), as a resume compares it
        (:func:`training.fingerprints.source_fingerprint`); None for none."""
        functions = [self.fn] if self.fn is not None else []
        functions += [fn for _, fn in self.funcs if not isinstance(fn, RewardModel)]
        user = [fn for fn in functions if not _is_built_in(fn)]
        return source_fingerprint(user)

    def score(
        self,
        prompts: list[str],
        completions: list[str],
        query_responses: mx.array,
        sequence_lengths: mx.array,
        columns: Columns,
    ) -> tuple[mx.array, dict[str, mx.array]]:
        """``(scores (B,), metrics)``: the reward of each completion and, for several rewards,
        each one's ``rewards/<name>/mean`` and ``/std`` (a function's None: not applicable).

        ``columns`` may hold the trainer's ``log_extra`` (an :class:`ExtraColumns`):
        each reward function then gets one that names its columns ``<reward name>/<column>``
        (a judge's ``judge/prompt``, ``judge/score`` ...)."""
        extra = columns.get(LOG_EXTRA)

        def for_reward(name: str) -> Columns:
            if not isinstance(extra, ExtraColumns):
                return {k: v for k, v in columns.items() if k not in (LOG_EXTRA, LOG_METRIC)}
            return {**columns, LOG_EXTRA: cast(Any, extra.prefixed(name))}

        if self.funcs:
            names = [name for name, _ in self.funcs]
            values: list[list[float | None]] = []
            for name, reward in self.funcs:
                if isinstance(reward, RewardModel):
                    scores = reward.score(query_responses, sequence_lengths)
                    values.append(np.asarray(scores).tolist())
                else:
                    cols = for_reward(name)
                    args, kwargs = reward_arguments(reward, prompts, completions, cols)
                    values.append(list(reward(*args, **kwargs)))
            matrix = reward_matrix(values, names, len(completions))  # (K, B)
            weights = self.weights or [1.0] * len(names)
            return combine_rewards(matrix, weights), reward_metrics(matrix, names)
        if self.model is not None:
            return self.model.score(query_responses, sequence_lengths), {}
        if self.fn is None:
            raise ValueError("no reward to score with: pass a reward model or function")
        cols = for_reward(str(getattr(self.fn, "__name__", "reward")))
        args, kwargs = reward_arguments(self.fn, prompts, completions, cols)
        out = self.fn(*args, **kwargs)
        return check_scores(out, len(completions), self.source), {}

    def check_call(self, prompts: list[str], columns: Columns) -> None:
        """Call each reward function once on ``prompts`` with empty completions, each column
        of ``columns`` aligned with them, and raise ``ValueError`` before any rollout when one
        does not return one score (or None) per completion. Only the count is checked: the
        values of empty completions mean nothing."""
        n = len(prompts)
        completions = [""] * n
        trial = ExtraColumns(n)  # what the trial call logs is dropped
        columns = {
            **columns,
            COMPLETION_IDS: [[] for _ in range(n)],
            LOG_EXTRA: cast(Any, trial),
            LOG_METRIC: cast(Any, trial.metric),
        }
        functions: list[tuple[str, Any]] = [] if self.fn is None else [("", self.fn)]
        functions += [(name, r) for name, r in self.funcs if not isinstance(r, RewardModel)]
        for name, function in functions:
            args, kwargs = reward_arguments(function, prompts, completions, columns)
            label = name or getattr(function, "__name__", repr(function))
            try:
                out = function(*args, **kwargs)
            except BaseException as error:  # re-raised, with what was being done
                error.add_note(
                    f"raised by the reward {label} in a trial call before training (the first "
                    f"prompt {n} times, empty completions): a rollout can produce an empty "
                    "completion, so a reward must score one"
                )
                raise
            count, what = _count(out)
            if count != n:
                raise ValueError(
                    f"the reward {label} returned {what} for {n} completions in a trial call "
                    f"before training (the first prompt {n} times, empty completions): it must "
                    f"return a list with one score (or None) per completion, {n} here"
                )

    def check_columns(self, columns: Columns) -> None:
        """Raise ``ValueError`` before any generation if a reward function needs a column that
        the prompts do not carry."""
        functions: list[Any] = [self.fn] if self.fn is not None else []
        functions += [r for _, r in self.funcs if not isinstance(r, RewardModel)]
        for function in functions:
            check_reward_function(function, list(columns))
            check_reward_columns(function, list(columns))


def _count(out: Any) -> tuple[int | None, str]:
    """How many scores a reward returned (None: not a sequence) and a description of it."""
    if isinstance(out, mx.array) or isinstance(out, np.ndarray):
        if out.ndim == 0:
            return None, f"a 0-d array ({out.item()!r})"
        return out.size, f"{out.size} scores"
    if isinstance(out, (list, tuple)):
        return len(out), f"{len(out)} scores"
    return None, f"{type(out).__name__} {out!r:.40}, not a list"
