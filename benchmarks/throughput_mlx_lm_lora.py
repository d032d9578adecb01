"""The mlx-lm-lora side of ``benchmarks.ppo_throughput --compare peers``: GRPO iterations of
mlx-lm-lora (``pip install mlx-lm-lora==5.10.2``) on the same checkpoints and settings as the MLX
side.

What runs: the body of mlx-lm-lora's ``train_grpo`` loop, one iteration per call, in a loop this
module controls, with its own functions from ``mlx_lm_lora.trainer.grpo_trainer``:

1. ``generate_grpo``: mlx-lm's ``BatchGenerator`` with a KV cache (each prompt prefilled once and
   its cache forked for the ``group_size`` completions), ``make_sampler(temperature=1.0,
   top_p=1.0, top_k=0, min_p=0.0)``, i.e. plain temperature-1 sampling as on the MLX side;
2. ``_rollout_rewards``: the reward function below, then group-normalised advantages (NumPy);
3. ``_grpo_value_and_grad`` over ``nn.value_and_grad(policy, grpo_loss)``: the reference
   log-probs and the policy's forward + backward, with ``beta`` 0.04 (k3 KL to the reference),
   ``grpo_loss_type="grpo"``, token-level importance sampling;
4. the rest of ``train_grpo``'s ``step`` (world size 1, no gradient accumulation): the
   finiteness check of loss and gradients, ``average_gradients`` (the identity on one process),
   one ``optim.AdamW(learning_rate=1e-6)`` update (mlx-lm-lora's ``--optimizer adamw``), and
   ``mx.eval`` of model, optimizer and random state.

Its validation, report printing and adapter saving, which ``train_grpo`` interleaves, do not run.

Set up as the MLX side is:

* policy and reference: ``mlx_lm.load(spec.policy_dir)`` twice, float32; the reference frozen
  (mlx-lm-lora's ``load_reference_model``). Full-weight training: no LoRA layers (what
  mlx-lm-lora's ``--train-type full`` gives: ``mlx_lm_lora.utils.from_pretrained`` with no LoRA
  config).
* prompts: ``spec.prompts[:batch_size]``, encoded without special tokens (as the MLX side does;
  no chat template), passed as the batch tuple ``iterate_grpo_batches`` yields.
* exactly ``max_new_tokens`` tokens per completion: ``generate_grpo`` stops at the tokenizer's
  ``eos_token_ids`` and at the encoding of ``end_token``; the worker empties the first (its own
  tokenizer object) and passes ``end_token=""``, so ``BatchGenerator`` gets no stop sequences and
  ends each completion at ``max_tokens``. Every completion's length is checked after generation.
* reward: mlx-lm-lora's reward functions take texts, ``(prompts, completions, answer, types) ->
  floats``. The one given here re-encodes each prompt and completion text (separately, so that
  no token merges across the boundary) and scores all ``rollout_size`` sequences with one
  batched forward pass of this project's :class:`~models.reward_model.RewardModel` from
  ``spec.reward_dir``, right-padded, at each row's last token.

Timers (the ``split``): ``generation`` is the ``generate_grpo`` call; ``scoring`` is the reward
function plus the reference log-probs, for which ``grpo_trainer._get_token_logps`` is wrapped:
called with the reference model, the wrapper evaluates its result where ``grpo_loss`` asks for it
(without this, MLX would evaluate it lazily with the policy's backward pass; the work is the same,
with one more synchronisation per microbatch; on the tiny configuration the median iteration
did not change beyond noise). ``update`` is the rest of step 3 and step 4;
``other`` is the remainder of the iteration (advantages, batch preparation, the length check).

How its work differs from the MLX side's:

* mlx-lm-lora's gradient step always splits the ``batch_size * group_size`` sequences into
  microbatches of ``batch_size`` rows (``_grpo_value_and_grad`` with ``chunk_size =
  len(prompts)``), accumulating gradients with one ``mx.eval`` each, before its one optimizer
  step: the same loss and gradient as one minibatch of the whole group batch, in
  ``group_size`` smaller passes.
* it computes no rollout ("old") log-probs: its importance ratio is ``exp(logp -
  stop_gradient(logp))``, on-policy by construction (one epoch); the MLX side takes them from
  sampling, so neither side spends a forward pass on them.
* the reward sees re-tokenised text (mlx-lm-lora's reward API), so a sequence it scores may have
  a few tokens more or fewer than prompt + ``max_new_tokens``; the MLX side scores the sampled ids.
* ``optim.AdamW`` with mlx's default ``weight_decay=0.01`` (mlx-lm-lora passes no weight decay);
  the MLX side uses decoupled weight decay 0. The same cost per step.
* advantages divide by the population std of the group (the MLX side: Bessel-corrected); the
  loss averages tokens per sequence, then sequences ("grpo"); a few scalar operations apart.
"""

from __future__ import annotations

import time
from types import ModuleType
from typing import Any, Sequence, cast

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from benchmarks.throughput_spec import (
    GRPO_BETA,
    SPLIT_KEYS,
    CpuMonitor,
    RunResult,
    RunSpec,
    package_versions,
    peak_rss_mb,
)
from models.reward_model import RewardModel

#: The mlx-lm-lora release this worker was written against (it calls private functions).
MLX_LM_LORA_REQUIREMENT = "mlx-lm-lora==5.10.2"
LEARNING_RATE = 1e-6


def _grpo_module() -> ModuleType:
    """``mlx_lm_lora.trainer.grpo_trainer``, with an install hint when it is missing."""
    try:
        from mlx_lm_lora.trainer import grpo_trainer
    except ImportError as err:
        raise ImportError(
            f"the mlx-lm-lora worker needs mlx-lm-lora: pip install {MLX_LM_LORA_REQUIREMENT}"
        ) from err
    return grpo_trainer


def _load_lm(path: str) -> tuple[nn.Module, Any]:
    """An mlx-lm causal LM and its tokenizer, float32, weights evaluated."""
    from mlx_lm import load

    model, tokenizer = cast(tuple[nn.Module, Any], load(path))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model, tokenizer


def _reward_function(
    reward_model: RewardModel, tokenizer: Any, pad_token_id: int, seconds: dict[str, float]
) -> Any:
    """An mlx-lm-lora reward function that scores prompt + completion with ``reward_model``,
    all completions in one forward pass; its wall time accumulates in ``seconds["reward"]``."""

    def reward_model_score(
        prompts: Sequence[str], completions: Sequence[str], **_: Any
    ) -> list[float]:
        start = time.perf_counter()
        rows = [
            list(tokenizer.encode(p, add_special_tokens=False))
            + list(tokenizer.encode(c, add_special_tokens=False))
            for p, c in zip(prompts, completions)
        ]
        width = max(len(r) for r in rows)
        ids = mx.array(
            [r + [pad_token_id] * (width - len(r)) for r in rows], dtype=mx.int32
        )  # (B, L), right-padded
        scores = reward_model.score(ids, [len(r) for r in rows])  # (B,)
        values = cast(list[float], scores.tolist())  # evaluates
        seconds["reward"] += time.perf_counter() - start
        return values

    return reward_model_score


def run_mlx_lm_lora(spec: RunSpec) -> RunResult:
    """Time ``spec.warmup + spec.iterations`` GRPO iterations of mlx-lm-lora (see the module
    docstring for what runs and how it differs from the MLX side)."""
    if spec.system != "mlx-lm-lora":
        raise ValueError(f"run_mlx_lm_lora runs system 'mlx-lm-lora', got {spec.system!r}")
    grpo = _grpo_module()
    mx.random.seed(spec.seed)

    policy, tokenizer = _load_lm(spec.policy_dir)
    ref_model, _ = _load_lm(spec.policy_dir)
    ref_model.freeze()  # mlx-lm-lora's load_reference_model
    ref_model.eval()
    policy.train()
    # No stop tokens: generate_grpo stops at tokenizer.eos_token_ids (a setter of mlx-lm's
    # TokenizerWrapper; this object is ours alone) and at end_token, passed as "".
    tokenizer.eos_token_ids = []
    pad_token_id = tokenizer.pad_token_id
    if pad_token_id is None:
        raise ValueError(f"the tokenizer of {spec.policy_dir} has no pad token to pad rewards with")
    reward_model = RewardModel.from_pretrained(spec.reward_dir, dtype="float32")

    prompts = list(spec.prompts[: spec.batch_size])
    prompt_tokens = [list(tokenizer.encode(p, add_special_tokens=False)) for p in prompts]
    # (prompt tokens, answer tokens, prompt texts, answer texts, types): iterate_grpo_batches'
    # batch; the answers are unused by the reward below.
    batch: tuple[list[list[int]], list[list[int]], list[str], list[str], None] = (
        prompt_tokens,
        [[] for _ in prompts],
        prompts,
        ["" for _ in prompts],
        None,
    )
    args = grpo.GRPOTrainingArgs(
        batch_size=spec.batch_size,
        iters=spec.warmup + spec.iterations,
        group_size=spec.group_size,
        beta=GRPO_BETA,
        max_completion_length=spec.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
    )
    epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    optimizer = optim.AdamW(learning_rate=LEARNING_RATE)
    loss_value_and_grad = nn.value_and_grad(policy, grpo.grpo_loss)
    parts = {"reference": 0.0, "reward": 0.0}
    reward_funcs = [_reward_function(reward_model, tokenizer, int(pad_token_id), parts)]

    original_token_logps = grpo._get_token_logps

    def timed_token_logps(
        model: nn.Module, inputs: mx.array, mask: mx.array, start: int = 0
    ) -> Any:
        if model is not ref_model:
            return original_token_logps(model, inputs, mask, start)
        began = time.perf_counter()
        logps = original_token_logps(model, inputs, mask, start)
        mx.eval(logps)  # no gradient reaches the reference: a constant of the loss
        parts["reference"] += time.perf_counter() - began
        return logps

    def iteration() -> dict[str, float]:
        for key in parts:
            parts[key] = 0.0
        start = time.perf_counter()
        completions, texts, indices = grpo.generate_grpo(
            model=policy,
            tokenizer=tokenizer,
            prompt_tokens=prompt_tokens,
            max_tokens=args.max_completion_length,
            group_size=args.group_size,
            batch_size=args.batch_size,
            end_token="",
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
        )
        generated = time.perf_counter()
        lengths = sorted({int(c.size) for c in completions})
        if len(completions) != spec.rollout_size or lengths != [spec.max_new_tokens]:
            raise ValueError(
                f"mlx-lm-lora generated {len(completions)} completions of {lengths} tokens, "
                f"expected {spec.rollout_size} of exactly max_new_tokens={spec.max_new_tokens}: "
                "the benchmark must generate every token"
            )
        advantages, reward_metrics = grpo._rollout_rewards(
            batch, texts, indices, reward_funcs, args.reward_weights
        )
        update_start = time.perf_counter()
        # train_grpo's step(): microbatches of len(prompts) rows, one optimizer update.
        (loss, tokens, metrics), grad = grpo._grpo_value_and_grad(
            loss_value_and_grad,
            policy,
            max(len(prompt_tokens), 1),
            batch=batch,
            completions=completions,
            completion_texts=texts,
            batch_indices=indices,
            advantages=advantages,
            reward_metrics=reward_metrics,
            beta=args.beta,
            epsilon=args.epsilon,
            epsilon_high=epsilon_high,
            ref_model=ref_model,
            grpo_loss_type=args.grpo_loss_type,
            importance_sampling_level=args.importance_sampling_level,
            max_tokens=args.max_completion_length,
        )
        flat_grad = cast(list[tuple[str, mx.array]], tree_flatten(grad))
        finite = mx.isfinite(loss) & mx.all(
            mx.stack([mx.all(mx.isfinite(g)) for _, g in flat_grad])
        )
        if not finite.item():
            raise FloatingPointError("mlx-lm-lora's GRPO loss or gradients are not finite")
        optimizer.update(policy, nn.average_gradients(grad))
        mx.eval([policy.state, optimizer.state, mx.random.state], loss, tokens, metrics)
        end = time.perf_counter()
        if parts["reference"] == 0.0:
            raise ValueError(
                "mlx-lm-lora's grpo_loss did not call _get_token_logps with the reference "
                f"model: this worker is written for {MLX_LM_LORA_REQUIREMENT}"
            )
        generation = generated - start
        scoring = parts["reward"] + parts["reference"]
        update = end - update_start - parts["reference"]
        return {
            "wall": end - start,
            "generation": generation,
            "scoring": scoring,
            "update": update,
            "other": (end - start) - generation - scoring - update,
        }

    flat = cast(list[tuple[str, mx.array]], tree_flatten(policy.trainable_parameters()))
    params = sum(
        v.size for _, v in cast(list[tuple[str, mx.array]], tree_flatten(policy.parameters()))
    )
    # Two parameters to check the updates reach the policy: the last matrix and the last
    # parameter (the final norm). Updates replace arrays, so holding them keeps the old values.
    watched = [next((k, v) for k, v in reversed(flat) if v.ndim == 2), flat[-1]]

    seconds: list[float] = []
    split: dict[str, list[float]] = {k: [] for k in SPLIT_KEYS}
    monitor = CpuMonitor()
    setattr(grpo, "_get_token_logps", timed_token_logps)  # grpo_loss looks it up at each call
    try:
        for i in range(spec.warmup + spec.iterations):
            if i == spec.warmup:
                mx.reset_peak_memory()
                monitor.start()
            times = iteration()
            if i < spec.warmup:
                continue
            seconds.append(times["wall"])
            for key in SPLIT_KEYS:
                split[key].append(times[key])
        mlx_peak = mx.get_peak_memory() / 2**20
        other_load = monitor.other_cores()
    finally:
        setattr(grpo, "_get_token_logps", original_token_logps)

    now = dict(cast(list[tuple[str, mx.array]], tree_flatten(policy.trainable_parameters())))
    unchanged = [name for name, before in watched if mx.array_equal(now[name], before).item()]
    if unchanged:
        raise ValueError(
            f"mlx-lm-lora's GRPO updates left {unchanged} unchanged: the policy did not train"
        )
    return RunResult(
        spec=spec,
        seconds=seconds,
        split=split,
        peak_rss_mb=peak_rss_mb(),
        mlx_peak_mb=mlx_peak,
        params_millions=params / 1e6,
        other_load=other_load,
        versions=package_versions("mlx", "mlx-lm", "mlx-lm-lora"),
    )
