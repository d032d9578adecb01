"""One call of :meth:`PPOTrainer.train`: the loop over iterations and what surrounds it.

:class:`TrainingRun` checks everything before the first step (the prompts, the run folder, the
checkpoint to resume), then repeats :meth:`PPOTrainer.step` on the epoch's next batch; after each
step: an evaluation when due, the history, ``metrics.jsonl``, callbacks, the progress bar, a
checkpoint when due, and the stop check (Ctrl-C, SIGTERM, a callback, on any rank). What the run
changes (the counters, the history, the optimisers ...; its checkpoints hold them) and what the
loop shares with the step (callbacks, the stop request, the worker) is the trainer's ``run``, a
:class:`~ppo_trainer.run_state.RunState`, whose per-call part the loop begins.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from base_setup import distributed as dist
from base_setup.backend import run_blas_threads
from config.ppo_config import PPOConfig
from ppo_trainer.agent_rollout import AgentRun
from ppo_trainer.callbacks import CallbackLike, as_callbacks
from ppo_trainer.prompt_records import Columns, PromptInput
from ppo_trainer.rollout import SamplingSettings
from ppo_trainer.rollout_worker import RolloutWorker, WorkerSpec, worker_blas_threads
from ppo_trainer.run_state import RunState, Trained, check_same_weights, ensure_optimizers
from training.checkpoint import CheckpointManager, named_write, resolve_on_all_ranks
from training.fingerprints import check_same_inputs, data_fingerprint
from training.run_control import (
    RunLog,
    check_extension_trains,
    check_resume_source,
    continue_timeline,
    prepare_run_dir,
    remove_run_leftovers,
    run_lock,
    save_after_failure,
)

logger = logging.getLogger("ppo_mlx")


class LoopTrainer(Protocol):
    """What :class:`TrainingRun` needs of the trainer it drives
    (:class:`~ppo_trainer.ppo_trainer.PPOTrainer`): its settings and run state, where it writes,
    and the methods a run calls. The loop changes the run state (``run``) and the recorded
    ``inputs``, nothing else of the trainer."""

    config: PPOConfig
    run: RunState
    group: Any
    is_main_process: bool
    run_dir: Path
    checkpoints: CheckpointManager
    agent: AgentRun | None
    inputs: dict[str, str | None]
    sampling: SamplingSettings

    @property
    def trained(self) -> Trained: ...

    def step(
        self,
        prompts: Sequence[PromptInput],
        next_prompts: Sequence[PromptInput] | None = None,
        more_prompts: Callable[[int], Sequence[PromptInput]] | None = None,
    ) -> dict[str, float]: ...

    def evaluate(self, prompts: Sequence[PromptInput]) -> dict[str, Any]: ...

    def save_checkpoint(self) -> Path: ...

    def load_checkpoint(self, path: str | Path) -> None: ...

    def _prepare_prompts(
        self, prompts: Sequence[PromptInput], start: int, stop: int
    ) -> tuple[list[str], list[list[int]], Columns]: ...

    def _check_reward_call(self, prompts: Sequence[PromptInput]) -> None: ...


class TrainingRun:
    """A run of ``trainer`` over ``prompts`` (see :meth:`PPOTrainer.train` for the arguments)."""

    def __init__(
        self,
        trainer: LoopTrainer,
        prompts: Sequence[PromptInput],
        num_epochs: int | None,
        callbacks: Sequence[CallbackLike] | None,
        eval_prompts: Sequence[PromptInput] | None,
    ) -> None:
        self.trainer = trainer
        self.prompts = prompts
        self.num_epochs = num_epochs
        self.callbacks = as_callbacks(callbacks)
        self.eval_prompts = eval_prompts

    def run(self, resume_from: str | Path | None) -> list[dict[str, float]]:
        """The whole run; returns the trainer's per-step history. Rank 0 holds the run folder's
        lock throughout (:func:`~training.run_control.run_lock`)."""
        with contextlib.ExitStack() as self._held:
            return self._run(resume_from)

    def _run(self, resume_from: str | Path | None) -> list[dict[str, float]]:
        t = self.trainer
        cfg = t.config
        if resume_from is None and t.run.global_step > 0:
            # A fresh run (and with overwrite_output_dir its folder emptied) on weights already
            # trained to its last step would train nothing.
            raise ValueError(
                f"this trainer has already trained {t.run.global_step} steps: to go on, call "
                "train(..., resume_from='latest') (with a larger total_steps); for a new run, "
                "build a new PPOTrainer"
            )
        # Check the prompts, the run folder and the checkpoint before any step.
        total, steps_per_epoch = self._plan()
        t.run.begin(total, self.callbacks)
        state = t.run
        self._check_run_dir(resuming=resume_from is not None)
        ensure_optimizers(t.run, cfg, t.trained.value_model is not None, total_steps=total)
        resume_step = None
        if resume_from is not None:
            resume_step = self._resume(resume_from, total, steps_per_epoch)
        if resume_step is None:  # a resumed run takes its checkpoint's count (load_checkpoint)
            t.run.blas_threads = run_blas_threads()
        check_same_weights(t.run, t.trained, "at the start of training", t.group)
        for cb in self.callbacks:
            cb.on_train_begin(t)
        last_saved = t.run.global_step if resume_step is not None else -1
        run_log = RunLog(
            t.run_dir,
            cfg,
            total=total,
            initial=t.run.global_step,
            desc=cfg.algorithm.upper(),
            writes=t.is_main_process,
            resume_step=resume_step,
        )
        stop = state.stop
        worker = (
            self._start_worker(resume_step is not None)
            if cfg.async_rollout
            else contextlib.nullcontext()
        )
        with stop, run_log, worker:
            state.rollout_worker = worker if isinstance(worker, RolloutWorker) else None
            try:
                while t.run.global_step < total and not stop.requested:
                    drawn = [0]  # extra generation rounds of dynamic sampling, counted
                    metrics = t.step(
                        self._next_batch(),
                        self._batch_after_next(total, steps_per_epoch),
                        self._more_prompts(drawn),
                    )
                    t.run.extra_gen_batches += drawn[0]  # once the step is done: resumes are exact
                    self._record(metrics, steps_per_epoch, total, run_log)
                    if cfg.save_every and t.run.global_step % cfg.save_every == 0:
                        t.save_checkpoint()
                        last_saved = t.run.global_step
                    # Stop on every rank or on none: a signal or a callback may reach only some.
                    if dist.any_rank(stop.requested, t.group):
                        stop.request(stop.reason or "another rank stopped")
                if stop.requested:
                    logger.warning("stopped (%s) at step %d", stop.reason, t.run.global_step)
                if last_saved != t.run.global_step:
                    t.save_checkpoint()
            except BaseException as err:
                if save_after_failure(err, state.updating, t.run.global_step, last_saved):
                    t.save_checkpoint()
                raise
            finally:
                state.rollout_worker = None  # the with block ends the worker process
        t.run.stop_reason = stop.reason
        check_same_weights(t.run, t.trained, "at the end of training", t.group)
        if self.eval_prompts and not stop.requested:
            final = self._evaluate()
            if t.is_main_process:
                with named_write(t.run_dir / "eval_final.json"):
                    (t.run_dir / "eval_final.json").write_text(json.dumps(final, indent=1))
        for cb in self.callbacks:
            cb.on_train_end(t, t.run.history)
        return t.run.history

    def _plan(self) -> tuple[int, int]:
        """``(total steps, steps per epoch)``, after checking every prompt (and that every rank
        has the same ones)."""
        t = self.trainer
        cfg = t.config
        if not self.prompts:
            raise ValueError("train() got an empty prompt list: give at least one prompt")
        epochs = cfg.num_epochs if self.num_epochs is None else self.num_epochs
        if epochs < 1:
            raise ValueError(f"num_epochs must be >= 1, got {epochs}")
        texts, _, _ = t._prepare_prompts(self.prompts, 0, len(self.prompts))
        if self.eval_prompts:
            t._prepare_prompts(self.eval_prompts, 0, len(self.eval_prompts))
        t._check_reward_call(self.prompts)  # after every column check: a trial call
        dist.check_same_on_all_ranks(
            json.dumps(texts).encode(),
            "the training prompts",
            "give every rank the same prompt file: each rank takes its slice of the same order",
            t.group,
        )
        t.inputs["prompts"] = data_fingerprint(self.prompts)  # checked on resume, recorded
        steps_per_epoch = math.ceil(len(self.prompts) / cfg.batch_size)
        total = epochs * steps_per_epoch
        if cfg.total_steps and cfg.total_steps < total:
            if t.is_main_process:  # a cap that binds is said, not silent
                logger.info(
                    "total_steps=%d caps the run at %d steps (num_epochs=%d x %d steps per "
                    "epoch would be %d)",
                    cfg.total_steps,
                    cfg.total_steps,
                    epochs,
                    steps_per_epoch,
                    total,
                )
            return cfg.total_steps, steps_per_epoch
        return total, steps_per_epoch

    def _check_run_dir(self, resuming: bool) -> None:
        """A fresh run must not reuse a folder that holds another run (collective)."""
        t = self.trainer
        error: ValueError | None = None
        if t.is_main_process:
            try:
                self._held.enter_context(run_lock(t.run_dir))  # before anything is removed
                prepare_run_dir(
                    t.run_dir,
                    resuming=resuming,
                    overwrite=t.config.overwrite_output_dir,
                    log_with=t.config.log_with,
                )
                remove_run_leftovers(t.run_dir)
            except ValueError as err:
                error = err
        dist.raise_if_any_rank_failed(error, f"checking output_dir {t.run_dir}", t.group)

    def _resume(self, resume_from: str | Path, total: int, steps_per_epoch: int) -> int:
        """Load the checkpoint to resume from (every rank the same one); returns its step.
        An extension that would train nothing of the run's ``total`` steps is refused first."""
        t = self.trainer
        path = resolve_on_all_ranks(t.checkpoints, resume_from, t.group)
        check_resume_source(t.run_dir, path)
        state = CheckpointManager.read_state(path)
        check_same_inputs(path, state.get("inputs"), t.inputs)
        check_extension_trains(
            int(state["global_step"]),
            total,
            epochs=t.config.num_epochs if self.num_epochs is None else self.num_epochs,
            steps_per_epoch=steps_per_epoch,
            total_steps=t.config.total_steps,
            saved_config=state.get("config") or {},
        )
        agent = t.agent
        if (
            t.is_main_process
            and agent is not None
            and agent.environment_factory is not None
            and not agent.seeded()
        ):
            logger.warning(
                "resuming with environment factory %s, which takes no seed: its environments "
                "are rebuilt by calling it, and the resumed run equals an uninterrupted one only "
                "if they draw no random numbers of their own (give it a seed parameter: "
                "docs/agents.md)",
                agent.description()["environment"],
            )
        t.load_checkpoint(path)
        if t.is_main_process:
            continue_timeline(t.checkpoints, t.run.global_step)
        logger.info("resumed from %s at step %d", path, t.run.global_step)
        return t.run.global_step

    def _next_batch(self) -> list[PromptInput]:
        """The prompts of the next step (see :meth:`_batch_at`)."""
        return self._batch_at(self.trainer.run.epoch, self.trainer.run.step_in_epoch)

    def _more_prompts(self, drawn: list[int]) -> Any:
        """With dynamic_sampling, the batch of the next step's ``k``-th extra generation round
        (the batches after its own, in the epoch's order), counting in ``drawn[0]`` how many
        it drew; None without dynamic_sampling."""
        t = self.trainer
        if not t.config.dynamic_sampling:
            return None
        epoch, position = t.run.epoch, t.run.step_in_epoch

        def more(k: int) -> list[PromptInput]:
            drawn[0] = max(drawn[0], k)
            return self._batch_at(epoch, position + k)

        return more

    def _batch_after_next(self, total: int, steps_per_epoch: int) -> list[PromptInput] | None:
        """With async_rollout, the prompts of the step after the next one (what the worker
        generates while the next one updates); None without it or when the next step is the
        run's last."""
        t = self.trainer
        if not t.config.async_rollout or t.run.global_step + 1 >= total:
            return None
        epoch, position = t.run.epoch, t.run.step_in_epoch + 1
        if position == steps_per_epoch:
            epoch, position = epoch + 1, 0
        return self._batch_at(epoch, position)

    def _batch_at(self, epoch: int, step_in_epoch: int) -> list[PromptInput]:
        """The prompts of step ``step_in_epoch`` of ``epoch``: the epoch's permutation (a
        function of seed and epoch), wrapping around at the end of the prompt list, after the
        batches dynamic sampling drew this epoch (``run.extra_gen_batches``)."""
        t = self.trainer
        n = len(self.prompts)
        order = np.random.default_rng([t.config.seed, epoch]).permutation(n)
        start = (step_in_epoch + t.run.extra_gen_batches) * t.config.batch_size
        return [self.prompts[int(order[(start + k) % n])] for k in range(t.config.batch_size)]

    def _start_worker(self, resumed: bool) -> RolloutWorker:
        """Start the async_rollout generation worker. A fresh run gives the trainer and the
        worker half its OpenBLAS threads each (they compute at the same time). The trainer's
        share is what checkpoints record: a resumed run keeps it, and gives the worker as many,
        at most half the cores."""
        t = self.trainer
        cfg = t.config
        if resumed:
            logger.warning(
                "async_rollout: this resumed run is not bit for bit the uninterrupted one: its "
                "first step generates with the weights after update %d, where the worker would "
                "have used those of before it (one step off-policy); set async_rollout: false "
                "for exact resumes",
                t.run.global_step,
            )
        if resumed:  # the checkpoint's count (perhaps of a synchronous run) stays the trainer's
            mine = t.run.blas_threads
            half = max(1, (os.cpu_count() or 1) // 2)
            theirs = None if mine is None else min(mine, half)
        else:
            mine, theirs = worker_blas_threads(t.run.blas_threads)
        if mine is not None and mine != t.run.blas_threads:
            t.run.blas_threads = run_blas_threads(mine)
        spec = WorkerSpec(cfg.model_config(), t.sampling, theirs, cfg.plain_mlx)
        return RolloutWorker(spec, t.run_dir)

    def _record(
        self, metrics: dict[str, float], steps_per_epoch: int, total: int, run_log: RunLog
    ) -> None:
        """After a step: evaluation when due, history, metrics.jsonl, callbacks, progress bar,
        the end of an epoch."""
        t = self.trainer
        metrics["epoch"] = t.run.epoch
        t.run.step_in_epoch += 1
        every = t.config.eval_every
        if self.eval_prompts and every and t.run.global_step % every == 0:
            metrics.update(self._evaluate())
        t.run.history.append(metrics)
        postfix = {
            "reward": f"{metrics['objective/scores']:.3f}",
            "kl": f"{metrics['objective/kl']:.3f}",
        }
        run_log.log(t.run.global_step, metrics, postfix)
        for cb in self.callbacks:
            cb.on_step_end(t, t.run.global_step, metrics)
        if t.run.step_in_epoch == steps_per_epoch or t.run.global_step == total:
            self._end_epoch()

    def _end_epoch(self) -> None:
        t = self.trainer
        records = [h for h in t.run.history if h.get("epoch") == t.run.epoch]
        keys = [k for k in records[0] if isinstance(records[0][k], (int, float))]
        summary = {k: float(np.mean([r[k] for r in records if k in r])) for k in keys}
        summary["steps"] = float(len(records))
        for cb in self.callbacks:
            cb.on_epoch_end(t, t.run.epoch, summary)
        t.run.epoch += 1
        t.run.step_in_epoch = 0
        t.run.extra_gen_batches = 0

    def _evaluate(self) -> dict[str, float]:
        """An evaluation during the run, recorded (overrides of evaluate() that call the base
        method record too, without a parameter to pass along)."""
        t = self.trainer
        assert self.eval_prompts is not None
        t.run.record_eval = t.is_main_process
        try:
            result = t.evaluate(self.eval_prompts)
        finally:
            t.run.record_eval = False
        scalars: dict[str, Any] = {k: v for k, v in result.items() if isinstance(v, float)}
        for cb in self.callbacks:
            cb.on_evaluate(t, t.run.global_step, scalars)
        return scalars
