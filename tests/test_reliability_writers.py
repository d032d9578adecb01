"""One writer per run folder, and a Python API that never destroys what the user has: a second
process writing into a running run's folder, ``save_model`` into a folder or file that holds
something, ``train()`` called again on a trained trainer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from config.ppo_config import PPOConfig
from fixtures.tiny_corpus import review_prompts
from ppo_trainer.ppo_trainer import PPOTrainer
from training.metrics_logger import read_metrics
from training.run_control import LOCK_FILE, run_lock

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = review_prompts(8, seed=0)

_HOLD = """
import sys, time
from training.run_control import run_lock
with run_lock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(600)
"""


def length_reward(prompts: list[str], completions: list[str]) -> list[float]:
    return [float(len(c)) / 10 for c in completions]


def make_config(model_dir: Path, out: Path, **overrides: Any) -> PPOConfig:
    values: dict[str, Any] = dict(
        model_name=str(model_dir),
        max_new_tokens=4,
        batch_size=2,
        num_ppo_epochs=1,
        output_dir=str(out),
        progress_bar=False,
        save_every=1,
        total_steps=2,
    )
    values.update(overrides)
    return PPOConfig(**values)


@pytest.fixture
def held(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    """A run folder locked by another process, as a running ``train`` holds it."""
    run = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(run)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stdout.readline() == "locked\n"
    yield run, process
    process.kill()
    process.wait()


def test_a_second_writer_is_refused_naming_the_first_and_a_killed_one_frees_the_folder(
    held: tuple[Path, subprocess.Popen[str]],
) -> None:
    run, process = held
    with pytest.raises(ValueError, match=f"in use: process {process.pid} is writing"):
        with run_lock(run):
            pass
    process.send_signal(signal.SIGKILL)  # no cleanup runs: the kernel drops the lock
    process.wait()
    with run_lock(run):
        with run_lock(run):  # re-entrant within a process
            assert (run / LOCK_FILE).read_text().strip() == str(os.getpid())
        assert (run / LOCK_FILE).exists()
    assert not (run / LOCK_FILE).exists()


def test_overwrite_while_a_run_is_going_is_refused_before_anything_is_removed(
    tiny_model_dir: Path, held: tuple[Path, subprocess.Popen[str]]
) -> None:
    """Both processes used to exit 0, the second having emptied the first's folder."""
    run, process = held
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    config = make_config(tiny_model_dir, run, overwrite_output_dir=True)
    trainer = PPOTrainer(config, reward_model=length_reward)
    with pytest.raises(ValueError, match=f"process {process.pid}"):
        trainer.train(PROMPTS)
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (run / "checkpoints" / "step_000001").is_dir()
    assert trainer.global_step == 0


@pytest.mark.slow
@pytest.mark.parametrize("command", ["train", "sft"])
def test_the_command_line_refuses_a_second_writer_before_any_model_loads(
    held: tuple[Path, subprocess.Popen[str]], tmp_path: Path, command: str
) -> None:
    run, process = held
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    data = tmp_path / "data.jsonl"
    data.write_text("".join('{"prompt": "a", "completion": "b"}\n' for _ in range(8)))
    given = ["--prompts", str(data)] if command == "train" else ["--data", str(data)]
    result = subprocess.run(
        [sys.executable, "main.py", command, *given, "--overwrite"]
        + ["--set", "model_name=/nonexistent/model", "--set", f"output_dir={run}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert f"process {process.pid} is writing a run there" in result.stderr
    assert "Traceback" not in result.stderr
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_save_model_refuses_a_folder_or_file_that_holds_something(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """save_model(existing_dir) deleted what was in it; save_model(file) turned the file into a
    model folder (the file left as a hidden .trash-*)."""
    trainer = PPOTrainer(make_config(tiny_model_dir, tmp_path / "run"), reward_model=length_reward)
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not empty.*overwrite=True"):
        trainer.save_model(folder)
    assert [p.name for p in folder.iterdir()] == ["notes.txt"]
    file = tmp_path / "weights.bin"
    file.write_text("keep me too")
    with pytest.raises(ValueError, match="is a file"):
        trainer.save_model(file, overwrite=True)
    assert file.read_text() == "keep me too"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "run", "weights.bin"]
    out = trainer.save_model(folder, overwrite=True)
    assert (out / "adapters.safetensors").is_file() and not (out / "notes.txt").exists()
    # The run's own final/ is its to replace (a resumed run saves it again).
    trainer.save_model(trainer.run_dir / "final")
    trainer.save_model(trainer.run_dir / "final")


def test_sft_save_pretrained_refuses_a_folder_that_holds_something(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from config.sft_config import SFTConfig
    from finetune.sft_trainer import SFTTrainer

    trainer = SFTTrainer(
        SFTConfig(model_name=str(tiny_model_dir), output_dir=str(tmp_path / "run"))
    )
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not empty"):
        trainer.save_pretrained(folder)
    assert (folder / "notes.txt").read_text() == "keep me"


def test_train_called_again_with_overwrite_keeps_the_run(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """It emptied metrics.jsonl and the checkpoints, then trained 0 steps."""
    run = tmp_path / "run"
    trainer = PPOTrainer(
        make_config(tiny_model_dir, run, overwrite_output_dir=True), reward_model=length_reward
    )
    trainer.train(PROMPTS)
    with pytest.raises(ValueError, match="already trained 2 steps.*resume_from='latest'"):
        trainer.train(PROMPTS)
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2]
    assert (run / "checkpoints" / "step_000002").is_dir()


_HELD_RUN = """
from base_setup import setup_blas; setup_blas()
import os, sys, time, json
from config.ppo_config import PPOConfig
from fixtures.tiny_corpus import review_prompts
from ppo_trainer.ppo_trainer import PPOTrainer
from ppo_trainer.callbacks import TrainerCallback

class Held(TrainerCallback):  # after step 2, waits until the test says go on
    def on_step_end(self, trainer, step, metrics):
        print(f"step {step}", flush=True)
        while step == 2 and not os.path.exists(sys.argv[2]):
            time.sleep(0.1)

config = PPOConfig(**json.loads(sys.argv[1]))
trainer = PPOTrainer(config, reward_model=lambda p, c: [float(len(x)) for x in c])
trainer.train(review_prompts(8, seed=0), callbacks=[Held()])
"""


@pytest.mark.slow
def test_a_second_resume_while_the_run_goes_on_is_refused(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Two processes resuming one folder both exited 0, with interleaved steps in metrics.jsonl."""
    import json

    run = tmp_path / "run"
    settings = dict(
        model_name=str(tiny_model_dir),
        max_new_tokens=4,
        batch_size=2,
        num_ppo_epochs=1,
        output_dir=str(run),
        progress_bar=False,
        total_steps=4,
        save_every=1,
    )
    first = subprocess.Popen(
        [sys.executable, "-c", _HELD_RUN, json.dumps(settings), str(tmp_path / "go_on")],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert first.stdout is not None and first.stdout.readline() == "step 1\n"
        assert first.stdout.readline() == "step 2\n"  # step 1's checkpoint is saved
        prompts = tmp_path / "prompts.txt"
        prompts.write_text("Review of the camera:\n")
        second = subprocess.run(
            [sys.executable, "main.py", "train", "--prompts", str(prompts), "--resume", "latest"]
            + ["--set", f"output_dir={run}", "--set", f"model_name={tiny_model_dir}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2, second.stderr
        assert f"process {first.pid} is writing a run there" in second.stderr
    finally:
        (tmp_path / "go_on").touch()
        first.wait(timeout=120)
    assert first.returncode == 0
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4]
    assert not (run / LOCK_FILE).exists()


def test_a_command_that_fails_leaves_no_folder_behind(tmp_path: Path) -> None:
    """Taking the lock creates the run folder; a run refused before writing removes it again."""
    run = tmp_path / "new" / "run"
    with pytest.raises(ValueError, match="refused"):
        with run_lock(run):
            raise ValueError("refused")
    assert not run.exists()
    with run_lock(run):
        (run / "metrics.jsonl").write_text("")
    assert [p.name for p in run.iterdir()] == ["metrics.jsonl"]


def test_a_directory_at_the_lock_path_and_a_read_only_folder_are_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """issue #47: both gave raw errno text ("[Errno 21] Is a directory: '.../.run.lock'")."""
    import errno

    run = tmp_path / "run"
    (run / LOCK_FILE).mkdir(parents=True)
    with pytest.raises(ValueError, match=r"\.run\.lock is a directory, not the run's lock file"):
        with run_lock(run):
            pass
    # A read-only file system (root ignores chmod, so the error is raised as the kernel would).
    real_open = os.open

    def read_only(path: Any, flags: int, *args: Any) -> int:
        if str(path).endswith(LOCK_FILE):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args)

    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(ValueError, match=r"is not writable \(Read-only file system\): choose"):
        with run_lock(other):
            pass
