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
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

import mlx.core as mx
import mlx.optimizers as optim

from base_setup import distributed as dist
from base_setup import seed_everything
from base_setup.grad_checkpoint import checkpoint_blocks
from base_setup.tokenizer_setup import chat_template_text, encode_text
from config.ppo_config import PPOConfig
from experience_buffer.buffer import RolloutBatch
from models.policy_model import PolicyModel
from models.reward_model import RewardFunction, RewardModel
from models.sft_model import ReferenceModel
from models.value_model import ValueModel
from agents import AgentSettings
from ppo_trainer.agent_rollout import AgentRun, agent_inputs
from ppo_trainer.callbacks import CallbackLike
from ppo_trainer.components import (
    RunModels,
    build_models,
    load_function,
    check_data_parallel_config,
    context_length,
    kl_controller,
    stop_token_ids,
    vocab_size,
)
from ppo_trainer.experience import ExperienceSettings, experience_phase
from ppo_trainer.memory_estimate import check_memory
from ppo_trainer.metrics import step_metrics, step_timings
from ppo_trainer.prompt_records import Prompt, PromptInput
from ppo_trainer.evaluation import evaluate_rollouts
from ppo_trainer.rollout import (
    PromptBatch,
    Rollout,
    SamplingSettings,
    StepPlan,
    rollout_keys,
    warn_if_ended_at_once,
)
from ppo_trainer.rollout_sources import build_rollout_source, check_rollout_features
from ppo_trainer.single_turn import SingleTurn
from ppo_trainer.rollout_records import (
    log_rollouts,
    rollout_arrays,
    rollouts_due,
)
from ppo_trainer.rewards import Rewards
from ppo_trainer.prompt_batches import PromptPreparation, chat_prompts
from ppo_trainer.scorer import Scorer
from ppo_trainer.run_state import (
    RunState,
    begin_step,
    Trained,
    run_inputs,
    load_models,
    load_trainer_state,
    save_models,
    save_trainer_state,
)
from ppo_trainer.run_loop import RLStage
from ppo_trainer.update import Updater
from training.checkpoint import (
    CheckpointManager,
    check_save_target,
)
from training.optimizer import SchedulePlan
from reward_kl.kl_divergence import AdaptiveKLController, FixedKLController
from reward_kl.reward_normalization import RunningMoments
from training.loop import InRunState
from training.run_control import in_run_scope, prepare_run_dir

logger = logging.getLogger("ppo_mlx")


class PPOTrainer:
    """RLHF with PPO (policy, reference, reward and value models) or GRPO (no value model).

    Args:
        config: the run configuration.
        policy: a ready policy; default: loaded from ``config.model_name`` (with LoRA if
            ``config.use_lora``).
        ref_model: a ready reference model; default: the policy's base weights with the adapters
            switched off (LoRA), else a frozen copy of ``config.sft_model_name or config.model_name``;
            none when the run has no KL term (``config.uses_reference_model``).
        reward_model: a :class:`RewardModel` or a function ``(prompts, completions, **columns)
            -> list[float]`` (the columns of prompt records it names, see
            :mod:`ppo_trainer.prompt_records`); default: loaded from ``config.reward_model_name``.
        value_model: a ready value model (PPO only); default: from ``config.value_model_name``, else
            from the reward model checkpoint, else from the policy's backbone.
        tokenizer: default: the policy's tokenizer.
        tools: agents: Python functions (type hints and a Google-style docstring each) or
            :class:`agents.Tool` s the policy may call (TRL's ``tools``); each rollout is then a
            multi-turn episode (docs/agents.md).
        environment_factory: agents: a callable returning a fresh environment per rollout
            (TRL's contract: ``reset(**record)``, public methods as tools, optional
            ``get_reward()``, whose reward is added to the score, or is the score when no
            reward is given). A factory with a ``seed`` parameter is called as
            ``factory(seed=...)``, a seed per rollout from (run seed, step, place in the global
            batch), so that a resumed or data-parallel run builds the same environments.

    Attributes (data parallelism, see the module docstring): ``group`` (the ``mx.distributed``
    group of the launched processes), ``world_size``, ``rank``, ``is_main_process`` (rank 0).
    ``stop_reason``: after :meth:`train`, why it stopped early ("SIGINT", "SIGTERM", or a
    callback's reason), None when it ran to the end. ``inputs``: fingerprints of the models,
    prompts and reward the run reads (:mod:`training.fingerprints`), which its checkpoints record
    and a resume compares.
    """

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
        # Data parallelism (mlx.launch): this process is rank `rank` of `world_size` (1 without
        # the launcher). The collective checks run before anything is loaded or generated.
        self.group = dist.world()
        self.world_size = self.group.size()
        self.rank = self.group.rank()
        self.is_main_process = self.rank == 0
        check_data_parallel_config(config, self.group)
        check_rollout_features(
            config,
            world_size=self.world_size,
            policy_given=policy is not None,
            agents=bool(tools) or environment_factory is not None,
        )
        #: Agents (tools, environments): checked before any model loads; None without them.
        self.agent = AgentRun.build(
            tools, environment_factory, AgentSettings.from_config(config, load_function)
        )
        if policy is None:  # before any model loads: sizes that cannot fit (memory_estimate)
            check_memory(config, self.world_size)
        self.run_dir = Path(config.output_dir)
        if self.is_main_process:  # before any model loads: a folder we cannot write is named
            prepare_run_dir(self.run_dir, resuming=True, overwrite=False)
        seed_everything(config.seed)
        # The one place that asks whether this class overrides compute_scores: the scorer
        # keeps the answer for the run.
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
        if config.gradient_checkpointing:  # the two models trained (a given one, in place)
            for trained in (models.policy, models.value_model):
                if trained is not None:
                    checkpoint_blocks(trained)
        self.policy = models.policy
        self.ref_model = models.ref_model
        self.value_model = models.value_model
        self.tokenizer = models.tokenizer
        # Pad may be an EOS id (as many checkpoints ship it): masks and the reward's last token
        # come from lengths, never from comparing ids with pad.
        self.pad_token_id = int(self.tokenizer.pad_token_id)
        self._build_rollout(models, overrides)
        self.experience = ExperienceSettings.from_config(config)
        #: What the run changes (counters, history, optimisers, the KL controller ...) and
        #: what train()'s loop shares with step() and evaluate() (callbacks, the stop request,
        #: the async_rollout worker ...); ``global_step`` and the others are its fields.
        self.run = RunState(kl_ctl=kl_controller(config))
        self.checkpoints = CheckpointManager(
            self.run_dir / "checkpoints", keep_last=config.keep_last_checkpoints
        )
        #: Phase 5: the losses' gradients and the SFT data of sft_coef (checked before any rollout).
        self.updater = Updater(config, self.policy, self.value_model, self.tokenizer)
        # What the run reads besides its settings, recorded in its checkpoints and compared on
        # resume (train() adds the prompts): the models, the reward, the reward functions'
        # source (edits to their files), the agents' import paths.
        self.inputs: dict[str, str | None] = {
            **run_inputs(config, self.scorer.description),
            "reward_source": self.rewards.source_fingerprint(),
            **agent_inputs(self.agent),
        }

    def _build_rollout(self, models: RunModels, overrides: bool) -> None:
        """Phases 1-3's parts, decided once: the reward and its :class:`Scorer` (``overrides``:
        this class overrides :meth:`compute_scores`), the agents' tokenizer, the stop tokens,
        the prompts' preparation, the sampling and the rollout source."""
        config = self.config
        self.rewards = Rewards(
            models.reward_model, models.reward_fn, models.reward_funcs, config.reward_weights
        )
        #: What scores the responses (phase 3).
        self.scorer = Scorer.build(
            config, self.rewards, self.compute_scores, type(self) if overrides else None
        )
        if self.agent is not None:  # tool_chat_template; one that cannot show tools stops here
            self.agent.prepare_tokenizer(self.tokenizer)  # before the stop tokens: its end of turn
        self.stop_token_ids = stop_token_ids(config, self.tokenizer, vocab_size(self.policy))
        #: Whether plain-text prompts go through the chat template (config.use_chat_template).
        self.chat_prompts = chat_prompts(
            self.tokenizer,
            config.use_chat_template,
            log=type(self).format_prompt is PPOTrainer.format_prompt and self.is_main_process,
        )
        #: How prompts become sequences (format_prompt, encode_prompt, the checks).
        self.preparation = PromptPreparation.from_config(
            config, self.format_prompt, self.encode_prompt, self.scorer, context_length(self.policy)
        )
        self.sampling = SamplingSettings.from_config(config, self.stop_token_ids, self.pad_token_id)
        #: Where the rollouts come from (phases 1-3), training's and evaluation's.
        self.source = build_rollout_source(
            config,
            SingleTurn(
                self.policy, self.ref_model, self.value_model, self.scorer, self.decode_completion
            ),
            agent=self.agent,
            tokenizer=self.tokenizer,
            context_length=context_length(self.policy),
            worker=lambda: self.run.rollout_worker,
        )

    # ------------------------------------------------------------------ task seams
    def format_prompt(self, prompt: Prompt) -> str:
        """Turn one dataset prompt into the text the policy continues.

        Default: chat messages go through the tokenizer's chat template with a generation
        prompt, ``config.system_prompt`` first when they have no system message and
        ``config.chat_template_kwargs`` as the template's variables; text too, as one user
        message, when ``config.use_chat_template`` says so (:attr:`chat_prompts`), else it is
        used as is. Override for a task-specific prompt format.
        """
        if isinstance(prompt, str):
            if not self.chat_prompts:
                return prompt
            prompt = [{"role": "user", "content": prompt}]
        system = self.config.system_prompt
        if system is not None and not (prompt and prompt[0].get("role") == "system"):
            prompt = [{"role": "system", "content": system}, *prompt]
        return chat_template_text(
            self.tokenizer, prompt, template_kwargs=self.config.chat_template_kwargs
        )

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
    ) -> mx.array | tuple[mx.array, dict[str, mx.array]]:
        """One scalar score per completion, shape (B,), and the metrics that go with them.

        ``prompts`` are the formatted prompt texts; ``columns`` the other fields of prompt
        records, each a list aligned with ``completions``. An override receives the columns it
        names as parameters, or all of them with ``**columns`` (none if it names none).

        Returns ``(scores, metrics)``, ``metrics`` named scalars logged with the step's (the
        per-reward ``rewards/<name>/mean`` and ``/std`` of several ``reward_funcs``, else
        empty). An override may return the pair or the scores alone (an array or a list of
        floats); one that calls this method gets the pair and passes the metrics on (a run
        with several rewards warns when they go missing).

        Default: the reward model scores the token ids at each sequence's last token (prompt +
        response up to and including the stop token), or the reward function scores the texts
        (with the columns it accepts). Override to compute a task's own reward (see
        ``examples/``).
        """
        return self.rewards.score(prompts, completions, query_responses, sequence_lengths, columns)

    # ------------------------------------------------------------------ one iteration
    @in_run_scope
    def step(
        self,
        prompts: Sequence[PromptInput],
        next_prompts: Sequence[PromptInput] | None = None,
        more_prompts: Callable[[int], Sequence[PromptInput]] | None = None,
    ) -> dict[str, float]:
        """One iteration on ``batch_size`` prompts (or prompt records), the global batch (each
        data-parallel rank learns from its contiguous share); returns the global batch's metrics.

        ``next_prompts``: the next step's batch, for the ``async_rollout`` worker to generate
        while this step updates; ``more_prompts(k)``: ``dynamic_sampling``'s ``k``-th extra
        round; :meth:`train` passes both (:class:`~ppo_trainer.rollout.StepPlan`).
        """
        cfg = self.config
        sequences, keys = self._step_sequences(prompts)
        begin_step(self.run, cfg, self.value_model is not None)
        step = self.global_step + 1
        t0 = time.perf_counter()

        # 1-3. Generate group_size responses per prompt; log-probs, values and scores.
        plan = StepPlan(self.global_step, self.preparation.batch, next_prompts, more_prompts)
        rollout = self._roll_out(sequences, keys, plan)
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
        self._record_rollouts(rollout, batch, stats, step)
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

    def _record_rollouts(
        self, rollout: Rollout, batch: RolloutBatch, stats: dict[str, mx.array], step: int
    ) -> None:
        """Rank 0 writes the step's rollout records when ``log_rollouts_every`` says so."""
        cfg = self.config
        if self.is_main_process and rollouts_due(step, cfg.log_rollouts_every, self.run.last_step):
            log_rollouts(
                self.run_dir,
                rollout_arrays(rollout, batch, stats, step, cfg.algorithm, cfg.group_size),
                self.tokenizer,
                cfg.rollout_records_per_step,
            )

    def _step_sequences(self, prompts: Sequence[PromptInput]) -> tuple[PromptBatch, mx.array]:
        """This rank's share of a step's global batch of ``prompts``, each ``group_size`` times,
        and their PRNG keys: sequence ``k`` of the global batch samples from key ``k``."""
        cfg = self.config
        if len(prompts) != cfg.batch_size:
            raise ValueError(
                f"step() needs batch_size={cfg.batch_size} prompts, got {len(prompts)}"
            )
        local = cfg.batch_size // self.world_size
        first = self.rank * local
        sequences = self.preparation.batch(prompts, first, first + local)
        keys = rollout_keys(cfg.seed, self.global_step, cfg.rollout_batch_size)
        return sequences, keys[first * cfg.group_size : (first + local) * cfg.group_size]

    def _roll_out(self, sequences: PromptBatch, keys: mx.array, plan: StepPlan) -> Rollout:
        """Phases 1-3 of step ``plan.step + 1`` from the run's source, and the warnings a
        rollout may call for (every response empty; several rewards' metrics missing)."""
        step = plan.step + 1
        try:
            rollout = self.source.rollout(sequences, self.sampling, keys, plan)
        except ValueError as err:  # a reward that is NaN or not numbers: name the step
            raise ValueError(f"step {step}: {err}") from err
        warn_if_ended_at_once(rollout.generation, step, self.config.use_chat_template)
        self.scorer.warn_without_metrics(rollout.reward_metrics)
        return rollout

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

    # ------------------------------------------------------------------ the loop
    @in_run_scope
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

        Ctrl-C, SIGTERM or SIGHUP stops after the current step and saves a checkpoint
        (:attr:`stop_reason` says which); a second one interrupts at once.
        """
        return RLStage(self, prompts, num_epochs, eval_prompts).train(callbacks, resume_from)

    def request_stop(self, reason: str = "requested by a callback") -> None:
        """Ask :meth:`train` to stop after the current step and save a checkpoint (what Ctrl-C
        does); callbacks use it for early stopping."""
        self.run.stop.request(reason)

    # ------------------------------------------------------------------ evaluation
    @in_run_scope
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

        def roll_out(start: int, stop: int) -> tuple[list[str], Rollout]:
            batch = PromptBatch(*self.preparation.prepare(prompts, start, stop))
            return batch.texts, self.source.rollout(batch, sampling, None)

        return evaluate_rollouts(
            roll_out,
            len(prompts),
            num_samples,
            config=cfg,
            experience=self.experience,
            tokenizer=self.tokenizer,
            records_at=(self.run_dir, self.global_step) if self.run.record_eval else None,
        )

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """Write everything needed to continue (atomically) under ``<output_dir>/checkpoints``.

        In a data-parallel run only rank 0 writes (every rank holds the same state); the others
        return the directory rank 0 writes.
        """
        if not self.is_main_process:
            return self.checkpoints.root / f"step_{self.global_step:06d}"
        path = save_trainer_state(
            self.run,
            self.trained,
            self.checkpoints,
            config=self.config,
            world_size=self.world_size,
            inputs=self.inputs,
            sft_cursor=self.updater.sft_mix.cursor if self.updater.sft_mix is not None else None,
        )
        for cb in self.run.callbacks:
            cb.on_save(self, self.global_step, path)
        return path

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore models, optimiser states, KL controller, counters, the schedule and the BLAS
        threads from a checkpoint of this run.

        Raises:
            ValueError: the checkpoint was written with other settings (``RESUME_KEYS`` of
                :mod:`ppo_trainer.run_state`), another number of processes, or is incomplete.
        """
        cursor = load_trainer_state(
            self.run,
            self.trained,
            path,
            config=self.config,
            world_size=self.world_size,
            warn=self.is_main_process,
        )
        if self.updater.sft_mix is not None:  # sft_coef's data stream continues where it stopped
            self.updater.sft_mix.cursor = cursor or 0

    def save_model(self, path: str | Path, overwrite: bool = False) -> Path:
        """Save the trained policy (a directory mlx-lm loads; adapters only with LoRA) and, for
        PPO, the value model under ``<path>/value_model``, all or nothing. Only rank 0 of a
        data-parallel run writes (the weights are the same on every rank).

        Raises:
            ValueError: ``path`` is a file, or a non-empty directory and not ``overwrite``
                (the run's own ``<output_dir>/final`` is replaced).
        """
        if not self.is_main_process:
            return Path(path)
        check_save_target(path, overwrite=overwrite, own=self.run_dir / "final")
        return save_models(self.policy, self.value_model, path)

    def load_model(self, path: str | Path) -> None:
        """Load weights saved by :meth:`save_model` into this trainer's policy (and value model)."""
        load_models(self.policy, self.value_model, path)


__all__ = ["PPOTrainer", "Prompt", "PromptInput", "RolloutBatch"]
