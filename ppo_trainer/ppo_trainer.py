"""PPOTrainer: the RLHF loop (PPO with a value model and GAE, or GRPO), with callbacks and resumable
checkpoints.

One iteration (:meth:`PPOTrainer.step`) reads as the phases of the data flow, each a module:

1-3. :mod:`ppo_trainer.rollout`: generate responses (batched, KV cache), then log-probs under the
     rollout policy and the reference, values, and scores (reward model or function);
4.   :mod:`ppo_trainer.experience`: per-token KL and rewards, advantages and returns (GAE for PPO,
     group-relative for GRPO);
5.   :mod:`ppo_trainer.update`: ``num_ppo_epochs`` passes over shuffled minibatches (clipped
     policy loss, clipped value loss);
6.   :mod:`ppo_trainer.metrics`: the KL controller and the metrics (checkpoints, logs and
     callbacks are :meth:`PPOTrainer.train`'s).

:meth:`PPOTrainer.evaluate` runs the same rollout (phases 1-3) with the evaluation settings.
Customise a task by overriding :meth:`format_prompt`, :meth:`compute_scores` and
:meth:`evaluate` (see ``examples/``), or observe it with callbacks. A prompt may be a record
``{"prompt": ..., <column>: ...}`` whose other columns reach the reward
(:mod:`ppo_trainer.prompt_records`).

Data parallelism (``mlx.launch -n N python main.py train ...``): every rank holds the same models
and receives the same global batch of ``batch_size`` prompts; it generates, scores and computes
log-probs and values for its contiguous share ``batch_size / N`` (phases 1-3 are local). Phase 4
whitens with the statistics of the global batch, phase 5 averages the gradients over the ranks
(token-weighted, so that the update is the one a single process would make on the global
minibatch), and phase 6 logs the metrics of the global batch. Sequence ``k`` of the global rollout
batch samples from its own PRNG key, so the responses do not depend on ``N``. Only rank 0 writes
logs, plots and checkpoints; the ranks' weights stay identical, which :meth:`PPOTrainer.train`
verifies at its start and end. Callbacks run on every rank (``on_rollout_end`` sees the rank's own
share of the batch; use ``trainer.is_main_process`` to write files).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from base_setup import distributed as dist
from base_setup import seed_everything
from base_setup.backend import adapt_blas_threads, run_blas_threads, step_seed
from base_setup.tokenizer_setup import chat_template_text, encode_text
from config.loading import config_to_dict
from config.ppo_config import PPOConfig
from experience_buffer.buffer import RolloutBatch
from models.policy_model import PolicyModel
from models.reward_model import RewardFunction, RewardModel
from models.sft_model import ReferenceModel
from models.value_model import ValueModel
from ppo_trainer.callbacks import CallbackLike, TrainerCallback, as_callbacks
from ppo_trainer.components import (
    build_models,
    check_data_parallel_config,
    context_length,
    stop_token_ids,
)
from ppo_trainer.experience import (
    KL_IN_REWARD,
    ExperienceSettings,
    kl_per_token,
    make_experience,
)
from ppo_trainer.generator import GenerationOutput
from ppo_trainer.metrics import iteration_metrics, reduce_over_ranks
from ppo_trainer.prompt_records import (
    Columns,
    Prompt,
    PromptInput,
    columns_for,
    repeat_columns,
    slice_columns,
    split_records,
)
from ppo_trainer.rollout import Rollout, SamplingSettings, check_prompts, collect_rollout
from ppo_trainer.rollout_records import (
    RolloutArrays,
    Source,
    log_rollouts,
    rollout_records,
    rollouts_due,
    select_rows,
    write_rollout_records,
)
from ppo_trainer.run_state import (
    build_optimizers,
    check_checkpoint,
    load_models,
    save_models,
    schedule_plan,
)
from ppo_trainer.update import (
    Learner,
    policy_loss_fn,
    policy_weighting,
    ppo_epochs,
    value_loss_fn,
)
from reward_kl.combined_reward import combine_rewards, reward_matrix, reward_metrics
from reward_kl.kl_divergence import AdaptiveKLController, FixedKLController
from training.checkpoint import (
    STATE_FILE,
    CheckpointManager,
    load_training_state,
    save_training_state,
)
from training.optimizer import SchedulePlan, resumed_schedule
from training.run_control import RunLog, StopSignals, prepare_run_dir, save_after_failure

logger = logging.getLogger("ppo_mlx")


class PPOTrainer:
    """RLHF with PPO (policy, reference, reward and value models) or GRPO (no value model).

    Args:
        config: the run configuration.
        policy: a ready policy; default: loaded from ``config.model_name`` (with LoRA if
            ``config.use_lora``).
        ref_model: a ready reference model; default: the policy's base weights with the adapters
            switched off (LoRA), else a frozen copy of ``config.sft_model_name or config.model_name``.
        reward_model: a :class:`RewardModel` or a function ``(prompts, completions, **columns)
            -> list[float]`` (the columns of prompt records it names, see
            :mod:`ppo_trainer.prompt_records`); default: loaded from ``config.reward_model_name``.
        value_model: a ready value model (PPO only); default: from ``config.value_model_name``, else
            from the reward model checkpoint, else from the policy's backbone.
        tokenizer: default: the policy's tokenizer.

    Attributes (data parallelism, see the module docstring): ``group`` (the ``mx.distributed``
    group of the launched processes), ``world_size``, ``rank``, ``is_main_process`` (rank 0).
    ``stop_reason``: after :meth:`train`, why it stopped early ("SIGINT", "SIGTERM", or a
    callback's reason), None when it ran to the end.
    """

    def __init__(
        self,
        config: PPOConfig,
        *,
        policy: PolicyModel | None = None,
        ref_model: ReferenceModel | None = None,
        reward_model: RewardModel | RewardFunction | None = None,
        value_model: ValueModel | None = None,
        tokenizer: Any = None,
    ) -> None:
        self.config = config
        # Data parallelism (mlx.launch): this process is rank `rank` of `world_size` (1 without
        # the launcher). The collective checks run before anything is loaded or generated.
        self.group = dist.world()
        self.world_size = self.group.size()
        self.rank = self.group.rank()
        self.is_main_process = self.rank == 0
        check_data_parallel_config(config, self.group)
        self.run_dir = Path(config.output_dir)
        if self.is_main_process:  # before any model loads: a folder we cannot write is named
            prepare_run_dir(self.run_dir, resuming=True, overwrite=False)
        seed_everything(config.seed)
        models = build_models(
            config,
            policy=policy,
            ref_model=ref_model,
            reward=reward_model,
            value_model=value_model,
            tokenizer=tokenizer,
            custom_scores=type(self).compute_scores is not PPOTrainer.compute_scores,
        )
        self.policy = models.policy
        self.ref_model = models.ref_model
        self.reward_model = models.reward_model
        self.reward_fn = models.reward_fn
        self.value_model = models.value_model
        self.tokenizer = models.tokenizer
        self.reward_funcs = models.reward_funcs
        self._reward_metrics: dict[str, mx.array] = {}
        # Pad may be an EOS id (as many checkpoints ship it): masks and the reward's last token
        # come from lengths, never from comparing ids with pad.
        self.pad_token_id = int(self.tokenizer.pad_token_id)
        self.stop_token_ids = stop_token_ids(config, self.tokenizer)
        self.sampling = SamplingSettings(
            max_new_tokens=config.max_new_tokens,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            stop_token_ids=self.stop_token_ids,
            pad_token_id=self.pad_token_id,
            logprobs_from=config.rollout_logprobs,
        )
        self.experience = ExperienceSettings.from_config(config)
        self.kl_ctl: FixedKLController | AdaptiveKLController = (
            AdaptiveKLController(config.kl_coef, config.kl_target, config.kl_horizon)
            if config.adaptive_kl
            else FixedKLController(config.kl_coef)
        )
        self.global_step = 0
        self.epoch = 0
        self.step_in_epoch = 0
        self.history: list[dict[str, float]] = []
        self.checkpoints = CheckpointManager(
            self.run_dir / "checkpoints", keep_last=config.keep_last_checkpoints
        )
        self.policy_optimizer: optim.Optimizer | None = None
        self.value_optimizer: optim.Optimizer | None = None
        self._policy_grad = nn.value_and_grad(self.policy, policy_loss_fn(config))
        self._value_grad = (
            nn.value_and_grad(self.value_model, value_loss_fn(config))
            if self.value_model is not None
            else None
        )
        self._stop = StopSignals()
        self.stop_reason: str | None = None
        self._updating = False
        self._callbacks: list[TrainerCallback] = []
        self._schedule_plan: SchedulePlan | None = None
        self._last_step: int | None = None  # the run's last step, while train() runs
        self._record_eval = False  # evaluate() writes rollout records (periodic evaluations)
        self.blas_threads: int | None = None  # OpenBLAS threads of this run (run_blas_threads)

    # ------------------------------------------------------------------ task seams
    def format_prompt(self, prompt: Prompt) -> str:
        """Turn one dataset prompt into the text the policy continues.

        Default: text is used as is; chat messages go through the tokenizer's chat template with a
        generation prompt. Override for a task-specific prompt format.
        """
        if isinstance(prompt, str):
            return prompt
        return chat_template_text(self.tokenizer, prompt)

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a formatted prompt: the tokenizer's BOS first when it adds one (not twice
        when the text starts with it), no other special tokens."""
        return encode_text(self.tokenizer, text)

    def decode_completion(self, tokens: Sequence[int]) -> str:
        """Text of a response's tokens (the stop token excluded by the caller)."""
        return str(self.tokenizer.decode(list(tokens), skip_special_tokens=True))

    def compute_scores(
        self,
        prompts: list[str],
        completions: list[str],
        query_responses: mx.array,
        sequence_lengths: mx.array,
        **columns: list[Any],
    ) -> mx.array:
        """One scalar score per completion, shape (B,).

        ``prompts`` are the formatted prompt texts; ``columns`` the other fields of prompt
        records, each a list aligned with ``completions``. An override receives the columns it
        names as parameters, or all of them with ``**columns`` (none if it names none).

        Default: the reward model scores the token ids at each sequence's last token (prompt +
        response up to and including the stop token), or the reward function scores the texts
        (with the columns it accepts). Override to compute a task's own reward (see
        ``examples/``).
        """
        if self.reward_funcs:
            return self._combined_scores(
                prompts, completions, query_responses, sequence_lengths, columns
            )
        if self.reward_model is not None:
            return self.reward_model.score(query_responses, sequence_lengths)
        assert self.reward_fn is not None
        scores = self.reward_fn(
            prompts, completions, **columns_for(self.reward_fn, columns, positional=2)
        )
        return check_scores_of(scores, len(completions), self._score_source())

    # ------------------------------------------------------------------ one iteration
    def step(self, prompts: Sequence[PromptInput]) -> dict[str, float]:
        """One PPO/GRPO iteration on ``batch_size`` prompts (or prompt records); returns its
        metrics.

        ``prompts`` is the global batch, the same on every rank of a data-parallel run: each rank
        learns from its contiguous share of ``batch_size / world_size`` prompts (and their
        columns), and the metrics are those of the global batch.
        """
        cfg = self.config
        if len(prompts) != cfg.batch_size:
            raise ValueError(
                f"step() needs batch_size={cfg.batch_size} prompts, got {len(prompts)}"
            )
        local = cfg.batch_size // self.world_size
        first = self.rank * local
        texts, prompt_ids, columns = self._prepare_prompts(prompts, first, first + local)
        self._ensure_optimizers(total_steps=None)
        adapt_blas_threads()  # only with PPO_MLX_ADAPTIVE_BLAS=step (else fixed per run)
        mx.random.seed(step_seed(cfg.seed, self.global_step))
        step = self.global_step + 1
        t0 = time.perf_counter()

        # 1-3. Generate group_size responses per prompt; log-probs, values and scores.
        group = cfg.group_size
        keys = self._rollout_keys(self.global_step)[first * group : (first + local) * group]
        rollout = self._rollout(
            [t for t in texts for _ in range(group)],
            [p for p in prompt_ids for _ in range(group)],
            repeat_columns(columns, group),
            self.sampling,
            keys,
        )
        t_rollout = time.perf_counter()

        # 4. Per-token KL and rewards, advantages and returns.
        batch, stats = make_experience(
            rollout, self.experience, self.kl_ctl.value, step=step, group=self.group
        )
        t_advantages = time.perf_counter()
        if self.is_main_process and rollouts_due(step, cfg.log_rollouts_every, self._last_step):
            log_rollouts(
                self.run_dir,
                self._rollout_arrays(rollout, batch, stats, step),
                self.tokenizer,
                cfg.rollout_records_per_step,
            )
        for cb in self._callbacks:
            cb.on_rollout_end(self, step, batch)

        # 5. PPO epochs over shuffled minibatches (the order is a function of seed and step).
        self._updating = True
        update_metrics = ppo_epochs(
            batch,
            self._learners(),
            num_ppo_epochs=cfg.num_ppo_epochs,
            num_mini_batches=cfg.num_mini_batches,
            gradient_accumulation_steps=cfg.gradient_accumulation_steps,
            max_grad_norm=cfg.max_grad_norm,
            rng=np.random.default_rng([cfg.seed, self.global_step, 1]),
            step=step,
            group=self.group,
        )
        self._updating = False
        t_update = time.perf_counter()

        # 6. Metrics of the global batch; the adaptive KL coefficient follows the measured KL.
        metrics = iteration_metrics(rollout, batch, stats, update_metrics, self.group)
        if self._reward_metrics:  # several rewards: each one's mean and spread
            metrics.update(reduce_over_ranks(self._reward_metrics, {}, self.group))
            self._reward_metrics = {}
        if cfg.algorithm in KL_IN_REWARD:
            self.kl_ctl.update(metrics["objective/kl"], cfg.rollout_batch_size)
        t_end = time.perf_counter()
        assert self.policy_optimizer is not None
        metrics.update(
            {
                "objective/kl_coef": float(self.kl_ctl.value),
                "lr": float(np.asarray(self.policy_optimizer.learning_rate)),
                "avg_reward": metrics["objective/scores"],
                "time/rollout": t_rollout - t0,
                "time/advantages": t_advantages - t_rollout,
                "time/update": t_update - t_advantages,
                "time/step": t_end - t0,
                "tokens_per_second": metrics.pop("num_generated") / max(t_end - t0, 1e-9),
            }
        )
        self.global_step = step
        self.last_rollout = (rollout, batch, stats)
        return metrics

    def _rollout_arrays(
        self,
        rollout: Rollout,
        batch: RolloutBatch,
        stats: dict[str, mx.array],
        step: int,
        source: Source = "train",
    ) -> RolloutArrays:
        """What the rollout records (:mod:`ppo_trainer.rollout_records`) are made of."""
        return RolloutArrays(
            step=step,
            algorithm=self.config.algorithm,
            prompts=rollout.texts,
            query_responses=batch.query_responses,
            prompt_lengths=batch.prompt_lengths,
            responses=batch.responses,
            mask=batch.mask,
            ended_with_stop=rollout.generation.ended_with_stop,
            scores=batch.scores,
            logprobs=batch.logprobs,
            ref_logprobs=batch.ref_logprobs,
            kl=stats["kl"],
            entropy=rollout.entropy,
            values=batch.values,
            rewards=stats.get("rewards"),
            advantages=batch.advantages if source == "train" else None,
            returns=batch.returns,
            group_size=self.config.group_size if source == "train" else 1,
            source=source,
        )

    def _prepare_prompts(
        self, prompts: Sequence[PromptInput], start: int, stop: int
    ) -> tuple[list[str], list[list[int]], Columns]:
        """Prompts ``start:stop`` formatted and encoded, with their columns, checked (columns
        the reward needs, lengths) before any generation."""
        plain, all_columns = split_records(prompts)
        self._check_columns(all_columns)
        texts = [self.format_prompt(p) for p in plain[start:stop]]
        prompt_ids = [self.encode_prompt(t) for t in texts]
        check_prompts(
            prompt_ids,
            texts,
            max_prompt_length=self.config.max_prompt_length,
            max_new_tokens=max(self.config.max_new_tokens, self.config.eval_tokens),
            context_length=context_length(self.policy),
        )
        return texts, prompt_ids, slice_columns(all_columns, start, stop)

    def _rollout(
        self,
        texts: list[str],
        prompt_ids: list[list[int]],
        columns: Columns,
        sampling: SamplingSettings,
        keys: mx.array | None = None,
        with_values: bool = True,
    ) -> Rollout:
        """Phases 1-3 with this trainer's models and reward (training and evaluation)."""

        def score(completions: list[str], query_responses: mx.array, lengths: mx.array) -> Any:
            return self.compute_scores(
                texts,
                completions,
                query_responses,
                lengths,
                **columns_for(self.compute_scores, columns, positional=4),
            )

        return collect_rollout(
            self.policy,
            self.ref_model,
            self.value_model if with_values else None,
            texts,
            prompt_ids,
            sampling,
            decode=self._decode_completions,
            score=score,
            score_source=self._score_source(),
            keys=keys,
        )

    def _rollout_keys(self, step: int) -> mx.array:
        """One PRNG key per sequence of the global rollout batch, (batch_size * group_size, 2).

        Sequence ``k`` (sample ``k % group_size`` of prompt ``k // group_size``) samples from key
        ``k`` whichever rank generates it, so a data-parallel run draws the responses one process
        would, and a resumed run those of an uninterrupted one.
        """
        seed = int(np.random.default_rng([self.config.seed, step, 2]).integers(2**63))
        return mx.random.split(mx.random.key(seed), self.config.rollout_batch_size)

    def _decode_completions(self, gen: GenerationOutput) -> list[str]:
        """Texts of the generated responses, each without its stop token."""
        ends = (np.array(gen.lengths) - np.array(gen.ended_with_stop).astype(np.int64)).tolist()
        rows = np.array(gen.responses).tolist()
        return [self.decode_completion(row[:end]) for row, end in zip(rows, ends)]

    def _learners(self) -> list[Learner]:
        """The value model (PPO), then the policy: the models are independent, and a value loss
        that overflows (huge rewards) then stops the step before the policy has moved."""
        assert self.policy_optimizer is not None
        learners = [
            Learner(
                self.policy,
                self.policy_optimizer,
                self._policy_grad,
                "policy",
                policy_weighting(self.config),
            )
        ]
        if self.value_model is not None:
            assert self.value_optimizer is not None and self._value_grad is not None
            value = Learner(self.value_model, self.value_optimizer, self._value_grad, "val")
            learners.insert(0, value)
        return learners

    def _combined_scores(
        self,
        prompts: list[str],
        completions: list[str],
        query_responses: mx.array,
        sequence_lengths: mx.array,
        columns: Columns,
    ) -> mx.array:
        """``reward_funcs`` weighted by ``reward_weights`` (a function's None: not applicable);
        each one's mean and spread go to the step's metrics as ``rewards/<name>/...``."""
        names = [name for name, _ in self.reward_funcs]
        values: list[list[float | None]] = []
        for name, reward in self.reward_funcs:
            if isinstance(reward, RewardModel):
                values.append(np.asarray(reward.score(query_responses, sequence_lengths)).tolist())
            else:
                out = reward(prompts, completions, **columns_for(reward, columns, positional=2))
                values.append(list(out))
        matrix = reward_matrix(values, names, len(completions))  # (K, B)
        self._reward_metrics = reward_metrics(matrix, names)
        weights = self.config.reward_weights or [1.0] * len(names)
        return combine_rewards(matrix, weights)

    def _check_columns(self, columns: Columns) -> None:
        """Raise ValueError before any generation if the reward needs a column that the
        prompts do not carry."""
        columns_for(self.compute_scores, columns, positional=4)
        if self.reward_fn is not None:
            columns_for(self.reward_fn, columns, positional=2)
        for _, reward in self.reward_funcs:
            if not isinstance(reward, RewardModel):
                columns_for(reward, columns, positional=2)

    def _score_source(self) -> str:
        if type(self).compute_scores is not PPOTrainer.compute_scores:
            return f"{type(self).__name__}.compute_scores"
        if self.reward_fn is not None:
            return f"the reward function {getattr(self.reward_fn, '__qualname__', self.reward_fn)}"
        if self.reward_funcs:
            return "the combined reward_funcs"
        return "the reward model"

    # ------------------------------------------------------------------ the loop
    def train(
        self,
        prompts: Sequence[PromptInput],
        num_epochs: int | None = None,
        callbacks: Sequence[CallbackLike] | None = None,
        eval_prompts: Sequence[PromptInput] | None = None,
        resume_from: str | Path | None = None,
    ) -> list[dict[str, float]]:
        """Run PPO/GRPO over ``prompts`` for ``num_epochs`` passes; returns the per-step metrics.

        Args:
            prompts: the training prompts: text, chat messages, or records ``{"prompt": ...,
                <column>: ...}`` whose other fields reach the reward (see
                :meth:`compute_scores`).
            num_epochs: passes over the prompts (default ``config.num_epochs``); each pass is
                ``ceil(len(prompts) / batch_size)`` iterations, capped by ``config.total_steps``.
            callbacks: :class:`TrainerCallback` objects and/or plain ``fn(epoch, metrics)``.
            eval_prompts: evaluated every ``config.eval_every`` steps (and at the end) if given.
            resume_from: a checkpoint directory or ``"latest"``: continue exactly where it stopped.

        Ctrl-C or SIGTERM stops after the current step and saves a checkpoint
        (:attr:`stop_reason` says which); a second one interrupts at once.
        """
        cfg = self.config
        # Check the prompts, the run folder and the checkpoint before any step.
        total, steps_per_epoch = self._plan_run(prompts, num_epochs, eval_prompts)
        self._last_step = total
        self._callbacks = as_callbacks(callbacks)
        self._check_run_dir(resuming=resume_from is not None)
        self._ensure_optimizers(total_steps=total)
        resume_step = self._resume(resume_from) if resume_from is not None else None
        if resume_step is None:  # a resumed run takes its checkpoint's count (load_checkpoint)
            self.blas_threads = run_blas_threads()
        self._check_same_weights("at the start of training")
        for cb in self._callbacks:
            cb.on_train_begin(self)
        last_saved = self.global_step if resume_step is not None else -1
        run_log = RunLog(
            self.run_dir,
            cfg,
            total=total,
            initial=self.global_step,
            desc=cfg.algorithm.upper(),
            writes=self.is_main_process,
            resume_step=resume_step,
        )
        self._stop = StopSignals()
        with self._stop, run_log:
            try:
                while self.global_step < total and not self._stop.requested:
                    metrics = self.step(self._next_batch(prompts))
                    self._record(metrics, steps_per_epoch, total, eval_prompts, run_log)
                    if cfg.save_every and self.global_step % cfg.save_every == 0:
                        self.save_checkpoint()
                        last_saved = self.global_step
                    # Stop on every rank or on none: a signal or a callback may reach only some.
                    if dist.any_rank(self._stop.requested, self.group):
                        self._stop.request(self._stop.reason or "another rank stopped")
                if self._stop.requested:
                    logger.warning("stopped (%s) at step %d", self._stop.reason, self.global_step)
                if last_saved != self.global_step:
                    self.save_checkpoint()
            except BaseException as err:
                if save_after_failure(err, self._updating, self.global_step, last_saved):
                    self.save_checkpoint()
                raise
        self.stop_reason = self._stop.reason
        self._check_same_weights("at the end of training")
        if eval_prompts and not self._stop.requested:
            final = self._periodic_eval(eval_prompts)
            if self.is_main_process:
                (self.run_dir / "eval_final.json").write_text(json.dumps(final, indent=1))
        for cb in self._callbacks:
            cb.on_train_end(self, self.history)
        return self.history

    def _plan_run(
        self,
        prompts: Sequence[PromptInput],
        num_epochs: int | None,
        eval_prompts: Sequence[PromptInput] | None,
    ) -> tuple[int, int]:
        """``(total steps, steps per epoch)`` of a run over ``prompts``, after checking every
        prompt (and that every rank has the same ones)."""
        cfg = self.config
        if not prompts:
            raise ValueError("train() got an empty prompt list: give at least one prompt")
        epochs = cfg.num_epochs if num_epochs is None else num_epochs
        if epochs < 1:
            raise ValueError(f"num_epochs must be >= 1, got {epochs}")
        texts, _, _ = self._prepare_prompts(prompts, 0, len(prompts))
        if eval_prompts:
            self._prepare_prompts(eval_prompts, 0, len(eval_prompts))
        dist.check_same_on_all_ranks(
            json.dumps(texts).encode(),
            "the training prompts",
            "give every rank the same prompt file: each rank takes its slice of the same order",
            self.group,
        )
        steps_per_epoch = math.ceil(len(prompts) / cfg.batch_size)
        total = epochs * steps_per_epoch
        return (min(total, cfg.total_steps) if cfg.total_steps else total), steps_per_epoch

    def _check_run_dir(self, resuming: bool) -> None:
        """A fresh run must not reuse a folder that holds another run (collective)."""
        error: ValueError | None = None
        if self.is_main_process:
            try:
                prepare_run_dir(
                    self.run_dir, resuming=resuming, overwrite=self.config.overwrite_output_dir
                )
            except ValueError as err:
                error = err
        dist.raise_if_any_rank_failed(error, f"checking output_dir {self.run_dir}", self.group)

    def _next_batch(self, prompts: Sequence[PromptInput]) -> list[PromptInput]:
        """The prompts of the next step: the epoch's permutation (a function of seed and epoch),
        wrapping around at the end of the prompt list."""
        cfg = self.config
        order = np.random.default_rng([cfg.seed, self.epoch]).permutation(len(prompts))
        start = self.step_in_epoch * cfg.batch_size
        return [prompts[int(order[(start + k) % len(prompts)])] for k in range(cfg.batch_size)]

    def _record(
        self,
        metrics: dict[str, float],
        steps_per_epoch: int,
        total: int,
        eval_prompts: Sequence[PromptInput] | None,
        run_log: RunLog,
    ) -> None:
        """After a step: evaluation when due, history, metrics.jsonl, callbacks, progress bar,
        the end of an epoch."""
        cfg = self.config
        metrics["epoch"] = self.epoch
        self.step_in_epoch += 1
        if eval_prompts and cfg.eval_every and self.global_step % cfg.eval_every == 0:
            metrics.update(self._periodic_eval(eval_prompts))
        self.history.append(metrics)
        postfix = {
            "reward": f"{metrics['objective/scores']:.3f}",
            "kl": f"{metrics['objective/kl']:.3f}",
        }
        run_log.log(self.global_step, metrics, postfix)
        for cb in self._callbacks:
            cb.on_step_end(self, self.global_step, metrics)
        if self.step_in_epoch == steps_per_epoch or self.global_step == total:
            self._end_epoch()

    def _end_epoch(self) -> None:
        records = [h for h in self.history if h.get("epoch") == self.epoch]
        keys = [k for k in records[0] if isinstance(records[0][k], (int, float))]
        summary = {k: float(np.mean([r[k] for r in records if k in r])) for k in keys}
        summary["steps"] = float(len(records))
        for cb in self._callbacks:
            cb.on_epoch_end(self, self.epoch, summary)
        self.epoch += 1
        self.step_in_epoch = 0

    def _resume(self, resume_from: str | Path) -> int:
        """Load the checkpoint to resume from (every rank the same one); returns its step."""
        path: Path | None = None
        error: FileNotFoundError | None = None
        try:
            path = self.checkpoints.resolve(resume_from)
        except FileNotFoundError as err:
            error = err
        dist.raise_if_any_rank_failed(error, f"finding the checkpoint {resume_from}", self.group)
        assert path is not None
        dist.check_same_on_all_ranks(
            (path / STATE_FILE).read_bytes(),
            f"the checkpoint {path}",
            "every rank must read the same checkpoint: keep output_dir on storage that every "
            "machine shares, or copy it to the same path on each",
            self.group,
        )
        self.load_checkpoint(path)
        logger.info("resumed from %s at step %d", path, self.global_step)
        return self.global_step

    def _check_same_weights(self, moment: str) -> None:
        """Raise on every rank unless every rank holds the same models and optimiser states."""
        models, optimizers = self._checkpointed()
        tree: dict[str, Any] = {name: model.parameters() for name, model in models.items()}
        tree.update({name: opt.state for name, opt in optimizers.items() if opt is not None})
        dist.check_same_weights(tree, f"the trained state {moment}", self.group)

    def request_stop(self, reason: str = "requested by a callback") -> None:
        """Ask :meth:`train` to stop after the current step and save a checkpoint (what Ctrl-C
        does); callbacks use it for early stopping."""
        self._stop.request(reason)

    def _periodic_eval(self, eval_prompts: Sequence[PromptInput]) -> dict[str, float]:
        # Evaluations during training are recorded (overrides of evaluate() that call the base
        # method record too, without a parameter to pass along).
        self._record_eval = self.is_main_process
        try:
            result = self.evaluate(eval_prompts)
        finally:
            self._record_eval = False
        scalars = {k: v for k, v in result.items() if isinstance(v, float)}
        for cb in self._callbacks:
            cb.on_evaluate(self, self.global_step, scalars)
        return scalars

    def _ensure_optimizers(self, total_steps: int | None) -> None:
        """Build the AdamW optimisers with a schedule over ``total_steps`` iterations.

        Called by :meth:`train` with the run's length (and by :meth:`step` with None, which keeps
        existing optimisers). Rebuilding keeps the moments and step count of the previous ones.
        """
        if self.policy_optimizer is not None and total_steps is None:
            return
        self._schedule_plan = schedule_plan(self.config, total_steps)
        self._build_optimizers(self._schedule_plan.schedule())

    def _build_optimizers(self, schedule: Callable[[mx.array], mx.array]) -> None:
        previous = {
            "policy": self.policy_optimizer.state if self.policy_optimizer else None,
            "value": self.value_optimizer.state if self.value_optimizer else None,
        }
        self.policy_optimizer, self.value_optimizer = build_optimizers(
            self.config, schedule, self.value_model is not None, previous
        )

    # ------------------------------------------------------------------ evaluation
    def evaluate(
        self,
        prompts: Sequence[PromptInput],
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        num_samples: int = 4,
    ) -> dict[str, Any]:
        """Mean reward and KL to the reference on ``prompts`` (or prompt records, whose columns
        reach the reward as in training), with sample completions. During :meth:`train`, up to
        ``rollout_records_per_step`` of them go to ``rollouts/step_NNNNNN_eval.jsonl``.

        Runs the training rollout (phases 1-3) with the evaluation settings: generation is greedy
        when the temperature (default ``config.eval_temperature``) is 0, and log-probs are taken
        at that temperature (1 when greedy), the KL with the training's estimator.
        Returns ``{"eval/mean_reward", "eval/kl", "eval/response_length", "samples": [...]}``
        where each sample is ``{"prompt", "completion", "reward"}``.
        """
        cfg = self.config
        if not prompts:
            raise ValueError("evaluate() got an empty prompt list")
        sampling = replace(
            self.sampling,
            max_new_tokens=max_new_tokens or cfg.eval_tokens,
            temperature=cfg.eval_temperature if temperature is None else temperature,
            logprobs_from="sampling",
        )
        rewards: list[float] = []
        kls: list[float] = []
        lengths: list[float] = []
        samples: list[dict[str, Any]] = []
        records: list[dict[str, Any]] = []
        record = self._record_eval
        for start in range(0, len(prompts), cfg.rollout_batch_size):
            stop = min(start + cfg.rollout_batch_size, len(prompts))
            texts, ids, columns = self._prepare_prompts(prompts, start, stop)
            rollout = self._rollout(texts, ids, columns, sampling, with_values=False)
            kl_tokens = kl_per_token(rollout, self.experience)  # (B, T)
            kl = kl_tokens.sum(axis=1)  # (B,)
            room = cfg.rollout_records_per_step - len(records)
            if record and room > 0:
                batch = self._eval_batch(rollout)
                arrays = self._rollout_arrays(
                    rollout, batch, {"kl": kl_tokens}, self.global_step, "eval"
                )
                rows = select_rows(len(texts), 1, room)
                records += rollout_records(arrays, self.tokenizer, rows)
            rewards.extend(np.array(rollout.scores).tolist())
            kls.extend(np.array(kl).tolist())
            lengths.extend(np.array(rollout.generation.lengths).tolist())
            samples += [
                {"prompt": t, "completion": c, "reward": r}
                for t, c, r in zip(texts, rollout.completions, rewards[start:stop])
            ][: max(num_samples - len(samples), 0)]
        if record:
            write_rollout_records(self.run_dir, self.global_step, records, "eval")
        return {
            "eval/mean_reward": float(np.mean(rewards)),
            "eval/kl": float(np.mean(kls)),
            "eval/response_length": float(np.mean(lengths)),
            "samples": samples,
        }

    @staticmethod
    def _eval_batch(rollout: Rollout) -> RolloutBatch:
        """An evaluation rollout as a batch (no advantages: nothing learns from it)."""
        return RolloutBatch(
            query_responses=rollout.query_responses,
            prompt_lengths=rollout.prompt_lengths,
            responses=rollout.generation.responses,
            mask=rollout.mask,
            logprobs=rollout.logprobs,
            ref_logprobs=rollout.ref_logprobs,
            scores=rollout.scores,
            advantages=mx.zeros_like(rollout.scores),
        )

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """Write everything needed to continue (atomically) under ``<output_dir>/checkpoints``.

        In a data-parallel run only rank 0 writes (every rank holds the same state); the others
        return the directory rank 0 writes.
        """
        if not self.is_main_process:
            return self.checkpoints.root / f"step_{self.global_step:06d}"
        state = {
            "global_step": self.global_step,
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "kl_controller": self.kl_ctl.state_dict(),
            "history": self.history,
            "config": config_to_dict(self.config),
            "world_size": self.world_size,
            "schedule": self._schedule_plan.to_dict() if self._schedule_plan else None,
            "blas_threads": self.blas_threads,
        }
        path = save_training_state(self.checkpoints, self.global_step, *self._checkpointed(), state)
        for cb in self._callbacks:
            cb.on_save(self, self.global_step, path)
        return path

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore models, optimiser states, KL controller and counters from a checkpoint.

        Raises:
            ValueError: the checkpoint was written with other settings (:data:`RESUME_KEYS`),
                another number of processes, or is incomplete.
        """
        state = CheckpointManager.read_state(path)
        check_checkpoint(path, state, self.config, self.world_size)
        load_training_state(path, *self._checkpointed())
        # The checkpoint's BLAS thread count: resumed matmuls sum in the same order.
        self.blas_threads = run_blas_threads(state.get("blas_threads"))
        self.kl_ctl.load_state_dict(state["kl_controller"])
        self.global_step = int(state["global_step"])
        self.epoch = int(state["epoch"])
        self.step_in_epoch = int(state["step_in_epoch"])
        self.history = list(state["history"])
        if self._schedule_plan is not None and self.policy_optimizer is not None:
            updates = int(np.asarray(self.policy_optimizer.step))
            self._build_optimizers(
                resumed_schedule(state.get("schedule"), self._schedule_plan, updates)
            )

    def _checkpointed(
        self,
    ) -> tuple[dict[str, nn.Module], dict[str, optim.Optimizer | None]]:
        """The models and optimisers a checkpoint holds, by name."""
        models: dict[str, nn.Module] = {"policy": self.policy}
        optimizers = {"policy_optimizer": self.policy_optimizer}
        if self.value_model is not None:
            models["value"] = self.value_model
            optimizers["value_optimizer"] = self.value_optimizer
        return models, optimizers

    def save_model(self, path: str | Path) -> Path:
        """Save the trained policy (a directory mlx-lm loads; adapters only with LoRA) and, for
        PPO, the value model under ``<path>/value_model``, all or nothing. Only rank 0 of a
        data-parallel run writes (the weights are the same on every rank)."""
        if not self.is_main_process:
            return Path(path)
        return save_models(self.policy, self.value_model, path)

    def load_model(self, path: str | Path) -> None:
        """Load weights saved by :meth:`save_model` into this trainer's policy (and value model)."""
        load_models(self.policy, self.value_model, path)


def check_scores_of(scores: Any, expected: int, source: str) -> mx.array:
    """A reward's scores as a (B,) float32 array (see :func:`ppo_trainer.rollout.check_scores`)."""
    from ppo_trainer.rollout import check_scores

    return check_scores(scores, expected, source)


__all__ = ["PPOTrainer", "Prompt", "PromptInput", "RolloutBatch"]
