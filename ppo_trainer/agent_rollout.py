"""Phase 1 for agents: multi-turn episodes in which the policy calls tools and reads their results.

Each sequence of the rollout batch is one :class:`agents.Episode` (its own environment from
``environment_factory``, reset with the prompt's record). Its prompt is rendered by the chat
template with the tools' schemas (and the environment's reset text added to the last user
message); the policy's turns are sampled by :func:`ppo_trainer.multi_turn.generate_turns`, which
keeps the KV cache: when a turn ends, the episode parses it and runs its tool calls, and the
tool messages, rendered by the template (:func:`agents.continuation_tokens`), are fed as the
row's next context. The generation's ``action_mask`` marks the policy's tokens: the only actions
the losses, the KL and GAE see.

Rewards from the environment (``get_reward()``): one float is added to the episode's score; a
list (one per assistant turn) gives per-action rewards, which land on each turn's last token
(:func:`reward_kl.reward_computer.add_action_rewards`; summed into the score for GRPO / RLOO).

:class:`AgentEpisodes` is the run's rollout source with agents
(:class:`~ppo_trainer.rollout.RolloutSource`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import mlx.core as mx
import numpy as np

from agents import (
    AgentSettings,
    Episode,
    Tool,
    build_environment,
    check_environment_factory,
    check_template_supports_tools,
    continuation_tokens,
    environment_tools,
    factory_name,
    make_tools,
    render_text,
    takes_seed,
    tool_chat_template,
)
from base_setup.tokenizer_setup import add_end_of_turn_id, encode_text, end_of_turn_token_id
from models.policy_model import PolicyModel
from ppo_trainer.generator import GenerationOutput, cut_after_stop_string
from ppo_trainer.multi_turn import turn_ends
from ppo_trainer.prompt_records import PROMPT_KEY, Columns
from ppo_trainer.rollout import (
    PromptBatch,
    Rollout,
    SamplingSettings,
    StepPlan,
    check_prompts,
    sample_episodes,
)
from ppo_trainer.single_turn import SingleTurn


@dataclass(frozen=True)
class AgentRun:
    """A run's agent part: the function tools, the environment factory and the settings."""

    tools: list[Tool]
    environment_factory: Callable[[], Any] | None
    settings: AgentSettings

    @classmethod
    def build(
        cls,
        tools: Sequence[Callable[..., Any] | Tool] | None,
        environment_factory: Callable[[], Any] | None,
        settings: AgentSettings,
    ) -> AgentRun | None:
        """The agent part of a trainer given ``tools=`` / ``environment_factory=``, checked
        before anything loads (None when neither is given).

        Raises:
            ValueError: a tool without type hints or docstring, duplicate names, or an
                environment factory whose environment has no ``reset`` or no tools.
        """
        if not tools and environment_factory is None:
            return None
        made = make_tools(list(tools or []))
        if environment_factory is not None:
            check_environment_factory(environment_factory)
        return cls(made, environment_factory, settings)

    def sample_tools(self) -> list[Tool]:
        """The tools an episode has (the function tools and one environment's), for checks."""
        env_tools = (
            environment_tools(build_environment(self.environment_factory, 0))
            if self.environment_factory is not None
            else []
        )
        return self.tools + env_tools

    def environment_rewards(self) -> bool:
        """Whether the environments score their episodes (``get_reward``)."""
        if self.environment_factory is None:
            return False
        env = build_environment(self.environment_factory, 0)
        return callable(getattr(env, "get_reward", None))

    def seeded(self) -> bool:
        """Whether the environments are built from seeds (the factory takes ``seed``)."""
        return self.environment_factory is not None and takes_seed(self.environment_factory)

    def description(self) -> dict[str, str]:
        """What a checkpoint records of the agent part, and a resume compares: the environment
        factory's and the function tools' import paths (``module:qualname``)."""
        env = self.environment_factory
        return {
            "environment": factory_name(env) if env is not None else "none",
            "tools": ", ".join(factory_name(t.function) for t in self.tools) or "none",
        }

    def prepare_tokenizer(self, tokenizer: Any) -> None:
        """Give ``tokenizer`` the run's ``tool_chat_template`` (its end-of-turn token joins the
        end ids), then stop the run before any rollout when the chat template cannot render the
        tools or their results, or has no end-of-turn token
        (:func:`agents.check_template_supports_tools`)."""
        if self.settings.tool_chat_template is not None:
            tokenizer.chat_template = tool_chat_template(self.settings.tool_chat_template)
            tokenizer.has_chat_template = True
            add_end_of_turn_id(tokenizer)
        check_template_supports_tools(tokenizer, self.sample_tools())


def agent_inputs(agent: AgentRun | None) -> dict[str, str]:
    """What a run's checkpoints record of its agents, and a resume compares
    (:meth:`AgentRun.description`; "none" for a run without)."""
    return agent.description() if agent is not None else {"environment": "none", "tools": "none"}


@dataclass
class Episodes:
    """A batch of started episodes: one per sequence, with its conversation and prompt."""

    episodes: list[Episode]
    conversations: list[list[dict[str, Any]]]  # the messages so far, per sequence
    texts: list[str]  # the rendered prompts
    prompt_ids: list[list[int]]


def start_episodes(
    agent: AgentRun,
    tokenizer: Any,
    columns: Columns,
    *,
    system_prompt: str | None,
    template_kwargs: Mapping[str, Any],
    seeds: Sequence[int],
) -> Episodes:
    """One episode per row of ``columns`` (the prompt records, ``"prompt"`` included): its
    environment built from the row's seed (``factory(seed=seeds[row])`` when the factory takes
    one, else ``factory()``) and reset with the row (``env.reset(**record)``), the reset text
    added to the last user message, and the prompt rendered with the episode's tools."""
    prompts = columns[PROMPT_KEY]
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} environment seeds for {len(prompts)} episodes")
    episodes, conversations, texts, ids = [], [], [], []
    for row, prompt in enumerate(prompts):
        factory = agent.environment_factory
        env = build_environment(factory, seeds[row]) if factory is not None else None
        episode = Episode(agent.tools, agent.settings, environment=env)
        extra = episode.start({name: values[row] for name, values in columns.items()})
        messages = (
            [{"role": "user", "content": prompt}]
            if isinstance(prompt, str)
            else [dict(m) for m in prompt]
        )
        if system_prompt is not None and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": system_prompt})
        if extra:
            users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
            if not users:
                raise ValueError(
                    f"prompt {row} has no user message to add the environment's reset text to"
                )
            content = str(messages[users[-1]].get("content") or "")
            messages[users[-1]]["content"] = f"{content}\n\n{extra}" if content else extra
        text = render_text(
            tokenizer,
            messages,
            tools=list(episode.tools.values()),
            add_generation_prompt=True,
            template_kwargs=template_kwargs,
        )
        episodes.append(episode)
        conversations.append(messages)
        texts.append(text)
        ids.append(encode_text(tokenizer, text))
    return Episodes(episodes, conversations, texts, ids)


def environment_seeds(keys: mx.array) -> list[int]:
    """One environment seed per sequence from its sampling key ((B, 2) uint32, from
    :func:`ppo_trainer.rollout.rollout_keys`): ``key[0] * 2**32 + key[1]``, so an episode's
    environment, like its samples, is a function of (run seed, step, place in the global batch),
    whichever rank plays it and whether or not the run was resumed."""
    pairs = np.asarray(keys).astype(np.uint64)  # (B, 2)
    return [int(hi) << 32 | int(lo) for hi, lo in pairs.tolist()]


def play_episodes(
    policy: PolicyModel,
    tokenizer: Any,
    started: Episodes,
    sampling: SamplingSettings,
    *,
    template_kwargs: Mapping[str, Any],
    keys: mx.array | None = None,
) -> GenerationOutput:
    """Sample the episodes to their ends (multi-turn, KV cache kept): after each policy turn
    that ends with a stop token or a stop string (the turn's text up to it), the episode runs
    the turn's tool calls and the tool messages' tokens continue the row (after a stop string
    the template's end-of-turn token first, as context); an episode ends on a turn without
    calls, after ``max_tool_calling_iterations`` rounds, or at ``max_new_tokens`` tokens."""
    stops = set(int(t) for t in sampling.stop_token_ids)
    end_of_turn = end_of_turn_token_id(tokenizer)

    def continue_fn(row: int, turn: list[int]) -> list[int] | None:
        ended = turn[-1] in stops
        # Special tokens kept: Mistral's [TOOL_CALLS] is one (the parsers skip the others).
        text = str(tokenizer.decode(turn[:-1] if ended else turn, skip_special_tokens=False))
        if not ended:  # a stop string ended the turn: the text its last token carried after it
            text = cut_after_stop_string(text, sampling.stop_strings)
        episode = started.episodes[row]
        tool_messages = episode.step(text)
        if tool_messages is None:
            return None
        conversation = started.conversations[row]
        conversation.append(episode.assistant_message(text))
        ids = continuation_tokens(
            tokenizer,
            conversation,
            tool_messages,
            tools=list(episode.tools.values()),
            template_kwargs=template_kwargs,
            ended_turn=turn[-1] == end_of_turn,
        )
        conversation.extend(tool_messages)
        return ids

    generation = sample_episodes(policy, started.prompt_ids, sampling, continue_fn, keys)
    assert generation.turn_spans is not None
    for episode, spans in zip(started.episodes, generation.turn_spans):
        # A last turn cut by the token budget was never read (no tool call of it ran), but it
        # is an assistant turn: it counts, as get_reward()'s one-reward-per-turn expects.
        episode.turns = max(episode.turns, len(spans))
    return generation


@dataclass(frozen=True)
class EpisodeRewards:
    """The environments' rewards of a batch of episodes.

    Attributes:
        scores: (B,) float32, each episode's ``get_reward()`` float (0 for a list or none).
        action_rewards: (B, K) float32, per-action rewards (turn ``k`` of row ``b``; 0 where
            a row gave a float, none, or has fewer turns); None when no episode gave a list.
        turn_ends: (B, K) int32, the column of each policy turn's last token (-1: none).
    """

    scores: mx.array
    action_rewards: mx.array | None
    turn_ends: mx.array


def episode_rewards(episodes: Sequence[Episode], generation: GenerationOutput) -> EpisodeRewards:
    """The environments' rewards, placed on the generation's policy turns."""
    assert generation.turn_spans is not None, "a multi-turn generation has turn spans"
    ends = turn_ends(generation.turn_spans)  # (B, K)
    scores = np.zeros(len(episodes), dtype=np.float32)
    actions = np.zeros(ends.shape, dtype=np.float32)
    any_list = False
    for row, episode in enumerate(episodes):
        reward = episode.episode_reward()
        if isinstance(reward, list):
            any_list = True
            spans = generation.turn_spans[row]
            # One reward per assistant turn the episode read; a last turn cut by the token
            # budget before the episode read it gets none.
            actions[row, : min(len(reward), len(spans))] = reward[: len(spans)]
        elif reward is not None:
            scores[row] = reward
    return EpisodeRewards(mx.array(scores), mx.array(actions) if any_list else None, ends)


#: The sums behind the ``agent/`` metrics, in the order :func:`agent_counts` returns them.
AGENT_COUNTS = ("episodes", "turns", "tool_calls", "successful_calls", "context_tokens")


def agent_counts(episodes: Sequence[Episode], generation: GenerationOutput) -> dict[str, mx.array]:
    """Per episode, the counts behind the ``agent/`` metrics (:data:`AGENT_COUNTS`), each
    ``(B,)`` float32: 1 (the episode), policy turns, tool calls (malformed ones included),
    successful calls, and context (tool and environment) tokens. Per row, so that the rows a
    step keeps (dynamic sampling) carry theirs; their sums (:func:`agent_count_sums`) add up
    exactly over batches and ranks."""
    assert generation.turn_spans is not None and generation.action_mask is not None
    lengths = np.asarray(generation.lengths)
    policy_tokens = np.asarray(generation.action_mask).sum(axis=1)
    rows = {
        "episodes": [1.0] * len(episodes),
        "turns": [len(s) for s in generation.turn_spans],
        "tool_calls": [e.calls for e in episodes],
        "successful_calls": [e.successful_calls for e in episodes],
        "context_tokens": (lengths - policy_tokens).tolist(),
    }
    return {name: mx.array(np.asarray(rows[name], dtype=np.float32)) for name in AGENT_COUNTS}


def agent_count_sums(counts: Mapping[str, mx.array]) -> dict[str, float]:
    """The sums over a batch's episodes of :func:`agent_counts`' per-episode counts."""
    return {name: float(np.asarray(v, dtype=np.float64).sum()) for name, v in counts.items()}


def agent_metrics(counts: Mapping[str, float], prefix: str = "agent/") -> dict[str, float]:
    """The ``agent/`` metrics from :func:`agent_count_sums` (of one batch, or added over
    batches and ranks): ``turns`` (policy turns per episode), ``tool_calls`` (calls per
    episode), ``tool_call_success`` (successful calls / calls; 0 without calls),
    ``context_tokens`` (tool and environment tokens per episode)."""
    episodes, calls = counts["episodes"], counts["tool_calls"]
    return {
        f"{prefix}turns": counts["turns"] / episodes,
        f"{prefix}tool_calls": calls / episodes,
        f"{prefix}tool_call_success": counts["successful_calls"] / calls if calls else 0.0,
        f"{prefix}context_tokens": counts["context_tokens"] / episodes,
    }


@dataclass(frozen=True)
class AgentEpisodes:
    """The rollout source of a run with tools or environments: each sequence a multi-turn
    episode (:func:`start_episodes`, :func:`play_episodes`) whose prompt
    (``columns["prompt"]``) is rendered with its tools, then scored as
    :class:`~ppo_trainer.single_turn.SingleTurn` scores, the environments' rewards added.

    Attributes:
        models: the run's models and scorer.
        agent: the tools, environment factory and settings.
        tokenizer: the policy's, with the run's tool chat template.
        system_prompt: put first in a conversation without a system message.
        template_kwargs: the chat template's variables.
        max_prompt_length: the longest rendered prompt allowed, in tokens.
        context_length: the policy's context (None: unknown).
    """

    models: SingleTurn
    agent: AgentRun
    tokenizer: Any
    system_prompt: str | None
    template_kwargs: Mapping[str, Any]
    max_prompt_length: int
    context_length: int | None

    def rollout(
        self,
        batch: PromptBatch,
        sampling: SamplingSettings,
        keys: mx.array | None,
        plan: StepPlan | None = None,
    ) -> Rollout:
        """The episodes of ``batch``'s records (:class:`~ppo_trainer.rollout.RolloutSource`)."""
        template_kwargs = dict(self.template_kwargs)
        # Each environment's seed comes from its sequence's key (seed, step, place in the
        # global batch); an evaluation's (no keys) from the random state, as its samples.
        seed_keys = keys
        if seed_keys is None:
            seed_keys = mx.random.randint(0, 2**31 - 1, (len(batch.texts), 2)).astype(mx.uint32)
        started = start_episodes(
            self.agent,
            self.tokenizer,
            batch.columns,
            system_prompt=self.system_prompt,
            template_kwargs=template_kwargs,
            seeds=environment_seeds(seed_keys),
        )
        check_prompts(
            started.prompt_ids,
            started.texts,
            max_prompt_length=self.max_prompt_length,
            max_new_tokens=sampling.max_new_tokens,
            context_length=self.context_length,
        )
        generation = play_episodes(
            self.models.policy,
            self.tokenizer,
            started,
            sampling,
            template_kwargs=template_kwargs,
            keys=keys,
        )
        rewards = episode_rewards(started.episodes, generation)
        rollout = self.models.collect(
            PromptBatch(started.texts, started.prompt_ids, batch.columns),
            sampling,
            keys,
            with_values=plan is not None,
            generation=generation,
            environment_scores=rewards.scores,
        )
        rollout.action_rewards = rewards.action_rewards
        rollout.turn_ends = rewards.turn_ends
        rollout.agent_counts = agent_counts(started.episodes, rollout.generation)
        return rollout
