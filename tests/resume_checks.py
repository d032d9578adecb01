"""What the exact-resume tests compare: a run's logged metrics without its timings, and the
trainable weights of two trainers' models, array for array; a callback that stops a run after a
given step, and the whole straight-against-resumed comparison of a PPO run."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ppo_trainer.callbacks import TrainerCallback
from ppo_trainer.ppo_trainer import PPOTrainer

#: Metric keys that measure time, so differ between a straight and a resumed run.
TIMING_KEYS = ("time/", "tokens_per_second")


def without_timings(history: Sequence[dict[str, float]]) -> list[dict[str, float]]:
    """The history's per-step metrics without the keys of :data:`TIMING_KEYS`."""
    return [{k: v for k, v in h.items() if not k.startswith(TIMING_KEYS)} for h in history]


def trainable_arrays(model: nn.Module) -> dict[str, np.ndarray]:
    """The model's trainable parameters as numpy arrays, by their dotted names."""
    flat = cast(list[tuple[str, Any]], tree_flatten(model.trainable_parameters()))
    return {k: np.array(v) for k, v in flat}


def assert_same_trainables(pairs: Iterable[tuple[Any, Any]]) -> None:
    """Each pair of models holds the same trainable parameters, bit for bit."""
    for a, b in pairs:
        wa, wb = trainable_arrays(a), trainable_arrays(b)
        assert wa.keys() == wb.keys()
        for key in wa:
            np.testing.assert_array_equal(wa[key], wb[key], err_msg=key)


class StopAt(TrainerCallback):
    """Asks the trainer to stop after optimiser step ``step`` (it saves a checkpoint there)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer: PPOTrainer, step: int, metrics: dict[str, float]) -> None:
        if step == self.step:
            trainer.request_stop()


def assert_resume_equals_straight(
    trainer_in: Callable[[str], PPOTrainer], prompts: Sequence[Any], num_epochs: int = 2
) -> None:
    """A run of ``trainer_in("a")`` straight through ``num_epochs`` (``prompts`` make one step
    an epoch), and one of ``trainer_in("b")`` stopped after step 1 and resumed from its latest
    checkpoint by a new trainer, log the same metrics (timings aside) and end with the same
    trainable weights of the policy and (with PPO) the value model, bit for bit."""
    straight = trainer_in("a")
    straight_history = straight.train(prompts, num_epochs=num_epochs)
    trainer_in("b").train(prompts, num_epochs=num_epochs, callbacks=[StopAt(1)])
    second = trainer_in("b")
    resumed_history = second.train(prompts, num_epochs=num_epochs, resume_from="latest")

    assert len(straight_history) == num_epochs  # one step an epoch: stopped after the first
    assert without_timings(resumed_history) == without_timings(straight_history)
    pairs: list[tuple[Any, Any]] = [(straight.policy, second.policy)]
    if straight.value_model is not None or second.value_model is not None:
        assert straight.value_model is not None and second.value_model is not None
        pairs.append((straight.value_model, second.value_model))
    assert_same_trainables(pairs)
