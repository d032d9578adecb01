"""The rollout batch as one dataclass of arrays, and minibatch iteration over it."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Iterator, Sequence, TypeVar, cast

import mlx.core as mx
import numpy as np


@dataclass
class RolloutBatch:
    """Everything one PPO/GRPO iteration learns from. ``B`` sequences, ``L`` prompt+response
    positions, ``T`` response tokens.

    Every array was produced without gradients (generation, frozen models, or values computed before
    the update): in the losses they are constants.

    Attributes:
        query_responses: (B, L) int32, prompt then response then padding (right-padded).
        prompt_lengths: (B,) int32, number of prompt tokens in each row.
        responses: (B, T) int32, the response tokens, padded after the stop token.
        mask: (B, T) float32, 1 on action tokens (up to and including the stop token).
        logprobs: (B, T) float32, log-probs of the responses under the rollout policy.
        ref_logprobs: (B, T) float32, log-probs under the frozen reference model.
        scores: (B,) float32, sequence scores from the reward model or function (after penalties).
        advantages: (B, T) float32 for PPO (GAE, whitened), (B,) for GRPO (group-relative).
        values: (B, T) float32 value estimates at rollout time (PPO only).
        returns: (B, T) float32 GAE returns, the value targets (PPO only).
    """

    query_responses: mx.array
    prompt_lengths: mx.array
    responses: mx.array
    mask: mx.array
    logprobs: mx.array
    ref_logprobs: mx.array
    scores: mx.array
    advantages: mx.array
    values: mx.array | None = None
    returns: mx.array | None = None

    def __post_init__(self) -> None:
        batch = self.query_responses.shape[0]
        for field in fields(self):
            value = getattr(self, field.name)
            if value is not None and value.shape[0] != batch:
                raise ValueError(
                    f"RolloutBatch.{field.name} has {value.shape[0]} rows but query_responses "
                    f"has {batch}: every array must have one row per sequence"
                )
        if self.mask.shape != self.responses.shape or self.logprobs.shape != self.mask.shape:
            raise ValueError(
                f"responses {self.responses.shape}, mask {self.mask.shape} and logprobs "
                f"{self.logprobs.shape} must have the same (B, T) shape"
            )

    def __len__(self) -> int:
        return int(self.query_responses.shape[0])

    def __getitem__(self, rows: slice) -> RolloutBatch:
        """The rows of a slice (``batch[a:b]``), as a new batch."""
        start, stop, stride = rows.indices(len(self))
        return self.select(mx.arange(start, stop, stride))

    def select(self, indices: mx.array) -> RolloutBatch:
        """The rows ``indices`` (a 1-D int array) of every array, as a new batch."""
        return replace(
            self,
            **{
                f.name: getattr(self, f.name)[indices]
                for f in fields(self)
                if getattr(self, f.name) is not None
            },
        )


def minibatch_indices(
    num_rows: int, num_mini_batches: int, rng: np.random.Generator
) -> Iterator[mx.array]:
    """Shuffle ``range(num_rows)`` with ``rng`` and yield ``num_mini_batches`` equal index arrays.

    The permutation comes from the caller's generator so that a resumed run, which restores that
    generator's state, visits the same minibatches in the same order.
    """
    if num_mini_batches < 1 or num_rows % num_mini_batches:
        raise ValueError(
            f"{num_rows} rollout sequences do not split into {num_mini_batches} equal minibatches: "
            "choose num_mini_batches dividing batch_size * group_size"
        )
    size = num_rows // num_mini_batches
    order = rng.permutation(num_rows)
    for start in range(0, num_rows, size):
        yield mx.array(order[start : start + size].astype(np.int32))


def iterate_minibatches(
    batch: RolloutBatch, num_mini_batches: int, rng: np.random.Generator
) -> Iterator[RolloutBatch]:
    """Shuffled minibatches of ``batch`` (one pass): each row appears exactly once."""
    for indices in minibatch_indices(len(batch), num_mini_batches, rng):
        yield batch.select(indices)


SizedSliceable = TypeVar("SizedSliceable", bound="RolloutBatch | Sequence[Any]")


def split_micro_batches(batch: SizedSliceable, parts: int) -> list[SizedSliceable]:
    """``batch`` (a :class:`RolloutBatch` or a sequence of examples) cut into at most ``parts``
    contiguous, non-empty pieces of near-equal size (sizes differ by at most one), in order,
    for gradient accumulation. Fewer pieces when there are fewer rows than ``parts``."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    n = len(batch)
    parts = max(1, min(parts, n))
    bounds = [round(k * n / parts) for k in range(parts + 1)]
    return [cast(SizedSliceable, batch[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
