"""PPOTrainer: the RLHF loop (PPO with a value model and GAE, or GRPO), with callbacks and resumable
checkpoints.

One iteration (:meth:`PPOTrainer.step`) reads as the phases of the data flow:

1. generate responses for a batch of prompts (batched, KV cache), truncated after the stop token;
2. log-probs under the rollout policy and the reference model, and values (no gradients);
3. scores (reward model or function), KL per token, per-token rewards;
4. advantages and returns (GAE for PPO, group-relative for GRPO);
5. ``num_ppo_epochs`` passes over shuffled minibatches: clipped policy loss, clipped value loss;
6. KL controller update, metrics, callbacks (checkpoints are written by :meth:`train`).

Customise a task by overriding :meth:`format_prompt`, :meth:`compute_scores` and
:meth:`evaluate` (see ``examples/``), or observe it with callbacks.

Data parallelism (``mlx.launch -n N python main.py train ...``): every rank holds the same models
and receives the same global batch of ``batch_size`` prompts; it generates, scores and computes
log-probs and values for its contiguous share ``batch_size / N`` (phases 1-3 are local). Phase 4
whitens with the statistics of the global batch, phase 5 averages the gradients over the ranks
(token-weighted, so that the update is the one a single process would make on the global
minibatch), and phase 6 logs the metrics of the global batch. Sequence ``k`` of the global rollout
batch samples from its own PRNG key, so the responses do not depend on ``N``. Only rank 0 writes
logs, plots and checkpoints; the ranks' weights stay identical, which :meth:`train` verifies at
its start and end. Callbacks run on every rank (``on_rollout_end`` sees the rank's own share of
the batch; use ``trainer.is_main_process`` to write files).
"""

from __future__ import annotations

import json
import logging
import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from tqdm import tqdm

from advantage.gae_advantage import compute_gae
from advantage.group_advantage import group_advantages
from advantage.whitening import masked_var, masked_whiten
from base_setup import distributed as dist
from base_setup import seed_everything
from base_setup.backend import adapt_blas_threads, step_seed
from base_setup.lora_setup import LoraSettings
from base_setup.tokenizer_setup import chat_template_text, encode_text, eos_token_ids
from config._fields import divisors
from config.loading import config_to_dict
from config.ppo_config import PPOConfig
from experience_buffer.buffer import RolloutBatch, iterate_minibatches, split_micro_batches
from models.policy_model import PolicyModel
from models.reward_model import RewardFunction, RewardModel
from models.sft_model import ReferenceModel
from models.value_model import ValueModel
from ppo_trainer.callbacks import CallbackLike, TrainerCallback, as_callbacks
from training.checkpoint import (
    STATE_FILE,
    CheckpointManager,
    check_resume_config,
    load_training_state,
    save_training_state,
)
from ppo_trainer.generator import GenerationOutput, generate
from training.metrics_logger import PLOT_FILE, MetricsLogger, plot_metrics, read_metrics
from reward_kl.kl_divergence import AdaptiveKLController, FixedKLController, kl_estimate
from reward_kl.reward_computer import apply_missing_eos_penalty, per_token_rewards
from token_attribution.sequences import (
    build_query_responses,
    gather_positions,
    response_positions,
    token_logprobs,
)
from training.optimizer import AdamW, lr_schedule, optimizer_step
from training.policy_loss import grpo_policy_loss, ppo_policy_loss
from training.value_loss import clipped_value_loss

logger = logging.getLogger("ppo_mlx")

Prompt = Union[str, list[dict[str, str]]]
"""A prompt: plain text, or chat messages ``[{"role": ..., "content": ...}, ...]``."""


@dataclass
class Rollout:
    """What phases 1-3 produce for one batch, before advantages (host-side texts included)."""

    prompts: list[str]
    completions: list[str]
    prompt_ids: list[list[int]]
    generation: GenerationOutput
    query_responses: mx.array  # (B, L)
    prompt_lengths: mx.array  # (B,)
    mask: mx.array  # (B, T)
    logprobs: mx.array  # (B, T)
    ref_logprobs: mx.array  # (B, T)
    entropy: mx.array  # (B, T)
    values: mx.array | None  # (B, T)
    scores: mx.array  # (B,)


class PPOTrainer:
    """RLHF with PPO (policy, reference, reward and value models) or GRPO (no value model).

    Args:
        config: the run configuration.
        policy: a ready policy; default: loaded from ``config.model_name`` (with LoRA if
            ``config.use_lora``).
        ref_model: a ready reference model; default: the policy's base weights with the adapters
            switched off (LoRA), else a frozen copy of ``config.sft_model_name or config.model_name``.
        reward_model: a :class:`RewardModel` or a function ``(prompts, completions) -> list[float]``;
            default: loaded from ``config.reward_model_name``.
        value_model: a ready value model (PPO only); default: from ``config.value_model_name``, else
            from the reward model checkpoint, else from the policy's backbone.
        tokenizer: default: the policy's tokenizer.

    Attributes (data parallelism, see the module docstring): ``group`` (the ``mx.distributed``
    group of the launched processes), ``world_size``, ``rank``, ``is_main_process`` (rank 0).
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
        _check_data_parallel_config(config, self.group)
        seed_everything(config.seed)
        lora = LoraSettings.from_model_config(config) if config.use_lora else None
        self.policy = policy or PolicyModel.from_pretrained(
            config.model_name, dtype=config.dtype, lora=lora
        )
        self.policy.check_trainable()  # a quantized model trains through adapters only (QLoRA)
        self.tokenizer = tokenizer if tokenizer is not None else self.policy.tokenizer
        self.ref_model = ref_model or self._build_reference()
        self.reward_model: RewardModel | None = None
        self.reward_fn: RewardFunction | None = None
        if isinstance(reward_model, RewardModel):
            self.reward_model = reward_model
        elif reward_model is not None:
            if not callable(reward_model):
                raise ValueError(
                    "reward_model must be a RewardModel or a function "
                    f"(prompts, completions) -> list[float], got {type(reward_model).__name__}"
                )
            self.reward_fn = reward_model
        elif config.reward_model_name:
            self.reward_model = RewardModel.from_pretrained(
                config.reward_model_name, dtype=config.dtype
            )
        elif type(self).compute_scores is PPOTrainer.compute_scores:
            # A subclass that overrides compute_scores brings its own reward.
            raise ValueError(
                "no reward: pass reward_model=<RewardModel or function (prompts, completions) -> "
                "list[float]>, set reward_model_name in the config, or override compute_scores"
            )
        self.value_model: ValueModel | None = None
        if config.algorithm == "ppo":
            self.value_model = value_model or self._build_value_model()
        # Pad may be an EOS id (as many checkpoints ship it): masks and the reward's last token
        # come from lengths, never from comparing ids with pad.
        self.pad_token_id = int(self.tokenizer.pad_token_id)
        self.stop_token_ids = self._stop_token_ids()
        self.kl_ctl: FixedKLController | AdaptiveKLController = (
            AdaptiveKLController(config.kl_coef, config.kl_target, config.kl_horizon)
            if config.adaptive_kl
            else FixedKLController(config.kl_coef)
        )
        self.global_step = 0
        self.epoch = 0
        self.step_in_epoch = 0
        self.history: list[dict[str, float]] = []
        self.run_dir = Path(config.output_dir)
        self.checkpoints = CheckpointManager(
            self.run_dir / "checkpoints", keep_last=config.keep_last_checkpoints
        )
        self.policy_optimizer: optim.Optimizer | None = None
        self.value_optimizer: optim.Optimizer | None = None
        self._policy_grad = nn.value_and_grad(self.policy, self._policy_loss)
        self._value_grad = (
            nn.value_and_grad(self.value_model, self._value_loss)
            if self.value_model is not None
            else None
        )
        self._stop_requested = False
        self._updating = False
        self._callbacks: list[TrainerCallback] = []

    # ------------------------------------------------------------------ components
    def _build_reference(self) -> ReferenceModel:
        cfg = self.config
        if cfg.use_lora and cfg.ref_model_name == cfg.model_name:
            # Same base weights with the adapters switched off: no second copy in memory.
            return ReferenceModel.from_policy(self.policy)
        return ReferenceModel.from_pretrained(cfg.ref_model_name, dtype=cfg.dtype)

    def _build_value_model(self) -> ValueModel:
        kind, path = self.config.value_source
        if kind == "policy":
            return ValueModel.from_policy_backbone(path, dtype=self.config.dtype)
        return ValueModel.from_pretrained(path, dtype=self.config.dtype)

    def _stop_token_ids(self) -> list[int]:
        if self.config.stop_token_ids is not None:  # [] = never stop early
            return list(self.config.stop_token_ids)
        ids = eos_token_ids(self.tokenizer)
        if not ids:
            raise ValueError(
                "the tokenizer has no EOS token: set stop_token_ids in the config so that "
                "responses can end"
            )
        return ids

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

    def _decode_completions(self, gen: GenerationOutput) -> list[str]:
        """Texts of the generated responses, each without its stop token."""
        ends = (np.array(gen.lengths) - np.array(gen.ended_with_stop).astype(np.int64)).tolist()
        rows = np.array(gen.responses).tolist()
        return [self.decode_completion(row[:end]) for row, end in zip(rows, ends)]

    def compute_scores(
        self,
        prompts: list[str],
        completions: list[str],
        query_responses: mx.array,
        sequence_lengths: mx.array,
    ) -> mx.array:
        """One scalar score per completion, shape (B,).

        Default: the reward model scores the token ids at each sequence's last token (prompt +
        response up to and including the stop token), or the reward function scores the texts.
        Override to compute a task's own reward (see ``examples/``).
        """
        if self.reward_model is not None:
            return self.reward_model.score(query_responses, sequence_lengths)
        assert self.reward_fn is not None
        return mx.array(self.reward_fn(prompts, completions), dtype=mx.float32)

    # ------------------------------------------------------------------ one iteration
    def step(self, prompts: Sequence[Prompt]) -> dict[str, float]:
        """One PPO/GRPO iteration on ``batch_size`` prompts; returns its metrics.

        ``prompts`` is the global batch, the same on every rank of a data-parallel run: each rank
        learns from its contiguous share of ``batch_size / world_size`` prompts, and the metrics
        are those of the global batch.
        """
        cfg = self.config
        if len(prompts) != cfg.batch_size:
            raise ValueError(
                f"step() needs batch_size={cfg.batch_size} prompts, got {len(prompts)}"
            )
        local = cfg.batch_size // self.world_size
        first = self.rank * local
        texts = [self.format_prompt(p) for p in prompts[first : first + local]]
        prompt_ids = [self.encode_prompt(t) for t in texts]
        self._check_prompt_lengths(prompt_ids, texts)
        self._ensure_optimizers(total_steps=None)
        adapt_blas_threads()  # fewer BLAS threads while other processes keep the cores busy
        mx.random.seed(step_seed(cfg.seed, self.global_step))
        t0 = time.perf_counter()

        # 1-3. Generate, score with every model, compute scores.
        group = cfg.group_size
        keys = self._rollout_keys(self.global_step)[first * group : (first + local) * group]
        rollout = self._rollout(
            [t for t in texts for _ in range(group)],
            [p for p in prompt_ids for _ in range(group)],
            keys,
        )
        t_rollout = time.perf_counter()

        # 3-4. Per-token rewards, KL, advantages.
        batch, stats = self._make_batch(rollout)
        t_adv = time.perf_counter()
        return self._learn(rollout, batch, stats, t0, t_rollout, t_adv)

    def _rollout_keys(self, step: int) -> mx.array:
        """One PRNG key per sequence of the global rollout batch, (batch_size * group_size, 2).

        Sequence ``k`` (sample ``k % group_size`` of prompt ``k // group_size``) samples from key
        ``k`` whichever rank generates it, so a data-parallel run draws the responses one process
        would, and a resumed run those of an uninterrupted one.
        """
        seed = int(np.random.default_rng([self.config.seed, step, 2]).integers(2**63))
        return mx.random.split(mx.random.key(seed), self.config.rollout_batch_size)

    def _rollout(
        self, texts: list[str], prompt_ids: list[list[int]], keys: mx.array | None = None
    ) -> Rollout:
        cfg = self.config
        # 1. Generate (batched, KV cache); the generator stops at the stop tokens and pads after.
        gen = generate(
            self.policy,
            prompt_ids,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            stop_token_ids=self.stop_token_ids,
            pad_token_id=self.pad_token_id,
            return_logprobs=True,
            keys=keys,
        )
        num_tokens = gen.responses.shape[1]
        mask = (mx.arange(num_tokens)[None, :] < gen.lengths[:, None]).astype(mx.float32)
        query_responses, prompt_lengths = build_query_responses(
            prompt_ids, gen.responses, self.pad_token_id
        )
        # 2. Log-probs under the rollout policy and the reference, and values: no gradients here.
        # The sampler's log-probs are log_softmax(logits / temperature) of the same weights
        # (eval mode, as here): "forward" recomputes them over whole sequences instead.
        positions = response_positions(prompt_lengths, num_tokens)  # (B, T)
        logprobs, entropy = gen.logprobs, gen.entropy
        if cfg.rollout_logprobs == "forward":
            logprobs, entropy = token_logprobs(
                self.policy.logits_at(query_responses, positions),
                gen.responses,
                cfg.temperature,
                with_entropy=True,
            )
        assert logprobs is not None and entropy is not None
        ref_logprobs, _ = token_logprobs(
            self.ref_model.logits_at(query_responses, positions), gen.responses, cfg.temperature
        )
        values = None
        if self.value_model is not None:
            values = gather_positions(self.value_model(query_responses), positions)
        mx.eval(logprobs, entropy, ref_logprobs, values)

        # 3. Scores of the completions (text without the stop token).
        completions = self._decode_completions(gen)
        scores = self.compute_scores(
            texts, completions, query_responses, prompt_lengths + gen.lengths
        )
        scores = self._validate_scores(scores, len(texts))
        if cfg.missing_eos_penalty is not None:
            scores = apply_missing_eos_penalty(scores, gen.ended_with_stop, cfg.missing_eos_penalty)
        return Rollout(
            texts,
            completions,
            prompt_ids,
            gen,
            query_responses,
            prompt_lengths,
            mask,
            logprobs,
            ref_logprobs,
            entropy,
            values,
            scores,
        )

    def _make_batch(self, r: Rollout) -> tuple[RolloutBatch, dict[str, mx.array]]:
        cfg = self.config
        if cfg.algorithm == "grpo":
            kl = kl_estimate(r.logprobs, r.ref_logprobs, "k3") * r.mask
            advantages = group_advantages(
                r.scores, cfg.group_size, cfg.grpo_advantage_scale, group=self.group
            )
            stats = {"kl": kl, "non_score": -cfg.beta * kl}
            returns = None
        else:
            assert r.values is not None
            kl = kl_estimate(r.logprobs, r.ref_logprobs, cfg.kl_estimator) * r.mask
            rewards, non_score = per_token_rewards(r.scores, kl, r.mask, self.kl_ctl.value)
            if cfg.whiten_rewards:
                rewards = masked_whiten(rewards, r.mask, shift_mean=False, group=self.group)
            advantages, returns = compute_gae(rewards, r.values, r.mask, cfg.gamma, cfg.lam)
            if cfg.whiten_advantages:
                advantages = masked_whiten(advantages, r.mask, group=self.group)
            stats = {"kl": kl, "non_score": non_score}
        batch = RolloutBatch(
            query_responses=r.query_responses,
            prompt_lengths=r.prompt_lengths,
            responses=r.generation.responses,
            mask=r.mask,
            logprobs=r.logprobs,
            ref_logprobs=r.ref_logprobs,
            scores=r.scores,
            advantages=advantages,
            values=r.values,
            returns=returns,
        )
        mx.eval(batch.advantages, batch.returns, stats)
        return batch, stats

    def _learn(
        self,
        r: Rollout,
        batch: RolloutBatch,
        stats: dict[str, mx.array],
        t0: float,
        t_rollout: float,
        t_adv: float,
    ) -> dict[str, float]:
        cfg = self.config
        for cb in self._callbacks:
            cb.on_rollout_end(self, self.global_step + 1, batch)

        # 5. PPO epochs over shuffled minibatches, with gradient accumulation.
        rng = np.random.default_rng([cfg.seed, self.global_step, 1])
        step_metrics: list[dict[str, mx.array]] = []
        self._updating = True
        for _ in range(cfg.num_ppo_epochs):
            for minibatch in iterate_minibatches(batch, cfg.num_mini_batches, rng):
                micro = split_micro_batches(minibatch, cfg.gradient_accumulation_steps)
                assert self.policy_optimizer is not None
                metrics = self._optimizer_step(
                    self.policy, self.policy_optimizer, self._policy_grad, micro, "policy"
                )
                if self.value_model is not None:
                    assert self.value_optimizer is not None and self._value_grad is not None
                    metrics.update(
                        self._optimizer_step(
                            self.value_model, self.value_optimizer, self._value_grad, micro, "val"
                        )
                    )
                step_metrics.append(metrics)
        self._updating = False
        t_update = time.perf_counter()

        # 6. KL controller, metrics of the global batch: per-rank means of rows (equal numbers
        # per rank) and of minibatch metrics (token-weighted in _optimizer_step) average over the
        # ranks, counts add up (one all-reduce); spreads use all-reduced statistics.
        mask = r.mask
        kl_sum = stats["kl"].sum(axis=1)  # (B,)
        non_score_sum = stats["non_score"].sum(axis=1)
        means = {
            "objective/kl": kl_sum.mean(),
            "objective/entropy": (r.entropy * mask).sum(axis=1).mean(),
            "objective/non_score_reward": non_score_sum.mean(),
            "objective/rlhf_reward": (r.scores + non_score_sum).mean(),
            "objective/scores": r.scores.mean(),
            "episode/response_length": r.generation.lengths.astype(mx.float32).mean(),
        }
        for key in step_metrics[0]:
            means[key] = mx.stack([m[key] for m in step_metrics]).mean()
        sums = {
            "val/num_eos_tokens": r.generation.ended_with_stop.astype(mx.float32).sum(),
            "num_generated": mask.sum(),
        }
        result: dict[str, float] = self._reduce_metrics(means, sums)
        num_generated = result.pop("num_generated")
        if cfg.algorithm == "ppo":
            self.kl_ctl.update(result["objective/kl"], cfg.rollout_batch_size)
        out: dict[str, mx.array | float] = {
            "objective/scores_std": mx.sqrt(
                masked_var(r.scores, mx.ones_like(r.scores), unbiased=False, group=self.group)
            ),
            "objective/kl_coef": float(self.kl_ctl.value),
        }
        if batch.values is not None and batch.returns is not None:
            residual_var = _masked_var(batch.returns - batch.values, mask, self.group)
            out["val/explained_variance"] = 1.0 - residual_var / (
                _masked_var(batch.returns, mask, self.group) + 1e-8
            )
        assert self.policy_optimizer is not None
        out["lr"] = self.policy_optimizer.learning_rate
        result.update({k: _to_float(v) if isinstance(v, mx.array) else v for k, v in out.items()})
        t_end = time.perf_counter()
        result.update(
            {
                "avg_reward": result["objective/scores"],
                "time/rollout": t_rollout - t0,
                "time/advantages": t_adv - t_rollout,
                "time/update": t_update - t_adv,
                "time/step": t_end - t0,
                "tokens_per_second": num_generated / max(t_end - t0, 1e-9),
            }
        )
        self.global_step += 1
        return result

    def _reduce_metrics(
        self, means: dict[str, mx.array], sums: dict[str, mx.array]
    ) -> dict[str, float]:
        """Scalar ``means`` averaged over the ranks and ``sums`` added up, as host floats (one
        all-reduce; the local values on one process)."""
        local = mx.stack([*means.values(), *sums.values()]).astype(mx.float32)  # (K,)
        scale = mx.array([1.0 / self.world_size] * len(means) + [1.0] * len(sums))  # (K,)
        values = np.array(dist.all_sum(local, self.group) * scale).tolist()
        return dict(zip([*means, *sums], values))

    def _token_weights(self, micro_batches: list[RolloutBatch]) -> mx.array | None:
        """This rank's gradient weight for each micro-batch in a data-parallel run, shape (n,).

        The losses are means over the action tokens of a micro-batch, and ranks hold different
        numbers of them: a plain mean of the ranks' gradients would weigh a token more on a rank
        with few. With ``w_k = N c_k / sum_r c_{r,k}`` (``c_k``: this rank's action tokens in
        micro-batch ``k``), ``sum_r w_{r,k} g_{r,k} / N`` is the gradient of the token mean over
        the union of the ranks' ``k``-th micro-batches, what one process computes on that global
        micro-batch. None on one process (all weights 1).
        """
        if self.world_size == 1:
            return None
        counts = mx.stack([(mb.mask != 0).sum().astype(mx.float32) for mb in micro_batches])
        return self.world_size * counts / dist.all_sum(counts, self.group)  # (n,)

    def _optimizer_step(
        self,
        model: nn.Module,
        optimizer: optim.Optimizer,
        value_and_grad: Callable[..., Any],
        micro_batches: list[RolloutBatch],
        prefix: str,
    ) -> dict[str, mx.array]:
        """One optimiser step (training.optimizer.optimizer_step): the mean of the micro-batches'
        gradients, averaged over the ranks of a data-parallel run (token-weighted, see
        :meth:`_token_weights`), clipped by global norm, refused if not finite."""
        n = len(micro_batches)
        dp_weights = self._token_weights(micro_batches)  # (n,) or None
        weights: list[float | mx.array] = (
            [1.0 / n] * n if dp_weights is None else [dp_weights[k] / n for k in range(n)]
        )
        metrics = optimizer_step(
            model,
            optimizer,
            value_and_grad,
            micro_batches,
            weights,
            max_grad_norm=self.config.max_grad_norm,
            step=self.global_step + 1,
            what="the policy loss" if prefix == "policy" else "the value loss",
            group=self.group,
        )
        return _rename_loss({f"{prefix}/{k}": v for k, v in metrics.items()}, prefix)

    def _policy_loss(self, policy: nn.Module, mb: RolloutBatch) -> tuple[mx.array, dict]:
        cfg = self.config
        # The model call is inside the differentiated function; every mb.* array is a rollout
        # constant (old log-probs, reference log-probs, advantages): no gradient flows into them.
        positions = response_positions(mb.prompt_lengths, mb.responses.shape[1])  # (b, T)
        logprobs, _ = token_logprobs(
            policy.logits_at(mb.query_responses, positions), mb.responses, cfg.temperature
        )
        if cfg.algorithm == "grpo":
            return grpo_policy_loss(
                logprobs,
                mb.logprobs,
                mb.ref_logprobs,
                mb.advantages,
                mb.mask,
                cfg.clip_epsilon,
                cfg.beta,
            )
        return ppo_policy_loss(logprobs, mb.logprobs, mb.advantages, mb.mask, cfg.clip_epsilon)

    def _value_loss(self, value_model: nn.Module, mb: RolloutBatch) -> tuple[mx.array, dict]:
        cfg = self.config
        assert mb.values is not None and mb.returns is not None
        positions = response_positions(mb.prompt_lengths, mb.responses.shape[1])
        vpred = gather_positions(value_model(mb.query_responses), positions)  # (b, T)
        # mb.values (rollout values) and mb.returns (GAE targets) are constants.
        loss, metrics = clipped_value_loss(
            vpred, mb.values, mb.returns, mb.mask, cfg.cliprange_value
        )
        return cfg.vf_coef * loss, metrics

    # ------------------------------------------------------------------ validation
    def _check_prompt_lengths(self, prompt_ids: list[list[int]], texts: list[str]) -> None:
        cfg = self.config
        context = self._context_length()
        for i, ids in enumerate(prompt_ids):
            if not ids:
                raise ValueError(f"prompt {i} is empty after formatting and tokenisation")
            if len(ids) > cfg.max_prompt_length:
                raise ValueError(
                    f"prompt {i} has {len(ids)} tokens, more than max_prompt_length="
                    f"{cfg.max_prompt_length} ({texts[i][:60]!r}...): shorten it or raise "
                    "max_prompt_length"
                )
            if context is not None and len(ids) + cfg.max_new_tokens > context:
                raise ValueError(
                    f"prompt {i} ({len(ids)} tokens) + max_new_tokens={cfg.max_new_tokens} exceeds "
                    f"the model's context of {context} tokens: shorten the prompt or lower "
                    "max_new_tokens"
                )

    def _context_length(self) -> int | None:
        args = getattr(self.policy.model, "args", None)
        for name in ("max_position_embeddings", "n_positions"):  # n_positions: GPT-2
            value = getattr(args, name, None)
            if value:
                return int(value)
        return None

    def _validate_scores(self, scores: Any, expected: int) -> mx.array:
        scores = (
            mx.array(scores, dtype=mx.float32).reshape(-1)
            if not isinstance(scores, mx.array)
            else scores.astype(mx.float32)
        )
        if scores.size != expected:
            raise ValueError(
                f"the reward returned {scores.size} scores for {expected} completions: it must "
                "return exactly one float per completion"
            )
        scores = scores.reshape(expected)
        finite = np.isfinite(np.array(scores))
        if not finite.all():
            bad = np.flatnonzero(~finite).tolist()
            raise ValueError(
                f"the reward returned non-finite scores (NaN or inf) for completions {bad[:10]}: "
                "fix the reward function or model; no update was made for this batch"
            )
        return scores

    # ------------------------------------------------------------------ the loop
    def train(
        self,
        prompts: Sequence[Prompt],
        num_epochs: int | None = None,
        callbacks: Sequence[CallbackLike] | None = None,
        eval_prompts: Sequence[Prompt] | None = None,
        resume_from: str | Path | None = None,
    ) -> list[dict[str, float]]:
        """Run PPO/GRPO over ``prompts`` for ``num_epochs`` passes; returns the per-step metrics.

        Args:
            prompts: the training prompts (text or chat messages).
            num_epochs: passes over the prompts (default ``config.num_epochs``); each pass is
                ``ceil(len(prompts) / batch_size)`` iterations, capped by ``config.total_steps``.
            callbacks: :class:`TrainerCallback` objects and/or plain ``fn(epoch, metrics)``.
            eval_prompts: evaluated every ``config.eval_every`` steps (and at the end) if given.
            resume_from: a checkpoint directory or ``"latest"``: continue exactly where it stopped.
        """
        cfg = self.config
        if not prompts:
            raise ValueError("train() got an empty prompt list: give at least one prompt")
        epochs = cfg.num_epochs if num_epochs is None else num_epochs
        if epochs < 1:
            raise ValueError(f"num_epochs must be >= 1, got {epochs}")
        texts = [self.format_prompt(p) for p in prompts]
        self._check_prompt_lengths([self.encode_prompt(t) for t in texts], texts)
        dist.check_same_on_all_ranks(
            json.dumps(texts).encode(),
            "the training prompts",
            "give every rank the same prompt file: each rank takes its slice of the same order",
            self.group,
        )
        steps_per_epoch = math.ceil(len(prompts) / cfg.batch_size)
        total = epochs * steps_per_epoch
        if cfg.total_steps is not None:
            total = min(total, cfg.total_steps)
        self._callbacks = as_callbacks(callbacks)
        self._ensure_optimizers(total_steps=total)
        resume_step = None
        if resume_from is not None:
            path = self._resolve_checkpoint(resume_from)
            self.load_checkpoint(path)
            resume_step = self.global_step
            logger.info("resumed from %s at step %d", path, self.global_step)
        self._check_same_weights("at the start of training")
        # Only rank 0 writes logs (the metrics are already those of the global batch).
        metrics_logger = (
            MetricsLogger(
                self.run_dir,
                cfg.log_with,
                config_to_dict(cfg),
                resume_step=resume_step,
                project=cfg.wandb_project,
            )
            if self.is_main_process
            else None
        )
        for cb in self._callbacks:
            cb.on_train_begin(self)
        previous_handler = self._install_interrupt_handler()
        last_saved = self.global_step if resume_step is not None else -1
        epoch_records: list[dict[str, float]] = [
            h for h in self.history if h.get("epoch") == self.epoch
        ]
        bar = tqdm(
            total=total,
            initial=self.global_step,
            desc=cfg.algorithm.upper(),
            disable=not cfg.progress_bar or not self.is_main_process,
            dynamic_ncols=True,
        )
        try:
            while self.global_step < total and not self._stop_requested:
                order = np.random.default_rng([cfg.seed, self.epoch]).permutation(len(prompts))
                start = self.step_in_epoch * cfg.batch_size
                idx = [int(order[(start + k) % len(prompts)]) for k in range(cfg.batch_size)]
                metrics = self.step([prompts[i] for i in idx])
                metrics["epoch"] = self.epoch
                self.step_in_epoch += 1
                if eval_prompts and cfg.eval_every and self.global_step % cfg.eval_every == 0:
                    metrics.update(self._periodic_eval(eval_prompts))
                self.history.append(metrics)
                epoch_records.append(metrics)
                if metrics_logger is not None:
                    metrics_logger.log(self.global_step, metrics)
                for cb in self._callbacks:
                    cb.on_step_end(self, self.global_step, metrics)
                bar.update(1)
                bar.set_postfix(
                    reward=f"{metrics['objective/scores']:.3f}",
                    kl=f"{metrics['objective/kl']:.3f}",
                )
                if self.step_in_epoch == steps_per_epoch or self.global_step == total:
                    self._end_epoch(epoch_records)
                    epoch_records = []
                if cfg.save_every and self.global_step % cfg.save_every == 0:
                    self.save_checkpoint()
                    last_saved = self.global_step
                # Stop on every rank or on none: Ctrl-C or a callback may reach only some.
                self._stop_requested = dist.any_rank(self._stop_requested, self.group)
            if self._stop_requested:
                logger.warning("interrupted: saving a checkpoint at step %d", self.global_step)
            if last_saved != self.global_step:
                self.save_checkpoint()
        except BaseException:
            # A failure between steps (bad reward, bad prompt, Ctrl-C twice) leaves the models at
            # the end of the last completed step: save it so no training is lost, then re-raise.
            if not self._updating and self.global_step > max(last_saved, 0):
                path = self.save_checkpoint()
                logger.error("training stopped by an error; state saved to %s", path)
            raise
        finally:
            bar.close()
            signal.signal(signal.SIGINT, previous_handler)
            if metrics_logger is not None:
                metrics_logger.close()
                records = read_metrics(metrics_logger.path)
                if records:
                    plot_metrics(records, self.run_dir / PLOT_FILE)
        self._check_same_weights("at the end of training")
        if eval_prompts and not self._stop_requested:
            final = self._periodic_eval(eval_prompts)
            if self.is_main_process:
                metrics_logger_final = self.run_dir / "eval_final.json"
                metrics_logger_final.write_text(_json_dumps(final))
        for cb in self._callbacks:
            cb.on_train_end(self, self.history)
        return self.history

    def _resolve_checkpoint(self, resume_from: str | Path) -> Path:
        """The checkpoint to resume from; every rank must find the same one (collective)."""
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
        return path

    def _check_same_weights(self, moment: str) -> None:
        """Raise on every rank unless every rank holds the same models and optimiser states."""
        tree: dict[str, Any] = {"policy": self.policy.parameters()}
        if self.value_model is not None:
            tree["value"] = self.value_model.parameters()
        for name, opt in (
            ("policy_optimizer", self.policy_optimizer),
            ("value_optimizer", self.value_optimizer),
        ):
            if opt is not None:
                tree[name] = opt.state
        dist.check_same_weights(tree, f"the trained state {moment}", self.group)

    def request_stop(self) -> None:
        """Ask :meth:`train` to stop after the current step and save a checkpoint (what Ctrl-C
        does); callbacks use it for early stopping."""
        self._stop_requested = True

    def _end_epoch(self, records: list[dict[str, float]]) -> None:
        keys = [k for k in records[0] if isinstance(records[0][k], (int, float))]
        summary = {k: float(np.mean([r[k] for r in records if k in r])) for k in keys}
        summary["steps"] = float(len(records))
        for cb in self._callbacks:
            cb.on_epoch_end(self, self.epoch, summary)
        self.epoch += 1
        self.step_in_epoch = 0

    def _periodic_eval(self, eval_prompts: Sequence[Prompt]) -> dict[str, float]:
        result = self.evaluate(eval_prompts)
        scalars = {k: v for k, v in result.items() if isinstance(v, float)}
        for cb in self._callbacks:
            cb.on_evaluate(self, self.global_step, scalars)
        return scalars

    def _install_interrupt_handler(self) -> Any:
        self._stop_requested = False
        self._updating = False

        def handler(signum: int, frame: Any) -> None:
            if self._stop_requested:
                raise KeyboardInterrupt
            self._stop_requested = True
            logger.warning("Ctrl-C: finishing this step, then saving a checkpoint (again to abort)")

        try:
            return signal.signal(signal.SIGINT, handler)
        except ValueError:  # not the main thread: leave Ctrl-C alone
            return signal.getsignal(signal.SIGINT)

    def _ensure_optimizers(self, total_steps: int | None) -> None:
        """Build the AdamW optimisers with a schedule over ``total_steps`` iterations.

        Called by :meth:`train` with the run's length (and by :meth:`step` with None, which keeps
        existing optimisers). Rebuilding keeps the moments and step count of the previous ones.
        """
        if self.policy_optimizer is not None and total_steps is None:
            return
        previous = {
            name: opt.state
            for name, opt in (
                ("policy_optimizer", self.policy_optimizer),
                ("value_optimizer", self.value_optimizer),
            )
            if opt is not None
        }
        cfg = self.config
        updates = cfg.num_ppo_epochs * cfg.num_mini_batches
        horizon = max((total_steps or cfg.total_steps or 1000) * updates, 1)
        warmup = cfg.warmup_steps * updates  # warmup_steps counts PPO iterations

        def schedule(lr: float) -> Callable[[mx.array], mx.array]:
            return lr_schedule(lr, cfg.lr_scheduler, warmup, horizon)

        self.policy_optimizer = AdamW(
            learning_rate=schedule(cfg.learning_rate),
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
            bias_correction=cfg.adam_bias_correction,
        )
        if self.value_model is not None:
            lr = cfg.value_learning_rate or cfg.learning_rate
            self.value_optimizer = AdamW(
                learning_rate=schedule(lr),
                eps=cfg.adam_eps,
                weight_decay=cfg.weight_decay,
                bias_correction=cfg.adam_bias_correction,
            )
        if previous:
            self._apply_optimizer_state(previous)

    # ------------------------------------------------------------------ evaluation
    def evaluate(
        self,
        prompts: Sequence[Prompt],
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        num_samples: int = 4,
    ) -> dict[str, Any]:
        """Mean reward and KL to the reference on ``prompts``, with sample completions.

        Generation is greedy when the temperature (default ``config.eval_temperature``) is 0.
        Returns ``{"eval/mean_reward", "eval/kl", "eval/response_length", "samples": [...]}``
        where each sample is ``{"prompt", "completion", "reward"}``.
        """
        cfg = self.config
        if not prompts:
            raise ValueError("evaluate() got an empty prompt list")
        temp = cfg.eval_temperature if temperature is None else temperature
        max_new = max_new_tokens or cfg.eval_tokens
        chunk = cfg.rollout_batch_size
        rewards: list[float] = []
        kls: list[float] = []
        lengths: list[float] = []
        samples: list[dict[str, Any]] = []
        for start in range(0, len(prompts), chunk):
            texts = [self.format_prompt(p) for p in prompts[start : start + chunk]]
            ids = [self.encode_prompt(t) for t in texts]
            self._check_prompt_lengths(ids, texts)
            gen = generate(
                self.policy,
                ids,
                max_new_tokens=max_new,
                temperature=temp,
                top_p=cfg.top_p if temp > 0 else 1.0,
                top_k=cfg.top_k if temp > 0 else 0,
                stop_token_ids=self.stop_token_ids,
                pad_token_id=self.pad_token_id,
            )
            query_responses, prompt_lengths = build_query_responses(
                ids, gen.responses, self.pad_token_id
            )
            mask = (mx.arange(gen.responses.shape[1])[None, :] < gen.lengths[:, None]).astype(
                mx.float32
            )
            positions = response_positions(prompt_lengths, gen.responses.shape[1])  # (B, T)
            logp, _ = token_logprobs(
                self.policy.logits_at(query_responses, positions), gen.responses
            )
            ref, _ = token_logprobs(
                self.ref_model.logits_at(query_responses, positions), gen.responses
            )
            kl = ((logp - ref) * mask).sum(axis=1)
            lens = np.array(gen.lengths)
            completions = self._decode_completions(gen)
            scores = self._validate_scores(
                self.compute_scores(
                    texts, completions, query_responses, prompt_lengths + gen.lengths
                ),
                len(ids),
            )
            rewards.extend(np.array(scores).tolist())
            kls.extend(np.array(kl).tolist())
            lengths.extend(lens.tolist())
            for i in range(len(ids)):
                if len(samples) < num_samples:
                    samples.append(
                        {
                            "prompt": texts[i],
                            "completion": completions[i],
                            "reward": rewards[-len(ids) + i],
                        }
                    )
        return {
            "eval/mean_reward": float(np.mean(rewards)),
            "eval/kl": float(np.mean(kls)),
            "eval/response_length": float(np.mean(lengths)),
            "samples": samples,
        }

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
        }
        path = save_training_state(self.checkpoints, self.global_step, *self._checkpointed(), state)
        for cb in getattr(self, "_callbacks", []):
            cb.on_save(self, self.global_step, path)
        return path

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore models, optimiser states, KL controller and counters from a checkpoint."""
        state = CheckpointManager.read_state(path)
        check_resume_config(
            path,
            state["config"],
            config_to_dict(self.config),
            ("algorithm", "model_name", "batch_size", "group_size", "use_lora", "seed"),
        )
        saved_world = int(state.get("world_size", 1))
        if saved_world != self.world_size:
            raise ValueError(
                f"checkpoint {path} was written by a run on {saved_world} process(es) but this "
                f"run has {self.world_size}: resume with the same number of processes "
                f"(mlx.launch -n {saved_world} ..., or no launcher for 1); each rank's share of "
                "the batch and its minibatch order depend on it"
            )
        load_training_state(path, *self._checkpointed())
        self.kl_ctl.load_state_dict(state["kl_controller"])
        self.global_step = int(state["global_step"])
        self.epoch = int(state["epoch"])
        self.step_in_epoch = int(state["step_in_epoch"])
        self.history = list(state["history"])

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

    def _apply_optimizer_state(self, saved: dict[str, dict[str, mx.array]]) -> None:
        for name, opt in (
            ("policy_optimizer", self.policy_optimizer),
            ("value_optimizer", self.value_optimizer),
        ):
            if opt is not None and name in saved:
                opt.state = saved[name]

    def save_model(self, path: str | Path) -> Path:
        """Save the trained policy (a directory mlx-lm loads; adapters only with LoRA) and, for
        PPO, the value model under ``<path>/value_model``. Only rank 0 of a data-parallel run
        writes (the weights are the same on every rank)."""
        path = Path(path)
        if not self.is_main_process:
            return path
        self.policy.save_pretrained(path)
        if self.value_model is not None:
            self.value_model.save_pretrained(path / "value_model")
        return path

    def load_model(self, path: str | Path) -> None:
        """Load weights saved by :meth:`save_model` into this trainer's policy (and value model)."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"no saved model at {path}")
        if self.policy.lora is not None:
            # The policy already carries adapters: overwrite their weights (names are checked).
            adapter_file = path / "adapters.safetensors"
            if not adapter_file.is_file():
                raise FileNotFoundError(
                    f"{path} has no adapters.safetensors: this trainer uses LoRA, so load_model "
                    "expects the adapter directory written by save_model"
                )
            self.policy.model.load_weights(str(adapter_file), strict=False)
        else:
            weights: dict[str, mx.array] = {}
            for shard in sorted(path.glob("model*.safetensors")):
                weights.update(_load_safetensors(shard))
            if not weights:
                raise FileNotFoundError(f"{path} has no model*.safetensors weights to load")
            self.policy.model.load_weights(list(weights.items()), strict=True)
        if self.value_model is not None and (path / "value_model").exists():
            self.value_model.load_pretrained_weights(path / "value_model")


def _to_float(x: mx.array) -> float:
    """A scalar array as a Python float (one host sync)."""
    return float(np.asarray(x))


def _load_safetensors(path: Path) -> dict[str, mx.array]:
    loaded = mx.load(str(path))
    assert isinstance(loaded, dict)
    return loaded


def _masked_var(x: mx.array, mask: mx.array, group: dist.Group) -> mx.array:
    """Population variance of the valid entries of the global batch (all ranks of ``group``)."""
    return masked_var(x, mask, unbiased=False, group=group)


def _check_data_parallel_config(config: PPOConfig, group: dist.Group) -> None:
    """Start-up checks of a data-parallel run; every rank raises the same ``ValueError``.

    First the configs must agree (hash compared across ranks), so that the checks after it see the
    same numbers everywhere; then the global batch must split evenly over the ranks, and each
    rank's rollout into ``num_mini_batches`` minibatches of ``gradient_accumulation_steps``
    micro-batches.
    """
    n = group.size()
    if n == 1:
        return
    dist.check_same_on_all_ranks(
        json.dumps(config_to_dict(config), sort_keys=True).encode(),
        "the configuration",
        "launch every rank with the same --config file and --set overrides",
        group,
    )
    rollout = config.batch_size // n * config.group_size
    mini = rollout // config.num_mini_batches
    problem = None
    if config.batch_size % n:
        multiple = n * max(1, round(config.batch_size / n))
        problem = (
            f"batch_size={config.batch_size} (the prompts of one iteration, over all ranks) does "
            f"not split evenly over {n} processes: set batch_size to a multiple of {n} (e.g. "
            f"{multiple}) or launch a number of processes that divides it "
            f"({divisors(config.batch_size)})"
        )
    elif rollout % config.num_mini_batches:
        problem = (
            f"each of the {n} processes generates batch_size / {n} * group_size = {rollout} "
            f"sequences, which cannot be split into num_mini_batches={config.num_mini_batches} "
            f"equal minibatches: set num_mini_batches to one of {divisors(rollout)} or raise "
            "batch_size"
        )
    elif mini % config.gradient_accumulation_steps:
        problem = (
            f"each process's minibatch has {rollout} / num_mini_batches="
            f"{config.num_mini_batches} = {mini} sequences, which cannot be split into "
            f"gradient_accumulation_steps={config.gradient_accumulation_steps} equal "
            f"micro-batches: set gradient_accumulation_steps to one of {divisors(mini)}"
        )
    if problem is not None:
        # Same config on every rank, so every rank gets here: all report before any exits.
        dist.fail_together(ValueError(problem), group)


def _rename_loss(metrics: dict[str, mx.array], prefix: str) -> dict[str, mx.array]:
    """``policy/loss`` -> ``loss/policy`` and ``val/loss`` -> ``loss/value`` (TRL's names)."""
    renamed = dict(metrics)
    loss = renamed.pop(f"{prefix}/loss")
    renamed["loss/policy" if prefix == "policy" else "loss/value"] = loss
    return renamed


def _json_dumps(obj: Any) -> str:
    import json

    return json.dumps(obj, indent=1)
