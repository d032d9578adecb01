"""One actionable line for every bad input a user can make, naming the file (or step), before
any work is lost: each of these ended in a traceback or in an error that named nothing."""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

import main
from fixtures.tiny_corpus import review_prompts
from ppo_trainer.ppo_trainer import PPOTrainer
from tests.test_reliability_writers import make_config

PROMPTS = review_prompts(8, seed=0)


def length_reward(prompts: list[str], completions: list[str]) -> list[float]:
    return [float(len(c)) / 10 for c in completions]


def texts_only(texts: list[str]) -> list[float]:
    """Names neither ``completions`` nor ``**kwargs``: called positionally, with two arguments."""
    return [1.0 for _ in texts]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """``main.py ARGV`` in this process: its exit code and its ``error:`` line (the one line
    it printed on stderr after the backend line)."""
    capsys.readouterr()
    code = main.main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    return code, errors[0]


def _train_args(model: Path, run: Path, prompts: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--prompts",
        str(prompts),
        "--reward-fn",
        "tests.test_reliability_messages:length_reward",
        "--set",
        f"model_name={model}",
        "--set",
        f"output_dir={run}",
        "--set",
        "progress_bar=false",
        *extra,
    ]


def test_a_prompt_file_that_is_not_utf8_or_a_message_without_content_is_named(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    latin = tmp_path / "prompts.txt"
    latin.write_bytes("Review of the camera:\nCritique du caf\xe9:\n".encode("latin-1"))
    code, err = run_cli(capsys, *_train_args(tiny_model_dir, tmp_path / "run", latin))
    assert code == 2 and f"{latin}:2: not UTF-8 text (byte 0xe9)" in err
    chat = tmp_path / "prompts.jsonl"
    chat.write_text(
        '{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": [{"role": "user"}]}\n'
    )
    code, err = run_cli(capsys, *_train_args(tiny_model_dir, tmp_path / "run", chat))
    assert code == 2 and f"{chat}:2: 'messages' has message 0 with no 'content'" in err


def test_train_says_what_a_prompt_must_be(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = PPOTrainer(make_config(tiny_model_dir, tmp_path / "run"), reward_model=length_reward)
    with pytest.raises(ValueError, match="prompt 0 is int 1: a prompt must be text, chat messages"):
        trainer.train([1, 2, 3])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="prompt 1 has message 0 with no 'content'"):
        trainer.train(["a", [{"role": "user"}]])


@pytest.mark.parametrize("damage", ["config", "weights"])
def test_a_damaged_model_folder_names_the_file(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    if damage == "config":
        (model / "config.json").write_text('{"model_type": "qwen3",\n')
        named = f"{model / 'config.json'} is not valid JSON"
    else:
        weights = model / "model.safetensors"
        with open(weights, "r+b") as f:
            f.truncate(weights.stat().st_size // 2)
        named = f"{weights} is damaged or incomplete"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Review of the camera:\n")
    code, err = run_cli(capsys, *_train_args(model, tmp_path / "run", prompts))
    assert code == 2 and named in err
    code, err = run_cli(capsys, "generate", "--model", str(model), "--prompt", "hi")
    assert code == 2 and named in err


def test_a_reward_function_with_the_wrong_signature_is_named_before_generation(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    trainer = PPOTrainer(make_config(tiny_model_dir, tmp_path / "run"), reward_model=texts_only)
    with pytest.raises(ValueError, match=r"texts_only\(texts.*takes 1 positional.*called with 2"):
        trainer.train(PROMPTS)
    assert trainer.global_step == 0 and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_missing_tracker_is_named_before_overwrite_removes_the_earlier_run(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    PPOTrainer(make_config(tiny_model_dir, run), reward_model=length_reward).train(PROMPTS)
    before = (run / "metrics.jsonl").read_text()
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # not installed
    again = make_config(tiny_model_dir, run, overwrite_output_dir=True, log_with="tensorboard")
    with pytest.raises(ValueError, match="needs tensorboardX.*pip install tensorboardX"):
        PPOTrainer(again, reward_model=length_reward).train(PROMPTS)
    assert (run / "metrics.jsonl").read_text() == before
    assert (run / "checkpoints" / "step_000002").is_dir()


@pytest.mark.parametrize("bad", [math.nan, 10**400], ids=["nan", "int_beyond_float"])
def test_a_nan_reward_names_the_step(tiny_model_dir: Path, tmp_path: Path, bad: float) -> None:
    """A Python int beyond float's range (10**400) raised OverflowError with a traceback
    (issue #47); it is a non-finite score like NaN."""
    calls = {"n": 0}

    def nan_at_second(prompts: list[str], completions: list[str]) -> list[float]:
        calls["n"] += 1
        # Call 1 is train()'s trial call (empty completions), call 3 step 2's scoring.
        return [bad if calls["n"] == 3 else 1.0 for _ in completions]

    trainer = PPOTrainer(make_config(tiny_model_dir, tmp_path / "run"), reward_model=nan_at_second)
    with pytest.raises(ValueError, match="^step 2: .*non-finite scores"):
        trainer.train(PROMPTS)
    assert trainer.global_step == 1


def test_resuming_a_checkpoint_that_does_not_exist_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said "model_name is required" (the run's settings come from the checkpoint)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Review of the camera:\n")
    missing = tmp_path / "run" / "checkpoints" / "step_000007"
    base = ["train", "--prompts", str(prompts), "--set", f"output_dir={tmp_path / 'run'}"]
    code, err = run_cli(capsys, *base, "--resume", str(missing))
    assert code == 2 and f"there is no checkpoint at {missing}" in err
    code, err = run_cli(capsys, *base, "--resume", "latest")
    assert code == 2 and "no complete checkpoint under" in err
    code, err = run_cli(capsys, "sft", "--data", str(prompts), "--resume", "latest")
    assert code == 2 and "no complete checkpoint under" in err


def test_export_on_a_full_disk_is_one_message_and_leaves_nothing(
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import mlx_lm.utils

    def full(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("[save_safetensors] Failed to write: No space left on device")

    out = tmp_path / "exported"
    stale = tmp_path / ".exported.partial-999999999"  # a killed export's (no such process)
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    monkeypatch.setattr(mlx_lm.utils, "save_model", full)
    code, err = run_cli(capsys, "export", str(tiny_model_dir), "--out", str(out))
    assert code == 1 and f"could not write the export {out}" in err and "MB free" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    monkeypatch.undo()
    assert main.main(["export", str(tiny_model_dir), "--out", str(out)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported"]
