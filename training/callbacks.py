"""The one callback type of every stage's loop (:mod:`training.loop`): a class with no-op hooks,
and plain ``on_epoch_end(epoch, metrics)`` functions.

Each hook receives the trainer that runs it (a :class:`~ppo_trainer.ppo_trainer.PPOTrainer`, or
a fine-tuning stage's :class:`~finetune.supervised_trainer.SupervisedTrainer`), typed ``Any``
here so that this module imports no trainer; a callback may annotate it. The RL hooks
(:meth:`TrainerCallback.on_rollout_scored`, :meth:`TrainerCallback.on_rollout_end`) fire in RL
stages only: a supervised stage has no rollouts."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence, Union

if TYPE_CHECKING:
    from experience_buffer.buffer import RolloutBatch

Metrics = dict[str, float]
EpochEndFunction = Callable[[int, Metrics], Any]


class TrainerCallback:
    """Override the hooks you need; every default does nothing. A hook may call
    ``trainer.request_stop()`` to stop early (the run saves a checkpoint and can be resumed).

    ``step`` counts optimiser steps (RL: iterations) from 1; ``epoch`` counts passes over the
    data (RL: the prompts) from 0.
    """

    def on_train_begin(self, trainer: Any) -> None:
        """Called once before the first step (after a resume has restored the state)."""

    def on_rollout_scored(self, trainer: Any, step: int, rollout: Any) -> None:
        """RL stages: called after generation, log-probs, values and scores of ``step`` (phases
        1-3) with the :class:`~ppo_trainer.rollout.Rollout`: the prompt texts, completions,
        token ids, log-probs, scores and the score function's ``reward_metrics`` (in a
        data-parallel run, this rank's share)."""

    def on_rollout_end(self, trainer: Any, step: int, batch: RolloutBatch) -> None:
        """RL stages: called after generation, scoring and advantages, before the PPO epochs of
        ``step``."""

    def on_step_end(self, trainer: Any, step: int, metrics: Metrics) -> None:
        """Called after each step with its metrics (and the evaluation's, if one was due)."""

    def on_epoch_end(self, trainer: Any, epoch: int, metrics: Metrics) -> None:
        """Called after each pass over the data with the epoch's mean metrics."""

    def on_evaluate(self, trainer: Any, step: int, metrics: Metrics) -> None:
        """Called after each evaluation on the held-out data (``eval/...`` metrics)."""

    def on_save(self, trainer: Any, step: int, path: Path) -> None:
        """Called after a checkpoint has been written (atomically) to ``path``."""

    def on_train_end(self, trainer: Any, history: list[Metrics]) -> None:
        """Called once at the end of ``train`` (also after a stop that saved a checkpoint)."""


class _EpochEndFunction(TrainerCallback):
    """Adapts a plain ``fn(epoch, metrics)`` to the callback interface."""

    def __init__(self, fn: EpochEndFunction) -> None:
        self.fn = fn

    def on_epoch_end(self, trainer: Any, epoch: int, metrics: Metrics) -> None:
        self.fn(epoch, metrics)


CallbackLike = Union[TrainerCallback, EpochEndFunction]


def as_callbacks(callbacks: Sequence[CallbackLike] | None) -> list[TrainerCallback]:
    """Normalise a user's list: callback objects stay, plain functions become epoch-end hooks."""
    result: list[TrainerCallback] = []
    for cb in callbacks or []:
        if isinstance(cb, TrainerCallback):
            result.append(cb)
        elif callable(cb):
            result.append(_EpochEndFunction(cb))
        else:
            raise ValueError(
                f"callback {cb!r} is neither a TrainerCallback nor a function "
                "on_epoch_end(epoch, metrics)"
            )
    return result
