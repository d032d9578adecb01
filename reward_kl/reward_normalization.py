"""Scores normalised by their running mean and standard deviation (OpenRLHF's
``normalize_reward``, TRL's ``use_score_norm``): PPO then learns the same way whatever the
reward's scale or offset (a reward of minus the word count, around -20, would otherwise leave a
value model that starts near 0 far behind the returns for many steps).

The running statistics cover every score seen so far (all ranks of a data-parallel run), updated
with each batch before it is normalised; they are part of a checkpoint, so a resumed run
normalises as the uninterrupted one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping

import mlx.core as mx
import numpy as np

from base_setup.distributed import Group, all_sum


@dataclass(frozen=True)
class RunningMoments:
    """Count, mean and (population) variance of every score seen so far."""

    count: float = 0.0
    mean: float = 0.0
    var: float = 0.0

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunningMoments:
        return cls(float(data["count"]), float(data["mean"]), float(data["var"]))


def update_moments(
    moments: RunningMoments, scores: mx.array, group: Group | None = None
) -> RunningMoments:
    """``moments`` combined with the batch ``scores`` (B,) (over every rank of ``group``), by the
    parallel formula of Chan et al.: with batch count ``n``, mean ``m``, variance ``v``,

        total = c + n;  delta = m - mean
        mean' = mean + delta * n / total
        var'  = (var * c + v * n + delta**2 * c * n / total) / total

    which equals the mean and population variance of all the scores at once."""
    values = scores.astype(mx.float32).reshape(-1)
    local = mx.stack([mx.array(float(values.size)), values.sum()])
    totals = local if group is None else all_sum(local, group)
    n, total_sum = (float(x) for x in np.asarray(totals))
    if n == 0:
        return moments
    batch_mean = total_sum / n
    squares = mx.square(values - batch_mean).sum()  # two passes, as masked_var does
    squares = squares if group is None else all_sum(squares, group)
    batch_var = float(np.asarray(squares)) / n
    total = moments.count + n
    delta = batch_mean - moments.mean
    mean = moments.mean + delta * n / total
    var = (
        moments.var * moments.count + batch_var * n + delta**2 * moments.count * n / total
    ) / total
    return RunningMoments(total, mean, var)


def normalize_scores(scores: mx.array, moments: RunningMoments, eps: float = 1e-8) -> mx.array:
    """``(scores - mean) / sqrt(var + eps)`` with the running ``moments``, (B,) -> (B,)."""
    return (scores - moments.mean) / math.sqrt(moments.var + eps)
