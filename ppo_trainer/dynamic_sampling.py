"""Dynamic sampling (DAPO, Yu et al. 2025; verl's ``filter_groups``): a group whose
``group_size`` scores are all equal has group-relative advantages of 0 and teaches nothing, so
the step drops it and fills the batch with the informative groups of further generation batches
(the next prompts), at most ``max_num_gen_batches`` batches in all.

:func:`choose_groups` is the selection, a pure function of the groups' scores;
:func:`take_groups` builds the step's rollout from the chosen groups of several generation
batches; :class:`DynamicSampling` wraps a run's rollout source with both.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from ppo_trainer.generator import GenerationOutput
from ppo_trainer.rollout import (
    PromptBatch,
    Rollout,
    RolloutSource,
    SamplingSettings,
    StepPlan,
    rollout_keys,
)
from token_attribution.sequences import build_query_responses

logger = logging.getLogger("ppo_mlx")


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


#: How :func:`take_groups` builds each field of a :class:`Rollout` (and of its
#: :class:`GenerationOutput`) from the chosen rows of several rollouts: "rows" (one entry per
#: row: a list, a ``(B, ...)`` array, or a dict of them), "tokens" (``(B, T)``, right-padded
#: to the longest response), "turns" (``(B, K)``, right-padded to the most policy turns),
#: "rebuilt" (the sequences, from the prompts and responses kept), "first" (the batch as
#: first sampled), "generation" (field by field, from :data:`GENERATION_FIELDS`). Every field
#: has an entry: a field added to the dataclasses without one stops :func:`take_groups`.
ROLLOUT_FIELDS: dict[str, str] = {
    "texts": "rows",
    "completions": "rows",
    "prompt_ids": "rows",
    "generation": "generation",
    "query_responses": "rebuilt",
    "prompt_lengths": "rebuilt",
    "mask": "tokens",
    "logprobs": "tokens",
    "ref_logprobs": "tokens",
    "entropy": "tokens",
    "values": "tokens",
    "scores": "rows",
    "reward_metrics": "first",
    "reward_details": "rows",
    "action_rewards": "turns",
    "turn_ends": "turns",
    "agent_counts": "rows",
    "source_metrics": "first",
}
GENERATION_FIELDS: dict[str, str] = {
    "responses": "tokens",
    "lengths": "rows",
    "ended_with_stop": "rows",
    "logprobs": "tokens",
    "entropy": "tokens",
    "stopped_by_string": "rows",
    "action_mask": "tokens",
    "turn_spans": "rows",
}

#: Where a rollout of the rounds lacks a field the others have (None): what stands for it.
#: A round in which no episode gave per-action rewards has none (0 on every turn); any other
#: field is there in every round of a run, or in none.
_MISSING_AS_ZEROS = ("action_rewards",)


def _pad_columns(x: mx.array, width: int, value: float | int = 0) -> mx.array:
    """``x`` (B, C) right-padded with ``value`` to (B, ``width``)."""
    if x.shape[1] == width:
        return x
    return mx.pad(x, [(0, 0), (0, width - x.shape[1])], constant_values=value)


def _take_rows(parts: Sequence[Any], rows: np.ndarray) -> Any:
    """``rows`` of the concatenation of ``parts`` (lists, ``(B_r, ...)`` arrays or dicts of
    either, all of one kind; arrays of equal trailing shapes)."""
    if isinstance(parts[0], dict):
        return {key: _take_rows([p[key] for p in parts], rows) for key in parts[0]}
    if isinstance(parts[0], list):
        joined = [x for p in parts for x in p]
        return [joined[i] for i in rows.tolist()]
    return mx.concatenate(list(parts), axis=0)[mx.array(rows, dtype=mx.int32)]


def take_groups(
    rollouts: Sequence[Rollout], groups: Sequence[int], group_size: int, pad_token_id: int
) -> Rollout:
    """The rollout of ``groups`` (indices into the groups of ``rollouts`` concatenated in
    order, each of ``group_size`` adjacent sequences), each group whole, with every per-row
    field of the rows kept (:data:`ROLLOUT_FIELDS`, agents' included): per-token arrays
    right-padded to the longest response (``T``, masked out beyond each response's length),
    per-turn arrays (``K``) to the most turns (turn ends with -1: none), the sequences rebuilt
    at ``L = max prompt + T``. Its ``reward_metrics`` are the first rollout's (the batch as
    first sampled).

    Raises:
        ValueError: a field of :class:`Rollout` or :class:`GenerationOutput` without a rule in
            :data:`ROLLOUT_FIELDS` / :data:`GENERATION_FIELDS`.
    """
    rows = np.array([g * group_size + k for g in groups for k in range(group_size)])  # (B,)
    counts = [len(r.texts) for r in rollouts]
    # One width per kind of columns, over every field of the kind: T for the per-token
    # arrays, K for the per-turn ones (action rewards and turn ends stay of one shape).
    widths = {"tokens": 0, "turns": 0}
    for r in rollouts:
        for source, table in ((r, ROLLOUT_FIELDS), (r.generation, GENERATION_FIELDS)):
            for name, how in table.items():
                part = getattr(source, name, None)
                if how in widths and part is not None:
                    widths[how] = max(widths[how], part.shape[1])

    def take(obj: str, table: dict[str, str], name: str, sources: list[Any]) -> Any:
        if name not in table:
            where = "ROLLOUT_FIELDS" if obj == "Rollout" else "GENERATION_FIELDS"
            raise ValueError(
                f"take_groups has no rule for the {obj} field {name!r}: add one to "
                f"ppo_trainer.dynamic_sampling.{where}"
            )
        parts = [getattr(s, name) for s in sources]
        if all(p is None for p in parts):
            return None
        if any(p is None for p in parts):
            if name not in _MISSING_AS_ZEROS:
                raise ValueError(f"take_groups: {obj}.{name} is None in some rollouts only")
            parts = [mx.zeros((n, 0)) if p is None else p for n, p in zip(counts, parts)]
        how = table[name]
        if how == "rows":
            return _take_rows(parts, rows)
        assert how in ("tokens", "turns"), how
        # Padding: the pad token after a response, -1 (no turn) after a row's turns, else 0.
        value = pad_token_id if name == "responses" else -1 if name == "turn_ends" else 0
        return _take_rows([_pad_columns(p, widths[how], value) for p in parts], rows)

    generation = GenerationOutput(
        **{
            f.name: take(
                "GenerationOutput", GENERATION_FIELDS, f.name, [r.generation for r in rollouts]
            )
            for f in fields(GenerationOutput)
        }
    )
    taken: dict[str, Any] = {}
    for f in fields(Rollout):
        rule = ROLLOUT_FIELDS.get(f.name)
        if rule == "generation":
            taken[f.name] = generation
        elif rule == "first":
            taken[f.name] = getattr(rollouts[0], f.name)
        elif rule != "rebuilt":
            taken[f.name] = take("Rollout", ROLLOUT_FIELDS, f.name, list(rollouts))
    taken["query_responses"], taken["prompt_lengths"] = build_query_responses(
        taken["prompt_ids"], generation.responses, pad_token_id
    )
    return Rollout(**taken)


@dataclass(frozen=True)
class DynamicSampling:
    """A rollout source that keeps only informative groups: generation rounds on the step's
    prompts, then ``plan.more_prompts(1), more_prompts(2), ...`` (the next prompts in the data
    order), until ``num_groups`` groups have differing scores or ``max_num_gen_batches`` rounds
    ran; the rollout of the groups chosen (:func:`choose_groups`). A batch still short is
    completed with uninformative groups, with a warning. Evaluations (no plan) keep every group.

    Its ``source_metrics``: ``dynamic_sampling/num_gen_batches``, ``/groups_dropped``
    (uninformative groups left out), ``/extra_rollouts`` (responses generated beyond the first
    round) and ``frac_reward_zero_std`` over every group generated.

    Attributes:
        inner: the source each round samples from.
        group_size: responses per prompt, adjacent.
        num_groups: groups a step trains on (``batch_size``).
        max_num_gen_batches: most generation rounds per step.
        seed, rollout_batch_size: the extra rounds' PRNG keys (:func:`rollout_keys`).
    """

    inner: RolloutSource
    group_size: int
    num_groups: int
    max_num_gen_batches: int
    seed: int
    rollout_batch_size: int

    def rollout(
        self,
        batch: PromptBatch,
        sampling: SamplingSettings,
        keys: mx.array | None,
        plan: StepPlan | None = None,
    ) -> Rollout:
        """The rollout of the groups chosen (:class:`~ppo_trainer.rollout.RolloutSource`)."""
        first = self.inner.rollout(batch, sampling, keys, plan)
        if plan is None:
            return first
        group, groups = self.group_size, self.num_groups
        rounds = [first]
        informative = informative_groups(np.array(first.scores), group).tolist()
        while sum(informative) < groups and len(rounds) < self.max_num_gen_batches:
            if plan.more_prompts is None:
                break
            r = len(rounds)
            more = self.inner.rollout(
                plan.prepare(plan.more_prompts(r)),
                sampling,
                rollout_keys(self.seed, plan.step, self.rollout_batch_size, extra_round=r),
                StepPlan(plan.step, plan.prepare),
            )
            rounds.append(more)
            informative += informative_groups(np.array(more.scores), group).tolist()
        chosen, filled = choose_groups(informative, groups)
        if filled:
            logger.warning(
                "step %d: dynamic sampling found %d of the batch's %d groups with differing "
                "scores in %d generation batch(es) (max_num_gen_batches=%d); the batch is "
                "completed with %d groups whose scores are all equal, which teach nothing. "
                "Raise max_num_gen_batches, or check that the reward can tell this model's "
                "responses apart (the prompts may be too hard or too easy for it)",
                plan.step + 1,
                groups - filled,
                groups,
                len(rounds),
                self.max_num_gen_batches,
                filled,
            )
        kept = first
        if len(rounds) > 1 or filled:
            kept = take_groups(rounds, chosen, group, sampling.pad_token_id)
        kept.source_metrics.update(
            {
                "dynamic_sampling/num_gen_batches": float(len(rounds)),
                "dynamic_sampling/groups_dropped": float(len(informative) - len(chosen)),
                "dynamic_sampling/extra_rollouts": float(
                    (len(rounds) - 1) * self.rollout_batch_size
                ),
                "frac_reward_zero_std": 1.0 - sum(informative) / len(informative),
            }
        )
        return kept
