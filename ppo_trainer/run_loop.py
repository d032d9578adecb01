"""The RL stage of the one training loop (:class:`training.loop.TrainingLoop`): what one call of
:meth:`PPOTrainer.train` adds to it.

:class:`RLStage` checks the prompts (every rank the same ones) and records their fingerprint,
builds the optimisers over the run's length, checks a checkpoint to resume (an extension that
would train nothing is refused; an environment factory that takes no seed is warned), starts the
``async_rollout`` worker, and gives each step the epoch's next prompt batch (with the batches
dynamic sampling draws beyond it, and the one after it that the worker generates). What the run
changes (the counters, the history, the optimisers ...; its checkpoints hold them) and what the
loop shares with the step (callbacks, the stop request, the worker) is the trainer's ``run``, a
:class:`~ppo_trainer.run_state.RunState`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

import numpy as np

from base_setup import distributed as dist
from base_setup.backend import run_blas_threads
from config.ppo_config import PPOConfig
from ppo_trainer.agent_rollout import AgentRun
from ppo_trainer.gkd import check_completions
from ppo_trainer.prompt_batches import PromptPreparation
from ppo_trainer.prompt_records import Columns, PromptInput
from ppo_trainer.rollout import SamplingSettings
from ppo_trainer.rollout_worker import RolloutWorker, WorkerSpec, worker_blas_threads
from ppo_trainer.run_state import RunState, Trained, ensure_optimizers, trained_tree
from training.callbacks import CallbackLike, as_callbacks
from training.checkpoint import CheckpointManager
from training.fingerprints import data_fingerprint
from training.loop import TrainingLoop
from training.run_control import check_extension_trains

logger = logging.getLogger("ppo_mlx")


class LoopTrainer(Protocol):
    """What :class:`RLStage` needs of the trainer it drives
    (:class:`~ppo_trainer.ppo_trainer.PPOTrainer`): its settings and run state, where it writes,
    and the methods a run calls. The loop changes the run state (``run``) and the recorded
    ``inputs``, nothing else of the trainer; ``preparation`` checks the prompts."""

    config: PPOConfig
    run: RunState
    group: Any
    is_main_process: bool
    run_dir: Path
    checkpoints: CheckpointManager
    agent: AgentRun | None
    inputs: dict[str, str | None]
    sampling: SamplingSettings
    preparation: PromptPreparation

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


class RLStage:
    """A run of ``trainer`` over ``prompts`` as a stage of :class:`~training.loop.TrainingLoop`
    (see :meth:`PPOTrainer.train` for the arguments)."""

    evaluate_first = False
    final_eval_file: str | None = "eval_final.json"
    epoch_ends_at_last_step = True

    def __init__(
        self,
        trainer: LoopTrainer,
        prompts: Sequence[PromptInput],
        num_epochs: int | None,
        eval_prompts: Sequence[PromptInput] | None,
    ) -> None:
        self.trainer = trainer
        self.config = trainer.config
        self.group = trainer.group
        self.is_main_process = trainer.is_main_process
        self.run_dir = trainer.run_dir
        self.checkpoints = trainer.checkpoints
        self.inputs = trainer.inputs
        self.label = trainer.config.algorithm.upper()
        self.prompts = prompts
        self.num_epochs = num_epochs
        self.eval_prompts = eval_prompts
        self._plan: tuple[int, int] | None = None

    @property
    def state(self) -> RunState:
        return self.trainer.run

    @property
    def has_eval(self) -> bool:
        return bool(self.eval_prompts)

    def train(
        self, callbacks: Sequence[CallbackLike] | None, resume_from: str | Path | None
    ) -> list[dict[str, float]]:
        """The whole run (:meth:`TrainingLoop.run`); returns the trainer's per-step history."""
        return TrainingLoop(self, as_callbacks(callbacks)).run(resume_from)

    def check_data(self) -> None:
        """Check every prompt (and that every rank has the same ones), record their fingerprint
        and the run's length."""
        t = self.trainer
        cfg = t.config
        if not self.prompts:
            raise ValueError("train() got an empty prompt list: give at least one prompt")
        epochs = cfg.num_epochs if self.num_epochs is None else self.num_epochs
        if epochs < 1:
            raise ValueError(f"num_epochs must be >= 1, got {epochs}")
        texts, _, columns = t.preparation.prepare(self.prompts, 0, len(self.prompts))
        check_completions(cfg, columns)  # GKD's steps on the data need each prompt's completion
        if self.eval_prompts:
            t.preparation.prepare(self.eval_prompts, 0, len(self.eval_prompts))
        t.preparation.check_reward_call(self.prompts)  # after every column check: a trial call
        dist.check_same_on_all_ranks(
            json.dumps(texts).encode(),
            "the training prompts",
            "give every rank the same prompt file: each rank takes its slice of the same order",
            t.group,
        )
        t.inputs["prompts"] = data_fingerprint(self.prompts)  # checked on resume, recorded
        steps_per_epoch = math.ceil(len(self.prompts) / cfg.batch_size)
        total = epochs * steps_per_epoch
        self._plan = (total, steps_per_epoch)
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
            self._plan = (cfg.total_steps, steps_per_epoch)

    def prepare(self) -> tuple[int, int]:
        """``(total steps, steps per epoch)`` (the prompts need no preparing)."""
        assert self._plan is not None, "check_data() first"
        return self._plan

    def build_optimizers(self, total: int) -> None:
        t = self.trainer
        ensure_optimizers(t.run, t.config, t.trained.value_model is not None, total_steps=total)

    def restore(self, path: Path, total: int, steps_per_epoch: int) -> None:
        """Load the checkpoint at ``path``; an extension that would train nothing of the run's
        ``total`` steps is refused first."""
        t = self.trainer
        state = CheckpointManager.read_state(path)
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

    @contextlib.contextmanager
    def open(self, resumed: bool) -> Iterator[None]:
        """With async_rollout, the generation worker, in the run state while the steps run."""
        if not self.config.async_rollout:
            yield
            return
        with self._start_worker(resumed) as worker:
            self.state.rollout_worker = worker
            try:
                yield
            finally:
                self.state.rollout_worker = None  # the with block ends the worker process

    def step(self, total: int, steps_per_epoch: int) -> dict[str, Any]:
        """One PPO iteration on the epoch's next batch; its metrics with the epoch."""
        t = self.trainer
        drawn = [0]  # extra generation rounds of dynamic sampling, counted
        metrics: dict[str, Any] = t.step(
            self._next_batch(),
            self._batch_after_next(total, steps_per_epoch),
            self._more_prompts(drawn),
        )
        t.run.extra_gen_batches += drawn[0]  # once the step is done: resumes are exact
        metrics["epoch"] = t.run.epoch
        return metrics

    def evaluate(self) -> dict[str, float]:
        """An evaluation during the run, recorded (overrides of evaluate() that call the base
        method record too, without a parameter to pass along); its scalars."""
        t = self.trainer
        assert self.eval_prompts is not None
        t.run.record_eval = t.is_main_process
        try:
            result = t.evaluate(self.eval_prompts)
        finally:
            t.run.record_eval = False
        return {k: v for k, v in result.items() if isinstance(v, float)}

    def postfix(self, record: Mapping[str, Any]) -> dict[str, str]:
        return {
            "reward": f"{record['objective/scores']:.3f}",
            "kl": f"{record['objective/kl']:.3f}",
        }

    def save_checkpoint(self) -> Path:
        return self.trainer.save_checkpoint()

    def trained_state(self) -> dict[str, Any]:
        return trained_tree(self.trainer.run, self.trainer.trained)

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
