"""RolloutBatch shape checks and minibatch iteration."""

import mlx.core as mx
import numpy as np
import pytest

from experience_buffer.buffer import (
    RolloutBatch,
    iterate_minibatches,
    minibatch_indices,
    split_micro_batches,
)


def make_batch(b: int = 8, t: int = 5, l: int = 9) -> RolloutBatch:
    rows = mx.arange(b).astype(mx.float32)
    return RolloutBatch(
        query_responses=mx.broadcast_to(mx.arange(b)[:, None], (b, l)).astype(mx.int32),
        prompt_lengths=mx.full((b,), 4, dtype=mx.int32),
        responses=mx.zeros((b, t), dtype=mx.int32),
        mask=mx.ones((b, t)),
        logprobs=mx.broadcast_to(rows[:, None], (b, t)),
        ref_logprobs=mx.zeros((b, t)),
        scores=rows,
        advantages=mx.broadcast_to(rows[:, None], (b, t)),
        values=mx.zeros((b, t)),
        returns=mx.zeros((b, t)),
    )


def test_minibatches_cover_every_row_once_and_keep_rows_aligned() -> None:
    batch = make_batch()
    seen: list[int] = []
    for mb in iterate_minibatches(batch, 4, np.random.default_rng(0)):
        assert len(mb) == 2
        ids = np.array(mb.scores).astype(int).tolist()
        # Every array of the minibatch holds the same rows.
        assert np.array(mb.query_responses[:, 0]).tolist() == ids
        assert np.array(mb.logprobs[:, 0]).astype(int).tolist() == ids
        seen.extend(ids)
    assert sorted(seen) == list(range(8))


def test_order_is_shuffled_and_reproducible() -> None:
    first = [np.array(i).tolist() for i in minibatch_indices(16, 4, np.random.default_rng(3))]
    again = [np.array(i).tolist() for i in minibatch_indices(16, 4, np.random.default_rng(3))]
    assert first == again
    assert sum(first, []) != list(range(16))


def test_indivisible_minibatches_raise() -> None:
    with pytest.raises(ValueError, match="num_mini_batches"):
        list(minibatch_indices(10, 3, np.random.default_rng(0)))


def test_micro_batches_split_consecutively() -> None:
    parts = split_micro_batches(make_batch(), 2)
    assert [np.array(p.scores).astype(int).tolist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # One contract for rollout batches and example lists: near-equal contiguous pieces.
    parts = split_micro_batches(make_batch(), 3)
    assert [len(p) for p in parts] == [3, 2, 3]
    assert np.concatenate([np.array(p.scores) for p in parts]).astype(int).tolist() == list(
        range(8)
    )
    assert split_micro_batches(list(range(8)), 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert split_micro_batches([1, 2], 4) == [[1], [2]]  # fewer rows than parts
    with pytest.raises(ValueError, match="parts"):
        split_micro_batches([1, 2], 0)


def test_mismatched_rows_raise() -> None:
    good = make_batch()
    with pytest.raises(ValueError, match="scores"):
        RolloutBatch(**{**good.__dict__, "scores": mx.zeros((3,))})
    with pytest.raises(ValueError, match="same"):
        RolloutBatch(**{**good.__dict__, "mask": mx.ones((8, 4))})
