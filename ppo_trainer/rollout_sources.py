"""Which rollout source a run has (:class:`~ppo_trainer.rollout.RolloutSource`), decided once
when the trainer is built: single-turn sampling, agents' multi-turn episodes, the asynchronous
worker or GKD's mix with the data's completions, each optionally wrapped in dynamic sampling, and
the source as a training step uses it (:class:`StepRollouts`); and which of those features a run
cannot combine, refused here before anything loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx

from config.ppo_config import PPOConfig
from ppo_trainer.agent_rollout import AgentEpisodes, AgentRun
from ppo_trainer.async_rollout import AsyncRollout
from ppo_trainer.dynamic_sampling import DynamicSampling
from ppo_trainer.gkd import GKDRollouts, takes_data_completions
from ppo_trainer.prompt_batches import chat_prompts
from ppo_trainer.rollout import (
    PromptBatch,
    Rollout,
    RolloutSource,
    SamplingSettings,
    StepPlan,
    warn_if_ended_at_once,
)
from ppo_trainer.rollout_worker import RolloutWorker
from ppo_trainer.scorer import Scorer
from ppo_trainer.single_turn import SingleTurn


def check_rollout_features(
    config: PPOConfig, *, world_size: int, policy_given: bool, agents: bool
) -> None:
    """Raise ``ValueError`` for rollout features this run cannot combine: the asynchronous
    worker or dynamic sampling with data parallelism, the worker with a policy passed to the
    trainer or with agents. (Pairs within the config alone, such as dynamic sampling with the
    worker, are refused by the config itself.)

    Args:
        world_size: the run's data-parallel processes.
        policy_given: a policy was passed to the trainer.
        agents: tools or an environment factory were passed to the trainer.
    """
    processes = f"{world_size} data-parallel processes"
    refused = [
        (
            config.async_rollout and world_size > 1,
            f"async_rollout with {processes}",
            "it runs one generation worker beside one trainer",
            "set async_rollout: false, or launch one process",
        ),
        (
            config.dynamic_sampling and world_size > 1,
            f"dynamic_sampling with {processes}",
            "it filters the groups of one process's batch",
            "set dynamic_sampling: false, or launch one process",
        ),
        (
            config.async_rollout and policy_given,
            "async_rollout with a policy passed to the trainer",
            "the generation worker builds its policy from the config (model_name, dtype, LoRA "
            "settings) and cannot copy one",
            "pass no policy=, or set async_rollout: false",
        ),
        (
            takes_data_completions(config) and config.lmbda < 1 and agents,
            f"lmbda={config.lmbda} with agents (tools, environment_factory)",
            "a share of gkd's steps trains on the data's completions, which are single turns",
            "set lmbda: 1 (the student's episodes only), or pass no tools",
        ),
        (
            config.async_rollout and agents,
            "async_rollout with agents (tools, environment_factory)",
            "the worker samples single-turn responses and agents need multi-turn episodes",
            "set async_rollout: false",
        ),
    ]
    for on, pair, why, change in refused:
        if on:
            raise ValueError(f"{pair}: {why}; {change}")


def build_rollout_source(
    config: PPOConfig,
    models: SingleTurn,
    *,
    agent: AgentRun | None,
    tokenizer: Any,
    context_length: int | None,
    worker: Callable[[], RolloutWorker | None],
) -> RolloutSource:
    """The run's rollout source: agents' episodes with tools or environments, else the
    worker's responses with ``async_rollout``, else GKD's mix of samples and the data's
    completions (``lmbda``), else ``models`` sampling one response per sequence; inside
    dynamic sampling with ``dynamic_sampling``.

    Args:
        models: the run's models and scorer.
        agent: the run's tools and environments (None: none).
        tokenizer: the policy's (agents render their prompts with it).
        context_length: the policy's context (None: unknown).
        worker: the run's asynchronous worker while it has one.
    """
    source: RolloutSource = models
    if agent is not None:
        source = AgentEpisodes(
            models,
            agent,
            tokenizer,
            system_prompt=config.system_prompt,
            template_kwargs=dict(config.chat_template_kwargs or {}),
            max_prompt_length=config.max_prompt_length,
            context_length=context_length,
        )
    elif config.async_rollout:
        source = AsyncRollout(models, worker, config.seed, config.rollout_batch_size)
    elif takes_data_completions(config):
        chat = chat_prompts(tokenizer, config.use_chat_template)
        source = GKDRollouts(models, tokenizer, config.lmbda, config.seed, chat)
    if config.dynamic_sampling:
        source = DynamicSampling(
            source,
            group_size=config.group_size,
            num_groups=config.batch_size,
            max_num_gen_batches=config.max_num_gen_batches,
            seed=config.seed,
            rollout_batch_size=config.rollout_batch_size,
        )
    return source


@dataclass(frozen=True)
class StepRollouts:
    """The run's rollout source as its steps use it: a training step's error names the step (a
    reward that is NaN or not numbers), and its rollout warns when every response ended at once
    or when several rewards' metrics went missing; an evaluation's (no ``plan``) passes
    through."""

    source: RolloutSource
    scorer: Scorer
    use_chat_template: Any

    def rollout(
        self,
        batch: PromptBatch,
        sampling: SamplingSettings,
        keys: mx.array | None,
        plan: StepPlan | None = None,
    ) -> Rollout:
        """The rollout of ``batch`` (:class:`~ppo_trainer.rollout.RolloutSource`)."""
        if plan is None:
            return self.source.rollout(batch, sampling, keys)
        step = plan.step + 1
        try:
            rollout = self.source.rollout(batch, sampling, keys, plan)
        except ValueError as err:
            raise ValueError(f"step {step}: {err}") from err
        warn_if_ended_at_once(rollout.generation, step, self.use_chat_template)
        self.scorer.warn_without_metrics(rollout.reward_metrics)
        return rollout
