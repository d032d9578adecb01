"""GKD (algorithms/gkd.py, ppo_trainer/gkd.py): TRL's generalized JSD to a teacher on the
student's samples (probability lmbda) or the data's completions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from config.ppo_config import PPOConfig
from ppo_trainer import gkd
from ppo_trainer.ppo_trainer import PPOTrainer
from tests.test_distill import PROMPTS, teacher_dir  # noqa: F401 (a fixture)
from tests.test_ppo_trainer import assert_all_changed, make_config, trainable

COMPLETIONS = [" a fine film", " too long", " it broke", " sturdy and light"]
RECORDS = [{"prompt": p, "completion": c} for p, c in zip(PROMPTS, COMPLETIONS)]


def gkd_config(tiny_model_dir: Path, teacher: Path, tmp_path: Path, **overrides: Any) -> PPOConfig:
    settings: dict[str, Any] = dict(
        algorithm="gkd",
        teacher_model_name=str(teacher),
        learning_rate=3e-3,
        num_mini_batches=1,
    )
    settings.update(overrides)
    return make_config(tiny_model_dir, tmp_path, **settings)


def test_the_config_takes_trls_defaults_and_refuses_bad_settings(tiny_model_dir: Path) -> None:
    name = str(tiny_model_dir)
    config = PPOConfig(model_name=name, algorithm="gkd", teacher_model_name=name)
    assert (config.lmbda, config.beta, config.temperature, config.num_ppo_epochs) == (
        0.5,
        0.5,
        0.9,
        1,
    )
    assert config.uses_reference_model and config.reward_coef == 1.0
    cases: list[tuple[dict[str, Any], str]] = [
        ({"lmbda": 1.5}, "lmbda must be in"),
        ({"lmbda": -0.1}, "lmbda must be in"),
        ({"beta": 2.0}, r"beta of algorithm \"gkd\" must be in \[0, 1\]"),
        ({"entropy_coef": 0.01}, "use algorithm distill"),
        ({"teacher_model_name": None}, "set teacher_model_name"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            settings: dict[str, Any] = {"algorithm": "gkd", "teacher_model_name": name, **bad}
            PPOConfig(model_name=name, **settings)
    with pytest.raises(ValueError, match="lmbda must be 0.5 .* use it with one of gkd"):
        PPOConfig(model_name=name, lmbda=0.2)
    with pytest.raises(ValueError, match="reward_coef must be 1.0 .* one of distill, gkd"):
        PPOConfig(model_name=name, reward_coef=0.5)


def test_the_data_shape_and_its_tokens(tiny_model_dir: Path) -> None:
    """Chat messages ending with the assistant's turn split into prompt and completion; a
    completion's tokens are its text's and the end token, cut at max_new_tokens."""
    from base_setup.tokenizer_setup import load_tokenizer

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert gkd.split_completion(messages) == {"prompt": messages[:1], "completion": messages[1:]}
    record = {"prompt": messages, "answer": "4"}
    assert gkd.split_completion(record) == {
        **record,
        "prompt": messages[:1],
        "completion": [messages[1]],
    }
    assert gkd.split_completion("plain") == "plain"
    assert gkd.split_completion(RECORDS[0]) == RECORDS[0]

    tokenizer = load_tokenizer(tiny_model_dir)
    text = tokenizer.encode(" a fine film", add_special_tokens=False)
    gen = gkd.completion_generation(
        [" a fine film", " a fine film"],
        ["p", "p"],
        tokenizer,
        chat=False,
        max_new_tokens=len(text),
        pad_token_id=0,
    )
    assert np.array(gen.responses)[0].tolist() == text  # cut before its end token
    assert not bool(gen.ended_with_stop[0]) and gen.logprobs is None
    gen = gkd.completion_generation(
        [" a fine film"], ["p"], tokenizer, chat=False, max_new_tokens=64, pad_token_id=0
    )
    assert np.array(gen.responses)[0].tolist() == text + [tokenizer.eos_token_id]
    assert bool(gen.ended_with_stop[0]) and int(gen.lengths[0]) == len(text) + 1
    with pytest.raises(ValueError, match="text or one assistant message"):
        gkd.completion_text([{"role": "user", "content": "x"}], "prompt 0")


def test_a_run_with_lmbda_below_1_needs_the_datas_completions_before_any_work(
    tiny_model_dir: Path, teacher_dir: Path, tmp_path: Path  # noqa: F811
) -> None:
    trainer = PPOTrainer(gkd_config(tiny_model_dir, teacher_dir, tmp_path, lmbda=0.5))
    with pytest.raises(ValueError, match="the prompts carry none.*or set lmbda: 1"):
        trainer.train(PROMPTS, num_epochs=1)
    bad = [{"prompt": p, "completion": 3} for p in PROMPTS]
    with pytest.raises(ValueError, match="prompt 0: the completion must be text"):
        trainer.train(bad, num_epochs=1)
    assert trainer.global_step == 0 and not (tmp_path / "run" / "checkpoints").exists()


def test_lmbda_0_trains_on_the_datas_completions_without_generating(
    tiny_model_dir: Path,
    teacher_dir: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing is sampled; each step's responses are the data's completions; the JSD to the
    teacher on them falls as the student learns (the same four every step)."""
    import ppo_trainer.rollout as rollout

    def no_sampling(*args: object, **kwargs: object) -> None:
        raise AssertionError("lmbda 0 generated")

    monkeypatch.setattr(rollout, "sample_responses", no_sampling)
    seen: list[list[str]] = []

    def record(prompts: list[str], completions: list[str]) -> list[float]:
        seen.append(completions)
        return [0.0] * len(completions)

    trainer = PPOTrainer(
        gkd_config(
            tiny_model_dir, teacher_dir, tmp_path, lmbda=0.0, total_steps=4, max_new_tokens=32
        ),
        reward_model=record,
    )
    history = trainer.train(RECORDS, num_epochs=4)
    assert [m["gkd/on_policy"] for m in history] == [0.0] * 4
    assert sorted(seen[-1]) == sorted(COMPLETIONS)  # the epoch's order is shuffled
    jsd = [m["policy/jsd"] for m in history]
    assert jsd[-1] < 0.7 * jsd[0], jsd


def test_lmbda_1_trains_on_the_students_samples_only(
    tiny_model_dir: Path,
    teacher_dir: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_data(*args: object, **kwargs: object) -> None:
        raise AssertionError("lmbda 1 read the data's completions")

    monkeypatch.setattr(gkd, "completion_generation", no_data)
    trainer = PPOTrainer(
        gkd_config(tiny_model_dir, teacher_dir, tmp_path, lmbda=1.0, total_steps=2)
    )
    history = trainer.train(PROMPTS, num_epochs=2)  # no completions needed
    assert [m["gkd/on_policy"] for m in history] == [1.0, 1.0]


@pytest.mark.parametrize("use_lora", [True, False])
def test_gkd_moves_every_trainable_parameter_and_mixes_as_lmbda_draws(
    tiny_model_dir: Path, teacher_dir: Path, tmp_path: Path, use_lora: bool  # noqa: F811
) -> None:
    """Both kinds of step, a verifiable reward's policy-gradient term beside the divergence;
    which kind each step is follows the (seed, step) draw."""

    def e_count(completions: list[str], **kwargs: object) -> list[float]:
        return [float(c.count("e")) for c in completions]

    config = gkd_config(
        tiny_model_dir, teacher_dir, tmp_path, lmbda=0.5, total_steps=4, use_lora=use_lora
    )
    trainer = PPOTrainer(config, reward_model=e_count)
    before = trainable(trainer.policy.model)
    history = trainer.train(RECORDS, num_epochs=4)
    assert_all_changed(before, trainable(trainer.policy.model))
    drawn = [float(gkd.student_samples(config.seed, step, 0.5)) for step in range(4)]
    assert [m["gkd/on_policy"] for m in history] == drawn and 0.0 < sum(drawn) < 4
    assert all(np.isfinite(m["policy/jsd"]) and m["policy/jsd"] > 0 for m in history)
    assert history[0]["objective/scores"] > 0


@pytest.mark.slow
def test_a_resumed_gkd_run_equals_the_straight_run(
    tiny_model_dir: Path,
    teacher_dir: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two steps, one on the data's completions and one on the student's samples (seed 2
    draws one of each), stopped after the first and resumed: the same metrics and weights."""
    from tests.resume_checks import assert_resume_equals_straight

    monkeypatch.setenv("PPO_MLX_ADAPTIVE_BLAS", "off")
    assert {gkd.student_samples(2, step, 0.5) for step in range(2)} == {True, False}
    assert_resume_equals_straight(
        lambda name: PPOTrainer(
            gkd_config(
                tiny_model_dir,
                teacher_dir,
                tmp_path / name,
                lmbda=0.5,
                seed=2,
                save_every=100,
            )
        ),
        RECORDS,
    )


@pytest.mark.slow
def test_python_main_py_distill_loss_gkd_trains_from_the_command_line(
    tiny_model_dir: Path, teacher_dir: Path, tmp_path: Path  # noqa: F811
) -> None:
    from tests.test_demo import run_main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    out = tmp_path / "run"
    run = run_main(
        "distill",
        "--loss",
        "gkd",
        "--teacher",
        str(teacher_dir),
        "--prompts",
        str(prompts),
        *("--set", f"model_name={tiny_model_dir}", "--set", "lmbda=0"),
        *("--set", "batch_size=4", "--set", "max_new_tokens=8", "--set", f"output_dir={out}"),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert (out / "final").is_dir() and "trained 1 steps" in run.stdout
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert record["gkd/on_policy"] == 0.0 and record["policy/jsd"] > 0
