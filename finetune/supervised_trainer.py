"""The fine-tuning stages (SFT, reward model, DPO): what they share of the one training loop
(:class:`training.loop.TrainingLoop`), which runs them as it runs PPO.

:meth:`SupervisedTrainer.train` runs a :class:`SupervisedStage` in the loop:

1. the training and held-out records are read once, fingerprinted, and tokenised
   (:meth:`~SupervisedTrainer.prepare`), after the loop has locked and checked the run folder;
2. AdamW with a warm-up + decay schedule over the run's steps; the loop resumes a checkpoint;
3. each step (:meth:`SupervisedTrainer.step`): the epoch's next length-bucketed batch, split into
   micro-batches; per micro-batch the gradient of :meth:`~SupervisedTrainer.loss_fn` (which
   calls the model; compiled whole at real model sizes, ``training.compiled_gradient``, with the
   batches' widths rounded up to a multiple of ``WIDTH_MULTIPLE``), the gradients weighted by
   the micro-batch's share of the batch's targets (tokens or pairs), so accumulation gives the
   gradient of the whole batch; clipping, one update, one ``mx.eval``;
4. the loop's: evaluation on the held-out data (before the first step, every ``eval_every``
   steps, after the last), ``metrics.jsonl``, the progress bar, a checkpoint every
   ``save_every`` steps, signals, and the hooks of the run's
   :class:`~training.callbacks.TrainerCallback` objects (``StageCallback`` is the same class);
5. ``training_curves.png``.

:class:`finetune.sft_trainer.SFTTrainer`, :class:`finetune.reward_trainer.RewardTrainer` and
:class:`finetune.dpo_trainer.DPOTrainer` fill in the task: :meth:`~SupervisedTrainer.prepare`,
:meth:`~SupervisedTrainer.collate`, :meth:`~SupervisedTrainer.loss_fn`,
:meth:`~SupervisedTrainer.evaluate` and :meth:`~SupervisedTrainer.save_pretrained`.

A resumed run continues exactly: the data order of an epoch is a function of ``(seed, epoch)``,
dropout is seeded from ``(seed, step)``, and a checkpoint holds the trainable weights, the
optimiser state (moments and step count), the learning-rate schedule (a run made longer on resume
continues from the rate it had reached instead of restarting its schedule), the step, the epoch
and the position in the epoch.

Data parallelism (``mlx.launch -n N python main.py sft|reward|dpo ...``, as PPO's): every rank
reads the same data and computes the same epoch order; ``batch_size`` is the global batch, and
rank ``r`` trains on its contiguous share of each batch (:func:`rank_share`), split into
``gradient_accumulation_steps`` micro-batches. Each micro-batch's gradient is weighted by
``N * n_k / sum_ranks(n)`` (``n_k`` its targets: tokens or pairs) before the ranks' gradients are
averaged, so the update is the gradient of the mean over the targets of the whole global batch,
the one a single process makes on it; the metrics are those of the global batch. Only rank 0
writes the run folder (``metrics.jsonl``, the curves, checkpoints, the model); every rank
evaluates the whole held-out set; the ranks' weights are checked identical at the start and end.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Generic, Iterable, Mapping, Sequence, Sized, TypeVar

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from base_setup import distributed as dist
from base_setup.backend import adapt_blas_threads, run_blas_threads, step_seed
from base_setup.grad_checkpoint import checkpoint_blocks
from config._fields import divisors
from config.loading import config_to_dict
from config.sft_config import FineTuneConfig
from experience_buffer.buffer import split_micro_batches
from training.callbacks import CallbackLike, TrainerCallback, as_callbacks
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
from training.loop import InRunState, LoopState, TrainingLoop
from training.compiled_gradient import batch_width_multiple, training_gradient
from training.optimizer import SchedulePlan, make_adamw, optimizer_step, resumed_plan
from training.run_control import (
    TrainingStopped,
    check_extension_trains,
    in_run_scope,
    prepare_run_dir,
    run_lock,
)

logger = logging.getLogger("ppo_mlx")

E = TypeVar("E", bound=Sized)  # one tokenised example; len() = its tokens
B = TypeVar("B")  # one collated micro-batch
T = TypeVar("T")

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


#: Fewer held-out records than this is warned (eval metrics on them are noise).
MIN_HELD_OUT = 10


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
    if 0 < len(held_out_part) < MIN_HELD_OUT:
        logger.warning(
            "eval_fraction=%g holds out %d of %d records: eval/ metrics on so few move in steps "
            "of 1/%d (an accuracy of 1.000 on 1 pair says little); give eval_dataset, raise "
            "eval_fraction, or set it to 0",
            config.eval_fraction,
            len(held_out_part),
            len(held_out_part) + len(train),
            len(held_out_part),
        )
    return train, held_out_part or None


C = TypeVar("C", bound=FineTuneConfig)


def check_data_parallel_config(config: FineTuneConfig, group: dist.Group | None = None) -> None:
    """Start-up checks of a data-parallel run (every rank raises the same ``ValueError``): the
    ranks' configs agree, and the global ``batch_size`` splits evenly over the N ranks, each
    rank's share into ``gradient_accumulation_steps`` micro-batches (as PPO requires). Nothing
    to check on one process."""
    group = group or dist.world()
    n = group.size()
    if n == 1:
        return
    dist.check_same_settings_on_all_ranks(config_to_dict(config), group)
    problem = None
    if config.batch_size % n:
        problem = (
            f"batch_size={config.batch_size} (the examples of one step, over all ranks) does not "
            f"split evenly over {n} processes: set batch_size to a multiple of {n} or launch a "
            f"number of processes that divides it ({divisors(config.batch_size)})"
        )
    elif (config.batch_size // n) % config.gradient_accumulation_steps:
        local = config.batch_size // n
        problem = (
            f"each of the {n} processes trains on batch_size / {n} = {local} examples, which "
            f"cannot be split into gradient_accumulation_steps="
            f"{config.gradient_accumulation_steps} equal micro-batches: set "
            f"gradient_accumulation_steps to one of {divisors(local)} or raise batch_size"
        )
    if problem is not None:  # the same config on every rank: every rank gets here
        dist.fail_together(ValueError(problem), group)


def rank_share(batch: Sequence[T], rank: int, world_size: int) -> Sequence[T]:
    """Rank ``rank``'s contiguous share of a global batch: ``batch[round(r B / N) :
    round((r + 1) B / N)]`` (``B / N`` examples each when N divides B; the last batch of an epoch
    may be smaller, and a rank's share then empty when B < N)."""
    n = len(batch)
    return batch[round(rank * n / world_size) : round((rank + 1) * n / world_size)]


def _main_process_only(
    group: dist.Group, what: str, action: Callable[[contextlib.ExitStack], None]
) -> contextlib.ExitStack:
    """``action(held)`` on rank 0 (the one writer of the run folder), its ``ValueError`` raised on
    every rank; returns ``held``, the stack that keeps what the action entered (a lock)."""
    held = contextlib.ExitStack()
    error: ValueError | None = None
    if group.rank() == 0:
        try:
            action(held)
        except ValueError as err:
            held.close()
            error = err
    dist.raise_if_any_rank_failed(error, what, group)
    return held


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
    check_data_parallel_config(config)  # before the data and the model load
    train_records, eval_records = load_run_data(config, load)

    def lock_and_check(held: contextlib.ExitStack) -> None:
        # One writer (rank 0), from the folder check to the saved model. Before the model
        # loads: a folder that holds another run, or that cannot be written.
        held.enter_context(run_lock(config.output_dir))
        prepare_run_dir(
            config.output_dir,
            resuming=resume_from is not None,
            overwrite=config.overwrite_output_dir,
            log_with=config.log_with,
        )

    with _main_process_only(
        dist.world(), f"checking output_dir {config.output_dir}", lock_and_check
    ):
        trainer = trainer_class(config)
        trainer.train(train_records, eval_records, resume_from=resume_from)
        if trainer.stop_reason is not None:  # a signal: the checkpoint holds the run
            raise TrainingStopped(trainer.stop_reason, trainer.global_step)
        # Rank 0 writes (the weights are the same on every rank); the others return the path.
        return trainer.save_pretrained(Path(config.output_dir) / MODEL_DIR, overwrite=True)


#: The callback type of the fine-tuning stages: the one of every stage,
#: :class:`training.callbacks.TrainerCallback` (kept under this name for existing code).
StageCallback = TrainerCallback


class SupervisedTrainer(Generic[E, B]):
    """Minibatch training of one model on tokenised examples; see the module docstring.

    Args:
        config: the run's :class:`FineTuneConfig` (an SFT or reward config).
        model: the model to train; its trainable parameters are what the optimiser updates.

    Attributes:
        group: the ``mx.distributed`` group of the launched processes; ``world_size``, ``rank``
            and ``is_main_process`` (rank 0, the one that writes files) describe it.
        run: what a run changes (:class:`~training.loop.LoopState`); ``global_step``,
            ``epoch``, ``batch_in_epoch`` (its ``step_in_epoch``), ``history``,
            ``blas_threads``, ``stop_reason`` and ``callbacks`` are its fields.
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

    global_step = InRunState[int]()
    epoch = InRunState[int]()
    batch_in_epoch = InRunState[int]("step_in_epoch")
    history = InRunState[list[dict[str, Any]]]()
    blas_threads = InRunState[int | None]()
    stop_reason = InRunState[str | None]()
    callbacks = InRunState[list[TrainerCallback]]()

    def __init__(self, config: FineTuneConfig, model: nn.Module) -> None:
        self.config = config
        self.model = model
        # Data parallelism (mlx.launch): rank `rank` of `world_size` (1 without the launcher).
        self.group = dist.world()
        self.world_size = self.group.size()
        self.rank = self.group.rank()
        self.is_main_process = self.rank == 0
        check_data_parallel_config(config, self.group)
        if config.gradient_checkpointing:
            checkpoint_blocks(model)
        # What the run changes (counters, history, stop request, callbacks), which the loop
        # (training.loop.TrainingLoop) shares with the step; global_step, epoch, ... are its fields.
        self.run = LoopState()
        self.run_dir = Path(config.output_dir)
        self.checkpoints = CheckpointManager(
            self.run_dir / "checkpoints", keep_last=config.keep_last_checkpoints
        )
        self.optimizer: optim.Optimizer | None = None
        self._schedule_plan: SchedulePlan | None = None  # the learning rate's, set by train()
        self._num_train_examples: int | None = None
        # Compiled at real model sizes (training.compiled_gradient); its batches then come in
        # widths that are multiples of WIDTH_MULTIPLE, each new width being a new trace.
        self._value_and_grad = training_gradient(self.model, self.loss_fn)
        self.pad_to_multiple_of = batch_width_multiple(self._value_and_grad)
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
        A file, or a non-empty directory without ``overwrite``, is refused (``ValueError``).
        Only rank 0 of a data-parallel run writes (the others return ``path``)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the loop
    @in_run_scope
    def train(
        self,
        train_data: Iterable[Mapping[str, Any]],
        eval_data: Iterable[Mapping[str, Any]] | None = None,
        resume_from: str | Path | None = None,
        callbacks: Sequence[CallbackLike] = (),
    ) -> list[dict[str, Any]]:
        """Train on ``train_data`` for the configured epochs/steps; returns the metrics history.

        Args:
            train_data: records (dicts, a list or a ``datasets.Dataset``) in the trainer's format.
            eval_data: held-out records, evaluated before the first step, every ``eval_every``
                steps and after the last; None = no evaluation.
            resume_from: a checkpoint directory or ``"latest"`` (the newest under
                ``<output_dir>/checkpoints``): continue where it stopped.
            callbacks: :class:`~training.callbacks.TrainerCallback` objects whose hooks the loop
                calls, and/or plain ``fn(epoch, metrics)``.
        """
        stage = SupervisedStage(self, train_data, eval_data)
        return TrainingLoop(stage, as_callbacks(callbacks)).run(resume_from)

    def request_stop(self, reason: str = "requested by a callback") -> None:
        """Ask :meth:`train` to stop after the current step and save a checkpoint (what Ctrl-C
        does); callbacks use it for early stopping.

        Raises:
            ValueError: called outside :meth:`train`.
        """
        if not self.run.running:
            raise ValueError("request_stop() stops a running train(); call it from a callback")
        self.run.stop.request(reason)

    @in_run_scope
    def step(self, examples: Sequence[E]) -> dict[str, float]:
        """One optimiser step on ``examples`` (one global batch; in a data-parallel run this rank
        computes the gradient of its :func:`rank_share`); returns the batch's metrics."""
        cfg = self.config
        if self.optimizer is None:
            raise ValueError("no optimiser: call train(), which builds it for the run's length")
        t0 = time.perf_counter()
        adapt_blas_threads()  # only with PPO_MLX_ADAPTIVE_BLAS=step (else fixed per run)
        self.model.train()
        seed = step_seed(cfg.seed, self.global_step)  # dropout, as a resumed run draws
        mx.random.seed(step_seed(seed, self.rank) if self.rank else seed)  # ranks: other masks
        local = rank_share(examples, self.rank, self.world_size)
        parts = split_micro_batches(local, cfg.gradient_accumulation_steps) if local else []
        micro = [self.collate(mb) for mb in parts]
        if not micro:  # an epoch's last batch smaller than the ranks: a zero-weight gradient
            micro = [(self.collate(examples[:1])[0], 0)]
        # Each micro-batch loss is a mean over its n targets: weighting it by N * n / total
        # (N ranks, total = the targets of the global batch) makes the accumulated gradient,
        # averaged over the ranks, that of the mean over the whole batch.
        local_total = sum(n for _, n in micro)
        if self.world_size == 1:
            weights = [n / local_total for _, n in micro] if len(micro) > 1 else [1.0]
        else:
            total = float(np.asarray(dist.all_sum(mx.array(float(local_total)), self.group)))
            weights = [self.world_size * n / total for _, n in micro]
        metrics = optimizer_step(
            self.model,
            self.optimizer,
            self._value_and_grad,
            [batch for batch, _ in micro],
            weights,
            max_grad_norm=cfg.max_grad_norm,
            step=self.global_step + 1,
            what=f"the {self.name} training loss",
            group=self.group,
        )
        if self.world_size > 1:  # each rank's sums of weighted means: their mean is the batch's
            keys = [key for key in metrics if key != "grad_norm"]  # the same on every rank
            means = dist.all_mean(mx.stack([metrics[k].astype(mx.float32) for k in keys]))
            metrics.update({k: means[i] for i, k in enumerate(keys)})
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
        ``<output_dir>/checkpoints/step_NNNNNN``. In a data-parallel run only rank 0 writes
        (every rank holds the same state); the others return the directory it writes."""
        if not self.is_main_process:
            return self.checkpoints.root / f"step_{self.global_step:06d}"
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
            "world_size": self.world_size,
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

    def _run_length(self, num_examples: int) -> tuple[int, int]:
        """``(total steps, steps per epoch)`` of a run over ``num_examples`` examples:
        ``num_epochs`` passes, capped by ``total_steps``."""
        cfg = self.config
        steps_per_epoch = math.ceil(num_examples / cfg.batch_size)
        total = cfg.num_epochs * steps_per_epoch
        if cfg.total_steps is not None:
            total = min(total, cfg.total_steps)
        return total, steps_per_epoch

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
        total, steps_per_epoch = self._run_length(int(state["num_train_examples"]))
        check_extension_trains(
            int(state["global_step"]),
            total,
            epochs=self.config.num_epochs,
            steps_per_epoch=steps_per_epoch,
            total_steps=self.config.total_steps,
            saved_config=state["config"],
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
        saved_world = int(state.get("world_size", 1))
        world_note = None
        if saved_world != self.world_size:  # the same global batches: allowed
            world_note = (
                f"written by {saved_world} process(es), continued on {self.world_size}: the same "
                "batches and updates, with the float rounding of the new split"
            )
        warn_changed_settings(
            path, state["config"], config_to_dict(self.config), [schedule_note, world_note]
        )

    def _resume_keys(self) -> tuple[str, ...]:
        """Further config fields a resumed run must share with its checkpoint."""
        return ()


class SupervisedStage(Generic[E, B]):
    """A fine-tuning stage (SFT, reward model, DPO) of :class:`~training.loop.TrainingLoop`: one
    :meth:`SupervisedTrainer.train` call over ``train_data`` (and held-out ``eval_data``).

    It reads the records once (fingerprinted, then tokenised by the trainer's
    :meth:`~SupervisedTrainer.prepare`), builds AdamW over the run's length, and gives each step
    the epoch's next length-bucketed batch (a function of ``(seed, epoch)``, so a resumed run
    recomputes it). It evaluates before the first step (with ``eval_every``) and at the last.
    """

    evaluate_first = True
    final_eval_file: str | None = None  # the last step evaluates, in its record
    epoch_ends_at_last_step = False  # a longer run resumed from the last step continues the pass

    def __init__(
        self,
        trainer: SupervisedTrainer[E, B],
        train_data: Iterable[Mapping[str, Any]],
        eval_data: Iterable[Mapping[str, Any]] | None,
    ) -> None:
        self.trainer = trainer
        self.config = trainer.config
        self.group = trainer.group
        self.is_main_process = trainer.is_main_process
        self.run_dir = trainer.run_dir
        self.checkpoints = trainer.checkpoints
        self.inputs = trainer.inputs
        self.label = trainer.name
        self.train_data = train_data
        self.eval_data = eval_data
        self.examples: list[E] = []
        self.eval_examples: list[E] = []
        self._records: list[dict[str, Any]] = []
        self._held_out: list[dict[str, Any]] | None = None
        self._batches: list[list[int]] = []
        self._batches_epoch = -1  # the epoch _batches belong to

    @property
    def state(self) -> LoopState:
        return self.trainer.run

    @property
    def has_eval(self) -> bool:
        return bool(self.eval_examples)

    def check_data(self) -> None:
        """Read the records once and record their fingerprint (every rank the same data)."""
        self._records = [dict(r) for r in self.train_data]  # fingerprinted, then tokenised
        self.inputs["data"] = data_fingerprint(self._records)  # the records, not settings' effects
        held_out = [dict(r) for r in self.eval_data] if self.eval_data is not None else None
        self._held_out = held_out
        dist.check_same_on_all_ranks(
            json.dumps([self.inputs["data"], held_out and data_fingerprint(held_out)]).encode(),
            "the training or held-out data",
            "give every rank the same data: each rank takes its share of the same batches",
            self.group,
        )

    def prepare(self) -> tuple[int, int]:
        """Tokenise (every record is checked before any training); the run's length."""
        t = self.trainer
        self.examples = t.prepare(self._records)
        self.eval_examples = t.prepare(self._held_out) if self._held_out is not None else []
        t._num_train_examples = len(self.examples)
        return t._run_length(len(self.examples))

    def build_optimizers(self, total: int) -> None:
        """AdamW with a warm-up + decay schedule over ``total`` steps."""
        t = self.trainer
        cfg = self.config
        t._schedule_plan = SchedulePlan(
            cfg.learning_rate, cfg.lr_scheduler, cfg.warmup_steps, total
        )
        t.optimizer = t._make_optimizer(t._schedule_plan)

    def restore(self, path: Path, total: int, steps_per_epoch: int) -> None:
        """:meth:`SupervisedTrainer.load_checkpoint` (which checks that it continues this run)."""
        self.trainer.load_checkpoint(path)

    def open(self, resumed: bool) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def step(self, total: int, steps_per_epoch: int) -> dict[str, Any]:
        """One optimiser step on the epoch's next batch; its record (step, epoch, metrics)."""
        t, state = self.trainer, self.trainer.run
        if self._batches_epoch != state.epoch:
            cfg = self.config
            self._batches = length_bucketed_batches(
                [len(e) for e in self.examples],
                cfg.batch_size,
                window=cfg.bucket_window,
                seed=cfg.seed,
                epoch=state.epoch,
            )
            self._batches_epoch = state.epoch
        batch = self._batches[state.step_in_epoch]
        metrics = t.step([self.examples[i] for i in batch])
        return {"step": state.global_step, "epoch": state.epoch, **metrics}

    def evaluate(self) -> dict[str, float]:
        return self.trainer.evaluate(self.eval_examples)

    def postfix(self, record: Mapping[str, Any]) -> dict[str, str]:
        return self.trainer._postfix(record)

    def save_checkpoint(self) -> Path:
        return self.trainer.save_checkpoint()

    def trained_state(self) -> dict[str, Any]:
        t = self.trainer
        tree: dict[str, Any] = {"model": t.model.parameters()}
        if t.optimizer is not None:
            tree["optimizer"] = t.optimizer.state
        return tree
