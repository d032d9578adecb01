"""What a :class:`~ppo_trainer.ppo_trainer.PPOTrainer` is built from, decided once: the checks
before any model loads (:func:`start_run`); phases 1-3's parts (:func:`build_rollout_parts`):
the reward and its :class:`~ppo_trainer.scorer.Scorer`, the stop tokens, how prompts become
sequences, the sampling settings and the rollout source; and the inputs its checkpoints record
(:func:`recorded_inputs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import mlx.core as mx

from agents import AgentSettings
from base_setup import distributed as dist
from base_setup import seed_everything
from config.ppo_config import PPOConfig
from ppo_trainer.agent_rollout import AgentRun, agent_inputs
from ppo_trainer.components import (
    RunModels,
    check_data_parallel_config,
    context_length,
    load_function,
    stop_token_ids,
    vocab_size,
)
from ppo_trainer.memory_estimate import check_memory
from ppo_trainer.prompt_batches import PromptPreparation, chat_prompts
from ppo_trainer.prompt_records import Prompt
from ppo_trainer.rewards import Rewards
from ppo_trainer.rollout import SamplingSettings
from ppo_trainer.rollout_sources import StepRollouts, build_rollout_source, check_rollout_features
from ppo_trainer.rollout_worker import RolloutWorker
from ppo_trainer.run_state import run_inputs
from ppo_trainer.scorer import Scorer
from ppo_trainer.single_turn import SingleTurn
from training.run_control import prepare_run_dir


def start_run(
    config: PPOConfig,
    group: dist.Group,
    policy_given: bool,
    tools: Sequence[Any] | None,
    environment_factory: Any,
) -> AgentRun | None:
    """What a run checks before any model loads, then its seed: data parallelism's settings
    (collective checks, on every rank), the rollout features it cannot combine, the agents'
    tools and environments, the memory its models need (when the trainer loads the policy),
    and on rank 0 that its folder can be written. Returns the run's agents (None without tools
    or environments)."""
    world_size = group.size()
    check_data_parallel_config(config, group)
    check_rollout_features(
        config,
        world_size=world_size,
        policy_given=policy_given,
        agents=bool(tools) or environment_factory is not None,
    )
    agent = AgentRun.build(
        tools, environment_factory, AgentSettings.from_config(config, load_function)
    )
    if not policy_given:  # sizes that cannot fit (memory_estimate)
        check_memory(config, world_size)
    if group.rank() == 0:  # a folder we cannot write is named
        prepare_run_dir(Path(config.output_dir), resuming=True, overwrite=False)
    seed_everything(config.seed)
    return agent


class TaskSeams(Protocol):
    """The trainer's overridable methods that phases 1-3 call."""

    def format_prompt(self, prompt: Prompt) -> str: ...

    def encode_prompt(self, text: str) -> list[int]: ...

    def decode_completion(self, tokens: Sequence[int]) -> str: ...

    def compute_scores(
        self,
        prompts: list[str],
        completions: list[str],
        query_responses: mx.array,
        sequence_lengths: mx.array,
        **columns: list[Any],
    ) -> mx.array | tuple[mx.array, dict[str, mx.array]]: ...


@dataclass(frozen=True)
class RolloutParts:
    """What phases 1-3 of a run are made of.

    Attributes:
        rewards: the reward model, function or functions.
        scorer: what scores the responses (phase 3).
        stop_token_ids: the ids that end a response.
        chat_prompts: whether plain-text prompts go through the chat template.
        preparation: how prompts become sequences (format_prompt, encode_prompt, the checks).
        sampling: the training's sampling settings.
        source: where the rollouts come from, training's and evaluation's.
    """

    rewards: Rewards
    scorer: Scorer
    stop_token_ids: list[int]
    chat_prompts: bool
    preparation: PromptPreparation
    sampling: SamplingSettings
    source: StepRollouts


def build_rollout_parts(
    config: PPOConfig,
    models: RunModels,
    seams: TaskSeams,
    *,
    owner: type | None,
    agent: AgentRun | None,
    log_chat: bool,
    group: dist.Group,
    worker: Callable[[], RolloutWorker | None],
) -> RolloutParts:
    """The parts of phases 1-3 of a run with ``config`` and ``models``.

    Args:
        seams: the trainer, whose task methods format, encode, decode and score.
        owner: the trainer's class when it overrides ``compute_scores``, else None.
        agent: the run's tools and environments (None: none); its tokenizer is prepared here.
        log_chat: say whether plain-text prompts go through the chat template (a trainer that
            keeps the default ``format_prompt``, on the main process).
        group: the data-parallel ranks (each prepares its share of a step's prompts).
        worker: the run's ``async_rollout`` worker while it has one.
    """
    tokenizer, policy = models.tokenizer, models.policy
    rewards = Rewards(
        models.reward_model, models.reward_fn, models.reward_funcs, config.reward_weights
    )
    scorer = Scorer.build(config, rewards, seams.compute_scores, owner)
    if agent is not None:  # tool_chat_template; one that cannot show tools stops here
        agent.prepare_tokenizer(tokenizer)  # before the stop tokens: its end of turn
    stops = stop_token_ids(config, tokenizer, vocab_size(policy))
    chat = chat_prompts(tokenizer, config.use_chat_template, log=log_chat)
    context = context_length(policy)
    preparation = PromptPreparation.from_config(
        config,
        seams.format_prompt,
        seams.encode_prompt,
        scorer,
        context,
        group.rank(),
        group.size(),
    )
    sampling = SamplingSettings.from_config(config, stops, int(tokenizer.pad_token_id))
    source = build_rollout_source(
        config,
        SingleTurn(policy, models.ref_model, models.value_model, scorer, seams.decode_completion),
        agent=agent,
        tokenizer=tokenizer,
        context_length=context,
        worker=worker,
    )
    steps = StepRollouts(source, scorer, config.use_chat_template)
    return RolloutParts(rewards, scorer, stops, chat, preparation, sampling, steps)


def recorded_inputs(
    config: PPOConfig, parts: RolloutParts, agent: AgentRun | None
) -> dict[str, str | None]:
    """What a run reads besides its settings, recorded in its checkpoints and compared on resume
    (``train()`` adds the prompts): the models, the reward, the reward functions' source (edits
    to their files), the agents' import paths."""
    return {
        **run_inputs(config, parts.scorer.description),
        "reward_source": parts.rewards.source_fingerprint(),
        **agent_inputs(agent),
    }
