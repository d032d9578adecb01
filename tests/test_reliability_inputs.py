"""Resume notices changed inputs: the weights a run starts from replaced at the same path, other
prompts or training data, another reward. Each resumed silently (with other prompts a run wrote
``final/`` with no new step while saying it trained)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from fixtures.tiny_corpus import review_prompts
from fixtures.tiny_model import build_tiny_checkpoint
from ppo_trainer.ppo_trainer import PPOTrainer
from training.fingerprints import data_fingerprint, model_fingerprint
from tests.test_reliability_writers import make_config

PROMPTS = review_prompts(8, seed=0)


def length_reward(prompts: list[str], completions: list[str]) -> list[float]:
    return [float(len(c)) / 10 for c in completions]


def vowel_reward(prompts: list[str], completions: list[str]) -> list[float]:
    return [float(sum(ch in "aeiou" for ch in c)) for c in completions]


def test_fingerprints_see_a_retrained_model_and_other_data(tmp_path: Path) -> None:
    first = build_tiny_checkpoint(tmp_path / "a", size="test", seed=0)
    again = build_tiny_checkpoint(tmp_path / "b", size="test", seed=0)
    other = build_tiny_checkpoint(tmp_path / "c", size="test", seed=1)
    assert model_fingerprint(first) == model_fingerprint(again)  # a copy is the same model
    assert model_fingerprint(first) != model_fingerprint(other)
    assert model_fingerprint("Qwen/Qwen3-0.6B") is None  # not a local folder
    assert data_fingerprint(["a", "b"]) == data_fingerprint(["a", "b"])
    assert data_fingerprint(["a", "b"]) != data_fingerprint(["a", "c"])


@pytest.mark.slow
def test_resume_refuses_a_base_model_replaced_at_the_same_path(tmp_path: Path) -> None:
    """An SFT stage re-run into the folder the PPO run starts from."""
    model = build_tiny_checkpoint(tmp_path / "sft_model", size="test", seed=0)
    run = tmp_path / "run"
    PPOTrainer(make_config(model, run), reward_model=length_reward).train(PROMPTS)
    shutil.rmtree(model)
    build_tiny_checkpoint(model, size="test", seed=1)
    trainer = PPOTrainer(make_config(model, run, total_steps=3), reward_model=length_reward)
    with pytest.raises(ValueError, match=r"other inputs.*the base model \(model_name\): sha256"):
        trainer.train(PROMPTS, resume_from="latest")
    assert trainer.global_step == 0


@pytest.mark.slow
def test_resume_refuses_other_prompts_and_another_reward(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    PPOTrainer(make_config(tiny_model_dir, run), reward_model=length_reward).train(PROMPTS)
    longer = make_config(tiny_model_dir, run, total_steps=3)
    other = review_prompts(8, seed=1)
    with pytest.raises(ValueError, match="the prompts: 8 records, sha256 .* -> 8 records"):
        PPOTrainer(longer, reward_model=length_reward).train(other, resume_from="latest")
    with pytest.raises(
        ValueError,
        match=r"the reward: function \S*test_reliability_inputs:length_reward -> function "
        r"\S*test_reliability_inputs:vowel_reward",
    ):
        PPOTrainer(longer, reward_model=vowel_reward).train(PROMPTS, resume_from="latest")
    # The same inputs resume.
    trainer = PPOTrainer(longer, reward_model=length_reward)
    trainer.train(PROMPTS, resume_from="latest")
    assert trainer.global_step == 3


def test_resume_refuses_a_reward_file_whose_body_was_edited(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """issue #47: only the reward's import path was recorded, so an edited function body at
    the same path was trained on after a resume without a word."""
    from ppo_trainer.components import load_function

    source = tmp_path / "my_reward.py"
    source.write_text(
        "def score(prompts, completions):\n    return [float(len(c)) for c in completions]\n"
    )
    run = tmp_path / "run"
    first = make_config(tiny_model_dir, run, total_steps=1)
    PPOTrainer(first, reward_model=load_function(f"{source}:score")).train(PROMPTS)
    source.write_text(
        "def score(prompts, completions):\n    return [-float(len(c)) for c in completions]\n"
    )
    longer = make_config(tiny_model_dir, run, total_steps=2)
    trainer = PPOTrainer(longer, reward_model=load_function(f"{source}:score"))
    with pytest.raises(
        ValueError,
        match=r"the reward's source: my_reward.py:score sha256 \w+ -> my_reward.py:score",
    ):
        trainer.train(PROMPTS, resume_from="latest")
    assert trainer.global_step == 0


def test_sft_resume_refuses_other_data_of_the_same_size_and_a_replaced_base(
    tmp_path: Path,
) -> None:
    from config.sft_config import SFTConfig
    from finetune.sft_trainer import run_sft
    from fixtures.demo_data import write_sft_data

    model = build_tiny_checkpoint(tmp_path / "base", size="test", seed=0)
    data = write_sft_data(tmp_path / "sft.jsonl", 16, seed=0)
    other = write_sft_data(tmp_path / "other.jsonl", 16, seed=1)

    def config(**change: Any) -> SFTConfig:
        values: dict[str, Any] = dict(
            model_name=str(model),
            dataset=str(data),
            output_dir=str(tmp_path / "sft"),
            batch_size=8,
            total_steps=1,
            eval_fraction=0.0,
            progress_bar=False,
        )
        return SFTConfig(**{**values, **change})

    run_sft(config())
    with pytest.raises(ValueError, match="the training data: 16 records"):
        run_sft(config(total_steps=2, dataset=str(other)), resume_from="latest")
    shutil.rmtree(model)
    build_tiny_checkpoint(model, size="test", seed=1)
    with pytest.raises(ValueError, match=r"the base model \(model_name\)"):
        run_sft(config(total_steps=2), resume_from="latest")
