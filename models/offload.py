"""Frozen models kept on disk between the phases that use them (``offload_frozen_models``).

A separate reward model, and a reference or teacher that is a copy of its own, work in one phase
of an iteration (scoring: phase 2-3), yet their weights stay resident through generation and the
update, where the run's peak memory usually is. :func:`offload_to_disk` writes a frozen module's
parameters once to a safetensors file and puts lazily loaded arrays of that file in their place:
``mx.load`` reads nothing until an array is evaluated. A pass then reads the weights as it
evaluates, and at the end of each phase :func:`drop_read_weights` gives every offloaded module
fresh unread arrays of its file, so the arrays the phase read are freed with the phase's graph.

The values are the ones written, so the results are the same bit for bit. The module stays usable
everywhere at every moment: a pass outside the phases (a user's own call) reads the weights too,
and holds them until the next phase ends. The cost is one read of the weights per phase that
uses them, from the page cache when the machine has room for it (about a second per GB), from
the disk otherwise.

The file lives in a hidden ``.offloaded-<host>-<pid>`` folder of the run folder (a disk the user
chose for checkpoints, unlike a ``/tmp`` that may be memory), removed when the module is
garbage collected or the process exits; a killed process's folder is removed by the next
offload on the same host.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import weakref
from pathlib import Path
from typing import cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from base_setup.backend import process_running
from models.backbone_loading import flat_parameters

logger = logging.getLogger("ppo_mlx")

_PREFIX = ".offloaded-"
#: Every module offloaded in this process and not yet garbage collected.
_OFFLOADED: weakref.WeakSet[DiskWeights] = weakref.WeakSet()


class DiskWeights:
    """The parameters of one frozen module, kept in a safetensors file and read for each phase
    that uses them (see the module docstring). Held by the module (``module.disk_weights``), so
    it lives as long as the module does.

    Attributes:
        path: the file.
        nbytes: the size of the parameters, in bytes.
    """

    def __init__(self, module: nn.Module, path: Path) -> None:
        self._module = weakref.ref(module)
        self.path = path
        self.nbytes = 0
        self._names: list[str] = []

    def write(self, what: str) -> None:
        """Write the module's parameters to :attr:`path`; ``what`` names the model in errors.

        Raises:
            ValueError: the file cannot be written (no space left, a folder that is not
                writable), with the size it needed.
        """
        module = self._module()
        if module is None:
            raise RuntimeError("the offloaded module was garbage collected")
        flat = flat_parameters(module)
        self._names = list(flat)
        self.nbytes = sum(a.nbytes for a in flat.values())
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            mx.save_safetensors(str(self.path), flat)
        except (OSError, RuntimeError) as err:  # MLX reports a failed write as RuntimeError
            if self.path.is_file():  # a partial write
                self.path.unlink()
            raise ValueError(
                f"offload_frozen_models: could not write {what}'s weights "
                f"({self.nbytes / 2**30:.2f} GiB) to {self.path} ({err}): free that much space "
                "in output_dir's disk, choose another output_dir, or set "
                "offload_frozen_models: false"
            ) from None

    def drop(self) -> None:
        """Give the module fresh, unread arrays of the file: whatever its arrays had read is
        freed once no graph holds it. Reads only the file's header."""
        module = self._module()
        if module is None:
            return
        if not self.path.is_file():
            # Its run folder was removed while the module lives on: most often an earlier
            # trainer of this process that the garbage collector has not reached yet. The
            # module's arrays still read the file they were loaded from (it stays open), so the
            # module works, but it keeps from now on what it reads.
            logger.debug("%s is gone: its model keeps what it reads in memory", self.path)
            _OFFLOADED.discard(self)
            return
        loaded = mx.load(str(self.path))
        if not isinstance(loaded, dict) or sorted(loaded) != sorted(self._names):
            raise RuntimeError(
                f"{self.path} no longer holds the offloaded weights it was written with: "
                "another process changed it"
            )
        module.update(tree_unflatten(list(loaded.items())))


def offload_to_disk(module: nn.Module, run_dir: str | Path, name: str, what: str) -> DiskWeights:
    """Keep the frozen ``module``'s parameters in ``<run_dir>/.offloaded-<host>-<pid>/<name>``
    and read them for each phase that uses them (the module docstring); ``what`` names the model
    in errors. Removes the folders that killed processes on this host left in ``run_dir``.

    Returns:
        the module's :class:`DiskWeights` (also set as ``module.disk_weights``).

    Raises:
        ValueError: ``module`` has trainable parameters (an offloaded model never trains), or
            its weights cannot be written.
    """
    trainable = cast(list[tuple[str, mx.array]], tree_flatten(module.trainable_parameters()))
    if trainable:
        raise ValueError(
            f"offload_frozen_models: {what} has trainable parameters ({trainable[0][0]}, ...): "
            "only frozen models are kept on disk"
        )
    run_dir = Path(run_dir)
    remove_stale_offloads(run_dir)
    folder = run_dir / f"{_PREFIX}{_host()}-{os.getpid()}"
    weights = DiskWeights(module, folder / f"{name}.safetensors")
    weights.write(what)
    weakref.finalize(module, _remove_file, weights.path)
    module.disk_weights = weights  # lives as long as the module
    _OFFLOADED.add(weights)
    weights.drop()
    mx.clear_cache()  # the arrays it held, freed into MLX's buffer cache, leave the process
    logger.info(
        "%s kept on disk outside its passes: %.2f GiB in %s", what, weights.nbytes / 2**30, folder
    )
    return weights


def drop_read_weights() -> None:
    """The end of a phase of work (the scoring passes, an optimiser step): every offloaded
    module lets go of the weights it read (:meth:`DiskWeights.drop`). Nothing to do, and no
    cost, in a process that offloaded nothing. Call it before the phase's
    ``base_setup.backend.release_cached_buffers``: the freed weights go to MLX's buffer cache,
    which that empties."""
    for weights in list(_OFFLOADED):
        weights.drop()


def offloaded_bytes() -> int:
    """The size of the weights offloaded in this process, in bytes."""
    return sum(w.nbytes for w in _OFFLOADED)


def remove_stale_offloads(run_dir: Path) -> None:
    """Remove the ``.offloaded-<host>-<pid>`` folders of this host's processes that no longer
    run (killed before they could remove them); other hosts' folders are left alone."""
    if not run_dir.is_dir():
        return
    for folder in run_dir.glob(f"{_PREFIX}{_host()}-*"):
        pid = folder.name.rpartition("-")[2]
        if pid.isdigit() and not process_running(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)  # a leftover costs only space


def _host() -> str:
    """This host's name as a folder name may hold it."""
    return "".join(c if c.isalnum() else "_" for c in socket.gethostname()) or "host"


def _remove_file(path: Path) -> None:
    """Remove an offloaded module's file, and its folder once empty (the module is gone; an
    array still unread keeps the file open, so it can still be read)."""
    path.unlink(missing_ok=True)
    folder = path.parent
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
