"""A PPO run's state: what the loop and the step share while it runs (:class:`RunState`),
what it keeps across a restart and what it leaves behind: its optimisers and their schedule,
the check that a checkpoint belongs to this run, and the trained models on disk."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from base_setup.backend import adapt_blas_threads, run_blas_threads, step_seed
from config.loading import config_to_dict
from config.ppo_config import PPOConfig
from models.policy_model import PolicyModel
from models.value_model import ValueModel
from ppo_trainer.sft_mix import SFTMix
from reward_kl.kl_divergence import AdaptiveKLController, FixedKLController
from reward_kl.reward_normalization import RunningMoments
from training.checkpoint import (
    CheckpointManager,
    atomic_directory,
    check_resume_config,
    load_training_state,
    save_training_state,
    warn_changed_settings,
)
from training.fingerprints import model_fingerprint
from training.callbacks import TrainerCallback
from training.loop import InRunState, LoopState
from training.optimizer import SchedulePlan, make_adamw, resumed_plan

if TYPE_CHECKING:
    from ppo_trainer.rollout_worker import RolloutWorker


@dataclass(kw_only=True)
class RunState(LoopState):
    """What an RL run changes: the trainer's ``run`` attribute, which the loop
    (:class:`training.loop.TrainingLoop`, through :class:`ppo_trainer.run_loop.RLStage`), the
    trainer's :meth:`~ppo_trainer.ppo_trainer.PPOTrainer.step` and its checkpoints
    (:class:`RunCheckpoints`) read and write (the trainer's ``global_step``, ``epoch``, ... are
    its fields, :class:`RunAttributes`). Besides the
    loop's fields (:class:`~training.loop.LoopState`: counters, history, BLAS threads, stop
    request, callbacks), a checkpoint keeps the scores' statistics, the optimisers, their
    schedule and the KL controller; ``rollout_worker`` and ``record_eval`` belong to one call of
    ``train()`` (:meth:`begin` resets them).

    Attributes:
        kl_ctl: the KL coefficient's controller (fixed, or adaptive: it changes).
        extra_gen_batches: prompt batches the epoch's extra generation rounds (dynamic sampling)
            drew beyond one per step: the data order's cursor is ``(step_in_epoch +
            extra_gen_batches) * batch_size``.
        reward_moments: the running statistics of the scores (``normalize_reward``).
        policy_optimizer, value_optimizer: AdamW of each trained model (None until the run or
            its first step builds them).
        lr_plan: the learning-rate schedule, in optimiser updates (None until then).
        rollout_worker: the ``async_rollout`` generation worker, while the run has one.
        record_eval: evaluations write rollout records (the run's periodic evaluations, on the
            main process).
    """

    kl_ctl: FixedKLController | AdaptiveKLController
    extra_gen_batches: int = 0
    reward_moments: RunningMoments = field(default_factory=RunningMoments)
    policy_optimizer: optim.Optimizer | None = None
    value_optimizer: optim.Optimizer | None = None
    lr_plan: SchedulePlan | None = None
    rollout_worker: RolloutWorker | None = None
    record_eval: bool = False

    def begin(self, last_step: int, callbacks: list[TrainerCallback]) -> None:
        """A call of ``train()`` starts: its last step and callbacks, a fresh stop request."""
        super().begin(last_step, callbacks)
        self.rollout_worker, self.record_eval = None, False

    def next_epoch(self) -> None:
        """The prompts' next pass starts (with no extra generation rounds drawn yet)."""
        super().next_epoch()
        self.extra_gen_batches = 0

    def learning_rate(self) -> float:
        """The policy's current learning rate."""
        assert self.policy_optimizer is not None
        return float(np.asarray(self.policy_optimizer.learning_rate))


class RunAttributes:
    """The fields of an RL trainer's run state (its ``run``, a :class:`RunState`) as attributes
    of the trainer: ``trainer.global_step`` reads and writes ``trainer.run.global_step``, and so
    on."""

    run: RunState
    global_step = InRunState[int]()
    epoch = InRunState[int]()
    step_in_epoch = InRunState[int]()
    extra_gen_batches = InRunState[int]()
    history = InRunState[list[dict[str, float]]]()
    reward_moments = InRunState[RunningMoments]()
    kl_ctl = InRunState[FixedKLController | AdaptiveKLController]()
    policy_optimizer = InRunState[optim.Optimizer | None]()
    value_optimizer = InRunState[optim.Optimizer | None]()
    lr_plan = InRunState[SchedulePlan | None]()
    blas_threads = InRunState[int | None]()
    stop_reason = InRunState[str | None]()


#: Settings a checkpoint must share with the run resuming it: the data order, the sampled
#: responses, and the trained parameters (their set and shapes) depend on them.
RESUME_KEYS: tuple[str, ...] = (
    "algorithm",
    "model_name",
    "batch_size",
    "group_size",
    "num_mini_batches",
    "seed",
    "use_lora",
    "lora_r",
    "lora_alpha",
    "lora_layers",
    "lora_keys",
    "value_model_name",
    "value_init",
    "reward_model_name",
    "reward_funcs",
    "dtype",
    "adam_bias_correction",
)


def run_inputs(config: PPOConfig, reward: str | None) -> dict[str, str | None]:
    """The fingerprints of the models a run starts from (local folders) and its ``reward``
    description, as its checkpoints record them (:mod:`training.fingerprints`)."""
    return {
        "model": model_fingerprint(config.model_name),
        "ref_model": model_fingerprint(config.teacher_model_name or config.sft_model_name),
        "value_model": model_fingerprint(config.value_model_name),
        "reward": reward,
    }


def schedule_plan(config: PPOConfig, total_steps: int | None) -> SchedulePlan:
    """The learning-rate schedule of a run of ``total_steps`` iterations, in optimiser updates
    (``num_ppo_epochs * num_mini_batches`` per iteration; ``warmup_steps`` counts iterations)."""
    updates = config.num_ppo_epochs * config.num_mini_batches
    return SchedulePlan(
        learning_rate=config.learning_rate,
        scheduler=config.lr_scheduler,
        warmup_steps=config.warmup_steps * updates,
        total_steps=max((total_steps or config.total_steps or 1000) * updates, 1),
    )


def build_optimizers(
    config: PPOConfig,
    schedule: Callable[[mx.array], mx.array],
    with_value: bool,
    previous: Mapping[str, Any] | None = None,
) -> tuple[optim.Optimizer, optim.Optimizer | None]:
    """AdamW for the policy and (``with_value``) the value model following ``schedule`` (the
    value model's scaled to ``value_learning_rate``), carrying over ``previous`` states
    (``{"policy": ..., "value": ...}``: moments and step counts)."""
    previous = previous or {}

    def adamw(lr: Any) -> optim.Optimizer:
        return make_adamw(
            lr,
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
            bias_correction=config.adam_bias_correction,
            plain=config.plain_mlx,
        )

    policy_optimizer = adamw(schedule)
    if previous.get("policy"):
        policy_optimizer.state = previous["policy"]
    if not with_value:
        return policy_optimizer, None
    ratio = config.value_lr / config.learning_rate

    def value_schedule(step: mx.array) -> mx.array:
        return ratio * schedule(step)

    value_optimizer = adamw(value_schedule if ratio != 1.0 else schedule)
    if previous.get("value"):
        value_optimizer.state = previous["value"]
    return policy_optimizer, value_optimizer


def check_checkpoint(
    path: str | Path, state: Mapping[str, Any], config: PPOConfig, world_size: int
) -> None:
    """Raise ``ValueError`` unless the checkpoint at ``path`` (its JSON ``state``) was written by
    this run: the same :data:`RESUME_KEYS` and the same number of processes."""
    check_resume_config(path, state["config"], config_to_dict(config), RESUME_KEYS)
    saved_world = int(state.get("world_size", 1))
    if saved_world != world_size:
        raise ValueError(
            f"checkpoint {path} was written by a run on {saved_world} process(es) but this "
            f"run has {world_size}: resume with the same number of processes "
            f"(mlx.launch -n {saved_world} ..., or no launcher for 1); each rank's share of "
            "the batch and its minibatch order depend on it"
        )


def save_models(policy: PolicyModel, value_model: ValueModel | None, path: str | Path) -> Path:
    """The policy (a directory mlx-lm loads; adapters only with LoRA) and the value model under
    ``<path>/value_model``, written all or nothing."""
    path = Path(path)
    with atomic_directory(path) as tmp:  # a kill mid-save never leaves half a model
        policy.save_pretrained(tmp)
        if value_model is not None:
            value_model.save_pretrained(tmp / "value_model")
    return path


def load_models(policy: PolicyModel, value_model: ValueModel | None, path: str | Path) -> None:
    """Load what :func:`save_models` wrote into ``policy`` (and ``value_model``), in place."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no saved model at {path}")
    if policy.lora is not None:
        # The policy already carries adapters: overwrite their weights (names are checked).
        adapter_file = path / "adapters.safetensors"
        if not adapter_file.is_file():
            raise FileNotFoundError(
                f"{path} has no adapters.safetensors: this trainer uses LoRA, so load_model "
                "expects the adapter directory written by save_model"
            )
        policy.model.load_weights(str(adapter_file), strict=False)
    else:
        weights: dict[str, mx.array] = {}
        for shard in sorted(path.glob("model*.safetensors")):
            loaded = mx.load(str(shard))
            assert isinstance(loaded, dict)
            weights.update(loaded)
        if not weights:
            raise FileNotFoundError(f"{path} has no model*.safetensors weights to load")
        policy.model.load_weights(list(weights.items()), strict=True)
    if value_model is not None and (path / "value_model").exists():
        value_model.load_pretrained_weights(path / "value_model")


def ensure_optimizers(
    state: RunState, config: PPOConfig, with_value: bool, total_steps: int | None
) -> None:
    """Give the run AdamW optimisers (the value model's too, ``with_value``) with a schedule over
    ``total_steps`` iterations.

    :meth:`PPOTrainer.train` calls it with the run's length, :meth:`PPOTrainer.step` with None
    (which keeps existing optimisers). Rebuilding keeps the moments and step counts.
    """
    if state.policy_optimizer is not None and total_steps is None:
        return
    state.lr_plan = schedule_plan(config, total_steps)
    rebuild_optimizers(state, config, with_value, state.lr_plan.schedule())


def begin_step(state: RunState, config: PPOConfig, with_value: bool) -> None:
    """Before a step's rollout: the optimisers (built at the first step, :func:`ensure_optimizers`),
    the BLAS threads (``PPO_MLX_ADAPTIVE_BLAS=step`` only; else fixed per run), the step's random
    seed (a function of seed and step)."""
    ensure_optimizers(state, config, with_value, total_steps=None)
    adapt_blas_threads()
    mx.random.seed(step_seed(config.seed, state.global_step))


def rebuild_optimizers(
    state: RunState,
    config: PPOConfig,
    with_value: bool,
    schedule: Callable[[mx.array], mx.array],
) -> None:
    """Replace the run's optimisers by ones following ``schedule``, with their states."""
    previous = {
        "policy": state.policy_optimizer.state if state.policy_optimizer else None,
        "value": state.value_optimizer.state if state.value_optimizer else None,
    }
    state.policy_optimizer, state.value_optimizer = build_optimizers(
        config, schedule, with_value, previous
    )


@dataclass(frozen=True)
class Trained:
    """The models a run trains: the policy and (PPO) the value model."""

    policy: nn.Module
    value_model: nn.Module | None = None


def checkpointed(
    state: RunState, trained: Trained
) -> tuple[dict[str, nn.Module], dict[str, optim.Optimizer | None]]:
    """The models and optimisers a checkpoint holds, by name."""
    models: dict[str, nn.Module] = {"policy": trained.policy}
    optimizers = {"policy_optimizer": state.policy_optimizer}
    if trained.value_model is not None:
        models["value"] = trained.value_model
        optimizers["value_optimizer"] = state.value_optimizer
    return models, optimizers


def trained_tree(state: RunState, trained: Trained) -> dict[str, Any]:
    """The models' weights and the optimiser states, by name (what every rank of a
    data-parallel run must hold alike)."""
    models, optimizers = checkpointed(state, trained)
    tree: dict[str, Any] = {name: model.parameters() for name, model in models.items()}
    tree.update({name: opt.state for name, opt in optimizers.items() if opt is not None})
    return tree


@dataclass(frozen=True)
class RunCheckpoints:
    """How a run writes and restores its checkpoints, besides its state and trained models.

    Attributes:
        manager: the checkpoint folders (``<output_dir>/checkpoints``).
        config: the run's settings (recorded; :data:`RESUME_KEYS` compared on resume).
        world_size: the run's data-parallel processes (recorded; compared on resume).
        inputs: the fingerprints of what the run reads (the trainer's ``inputs``, which
            ``train()`` completes with the prompts'), recorded.
        sft_mix: the SFT examples of ``sft_coef`` (None: none), whose cursor is recorded.
    """

    manager: CheckpointManager
    config: PPOConfig
    world_size: int
    inputs: Mapping[str, str | None]
    sft_mix: SFTMix | None

    @classmethod
    def of(
        cls,
        config: PPOConfig,
        world_size: int,
        inputs: Mapping[str, str | None],
        sft_mix: SFTMix | None,
    ) -> RunCheckpoints:
        """The checkpoints of a run with ``config``, under ``<output_dir>/checkpoints`` (the last
        ``keep_last_checkpoints`` of them kept)."""
        root = Path(config.output_dir) / "checkpoints"
        manager = CheckpointManager(root, keep_last=config.keep_last_checkpoints)
        return cls(manager, config, world_size, inputs, sft_mix)

    def save(self, state: RunState, trained: Trained) -> Path:
        """Write the run's checkpoint for its current step: trainable weights and optimiser
        states, and the JSON state (counters and the data cursor, KL controller, history,
        config, number of processes, schedule, BLAS threads, the run's ``inputs``, the scores'
        running statistics, the SFT data cursor); returns its directory."""
        plan = state.lr_plan
        saved = {
            "global_step": state.global_step,
            "epoch": state.epoch,
            "step_in_epoch": state.step_in_epoch,
            "extra_gen_batches": state.extra_gen_batches,
            "kl_controller": state.kl_ctl.state_dict(),
            "history": state.history,
            "config": config_to_dict(self.config),
            "world_size": self.world_size,
            "schedule": plan.to_dict() if plan else None,
            "blas_threads": state.blas_threads,
            "inputs": dict(self.inputs),
            "reward_moments": state.reward_moments.to_dict(),
            "sft_cursor": self.sft_mix.cursor if self.sft_mix is not None else None,
        }
        models, optimizers = checkpointed(state, trained)
        return save_training_state(self.manager, state.global_step, models, optimizers, saved)

    def load(self, state: RunState, trained: Trained, path: str | Path, warn: bool) -> None:
        """Restore what :meth:`save` wrote, after checking that the checkpoint belongs to this
        run (:func:`check_checkpoint`); the SFT data stream continues where it stopped. The
        resumed run takes the checkpoint's BLAS thread count (its matmuls sum in the same
        order) and its learning-rate schedule (continued, not restarted, when the run's length
        changed). ``warn``: log the settings that changed (the main process)."""
        config = self.config
        saved = CheckpointManager.read_state(path)
        check_checkpoint(path, saved, config, self.world_size)
        load_training_state(path, *checkpointed(state, trained))
        state.blas_threads = run_blas_threads(saved.get("blas_threads"))
        kl_note = restore_kl_controller(state.kl_ctl, config, saved)
        state.global_step = int(saved["global_step"])
        state.epoch = int(saved["epoch"])
        state.step_in_epoch = int(saved["step_in_epoch"])
        state.extra_gen_batches = int(saved.get("extra_gen_batches", 0))
        state.history = list(saved["history"])
        moments = saved.get("reward_moments")  # normalize_reward's statistics (none: before them)
        state.reward_moments = RunningMoments.from_dict(moments) if moments else RunningMoments()
        schedule_note = None
        if state.lr_plan is not None and state.policy_optimizer is not None:
            updates = int(np.asarray(state.policy_optimizer.step))
            plan, schedule_note = resumed_plan(saved.get("schedule"), state.lr_plan, updates)
            state.lr_plan = plan  # its checkpoints record the schedule it follows
            rebuild_optimizers(state, config, trained.value_model is not None, plan.schedule())
        if warn:
            warn_changed_settings(
                path, saved["config"], config_to_dict(config), [schedule_note, kl_note]
            )
        if self.sft_mix is not None:
            self.sft_mix.cursor = int(saved.get("sft_cursor") or 0)


def restore_kl_controller(
    ctl: FixedKLController | AdaptiveKLController, config: PPOConfig, state: Mapping[str, Any]
) -> str | None:
    """Restore the KL controller ``ctl`` from a checkpoint's JSON ``state``. An adaptive one
    continues from the coefficient it had reached (its state; ``kl_coef`` is only where it
    started), with the configured ``kl_target`` and ``kl_horizon``; a fixed one is the
    configured ``kl_coef`` (a value changed on resume takes effect), as is an adaptive one
    resumed from a fixed run. Returns a note for the resume's warning when ``kl_coef`` changed
    but the controller keeps its value, else None."""
    saved = state["kl_controller"]
    if not (isinstance(ctl, AdaptiveKLController) and saved.get("type") == "adaptive"):
        return None
    ctl.load_state_dict(dict(saved))
    ctl.target, ctl.horizon = config.kl_target, config.kl_horizon
    if state["config"].get("kl_coef") == config.kl_coef:
        return None
    return f"kl_coef only starts the adaptive KL controller: it continues from {ctl.value:.4g}"
