"""Atomic checkpoints: written aside then renamed, pruned, resolved."""

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from training.checkpoint import (
    CheckpointManager,
    CheckpointWriteError,
    atomic_directory,
    load_training_state,
    save_training_state,
)


def save(manager: CheckpointManager, step: int) -> Path:
    return manager.save(step, {"policy": {"w": mx.full((2,), float(step))}}, {"global_step": step})


def test_round_trip_and_latest(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=0)
    save(manager, 1)
    path = save(manager, 12)
    assert manager.latest() == path and path.name == "step_000012"
    arrays, state = manager.load(manager.resolve("latest"))
    assert state == {"global_step": 12}
    assert arrays["policy"]["w"].tolist() == [12.0, 12.0]


def test_keeps_last_n(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3, 4):
        save(manager, step)
    assert [p.name for p in manager.checkpoints()] == ["step_000003", "step_000004"]


def test_half_written_checkpoint_is_ignored(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=3)
    good = save(manager, 5)
    # A crash mid-write leaves a temporary directory, or a step directory without its state file.
    (tmp_path / ".tmp-step_000006-999").mkdir()
    (tmp_path / ".tmp-step_000006-999" / "policy.safetensors").write_bytes(b"partial")
    (tmp_path / "step_000007").mkdir()
    assert manager.latest() == good
    save(manager, 6)
    assert not (tmp_path / ".tmp-step_000006-999").exists()


def test_resave_same_step_replaces(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    save(manager, 3)
    manager.save(3, {"policy": {"w": mx.zeros((2,))}}, {"global_step": 3, "again": True})
    assert manager.load(manager.resolve("latest"))[1]["again"] is True


def test_resolve_errors(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        manager.resolve("latest")
    with pytest.raises(FileNotFoundError, match="not a checkpoint"):
        manager.resolve(tmp_path)


# --------------------------------------------------------------------------- crash safety


def test_a_half_deleted_checkpoint_is_not_listed_nor_resumed(tmp_path: Path) -> None:
    """A kill while an old checkpoint was deleted (before pruning renamed first) left only some of
    its files: it must not count as a checkpoint."""
    manager = CheckpointManager(tmp_path, keep_last=0)
    first = manager.save(1, {"policy": {"w": mx.ones((2,))}, "opt": {"m": mx.ones((2,))}}, {})
    good = save(manager, 2)
    (first / "policy.safetensors").unlink()  # what an interrupted rmtree leaves
    assert manager.checkpoints() == [good]
    with pytest.raises(FileNotFoundError, match="policy.safetensors is missing"):
        manager.resolve(first)
    # A checkpoint missing only an optimiser file is not resumed with a fresh optimiser either.
    (good / "policy.safetensors").unlink()
    assert manager.latest() is None


def test_a_truncated_latest_checkpoint_is_passed_over_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """issue #47: resume_from='latest' skipped a truncated newest checkpoint for the previous
    one without a word."""
    manager = CheckpointManager(tmp_path, keep_last=0)
    previous = save(manager, 1)
    newest = save(manager, 2)
    weights = newest / "policy.safetensors"
    weights.write_bytes(weights.read_bytes()[:-3])
    with caplog.at_level("WARNING", logger="ppo_mlx"):
        assert manager.resolve("latest") == previous
    assert f"checkpoint {newest} is incomplete (policy.safetensors has" in caplog.text
    assert "resuming from step_000001 instead" in caplog.text


def test_a_damaged_file_is_named_on_load(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    path = save(manager, 3)
    data = bytearray((path / "policy.safetensors").read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes
    (path / "policy.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="policy.safetensors does not match its checksum"):
        manager.load(path)


def test_pruning_renames_before_deleting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import training.checkpoint as checkpoint

    manager = CheckpointManager(tmp_path, keep_last=1)
    save(manager, 1)

    def killed(path: Any, ignore_errors: bool = False, **kwargs: Any) -> None:
        raise KeyboardInterrupt  # the process dies inside the deletion

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        save(manager, 2)
    monkeypatch.undo()
    # The old checkpoint left the listing before its deletion began; the new one is complete.
    assert [p.name for p in manager.checkpoints()] == ["step_000002"]
    assert list(tmp_path.glob(".trash-*"))
    save(manager, 3)  # the next save removes the leftover
    assert not list(tmp_path.glob(".trash-*")) and not list(tmp_path.glob(".tmp-*"))


def test_leftovers_do_not_block_and_are_removed(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2)
    good = save(manager, 4)
    for leftover in (".tmp-step_000005-4242", ".trash-step_000001-4242"):
        (tmp_path / leftover).mkdir()
        (tmp_path / leftover / "policy.safetensors").write_bytes(b"x" * 100)
    assert manager.resolve("latest") == good
    save(manager, 5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000004", "step_000005"]


def test_a_full_disk_is_named_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    manager = CheckpointManager(tmp_path, keep_last=2)
    good = save(manager, 1)

    def full(path: str, arrays: Any, metadata: Any = None) -> None:
        raise RuntimeError("[write] Unable to write 8391 bytes to file.")  # what MLX raises

    monkeypatch.setattr(mx, "save_safetensors", full)
    with pytest.raises(CheckpointWriteError) as info:
        save(manager, 2)
    message = str(info.value)
    assert "step_000002" in message and "MB free" in message and "needs about" in message
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert manager.checkpoints() == [good] and not list(tmp_path.glob(".tmp-*"))
    monkeypatch.undo()
    assert save(manager, 2).name == "step_000002"  # space freed: it works again

    with pytest.raises(CheckpointWriteError, match="No space left"):
        with atomic_directory(tmp_path / "final") as out:
            (out / "weights").write_bytes(b"x")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert not (tmp_path / "final").exists() and not list(tmp_path.glob(".tmp-final*"))


def test_atomic_directory_replaces_whole_or_not_at_all(tmp_path: Path) -> None:
    final = tmp_path / "final"
    with atomic_directory(final) as out:
        (out / "a.txt").write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_directory(final) as out:
            (out / "b.txt").write_text("new, half")
            raise KeyboardInterrupt
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    assert [p.name for p in final.iterdir()] == ["a.txt"]
    with atomic_directory(final) as out:
        (out / "b.txt").write_text("new")
    assert [p.name for p in final.iterdir()] == ["b.txt"]


def test_a_truncated_last_metrics_line_is_dropped(tmp_path: Path, caplog: Any) -> None:
    from training.metrics_logger import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x": 2.0}\n{"step": 3, "x"')
    with caplog.at_level("WARNING", logger="ppo_mlx"):
        assert [r["step"] for r in read_metrics(path)] == [1, 2]
    assert "partly written last line" in caplog.text
    path.write_text('{"step": 1}\n{"step": 2,\n{"step": 3}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        read_metrics(path)


def test_weights_of_another_shape_are_refused(tmp_path: Path) -> None:
    import mlx.nn as nn

    manager = CheckpointManager(tmp_path)
    path = save_training_state(manager, 1, {"policy": nn.Linear(4, 2)}, {}, {"global_step": 1})
    with pytest.raises(ValueError, match="do not match this run's trainable parameters"):
        load_training_state(path, {"policy": nn.Linear(4, 3)}, {})
