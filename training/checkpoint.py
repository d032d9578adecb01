"""Crash-safe, resumable checkpoints: a directory per step, written aside, verified, renamed.

A checkpoint directory ``step_000120/`` holds one ``<name>.safetensors`` file per group of arrays
(trainable weights, optimiser states), ``trainer_state.json`` (counters, history, config) and,
written last, ``manifest.json``: every other file with its size and SHA-256. The guarantees:

* **Written aside, then renamed.** Everything goes to a hidden ``.tmp-step_*`` directory, is
  fsynced, and the directory is renamed into place (atomic on POSIX file systems). A crash
  mid-write leaves only the hidden directory, which the next save removes.
* **Listed only when complete.** A ``step_*`` directory counts as a checkpoint only if its
  manifest is there and every file has the size the manifest says; :meth:`CheckpointManager.load`
  also checks every checksum before reading, and names the damaged file otherwise.
* **Removed by renaming first.** Pruning (and replacing a step) renames the old directory to a
  hidden ``.trash-*`` name before deleting it, so a kill during deletion never leaves a half-deleted
  checkpoint in the listing; leftovers are removed by the next save.
* **A full disk is named.** A failed write removes its temporary directory and raises
  :class:`CheckpointWriteError` naming the path, the free space and the space needed; the
  previous checkpoints are untouched, so the run resumes once space is freed.

:func:`atomic_directory` gives the same write-aside-and-rename to a final model directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, cast

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from base_setup import distributed as dist

logger = logging.getLogger("ppo_mlx")

_STEP_DIR = re.compile(r"^step_(\d+)$")
STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
_MANIFEST_FORMAT = 1
_HASH_CHUNK = 1 << 20


class CheckpointWriteError(OSError):
    """A checkpoint or model directory could not be written (e.g. the disk is full); the
    message names the path and the space it needed. Nothing half-written is left behind."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_failure(
    path: Path, err: BaseException, needed: int | None = None
) -> CheckpointWriteError:
    """A :class:`CheckpointWriteError` for a failed write under ``path``: what failed, the free
    space on its file system and (when known) the space the write needed."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    need = f", and it needs about {needed / 2**20:.1f} MB" if needed is not None else ""
    saved = _run_checkpoints(path)
    if saved:
        then = f"resume with --resume latest (the checkpoints up to {saved[-1].name} are intact)"
    else:
        # Its metrics of unsaved steps are there: a fresh start must replace them.
        then = (
            "start the run again with --overwrite (overwrite_output_dir: true): it has no "
            "checkpoint to resume from yet"
        )
    return CheckpointWriteError(
        f"could not write {path} ({type(err).__name__}: {err}). The file system has "
        f"{free / 2**20:.1f} MB free{need}: free some space (or point output_dir elsewhere) and "
        f"{then}"
    )


def _run_checkpoints(path: Path) -> list[Path]:
    """The complete checkpoints of the run that ``path`` is written for: a checkpoint directory
    under ``checkpoints/``, or a file or model beside that folder (or one level below)."""
    for folder in (path.parent, path.parent / "checkpoints", path.parent.parent / "checkpoints"):
        if folder.name == "checkpoints" and folder.is_dir():
            return CheckpointManager(folder).checkpoints()
    return []


@contextmanager
def named_write(path: str | Path, needed: int | None = None) -> Iterator[None]:
    """Within the block, an ``OSError`` (a full disk: ``[Errno 28] No space left on device``,
    which names no file) becomes a :class:`CheckpointWriteError` naming ``path`` and the free
    space (:func:`write_failure`), raised alone (no chained tracebacks)."""
    try:
        yield
    except CheckpointWriteError:
        raise
    except OSError as err:
        raise write_failure(Path(path), err, needed) from None


def remove_leftovers(root: Path, name_pattern: str = "*") -> None:
    """Delete hidden ``.tmp-<name>-*`` / ``.trash-<name>-*`` directories under ``root`` that
    crashed or killed writes left (this process's own in-flight ones are never there when this
    runs)."""
    if not root.is_dir():
        return
    for prefix in (".tmp-", ".trash-"):
        for leftover in root.glob(f"{prefix}{name_pattern}"):
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)


def _replace_directory(tmp: Path, final: Path) -> None:
    """Put the complete directory ``tmp`` at ``final``, replacing what is there: the old one is
    renamed out of the way first, so ``final`` is at every moment either the old or the new
    directory, complete."""
    _fsync_dir(tmp)
    if final.exists():
        trash = final.parent / f".trash-{final.name}-{os.getpid()}"
        if trash.exists():
            shutil.rmtree(trash)
        final.rename(trash)
        tmp.rename(final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        tmp.rename(final)
    _fsync_dir(final.parent)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync_file(Path(dirpath) / name)
        _fsync_dir(Path(dirpath))


def check_save_target(path: str | Path, *, overwrite: bool, own: Path | None = None) -> None:
    """Raise ``ValueError`` if saving a model directory at ``path`` would destroy what is
    there: a file, or (without ``overwrite``) a non-empty directory. ``own``: the directory the
    run writes its model to (``<output_dir>/final``), which it replaces as its own."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"cannot save a model to {path}: it is a file; give a directory path")
    is_own = own is not None and path.resolve() == Path(own).resolve()
    if path.is_dir() and any(path.iterdir()) and not (overwrite or is_own):
        raise ValueError(
            f"cannot save a model to {path}: the directory is not empty; choose a new "
            "directory or pass overwrite=True to replace it"
        )


@contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Write a directory (a final model, an export) all or nothing.

    Yields a hidden temporary sibling to write into; when the block ends without an error its
    files are fsynced and it replaces ``path`` in one rename (an existing ``path`` stays complete
    until that moment). On an error the temporary directory is removed and the error re-raised
    (an ``OSError`` as a :class:`CheckpointWriteError` naming the path and the free space).
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(final.parent, f"{final.name}-*")
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
        _replace_directory(tmp, final)
    except (OSError, RuntimeError) as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, CheckpointWriteError):
            raise
        raise write_failure(final, err) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of a checkpoint directory, or None if it has none (or an unreadable one)."""
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return manifest if isinstance(manifest, dict) and "files" in manifest else None


def verify_checkpoint(path: str | Path, *, checksums: bool = True) -> str | None:
    """What is wrong with the checkpoint directory ``path``, or None if it is complete: every
    file of its manifest present with its size (and, with ``checksums``, its SHA-256)."""
    path = Path(path)
    manifest = read_manifest(path)
    if manifest is None:
        return f"it has no readable {MANIFEST_FILE} (written last: the write did not finish)"
    for name, entry in manifest["files"].items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != entry["bytes"]:
            return f"{name} has {size} bytes, the manifest says {entry['bytes']}"
        if checksums and _sha256(file) != entry["sha256"]:
            return f"{name} does not match its checksum"
    return None


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

    def _step_dirs(self) -> list[Path]:
        """Every ``step_NNNNNN`` directory, complete or not, oldest first."""
        if not self.root.is_dir():
            return []
        found = [
            (int(m.group(1)), p)
            for p in self.root.iterdir()
            if (m := _STEP_DIR.match(p.name)) and p.is_dir()
        ]
        return [p for _, p in sorted(found)]

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints (manifest present, every file of the right size), oldest first."""
        return [p for p in self._step_dirs() if verify_checkpoint(p, checksums=False) is None]

    def latest(self) -> Path | None:
        """The most recent complete checkpoint, or None."""
        found = self.checkpoints()
        return found[-1] if found else None

    def resolve(self, path_or_latest: str | Path) -> Path:
        """A complete checkpoint directory from a path, or from ``"latest"`` (the newest
        complete one under ``root``).

        Raises:
            FileNotFoundError: no checkpoint there, or an incomplete or damaged one (named).
        """
        if str(path_or_latest) == "latest":
            latest = self.latest()
            for newer in self._step_dirs():  # passed over for an older one: said, not silent
                if latest is None or newer.name > latest.name:
                    logger.warning(
                        "checkpoint %s is incomplete (%s): resuming from %s instead",
                        newer,
                        verify_checkpoint(newer, checksums=False),
                        latest.name if latest is not None else "none",
                    )
            if latest is None:
                raise FileNotFoundError(
                    f"resume_from='latest' but there is no complete checkpoint under "
                    f"{self.root}: start the run again without --resume (with --overwrite if "
                    "the folder holds its metrics), or point it at a checkpoint directory"
                )
            return latest
        path = Path(path_or_latest)
        if not (path / STATE_FILE).is_file() and read_manifest(path) is None:
            raise FileNotFoundError(
                f"{path} is not a checkpoint directory (no {STATE_FILE}); checkpoints are the "
                f"step_NNNNNN directories under <output_dir>/checkpoints"
            )
        problem = verify_checkpoint(path, checksums=False)
        if problem is not None:
            raise FileNotFoundError(
                f"checkpoint {path} is incomplete: {problem}. Resume from another one: "
                f"{[str(p) for p in self.checkpoints()] or 'none is complete'}"
            )
        return path

    def save(
        self, step: int, arrays: dict[str, dict[str, mx.array]], state: dict[str, Any]
    ) -> Path:
        """Write a checkpoint for ``step`` (see the module doc) and prune old ones; returns its
        directory.

        ``arrays`` maps a file stem to a flat ``{name: array}`` dict; ``state`` must be
        JSON-serialisable.

        Raises:
            CheckpointWriteError: the write failed (e.g. a full disk); nothing of it is left.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        remove_leftovers(self.root)
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f".tmp-{final.name}-{os.getpid()}"
        state_text = json.dumps(state, indent=1, sort_keys=True)
        needed = sum(a.nbytes for group in arrays.values() for a in group.values())
        needed += len(state_text)
        try:
            tmp.mkdir()
            files: dict[str, dict[str, Any]] = {}
            for stem, group in arrays.items():
                file = tmp / f"{stem}.safetensors"
                mx.save_safetensors(str(file), group)
                _fsync_file(file)
                files[file.name] = {"bytes": file.stat().st_size, "sha256": _sha256(file)}
            state_file = tmp / STATE_FILE
            state_file.write_text(state_text)
            _fsync_file(state_file)
            files[STATE_FILE] = {"bytes": state_file.stat().st_size, "sha256": _sha256(state_file)}
            manifest = {"format": _MANIFEST_FORMAT, "step": step, "files": files}
            (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1, sort_keys=True))
            _fsync_file(tmp / MANIFEST_FILE)
            _replace_directory(tmp, final)
        except (OSError, RuntimeError) as err:  # MLX reports a failed write as RuntimeError
            shutil.rmtree(tmp, ignore_errors=True)
            raise write_failure(final, err, needed) from None
        self._prune()
        return final

    @staticmethod
    def read_state(path: str | Path) -> dict[str, Any]:
        """The JSON state of a checkpoint directory (counters, history, config), no arrays."""
        return dict(json.loads((Path(path) / STATE_FILE).read_text()))

    @staticmethod
    def load(path: str | Path) -> tuple[dict[str, dict[str, mx.array]], dict[str, Any]]:
        """Read a checkpoint directory written by :meth:`save`, after checking every file
        against the manifest.

        Raises:
            ValueError: the checkpoint is incomplete or damaged (the file is named).
        """
        path = Path(path)
        problem = verify_checkpoint(path, checksums=True)
        if problem is not None:
            raise ValueError(
                f"checkpoint {path} cannot be resumed: {problem}. Resume from an earlier "
                "checkpoint (the step_NNNNNN directories next to it)"
            )
        state = json.loads((path / STATE_FILE).read_text())
        arrays: dict[str, dict[str, mx.array]] = {}
        for file in sorted(path.glob("*.safetensors")):
            loaded = mx.load(str(file))
            assert isinstance(loaded, dict)
            arrays[file.stem] = loaded
        return arrays, state

    def drop_after(self, step: int) -> list[Path]:
        """Remove the checkpoints of steps after ``step`` (each renamed out of the listing before
        it is deleted); returns the paths they had. What resuming from an earlier checkpoint
        does: the later ones belong to the timeline it abandons."""
        later = [p for p in self.checkpoints() if int(p.name.split("_")[1]) > step]
        for path in later:
            _prune_one(path)
        return later

    def _prune(self) -> None:
        if not self.keep_last:
            return
        for old in self.checkpoints()[: -self.keep_last]:
            _prune_one(old)


def _prune_one(checkpoint: Path) -> None:
    """Delete a checkpoint: out of the listing first (a rename), then deleted, so a kill in
    between leaves only a hidden leftover that the next save removes."""
    trash = checkpoint.parent / f".trash-{checkpoint.name}-{os.getpid()}"
    checkpoint.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)


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
        ValueError: the checkpoint is damaged, lacks one of ``models`` or an optimiser state, or
            its arrays do not match the models' trainable parameters (names and shapes: a run
            with other LoRA settings or another value model).
    """
    arrays, state = CheckpointManager.load(path)
    for name, model in models.items():
        if name not in arrays:
            raise ValueError(
                f"checkpoint {path} holds no {name!r} weights (it has {sorted(arrays)}): it was "
                "written by another kind of run"
            )
        trainable = cast(list[tuple[str, mx.array]], tree_flatten(model.trainable_parameters()))
        expected = {k: tuple(v.shape) for k, v in trainable}
        saved = {k: tuple(v.shape) for k, v in arrays[name].items()}
        if saved != expected:
            missing = sorted(expected.keys() - saved.keys())[:3]
            extra = sorted(saved.keys() - expected.keys())[:3]
            shapes = [
                f"{k}: saved {saved[k]}, now {expected[k]}"
                for k in sorted(saved.keys() & expected.keys())
                if saved[k] != expected[k]
            ][:3]
            raise ValueError(
                f"checkpoint {path}: its {name!r} weights do not match this run's trainable "
                f"parameters (missing {missing}, unexpected {extra}, shapes {shapes}); resume "
                "with the settings the run was started with (LoRA rank, layers and keys, the "
                "models)"
            )
        model.load_weights(list(arrays[name].items()), strict=False)
        mx.eval(model.parameters())
    for name, opt in optimizers.items():
        if opt is None:
            continue
        if name not in arrays:
            raise ValueError(
                f"checkpoint {path} holds no {name!r} state: resuming would restart the "
                "optimiser (moments, step count and schedule); resume from a complete checkpoint"
            )
        opt.state = tree_unflatten(list(arrays[name].items()))
    return state


#: What a config written before a setting existed meant by it (checkpoints of older versions).
LEGACY_DEFAULTS: dict[str, Any] = {"adam_bias_correction": False}


def check_resume_config(
    path: str | Path, saved: Mapping[str, Any], current: Mapping[str, Any], keys: Iterable[str]
) -> None:
    """Raise ``ValueError`` unless the config a checkpoint was written with agrees with this
    run's on every one of ``keys`` (settings that change the data order, the trained parameters,
    their shapes or how they are optimised). A key the checkpoint's config lacks counts as its
    :data:`LEGACY_DEFAULTS` value."""
    for key in keys:
        if saved.get(key, LEGACY_DEFAULTS.get(key)) != current.get(key):
            raise ValueError(
                f"checkpoint {path} was written with {key}="
                f"{saved.get(key, LEGACY_DEFAULTS.get(key))!r} but this run has "
                f"{key}={current.get(key)!r}: resume with the same configuration"
            )


#: Settings that may differ on resume without a word: it acted once, when the run began.
_UNLISTED_ON_RESUME: tuple[str, ...] = ("overwrite_output_dir",)


def changed_settings(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``"key old -> new"`` for each setting of ``current`` (a config as ``config_to_dict``
    gives it) that differs from the checkpoint's ``saved`` config, values written as ``--set``
    takes them. A setting the checkpoint did not record (an older version) is not listed."""
    now = json.loads(json.dumps(dict(current)))  # tuples as lists, as the checkpoint holds them

    def shown(value: Any) -> str:
        return value if isinstance(value, str) else json.dumps(value)

    return [
        f"{key} {shown(saved[key])} -> {shown(value)}"
        for key, value in now.items()
        if key in saved and saved[key] != value and key not in _UNLISTED_ON_RESUME
    ]


def warn_changed_settings(
    path: str | Path,
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    notes: Iterable[str | None] = (),
) -> None:
    """Log one warning on resume: every setting that differs from the checkpoint's config
    (:func:`changed_settings`; they take effect), then ``notes`` on what follows from them
    (the learning-rate schedule continued, a KL coefficient that is state). Nothing when
    nothing changed."""
    changes = changed_settings(saved, current)
    said = [note for note in notes if note]
    if not changes and not said:
        return
    head = f"resuming {Path(path).name}"
    if changes:
        head += " with changed settings: " + ", ".join(changes)
    logger.warning("; ".join([head, *said]))


def resolve_on_all_ranks(
    checkpoints: CheckpointManager, resume_from: str | Path, group: Any
) -> Path:
    """The checkpoint directory ``resume_from`` names (:meth:`CheckpointManager.resolve`), found
    on every rank and the same everywhere (its state file compared by hash): a rank that cannot
    find it, or reads another, stops every rank with one message."""
    path: Path | None = None
    error: FileNotFoundError | None = None
    try:
        path = checkpoints.resolve(resume_from)
    except FileNotFoundError as err:
        error = err
    dist.raise_if_any_rank_failed(error, f"finding the checkpoint {resume_from}", group)
    assert path is not None
    dist.check_same_on_all_ranks(
        (path / STATE_FILE).read_bytes(),
        f"the checkpoint {path}",
        "every rank must read the same checkpoint: keep output_dir on storage that every "
        "machine shares, or copy it to the same path on each",
        group,
    )
    return path
