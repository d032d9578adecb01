"""Atomic checkpoints: written aside then renamed, pruned, resolved."""

from pathlib import Path

import mlx.core as mx
import pytest

from training.checkpoint import CheckpointManager


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
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        manager.resolve("latest")
    with pytest.raises(FileNotFoundError, match="not a checkpoint"):
        manager.resolve(tmp_path)
