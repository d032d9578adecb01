"""Dynamic sampling (DAPO, Yu et al. 2025; verl's ``filter_groups``): a group whose
``group_size`` scores are all equal has group-relative advantages of 0 and teaches nothing, so
the step drops it and fills the batch with the informative groups of further generation batches
(the next prompts), at most ``max_num_gen_batches`` batches in all.

:func:`choose_groups` is the selection, a pure function of the groups' scores;
:func:`take_groups` builds the step's rollout from the chosen groups of several generation
batches.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

from ppo_trainer.generator import GenerationOutput
from ppo_trainer.rollout import Rollout
from token_attribution.sequences import build_query_responses


def informative_groups(scores: np.ndarray, group_size: int) -> np.ndarray:
    """``(N,)`` bool: whether group ``n``'s scores differ (max > min), from ``scores`` ``(N *
    G,)`` with a group's ``G = group_size`` responses adjacent. The complement of TRL's
    ``frac_reward_zero_std`` groups (a spread of exactly 0)."""
    grouped = np.asarray(scores, dtype=np.float64).reshape(-1, group_size)  # (N, G)
    return np.asarray(grouped.max(axis=1) > grouped.min(axis=1))


def choose_groups(informative: Sequence[bool], num_groups: int) -> tuple[list[int], int]:
    """The groups a step trains on, from the ``informative`` flags of every group generated so
    far (in generation order): the first ``num_groups`` informative ones; if there are fewer,
    all of them and then the earliest uninformative ones up to ``num_groups`` (what a run
    without dynamic sampling would have trained on). Returns ``(indices ascending, number of
    uninformative groups among them)``.

    Raises:
        ValueError: fewer than ``num_groups`` groups in all.
    """
    if len(informative) < num_groups:
        raise ValueError(f"{len(informative)} groups generated, {num_groups} needed")
    good = [i for i, ok in enumerate(informative) if ok][:num_groups]
    fill = [i for i, ok in enumerate(informative) if not ok][: num_groups - len(good)]
    return sorted(good + fill), len(fill)


def _pad_columns(x: mx.array, width: int, value: float | int = 0) -> mx.array:
    """``x`` (B, T) right-padded with ``value`` to (B, ``width``)."""
    if x.shape[1] == width:
        return x
    return mx.pad(x, [(0, 0), (0, width - x.shape[1])], constant_values=value)


def take_groups(
    rollouts: Sequence[Rollout], groups: Sequence[int], group_size: int, pad_token_id: int
) -> Rollout:
    """The rollout of ``groups`` (indices into the groups of ``rollouts`` concatenated in
    order, each of ``group_size`` adjacent sequences), each group whole: per-token arrays
    right-padded to the longest response (``T``, masked out beyond each response's length),
    the sequences rebuilt at ``L = max prompt + T``. Its ``reward_metrics`` are the first
    rollout's (the batch as first sampled)."""
    rows = np.array([g * group_size + k for g in groups for k in range(group_size)])  # (B,)
    index = mx.array(rows, dtype=mx.int32)
    width = max(r.generation.responses.shape[1] for r in rollouts)  # T

    def cat(get: str, source: str = "rollout", value: float | int = 0) -> mx.array:
        parts = [
            getattr(r.generation if source == "generation" else r, get) for r in rollouts
        ]  # each (B_r, T_r) or (B_r,)
        if parts[0].ndim == 2:
            parts = [_pad_columns(p, width, value) for p in parts]
        return mx.concatenate(parts, axis=0)[index]

    def cat_list(get: str) -> list:
        return [x for r in rollouts for x in getattr(r, get)]

    texts, completions, prompt_ids = (
        [cat_list(name)[i] for i in rows] for name in ("texts", "completions", "prompt_ids")
    )
    first = rollouts[0].generation
    generation = GenerationOutput(
        responses=cat("responses", "generation", pad_token_id),
        lengths=cat("lengths", "generation"),
        ended_with_stop=cat("ended_with_stop", "generation"),
        logprobs=None if first.logprobs is None else cat("logprobs", "generation"),
        entropy=None if first.entropy is None else cat("entropy", "generation"),
        stopped_by_string=(
            None if first.stopped_by_string is None else cat("stopped_by_string", "generation")
        ),
    )
    query_responses, prompt_lengths = build_query_responses(
        prompt_ids, generation.responses, pad_token_id
    )
    return Rollout(
        texts,
        completions,
        prompt_ids,
        generation,
        query_responses,
        prompt_lengths,
        cat("mask"),
        cat("logprobs"),
        cat("ref_logprobs"),
        cat("entropy"),
        None if rollouts[0].values is None else cat("values"),
        cat("scores"),
        rollouts[0].reward_metrics,
    )
