"""What the exact-resume tests compare: a run's logged metrics without its timings, and the
trainable weights of two trainers' models, array for array."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, cast

import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

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
