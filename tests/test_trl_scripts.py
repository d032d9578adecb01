"""TRL's documented GRPO / RLOO scripts run here with only their imports changed (issue #50).

The scripts are those of TRL's documentation (``docs/source/grpo_trainer.md``: the quick start and
the reward functions of "Using a custom reward function"; ``rloo_trainer.md``'s quick start):
the import lines changed and, since tests download nothing, a tiny local model and an in-memory
``datasets.Dataset`` in place of the Hub's. The reward functions keep the documented signatures
and read the documented shapes (``completion[0]["content"]`` for a conversational dataset).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest
from datasets import Dataset

from config.ppo_config import PPOConfig
from config.trl_names import MODEL_FROM_TRAINER, from_peft_config
from ppo_trainer.callbacks import TrainerCallback
from ppo_trainer.trl_data import TrainerState, dataset_records, trl_reward
from tests.test_ppo_trainer import assert_all_changed, trainable

MATH_ROWS = [
    {"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "solution": str(2 * i)}
    for i in range(8)
]


@dataclass
class LoraConfig:
    """Stands for ``peft.LoraConfig`` (PEFT is not installed here): the attributes a TRL
    script sets, with PEFT's defaults."""

    r: int = 8
    lora_alpha: int = 8
    lora_dropout: float = 0.0
    target_modules: list[str] | str | None = None
    task_type: str = "CAUSAL_LM"
    bias: str = "none"
    use_dora: bool = False
    modules_to_save: list[str] | None = None
    layers_to_transform: list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@pytest.mark.parametrize("trainer_name", ["GRPOTrainer", "RLOOTrainer"])
def test_the_quick_start(
    trainer_name: str, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the default output_dir is relative, as TRL's
    model_path = str(tiny_model_dir)  # was "Qwen/Qwen2-0.5B-Instruct"
    dataset = Dataset.from_list(MATH_ROWS)  # was load_dataset("trl-lib/DeepMath-103K", ...)

    # was: from trl import GRPOTrainer (RLOOTrainer); from trl.rewards import accuracy_reward
    from ppo_trainer.trl_names import GRPOTrainer, RLOOTrainer
    from rewards.builtin import math_accuracy as accuracy_reward

    Trainer = {"GRPOTrainer": GRPOTrainer, "RLOOTrainer": RLOOTrainer}[trainer_name]
    trainer = Trainer(
        model=model_path,
        reward_funcs=accuracy_reward,
        train_dataset=dataset,
    )
    metrics = trainer.train()

    # TRL's defaults: num_generations 8 (GRPO) or 2 (RLOO), one pass over the 8 prompts.
    assert trainer.config.model_name == model_path
    assert trainer.config.group_size == (8 if trainer_name == "GRPOTrainer" else 2)
    assert len(metrics) == 1 and "objective/scores" in metrics[0]
    assert (tmp_path / trainer.config.output_dir).is_dir()


def test_the_documented_rewards_on_a_standard_dataset(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Examples 1, 1.1 and 3 (length in tokens and in characters, a ``ground_truth`` column),
    weighted with reward_weights, with the TRL keys a script sets."""
    seen: dict[str, Any] = {}
    model_path = str(tiny_model_dir)
    dataset = Dataset.from_list(  # was a Hub dataset with a ground_truth column
        [
            {"prompt": f"Problem: solve {i}x = {2 * i}. Solution:", "ground_truth": "2"}
            for i in range(1, 5)
        ]
    )

    # was: from trl import GRPOConfig, GRPOTrainer
    from ppo_trainer.trl_names import GRPOConfig, GRPOTrainer

    def reward_len_tokens(completions_ids, **kwargs):
        """Example 1: longer completions (in tokens) score higher."""
        seen["tokens"] = dict(completions_ids=completions_ids, **kwargs)
        return [float(len(ids)) for ids in completions_ids]

    def reward_len_chars(completions, **kwargs):
        """Example 1.1: the same in characters."""
        seen["chars"] = dict(completions=completions, **kwargs)
        return [float(len(completion)) for completion in completions]

    def reward_boxed(completions, ground_truth, **kwargs):
        """Example 3: 1 if the boxed answer is the ground truth."""
        found = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
        answers = [m.group(1) if m else "" for m in found]
        return [1.0 if a == gt else 0.0 for a, gt in zip(answers, ground_truth)]

    training_args = GRPOConfig(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=16,
        max_steps=2,
        logging_steps=1,
        report_to="none",
        reward_weights=[0.1, 0.1, 1.0],
        seed=0,
    )
    trainer = GRPOTrainer(
        model=model_path,
        reward_funcs=[reward_len_tokens, reward_len_chars, reward_boxed],
        args=training_args,
        train_dataset=dataset,
    )
    before = trainable(trainer.policy.model)
    metrics = trainer.train()
    trainer.save_model(training_args.output_dir)  # how TRL's example scripts end

    assert_all_changed(before, trainable(trainer.policy.model))  # LoRA: both steps' updates
    assert (tmp_path / "run" / "final" / "adapters.safetensors").is_file()
    assert (trainer.config.batch_size, trainer.config.group_size) == (2, 2)
    for name in ("reward_len_tokens", "reward_len_chars", "reward_boxed"):
        assert f"rewards/{name}/mean" in metrics[-1]
    # TRL's call: the prompts as the dataset gave them, text completions, completion_ids,
    # trainer_state, the two logging functions, and every column but prompt.
    call = seen["chars"]
    assert set(call) == {
        "completions",
        "prompts",
        "completion_ids",
        "trainer_state",
        "log_extra",
        "log_metric",
        "ground_truth",
    }
    assert all(isinstance(c, str) for c in call["completions"])
    assert call["prompts"][0] in dataset["prompt"] and len(call["prompts"]) == 4
    assert call["ground_truth"] == ["2"] * 4
    assert isinstance(call["trainer_state"], TrainerState)
    assert call["trainer_state"].global_step == 1 and call["trainer_state"].max_steps == 2
    tokens = seen["tokens"]
    assert tokens["completions_ids"] is tokens["completion_ids"]  # the docs' spelling too
    assert all(1 <= len(ids) <= 16 for ids in tokens["completions_ids"])


def test_the_documented_rewards_on_a_conversational_dataset(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Example 2 (a format reward on ``completion[0]["content"]``) and Example 4 (task rewards
    that return None where they do not apply), with ``peft_config``."""
    seen: dict[str, Any] = {}
    model_path = str(tiny_model_dir)
    dataset = Dataset.from_list(  # Example 4's dataset
        [
            {"prompt": [{"role": "user", "content": "What is 2+2?"}], "task": "math"},
            {"prompt": [{"role": "user", "content": "Write a sum function."}], "task": "code"},
            {"prompt": [{"role": "user", "content": "What is 3*4?"}], "task": "math"},
            {"prompt": [{"role": "user", "content": "Write a product function."}], "task": "code"},
        ]
    )

    # was: from trl import GRPOConfig, GRPOTrainer; from peft import LoraConfig
    from ppo_trainer.trl_names import GRPOConfig, GRPOTrainer

    def format_reward_func(completions, **kwargs):
        """Example 2: the DeepSeek-R1 format, on each completion's one assistant message."""
        seen["format"] = dict(completions=completions, **kwargs)
        pattern = r"^<think>.*?</think><answer>.*?</answer>$"
        contents = [completion[0]["content"] for completion in completions]
        return [1.0 if re.match(pattern, content) else 0.0 for content in contents]

    def math_reward_func(prompts, completions, task, **kwargs):
        """Example 4: math prompts only (a stand-in check: shorter is better)."""
        return [
            -len(c[0]["content"]) / 10 if t == "math" else None for c, t in zip(completions, task)
        ]

    def coding_reward_func(prompts, completions, task, **kwargs):
        """Example 4: code prompts only (a stand-in check: it defines something)."""
        return [
            float("def" in c[0]["content"]) if t == "code" else None
            for c, t in zip(completions, task)
        ]

    training_args = GRPOConfig(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=16,  # every prompt in each step: math ones teach
        num_generations=4,
        max_completion_length=16,
        num_train_epochs=2,
        report_to="none",
    )
    trainer = GRPOTrainer(
        model=model_path,
        reward_funcs=[format_reward_func, math_reward_func, coding_reward_func],
        args=training_args,
        train_dataset=dataset,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    assert (trainer.config.lora_r, trainer.config.lora_alpha) == (4, 8.0)
    before = trainable(trainer.policy.model)
    assert before and all(
        re.search(r"self_attn\.(q_proj|v_proj)\.lora_[ab]$", name) for name in before
    )
    metrics = trainer.train()

    assert_all_changed(before, trainable(trainer.policy.model))
    assert "rewards/math_reward_func/mean" in metrics[-1]
    call = seen["format"]
    assert "prompt" not in call and len(call["prompts"]) == len(call["task"]) == 16
    task_of = {row["prompt"][0]["content"]: row["task"] for row in dataset}
    for prompt, task in zip(call["prompts"], call["task"]):  # the messages, as given
        assert prompt == [{"role": "user", "content": prompt[0]["content"]}]
        assert task_of[prompt[0]["content"]] == task
    for completion in call["completions"]:
        assert len(completion) == 1 and completion[0]["role"] == "assistant"
        assert isinstance(completion[0]["content"], str)


def test_messages_records_train(tiny_model_dir: Path, tmp_path: Path) -> None:
    """``{"messages": [...], "answer": ...}`` records, as the command line reads them."""
    from ppo_trainer.trl_names import GRPOConfig, GRPOTrainer

    answers: list[str] = []

    def exact(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
        answers.extend(answer)
        texts = [c[0]["content"] for c in completions]
        return [float(t.strip() == a) - len(t) / 50 for t, a in zip(texts, answer)]

    records = [
        {"messages": [{"role": "user", "content": f"What is {i} + 1?"}], "answer": str(i + 1)}
        for i in range(2)
    ]
    args = GRPOConfig(
        output_dir=str(tmp_path / "run"),
        num_generations=2,
        batch_size=2,
        max_completion_length=8,
        max_steps=1,
        use_lora=False,
        progress_bar=False,
    )
    evaluated: list[int] = []

    class Evaluated(TrainerCallback):
        def on_evaluate(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
            evaluated.append(step)

    trainer = GRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=exact,
        args=args,
        train_dataset=records,
        eval_dataset=records[:1],
        callbacks=[Evaluated()],
    )
    assert trainer.train_dataset == [
        {"prompt": r["messages"], "answer": r["answer"]} for r in records
    ]
    before = trainable(trainer.policy.model)
    trainer.train()
    assert_all_changed(before, trainable(trainer.policy.model))
    assert sorted(set(answers)) == ["1", "2"]
    assert evaluated == [1]  # the eval_dataset, at the end


def test_a_rewards_log_metric_and_log_extra_reach_the_metrics_and_records(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """TRL's ``log_metric(name, value)`` (a scalar of the step, averaged when logged twice, under
    its own name) and ``log_extra(column, values)`` (one value per completion, in the rollout
    records' ``details`` under ``<reward>/<column>``); a value that is not a number is refused."""
    from ppo_trainer.trl_names import GRPOConfig, GRPOTrainer

    def length(completions: list[str], log_metric: Any, log_extra: Any, **kw: Any) -> list[float]:
        lengths = [float(len(c)) for c in completions]
        log_metric("length/max", max(lengths))
        log_metric("length/max", max(lengths) + 2.0)  # twice in a step: the mean
        log_extra("chars", [len(c) for c in completions])
        return lengths

    args = GRPOConfig(
        output_dir=str(tmp_path / "run"),
        num_generations=2,
        batch_size=2,
        max_completion_length=8,
        max_steps=1,
        progress_bar=False,
        log_rollouts_every=1,
    )
    prompts = [{"prompt": f"Count to {i}:"} for i in range(2)]
    trainer = GRPOTrainer(
        model=str(tiny_model_dir), reward_funcs=length, args=args, train_dataset=prompts
    )
    metrics = trainer.train()[-1]
    records = [
        json.loads(line)
        for line in (tmp_path / "run" / "rollouts" / "step_000001.jsonl").read_text().splitlines()
    ]
    scores = [r["score"] for r in records]  # each completion's length in characters
    assert metrics["length/max"] == pytest.approx(max(scores) + 1.0)
    assert [r["details"]["length/chars"] for r in records] == scores

    from ppo_trainer.prompt_records import ExtraColumns

    extra = ExtraColumns(2)
    with pytest.raises(ValueError, match="log_metric\\('x', ...\\) needs a number"):
        extra.metric("x", cast(Any, "high"))
    with pytest.raises(ValueError, match="needs a metric name"):
        extra.metric("", 1.0)


def test_trl_keys_are_translated_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    from config.trl_names import GRPOConfig, RLOOConfig

    with caplog.at_level(logging.INFO, logger="ppo_mlx"):
        c = GRPOConfig(
            model_name="m",
            per_device_train_batch_size=16,
            gradient_accumulation_steps=2,
            num_generations=4,
            num_train_epochs=2.0,
            max_steps=-1,
            save_steps=50,
            save_total_limit=None,
            report_to=["wandb"],
            logging_steps=10,
            logging_dir="logs",
            bf16=True,
            use_vllm=False,
            max_prompt_length=None,
            disable_tqdm=True,
        )
    # 16 completions per micro-batch, 2 micro-batches per update: 32 = 8 prompts x 4.
    assert (c.batch_size, c.group_size, c.num_mini_batches) == (8, 4, 1)
    assert (c.micro_batch_size, c.gradient_accumulation_steps) == (16, 2)
    assert (c.num_epochs, c.total_steps, c.save_every, c.keep_last_checkpoints) == (2, None, 50, 0)
    assert (c.log_with, c.progress_bar, c.max_prompt_length) == ("wandb", False, 512)
    [line] = [r.getMessage() for r in caplog.records]
    assert "32 completions per step = batch_size 8 prompts x group_size 4" in line
    for ignored in ("logging_steps ignored", "logging_dir ignored", "bf16 ignored"):
        assert ignored in line
    # TRL's defaults for what a group run needs; no log line when nothing is translated.
    assert GRPOConfig(model_name="m").group_size == 8
    assert RLOOConfig(model_name="m").group_size == 2
    assert GRPOConfig().model_name == MODEL_FROM_TRAINER


def test_what_is_not_honoured_is_refused_in_one_line() -> None:
    from config.trl_names import GRPOConfig

    def refusal(error: type[Exception], **values: Any) -> str:
        with pytest.raises(error) as info:
            GRPOConfig(model_name="m", **values)
        message = str(info.value)
        assert "\n" not in message
        return message

    message = refusal(TypeError, per_device_train_batchsize=4, lerning_rate=1e-6)
    assert message.startswith("GRPOConfig does not take 'per_device_train_batchsize': did you")
    assert "'per_device_train_batch_size'" in message and "'learning_rate'" in message
    assert "no key is close" in refusal(TypeError, vllm_gpu_memory_utilization=0.3)
    assert "set use_vllm=False" in refusal(ValueError, use_vllm=True)
    assert "name one backend" in refusal(ValueError, report_to="all")
    assert "multiple of num_generations=4" in refusal(
        ValueError, per_device_train_batch_size=6, num_generations=4
    )
    assert "not both" in refusal(ValueError, per_device_train_batch_size=8, batch_size=2)
    assert "given twice" in refusal(ValueError, num_generations=4, group_size=4)
    # Our own config, in Python: the CLI's "did you mean", not a bare TypeError.
    with pytest.raises(TypeError, match=r"^PPOConfig does not take 'learning_rat': did you mean"):
        PPOConfig(model_name="m", learning_rat=1e-5)  # type: ignore[call-arg]


def test_the_model_comes_from_the_trainer(tiny_model_dir: Path, tmp_path: Path) -> None:
    from ppo_trainer.trl_names import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path), num_generations=2, batch_size=2)
    with pytest.raises(ValueError, match=r"GRPOTrainer needs the model: pass model="):
        GRPOTrainer(reward_funcs=lambda completions, **k: [0.0] * len(completions), args=args)
    with pytest.raises(ValueError, match=r"takes a path or repo id here, got object"):
        GRPOTrainer(model=object(), args=args)  # type: ignore[arg-type]
    trainer = GRPOTrainer(model=str(tiny_model_dir), args=args, reward_funcs="think_format")
    assert trainer.config.model_name == str(tiny_model_dir)
    # TRL's split: reward_weights in the config, the functions in the trainer.
    weighted = GRPOConfig(output_dir=str(tmp_path), num_generations=2, reward_weights=[0.5])
    with pytest.raises(ValueError, match=r"reward_weights \[0.5\] but no reward functions"):
        GRPOTrainer(model=str(tiny_model_dir), args=weighted)

    def weighted_brevity(completions: list[str], **kwargs: Any) -> list[float]:
        return [-len(c) / 50 for c in completions]

    trainer = GRPOTrainer(model=str(tiny_model_dir), args=weighted, reward_funcs=weighted_brevity)
    assert trainer.config.reward_funcs == ["weighted_brevity"]
    assert trainer.config.reward_weights == [0.5]


def test_peft_config_translation() -> None:
    keys = from_peft_config(LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "down_proj"]))
    assert keys == {
        "use_lora": True,
        "lora_r": 16,
        "lora_keys": ["self_attn.q_proj", "mlp.down_proj"],
        "lora_alpha": 32.0,
        "lora_dropout": 0.0,
    }
    assert from_peft_config(LoraConfig(target_modules="all-linear"))["lora_keys"] is None
    assert from_peft_config(LoraConfig())["lora_keys"] == ["self_attn.q_proj", "self_attn.v_proj"]
    for bad, match in [
        (LoraConfig(use_dora=True), "use_dora=True is not available"),
        (LoraConfig(bias="all"), "bias='all' is not available"),
        (LoraConfig(target_modules=".*proj"), "a regular expression is not read"),
        (LoraConfig(target_modules=["qkv"]), r"has \['qkv'\]: choose among"),
        ("r16", "peft_config must be a LoRA config"),
    ]:
        with pytest.raises(ValueError, match=match):
            from_peft_config(bad)


def test_dataset_rows_become_prompt_records() -> None:
    chat = [{"role": "user", "content": "Hi"}]
    rows = Dataset.from_list([{"prompt": "a", "x": 1}, {"prompt": "b", "x": 2}])
    assert dataset_records(rows) == [{"prompt": "a", "x": 1}, {"prompt": "b", "x": 2}]
    assert dataset_records(Dataset.from_list([{"prompt": chat}])) == [chat]
    assert dataset_records([{"messages": chat, "answer": "4"}, "plain"]) == [
        {"prompt": chat, "answer": "4"},
        "plain",
    ]
    with pytest.raises(ValueError, match=r"^train_dataset row 1: expected an object with 'prompt'"):
        dataset_records([{"prompt": "a"}, {"text": "b"}])
    with pytest.raises(ValueError, match=r"^eval_dataset row 0: 'prompt' is an empty list"):
        dataset_records([{"prompt": []}], "eval_dataset")
    with pytest.raises(ValueError, match="train_dataset is empty"):
        dataset_records(Dataset.from_list([]))


def test_a_reward_gets_trls_shapes() -> None:
    state = TrainerState(global_step=3, max_steps=10, epoch=1.0)
    calls: list[dict[str, Any]] = []

    def spy(prompts, completions, **kwargs):
        calls.append(dict(prompts=prompts, completions=completions, **kwargs))
        return [0.5] * len(completions)

    wrapped = trl_reward(spy, lambda: state)
    assert wrapped.__name__ == "spy"
    chat = [{"role": "user", "content": "Hi"}]
    columns = {"prompt": [chat, chat], "completion_ids": [[1], [2, 3]], "answer": ["a", "b"]}
    assert wrapped(["<formatted>"] * 2, ["x", "yz"], **columns) == [0.5, 0.5]
    assert calls[-1] == {
        "prompts": [chat, chat],
        "completions": [
            [{"role": "assistant", "content": "x"}],
            [{"role": "assistant", "content": "yz"}],
        ],
        "completion_ids": [[1], [2, 3]],
        "answer": ["a", "b"],
        "trainer_state": state,
    }
    wrapped(["<formatted>"], ["x"], prompt=["text"], completion_ids=[[1]])
    assert calls[-1]["prompts"] == ["text"] and calls[-1]["completions"] == ["x"]

    async def async_reward_func(prompts, completions, **kwargs):  # TRL's Example 5
        await asyncio.sleep(0.001)
        return [1.0 if completion else 0.0 for completion in completions]

    assert trl_reward(async_reward_func, lambda: state)(["p"] * 2, ["x", ""], prompt=["p"] * 2) == [
        1.0,
        0.0,
    ]

    def needs(completions, solution):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match=r"the reward .*needs \['solution'\]"):
        trl_reward(needs, lambda: state)(["p"], ["c"], prompt=["p"], completion_ids=[[1]])


def test_a_reward_defined_again_takes_its_name_back(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A notebook runs the cell that defines ``reward_len`` twice: the second trainer scores
    with the second function."""
    from ppo_trainer.trl_names import GRPOConfig, GRPOTrainer
    from rewards import resolve_reward

    args = GRPOConfig(output_dir=str(tmp_path), num_generations=2, batch_size=2)
    functions = []
    for _ in range(2):

        def reward_len(completions: list[str], **kwargs: Any) -> list[float]:
            return [float(len(c)) for c in completions]

        functions.append(reward_len)
        trainer = GRPOTrainer(model=str(tiny_model_dir), args=args, reward_funcs=[reward_len])
        assert trainer.config.reward_funcs == ["reward_len"]
        assert resolve_reward("reward_len").__wrapped__ is reward_len  # type: ignore[attr-defined]
    assert functions[0] is not functions[1]


def test_the_docs_name_every_trl_key_accepted() -> None:
    """docs/algorithms.md's TRL section names each key that is renamed, translated, ignored or
    accepted only turned off, so that it says exactly what a TRL script may set."""
    from config.trl_names import IGNORED, OFF_ONLY, TRANSLATED, TRL_ALIASES

    text = (Path(__file__).parents[1] / "docs" / "algorithms.md").read_text(encoding="utf-8")
    section = text[text.index("## GRPO as TRL users run it") : text.index("## Metrics")]
    keys = [*TRL_ALIASES, *TRANSLATED, *IGNORED, *OFF_ONLY, "reward_weights", "peft_config"]
    missing = [key for key in keys if f"`{key}`" not in section and key != "max_turns"]
    assert not missing, f"docs/algorithms.md's TRL section does not name {missing}"


def test_trls_renames_work_in_config_files_and_overrides() -> None:
    from config.loading import load_config

    c = load_config(
        None,
        ["model_name=m", "num_train_epochs=2", "max_steps=-1", "save_steps=5"]
        + ["save_total_limit=2", "report_to=tensorboard", "lr_scheduler_type=cosine"],
    )
    assert (c.num_epochs, c.total_steps, c.save_every, c.keep_last_checkpoints) == (2, None, 5, 2)
    assert (c.log_with, c.lr_scheduler) == ("tensorboard", "cosine")
