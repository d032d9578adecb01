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

With ``config.async_rollout``, phase 1 of step k+1 runs in a second process
(:mod:`ppo_trainer.rollout_worker`) during step k's phases 2-6, from the weights of before update
k; its sampling log-probs are phase 2's rollout log-probs (one step off-policy).

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

import logging
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import mlx.core as mx

from base_setup import distributed as dist
from base_setup.tokenizer_setup import encode_text
from config.ppo_config import PPOConfig
from experience_buffer.buffer import RolloutBatch
from models.policy_model import PolicyModel
from models.reward_model import RewardFunction, RewardModel
from models.sft_model import ReferenceModel
from models.value_model import ValueModel
from ppo_trainer.callbacks import CallbackLike
from ppo_trainer.components import build_models, kl_controller
from ppo_trainer.evaluation import Evaluator
from ppo_trainer.experience import ExperienceSettings, experience_phase
from ppo_trainer.metrics import step_metrics, step_timings
from ppo_trainer.prompt_batches import format_chat_prompt
from ppo_trainer.prompt_records import Prompt, PromptInput
from ppo_trainer.rollout import StepPlan
from ppo_trainer.rollout_records import log_step_rollouts
from ppo_trainer.run_loop import RLStage
from ppo_trainer.run_state import (
    RunAttributes,
    RunCheckpoints,
    RunState,
    Trained,
    begin_step,
    load_models,
    save_models,
)
from ppo_trainer.trainer_setup import build_rollout_parts, recorded_inputs, start_run
from ppo_trainer.update import Updater
from training.checkpoint import check_save_target
from training.run_control import in_run_scope

logger = logging.getLogger("ppo_mlx")


class PPOTrainer(RunAttributes):
    """RLHF with PPO (policy, reference, reward and value models), GRPO and the other
    algorithms of ``config.algorithm`` (no value model).

    Args:
        config: the run configuration.
        policy, ref_model, value_model, tokenizer: ready models; default: loaded as ``config``
            says (:func:`~ppo_trainer.components.build_models`).
        reward_model: a :class:`RewardModel` or a function ``(prompts, completions, **columns)
            -> list[float]`` (:mod:`ppo_trainer.prompt_records`); default: as ``config`` says.
        tools, environment_factory: agents' Python functions or :class:`agents.Tool` s, and a
            callable returning a fresh environment per rollout (TRL's contract, docs/agents.md).

    Attributes: ``group`` (``mx.distributed``), ``world_size``, ``rank``, ``is_main_process``;
    ``stop_reason``: why :meth:`train` stopped early (None: it did not); ``inputs``: the
    fingerprints its checkpoints record and a resume compares.
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
        tools: Sequence[Any] | None = None,
        environment_factory: Any = None,
    ) -> None:
        self.config = config
        self.group = dist.world()  # data parallelism (mlx.launch); 1 process without it
        self.world_size, self.rank = self.group.size(), self.group.rank()
        self.is_main_process = self.rank == 0
        self.run_dir = Path(config.output_dir)
        #: Agents (None without tools or environments), checked before any model loads.
        self.agent = start_run(config, self.group, policy is not None, tools, environment_factory)
        # The one place that asks whether compute_scores is overridden (the scorer keeps it).
        overrides = type(self).compute_scores is not PPOTrainer.compute_scores
        models = build_models(
            config,
            policy=policy,
            ref_model=ref_model,
            reward=reward_model,
            value_model=value_model,
            tokenizer=tokenizer,
            custom_scores=overrides
            or (self.agent is not None and self.agent.environment_rewards()),
        )
        self.policy, self.ref_model = models.policy, models.ref_model
        self.value_model, self.tokenizer = models.value_model, models.tokenizer
        # Pad may be an EOS id: masks and the reward's last token come from lengths, never pad.
        self.pad_token_id = int(self.tokenizer.pad_token_id)
        parts = build_rollout_parts(
            config,
            models,
            self,
            owner=type(self) if overrides else None,
            agent=self.agent,
            log_chat=type(self).format_prompt is PPOTrainer.format_prompt and self.is_main_process,
            group=self.group,
            worker=lambda: self.run.rollout_worker,
        )
        #: Phases 1-3, decided once (:class:`~ppo_trainer.trainer_setup.RolloutParts`).
        self.rewards, self.scorer, self.preparation = parts.rewards, parts.scorer, parts.preparation
        self.stop_token_ids, self.chat_prompts = parts.stop_token_ids, parts.chat_prompts
        self.sampling, self.source = parts.sampling, parts.source
        self.experience = ExperienceSettings.from_config(config)  # phase 4's settings
        #: What the run changes and what train()'s loop shares with step() and evaluate();
        #: ``global_step`` and the others are its fields (:class:`RunAttributes`).
        self.run = RunState(kl_ctl=kl_controller(config))
        #: Phase 5: the losses' gradients and the SFT data of sft_coef (checked before any rollout).
        self.updater = Updater(config, models)
        self.inputs = recorded_inputs(config, parts, self.agent)
        self.checkpointing = RunCheckpoints.of(
            config, self.world_size, self.inputs, self.updater.sft_mix
        )
        self.checkpoints = self.checkpointing.manager  # <output_dir>/checkpoints
        self.evaluator = Evaluator(
            self.preparation, self.source, self.sampling, self.experience, self.tokenizer, config
        )

    def format_prompt(self, prompt: Prompt) -> str:
        """Turn one dataset prompt into the text the policy continues; override for a task's own
        format. Default: the chat template with ``config``'s system prompt and variables, for
        text too when :attr:`chat_prompts` (:func:`~ppo_trainer.prompt_batches.format_chat_prompt`).
        """
        cfg = self.config
        return format_chat_prompt(
            prompt, self.tokenizer, self.chat_prompts, cfg.system_prompt, cfg.chat_template_kwargs
        )

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a formatted prompt: BOS (once) when the tokenizer adds one, no others."""
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
    ) -> mx.array | tuple[mx.array, dict[str, mx.array]]:
        """One scalar score per completion, shape (B,), and named scalar metrics logged with the
        step's (``rewards/<name>/mean`` and ``/std`` of several ``reward_funcs``); override for a
        task's own reward (``examples/``), which may return the scores alone. ``prompts``: the
        formatted texts; ``columns``: the prompt records' other fields, aligned with
        ``completions`` (an override receives those it names, or all with ``**columns``).
        Default: the reward model at each sequence's last token, or the reward function(s)."""
        return self.rewards.score(prompts, completions, query_responses, sequence_lengths, columns)

    @in_run_scope
    def step(
        self,
        prompts: Sequence[PromptInput],
        next_prompts: Sequence[PromptInput] | None = None,
        more_prompts: Callable[[int], Sequence[PromptInput]] | None = None,
    ) -> dict[str, float]:
        """One iteration on the global batch of ``batch_size`` prompts (each data-parallel rank
        learns from its share); returns its metrics. :meth:`train` passes ``next_prompts`` (for
        the ``async_rollout`` worker) and ``more_prompts(k)`` (``dynamic_sampling``'s extra
        rounds): :class:`~ppo_trainer.rollout.StepPlan`."""
        cfg = self.config
        sequences, keys = self.preparation.step_share(prompts, self.global_step)
        begin_step(self.run, cfg, self.value_model is not None)
        step = self.global_step + 1
        t0 = time.perf_counter()

        # 1-3. Generate group_size responses per prompt; log-probs, values and scores.
        plan = StepPlan(self.global_step, self.preparation.batch, next_prompts, more_prompts)
        rollout = self.source.rollout(sequences, self.sampling, keys, plan)
        t_rollout = time.perf_counter()
        for cb in self.run.callbacks:
            cb.on_rollout_scored(self, step, rollout)

        # 4. Per-token KL and rewards, advantages and returns (with normalize_reward, from
        # scores normalised by running statistics that take this batch in first).
        moments = self.reward_moments if cfg.normalizes_reward else None
        batch, stats, moments = experience_phase(
            rollout, self.experience, self.kl_ctl.value, moments, step=step, group=self.group
        )
        if moments is not None:
            self.reward_moments = moments
        t_advantages = time.perf_counter()
        if self.is_main_process:  # rank 0 writes the records, when log_rollouts_every says so
            log_step_rollouts(
                self.run_dir, rollout, batch, stats, step, self.run.last_step, cfg, self.tokenizer
            )
        for cb in self.run.callbacks:
            cb.on_rollout_end(self, step, batch)

        # 5. PPO epochs over shuffled minibatches (the order is a function of seed and step).
        update_metrics = self.updater.update(batch, self.run, step, self.group)
        t_update = time.perf_counter()

        # 6. Metrics of the global batch; the adaptive KL coefficient follows the measured KL.
        metrics = step_metrics(rollout, batch, stats, update_metrics, cfg, self.kl_ctl, self.group)
        lr = self.run.learning_rate()
        metrics.update(step_timings(t0, t_rollout, t_advantages, t_update, metrics, lr))
        self.global_step = step
        return metrics

    @property
    def trained(self) -> Trained:
        """The models this trainer trains (the policy; the value model with PPO)."""
        return Trained(self.policy, self.value_model)

    @property
    def reward_model(self) -> RewardModel | None:
        """The reward model, if the reward is one."""
        return self.rewards.model

    @property
    def reward_fn(self) -> RewardFunction | None:
        """The reward function, if the reward is one."""
        return self.rewards.fn

    @in_run_scope
    def train(
        self,
        prompts: Sequence[PromptInput],
        num_epochs: int | None = None,
        callbacks: Sequence[CallbackLike] | None = None,
        eval_prompts: Sequence[PromptInput] | None = None,
        resume_from: str | Path | None = None,
    ) -> list[dict[str, float]]:
        """Run the algorithm over ``prompts`` (text, chat messages, or records ``{"prompt": ...,
        <column>: ...}`` whose other fields reach the reward) for ``num_epochs`` passes (default
        ``config.num_epochs``, capped by ``config.total_steps``); returns the per-step metrics.
        ``callbacks``: :class:`TrainerCallback` objects and/or ``fn(epoch, metrics)``;
        ``eval_prompts``: evaluated every ``config.eval_every`` steps and at the end;
        ``resume_from``: a checkpoint directory or ``"latest"``. Ctrl-C, SIGTERM or SIGHUP stops
        after the current step and saves a checkpoint (:attr:`stop_reason`); a second, at once.
        """
        return RLStage(self, prompts, num_epochs, eval_prompts).train(callbacks, resume_from)

    def request_stop(self, reason: str = "requested by a callback") -> None:
        """Ask :meth:`train` to stop after the current step and save (early stopping)."""
        self.run.stop.request(reason)

    @in_run_scope
    def evaluate(
        self,
        prompts: Sequence[PromptInput],
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        num_samples: int = 4,
    ) -> dict[str, Any]:
        """Mean reward and KL to the reference on ``prompts`` (or records, as in training) from
        the training rollout with the evaluation settings (greedy at temperature 0, default
        ``config.eval_temperature``): ``{"eval/mean_reward", "eval/kl", "eval/response_length",
        "samples": [{"prompt", "completion", "reward"}, ...]}``, recorded during :meth:`train`."""
        records = (self.run_dir, self.global_step) if self.run.record_eval else None
        return self.evaluator.evaluate(prompts, max_new_tokens, temperature, num_samples, records)

    def save_checkpoint(self) -> Path:
        """Write everything needed to continue (atomically) under ``<output_dir>/checkpoints``;
        in a data-parallel run rank 0 writes, the others return the directory it writes."""
        if not self.is_main_process:
            return self.checkpoints.root / f"step_{self.global_step:06d}"
        path = self.checkpointing.save(self.run, self.trained)
        for cb in self.run.callbacks:
            cb.on_save(self, self.global_step, path)
        return path

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore the run's state and trained models from one of its checkpoints; raises
        ``ValueError`` for one written with other settings (``RESUME_KEYS`` of
        :mod:`ppo_trainer.run_state`), another number of processes, or incomplete."""
        self.checkpointing.load(self.run, self.trained, path, warn=self.is_main_process)

    def save_model(self, path: str | Path, overwrite: bool = False) -> Path:
        """Save the trained policy (a directory mlx-lm loads; adapters only with LoRA) and the
        value model under ``<path>/value_model``, all or nothing; only rank 0 writes. Raises
        ``ValueError`` for a file, or a non-empty directory unless ``overwrite`` (or the run's
        own ``<output_dir>/final``)."""
        if not self.is_main_process:
            return Path(path)
        check_save_target(path, overwrite=overwrite, own=self.run_dir / "final")
        return save_models(self.policy, self.value_model, path)

    def load_model(self, path: str | Path) -> None:
        """Load weights saved by :meth:`save_model` into this trainer's policy (and value model)."""
        load_models(self.policy, self.value_model, path)


__all__ = ["PPOTrainer", "Prompt", "PromptInput", "RolloutBatch"]
