"""The loop that SFT and reward-model training share: batches, optimiser steps, evaluation,
checkpoints and metrics.

:meth:`SupervisedTrainer.train` reads top to bottom:

1. tokenise the training and held-out data (:meth:`~SupervisedTrainer.prepare`);
2. build AdamW with a warm-up + decay schedule over the run's steps, and resume from a checkpoint;
3. each step: the epoch's next length-bucketed batch, split into micro-batches; per micro-batch
   ``nn.value_and_grad`` of :meth:`~SupervisedTrainer.loss_fn` (which calls the model), the
   gradients weighted by the micro-batch's share of the batch's targets (tokens or pairs), so
   accumulation gives the gradient of the whole batch; clipping, one update, one ``mx.eval``;
4. evaluation on the held-out data (before the first step, every ``eval_every`` steps, after
   the last), ``metrics.jsonl``, the progress bar, a checkpoint every ``save_every`` steps, and
   the hooks of the run's :class:`StageCallback` objects;
5. ``training_curves.png``.

:class:`finetune.sft_trainer.SFTTrainer` and :class:`finetune.reward_trainer.RewardTrainer` fill
in the task: :meth:`~SupervisedTrainer.prepare`, :meth:`~SupervisedTrainer.collate`,
:meth:`~SupervisedTrainer.loss_fn`, :meth:`~SupervisedTrainer.evaluate` and
:meth:`~SupervisedTrainer.save_pretrained`.

A resumed run continues exactly: the data order of an epoch is a function of ``(seed, epoch)``,
dropout is seeded from ``(seed, step)``, and a checkpoint holds the trainable weights, the
optimiser state (moments and step count), the learning-rate schedule (a run made longer on resume
continues from the rate it had reached instead of restarting its schedule), the step, the epoch
and the position in the epoch.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Generic, Iterable, Mapping, Sequence, Sized, TypeVar

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from base_setup.backend import adapt_blas_threads, run_blas_threads, step_seed
from base_setup.grad_checkpoint import checkpoint_blocks
from config.loading import config_to_dict
from config.sft_config import FineTuneConfig
from experience_buffer.buffer import split_micro_batches
from training.checkpoint import (
    CheckpointManager,
    check_resume_config,
    load_training_state,
    save_training_state,
    warn_changed_settings,
)
from finetune.records import train_eval_split
from training.fingerprints import check_same_inputs, data_fingerprint, model_fingerprint
from finetune.tokenize import length_bucketed_batches
from training.optimizer import SchedulePlan, make_adamw, optimizer_step, resumed_plan
from training.run_control import (
    RunLog,
    StopSignals,
    TrainingStopped,
    check_resume_source,
    continue_timeline,
    in_run_scope,
    prepare_run_dir,
    remove_run_leftovers,
    run_lock,
    save_after_failure,
)

logger = logging.getLogger("ppo_mlx")

E = TypeVar("E", bound=Sized)  # one tokenised example; len() = its tokens
B = TypeVar("B")  # one collated micro-batch

#: Name of the trained model's directory under ``output_dir``.
MODEL_DIR = "model"
# Config fields a checkpoint must agree on to be resumed: the data order, the trained weights'
# dtype, how they are optimised.
_RESUME_KEYS = (
    "model_name",
    "batch_size",
    "seed",
    "bucket_window",
    "dtype",
    "adam_bias_correction",
)


def load_run_data(
    config: FineTuneConfig, load: Callable[..., Iterable[Mapping[str, Any]]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The run's (training, held-out) records: ``config.dataset`` and ``config.eval_dataset``
    read with ``load(source, split=...)``, or, without an eval_dataset, ``eval_fraction`` of the
    training records held out with ``seed`` (None when eval_fraction is 0).

    Raises:
        ValueError: ``config.dataset`` is not set.
    """
    if config.dataset is None:
        raise ValueError(
            "dataset is not set: point it at a JSONL file (see finetune/records.py for the "
            "formats) or a Hugging Face dataset name"
        )
    records = load(config.dataset, split=config.dataset_split)
    if config.eval_dataset is not None:
        held_out = load(config.eval_dataset, split=config.eval_dataset_split)
        return [dict(r) for r in records], [dict(r) for r in held_out]
    train, held_out_part = train_eval_split(records, config.eval_fraction, config.seed)
    return train, held_out_part or None


C = TypeVar("C", bound=FineTuneConfig)


def run_stage(
    trainer_class: Callable[[C], SupervisedTrainer[Any, Any]],
    config: C,
    load: Callable[..., Iterable[Mapping[str, Any]]],
    resume_from: str | Path | None,
) -> Path:
    """One fine-tuning stage from its config alone: read the data (:func:`load_run_data`), check
    the output folder before the model loads, train, and save the model to
    ``<output_dir>/model``, which is returned.

    Raises:
        ValueError: ``config.dataset`` is not set, or the data is malformed.
        TrainingStopped: Ctrl-C or SIGTERM stopped the run (after saving a checkpoint).
    """
    train_records, eval_records = load_run_data(config, load)
    with run_lock(config.output_dir):  # one writer, from the folder check to the saved model
        # Before the model loads: a folder that holds another run, or that cannot be written.
        prepare_run_dir(
            config.output_dir,
            resuming=resume_from is not None,
            overwrite=config.overwrite_output_dir,
            log_with=config.log_with,
        )
        trainer = trainer_class(config)
        trainer.train(train_records, eval_records, resume_from=resume_from)
        if trainer.stop_reason is not None:  # a signal: the checkpoint holds the run
            raise TrainingStopped(trainer.stop_reason, trainer.global_step)
        return trainer.save_pretrained(Path(config.output_dir) / MODEL_DIR, overwrite=True)


class StageCallback:
    """Hooks of a fine-tuning stage's loop (SFT, reward model, DPO), as PPO's
    ``TrainerCallback``; override the ones you need, every default does nothing. ``step`` counts
    optimiser steps from 1; a hook may call ``trainer.request_stop()`` to stop early (the run
    saves a checkpoint and can be resumed)."""

    def on_train_begin(self, trainer: SupervisedTrainer[Any, Any]) -> None:
        """Called once before the first step (after a resume has restored the state)."""

    def on_step_end(
        self, trainer: SupervisedTrainer[Any, Any], step: int, metrics: dict[str, Any]
    ) -> None:
        """Called after each optimiser step with its metrics (and the evaluation's, if due)."""

    def on_evaluate(
        self, trainer: SupervisedTrainer[Any, Any], step: int, metrics: dict[str, float]
    ) -> None:
        """Called after each evaluation on the held-out data (``eval/...`` metrics)."""

    def on_save(self, trainer: SupervisedTrainer[Any, Any], step: int, path: Path) -> None:
        """Called after a checkpoint has been written (atomically) to ``path``."""

    def on_train_end(
        self, trainer: SupervisedTrainer[Any, Any], history: list[dict[str, Any]]
    ) -> None:
        """Called once at the end of ``train`` (also after a stop that saved a checkpoint)."""


class SupervisedTrainer(Generic[E, B]):
    """Minibatch training of one model on tokenised examples; see the module docstring.

    Args:
        config: the run's :class:`FineTuneConfig` (an SFT or reward config).
        model: the model to train; its trainable parameters are what the optimiser updates.

    Attributes:
        global_step: optimiser steps taken.
        epoch: the current pass over the training data (0-based).
        batch_in_epoch: batches of the current epoch already trained on.
        history: one metrics dict per step (with ``"step"`` and ``"epoch"``), plus a first
            ``{"step": 0, "eval/...": ...}`` record when evaluating before training.
    """

    #: Progress-bar label.
    name = "train"
    #: Metric key of the training loss.
    loss_key = "loss/train"

    def __init__(self, config: FineTuneConfig, model: nn.Module) -> None:
        self.config = config
        self.model = model
        if config.gradient_checkpointing:
            checkpoint_blocks(model)
        self.global_step = 0
        self.epoch = 0
        self.batch_in_epoch = 0
        self.history: list[dict[str, Any]] = []
        self.run_dir = Path(config.output_dir)
        self.checkpoints = CheckpointManager(
            self.run_dir / "checkpoints", keep_last=config.keep_last_checkpoints
        )
        self.optimizer: optim.Optimizer | None = None
        self._schedule_plan: SchedulePlan | None = None  # the learning rate's, set by train()
        self._num_train_examples: int | None = None
        self.blas_threads: int | None = None  # OpenBLAS threads of this run (run_blas_threads)
        self.stop_reason: str | None = None  # after train(): why it stopped early, if it did
        self.callbacks: list[StageCallback] = []  # those of the current train() call
        self._stop: StopSignals | None = None  # the current train() call's
        self._value_and_grad = nn.value_and_grad(self.model, self.loss_fn)
        # What the run reads besides its settings, recorded and compared on resume (train() adds
        # the data's).
        self.inputs: dict[str, str | None] = {"model": model_fingerprint(config.model_name)}

    # ------------------------------------------------------------------ task seams
    def prepare(self, data: Iterable[Mapping[str, Any]]) -> list[E]:
        """Check and tokenise records into examples."""
        raise NotImplementedError

    def collate(self, examples: Sequence[E]) -> tuple[B, int]:
        """One micro-batch of ``examples`` and its number of loss targets (tokens or pairs)."""
        raise NotImplementedError

    def loss_fn(self, model: nn.Module, batch: B) -> tuple[mx.array, dict[str, mx.array]]:
        """``(loss, metrics)`` of one micro-batch, each a mean over its targets; calls ``model``
        (the function ``nn.value_and_grad`` differentiates)."""
        raise NotImplementedError

    def evaluate(self, examples: Sequence[E]) -> dict[str, float]:
        """Metrics (``eval/...``) on held-out examples, without gradients."""
        raise NotImplementedError

    def save_pretrained(self, path: str | Path, overwrite: bool = False) -> Path:
        """Save the trained model where the next stage loads it; returns the directory.
        A file, or a non-empty directory without ``overwrite``, is refused (``ValueError``)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the loop
    @in_run_scope
    def train(
        self,
        train_data: Iterable[Mapping[str, Any]],
        eval_data: Iterable[Mapping[str, Any]] | None = None,
        resume_from: str | Path | None = None,
        callbacks: Sequence[StageCallback] = (),
    ) -> list[dict[str, Any]]:
        """Train on ``train_data`` for the configured epochs/steps; returns the metrics history.

        Args:
            train_data: records (dicts, a list or a ``datasets.Dataset``) in the trainer's format.
            eval_data: held-out records, evaluated before the first step, every ``eval_every``
                steps and after the last; None = no evaluation.
            resume_from: a checkpoint directory or ``"latest"`` (the newest under
                ``<output_dir>/checkpoints``): continue where it stopped.
            callbacks: :class:`StageCallback` objects whose hooks the loop calls.
        """
        with run_lock(self.run_dir):  # one writer per run folder, before anything is removed
            return self._train(train_data, eval_data, resume_from, callbacks)

    def _train(
        self,
        train_data: Iterable[Mapping[str, Any]],
        eval_data: Iterable[Mapping[str, Any]] | None,
        resume_from: str | Path | None,
        callbacks: Sequence[StageCallback],
    ) -> list[dict[str, Any]]:
        cfg = self.config
        if resume_from is None and self.global_step > 0:  # would empty the folder, train nothing
            raise ValueError(
                f"this trainer has already trained {self.global_step} steps: to go on, call "
                "train(..., resume_from='latest') (with a larger total_steps); for a new run, "
                "build a new trainer"
            )
        self.callbacks = list(callbacks)
        prepare_run_dir(
            self.run_dir,
            resuming=resume_from is not None,
            overwrite=cfg.overwrite_output_dir,
            log_with=cfg.log_with,
        )
        remove_run_leftovers(self.run_dir)
        # 1. Tokenise (every record is checked before any training).
        records = [dict(r) for r in train_data]  # read once: fingerprinted, then tokenised
        self.inputs["data"] = data_fingerprint(records)  # the records, not settings' effects
        examples = self.prepare(records)
        eval_examples = self.prepare(eval_data) if eval_data is not None else []
        self._num_train_examples = len(examples)
        lengths = [len(e) for e in examples]
        steps_per_epoch = math.ceil(len(examples) / cfg.batch_size)
        total = cfg.num_epochs * steps_per_epoch
        if cfg.total_steps is not None:
            total = min(total, cfg.total_steps)

        # 2. Optimiser over the run's length; resume.
        self._schedule_plan = SchedulePlan(
            cfg.learning_rate, cfg.lr_scheduler, cfg.warmup_steps, total
        )
        self.optimizer = self._make_optimizer(self._schedule_plan)
        resume_step = None
        if resume_from is not None:
            path = self.checkpoints.resolve(resume_from)
            check_resume_source(self.run_dir, path)
            self.load_checkpoint(path)
            continue_timeline(self.checkpoints, self.global_step)
            resume_step = self.global_step
            logger.info("resumed from %s at step %d", path, self.global_step)
        else:
            self.blas_threads = run_blas_threads()  # fixed for the run (and its resumptions)
        last_saved = self.global_step if resume_step is not None else -1
        run_log = RunLog(
            self.run_dir,
            cfg,
            total=total,
            initial=self.global_step,
            desc=self.name,
            resume_step=resume_step,
        )
        stop = StopSignals()  # Ctrl-C / SIGTERM: finish the step, save, return (stop_reason)
        self._stop = stop
        with stop, run_log:
            try:
                for cb in self.callbacks:
                    cb.on_train_begin(self)
                if eval_examples and cfg.eval_every and self.global_step == 0:
                    record: dict[str, Any] = {"step": 0, **self.evaluate(eval_examples)}
                    self.history.append(record)
                    run_log.write(0, record)
                    for cb in self.callbacks:
                        cb.on_evaluate(self, 0, {k: v for k, v in record.items() if k != "step"})
                batches: list[list[int]] = []
                batches_epoch = -1
                # 3. Steps.
                while self.global_step < total and not stop.requested:
                    if batches_epoch != self.epoch:
                        batches = length_bucketed_batches(
                            lengths,
                            cfg.batch_size,
                            window=cfg.bucket_window,
                            seed=cfg.seed,
                            epoch=self.epoch,
                        )
                        batches_epoch = self.epoch
                    metrics = self.step([examples[i] for i in batches[self.batch_in_epoch]])
                    record = {"step": self.global_step, "epoch": self.epoch, **metrics}
                    self.batch_in_epoch += 1
                    if self.batch_in_epoch == len(batches):
                        self.epoch += 1
                        self.batch_in_epoch = 0
                    # 4. Evaluation, logging, checkpoints.
                    due = cfg.eval_every and self.global_step % cfg.eval_every == 0
                    if eval_examples and (due or self.global_step == total):
                        evaluation = self.evaluate(eval_examples)
                        record.update(evaluation)
                        for cb in self.callbacks:
                            cb.on_evaluate(self, self.global_step, evaluation)
                    self.history.append(record)
                    run_log.log(self.global_step, record, self._postfix(record))
                    for cb in self.callbacks:
                        cb.on_step_end(self, self.global_step, record)
                    if cfg.save_every and self.global_step % cfg.save_every == 0:
                        self.save_checkpoint()
                        last_saved = self.global_step
                if last_saved != self.global_step:
                    self.save_checkpoint()
            except BaseException as err:
                if save_after_failure(err, False, self.global_step, last_saved):
                    self.save_checkpoint()
                raise
        self.stop_reason = stop.reason
        self._stop = None
        for cb in self.callbacks:
            cb.on_train_end(self, self.history)
        if stop.requested:
            logger.warning(
                "stopped (%s) at step %d; the checkpoint is saved", stop.reason, self.global_step
            )
        return self.history

    def request_stop(self, reason: str = "requested by a callback") -> None:
        """Ask :meth:`train` to stop after the current step and save a checkpoint (what Ctrl-C
        does); callbacks use it for early stopping.

        Raises:
            ValueError: called outside :meth:`train`.
        """
        if self._stop is None:
            raise ValueError("request_stop() stops a running train(); call it from a callback")
        self._stop.request(reason)

    @in_run_scope
    def step(self, examples: Sequence[E]) -> dict[str, float]:
        """One optimiser step on ``examples`` (one batch); returns its metrics."""
        cfg = self.config
        if self.optimizer is None:
            raise ValueError("no optimiser: call train(), which builds it for the run's length")
        t0 = time.perf_counter()
        adapt_blas_threads()  # only with PPO_MLX_ADAPTIVE_BLAS=step (else fixed per run)
        self.model.train()
        mx.random.seed(step_seed(cfg.seed, self.global_step))  # dropout, as a resumed run draws
        micro = [
            self.collate(mb)
            for mb in split_micro_batches(examples, cfg.gradient_accumulation_steps)
        ]
        total = sum(n for _, n in micro)
        # Each micro-batch loss is a mean over its n targets: weighting it by n / total makes
        # the accumulated gradient that of the mean over the whole batch.
        metrics = optimizer_step(
            self.model,
            self.optimizer,
            self._value_and_grad,
            [batch for batch, _ in micro],
            [n / total for _, n in micro] if len(micro) > 1 else [1.0],
            max_grad_norm=cfg.max_grad_norm,
            step=self.global_step + 1,
            what=f"the {self.name} training loss",
        )
        out = {key: float(np.asarray(value)) for key, value in metrics.items()}
        out[self.loss_key] = out.pop("loss")
        out["lr"] = float(self.optimizer.learning_rate)
        out["time/step"] = time.perf_counter() - t0
        self.global_step += 1
        return out

    def _make_optimizer(self, plan: SchedulePlan) -> optim.Optimizer:
        """AdamW following ``plan``'s learning-rate schedule."""
        cfg = self.config
        return make_adamw(
            plan.schedule(),
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
            bias_correction=cfg.adam_bias_correction,
            plain=cfg.plain_mlx,
        )

    def eval_chunks(self, examples: Sequence[E]) -> list[list[E]]:
        """Held-out examples in evaluation micro-batches, similar lengths together."""
        size = self.config.eval_micro_batch_size
        ordered = sorted(examples, key=len)
        return [ordered[i : i + size] for i in range(0, len(ordered), size)]

    def _postfix(self, record: Mapping[str, Any]) -> dict[str, str]:
        postfix = {"loss": f"{record[self.loss_key]:.3f}"}
        postfix.update(
            {k.split("/")[-1]: f"{v:.3f}" for k, v in record.items() if k.startswith("eval/")}
        )
        return postfix

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """Write the trainable weights, optimiser state and position (atomically) under
        ``<output_dir>/checkpoints/step_NNNNNN``."""
        state = {
            "global_step": self.global_step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "num_train_examples": self._num_train_examples,
            "blas_threads": self.blas_threads,
            "schedule": self._schedule_plan.to_dict() if self._schedule_plan else None,
            "history": self.history,
            "config": config_to_dict(self.config),
            "inputs": self.inputs,
        }
        path = save_training_state(
            self.checkpoints,
            self.global_step,
            {"model": self.model},
            {"optimizer": self.optimizer},
            state,
        )
        for cb in self.callbacks:
            cb.on_save(self, self.global_step, path)
        return path

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore weights, optimiser state and position from a checkpoint of the same run.

        Raises:
            ValueError: the checkpoint was written with another model, batch size, seed or
                data size (the data order would differ), dtype, or trained set (LoRA settings,
                the reward head's initialisation).
        """
        state = CheckpointManager.read_state(path)
        check_resume_config(
            path, state["config"], config_to_dict(self.config), _RESUME_KEYS + self._resume_keys()
        )
        check_same_inputs(path, state.get("inputs"), self.inputs)
        if state["num_train_examples"] != self._num_train_examples:
            raise ValueError(
                f"checkpoint {path} was trained on {state['num_train_examples']} examples but "
                f"this run has {self._num_train_examples}: resume with the same data"
            )
        load_training_state(path, {"model": self.model}, {"optimizer": self.optimizer})
        self.blas_threads = run_blas_threads(state.get("blas_threads"))  # the same sums
        self.global_step = int(state["global_step"])
        self.epoch = int(state["epoch"])
        self.batch_in_epoch = int(state["batch_in_epoch"])
        self.history = list(state["history"])
        schedule_note = None
        if self._schedule_plan is not None and self.optimizer is not None:
            # The schedule the run followed, continued (not restarted) if total_steps changed.
            updates = int(np.asarray(self.optimizer.step))
            self._schedule_plan, schedule_note = resumed_plan(
                state.get("schedule"), self._schedule_plan, updates
            )
            moments = self.optimizer.state
            self.optimizer = self._make_optimizer(self._schedule_plan)
            self.optimizer.state = moments
        warn_changed_settings(path, state["config"], config_to_dict(self.config), [schedule_note])

    def _resume_keys(self) -> tuple[str, ...]:
        """Further config fields a resumed run must share with its checkpoint."""
        return ()
