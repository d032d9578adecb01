"""Phase 3's scores, from whatever a run scores with, decided once when the trainer is built.

A run's scores come from a reward model, a reward function, several rewards (``reward_funcs``,
built-ins included), its environments' ``get_reward()``, or a trainer subclass's
``compute_scores``. :class:`Scorer` holds that choice, so that nothing asks it again during the
run: what the scores are called in error messages, what a resume compares, whether they are the
reward model's pass (which the rollout may run beside the reference's), and the checks a run
makes of its prompts and rewards before any generation.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from typing import Any, Callable, cast

import mlx.core as mx
import numpy as np

from config.ppo_config import PPOConfig, RewardSpec, is_reward_function_spec
from ppo_trainer.prompt_records import (
    COMPLETION_IDS,
    LOG_EXTRA,
    LOG_METRIC,
    Columns,
    ExtraColumns,
    columns_for,
)
from ppo_trainer.rewards import Rewards
from ppo_trainer.rollout import Scored, check_scores, split_scores
from training.fingerprints import model_fingerprint


def describe_reward_spec(spec: RewardSpec) -> str:
    """A ``reward_funcs`` entry as a resume compares it: a function's name or path with its
    parameters, or a reward model's folder with its fingerprint."""
    if isinstance(spec, dict):
        return json.dumps(spec, sort_keys=True, default=str)
    if is_reward_function_spec(spec):
        return spec
    return f"{spec} ({model_fingerprint(spec)})"


def reward_description(config: PPOConfig, rewards: Rewards, owner: type | None) -> str | None:
    """What scores the responses, as a resume compares it: the overriding method of ``owner``
    (a trainer class), the function's import path, the ``reward_funcs``, or the reward model's
    folder and fingerprint (None: a reward model passed as an object, or environments only)."""
    if owner is not None:
        return f"{owner.__module__}.{owner.__qualname__}.compute_scores"
    fn = rewards.fn
    if fn is not None:
        return f"function {getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', fn)}"
    if config.reward_funcs:
        return "reward_funcs " + ", ".join(describe_reward_spec(s) for s in config.reward_funcs)
    name = config.reward_model_name
    return f"reward model {name} ({model_fingerprint(name)})" if name else None


@dataclass(frozen=True)
class Scorer:
    """A run's score function and what the run needs to know of it.

    Attributes:
        rewards: the run's reward model, function or functions (any may be unset when
            ``owner`` overrides ``compute_scores`` or the environments score).
        compute_scores: the trainer's ``compute_scores`` (bound): the default one scores with
            ``rewards``; a subclass's is the task's own.
        owner: the trainer class whose ``compute_scores`` overrides the default; None when
            the default scores.
        description: what a resume compares (:func:`reward_description`).
    """

    rewards: Rewards
    compute_scores: Callable[..., Any]
    owner: type | None
    description: str | None

    @classmethod
    def build(
        cls,
        config: PPOConfig,
        rewards: Rewards,
        compute_scores: Callable[..., Any],
        owner: type | None,
    ) -> Scorer:
        """The scorer of a trainer built with ``config`` and ``rewards``; ``owner``: the
        trainer's class if it overrides ``compute_scores``, else None."""
        return cls(rewards, compute_scores, owner, reward_description(config, rewards, owner))

    @property
    def source(self) -> str:
        """What computes the scores, named in error messages."""
        if self.owner is not None:
            return f"{self.owner.__name__}.compute_scores"
        return self.rewards.source

    @property
    def has_reward(self) -> bool:
        """Whether the run has a reward besides its environments' (a model, a function,
        several, or an overridden ``compute_scores``)."""
        r = self.rewards
        return self.owner is not None or r.model is not None or r.fn is not None or bool(r.funcs)

    @property
    def is_model_pass(self) -> bool:
        """Whether the scores are the reward model's pass, returned unevaluated (the rollout may
        run it beside the reference's): the default ``compute_scores`` with a reward model."""
        return self.owner is None and self.rewards.model is not None

    def check_columns(self, columns: Columns) -> None:
        """Raise ``ValueError`` before any generation if the reward needs a column that the
        prompts do not carry."""
        columns = {**columns, COMPLETION_IDS: [], LOG_EXTRA: [], LOG_METRIC: []}
        columns_for(self.compute_scores, columns, positional=4)
        self.rewards.check_columns(columns)

    def check_call(self, texts: list[str], columns: Columns) -> None:
        """Raise ``ValueError`` before any rollout when a reward function returns the wrong
        number of scores for ``texts`` with empty completions (:meth:`Rewards.check_call`).
        Not for an overridden ``compute_scores``: it reads the sequences, which do not exist
        yet."""
        if self.owner is None:
            self.rewards.check_call(texts, columns)

    def score(
        self,
        texts: list[str],
        prompt_ids: list[list[int]],
        columns: Columns,
        completions: list[str],
        query_responses: mx.array,
        sequence_lengths: mx.array,
        environment_scores: mx.array | None = None,
    ) -> Any:
        """The scores of ``completions`` as :class:`~ppo_trainer.rollout.Scored`: what
        ``compute_scores`` returns (the scores, or the pair ``(scores, metrics)``) and what the
        rewards logged per completion. Each completion's token ids are given as the column
        ``completion_ids``, and ``log_extra`` (an :class:`ExtraColumns`) collects the logged
        columns. ``environment_scores`` (B,): agents' episodes' ``get_reward()`` floats, added
        to the reward's scores, or the scores when the run has no other reward."""
        if environment_scores is not None and not self.has_reward:
            return environment_scores
        # Each completion's ids, stop token included: prompt_ids[i] ends where it starts.
        rows = np.asarray(query_responses).tolist()
        ends = np.asarray(sequence_lengths).tolist()
        ids = [row[len(p) : end] for row, p, end in zip(rows, prompt_ids, ends)]
        extra = ExtraColumns(len(completions))
        all_columns: Columns = {
            **columns,
            COMPLETION_IDS: ids,
            LOG_EXTRA: cast(Any, extra),
            LOG_METRIC: cast(Any, extra.metric),
        }
        out = self.compute_scores(
            texts,
            completions,
            query_responses,
            sequence_lengths,
            **columns_for(self.compute_scores, all_columns, positional=4),
        )
        if environment_scores is None and not extra.metrics:
            return Scored(out, extra.columns)
        raw, metrics = split_scores(out, self.source)
        metrics = {**metrics, **{k: mx.array(v) for k, v in extra.metric_means().items()}}
        if environment_scores is None:
            return Scored((raw, metrics), extra.columns)
        base = check_scores(raw, len(completions), self.source)
        return Scored((base + environment_scores, metrics), extra.columns)

    def warn_without_metrics(self, reward_metrics: dict[str, mx.array]) -> None:
        """Warn when a run of several ``reward_funcs`` gets no per-reward metrics (an
        overridden ``compute_scores`` that dropped them)."""
        if self.rewards.funcs and not reward_metrics:
            warnings.warn(
                f"{self.source} returned no metrics, so the per-reward metrics of "
                "reward_funcs are not logged: return (scores, metrics) with the metrics of "
                "PPOTrainer.compute_scores",
                stacklevel=3,
            )
