"""What a hostile user does to a run: reused folders, changed settings on resume, rewards that
overflow or are not numbers, folders that cannot be written, signals, a longer run on resume.
Each test reproduces the fault first named in the reliability issue, then checks the fix."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mlx.utils import tree_flatten

from config.ppo_config import PPOConfig
from fixtures.tiny_corpus import review_prompts
from ppo_trainer.callbacks import TrainerCallback
from ppo_trainer.ppo_trainer import PPOTrainer
from training.metrics_logger import read_metrics

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = review_prompts(16, seed=0)


def length_reward(prompts: list[str], completions: list[str]) -> list[float]:
    return [float(len(c)) / 10 for c in completions]


def make_config(model_dir: Path, out: Path, **overrides: Any) -> PPOConfig:
    values: dict[str, Any] = dict(
        model_name=str(model_dir),
        max_new_tokens=6,
        batch_size=2,
        learning_rate=1e-3,
        num_ppo_epochs=1,
        output_dir=str(out),
        progress_bar=False,
        save_every=1,
        keep_last_checkpoints=2,
    )
    values.update(overrides)
    return PPOConfig(**values)


@pytest.mark.slow
def test_a_fresh_run_refuses_a_folder_holding_another_run(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    PPOTrainer(make_config(tiny_model_dir, run, total_steps=5), reward_model=length_reward).train(
        PROMPTS
    )
    shorter = make_config(tiny_model_dir, run, total_steps=2)
    with pytest.raises(ValueError, match="already holds a run .*--overwrite"):
        PPOTrainer(shorter, reward_model=length_reward).train(PROMPTS)
    # With overwrite the new run's timeline is its own: no old checkpoint, no old metrics.
    overwrite = make_config(tiny_model_dir, run, total_steps=2, overwrite_output_dir=True)
    PPOTrainer(overwrite, reward_model=length_reward).train(PROMPTS)
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step_000001",
        "step_000002",
    ]


@pytest.mark.slow
def test_resuming_an_earlier_checkpoint_drops_the_later_timeline(
    tiny_model_dir: Path, tmp_path: Path, caplog: Any
) -> None:
    """Resumed from step 2 of a run whose checkpoints go to step 4, and stopped after step 3:
    'latest' was the old step 4 (the abandoned timeline), so the next resume continued it."""
    run = tmp_path / "run"
    config = make_config(tiny_model_dir, run, total_steps=4, keep_last_checkpoints=3)
    PPOTrainer(config, reward_model=length_reward).train(PROMPTS)
    trainer = PPOTrainer(config, reward_model=length_reward)
    with caplog.at_level("WARNING", logger="ppo_mlx"):
        trainer.train(
            PROMPTS, resume_from=run / "checkpoints" / "step_000002", callbacks=[_StopAt(3)]
        )
    assert "step_000003, step_000004" in caplog.text
    assert trainer.checkpoints.latest() == run / "checkpoints" / "step_000003"
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]


@pytest.mark.slow
def test_a_run_resumed_at_its_end_removes_the_leftovers_of_killed_writes(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Killed while its last step's pruning deleted an old checkpoint (or while the final model
    or a rollout record was written), then resumed: nothing was left to save, so the leftovers
    stayed for good."""
    run = tmp_path / "run"
    config = make_config(tiny_model_dir, run, total_steps=2, log_rollouts_every=1)
    PPOTrainer(config, reward_model=length_reward).train(PROMPTS)
    leftovers = [
        run / "checkpoints" / ".trash-step_000001-4242",
        run / "checkpoints" / ".tmp-step_000003-4242",
        run / ".tmp-final-4242",
        run / ".trash-final-4242",
    ]
    for path in leftovers:
        path.mkdir()
        (path / "weights.safetensors").write_bytes(b"partial")
    (run / "rollouts" / ".step_000002.jsonl.tmp-4242").write_text("{")
    (run / ".metrics.jsonl.tmp").write_text("{")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss/po')  # a kill in the middle of a metrics line
    trainer = PPOTrainer(config, reward_model=length_reward)
    trainer.train(PROMPTS, resume_from="latest")
    assert trainer.global_step == 2
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2]
    assert not list(run.rglob(".*")), list(run.rglob(".*"))


@pytest.mark.slow
def test_resuming_another_folders_checkpoint_into_a_run_is_refused(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A checkpoint of run A resumed into run B's folder: B's checkpoints up to A's step would
    stay listed beside A's continuation."""
    a, b = tmp_path / "a", tmp_path / "b"
    for run in (a, b):
        PPOTrainer(
            make_config(tiny_model_dir, run, total_steps=2), reward_model=length_reward
        ).train(PROMPTS)
    into_b = PPOTrainer(make_config(tiny_model_dir, b, total_steps=4), reward_model=length_reward)
    with pytest.raises(ValueError, match="another run folder.* holds a run"):
        into_b.train(PROMPTS, resume_from=a / "checkpoints" / "step_000001")
    # Into an empty folder it is a new branch of run A: fine.
    c = make_config(tiny_model_dir, tmp_path / "c", total_steps=3)
    PPOTrainer(c, reward_model=length_reward).train(
        PROMPTS, resume_from=a / "checkpoints" / "step_000002"
    )
    assert [p.name for p in (tmp_path / "c" / "checkpoints").iterdir()] == ["step_000003"]


def test_the_command_line_refuses_before_any_model_loads(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000003").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Review of the camera:\n")
    result = subprocess.run(
        [
            sys.executable,
            "main.py",
            "train",
            "--prompts",
            str(prompts),
            "--set",
            "model_name=/nonexistent/model",  # never loaded: the folder check comes first
            "--set",
            f"output_dir={run}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "already holds a run" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "change", [{"lora_r": 4}, {"lora_layers": 1}, {"lora_keys": ["self_attn.q_proj"]}]
)
def test_resume_refuses_settings_that_change_the_trained_parameters(
    tiny_model_dir: Path, tmp_path: Path, change: dict[str, Any]
) -> None:
    run = tmp_path / "run"
    PPOTrainer(make_config(tiny_model_dir, run, total_steps=1), reward_model=length_reward).train(
        PROMPTS
    )
    other = make_config(tiny_model_dir, run, total_steps=2, **change)
    (key,) = change
    with pytest.raises(ValueError, match=f"written with {key}="):
        PPOTrainer(other, reward_model=length_reward).train(PROMPTS, resume_from="latest")


@pytest.mark.slow
def test_sft_resume_refuses_settings_that_change_the_trained_parameters(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from config.sft_config import SFTConfig
    from finetune.sft_trainer import run_sft
    from fixtures.demo_data import write_sft_data

    data = write_sft_data(tmp_path / "sft.jsonl", 16, seed=0)

    def config(**change: Any) -> SFTConfig:
        values: dict[str, Any] = dict(
            model_name=str(tiny_model_dir),
            dataset=str(data),
            output_dir=str(tmp_path / "sft"),
            batch_size=8,
            total_steps=1,
            eval_fraction=0.0,
            progress_bar=False,
            use_lora=True,
        )
        return SFTConfig(**{**values, **change})

    run_sft(config())
    for change in (
        {"lora_r": 4},
        {"lora_layers": 1},
        {"lora_keys": ["self_attn.q_proj"]},
        {"lora_alpha": 8.0},
        {"dtype": "bfloat16"},
        {"use_lora": False},
    ):
        (key,) = change
        with pytest.raises(ValueError, match=f"written with {key}="):
            run_sft(config(total_steps=2, **change), resume_from="latest")


@pytest.mark.slow
def test_overflowing_rewards_stop_the_run_before_any_update(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    calls = {"n": 0}

    def overflowing(prompts: list[str], completions: list[str]) -> list[float]:
        calls["n"] += 1  # call 1 is train()'s trial call, call 3 step 2's scoring
        return [1e30 if calls["n"] >= 3 else 1.0] * len(completions)

    run = tmp_path / "run"
    # Raw scores: normalised ones (normalize_reward auto, a reward function) stay finite here.
    config = make_config(tiny_model_dir, run, total_steps=4, normalize_reward=False)
    trainer = PPOTrainer(config, reward_model=overflowing)
    with pytest.raises(ValueError, match="step 2 .*too large"):
        trainer.train(PROMPTS)
    assert trainer.global_step == 1
    assert [p.name for p in trainer.checkpoints.checkpoints()] == ["step_000001"]
    restored = PPOTrainer(make_config(tiny_model_dir, tmp_path / "other"), reward_model=overflowing)
    restored.load_checkpoint(run / "checkpoints" / "step_000001")
    ours = dict(restored.policy.trainable_parameters())
    assert ours.keys() == dict(trainer.policy.trainable_parameters()).keys()


@pytest.mark.plots
@pytest.mark.slow
def test_a_full_disk_stops_with_one_message_and_the_run_resumes(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """The disk fills up while step 2's checkpoint is written: one error naming the path and the
    space, no plot attempted after it (that was the last of four chained tracebacks), step 1's
    checkpoint intact; once space is freed the run resumes and finishes."""
    import mlx.core as mx

    from training.checkpoint import CheckpointWriteError

    save = mx.save_safetensors

    def full_at_step_2(path: str, arrays: Any, metadata: Any = None) -> None:
        if "step_000002" in path:
            raise RuntimeError("[write] Unable to write 8391 bytes to file.")  # what MLX raises
        save(path, arrays, metadata)

    run = tmp_path / "run"
    config = make_config(tiny_model_dir, run, total_steps=3)
    monkeypatch.setattr(mx, "save_safetensors", full_at_step_2)
    with caplog.at_level("WARNING", logger="ppo_mlx"), pytest.raises(CheckpointWriteError) as info:
        PPOTrainer(config, reward_model=length_reward).train(PROMPTS)
    message = str(info.value)
    assert f"could not write {run / 'checkpoints' / 'step_000002'}" in message
    assert "MB free, and it needs about" in message and "--resume latest" in message
    assert "the checkpoints up to step_000001 are intact" in message
    assert info.value.__suppress_context__  # no chain of tracebacks behind it
    assert "could not draw" not in caplog.text and not (run / "training_curves.png").exists()
    checkpoints = PPOTrainer(config, reward_model=length_reward).checkpoints
    assert [p.name for p in checkpoints.checkpoints()] == ["step_000001"]
    assert not list((run / "checkpoints").glob(".tmp-*"))
    monkeypatch.undo()  # space freed
    resumed = PPOTrainer(config, reward_model=length_reward)
    resumed.train(PROMPTS, resume_from="latest")
    assert resumed.global_step == 3
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]


def test_a_full_disk_while_recording_rollouts_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import os

    from ppo_trainer.rollout_records import write_rollout_records
    from training.checkpoint import CheckpointWriteError

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")  # names no file

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(CheckpointWriteError, match="could not write .*step_000003.jsonl") as info:
        write_rollout_records(tmp_path, 3, [{"prompt": "a"}])
    assert "No space left" in str(info.value) and info.value.__suppress_context__
    assert not list((tmp_path / "rollouts").iterdir())  # no temporary file left


@pytest.mark.parametrize(
    "bad, shown", [(lambda n: ["0.5"] * n, "str '0.5'"), (lambda n: [None] * n, "NoneType None")]
)
def test_a_reward_that_returns_no_numbers_is_named(
    tiny_model_dir: Path, tmp_path: Path, bad: Any, shown: str
) -> None:
    def texty_reward(prompts: list[str], completions: list[str]) -> list[Any]:
        return list(bad(len(completions)))

    trainer = PPOTrainer(make_config(tiny_model_dir, tmp_path / "run"), reward_model=texty_reward)
    with pytest.raises(ValueError, match=f"texty_reward returned {shown} for completion 0"):
        trainer.step(PROMPTS[:2])


def test_an_unwritable_output_dir_fails_before_models_load(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    config = make_config(tiny_model_dir, blocker / "run")
    with pytest.raises(ValueError, match="is not writable"):
        PPOTrainer(config, reward_model=length_reward)


class _StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        if step == self.step:
            trainer.request_stop("test stop")


@pytest.mark.slow
def test_a_longer_run_on_resume_continues_the_learning_rate(
    tiny_model_dir: Path, tmp_path: Path, caplog: Any
) -> None:
    run = tmp_path / "run"
    first = make_config(tiny_model_dir, run, total_steps=4, lr_scheduler="linear")
    trainer = PPOTrainer(first, reward_model=length_reward)
    trainer.train(PROMPTS, callbacks=[_StopAt(2)])
    assert trainer.global_step == 2 and trainer.stop_reason == "test stop"
    lrs = [r["lr"] for r in read_metrics(run / "metrics.jsonl")]
    longer = make_config(tiny_model_dir, run, total_steps=8, lr_scheduler="linear")
    with caplog.at_level("WARNING", logger="ppo_mlx"):
        PPOTrainer(longer, reward_model=length_reward).train(
            PROMPTS, resume_from="latest", callbacks=[_StopAt(4)]
        )
    assert "planned for 4 updates and now for 8" in caplog.text
    caplog.clear()
    # Stopped again under the longer plan: resuming continues the continued schedule (the
    # checkpoint records it), not the 8-step plan from its start.
    with caplog.at_level("WARNING", logger="ppo_mlx"):
        PPOTrainer(longer, reward_model=length_reward).train(PROMPTS, resume_from="latest")
    assert "planned for" not in caplog.text
    after = [r["lr"] for r in read_metrics(run / "metrics.jsonl")][2:]
    # The third update uses the rate the 4-step plan had reached (half the peak), not the 8-step
    # plan's 3/4 of it, and then it decays linearly to 0 at the new end: no jump back up.
    peak = first.learning_rate
    assert after == pytest.approx([peak / 2 * (1 - k / 6) for k in range(6)], rel=1e-5)
    assert after[0] <= lrs[-1]


@pytest.mark.slow
def test_a_longer_sft_run_on_resume_continues_the_learning_rate(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """SFT and reward training share the loop: a run of 4 steps stopped after 2 and resumed for
    8 continues from the rate it had reached (it restarted the 8-step schedule: the rate jumped
    from 1/2 to 3/4 of the peak), and a second stop and resume keeps that schedule."""
    import os

    from config.sft_config import SFTConfig
    from finetune.sft_trainer import SFTTrainer, run_sft
    from fixtures.demo_data import write_sft_data
    from training.run_control import TrainingStopped

    stops = {2, 4}
    original = SFTTrainer.step

    def step_then_sigterm(self: Any, examples: Any) -> Any:
        out = original(self, examples)
        if self.global_step in stops:
            stops.discard(self.global_step)
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(SFTTrainer, "step", step_then_sigterm)
    data = write_sft_data(tmp_path / "sft.jsonl", 32, seed=0)

    def config(total_steps: int) -> SFTConfig:
        return SFTConfig(
            model_name=str(tiny_model_dir),
            dataset=str(data),
            output_dir=str(tmp_path / "sft"),
            batch_size=8,
            num_epochs=2,
            total_steps=total_steps,
            learning_rate=1e-3,
            lr_scheduler="linear",
            warmup_steps=0,
            eval_fraction=0.0,
            progress_bar=False,
        )

    with pytest.raises(TrainingStopped, match="after step 2"):
        run_sft(config(4))
    with caplog.at_level("WARNING", logger="ppo_mlx"), pytest.raises(TrainingStopped):
        run_sft(config(8), resume_from="latest")
    assert "planned for 4 updates and now for 8" in caplog.text
    run_sft(config(8), resume_from="latest")
    lrs = [r["lr"] for r in read_metrics(tmp_path / "sft" / "metrics.jsonl")]
    assert lrs[:2] == pytest.approx([1e-3, 1e-3 * 3 / 4], rel=1e-5)
    assert lrs[2:] == pytest.approx([1e-3 / 2 * (1 - k / 6) for k in range(6)], rel=1e-5)


def _stop_after_steps(monkeypatch: pytest.MonkeyPatch, trainer_class: Any, steps: set[int]) -> None:
    """``trainer_class.step`` then, after each of ``steps``, SIGTERM: the run saves and stops."""
    import os

    original = trainer_class.step

    def step_then_sigterm(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        if self.global_step in steps:
            steps.discard(self.global_step)
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(trainer_class, "step", step_then_sigterm)


@pytest.mark.slow
def test_the_command_line_resume_continues_the_run_as_configured(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """The README's two lines: `train --config run.yaml --set kl_coef=0.1`, stopped, then
    `--resume latest` without the --set went on with 0.1 (the checkpoint's KL controller) but
    rewrote config.yaml with the default 0.05; and a kl_coef given again on resume (0.2) was
    silently ignored. Now the run's own config is the base, a changed setting takes effect and
    is named in one warning, and config.yaml says what the run uses."""
    import yaml

    import main
    from config.loading import load_config

    run = tmp_path / "run"
    settings = {
        "model_name": str(tiny_model_dir),
        "max_new_tokens": 6,
        "batch_size": 2,
        "learning_rate": 1e-3,
        "num_ppo_epochs": 1,
        "output_dir": str(run),
        "progress_bar": False,
        "save_every": 1,
        "total_steps": 3,
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(settings))
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    train = ["train", "--config", str(tmp_path / "run.yaml"), "--prompts"]
    train += [str(tmp_path / "prompts.txt"), "--reward-fn", "tests.test_reliability:length_reward"]
    _stop_after_steps(monkeypatch, PPOTrainer, {1, 2})
    assert main.main([*train, "--set", "kl_coef=0.1"]) == 143  # stopped by SIGTERM after step 1
    with caplog.at_level("WARNING", logger="ppo_mlx"):
        assert main.main([*train, "--resume", "latest"]) == 143  # after step 2
    assert "changed settings" not in caplog.text
    assert load_config(run / "config.yaml").kl_coef == 0.1
    with caplog.at_level("WARNING", logger="ppo_mlx"):
        assert main.main([*train, "--resume", "latest", "--set", "kl_coef=0.2"]) == 0
    assert "resuming step_000002 with changed settings: kl_coef 0.1 -> 0.2" in caplog.text
    assert load_config(run / "config.yaml").kl_coef == 0.2
    coefs = [r["objective/kl_coef"] for r in read_metrics(run / "metrics.jsonl")]
    assert coefs == pytest.approx([0.1, 0.1, 0.2])


@pytest.mark.slow
def test_evaluate_a_checkpoint_with_nothing_but_its_path(
    tiny_model_dir: Path, tmp_path: Path, capsys: Any, caplog: Any
) -> None:
    """`evaluate --checkpoint RUN/checkpoints/step_N --prompts P` needed the run's config again
    (without it: "model_name is required"; with another: "changed settings"): the checkpoint's
    own config is now the base, as for --resume."""
    import main

    run = tmp_path / "run"
    trainer = PPOTrainer(
        make_config(tiny_model_dir, run, total_steps=1, kl_coef=0.1), reward_model=length_reward
    )
    trainer.train(PROMPTS)
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    checkpoint = run / "checkpoints" / "step_000001"
    capsys.readouterr()
    with caplog.at_level("WARNING", logger="ppo_mlx"):
        main.main(
            [
                "evaluate",
                "--checkpoint",
                str(checkpoint),
                "--prompts",
                str(tmp_path / "prompts.txt"),
            ]
            + ["--reward-fn", "tests.test_reliability:length_reward", "--samples", "1"]
        )
    assert "changed settings" not in caplog.text
    result = json.loads(capsys.readouterr().out)
    assert math.isfinite(result["eval/mean_reward"]) and len(result["samples"]) == 1


@pytest.mark.slow
def test_an_adaptive_kl_controller_keeps_its_value_on_resume(
    tiny_model_dir: Path, tmp_path: Path, caplog: Any
) -> None:
    """kl_coef only starts an adaptive controller: its value is state and continues, while a
    changed kl_target takes effect (it was taken from the checkpoint) and both are warned of."""
    run = tmp_path / "run"
    first = make_config(tiny_model_dir, run, total_steps=1, adaptive_kl=True, kl_coef=0.1)
    trainer = PPOTrainer(first, reward_model=length_reward)
    trainer.train(PROMPTS)
    reached = trainer.kl_ctl.value
    assert reached != 0.1
    changed = make_config(
        tiny_model_dir, run, total_steps=1, adaptive_kl=True, kl_coef=0.2, kl_target=3.0
    )
    resumed = PPOTrainer(changed, reward_model=length_reward)
    with caplog.at_level("WARNING", logger="ppo_mlx"):
        resumed.load_checkpoint(run / "checkpoints" / "step_000001")
    assert resumed.kl_ctl.value == reached and getattr(resumed.kl_ctl, "target") == 3.0
    assert "kl_coef 0.1 -> 0.2, kl_target 6.0 -> 3.0" in caplog.text
    assert "kl_coef only starts the adaptive KL controller" in caplog.text


@pytest.mark.slow
def test_the_sft_command_line_resume_keeps_the_settings_of_its_start(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`sft --set learning_rate=1e-3 ...` stopped, then resumed without the --set: the resumed
    steps used the default 2e-5 (a schedule change) and config.yaml said so."""
    import main
    from config.loading import load_config
    from config.sft_config import SFTConfig
    from finetune.sft_trainer import SFTTrainer
    from fixtures.demo_data import write_sft_data

    data = write_sft_data(tmp_path / "sft.jsonl", 32, seed=0)
    out = tmp_path / "sft"
    sft = ["sft", "--data", str(data), "--set", f"model_name={tiny_model_dir}"]
    sft += ["--set", f"output_dir={out}", "--set", "progress_bar=false"]
    start = ["learning_rate=1e-3", "lr_scheduler=constant", "batch_size=8", "eval_fraction=0"]
    _stop_after_steps(monkeypatch, SFTTrainer, {1})
    assert main.main([*sft, "--set", "total_steps=2", *(f"--set={s}" for s in start)]) == 143
    assert main.main([*sft, "--resume", "latest"]) == 0
    assert [r["lr"] for r in read_metrics(out / "metrics.jsonl")] == pytest.approx([1e-3] * 2)
    saved = load_config(out / "config.yaml", cls=SFTConfig)
    assert (saved.learning_rate, saved.batch_size, saved.total_steps) == (1e-3, 8, 2)


def test_a_full_disk_before_any_checkpoint_says_there_is_none_to_resume(tmp_path: Path) -> None:
    from training.checkpoint import write_failure

    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    message = str(write_failure(checkpoints / "step_000001", OSError(28, "No space left")))
    assert "no checkpoint to resume from yet" in message and "intact" not in message


# --------------------------------------------------------------------------- signals

_TRAIN_SCRIPT = """
from base_setup import setup_blas; setup_blas()
import sys, time, json
from config.ppo_config import PPOConfig
from fixtures.tiny_corpus import review_prompts
from ppo_trainer.ppo_trainer import PPOTrainer
from ppo_trainer.callbacks import TrainerCallback
from training.run_control import stop_exit_code

class Slow(TrainerCallback):
    def on_step_end(self, trainer, step, metrics):
        print(f"step {step}", flush=True)
        time.sleep(1.5)

config = PPOConfig(**json.loads(sys.argv[1]))
trainer = PPOTrainer(config, reward_model=lambda p, c: [float(len(x)) for x in c])
try:
    trainer.train(review_prompts(16, seed=0), callbacks=[Slow()])
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    sys.exit(130)
print(f"stopped={trainer.stop_reason} at {trainer.global_step}", flush=True)
sys.exit(stop_exit_code(trainer.stop_reason))
"""


def _start(config: dict[str, Any]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _TRAIN_SCRIPT, json.dumps(config)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_step(process: subprocess.Popen[str]) -> None:
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line.startswith("step "), line


@pytest.mark.slow
def test_sigterm_finishes_the_step_saves_and_exits_non_zero(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    config = dict(
        model_name=str(tiny_model_dir),
        max_new_tokens=4,
        batch_size=2,
        num_ppo_epochs=1,
        output_dir=str(run),
        progress_bar=False,
        total_steps=20,
    )
    process = _start(config)
    _wait_for_step(process)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 143, err[-2000:]
    assert "stopped=SIGTERM" in out and "SIGTERM: finishing this step" in err
    step = int(out.split("stopped=SIGTERM at ")[1].split()[0])
    assert (run / "checkpoints" / f"step_{step:06d}" / "manifest.json").is_file()

    # Twice: stop at once, say "interrupted", exit 130, no traceback.
    process = _start({**config, "output_dir": str(tmp_path / "run2")})
    _wait_for_step(process)
    process.send_signal(signal.SIGINT)
    time.sleep(0.3)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err[-2000:]
    assert "interrupted" in err and "Traceback" not in err


def _cli_train(run: Path, model: Path, prompts: Path, err: Path) -> subprocess.Popen[bytes]:
    """``main.py train`` as a user starts it (a real process, real signals), stderr to ``err``."""
    settings = dict(
        model_name=model,
        output_dir=run,
        max_new_tokens=4,
        batch_size=2,
        num_epochs=20,
        total_steps=100,
        save_every=0,
        progress_bar="false",
    )
    command = [sys.executable, "main.py", "train", "--prompts", str(prompts)]
    command += ["--reward-fn", "tests.test_reliability:length_reward"]
    for key, value in settings.items():
        command += ["--set", f"{key}={value}"]
    with open(err, "w") as stderr:
        return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr)


def _wait_for(condition: Any, process: subprocess.Popen[bytes], err: Path) -> None:
    deadline = time.monotonic() + 120
    while not condition():
        assert process.poll() is None, err.read_text()[-2000:]
        assert time.monotonic() < deadline, err.read_text()[-2000:]
        time.sleep(0.05)


@pytest.mark.slow
def test_the_command_line_on_sigterm_and_a_second_ctrl_c(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Real signals to ``python main.py train``: SIGTERM in the loop finishes the step, saves
    and exits 143 with a message; SIGTERM while the model loads exits 143 with a message (it
    died silently); Ctrl-C twice says "interrupted" and exits 130; never a traceback."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    err = tmp_path / "err.txt"

    run = tmp_path / "term"
    process = _cli_train(run, tiny_model_dir, prompts, err)
    _wait_for(
        lambda: (run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text(),
        process,
        err,
    )
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 143, err.read_text()[-2000:]
    text = err.read_text()
    assert "Traceback" not in text and "stopped (SIGTERM) after step " in text
    step = int(text.split("stopped (SIGTERM) after step ")[1].split(";")[0])
    assert (run / "checkpoints" / f"step_{step:06d}" / "manifest.json").is_file()
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(1, step + 1))

    process = _cli_train(tmp_path / "loading", tiny_model_dir, prompts, err)
    # main() is running: it has loaded the reward function and goes on to import the trainer
    # and load the model, which take seconds.
    _wait_for(lambda: "reward function length_reward" in err.read_text(), process, err)
    time.sleep(0.3)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 143, err.read_text()[-2000:]
    text = err.read_text()
    assert "interrupted (SIGTERM)" in text and "Traceback" not in text, text[-2000:]

    run = tmp_path / "int"
    process = _cli_train(run, tiny_model_dir, prompts, err)
    _wait_for(
        lambda: (run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text(),
        process,
        err,
    )
    process.send_signal(signal.SIGINT)
    time.sleep(0.1)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=120) == 130, err.read_text()[-2000:]
    text = err.read_text()
    assert text.rstrip().endswith("interrupted") and "Traceback" not in text, text[-2000:]


@pytest.mark.slow
def test_resume_is_bit_exact_when_the_load_changes(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both fresh runs start on a busy machine (one BLAS thread); the stopped one resumes on a
    quiet machine and must still take its checkpoint's one thread: the same weights, bit for
    bit, as the uninterrupted run."""
    from base_setup import backend

    if backend._OPENBLAS.get("lib") is None:
        pytest.skip("OpenBLAS is loaded on Linux x86_64 only")
    start = int(backend._OPENBLAS["lib"].openblas_get_num_threads())
    monkeypatch.setattr(backend.os, "cpu_count", lambda: 2)
    monkeypatch.setitem(backend._OPENBLAS, "max_threads", 2)
    monkeypatch.setattr(backend.time, "sleep", lambda seconds: None)

    def load(others: float) -> None:
        samples = iter([(0.0, 0.0, 0.0), (others, 0.0, 1.0)])
        monkeypatch.setattr(backend, "_cpu_sample", lambda: next(samples))

    try:
        load(1.8)
        straight = PPOTrainer(
            make_config(tiny_model_dir, tmp_path / "a", total_steps=4), reward_model=length_reward
        )
        straight.train(PROMPTS)
        assert straight.blas_threads == 1
        load(1.8)
        first = PPOTrainer(
            make_config(tiny_model_dir, tmp_path / "b", total_steps=4), reward_model=length_reward
        )
        first.train(PROMPTS, callbacks=[_StopAt(2)])
        load(0.0)  # quiet now: a fresh run would take both threads
        resumed = PPOTrainer(
            make_config(tiny_model_dir, tmp_path / "b", total_steps=4), reward_model=length_reward
        )
        resumed.train(PROMPTS, resume_from="latest")
        assert resumed.blas_threads == 1
        want = dict(tree_flatten(straight.policy.trainable_parameters()))
        got = dict(tree_flatten(resumed.policy.trainable_parameters()))
        assert want.keys() == got.keys() and want
        for key in want:
            np.testing.assert_array_equal(np.array(got[key]), np.array(want[key]), key)
    finally:
        backend._OPENBLAS["lib"].openblas_set_num_threads(start)


@pytest.mark.slow
def test_sigkill_at_random_moments_and_inside_writes_loses_nothing(tmp_path: Path) -> None:
    """The short version of tests/kill_loop.py (30 kills: python -m tests.kill_loop): each crash
    point once, and two kills at random moments (the long version does half of its kills so)."""
    from tests.kill_loop import CRASH_POINTS, kill_loop

    result = kill_loop(tmp_path, kills=len(CRASH_POINTS) + 2, seed=1, random_kills=2)
    assert result["kills"] == len(CRASH_POINTS) + 2
    assert sum(" at " in line for line in result["log"] if "exit -9" in line) == 2
    inside = {line.split("inside ")[1].split(":")[0] for line in result["log"] if "inside" in line}
    assert inside == set(CRASH_POINTS)


@pytest.mark.slow
def test_sft_stops_on_sigterm_after_the_step_and_saves(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from config.sft_config import SFTConfig
    from fixtures.demo_data import write_sft_data
    from training.run_control import TrainingStopped
    from finetune.sft_trainer import SFTTrainer, run_sft

    original = SFTTrainer.step

    def step_then_sigterm(self: Any, examples: Any) -> Any:
        out = original(self, examples)
        if self.global_step == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # what a scheduler sends mid-step
        return out

    monkeypatch.setattr(SFTTrainer, "step", step_then_sigterm)
    before = signal.getsignal(signal.SIGTERM)
    config = SFTConfig(
        model_name=str(tiny_model_dir),
        dataset=str(write_sft_data(tmp_path / "sft.jsonl", 32, seed=0)),
        output_dir=str(tmp_path / "sft"),
        batch_size=8,
        eval_fraction=0.0,
        progress_bar=False,
    )
    with pytest.raises(TrainingStopped, match=r"stopped \(SIGTERM\) after step 1"):
        run_sft(config)
    assert (tmp_path / "sft" / "checkpoints" / "step_000001" / "manifest.json").is_file()
    assert not (tmp_path / "sft" / "model").exists()  # no final model from a stopped run
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back


@pytest.mark.slow
def test_sft_resumes_only_complete_checkpoints_of_one_timeline(
    tiny_model_dir: Path, tmp_path: Path, caplog: Any
) -> None:
    """SFT (and reward training: the same loop) on a damaged run folder: a checkpoint missing its
    optimiser file is neither listed nor resumed, leftovers of killed writes (a checkpoint's, the
    model's) are removed, and resuming an earlier checkpoint drops the later ones."""
    from config.sft_config import SFTConfig
    from finetune.sft_trainer import run_sft
    from fixtures.demo_data import write_sft_data

    out = tmp_path / "sft"
    config = SFTConfig(
        model_name=str(tiny_model_dir),
        dataset=str(write_sft_data(tmp_path / "sft.jsonl", 32, seed=0)),
        output_dir=str(out),
        batch_size=8,
        eval_fraction=0.0,
        progress_bar=False,
        save_every=1,
        keep_last_checkpoints=3,
    )
    run_sft(config)
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [f"step_00000{k}" for k in (2, 3, 4)]
    (checkpoints / "step_000004" / "optimizer.safetensors").unlink()  # a kill mid-deletion
    for leftover in (checkpoints / ".tmp-step_000005-1", checkpoints / ".trash-step_000001-1"):
        leftover.mkdir()
        (leftover / "model.safetensors").write_bytes(b"partial")
    (tmp_path / "sft" / ".tmp-model-1").mkdir()
    with pytest.raises(FileNotFoundError, match="optimizer.safetensors is missing"):
        run_sft(config, resume_from=checkpoints / "step_000004")
    with caplog.at_level("INFO", logger="ppo_mlx"):
        run_sft(config, resume_from="latest")
    assert "resumed from " + str(checkpoints / "step_000003") in caplog.text
    assert sorted(p.name for p in checkpoints.iterdir()) == [f"step_00000{k}" for k in (2, 3, 4)]
    assert not list(out.glob(".tmp-*")) and (out / "model").is_dir()
    caplog.clear()
    with caplog.at_level("WARNING", logger="ppo_mlx"):
        run_sft(config, resume_from=checkpoints / "step_000002")
    assert "abandoned timeline (step_000003, step_000004)" in caplog.text


def test_prints_and_log_lines_go_above_the_progress_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    from tqdm import tqdm

    from training.run_control import output_beside_progress

    written: list[str] = []
    monkeypatch.setattr(tqdm, "write", staticmethod(lambda s, file=None, **_: written.append(s)))
    with output_beside_progress(True):
        print("step 3: reward 0.5")
        print("partial", end="")
        print(" line")
        logging.getLogger("ppo_mlx").warning("a log line")
    assert written[:2] == ["step 3: reward 0.5", "partial line"]
    with output_beside_progress(False):
        print("plain")  # no bar: untouched
    assert written[-1] != "plain"


def test_a_signal_inside_a_finaliser_is_delivered_again_after_it() -> None:
    """SIGTERM while the model loaded sometimes struck inside a library object's ``__del__``
    (regex's, as a tokenizer loaded): the exception raised there was printed as "Exception
    ignored" and the command went on to exit 0. The handler now re-delivers the signal once the
    finaliser has returned, and raises anywhere else."""
    import sys as _sys

    from training.run_control import Interrupted, raise_interrupted

    received: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    try:

        class Finalised:
            def __del__(self) -> None:
                raise_interrupted(signal.SIGUSR1, _sys._getframe())

        Finalised()  # collected at once: __del__ runs the handler, which must not raise there
        deadline = time.monotonic() + 5
        while not received and time.monotonic() < deadline:
            time.sleep(0.01)
        assert received == [signal.SIGUSR1]
        with pytest.raises(Interrupted, match="SIGUSR1"):
            raise_interrupted(signal.SIGUSR1, _sys._getframe())
    finally:
        signal.signal(signal.SIGUSR1, previous)
