"""Prompt records: their fields reach the reward function and ``compute_scores`` as columns,
aligned with the completions; old-style rewards keep working; bad records fail before any
generation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from config.ppo_config import PPOConfig
from ppo_trainer import rollout as rollout_module
from ppo_trainer.ppo_trainer import PPOTrainer
from ppo_trainer.prompt_records import columns_for, repeat_columns, split_records

PROMPTS = ["Review of the blue kettle:", "Review of the old bakery:", "Review of the quiet park:"]
RECORDS = [{"prompt": p, "target": i, "tags": [i] * (i + 1)} for i, p in enumerate(PROMPTS)]


def make_config(tiny_model_dir: Path, tmp_path: Path, **overrides: Any) -> PPOConfig:
    settings: dict[str, Any] = dict(
        model_name=str(tiny_model_dir),
        max_new_tokens=4,
        batch_size=2,
        num_ppo_epochs=1,
        num_mini_batches=1,
        learning_rate=1e-3,
        output_dir=str(tmp_path / "run"),
        progress_bar=False,
        use_chat_template=False,  # the prompts reach the reward as they are
    )
    settings.update(overrides)
    return PPOConfig(**settings)


def trainable(trainer: PPOTrainer) -> dict[str, np.ndarray]:
    flat = dict(tree_flatten(trainer.policy.trainable_parameters()))
    return {k: np.array(v) for k, v in flat.items()}


# --------------------------------------------------------------------------- the pure helpers


def test_split_records_gives_prompts_and_aligned_columns() -> None:
    prompts, columns = split_records(RECORDS)
    assert prompts == PROMPTS
    assert columns == {"prompt": PROMPTS, "target": [0, 1, 2], "tags": [[0], [1, 1], [2, 2, 2]]}
    chat = [{"role": "user", "content": "Hi"}]
    prompts, columns = split_records(["plain text", chat])
    assert prompts == ["plain text", chat] and columns == {"prompt": ["plain text", chat]}
    # plain prompts mix with records that have no other field
    assert split_records(["a", {"prompt": "b"}])[1] == {"prompt": ["a", "b"]}


@pytest.mark.parametrize(
    "items, message",
    [
        ([{"prompt": "a"}, {"text": "b", "target": 1}], "record 1 has no 'prompt' field"),
        ([RECORDS[0], {"prompt": "b"}], "prompt 1 has the fields \\['prompt'\\] but prompt 0"),
        (["a", RECORDS[1]], "prompt 1 has the fields"),
        ([{"prompt": "a", "completions": "x"}], "named \\['completions'\\]"),
    ],
)
def test_split_records_rejects_malformed_records(items: list[Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        split_records(items)


def test_repeat_columns_repeats_each_entry_in_place() -> None:
    assert repeat_columns({"a": [1, 2], "b": ["x", "y"]}, 3) == {
        "a": [1, 1, 1, 2, 2, 2],
        "b": ["x", "x", "x", "y", "y", "y"],
    }


def test_columns_for_passes_what_a_function_accepts() -> None:
    columns: dict[str, list[Any]] = {"prompt": ["p"], "target": [1], "tags": [[1]]}

    def old_style(prompts: Any, completions: Any) -> None: ...

    def named(prompts: Any, completions: Any, target: Any, extra: int = 0) -> None: ...

    def keyword_only(prompts: Any, completions: Any, *, tags: Any) -> None: ...

    def everything(prompts: Any, completions: Any, **kwargs: Any) -> None: ...

    def needs_missing(prompts: Any, completions: Any, answer: Any) -> None: ...

    class Scorer:
        def score(self, a: Any, b: Any, c: Any, d: Any, target: Any = None) -> None: ...

    assert columns_for(old_style, columns, positional=2) == {}
    assert columns_for(named, columns, positional=2) == {"target": [1]}
    assert columns_for(keyword_only, columns, positional=2) == {"tags": [[1]]}
    assert columns_for(everything, columns, positional=2) == columns
    assert columns_for(lambda p, c: None, columns, positional=2) == {}
    assert columns_for(Scorer().score, columns, positional=4) == {"target": [1]}
    with pytest.raises(ValueError, match="needs_missing needs the column\\(s\\) \\['answer'\\]"):
        columns_for(needs_missing, columns, positional=2)


# --------------------------------------------------------------------------- in the trainer


def test_columns_reach_the_reward_aligned_with_grouped_completions(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    calls: list[dict[str, Any]] = []

    def target_reward(
        prompts: list[str], completions: list[str], target: list[int], **columns: Any
    ) -> list[float]:
        calls.append({"prompts": prompts, "completions": completions, "target": target, **columns})
        return [float(t) for t in target]

    config = make_config(tiny_model_dir, tmp_path, algorithm="grpo", group_size=3)
    trainer = PPOTrainer(config, reward_model=target_reward)
    metrics = trainer.step(RECORDS[1:])
    [call] = calls
    # prompt i's entries at 3i..3i+2, like its completions
    assert call["prompts"] == [PROMPTS[1]] * 3 + [PROMPTS[2]] * 3
    assert call["prompt"] == call["prompts"]  # the prompts as given (plain text here)
    assert call["target"] == [1, 1, 1, 2, 2, 2]
    assert call["tags"] == [[1, 1]] * 3 + [[2, 2, 2]] * 3
    assert len(call["completions"]) == 6
    assert metrics["objective/scores"] == pytest.approx(1.5)  # the scores trained on

    calls.clear()
    result = trainer.evaluate(RECORDS, num_samples=3)
    assert calls[0]["target"] == [0, 1, 2] and calls[0]["prompts"] == PROMPTS
    assert [s["reward"] for s in result["samples"]] == [0.0, 1.0, 2.0]


class ColumnScorer(PPOTrainer):
    """``compute_scores`` overridden: the score is the record's ``target`` column."""

    seen: list[dict[str, Any]]

    def compute_scores(
        self,
        prompts: list[str],
        completions: list[str],
        query_responses: mx.array,
        sequence_lengths: mx.array,
        **columns: Any,
    ) -> mx.array:
        self.seen.append({"prompts": prompts, **columns})
        return mx.array(columns["target"], dtype=mx.float32)


class OldStyleScorer(PPOTrainer):
    """An override written before prompt records: it takes no columns."""

    def compute_scores(
        self,
        prompts: list[str],
        completions: list[str],
        query_responses: mx.array,
        sequence_lengths: mx.array,
        **unused: Any,
    ) -> mx.array:
        return mx.array([float(len(c)) for c in completions])


def test_a_compute_scores_override_receives_the_columns(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # PPO, two updates (LoRA: the first moves only lora_b)
    config = make_config(tiny_model_dir, tmp_path, group_size=2, batch_size=3, num_ppo_epochs=2)
    trainer = ColumnScorer(config)
    trainer.seen = []
    before = trainable(trainer)
    metrics = trainer.step(RECORDS)
    [seen] = trainer.seen
    assert seen["target"] == [0, 0, 1, 1, 2, 2]
    assert seen["prompts"] == [p for p in PROMPTS for _ in range(2)]
    assert seen["tags"][2:4] == [[1, 1], [1, 1]]
    assert metrics["objective/scores"] == pytest.approx(1.0)
    after = trainable(trainer)
    assert all(not np.array_equal(before[k], after[k]) for k in before)  # it trained on them
    trainer.seen = []
    result = trainer.evaluate(RECORDS[::-1])
    assert trainer.seen[0]["target"] == [2, 1, 0]
    assert result["eval/mean_reward"] == pytest.approx(1.0)


def test_old_style_rewards_ignore_the_columns(tiny_model_dir: Path, tmp_path: Path) -> None:
    def brevity(prompts: list[str], completions: list[str]) -> list[float]:
        return [-float(len(c)) for c in completions]

    config = make_config(tiny_model_dir, tmp_path)
    metrics = PPOTrainer(config, reward_model=brevity).step(RECORDS[:2])
    assert np.isfinite(metrics["objective/scores"]) and metrics["objective/scores"] <= 0
    metrics = OldStyleScorer(config).step(RECORDS[:2])
    assert metrics["objective/scores"] >= 0


def test_bad_records_fail_before_any_generation(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_generation(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("generated before the records were checked")

    monkeypatch.setattr(rollout_module, "generate", no_generation)

    def needs_answer(prompts: list[str], completions: list[str], answer: list[str]) -> list[float]:
        raise AssertionError("not reached")

    config = make_config(tiny_model_dir, tmp_path)
    trainer = PPOTrainer(config, reward_model=needs_answer)
    no_prompt = [{"prompt": "a", "answer": "x"}, {"text": "b", "answer": "y"}]
    for call in (trainer.train, trainer.step, trainer.evaluate):
        with pytest.raises(ValueError, match="record 1 has no 'prompt' field"):
            call(no_prompt)
    for call in (trainer.train, trainer.step, trainer.evaluate):
        with pytest.raises(ValueError, match="needs the column\\(s\\) \\['answer'\\]"):
            call(RECORDS[:2])
    with pytest.raises(ValueError, match="needs the column"):
        trainer.train([{"prompt": "a", "answer": "x"}] * 2, eval_prompts=PROMPTS)
    assert trainer.global_step == 0


def test_a_prompt_files_other_fields_become_columns(tmp_path: Path) -> None:
    from main import read_prompts

    chat = [{"role": "user", "content": "Hi"}]
    lines = [{"prompt": "a", "letter": "e"}, {"messages": chat, "letter": "o"}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    prompts = read_prompts(path)
    assert prompts == [{"prompt": "a", "letter": "e"}, {"prompt": chat, "letter": "o"}]
    assert split_records(prompts)[1]["letter"] == ["e", "o"]
    path.write_text(json.dumps({"prompt": "a"}) + "\n")
    assert read_prompts(path) == ["a"]  # no other field: a plain prompt


# --------------------------------------------------------------------------- called by keyword


def test_reward_arguments_call_trl_style_functions_by_keyword() -> None:
    from ppo_trainer.prompt_records import reward_arguments

    columns: dict[str, list[Any]] = {"prompt": ["q"], "answer": ["4"], "completion_ids": [[7, 2]]}

    def trl_style(completions: list[str], **kwargs: Any) -> list[float]:
        return [0.0]

    def named(prompts: list[str], completions: list[str], answer: list[str]) -> list[float]:
        return [0.0]

    def needs_missing(completions: list[str], solution: list[str]) -> list[float]:
        return [0.0]

    args, kwargs = reward_arguments(trl_style, ["Q"], ["c"], columns)
    assert args == () and kwargs == {"prompts": ["Q"], "completions": ["c"], **columns}
    trl_style(*args, **kwargs)  # the call that raised TypeError when made positionally
    args, kwargs = reward_arguments(named, ["Q"], ["c"], columns)
    assert args == () and kwargs == {"prompts": ["Q"], "completions": ["c"], "answer": ["4"]}
    # only **kwargs: everything by keyword
    assert reward_arguments(lambda **kw: None, ["Q"], ["c"], columns)[1]["completions"] == ["c"]
    # a function that names no `completions` keeps the classic positional call
    assert reward_arguments(lambda p, c: None, ["Q"], ["c"], columns) == ((["Q"], ["c"]), {})
    with pytest.raises(ValueError, match="needs_missing needs the column\\(s\\) \\['solution'\\]"):
        reward_arguments(needs_missing, ["Q"], ["c"], columns)


def test_a_reward_of_the_wrong_length_or_column_fails_before_any_rollout(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[list[str]] = []

    def per_prompt(prompts: list[str], completions: list[str]) -> list[float]:
        calls.append(completions)
        return [0.0] * len(set(prompts))  # one per distinct prompt: a group's worth too few

    def scalar(completions: list[str], **kwargs: Any) -> Any:
        return 0.0

    def right(completions: list[str], **kwargs: Any) -> Any:
        return [None] * len(completions)

    def no_generation(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("generated before checking the reward")

    monkeypatch.setattr(rollout_module, "sample_responses", no_generation)
    records = [{"prompt": p, "answer": "B"} for p in PROMPTS[:2]]
    grpo = dict(algorithm="grpo", group_size=2, beta=0.0, batch_size=1)
    trainer = PPOTrainer(make_config(tiny_model_dir, tmp_path, **grpo), reward_model=per_prompt)
    message = "the reward per_prompt returned 1 scores for 2 completions in a trial call"
    with pytest.raises(ValueError, match=message):
        trainer.train(records)
    assert calls == [["", ""]]  # once, on the first prompt twice, empty completions
    trainer.rewards.fn = scalar
    with pytest.raises(ValueError, match="the reward scalar returned float 0.0, not a list"):
        trainer.train(records)
    trainer.rewards.fn = right
    trainer.preparation.check_reward_call(records)  # a right one passes

    def first_word(completions: list[str], **kwargs: Any) -> list[float]:
        return [float(len(c.split()[0])) for c in completions]  # fails on an empty completion

    trainer.rewards.fn = first_word
    with pytest.raises(IndexError) as raised:
        trainer.train(records)
    assert "raised by the reward first_word in a trial call before training" in "".join(
        raised.value.__notes__
    )
    import rewards

    monkeypatch.setitem(
        rewards.registry._REGISTRY,
        "test_scalar",
        rewards.RewardInfo("test_scalar", scalar, (), "A scalar."),
    )
    funcs = make_config(
        tiny_model_dir, tmp_path, reward_funcs=["mcq_accuracy", "test_scalar"], **grpo
    )
    with pytest.raises(ValueError, match="the reward test_scalar returned float"):
        PPOTrainer(funcs).train(records)
    # A column a built-in reads, missing from the records: named before any rollout too.
    with pytest.raises(ValueError, match=r"mcq_accuracy needs the column\(s\) \['answer'\]"):
        PPOTrainer(funcs).train(PROMPTS[:2])


def test_a_trl_style_reward_trains_and_gets_the_completion_ids(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    calls: list[dict[str, Any]] = []

    def length_reward(completions: list[str], **kwargs: Any) -> list[float]:
        calls.append({"completions": completions, **kwargs})
        return [float(len(ids)) for ids in kwargs["completion_ids"]]

    config = make_config(tiny_model_dir, tmp_path)
    trainer = PPOTrainer(config, reward_model=length_reward)
    before = trainable(trainer)
    metrics = trainer.step(RECORDS[:2])
    [call] = calls
    assert call["prompts"] == PROMPTS[:2] and call["target"] == [0, 1]
    for ids, text in zip(call["completion_ids"], call["completions"]):
        assert 1 <= len(ids) <= 4 and all(isinstance(i, int) for i in ids)
        assert trainer.tokenizer.decode(ids).startswith(text)  # the stop token may follow
    assert metrics["objective/scores"] >= 1
    after = trainable(trainer)
    assert any(not np.array_equal(before[k], after[k]) for k in before)


def test_a_reward_with_a_wrong_signature_fails_before_any_generation(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def needs_solution(completions: list[str], solution: list[str]) -> list[float]:
        return [0.0] * len(completions)

    def no_generation(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("generated before checking the reward's signature")

    monkeypatch.setattr(rollout_module, "sample_responses", no_generation)
    trainer = PPOTrainer(make_config(tiny_model_dir, tmp_path), reward_model=needs_solution)
    with pytest.raises(ValueError, match="needs the column\\(s\\) \\['solution'\\]"):
        trainer.step(RECORDS[:2])
