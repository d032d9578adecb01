"""PPOTrainer with tools and environments (agents): one step per algorithm on a tiny model with a
tool-capable chat template, and the configuration errors that stop a run before any rollout.

The random tiny model writes no ``<tool_call>``: the tests read its turns with
:func:`every_turn_calls` (a ``tool_call_parser`` function), and end its turns on frequent tokens
(``stop_token_ids``), so that every episode has several turns and tool results.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from agents import ParsedTurn, ToolCall
from base_setup.tokenizer_setup import end_of_turn_token_id
from config.ppo_config import PPOConfig
from experience_buffer.buffer import RolloutBatch
from fixtures.checkpoint_families import _QWEN_TOOLS_MESSAGES, build_family_checkpoint
from models.policy_model import PolicyModel
from ppo_trainer.callbacks import TrainerCallback
from ppo_trainer.generator import generate
from ppo_trainer.inspector import write_inspector
from ppo_trainer.metrics import agent_metrics_over_ranks
from ppo_trainer.ppo_trainer import PPOTrainer
from ppo_trainer.rollout import Rollout
from ppo_trainer.rollout_records import read_rollout_records
from tests.test_advantage import _ThreadRanks, threaded_all_sum  # noqa: F401 (a fixture)
from tests.resume_checks import StopAt, without_timings

PROMPTS = [
    {"prompt": "What is stored under apple?", "target": 2},
    {"prompt": "Look up the pear.", "target": 1},
]


def lookup(key: str) -> str:
    """Look up the value stored under a key.

    Args:
        key: The key to look up.
    """
    return f"value of {key!r}"


def every_turn_calls(text: str) -> ParsedTurn:
    """A parser for a random model: every turn calls a tool, ``lookup`` when the turn has an
    even number of characters, else an unknown tool (a failed call)."""
    name = "lookup" if len(text) % 2 == 0 else "missing_tool"
    return ParsedTurn(calls=[ToolCall(name, {"key": text[:3]})], errors=[])


def every_turn_increments(text: str) -> ParsedTurn:
    """Every turn calls the environment's ``increment``."""
    return ParsedTurn(calls=[ToolCall("increment", {"by": 1})], errors=[])


class Counter:
    """An environment whose tool counts; rewards per action (one per assistant turn)."""

    def reset(self, **record: Any) -> str:
        self.count, self.target = 0, int(record["target"])
        return f"Count to {self.target}."

    def increment(self, by: int) -> str:
        """Add to the counter.

        Args:
            by: How much to add.
        """
        self.count += by
        return str(self.count)

    def get_reward(self) -> list[float]:
        # One reward per assistant turn: 1 while the count has not passed the target.
        return [1.0 if k < self.target else -1.0 for k in range(self.count + 1)]


class EpisodeScore:
    """An environment that scores the episode with one float."""

    def reset(self, **record: Any) -> None:
        self.calls = 0

    def increment(self, by: int) -> str:
        """Add to the counter.

        Args:
            by: How much to add.
        """
        self.calls += by
        return "ok"

    def get_reward(self) -> float:
        return float(self.calls)


#: Qwen3's tool template with a short tools header (the tools' names, not their schemas): the
#: tiny tokenizer spends about one token per character, and the prompts stay short.
SHORT_TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}"
    "{%- for tool in tools %}{{- ' ' + tool.function.name }}{%- endfor %}"
    "{{- '</tools><|im_end|>\\n' }}{%- endif %}"
    + _QWEN_TOOLS_MESSAGES
    + "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The qwen3_tools family checkpoint with :data:`SHORT_TOOLS_TEMPLATE`."""
    path = build_family_checkpoint(tmp_path_factory.mktemp("qwen3_tools"), "qwen3_tools")
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = SHORT_TOOLS_TEMPLATE
    config_path.write_text(json.dumps(config), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def frequent_tokens(tools_model: Path) -> list[int]:
    """The random model's most frequent sampled tokens: as stop tokens they end turns early."""
    return most_frequent_tokens(tools_model)


def most_frequent_tokens(model: Path) -> list[int]:
    """The ten tokens ``model`` samples most often from three short prompts."""
    policy = PolicyModel.from_pretrained(model)
    prompts = [policy.tokenizer.encode(t) for t in ("Hello there", "What is it", "A b c")]
    mx.random.seed(0)
    out = generate(
        policy, prompts, max_new_tokens=32, temperature=1.0, stop_token_ids=[], pad_token_id=0
    )
    ids, counts = np.unique(np.array(out.responses), return_counts=True)
    return [int(i) for i in ids[np.argsort(-counts)][:10]]


def make_config(model: Path, tmp_path: Path, stops: list[int], **overrides: Any) -> PPOConfig:
    settings: dict[str, Any] = dict(
        model_name=str(model),
        max_new_tokens=96,
        max_prompt_length=128,
        batch_size=2,
        learning_rate=1e-3,
        num_ppo_epochs=1,
        use_lora=False,
        num_mini_batches=1,
        output_dir=str(tmp_path / "run"),
        progress_bar=False,
        seed=0,
        stop_token_ids=stops,
        max_tool_calling_iterations=2,
        tool_call_parser="tests.test_agent_trainer:every_turn_calls",
    )
    settings.update(overrides)
    return PPOConfig(**settings)


def trainable(model: Any) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in dict(tree_flatten(model.trainable_parameters())).items()}


class Capture(TrainerCallback):
    """Keeps the step's rollout and batch."""

    rollout: Rollout
    batch: RolloutBatch

    def on_rollout_scored(self, trainer: PPOTrainer, step: int, rollout: Rollout) -> None:
        self.rollout = rollout

    def on_rollout_end(self, trainer: PPOTrainer, step: int, batch: RolloutBatch) -> None:
        self.batch = batch


def run_step(trainer: PPOTrainer, prompts: list[Any]) -> tuple[dict[str, float], Capture]:
    capture = Capture()
    trainer.run.callbacks = [capture]
    before = {"policy": trainable(trainer.policy)}
    if trainer.value_model is not None:
        before["value"] = trainable(trainer.value_model)
    metrics = trainer.step(prompts)
    after = {"policy": trainable(trainer.policy)}
    if trainer.value_model is not None:
        after["value"] = trainable(trainer.value_model)
    for name in before:
        unchanged = [k for k in before[name] if np.array_equal(before[name][k], after[name][k])]
        assert not unchanged, f"{name} parameters not updated: {unchanged}"
    # Context (tool) tokens carry no loss weight: the batch's mask is the policy's tokens only.
    gen = capture.rollout.generation
    assert gen.action_mask is not None
    lengths = np.array(gen.lengths)
    context = (np.arange(gen.responses.shape[1])[None, :] < lengths[:, None]) & (
        np.array(gen.action_mask) == 0
    )
    assert context.any(), "the episodes should hold tool tokens"
    assert not np.array(capture.batch.mask)[context].any()
    assert metrics["agent/turns"] > 1
    return metrics, capture


@pytest.mark.slow
def test_ppo_with_an_environment_rewarding_each_action(
    tools_model: Path, frequent_tokens: list[int], tmp_path: Path
) -> None:
    config = make_config(
        tools_model,
        tmp_path,
        frequent_tokens,
        max_new_tokens=160,  # room for every turn: the per-turn rewards count on all of them
        num_ppo_epochs=2,  # the value head starts at 0: its backbone moves from the 2nd update
        log_rollouts_every=1,
        tool_call_parser="tests.test_agent_trainer:every_turn_increments",
    )
    trainer = PPOTrainer(config, environment_factory=Counter)
    metrics, capture = run_step(trainer, PROMPTS)
    assert metrics["agent/tool_call_success"] == 1.0
    rollout = capture.rollout
    assert rollout.action_rewards is not None and rollout.turn_ends is not None
    # The environment's reset text reached the prompt.
    assert "Count to 2." in rollout.texts[0]
    # Per-action rewards (3 turns: 2 rounds of calls, then the turn that may not call):
    # 1 while the count is below the target (2, then 1), -1 after.
    assert np.array(rollout.action_rewards).tolist() == [[1.0, 1.0, -1.0], [1.0, -1.0, -1.0]]
    # The records show the turns: the policy's tokens carry numbers, the tools' tokens none.
    (steps,) = read_rollout_records(tmp_path / "run")
    record = steps.records[0]
    actions = record["actions"]
    assert 0 in actions and len(actions) == record["length"] and len(record["turns"]) == 3
    for key in ("value", "logprob", "advantage", "return", "kl"):
        assert [x is None for x in record[key]] == [a == 0 for a in actions], key
    assert (
        "".join(record["tokens"][i] for i, a in enumerate(actions) if a == 0).count(
            "<tool_response>"
        )
        == 2
    )
    page = write_inspector(tmp_path / "run")
    assert "tool tokens" in page.read_text(encoding="utf-8")


def test_grpo_with_function_tools(
    tools_model: Path, frequent_tokens: list[int], tmp_path: Path
) -> None:
    config = make_config(tools_model, tmp_path, frequent_tokens, algorithm="grpo", group_size=2)

    def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        return [float(len(c) % 5) for c in completions]

    trainer = PPOTrainer(config, tools=[lookup], reward_model=reward)
    metrics, capture = run_step(trainer, PROMPTS)
    assert 0.0 <= metrics["agent/tool_call_success"] <= 1.0
    assert metrics["agent/tool_calls"] > 0
    assert "<tools> lookup</tools>" in capture.rollout.texts[0]  # the tools are in the prompt
    result = trainer.evaluate(PROMPTS, max_new_tokens=96, temperature=1.0, num_samples=1)
    assert result["eval/agent/turns"] >= 1 and "eval/agent/tool_call_success" in result


@pytest.mark.slow
def test_stop_strings_end_a_turn_as_the_end_of_turn_token_does(
    tools_model: Path, frequent_tokens: list[int], tmp_path: Path
) -> None:
    """A stop string ends the policy's turn: the tool results follow it (the template's
    end-of-turn token first, as context), and the episode's completion ends with it."""
    tokens = frequent_tokens[:6]  # the others are left to the stop string
    probe = PolicyModel.from_pretrained(tools_model).tokenizer
    stop = next(
        text
        for t in frequent_tokens[6:]
        if (text := str(probe.decode([t], skip_special_tokens=True)).strip())
    )
    config = make_config(
        tools_model, tmp_path, tokens, algorithm="grpo", group_size=2, stop_strings=[stop]
    )

    def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        return [float(len(c) % 5) for c in completions]

    trainer = PPOTrainer(config, tools=[lookup], reward_model=reward)
    metrics, capture = run_step(trainer, PROMPTS)
    gen = capture.rollout.generation
    assert gen.turn_spans is not None and gen.stopped_by_string is not None
    responses = np.array(gen.responses)
    decode = trainer.decode_completion
    end_of_turn = end_of_turn_token_id(trainer.tokenizer)
    by_string = 0
    for row, spans in enumerate(gen.turn_spans):
        for k, (start, end) in enumerate(spans):
            turn = responses[row, start:end].tolist()
            if turn[-1] in tokens:
                continue
            last_turn = k == len(spans) - 1
            if not last_turn:  # ended by the string (only a last turn is cut by the budget)
                assert stop in decode(turn) and stop not in decode(turn[:-1])
                assert responses[row, end] == end_of_turn  # the context closes the turn
                by_string += 1
            elif bool(gen.stopped_by_string[row].item()):
                assert capture.rollout.completions[row].endswith(stop)
    assert by_string > 0, "some turns should end at the stop string"


def test_rloo_scored_by_the_environment_alone(
    tools_model: Path, frequent_tokens: list[int], tmp_path: Path
) -> None:
    config = make_config(
        tools_model,
        tmp_path,
        frequent_tokens,
        algorithm="rloo",
        group_size=2,
        tool_call_parser="tests.test_agent_trainer:every_turn_increments",
    )
    trainer = PPOTrainer(config, environment_factory=EpisodeScore)  # no reward: the env's
    metrics, capture = run_step(trainer, PROMPTS)
    # Each episode's score is its number of calls (all successful): the environment's reward.
    scores = np.array(capture.rollout.scores)
    assert scores.mean() == pytest.approx(metrics["agent/tool_calls"]) and scores.max() >= 1
    assert metrics["agent/tool_call_success"] == 1.0


def no_docstring(key: str) -> str:
    return key


class NoReset:
    def act(self, x: int) -> int:
        """Act.

        Args:
            x: A number.
        """
        return x


def test_a_chatml_checkpoint_without_tool_support_trains_with_tool_chat_template(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The embedded tiny model's ChatML template renders no tools (SmolLM2-Instruct's case): the
    run is refused naming the setting, and with ``tool_chat_template: chatml_tools`` the tools
    are described in the prompt, their results rendered, and a GRPO step trains."""

    def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        return [float(len(c) % 5) for c in completions]

    stops = most_frequent_tokens(tiny_model_dir)
    plain = make_config(tiny_model_dir, tmp_path, stops, algorithm="grpo", group_size=2)
    with pytest.raises(ValueError, match="tool_chat_template: chatml_tools"):
        PPOTrainer(plain, tools=[lookup], reward_model=reward)
    config = make_config(
        tiny_model_dir,
        tmp_path,
        stops,
        algorithm="grpo",
        group_size=2,
        max_prompt_length=1024,  # the tools' JSON schemas, about a token per character here
        tool_chat_template="chatml_tools",
    )
    trainer = PPOTrainer(config, tools=[lookup], reward_model=reward)
    metrics, capture = run_step(trainer, PROMPTS)
    assert metrics["agent/tool_calls"] > 0
    text = capture.rollout.texts[0]
    assert '<tools>\n{"type": "function", "function": {"name": "lookup"' in text
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    gen = capture.rollout.generation
    assert gen.action_mask is not None
    rows = [
        [t for t, a in zip(r, m) if a == 0]
        for r, m in zip(np.array(gen.responses).tolist(), np.array(gen.action_mask).tolist())
    ]
    context = [trainer.tokenizer.decode(row) for row in rows if row]
    assert any("<tool_response>" in c for c in context), context  # the built-in template's


def test_configuration_errors_stop_the_run_before_any_rollout(
    tools_model: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = make_config(tools_model, tmp_path, [0])
    with pytest.raises(ValueError, match="no_docstring"):
        PPOTrainer(config, tools=[no_docstring], reward_model=lambda p, c: [0.0] * len(c))
    with pytest.raises(ValueError, match="no reset method"):
        PPOTrainer(config, environment_factory=NoReset, reward_model=lambda p, c: [0.0] * len(c))
    plain = make_config(tiny_model_dir, tmp_path, [0])  # ChatML without tools
    with pytest.raises(ValueError, match="ignores tools"):
        PPOTrainer(plain, tools=[lookup], reward_model=lambda p, c: [0.0] * len(c))
    with pytest.raises(ValueError, match="async_rollout"):
        PPOTrainer(
            make_config(tools_model, tmp_path, [0], async_rollout=True),
            tools=[lookup],
            reward_model=lambda p, c: [0.0] * len(c),
        )


def test_agent_metrics_are_the_global_batchs_over_two_ranks(threaded_all_sum: None) -> None:
    """Each rank's episode sums add up over the ranks before dividing: the tool-call success is
    all successful calls / all calls (7/8 here), not the mean of the ranks' rates (0.75)."""
    counts = [
        {"episodes": 2, "turns": 3, "tool_calls": 2, "successful_calls": 1, "context_tokens": 10},
        {"episodes": 2, "turns": 7, "tool_calls": 6, "successful_calls": 6, "context_tokens": 30},
    ]
    keys = ("agent/turns", "agent/tool_calls", "agent/tool_call_success", "agent/context_tokens")

    def on_rank(group: Any, rank: int) -> mx.array:
        metrics = agent_metrics_over_ranks({k: float(v) for k, v in counts[rank].items()}, group)
        return mx.array([metrics[k] for k in keys])

    got = _ThreadRanks().run(on_rank)
    want = [10 / 4, 8 / 4, 7 / 8, 40 / 4]
    np.testing.assert_allclose(got, [want, want], rtol=1e-6)


class Dice:
    """A seeded environment: its reset text, tool results and reward come from its own random
    numbers (``seed``: the trainer's per-rollout seed; None: unseeded, as TRL builds it)."""

    seeds: list[int | None] = []  # every seed it was built with (a test's record)

    def __init__(self, seed: int | None = None) -> None:
        Dice.seeds.append(seed)
        self.rng = random.Random(seed)

    def reset(self, **record: Any) -> str:
        self.total = 0
        return f"Roll {self.rng.randint(1, 6)}."

    def increment(self, by: int) -> str:
        """Roll the die and add it, times a factor.

        Args:
            by: The factor.
        """
        self.total += by * self.rng.randint(1, 6)
        return str(self.total)

    def get_reward(self) -> float:
        return self.total + self.rng.random()


def length(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    return [float(len(c)) for c in completions]


@pytest.mark.slow
def test_a_run_with_seeded_environments_resumes_exactly_and_names_a_changed_factory(
    tools_model: Path,
    frequent_tokens: list[int],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PPO_MLX_ADAPTIVE_BLAS", "off")  # two fresh runs: the same BLAS threads
    settings: dict[str, Any] = dict(
        algorithm="grpo",
        group_size=2,
        save_every=100,
        tool_call_parser="tests.test_agent_trainer:every_turn_increments",
    )

    def config(name: str) -> PPOConfig:
        return make_config(
            tools_model, tmp_path / name, frequent_tokens, max_new_tokens=64, **settings
        )

    Dice.seeds.clear()
    straight = PPOTrainer(config("a"), environment_factory=Dice)
    initial = trainable(straight.policy)
    straight_history = straight.train(PROMPTS, num_epochs=2)
    assert len(straight_history) == 2
    # Each episode's environment has its own seed (4 per step), a function of the run's seed.
    played = Dice.seeds[-8:]
    assert None not in played and len(set(played)) == 8

    first = PPOTrainer(config("b"), environment_factory=Dice)
    first.train(PROMPTS, num_epochs=2, callbacks=[StopAt(1)])
    assert first.global_step == 1
    second = PPOTrainer(config("b"), environment_factory=Dice)
    resumed_history = second.train(PROMPTS, num_epochs=2, resume_from="latest")
    assert Dice.seeds[-4:] == played[-4:]  # step 2's environments, rebuilt from their seeds

    assert without_timings(resumed_history) == without_timings(straight_history)
    assert straight_history[0]["objective/scores_std"] > 0  # the dice made the scores differ
    final, resumed = trainable(straight.policy), trainable(second.policy)
    for key in final:
        assert not np.array_equal(final[key], initial[key]), f"{key} did not train"
        np.testing.assert_array_equal(resumed[key], final[key], err_msg=key)

    # Resuming with another environment factory, or none, names it before any step.
    for other in (dict(environment_factory=Counter), dict(tools=[lookup], reward_model=length)):
        with pytest.raises(ValueError, match=r"environment factory.*test_agent_trainer:Dice ->"):
            PPOTrainer(config("b"), **other).train(PROMPTS, num_epochs=3, resume_from="latest")
