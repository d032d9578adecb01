"""The one training loop of every stage: SFT, reward model, DPO and the RL family (PPO, GRPO,
RLOO, REINFORCE++) are :class:`Stage` objects that :class:`TrainingLoop` drives.

:meth:`TrainingLoop.run` reads top to bottom:

1. before any step: a trainer already trained is refused; the stage checks its data and records
   its fingerprint (:meth:`Stage.check_data`); rank 0 locks the run folder
   (:func:`~training.run_control.run_lock`) and checks it (a fresh run refuses a folder that holds
   another run); a resume compares the checkpoint's recorded inputs with this run's; the stage
   prepares (tokenises) its data and builds its optimisers over the run's length; a resume loads
   the checkpoint (every rank the same one) and drops the abandoned timeline's later checkpoints;
   every rank's weights are checked identical;
2. within the run's log (``config.yaml``, ``metrics.jsonl``, progress bar, curves) and its stop
   request (Ctrl-C, SIGTERM, SIGHUP, ``request_stop``): ``on_train_begin``; an evaluation before
   the first step where the stage asks for one; then each step: the stage's step, an evaluation
   when due, the history, ``metrics.jsonl``, ``on_step_end``, the end of an epoch
   (``on_epoch_end`` with the epoch's mean metrics), a checkpoint every ``save_every`` steps, and
   the stop check on every rank; a checkpoint of the last step; after a failure between steps, a
   checkpoint of the last completed one (:func:`~training.run_control.save_after_failure`);
3. after it: the weights checked identical again, the stage's final evaluation (RL:
   ``eval_final.json``), ``on_train_end``.

What a run changes and its checkpoints keep is the stage's :class:`LoopState` (RL stages extend
it with their KL controller, reward statistics, optimisers ...). A stage gives only what differs:
its data, its step, its evaluation, its checkpoint, and a few policies (attributes of
:class:`Stage`).
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Mapping, Protocol, TypeVar, cast

import numpy as np

from base_setup import distributed as dist
from base_setup.backend import run_blas_threads
from training.callbacks import TrainerCallback
from training.checkpoint import CheckpointManager, named_write, resolve_on_all_ranks
from training.fingerprints import check_same_inputs
from training.run_control import (
    RunLog,
    StopSignals,
    check_resume_source,
    continue_timeline,
    prepare_run_dir,
    remove_run_leftovers,
    run_lock,
    save_after_failure,
)

logger = logging.getLogger("ppo_mlx")

T = TypeVar("T")


@dataclass(kw_only=True)
class LoopState:
    """What the loop changes in a run, and its stage's step reads. A checkpoint keeps the
    counters, the history and the BLAS threads; the others belong to one call of ``train()``
    (:meth:`begin` resets them).

    Attributes:
        global_step: optimiser steps (RL: iterations) done.
        epoch: passes over the data done.
        step_in_epoch: steps done in the current pass.
        history: every step's metrics (a supervised stage's first record may be the evaluation
            before the first step).
        blas_threads: OpenBLAS threads of this run (``run_blas_threads``).
        stop_reason: after ``train()``, why it stopped early (None: it ran to the end).
        last_step: the run's last step; None: no run yet.
        callbacks: the run's callbacks.
        stop: the run's stop request (Ctrl-C, SIGTERM, SIGHUP, the trainer's ``request_stop``).
        running: a ``train()`` call is in progress.
        updating: the step is updating the weights (a failure then saves no checkpoint:
            :func:`~training.run_control.save_after_failure`).
    """

    global_step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    blas_threads: int | None = None
    stop_reason: str | None = None
    last_step: int | None = None
    callbacks: list[TrainerCallback] = field(default_factory=list)
    stop: StopSignals = field(default_factory=StopSignals)
    running: bool = False
    updating: bool = False

    def begin(self, last_step: int, callbacks: list[TrainerCallback]) -> None:
        """A call of ``train()`` starts: its last step and callbacks, a fresh stop request."""
        self.last_step, self.callbacks, self.stop = last_step, callbacks, StopSignals()
        self.updating = False

    def next_epoch(self) -> None:
        """The data's next pass starts."""
        self.epoch += 1
        self.step_in_epoch = 0


class InRunState(Generic[T]):
    """A trainer attribute that is a field of its run state (``trainer.run``, a
    :class:`LoopState`); ``field`` names the state's field when it is not the attribute's."""

    def __init__(self, field: str | None = None) -> None:
        self.field = field

    def __set_name__(self, owner: type, name: str) -> None:
        self.field = self.field or name

    def __get__(self, trainer: Any, owner: Any = None) -> T:
        if trainer is None:  # on the class: the descriptor itself
            return cast(T, self)
        return cast(T, getattr(trainer.run, cast(str, self.field)))

    def __set__(self, trainer: Any, value: T) -> None:
        setattr(trainer.run, cast(str, self.field), value)


class Stage(Protocol):
    """What :class:`TrainingLoop` needs of a stage: where the run writes, its state, and the
    steps that differ between stages.

    Attributes:
        trainer: what the callbacks receive.
        config: the run's settings (``output_dir``, ``save_every``, ``eval_every``,
            ``overwrite_output_dir``, ``log_with``, ``progress_bar`` ...).
        state: the run's :class:`LoopState`.
        group: the ``mx.distributed`` group of the launched processes.
        is_main_process: rank 0, the one that writes the run folder.
        run_dir: the run folder; ``checkpoints`` its checkpoint manager.
        inputs: fingerprints of what the run reads, recorded in checkpoints, compared on resume.
        label: the progress bar's label.
        has_eval: held-out data was given (known after :meth:`prepare`).
        evaluate_first: evaluate before the first step of a fresh run (with ``eval_every``).
        final_eval_file: after an unstopped run, evaluate again and write the result to this
            file of the run folder; None: the last step evaluates instead, in its record.
        epoch_ends_at_last_step: the run's last step ends an epoch (``on_epoch_end`` fires and
            the epoch counter moves on) even in the middle of a pass.
    """

    trainer: Any
    config: Any
    group: Any
    is_main_process: bool
    run_dir: Path
    checkpoints: CheckpointManager
    inputs: dict[str, str | None]
    label: str
    evaluate_first: bool
    final_eval_file: str | None
    epoch_ends_at_last_step: bool

    @property
    def state(self) -> LoopState: ...

    @property
    def has_eval(self) -> bool: ...

    def check_data(self) -> None:
        """Check the data (every rank the same) and record its fingerprint in ``inputs``;
        writes nothing."""

    def prepare(self) -> tuple[int, int]:
        """Prepare (tokenise) the data; returns ``(total steps, steps per epoch)``."""

    def build_optimizers(self, total: int) -> None:
        """The optimisers and their learning-rate schedule over ``total`` steps."""

    def restore(self, path: Path, total: int, steps_per_epoch: int) -> None:
        """Check that the checkpoint at ``path`` continues this run, and load it."""

    def open(self, resumed: bool) -> contextlib.AbstractContextManager[Any]:
        """What lives as long as the steps do (the RL async generation worker)."""

    def step(self, total: int, steps_per_epoch: int) -> dict[str, Any]:
        """One step on the next batch (advancing ``state.global_step``); returns its record."""

    def evaluate(self) -> dict[str, float]:
        """The held-out metrics (``eval/...``) at this step."""

    def postfix(self, record: Mapping[str, Any]) -> dict[str, str]:
        """The progress bar's summary of a step's record."""

    def save_checkpoint(self) -> Path:
        """Write the run's checkpoint at this step (rank 0); fires ``on_save``."""

    def trained_state(self) -> dict[str, Any]:
        """The weights and optimiser states, by name, that every rank must hold alike."""


class TrainingLoop:
    """One ``train()`` call of ``stage``; see the module docstring."""

    def __init__(self, stage: Stage, callbacks: list[TrainerCallback]) -> None:
        self.stage = stage
        self.callbacks = callbacks

    def run(self, resume_from: str | Path | None) -> list[dict[str, Any]]:
        """The whole run; returns the per-step history. Rank 0 holds the run folder's lock
        throughout."""
        with contextlib.ExitStack() as self._held:
            return self._run(resume_from)

    def _run(self, resume_from: str | Path | None) -> list[dict[str, Any]]:
        s, state = self.stage, self.stage.state
        if resume_from is None and state.global_step > 0:
            # A fresh run (and with overwrite_output_dir its folder emptied) on weights already
            # trained to its last step would train nothing.
            raise ValueError(
                f"this trainer has already trained {state.global_step} steps: to go on, call "
                "train(..., resume_from='latest') (with a larger total_steps); for a new run, "
                f"build a new {type(s.trainer).__name__}"
            )
        # 1. Everything is checked before the first step.
        s.check_data()
        self._check_run_dir(resuming=resume_from is not None)
        saved_threads = None
        if resume_from is not None:  # before prepare(): DPO's reference pass costs minutes
            saved_threads = self._check_resume_inputs(resume_from)
        # OpenBLAS's thread count, fixed for the run (and its resumptions: the checkpoint's)
        # before anything is computed: prepare() may compute (DPO's reference pass), and the
        # count changes a matmul's sums, so whatever an earlier run in this process left must
        # not reach this run's numbers.
        state.blas_threads = run_blas_threads(saved_threads)
        total, steps_per_epoch = s.prepare()
        state.begin(total, self.callbacks)
        s.build_optimizers(total)
        resume_step = None
        if resume_from is not None:
            resume_step = self._resume(resume_from, total, steps_per_epoch)
        self._check_same_weights("at the start of training")
        run_log = RunLog(
            s.run_dir,
            s.config,
            total=total,
            initial=state.global_step,
            desc=s.label,
            writes=s.is_main_process,
            resume_step=resume_step,
        )
        # 2. The steps.
        with state.stop, run_log, s.open(resume_step is not None):
            self._steps(total, steps_per_epoch, run_log, resumed=resume_step is not None)
        # 3. After them.
        state.stop_reason = state.stop.reason
        self._check_same_weights("at the end of training")
        if s.final_eval_file and s.has_eval and not state.stop.requested:
            final = self._evaluate()
            if s.is_main_process:
                path = s.run_dir / s.final_eval_file
                with named_write(path):
                    path.write_text(json.dumps(final, indent=1))
        for cb in self.callbacks:
            cb.on_train_end(s.trainer, state.history)
        return state.history

    def _steps(self, total: int, steps_per_epoch: int, run_log: RunLog, resumed: bool) -> None:
        """The steps until ``total`` or a stop, each recorded; the last one saved."""
        s, state = self.stage, self.stage.state
        stop = state.stop
        last_saved = state.global_step if resumed else -1
        state.running = True
        try:
            for cb in self.callbacks:
                cb.on_train_begin(s.trainer)
            if s.evaluate_first and s.has_eval and s.config.eval_every and state.global_step == 0:
                record: dict[str, Any] = {"step": 0, **self._evaluate()}
                state.history.append(record)
                run_log.write(0, record)
            while state.global_step < total and not stop.requested:
                record = s.step(total, steps_per_epoch)
                self._record(record, total, steps_per_epoch, run_log)
                if s.config.save_every and state.global_step % s.config.save_every == 0:
                    s.save_checkpoint()
                    last_saved = state.global_step
                # Stop on every rank or on none: a signal or a callback may reach only some.
                if dist.any_rank(stop.requested, s.group):
                    stop.request(stop.reason or "another rank stopped")
            if last_saved != state.global_step:
                s.save_checkpoint()
            if stop.requested:
                logger.warning(
                    "stopped (%s) at step %d; the checkpoint is saved",
                    stop.reason,
                    state.global_step,
                )
        except BaseException as err:
            if save_after_failure(err, state.updating, state.global_step, last_saved):
                s.save_checkpoint()
            raise
        finally:
            state.running = False

    def _record(
        self, record: dict[str, Any], total: int, steps_per_epoch: int, run_log: RunLog
    ) -> None:
        """After a step: evaluation when due, history, metrics.jsonl, callbacks, progress bar,
        the end of an epoch."""
        s, state = self.stage, self.stage.state
        state.step_in_epoch += 1
        every = s.config.eval_every
        due = bool(every) and state.global_step % every == 0
        if s.final_eval_file is None and state.global_step == total:
            due = True  # the last step's record holds the final evaluation
        if s.has_eval and due:
            record.update(self._evaluate())
        state.history.append(record)
        run_log.log(state.global_step, record, s.postfix(record))
        for cb in self.callbacks:
            cb.on_step_end(s.trainer, state.global_step, record)
        last = s.epoch_ends_at_last_step and state.global_step == total
        if state.step_in_epoch == steps_per_epoch or last:
            self._end_epoch()

    def _end_epoch(self) -> None:
        """``on_epoch_end`` with the epoch's mean metrics; the next epoch starts."""
        s, state = self.stage, self.stage.state
        records = [h for h in state.history if h.get("epoch") == state.epoch]
        keys = [k for k in records[0] if isinstance(records[0][k], (int, float))]
        summary = {k: float(np.mean([r[k] for r in records if k in r])) for k in keys}
        summary["steps"] = float(len(records))
        for cb in self.callbacks:
            cb.on_epoch_end(s.trainer, state.epoch, summary)
        state.next_epoch()

    def _evaluate(self) -> dict[str, float]:
        """The stage's evaluation at this step, given to the ``on_evaluate`` hooks."""
        s = self.stage
        metrics = s.evaluate()
        for cb in self.callbacks:
            cb.on_evaluate(s.trainer, s.state.global_step, metrics)
        return metrics

    def _check_same_weights(self, moment: str) -> None:
        """Raise on every rank unless every rank holds the same trained state (data
        parallelism: the ranks' updates must agree)."""
        s = self.stage
        dist.check_same_weights(s.trained_state(), f"the trained state {moment}", s.group)

    def _check_run_dir(self, resuming: bool) -> None:
        """Rank 0 locks the run folder (held until the run ends) and checks it: a fresh run must
        not reuse a folder that holds another run. Collective: every rank raises its error."""
        s = self.stage
        error: ValueError | None = None
        if s.is_main_process:
            try:
                self._held.enter_context(run_lock(s.run_dir))  # before anything is removed
                prepare_run_dir(
                    s.run_dir,
                    resuming=resuming,
                    overwrite=s.config.overwrite_output_dir,
                    log_with=s.config.log_with,
                )
                remove_run_leftovers(s.run_dir)
            except ValueError as err:
                error = err
        dist.raise_if_any_rank_failed(error, f"checking output_dir {s.run_dir}", s.group)

    def _check_resume_inputs(self, resume_from: str | Path) -> int | None:
        """Refuse (on every rank) a checkpoint whose recorded inputs (models, data) differ from
        this run's, before any work that depends on them (:func:`check_same_inputs`); returns
        the BLAS thread count it records (None in a checkpoint without one)."""
        s = self.stage
        path = resolve_on_all_ranks(s.checkpoints, resume_from, s.group)
        error = None
        threads = None
        try:
            saved = CheckpointManager.read_state(path)
            check_same_inputs(path, saved.get("inputs"), s.inputs)
            threads = saved.get("blas_threads")
        except ValueError as err:
            error = err
        dist.raise_if_any_rank_failed(error, f"resuming from {path}", s.group)
        return None if threads is None else int(threads)

    def _resume(self, resume_from: str | Path, total: int, steps_per_epoch: int) -> int:
        """Load the checkpoint to resume from (every rank the same one); returns its step."""
        s = self.stage
        path = resolve_on_all_ranks(s.checkpoints, resume_from, s.group)
        error = None
        try:  # before rank 0 writes anything to the folder: every rank checks it as it was
            check_resume_source(s.run_dir, path)
            s.restore(path, total, steps_per_epoch)
        except ValueError as err:
            error = err
        dist.raise_if_any_rank_failed(error, f"resuming from {path}", s.group)
        if s.is_main_process:
            continue_timeline(s.checkpoints, s.state.global_step)
        logger.info("resumed from %s at step %d", path, s.state.global_step)
        return s.state.global_step
