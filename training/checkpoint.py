"""Atomic, resumable checkpoints: a directory per step, written aside and renamed into place.

A checkpoint directory ``step_000120/`` holds one ``<name>.safetensors`` file per group of arrays
(policy trainable weights, value model, optimiser states) and ``trainer_state.json`` (counters, KL
controller, config). It is first written to a hidden temporary directory next to it and then renamed,
which is atomic on POSIX file systems: a crash mid-write leaves a temporary directory that is ignored
(and cleaned up), never a checkpoint that loads wrong.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterable, Mapping

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

_STEP_DIR = re.compile(r"^step_(\d+)$")
STATE_FILE = "trainer_state.json"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


class CheckpointManager:
    """Writes, finds and prunes the checkpoints of one run under ``root``.

    Args:
        root: the run's checkpoint directory (created if needed).
        keep_last: how many of the most recent checkpoints to keep (older ones are deleted after a
            new one is safely in place); 0 keeps all.
    """

    def __init__(self, root: str | Path, keep_last: int = 3) -> None:
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = [
            (int(m.group(1)), p)
            for p in self.root.iterdir()
            if (m := _STEP_DIR.match(p.name)) and (p / STATE_FILE).is_file()
        ]
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        """The most recent complete checkpoint, or None."""
        found = self.checkpoints()
        return found[-1] if found else None

    def resolve(self, path_or_latest: str | Path) -> Path:
        """A checkpoint directory from a path, or from ``"latest"`` (the newest under ``root``)."""
        if str(path_or_latest) == "latest":
            latest = self.latest()
            if latest is None:
                raise FileNotFoundError(
                    f"resume_from='latest' but there is no checkpoint under {self.root}: "
                    "start without resume_from, or point it at a checkpoint directory"
                )
            return latest
        path = Path(path_or_latest)
        if not (path / STATE_FILE).is_file():
            raise FileNotFoundError(
                f"{path} is not a checkpoint directory (no {STATE_FILE}); checkpoints are the "
                f"step_NNNNNN directories under <output_dir>/checkpoints"
            )
        return path

    def save(
        self, step: int, arrays: dict[str, dict[str, mx.array]], state: dict[str, Any]
    ) -> Path:
        """Write a checkpoint for ``step`` atomically and prune old ones; returns its directory.

        ``arrays`` maps a file stem to a flat ``{name: array}`` dict; ``state`` must be JSON-serialisable.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f".tmp-{final.name}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        for stem, group in arrays.items():
            file = tmp / f"{stem}.safetensors"
            mx.save_safetensors(str(file), group)
            _fsync_file(file)
        state_file = tmp / STATE_FILE
        state_file.write_text(json.dumps(state, indent=1, sort_keys=True))
        _fsync_file(state_file)
        _fsync_dir(tmp)
        if final.exists():  # re-saving the same step (e.g. interrupt right after a periodic save)
            trash = self.root / f".trash-{final.name}-{os.getpid()}"
            final.rename(trash)
            tmp.rename(final)
            shutil.rmtree(trash)
        else:
            tmp.rename(final)
        _fsync_dir(self.root)
        self._prune()
        return final

    @staticmethod
    def read_state(path: str | Path) -> dict[str, Any]:
        """The JSON state of a checkpoint directory (counters, history, config), no arrays."""
        return dict(json.loads((Path(path) / STATE_FILE).read_text()))

    @staticmethod
    def load(path: str | Path) -> tuple[dict[str, dict[str, mx.array]], dict[str, Any]]:
        """Read a checkpoint directory written by :meth:`save`."""
        path = Path(path)
        state = json.loads((path / STATE_FILE).read_text())
        arrays: dict[str, dict[str, mx.array]] = {}
        for file in path.glob("*.safetensors"):
            loaded = mx.load(str(file))
            assert isinstance(loaded, dict)
            arrays[file.stem] = loaded
        return arrays, state

    def _prune(self) -> None:
        for leftover in self.root.glob(".tmp-*"):
            if not leftover.name.endswith(f"-{os.getpid()}"):
                shutil.rmtree(leftover, ignore_errors=True)
        if self.keep_last:
            for old in self.checkpoints()[: -self.keep_last]:
                shutil.rmtree(old)


def save_training_state(
    checkpoints: CheckpointManager,
    step: int,
    models: Mapping[str, nn.Module],
    optimizers: Mapping[str, optim.Optimizer | None],
    state: dict[str, Any],
) -> Path:
    """Write a run's checkpoint for ``step``: each model's trainable weights and each optimiser's
    state (moments and step count, hence the learning-rate schedule) under their names, plus the
    JSON ``state`` (counters, history, config)."""
    arrays: dict[str, dict[str, mx.array]] = {
        name: dict(tree_flatten(model.trainable_parameters())) for name, model in models.items()
    }
    arrays.update(
        {name: dict(tree_flatten(opt.state)) for name, opt in optimizers.items() if opt is not None}
    )
    return checkpoints.save(step, arrays, state)


def load_training_state(
    path: str | Path,
    models: Mapping[str, nn.Module],
    optimizers: Mapping[str, optim.Optimizer | None],
) -> dict[str, Any]:
    """Load what :func:`save_training_state` wrote into ``models`` and ``optimizers`` (in
    place); returns the JSON state.

    Raises:
        ValueError: the checkpoint lacks one of ``models`` (a checkpoint of another run kind).
    """
    arrays, state = CheckpointManager.load(path)
    for name, model in models.items():
        if name not in arrays:
            raise ValueError(
                f"checkpoint {path} holds no {name!r} weights (it has {sorted(arrays)}): it was "
                "written by another kind of run"
            )
        model.load_weights(list(arrays[name].items()), strict=False)
        mx.eval(model.parameters())
    for name, opt in optimizers.items():
        if opt is not None and name in arrays:
            opt.state = tree_unflatten(list(arrays[name].items()))
    return state


def check_resume_config(
    path: str | Path, saved: Mapping[str, Any], current: Mapping[str, Any], keys: Iterable[str]
) -> None:
    """Raise ``ValueError`` unless the config a checkpoint was written with agrees with this
    run's on every one of ``keys`` (settings that change the data order, the trained parameters
    or their shapes)."""
    for key in keys:
        if saved.get(key) != current.get(key):
            raise ValueError(
                f"checkpoint {path} was written with {key}={saved.get(key)!r} but this run has "
                f"{key}={current.get(key)!r}: resume with the same configuration"
            )
