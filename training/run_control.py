"""What every trainer's loop shares around its steps: stopping on signals, and the run folder.

* :class:`StopSignals`: the first Ctrl-C (SIGINT) or SIGTERM (what schedulers and ``docker stop``
  send) asks the loop to stop after the current step and save; a second one interrupts at once
  (``KeyboardInterrupt``). The command line reports either and exits non-zero.
* :func:`output_beside_progress`: while a progress bar runs, log lines and a callback's prints
  are written above it (``tqdm.write``) instead of through it; :class:`RunLog` holds the bar,
  ``config.yaml``, ``metrics.jsonl`` and the curves of a run.
* :func:`prepare_run_dir`: a fresh run refuses a folder that holds another run (its new
  checkpoints would be pruned against the old ones and ``--resume latest`` would continue the
  old run), unless told to overwrite it; the folder must be writable before any model loads.
  Resuming keeps one timeline too: :func:`check_resume_source` refuses another folder's
  checkpoint into a folder that holds a run, and :func:`continue_timeline` removes the
  checkpoints after the one resumed from.
* :func:`run_lock`: one writer per run folder. A run holds an ``fcntl`` lock on
  ``<output_dir>/.run.lock`` from before it checks (or clears) the folder until its model is
  saved; a second process gets a ``ValueError`` naming the first's pid. The kernel releases the
  lock when the process dies, so a killed run never leaves the folder locked.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import io
import logging
import os
import shutil
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Iterator, Sequence, TypeVar

from base_setup.backend import run_scope

logger = logging.getLogger("ppo_mlx")

#: The run's config, written to its folder when training starts (what ``export`` reads).
CONFIG_FILE = "config.yaml"
#: What a trainer writes into its run folder (``overwrite`` removes these and nothing else).
RUN_ARTIFACTS: tuple[str, ...] = (
    "checkpoints",
    "metrics.jsonl",
    "training_curves.png",
    "final",
    "model",
    "eval_final.json",
    "rollouts",
    "config.yaml",
    "tensorboard",
    "reference_logps",
)


#: The lock file of a run folder (:func:`run_lock`).
LOCK_FILE = ".run.lock"
# The run folders this process holds locked: resolved path -> (file descriptor, depth).
_HELD_LOCKS: dict[Path, tuple[int, int]] = {}


def _lock_holder(lock: Path) -> str:
    """Who holds ``lock``, as its file says (the pid the holder wrote)."""
    try:
        pid = lock.read_text().strip()
    except OSError:
        pid = ""
    return f"process {pid}" if pid.isdigit() else "another process"


def _open_lock(run_dir: Path, lock: Path) -> int:
    """The lock file's descriptor (created if needed), or ``ValueError`` saying what is in the
    way: a directory at its path, a folder that cannot be written."""
    try:
        return os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except IsADirectoryError:
        raise ValueError(
            f"{lock} is a directory, not the run's lock file: remove it (rmdir {lock}) or "
            "choose another output_dir"
        ) from None
    except OSError as err:
        if err.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        raise ValueError(
            f"output_dir {run_dir} is not writable ({err.strerror or err}): choose a folder "
            "you can write to"
        ) from None


def _acquire(run_dir: Path) -> int:
    """Lock ``run_dir`` for this process (non-blocking); returns the lock file's descriptor."""
    lock = run_dir / LOCK_FILE
    while True:
        fd = _open_lock(run_dir, lock)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise ValueError(
                f"output_dir {run_dir} is in use: {_lock_holder(lock)} is writing a run there "
                f"({lock}). Wait for it to end (or stop it), or choose another output_dir"
            ) from None
        # The holder before us may have removed the file between our open and our lock: then
        # the lock is on a file nobody else sees; take the one at the path instead.
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(lock))
        except FileNotFoundError:
            same = False
        if same:
            from training.checkpoint import named_write

            try:
                with named_write(lock):  # a full disk: named, with the way out
                    os.ftruncate(fd, 0)
                    os.write(fd, f"{os.getpid()}\n".encode())
            except OSError:
                os.close(fd)
                raise
            return fd
        os.close(fd)


@contextlib.contextmanager
def run_lock(run_dir: str | Path) -> Iterator[None]:
    """Within the block this process is the only writer of the run folder ``run_dir``
    (created if needed). Re-entrant within a process (the command line holds it around a
    trainer that takes it again); the lock file is removed when the outermost block ends (and
    the folder, if the block created it and nothing was written), and the kernel drops the lock
    of a process that dies.

    Raises:
        ValueError: another process holds the folder (its pid is named), or the folder cannot
            be created.
    """
    run_dir = Path(run_dir)
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(
            f"output_dir {run_dir} cannot be created ({type(err).__name__}: "
            f"{err.strerror or err}): choose a folder you can write to"
        ) from None
    key = run_dir.resolve()
    if key in _HELD_LOCKS:
        fd, depth = _HELD_LOCKS[key]
        _HELD_LOCKS[key] = (fd, depth + 1)
    else:
        try:
            fd = _acquire(run_dir)
        except PermissionError as err:
            raise ValueError(
                f"output_dir {run_dir} is not writable ({err.strerror or err}): choose a folder "
                "you can write to"
            ) from None
        _HELD_LOCKS[key] = (fd, 1)
    try:
        yield
    finally:
        fd, depth = _HELD_LOCKS[key]
        if depth > 1:
            _HELD_LOCKS[key] = (fd, depth - 1)
        else:
            del _HELD_LOCKS[key]
            # Removed while still locked: a process that opened it meanwhile sees the file gone
            # and takes a new one (_acquire), never a second lock on this one.
            (run_dir / LOCK_FILE).unlink(missing_ok=True)
            os.close(fd)
            if created and not any(run_dir.iterdir()):  # a command that failed leaves nothing
                run_dir.rmdir()


class Interrupted(KeyboardInterrupt):
    """Stop at once: a second Ctrl-C or SIGTERM during a run, or SIGTERM before or after its
    loop (where the command line turns it into this, as Python turns Ctrl-C into
    ``KeyboardInterrupt``). ``reason``: the signal's name."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def raise_interrupted(signum: int, frame: FrameType | None) -> None:
    """A signal handler that raises :class:`Interrupted` (what ``main.py`` installs for SIGTERM:
    outside the training loop it ends the command like Ctrl-C, with a message)."""
    running: FrameType | None = frame
    while running is not None:
        if running.f_code.co_name == "__del__":
            # Raised within a finaliser (a library object collected while loading), the
            # exception would be printed and ignored, and the command would go on: deliver the
            # signal again once the finaliser has returned.
            threading.Timer(0.05, os.kill, (os.getpid(), signum)).start()
            return
        running = running.f_back
    raise Interrupted(signal.Signals(signum).name)


#: What a run stops on (after the step, saving): Ctrl-C, a scheduler's SIGTERM, and SIGHUP (the
#: terminal or SSH session that started it closed).
STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopSignals:
    """Within the block, SIGINT, SIGTERM and SIGHUP request a stop instead of killing the
    process.

    ``requested`` turns true at the first signal (or :meth:`request`); the loop checks it between
    steps, saves and returns. A second signal raises :class:`Interrupted` (a
    ``KeyboardInterrupt``) where the process is.
    Outside the main thread (where handlers cannot be installed) signals keep their default.
    """

    def __init__(self) -> None:
        self.requested = False
        self.reason: str | None = None
        self._previous: dict[int, Any] = {}

    def request(self, reason: str) -> None:
        """Ask the loop to stop after the current step (a callback's early stop, a signal)."""
        if not self.requested:
            self.requested = True
            self.reason = reason

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            raise Interrupted(name)
        self.request(name)
        logger.warning(
            "%s: finishing this step, then saving a checkpoint (send it again to stop at once)",
            name,
        )

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()


class TrainingStopped(Exception):
    """A run stopped before its end by a signal or a callback; its state is in a checkpoint.

    Attributes:
        reason: "SIGINT", "SIGTERM" or the callback's reason.
        step: the last completed (and saved) step.
    """

    def __init__(self, reason: str, step: int) -> None:
        super().__init__(
            f"stopped ({reason}) after step {step}; the checkpoint is saved: continue with "
            "--resume latest"
        )
        self.reason = reason
        self.step = step


def stop_exit_code(reason: str | None) -> int:
    """The exit code of a run stopped for ``reason``: the shell's code for a signal (130 for
    SIGINT, 143 for SIGTERM, 129 for SIGHUP), 1 for another stop, 0 for none."""
    if reason is None:
        return 0
    return {"SIGINT": 130, "SIGTERM": 143, "SIGHUP": 129}.get(reason, 1)


def holds_a_run(run_dir: Path) -> list[str]:
    """What in ``run_dir`` belongs to an earlier run (empty if nothing)."""
    if not run_dir.is_dir():
        return []
    found = []
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir() and any(p.name.startswith("step_") for p in checkpoints.iterdir()):
        found.append("checkpoints/")
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append("metrics.jsonl")
    found += [f"{name}/" for name in ("final", "model") if (run_dir / name).is_dir()]
    return found


def check_run_dir(
    run_dir: str | Path, *, resuming: bool, overwrite: bool, log_with: str = "none"
) -> None:
    """Raise ``ValueError`` if a fresh run (not ``resuming``, no ``overwrite``) would reuse a
    folder that holds another run, or if the tracker ``log_with`` is not installed; changes
    nothing (see :func:`prepare_run_dir`)."""
    from training.metrics_logger import check_tracker

    check_tracker(log_with)  # before anything is removed: the run would fail at its start
    run_dir = Path(run_dir)
    earlier = holds_a_run(run_dir)
    if earlier and not resuming and not overwrite:
        raise ValueError(
            f"output_dir {run_dir} already holds a run ({', '.join(earlier)}): continue it "
            "with --resume latest, choose another output_dir, or pass --overwrite "
            "(overwrite_output_dir: true) to replace it"
        )


def prepare_run_dir(
    run_dir: str | Path, *, resuming: bool, overwrite: bool, log_with: str = "none"
) -> None:
    """Check ``run_dir`` before a run starts (before models load when called early).

    A fresh run (not ``resuming``) into a folder that holds another run raises ``ValueError``
    naming what is there, unless ``overwrite``, which removes the earlier run's files
    (:data:`RUN_ARTIFACTS`, nothing else). The folder must be writable, and the tracker
    ``log_with`` installed (checked first).

    Raises:
        ValueError: the folder holds another run (and no overwrite), is not writable, or the
            tracker is missing.
    """
    run_dir = Path(run_dir)
    check_run_dir(run_dir, resuming=resuming, overwrite=overwrite, log_with=log_with)
    earlier = holds_a_run(run_dir)
    if earlier and not resuming:
        logger.warning("overwriting the earlier run in %s (%s)", run_dir, ", ".join(earlier))
        for name in RUN_ARTIFACTS:
            path = run_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise ValueError(
            f"output_dir {run_dir} is not writable ({type(err).__name__}: {err.strerror or err}): "
            "choose a folder you can write to"
        ) from None


def remove_run_leftovers(run_dir: str | Path) -> None:
    """Delete what killed writes left in ``run_dir``: hidden ``.tmp-*`` / ``.trash-*``
    directories of checkpoints and of the final model, and temporary metrics and rollout files.
    A run calls it as it starts (the next save would remove a checkpoint's, but a run resumed at
    its end saves nothing); never while another process writes into the folder."""
    from training.checkpoint import remove_leftovers
    from training.metrics_logger import METRICS_FILE

    run_dir = Path(run_dir)
    try:
        remove_leftovers(run_dir / "checkpoints")
        remove_leftovers(run_dir)
        (run_dir / f".{METRICS_FILE}.tmp").unlink(missing_ok=True)
        rollouts = run_dir / "rollouts"
        if rollouts.is_dir():
            for tmp in rollouts.glob(".*.tmp-*"):
                tmp.unlink(missing_ok=True)
    except OSError as err:  # they are never read: a leftover that stays costs only space
        logger.warning("could not remove a leftover of a killed write in %s: %s", run_dir, err)


def check_resume_source(run_dir: str | Path, checkpoint: str | Path) -> None:
    """Raise ``ValueError`` if ``checkpoint`` belongs to another run folder while ``run_dir``
    holds a run: the new timeline would continue beside that run's checkpoints and metrics
    (``--resume latest`` could then pick either). Into an empty folder it starts a branch."""
    run_dir, checkpoint = Path(run_dir), Path(checkpoint)
    own = (run_dir / "checkpoints").resolve()
    earlier = holds_a_run(run_dir)
    if checkpoint.resolve().parent != own and earlier:
        raise ValueError(
            f"resuming from {checkpoint}, a checkpoint of another run folder, but output_dir "
            f"{run_dir} holds a run ({', '.join(earlier)}): the two runs' checkpoints and metrics "
            "would mix. Resume into an empty output_dir, or from one of "
            f"{run_dir / 'checkpoints'}"
        )


def resumed_run_config(run_dir: str | Path, resume_from: str | Path) -> dict[str, Any] | None:
    """The config of the run that ``resume_from`` continues, as its checkpoint recorded it: that
    of the checkpoint directory ``resume_from``, or for ``"latest"`` of the newest complete one
    under ``<run_dir>/checkpoints``. None when there is none (the resume itself then fails,
    naming what is missing). ``overwrite_output_dir`` is left out: it acted when the run began."""
    from training.checkpoint import STATE_FILE, CheckpointManager

    if str(resume_from) == "latest":
        found = CheckpointManager(Path(run_dir) / "checkpoints").latest()
    else:
        found = Path(resume_from) if (Path(resume_from) / STATE_FILE).is_file() else None
    if found is None:
        return None
    config = CheckpointManager.read_state(found).get("config")
    if not isinstance(config, dict):
        return None
    return {k: v for k, v in config.items() if k != "overwrite_output_dir"}


def check_resume_target(resume_from: str | Path, run_dir: str | Path) -> None:
    """Raise ``FileNotFoundError`` saying so if there is no checkpoint to resume: for
    ``"latest"``, no complete one under ``<run_dir>/checkpoints``; else ``resume_from`` is not
    a checkpoint directory (what a resume checks before it needs the run's settings)."""
    from training.checkpoint import CheckpointManager

    if str(resume_from) != "latest" and not Path(resume_from).exists():
        raise FileNotFoundError(
            f"there is no checkpoint at {resume_from}: checkpoints are the step_NNNNNN "
            f"directories under {Path(run_dir) / 'checkpoints'} (or resume 'latest')"
        )
    CheckpointManager(Path(run_dir) / "checkpoints").resolve(resume_from)


def load_resumed_config(
    config_file: str | Path | None,
    overrides: Sequence[str],
    resume_from: str | Path,
    cls: type[Any],
    run_dir: str | Path | None = None,
) -> Any | None:
    """The ``cls`` config of a command that resumes ``resume_from``: the resumed run's recorded
    config (:func:`resumed_run_config`) as the base, with ``config_file`` and ``overrides`` on
    top, so that a setting not given again keeps the run's value rather than its default. The
    run is looked for in ``run_dir``, by default the ``output_dir`` that ``config_file`` and
    ``overrides`` give (as for a fresh run); for ``"latest"`` the config keeps that folder,
    wherever the run began. None when no checkpoint there records a config."""
    from config.loading import given_value, load_config

    if run_dir is None:
        run_dir = given_value("output_dir", config_file, overrides, cls)
    base = resumed_run_config(run_dir, resume_from)
    if base is None:
        return None
    if str(resume_from) == "latest":
        base["output_dir"] = str(run_dir)
    return load_config(config_file, overrides, cls=cls, base=base)


def check_extension_trains(
    step: int,
    total: int,
    *,
    epochs: int,
    steps_per_epoch: int,
    total_steps: int | None,
    saved_config: dict[str, Any],
) -> None:
    """Refuse a resume at ``step`` that asks for a longer run (``total_steps`` or ``num_epochs``
    above the checkpoint's ``saved_config``) but would train nothing, because the other setting
    ends the run at ``total <= step``; name that setting and the value that extends it. A
    finished run resumed as it was (nothing asked) passes: it only saves what is unsaved.

    Raises:
        ValueError: the extension trains no step.
    """
    if step < total:
        return
    by_epochs = epochs * steps_per_epoch
    asked_steps = (
        total_steps is not None
        and total_steps > step
        and total_steps != saved_config.get("total_steps")
    )
    asked_epochs = epochs > int(saved_config.get("num_epochs") or epochs) and by_epochs > step
    if asked_steps and by_epochs <= step:
        assert total_steps is not None
        ender = f"num_epochs={epochs} ({epochs} x {steps_per_epoch} steps per epoch)"
        fix = f"raise num_epochs with it (--set num_epochs={-(-total_steps // steps_per_epoch)})"
    elif asked_epochs and total_steps is not None:
        ender = f"total_steps={total_steps}"
        fix = f"raise total_steps with it (--set total_steps={by_epochs}) or remove it"
    else:
        return
    raise ValueError(
        f"this resume asks for a longer run, but {ender} ends the run at step {total}, which "
        f"the checkpoint has reached (step {step}): it would train nothing; {fix}"
    )


def continue_timeline(checkpoints: Any, step: int) -> None:
    """Before a run resumed at ``step`` goes on: remove its checkpoints after ``step`` (a resume
    from an earlier checkpoint abandons them; left there, ``--resume latest`` would go back to
    them, and pruning would keep them over the new ones). ``checkpoints``: the run's
    :class:`~training.checkpoint.CheckpointManager`."""
    dropped = checkpoints.drop_after(step)
    if dropped:
        logger.warning(
            "resumed from step %d: removed the later checkpoints of the abandoned timeline (%s)",
            step,
            ", ".join(p.name for p in dropped),
        )


class _AboveTheBar(io.TextIOBase):
    """A text stream that hands whole lines to ``tqdm.write`` (which clears the bar, writes the
    line to ``target``, and draws the bar again)."""

    def __init__(self, target: Any) -> None:
        super().__init__()
        self.target = target
        self._pending = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        from tqdm import tqdm

        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            tqdm.write(line, file=self.target)
        return len(text)

    def flush(self) -> None:
        if self._pending:
            from tqdm import tqdm

            tqdm.write(self._pending, file=self.target)
            self._pending = ""
        self.target.flush()


@contextlib.contextmanager
def output_beside_progress(enabled: bool) -> Iterator[None]:
    """Within the block, the root logger's console lines and ``print`` output go above the
    progress bar (when ``enabled``: a bar is shown) rather than breaking its line."""
    if not enabled:
        yield
        return
    from tqdm.contrib.logging import logging_redirect_tqdm

    stream = _AboveTheBar(sys.stdout)
    with logging_redirect_tqdm(loggers=[logging.getLogger()]), contextlib.redirect_stdout(stream):
        try:
            yield
        finally:
            stream.flush()


class RunLog:
    """What a run writes as it goes, on the process that writes (rank 0): ``config.yaml`` when it
    starts, ``metrics.jsonl`` (cut back to ``resume_step`` on resume) and a tracker, a progress
    bar, and ``training_curves.png`` when it ends. A context manager: within it, prints and log
    lines go above the bar; on exit the bar and trackers close and the curves are drawn (not
    after a failed write such as a full disk; a failing plot is logged so that it never hides the
    error that ended the run). A write that fails names its file (:func:`named_write`).

    Args:
        run_dir: the run folder.
        config: the run's config dataclass (saved, and sent to the tracker).
        total: the run's steps (the bar's length); ``initial``: steps already done.
        desc: the bar's label.
        writes: whether this process writes (False on data-parallel ranks other than 0: a silent
            log with no bar).
        resume_step: on resume, the checkpoint's step (metrics after it are dropped).
    """

    def __init__(
        self,
        run_dir: str | Path,
        config: Any,
        *,
        total: int,
        initial: int,
        desc: str,
        writes: bool = True,
        resume_step: int | None = None,
    ) -> None:
        from tqdm import tqdm

        from config.loading import config_to_dict, save_config
        from training.checkpoint import named_write
        from training.metrics_logger import METRICS_FILE, MetricsLogger

        self.run_dir = Path(run_dir)
        self.metrics: MetricsLogger | None = None
        if writes:
            with named_write(self.run_dir / CONFIG_FILE):
                save_config(config, self.run_dir / CONFIG_FILE)
            with named_write(self.run_dir / METRICS_FILE):
                self.metrics = MetricsLogger(
                    self.run_dir,
                    config.log_with,
                    config_to_dict(config),
                    resume_step=resume_step,
                    project=config.wandb_project,
                )
        self.bar = tqdm(
            total=total,
            initial=initial,
            desc=desc,
            unit="step",  # tqdm then shows s/step and the time left: "[02:10<06:30, 43.3s/step]"
            disable=not (writes and config.progress_bar),
            dynamic_ncols=True,
        )
        self._output = output_beside_progress(not self.bar.disable)

    def log(self, step: int, record: dict[str, Any], postfix: dict[str, str]) -> None:
        """One step's record: to metrics.jsonl and the tracker; the bar moves on."""
        if self.metrics is not None:
            self.metrics.log(step, record)
        self.bar.update(1)
        self.bar.set_postfix(postfix)

    def write(self, step: int, record: dict[str, Any]) -> None:
        """A record that is not a step (an evaluation before the first step)."""
        if self.metrics is not None:
            self.metrics.log(step, record)

    def __enter__(self) -> RunLog:
        self._output.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        from training.checkpoint import CheckpointWriteError
        from training.metrics_logger import PLOT_FILE, plot_metrics, read_metrics

        try:
            self.bar.close()
            if self.metrics is not None:
                self.metrics.close()
                records = read_metrics(self.metrics.path)
                # Not after a failed write (a full disk): the plot would fail too, or take the
                # space the user is about to free, and its message would follow the one that
                # matters.
                if records and not isinstance(exc[1], CheckpointWriteError):
                    try:
                        plot_metrics(records, self.run_dir / PLOT_FILE)
                    except (OSError, ValueError) as err:  # a full disk; records it cannot draw
                        logger.warning("could not draw %s: %s", self.run_dir / PLOT_FILE, err)
        finally:
            self._output.__exit__(*exc)


def save_after_failure(err: BaseException, updating: bool, step: int, last_saved: int) -> bool:
    """Whether a run that failed with ``err`` should save its state before re-raising: a failure
    between steps (a bad reward, a second Ctrl-C) leaves the models at the end of the last
    completed step, so saving it loses nothing; not after a failed write (it would fail again),
    nor in the middle of an update (a half-updated state), nor when that step is already saved.
    Logs what happened when it says yes."""
    from training.checkpoint import CheckpointWriteError

    if isinstance(err, CheckpointWriteError) or updating or step <= max(last_saved, 0):
        return False
    what = "interrupted" if isinstance(err, KeyboardInterrupt) else "stopped by an error"
    logger.error("training %s; saving the state after step %d", what, step)
    return True


_Method = TypeVar("_Method", bound=Callable[..., Any])


def in_run_scope(method: _Method) -> _Method:
    """Decorator for a trainer's methods that compute (train, step, evaluate): the call holds
    :func:`base_setup.backend.run_scope` with the trainer's ``config.plain_mlx``, so plain MLX
    and the buffer-cache policy apply to that work only and are undone when it returns."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with run_scope(self.config.plain_mlx):
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
