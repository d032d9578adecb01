"""The MLX side of ``benchmarks.ppo_throughput``: time ``PPOTrainer.step`` and the irreducible
pieces of an iteration, in one process.

Iterations: a :class:`~ppo_trainer.ppo_trainer.PPOTrainer` with full-weight training and a
separate frozen reference, or, when the spec asks for LoRA (the real shapes), LoRA adapters on the
policy (``use_lora``, ``lora_r``, ``lora_alpha``, ``lora_keys`` from the spec, no dropout) with the
policy's base weights, adapters off, as the reference; the value model trains all its weights
either way. The reward checkpoint is the reward model and the value model's start;
float32, temperature 1, no stop tokens (every response has exactly ``max_new_tokens`` tokens,
which is checked), one PPO epoch over one minibatch. The time split comes from the step's own
``time/*`` metrics plus a timer around the trainer's ``generate`` call. The peak memory of each
phase (resident and MLX's arrays, :class:`PhasePeaks`) is read at the same boundaries, the
scoring's end taken from the ``on_rollout_scored`` callback.

Irreducible pieces (:data:`~benchmarks.throughput_spec.FLOOR_KEYS`), timed on the trainer's own
models and shapes right after the iterations (median of ``floor_repeats`` after one warm-up):

* ``sample``: batched sampling of ``rollout_size x max_new_tokens`` tokens with mlx-lm's KV cache
  (prompts of equal length, no padding, no log-probs: the plainest decoding loop), drawing each
  token by inverse CDF as the trainer's generator does (``mx.random.categorical`` is slower on
  the CPU);
* ``lm_forward``: one forward pass of the policy on the (B, prompt + response) batch, logits
  evaluated;
* ``head_forward``: the same for a scalar-head model (reward / value: no vocabulary projection);
* ``lm_train_step``: forward + backward + AdamW update of the policy (the mean log-prob of the
  response tokens, through the same ``response_logprobs`` (blockwise from the hidden states for
  a frozen head, a LoRA policy's) / compiled ``AdamW`` the trainer uses);
* ``head_train_step``: the same for the value (or reward) model with a squared loss.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any, Callable, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from benchmarks.throughput_spec import (
    GRPO_BETA,
    PHASE_NAMES,
    CpuMonitor,
    RunResult,
    RunSpec,
    package_versions,
    peak_rss_mb,
    reset_peak_rss,
)
from benchmarks.phase_floors import QUICK_LIMITS, measure_limits, timings
from base_setup import fast_math
from config.model_config import ValueInit
from config.ppo_config import PPOConfig
from ppo_trainer import rollout as rollout_module
from ppo_trainer.callbacks import TrainerCallback
from ppo_trainer.generator import inverse_cdf
from ppo_trainer.ppo_trainer import PPOTrainer
from token_attribution.sequences import response_logprobs
from training.optimizer import AdamW

#: Prompt length of the floor's sampling piece: the benchmark prompts' mean.
FLOOR_PROMPT_TOKENS = 14


def build_trainer(spec: RunSpec, output_dir: str) -> PPOTrainer:
    """The ``PPOTrainer`` of ``spec``: full weights or the spec's LoRA, float32, no stop tokens."""
    settings: dict[str, Any] = {}
    if spec.uses_lora:
        settings = {
            "lora_r": spec.lora_rank,
            "lora_alpha": spec.lora_alpha,
            "lora_dropout": 0.0,
            "lora_keys": list(spec.lora_modules),
        }
    if spec.algorithm == "grpo":  # TRL's beta, not GRPO's default 0: the same reference pass
        settings["beta"] = GRPO_BETA
    config = PPOConfig(
        model_name=spec.policy_dir,
        reward_model_name=spec.reward_dir if spec.reward_function is None else None,
        reward_funcs=None if spec.reward_function is None else [spec.reward_function],
        value_init=cast(ValueInit, spec.value_init),
        share_reward_base=spec.share_reward_base,
        offload_frozen_models=spec.offload_frozen_models,
        algorithm=spec.algorithm,
        use_lora=spec.uses_lora,
        **settings,
        dtype="float32",
        batch_size=spec.batch_size,
        group_size=spec.group_size,
        max_new_tokens=spec.max_new_tokens,
        temperature=1.0,
        stop_token_ids=[],
        num_ppo_epochs=1,
        num_mini_batches=1,
        learning_rate=1e-6,
        seed=spec.seed,
        output_dir=output_dir,
        progress_bar=False,
        gradient_checkpointing=spec.gradient_checkpointing,
        use_chat_template=False,  # the peers' prompt ids: plain text, no template
    )
    # stop_token_ids=[]: never stop before max_new_tokens (run_mlx checks every response has
    # max_new_tokens tokens).
    return PPOTrainer(config)


def _median_seconds(fn: Callable[[], None], repeats: int) -> float:
    return statistics.median(timings(fn, repeats))


def measure_floor(trainer: PPOTrainer, spec: RunSpec) -> dict[str, float]:
    """Median seconds of each irreducible piece on the trainer's models (see module docstring)."""
    from mlx_lm.models.cache import make_prompt_cache

    lm = trainer.policy.model
    head_model = trainer.value_model if trainer.value_model is not None else trainer.reward_model
    if head_model is None:
        raise ValueError("the floor needs a reward or value model with a scalar head")
    num_seqs, new_tokens = spec.rollout_size, spec.max_new_tokens
    vocab = int(trainer.policy.config["vocab_size"])
    key = mx.random.key(spec.seed)
    prompt = mx.random.randint(4, vocab, (num_seqs, FLOOR_PROMPT_TOKENS), key=key)  # (B, P)
    sequence = mx.random.randint(
        4, vocab, (num_seqs, FLOOR_PROMPT_TOKENS + new_tokens), key=key
    )  # (B, L)
    mx.eval(prompt, sequence)
    lm.eval()

    def sample() -> None:
        cache = make_prompt_cache(lm)
        logits = lm(prompt, cache=cache)[:, -1, :]  # (B, V)
        tokens = []
        for t in range(new_tokens):
            weights = fast_math.exp(logits - logits.max(axis=-1, keepdims=True))  # (B, V)
            token = inverse_cdf(weights, mx.random.uniform(shape=(num_seqs, 1)))  # (B,)
            tokens.append(token)
            if t < new_tokens - 1:
                logits = lm(token[:, None], cache=cache)[:, -1, :]
                mx.async_eval(logits)
        mx.eval(tokens)

    def lm_forward() -> None:
        mx.eval(lm(sequence))

    def head_forward() -> None:
        mx.eval(cast(Any, head_model)(sequence))

    response = sequence[:, FLOOR_PROMPT_TOKENS:]  # (B, T)

    positions = mx.broadcast_to(
        mx.arange(FLOOR_PROMPT_TOKENS - 1, FLOOR_PROMPT_TOKENS - 1 + new_tokens), response.shape
    )  # (B, T)

    def lm_loss(model: nn.Module, ids: mx.array) -> mx.array:
        # trainer.policy runs ``model`` (value_and_grad swaps its parameters in place).
        return -response_logprobs(trainer.policy, ids, positions, response)[0].mean()

    def head_loss(model: nn.Module, ids: mx.array) -> mx.array:
        return mx.square(model(ids)).mean()

    def train_step(model: nn.Module, loss_fn: Callable[..., mx.array]) -> Callable[[], None]:
        optimizer = AdamW(learning_rate=1e-6)
        value_and_grad = nn.value_and_grad(model, loss_fn)

        def step() -> None:
            loss, grads = value_and_grad(model, sequence)
            optimizer.update(model, grads)
            mx.eval(model.trainable_parameters(), optimizer.state, loss)

        return step

    repeats = spec.floor_repeats
    floor = {
        "sample": _median_seconds(sample, repeats),
        "lm_forward": _median_seconds(lm_forward, repeats),
        "head_forward": _median_seconds(head_forward, repeats),
    }
    lm.train()
    floor["lm_train_step"] = _median_seconds(train_step(lm, lm_loss), repeats)
    if head_model is trainer.reward_model:
        # GRPO's stand-in for a trained head is its reward model, which offload_frozen_models
        # froze (the run's iterations are over: what this step changes is never used).
        head_model.unfreeze()
    floor["head_train_step"] = _median_seconds(train_step(head_model, head_loss), repeats)
    return floor


class PhasePeaks(TrainerCallback):
    """The peak memory of each phase of the timed iterations: resident memory (``VmHWM``, reset
    at each boundary through /proc/self/clear_refs) and MLX's peak array memory (reset with
    ``mx.reset_peak_memory``), the largest over the iterations.

    :meth:`close` ends the running phase at a boundary: the generation's start (the work before
    it, the prompts' preparation, is not a phase), its end, the scoring's end (this callback's
    ``on_rollout_scored``) and the step's end (the update with the advantages and metrics before
    it). Resident peaks are None where ``VmHWM`` cannot be reset (not Linux): each would
    include everything before. The resets do not lose the whole run's peaks: :meth:`process_rss`
    and :meth:`timed_mlx` carry them across."""

    def __init__(self) -> None:
        self.peaks: dict[str, dict[str, float | None]] = {}
        self.timing = False
        self.resettable = True
        self._process_rss = 0.0
        self._timed_mlx = 0.0

    def close(self, phase: str | None) -> None:
        """End ``phase`` (None: work that is not a phase) and start the next one."""
        rss, mlx_mb = peak_rss_mb(), mx.get_peak_memory() / 2**20
        self._process_rss = max(self._process_rss, rss)
        if self.timing:
            self._timed_mlx = max(self._timed_mlx, mlx_mb)
        if self.timing and phase is not None:
            phase_rss = rss if self.resettable else None
            before = self.peaks.setdefault(phase, {"rss_mb": phase_rss, "mlx_mb": mlx_mb})
            for key, value in (("rss_mb", phase_rss), ("mlx_mb", mlx_mb)):
                old = before[key]
                before[key] = None if value is None or old is None else max(old, value)
        mx.reset_peak_memory()
        self.resettable = reset_peak_rss() and self.resettable

    def process_rss(self) -> float:
        """The process's peak resident memory in MiB, loading included (:func:`peak_rss_mb`
        across the resets)."""
        return max(self._process_rss, peak_rss_mb())

    def timed_mlx(self) -> float:
        """MLX's peak array memory in MiB over the timed iterations (from the first timed
        iteration's start: ``mx.reset_peak_memory`` there)."""
        return max(self._timed_mlx, mx.get_peak_memory() / 2**20)

    def on_rollout_scored(self, trainer: Any, step: int, rollout: Any) -> None:
        self.close("scoring")


def run_mlx(spec: RunSpec) -> RunResult:
    """Time ``spec.warmup + spec.iterations`` PPO/GRPO iterations (and the floor if asked)."""
    if spec.system != "mlx":
        raise ValueError(f"run_mlx runs system 'mlx', got {spec.system!r}")
    generation_seconds: list[float] = []
    original_generate = rollout_module.generate

    phases = PhasePeaks()

    def timed_generate(*args: Any, **kwargs: Any) -> Any:
        phases.close(None)
        start = time.perf_counter()
        out = original_generate(*args, **kwargs)  # ends with mx.eval: the time is real
        generation_seconds.append(time.perf_counter() - start)
        phases.close("generation")
        return out

    prompts = list(spec.prompts[: spec.batch_size])
    seconds: list[float] = []
    split: dict[str, list[float]] = {k: [] for k in ("generation", "scoring", "update", "other")}
    monitor = CpuMonitor()
    rollout_module.generate = timed_generate
    try:
        with tempfile.TemporaryDirectory() as output_dir:
            trainer = build_trainer(spec, output_dir)
            trainer.run.callbacks.append(phases)
            for i in range(spec.warmup + spec.iterations):
                if i == spec.warmup:
                    mx.reset_peak_memory()
                    monitor.start()
                    phases.timing = True
                start = time.perf_counter()
                metrics = trainer.step(prompts)
                wall = time.perf_counter() - start
                phases.close("update")
                length = metrics["episode/response_length"]
                if length != spec.max_new_tokens:
                    raise ValueError(
                        f"responses averaged {length} tokens, not max_new_tokens="
                        f"{spec.max_new_tokens}: the benchmark must generate every token"
                    )
                if i < spec.warmup:
                    continue
                generation = generation_seconds[-1]
                scoring = metrics["time/rollout"] - generation
                update = metrics["time/update"]
                seconds.append(wall)
                split["generation"].append(generation)
                split["scoring"].append(scoring)
                split["update"].append(update)
                split["other"].append(wall - generation - scoring - update)
            phases.timing = False  # the floor's pieces below are not the iteration's phases
            mlx_peak = phases.timed_mlx()
            rss = phases.process_rss()
            flat = cast(list[tuple[str, mx.array]], tree_flatten(trainer.policy.parameters()))
            base = [v for name, v in flat if not name.endswith((".lora_a", ".lora_b"))]
            params = sum(v.size for v in base) / 1e6  # the base model's, without adapters
            trainable = cast(
                list[tuple[str, mx.array]], tree_flatten(trainer.policy.trainable_parameters())
            )
            floor = measure_floor(trainer, spec) if spec.measure_floor else None
            other_load = monitor.other_cores()  # over the timed iterations and the floor
            limits = None
            if spec.measure_limits:
                limits = measure_limits(**(QUICK_LIMITS if spec.quick_limits else {}))
            prompt_tokens = [len(ids) for ids in trainer.preparation.batch(prompts).prompt_ids]
    finally:
        rollout_module.generate = original_generate
    return RunResult(
        spec=spec,
        seconds=seconds,
        split=split,
        peak_rss_mb=rss,
        mlx_peak_mb=mlx_peak,
        params_millions=params,
        trainable_millions=sum(v.size for _, v in trainable) / 1e6,
        floor=floor,
        other_load=other_load,
        limits=limits,
        prompt_tokens=prompt_tokens,
        phase_peaks={phase: phases.peaks[phase] for phase in PHASE_NAMES if phase in phases.peaks},
        versions={
            **package_versions("mlx", "mlx-lm"),
            "device": f"{mx.default_device()}: {mx.device_info().get('device_name', '?')}",
        },
    )
