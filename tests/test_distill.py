"""On-policy distillation (algorithms/distill.py): the student samples, the teacher's per-token
log-probs of those samples are the signal (advantage/distillation.py)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import cast

import mlx.core as mx
import numpy as np
import pytest

from advantage.distillation import distillation_advantages
from algorithms.registry import get_algorithm
from config.ppo_config import PPOConfig
from fixtures.tiny_model import TINY_SIZES, build_checkpoint
from ppo_trainer.ppo_trainer import PPOTrainer
from tests.test_ppo_trainer import assert_all_changed, make_config, trainable

PROMPTS = ["Review of the film:", "Review of the book:", "Review of the phone:", "Review of a bag:"]


def test_advantages_equal_a_naive_loop() -> None:
    rng = np.random.default_rng(0)
    kl = rng.normal(size=(3, 5)).astype(np.float32)
    scores = rng.normal(size=3).astype(np.float32)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0]], dtype=np.float32)
    got = np.array(distillation_advantages(mx.array(kl), mx.array(scores), mx.array(mask), 0.5))
    want = np.zeros_like(kl)
    for b in range(3):
        for t in range(5):
            if mask[b, t]:
                want[b, t] = -0.5 * kl[b, t] + scores[b]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    with pytest.raises(ValueError, match="scores must have shape"):
        distillation_advantages(mx.array(kl), mx.array(scores[:2]), mx.array(mask), 1.0)


@pytest.fixture(scope="module")
def teacher_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with other weights (the same tokenizer): a teacher to move toward."""
    out = tmp_path_factory.mktemp("teacher") / "model"
    shutil.copytree(tiny_model_dir, out)
    weights = cast(dict[str, mx.array], mx.load(str(out / "model.safetensors")))
    rng = np.random.default_rng(1)
    moved = {
        k: v + mx.array(rng.normal(0.0, 0.05, v.shape).astype(np.float32)) if "norm" not in k else v
        for k, v in weights.items()
    }
    mx.save_safetensors(str(out / "model.safetensors"), moved)
    return out


def test_the_config_needs_a_teacher_and_keeps_it_to_distillation(tiny_model_dir: Path) -> None:
    name = str(tiny_model_dir)
    with pytest.raises(ValueError, match="set teacher_model_name"):
        PPOConfig(model_name=name, algorithm="distill")
    with pytest.raises(ValueError, match="teacher_model_name is for on-policy distillation"):
        PPOConfig(model_name=name, teacher_model_name=name)
    with pytest.raises(ValueError, match="adaptive_kl: false"):
        PPOConfig(model_name=name, algorithm="distill", teacher_model_name=name, adaptive_kl=True)
    config = PPOConfig(model_name=name, algorithm="distill", teacher_model_name="/t")
    assert (config.kl_coef, config.num_ppo_epochs, config.temperature) == (1.0, 1, 1.0)
    assert config.ref_model_name == "/t" and config.uses_reference_model
    algorithm = get_algorithm("distill")
    assert not algorithm.value_model and "teacher_model_name" in algorithm.keys


def test_a_teacher_with_another_vocabulary_is_refused_before_its_weights_load(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    other = build_checkpoint(tmp_path / "other", TINY_SIZES["test"], seed=3)
    (other / "model.safetensors").unlink()  # it must be refused before anything reads them
    config = make_config(
        tiny_model_dir, tmp_path, algorithm="distill", teacher_model_name=str(other)
    )
    with pytest.raises(ValueError, match="another vocabulary than the student"):
        PPOTrainer(config)


def test_distillation_trains_the_student_toward_the_teacher(
    tiny_model_dir: Path, teacher_dir: Path, tmp_path: Path
) -> None:
    """No reward: every trainable weight moves, and the student's reverse KL to the teacher on
    its own samples (16 at temperature 1) falls by a fifth or more in 20 steps (measured: 18.1
    -> 11.0 nats a sequence)."""
    config = make_config(
        tiny_model_dir,
        tmp_path,
        algorithm="distill",
        teacher_model_name=str(teacher_dir),
        learning_rate=3e-3,
        batch_size=8,
        total_steps=20,
        use_lora=True,
    )
    trainer = PPOTrainer(config)
    before = trainable(trainer.policy.model)
    kl_before = trainer.evaluate(PROMPTS * 4, temperature=1.0, num_samples=0)["eval/kl"]
    history = trainer.train(PROMPTS * 10, num_epochs=4)
    assert len(history) == 20 and history[0]["objective/scores"] == 0.0
    assert_all_changed(before, trainable(trainer.policy.model))
    kl_after = trainer.evaluate(PROMPTS * 4, temperature=1.0, num_samples=0)["eval/kl"]
    assert kl_after < 0.8 * kl_before, (kl_before, kl_after)


def test_a_verifiable_reward_adds_to_the_teachers_signal(
    tiny_model_dir: Path, teacher_dir: Path, tmp_path: Path
) -> None:
    def e_count(completions: list[str], **kwargs: object) -> list[float]:
        return [float(c.count("e")) for c in completions]

    config = make_config(
        tiny_model_dir, tmp_path, algorithm="distill", teacher_model_name=str(teacher_dir)
    )
    trainer = PPOTrainer(config, reward_model=e_count)
    metrics = trainer.step(PROMPTS)
    assert metrics["objective/scores"] > 0 and np.isfinite(metrics["objective/kl"])


def test_python_main_py_distill_trains_from_the_command_line(
    tiny_model_dir: Path, teacher_dir: Path, tmp_path: Path
) -> None:
    from tests.test_demo import run_main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    out = tmp_path / "run"
    common = ["--prompts", str(prompts), "--set", f"model_name={tiny_model_dir}"]
    run = run_main(
        "distill",
        "--teacher",
        str(teacher_dir),
        *common,
        *("--set", "batch_size=4", "--set", "max_new_tokens=8", "--set", f"output_dir={out}"),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert (out / "final").is_dir() and "trained 1 steps" in run.stdout
    refused = run_main("distill", "--teacher", str(teacher_dir), *common, "--set", "algorithm=ppo")
    assert refused.returncode != 0 and "distill sets algorithm itself" in refused.stderr


@pytest.mark.slow
def test_a_resumed_distillation_equals_the_straight_run(
    tiny_model_dir: Path, teacher_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.resume_checks import assert_resume_equals_straight

    monkeypatch.setenv("PPO_MLX_ADAPTIVE_BLAS", "off")
    assert_resume_equals_straight(
        lambda name: PPOTrainer(
            make_config(
                tiny_model_dir,
                tmp_path / name,
                algorithm="distill",
                teacher_model_name=str(teacher_dir),
                save_every=100,
            )
        ),
        PROMPTS,
    )
