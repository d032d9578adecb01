"""Rollout sources and the scorer, on hand-made rewards, sources and workers: which source a run
builds, the feature pairs it refuses (one table, one message style), the scores with the
environments' rewards and the completions' ids, dynamic sampling's rounds and the asynchronous
worker's batches."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any, cast

import mlx.core as mx
import numpy as np
import pytest

from config.ppo_config import PPOConfig
from ppo_trainer.agent_rollout import AgentEpisodes, AgentRun
from ppo_trainer.async_rollout import AsyncRollout
from ppo_trainer.dynamic_sampling import DynamicSampling
from ppo_trainer.rewards import Rewards
from ppo_trainer.rollout import (
    PromptBatch,
    Rollout,
    RolloutSource,
    SamplingSettings,
    Scored,
    StepPlan,
    rollout_keys,
)
from ppo_trainer.rollout_sources import build_rollout_source, check_rollout_features
from ppo_trainer.scorer import Scorer
from ppo_trainer.single_turn import SingleTurn
from tests.test_dynamic_sampling import _rollout

SAMPLING = SamplingSettings(
    max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0, stop_token_ids=[0], pad_token_id=0
)


def test_each_pair_a_run_cannot_combine_is_refused_in_one_style() -> None:
    no_run: dict[str, Any] = dict(world_size=1, policy_given=False, agents=False)
    grpo_dynamic = dict(algorithm="grpo", group_size=2, dynamic_sampling=True)
    cases: list[tuple[dict[str, Any], dict[str, Any], str]] = [
        (
            dict(async_rollout=True),
            dict(world_size=2),
            r"^async_rollout with 2 data-parallel processes: .+; set async_rollout: false, "
            "or launch one process$",
        ),
        (
            grpo_dynamic,
            dict(world_size=4),
            r"^dynamic_sampling with 4 data-parallel processes: .+; set dynamic_sampling: "
            "false, or launch one process$",
        ),
        (
            dict(async_rollout=True),
            dict(policy_given=True),
            r"^async_rollout with a policy passed to the trainer: .+; pass no policy=, or set "
            "async_rollout: false$",
        ),
        (
            dict(async_rollout=True),
            dict(agents=True),
            r"^async_rollout with agents \(tools, environment_factory\): .+; set "
            "async_rollout: false$",
        ),
    ]
    for settings, run, message in cases:
        config = PPOConfig(model_name="m", **settings)
        with pytest.raises(ValueError, match=message):
            check_rollout_features(config, **{**no_run, **run})
        check_rollout_features(config, **no_run)  # the feature alone runs
        check_rollout_features(PPOConfig(model_name="m"), **{**no_run, **run})  # so does the rest


def length_reward(prompts: list[str], completions: list[str]) -> list[float]:
    return [float(len(c)) for c in completions]


class IdsTrainer:
    """Stands for a trainer class that overrides compute_scores."""


def ids_scores(
    prompts: list[str],
    completions: list[str],
    query_responses: mx.array,
    sequence_lengths: mx.array,
    completion_ids: list[list[int]],
) -> list[float]:
    return [float(sum(ids)) for ids in completion_ids]


def default_scores(rewards: Rewards) -> Any:
    """The default compute_scores of a trainer with ``rewards``."""

    def compute_scores(
        prompts: list[str],
        completions: list[str],
        query_responses: mx.array,
        sequence_lengths: mx.array,
        **columns: list[Any],
    ) -> Any:
        return rewards.score(prompts, completions, query_responses, sequence_lengths, columns)

    return compute_scores


# Two sequences: prompt [1, 2], responses [7, 8] and [9] (then padding).
PROMPT_IDS = [[1, 2], [1, 2]]
QUERY_RESPONSES = mx.array([[1, 2, 7, 8, 0], [1, 2, 9, 0, 0]])
LENGTHS = mx.array([4, 3])


def score(scorer: Scorer, environment: list[float] | None = None) -> list[float]:
    env = None if environment is None else mx.array(environment)
    out = scorer.score(["p", "p"], PROMPT_IDS, {}, ["ab", "c"], QUERY_RESPONSES, LENGTHS, env)
    if isinstance(out, Scored):  # with what the rewards logged
        out = out.out
    scores = out[0] if isinstance(out, tuple) else out
    return np.asarray(scores).tolist()


def test_the_scorer_of_a_reward_function() -> None:
    rewards = Rewards(fn=length_reward)
    scorer = Scorer.build(PPOConfig(model_name="m"), rewards, default_scores(rewards), None)
    assert scorer.source == "the reward function length_reward"
    assert scorer.description == "function tests.test_rollout_sources:length_reward"
    assert scorer.has_reward and not scorer.is_model_pass
    assert score(scorer) == [2.0, 1.0]
    assert score(scorer, environment=[0.5, -1.0]) == [2.5, 0.0]  # the environments' added


def test_the_scorer_of_an_overridden_compute_scores_reads_the_completion_ids() -> None:
    def refuse(prompts: list[str], completions: list[str]) -> list[float]:
        raise AssertionError("an override's reward is not called before the rollout")

    scorer = Scorer.build(PPOConfig(model_name="m"), Rewards(fn=refuse), ids_scores, IdsTrainer)
    assert scorer.source == "IdsTrainer.compute_scores"
    assert scorer.description == "tests.test_rollout_sources.IdsTrainer.compute_scores"
    assert scorer.has_reward and not scorer.is_model_pass
    assert score(scorer) == [15.0, 9.0]  # [7, 8] and [9]
    scorer.check_call(["p", "p"], {})
    with pytest.raises(ValueError, match="completion_ids|answer"):
        Scorer.build(
            PPOConfig(model_name="m"),
            Rewards(),
            lambda p, c, q, s, answer: [0.0] * len(c),
            IdsTrainer,
        ).check_columns(
            {}
        )  # a column no prompt carries


def test_the_scorer_of_environments_alone_gives_their_rewards() -> None:
    rewards = Rewards()
    scorer = Scorer.build(PPOConfig(model_name="m"), rewards, default_scores(rewards), None)
    assert not scorer.has_reward and not scorer.is_model_pass
    assert scorer.description is None
    assert score(scorer, environment=[3.0, 4.0]) == [3.0, 4.0]


class Rounds:
    """A rollout source that returns its rollouts in turn and records what it was asked."""

    def __init__(self, rollouts: list[Rollout]) -> None:
        self.rollouts = rollouts
        self.asked: list[tuple[PromptBatch, mx.array | None, StepPlan | None]] = []

    def rollout(
        self,
        batch: PromptBatch,
        sampling: SamplingSettings,
        keys: mx.array | None,
        plan: StepPlan | None = None,
    ) -> Rollout:
        self.asked.append((batch, keys, plan))
        return self.rollouts[len(self.asked) - 1]


def scored(base: float, scores: list[float]) -> Rollout:
    return replace(_rollout(base, [1] * len(scores), 2, 2), scores=mx.array(scores))


def test_dynamic_sampling_draws_rounds_until_the_batch_is_informative() -> None:
    # Groups of 2, a batch of 2 groups: round 0 has one informative group (1), round 1 one (3).
    inner = Rounds([scored(0.0, [1, 1, 0, 1]), scored(10.0, [2, 2, 3, 4])])
    source = DynamicSampling(
        inner, group_size=2, num_groups=2, max_num_gen_batches=3, seed=5, rollout_batch_size=4
    )
    batch = PromptBatch(["a", "a", "b", "b"], [[1]] * 4, {})
    drawn: list[int] = []

    def more(k: int) -> list[str]:
        drawn.append(k)
        return ["c", "d"]

    def prepare(prompts: Any) -> PromptBatch:
        return PromptBatch(list(prompts), [[2]] * len(prompts), {})

    plan = StepPlan(7, prepare, None, more)
    out = source.rollout(batch, SAMPLING, None, plan)
    assert drawn == [1]  # one extra round was enough
    assert np.asarray(out.scores).tolist() == [0.0, 1.0, 3.0, 4.0]  # groups 1 and 3
    assert out.source_metrics == {
        "dynamic_sampling/num_gen_batches": 2.0,
        "dynamic_sampling/groups_dropped": 2.0,
        "dynamic_sampling/extra_rollouts": 4.0,
        "frac_reward_zero_std": 0.5,
    }
    extra_batch, extra_keys, extra_plan = inner.asked[1]
    assert extra_batch.texts == ["c", "d"]
    assert extra_keys is not None
    assert mx.array_equal(extra_keys, rollout_keys(5, 7, 4, extra_round=1)).item()
    assert extra_plan is not None and extra_plan.more_prompts is None  # rounds do not nest
    # An evaluation keeps every group of its one round.
    evaluated = Rounds([scored(0.0, [1, 1, 1, 1])])
    kept = replace(source, inner=evaluated).rollout(batch, SAMPLING, None)
    assert kept is evaluated.rollouts[0] and not kept.source_metrics


class Worker:
    """Stands for the asynchronous worker: one batch ready, and the requests it gets."""

    def __init__(self, ready: Any) -> None:
        self.ready = ready
        self.taken: list[tuple[int, list[list[int]]]] = []
        self.requested: list[tuple[int, list[list[int]], mx.array]] = []

    def take(self, step: int, prompt_ids: list[list[int]]) -> Any:
        self.taken.append((step, prompt_ids))
        return self.ready

    def request(self, step: int, prompt_ids: list[list[int]], keys: mx.array, weights: Any) -> None:
        self.requested.append((step, prompt_ids, keys))


def test_the_async_source_takes_this_batch_and_asks_for_the_next() -> None:
    collected: list[dict[str, Any]] = []

    def collect(batch: PromptBatch, sampling: Any, keys: Any, **kwargs: Any) -> Rollout:
        collected.append(kwargs)
        return scored(0.0, [1.0, 2.0])

    policy = SimpleNamespace(trainable_parameters=lambda: {"w": mx.zeros((1,))})
    models = cast(SingleTurn, SimpleNamespace(collect=collect, policy=policy))
    ready = object()
    worker = Worker(ready)
    source = AsyncRollout(models, lambda: cast(Any, worker), seed=3, rollout_batch_size=2)
    batch = PromptBatch(["a", "a"], [[1], [1]], {})

    def prepare(prompts: Any) -> PromptBatch:
        return PromptBatch(list(prompts), [[9]] * len(prompts), {})

    out = source.rollout(batch, SAMPLING, None, StepPlan(4, prepare, ["n", "n"]))
    assert worker.taken == [(4, [[1], [1]])]
    assert [(s, ids) for s, ids, _ in worker.requested] == [(5, [[9], [9]])]
    assert mx.array_equal(worker.requested[0][2], rollout_keys(3, 5, 2)).item()
    assert collected == [{"with_values": True, "generation": ready}]
    assert set(out.source_metrics) == {"time/generation_wait"}


def test_a_run_builds_its_source_once_from_its_features() -> None:
    models = cast(SingleTurn, SimpleNamespace())
    agent = cast(AgentRun, SimpleNamespace())

    def build(agent: AgentRun | None = None, **settings: Any) -> RolloutSource:
        config = PPOConfig(model_name="m", **settings)
        return build_rollout_source(
            config, models, agent=agent, tokenizer=None, context_length=None, worker=lambda: None
        )

    assert build() is models
    assert isinstance(build(async_rollout=True), AsyncRollout)
    assert isinstance(build(agent), AgentEpisodes)
    dynamic = build(agent, algorithm="grpo", group_size=2, dynamic_sampling=True)
    assert isinstance(dynamic, DynamicSampling) and isinstance(dynamic.inner, AgentEpisodes)
