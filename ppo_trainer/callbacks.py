"""Callbacks of a PPO run: the one callback type of every stage, :class:`TrainerCallback`
(:mod:`training.callbacks`), under the name PPO's users import it by."""

from __future__ import annotations

from training.callbacks import (
    CallbackLike,
    EpochEndFunction,
    Metrics,
    TrainerCallback,
    as_callbacks,
)

__all__ = ["CallbackLike", "EpochEndFunction", "Metrics", "TrainerCallback", "as_callbacks"]
