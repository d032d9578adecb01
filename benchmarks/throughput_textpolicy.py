"""The textpolicy side of ``benchmarks.ppo_throughput --compare peers``: textpolicy 0.1.11's GRPO
(its rollout runner and its ``Trainer``) on the same checkpoints and settings as ours.

textpolicy needs Python >= 3.12, so this worker runs with the interpreter of its own virtual
environment (``requirements-bench-textpolicy.txt``), which also has this repository's runtime
requirements: the worker runs ``base_setup.setup_blas`` first, so both sides run MLX on the same
OpenBLAS.

What one iteration runs, all of it textpolicy's code but the reward model:

1. Rollout: ``RolloutCoordinator(...).collect()`` over a ``TextGenerationEnv`` with
   ``group_size=G`` and the runner's batched path (``batch_size=G``, ``max_steps=B * G``). The
   environment moves to the next prompt every G steps, not at a reset, and the runner resets it
   once per sequence of a batch before stepping any, so a batch must be one prompt's G sequences:
   B batched decodes (one per prompt, checked every iteration) of G sequences, each with its
   shared-prefill KV cache (``create_batched_policy`` -> ``batch_generate_tokens``, backend
   "mlx", temperature 1, ``top_p=1``, no repetition penalty).
   The sampler's log-probs are the "old" log-probs (no second forward pass). Then
   ``TextGenerationEnv.step`` decodes each completion and calls the reward function.
2. Reward: the reward function scores ``prompt + completion`` with our
   :class:`~models.reward_model.RewardModel` (the ``Qwen3ForSequenceClassification`` checkpoint
   of ``spec.reward_dir``, float32), one completion per call: textpolicy's reward functions take
   one ``(prompt, completion, example)`` at a time, so the reward model runs with batch size 1,
   ``B * G`` times per iteration (ours scores the whole batch in one pass).
3. Update: ``Trainer.train()`` on the collected buffer (``grpo.select_all_data``): one forward
   and backward pass of the whole ``B * G`` batch (``compute_logprobs_batched``), textpolicy's
   ``grpo.compute_advantages`` and ``grpo.policy_loss``, gradient clipping at norm 1.0 (ours'
   ``max_grad_norm``), one ``mlx.optimizers.AdamW`` step (learning rate 1e-6, eps 1e-5, no weight
   decay, as ours), full weights in float32, ``compile_training=False``. textpolicy's default
   (``"auto"``: compile from 1M parameters) compiles ``nn.value_and_grad(model, loss)`` without
   the model as an input, so the compiled function keeps the weights of its first call: from the
   second step on it returns the loss and gradients of the initial weights (textpolicy 0.1.11,
   MLX 0.32.4: the compiled and uncompiled losses differ after one update). The uncompiled step
   is the correct one; at the tiny size both take the same time (the compiled one holds more
   memory).

How the work differs from ours (``benchmarks.throughput_mlx``):

* No reference model and no KL term: textpolicy's GRPO loss has none (its ``kl_divergence``
  metric is a rollout-vs-current approximation, not a penalty), so there is no reference forward
  pass; ours runs one (``beta`` 0.04, k3).
* Advantages are ``reward - mean(reward)`` over the whole batch (``grpo.compute_advantages``: no
  per-prompt group mean, no std division); ours uses the group mean and std. Same cost.
* The clip range is textpolicy's default, asymmetric 0.2 / 0.28 (DAPO); ours 0.2. Same cost.
* Generation is B decodes of G sequences (one per prompt, sharing the prompt's prefill) instead
  of one decode of all ``B * G``; each decoding step syncs to the host (``tolist``) and loops
  over the sequences in Python, as textpolicy does.
* The reward model sees ``prompt + decoded completion`` re-tokenised (a reward function gets
  text), at batch size 1; ours scores the generated token ids in one batch.

EOS stopping is disabled by emptying the tokenizer's ``eos_token_ids`` after ``load_model``
(textpolicy's batched decoder stops a sequence at a token in ``tokenizer.eos_token_ids``);
:func:`run_textpolicy` checks that every completion has exactly ``max_new_tokens`` tokens. The
tokenizer's chat template is removed: textpolicy would wrap each prompt in it for generation (but
train on the raw prompt), while ours continues the raw prompt text; without a template both
generate from and train on the same raw prompt tokens (checked before the first iteration).

The split comes from timers around textpolicy's own functions: the batched policy function
(``generation``), ``TextGenerationEnv.step`` (``scoring``: decoding and the reward model; there
is no reference or old-log-prob pass to time) and ``Trainer.train`` (``update``, its batch
packing included); ``other`` is the rest (environment resets and tokenisation, buffer storage).
"""

from __future__ import annotations

import platform
import time
from typing import Any, Callable, cast

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten
from textpolicy.algorithms import grpo
from textpolicy.environment.text_generation import TextGenerationEnv
from textpolicy.generation import mlx_generation
from textpolicy.rollout import RolloutCoordinator
from textpolicy.training import Trainer

from benchmarks.throughput_spec import (
    SPLIT_KEYS,
    CpuMonitor,
    RunResult,
    RunSpec,
    package_versions,
    peak_rss_mb,
)
from models.reward_model import RewardModel

#: The same optimiser settings as ours (``PPOConfig`` defaults and ``build_trainer``).
LEARNING_RATE = 1e-6
ADAM_EPS = 1e-5
MAX_GRAD_NORM = 1.0
TEMPERATURE = 1.0


class _Timers:
    """Seconds spent in the wrapped textpolicy functions during the current iteration."""

    def __init__(self) -> None:
        self.current: dict[str, float] = {k: 0.0 for k in SPLIT_KEYS if k != "other"}

    def reset(self) -> None:
        self.current = {k: 0.0 for k in self.current}

    def wrap(self, fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.current[key] += time.perf_counter() - start
            return out

        return timed


def _load_policy(spec: RunSpec) -> tuple[Any, Any]:
    """textpolicy's ``load_model`` (mlx-lm's ``load``), in float32, with EOS stopping and the
    chat template turned off (see the module docstring)."""
    model, tokenizer = mlx_generation.load_model(spec.policy_dir)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    # textpolicy's batched decoder ends a sequence at any id in tokenizer.eos_token_ids
    # (_resolve_eos_token_ids); none means every sequence runs max_tokens steps.
    tokenizer.eos_token_ids = []
    # Forwarded to the Hugging Face tokenizer: apply_chat_template then raises, and textpolicy
    # keeps the raw prompt tokens (_maybe_apply_chat_template).
    tokenizer.chat_template = None
    return model, tokenizer


def _check_raw_prompts(tokenizer: Any, prompts: list[str]) -> None:
    """Raise unless textpolicy generates from the same prompt tokens the environment stores."""
    for prompt in prompts:
        ids = mlx_generation.encode(tokenizer, prompt)  # (P,)
        processed = mlx_generation._maybe_apply_chat_template(tokenizer, ids)
        if processed.tolist() != ids.tolist():
            raise ValueError(
                f"textpolicy still formats the prompt {prompt!r} for generation "
                f"({ids.size} -> {processed.size} tokens): the benchmark needs the raw prompt"
            )


def _reward_function(reward_model: RewardModel, tokenizer: Any) -> Callable[..., float]:
    """A textpolicy reward function: the reward model's score of ``prompt + completion``."""

    def reward(prompt: str, completion: str, example: dict[str, Any], **kwargs: Any) -> float:
        ids = list(tokenizer.encode(prompt + completion, add_special_tokens=False))
        scores = reward_model.score(mx.array([ids]), [len(ids)])  # (1,)
        return cast(float, scores.item())

    return reward


def run_textpolicy(spec: RunSpec) -> RunResult:
    """Time ``spec.warmup + spec.iterations`` GRPO iterations of textpolicy (see the module
    docstring for what one iteration runs)."""
    if spec.system != "textpolicy":
        raise ValueError(f"run_textpolicy runs system 'textpolicy', got {spec.system!r}")
    mx.random.seed(spec.seed)
    prompts = list(spec.prompts[: spec.batch_size])
    model, tokenizer = _load_policy(spec)
    _check_raw_prompts(tokenizer, prompts)
    reward_model = RewardModel.from_pretrained(spec.reward_dir, dtype="float32")
    reward_model.eval()

    timers = _Timers()
    widths: list[int] = []
    fed: list[mx.array] = []  # the prompts the decoder got, in order
    batched_policy = mlx_generation.create_batched_policy(
        model,
        tokenizer,
        {"max_tokens": spec.max_new_tokens, "temperature": TEMPERATURE, "top_p": 1.0},
    )
    timed_generate = timers.wrap(batched_policy, "generation")

    def policy(prompt_tokens: list[mx.array], deterministic: bool = False) -> Any:
        out = timed_generate(prompt_tokens, deterministic=deterministic)
        fed.extend(prompt_tokens)
        widths.extend(int(tokens.size) for tokens, _ in out)
        return out

    # The coordinator takes a function marked batched as the runner's batched policy as is.
    setattr(policy, "_tp_is_batched", True)

    envs: list[TextGenerationEnv] = []

    def make_env() -> TextGenerationEnv:
        env = TextGenerationEnv(
            prompts,
            _reward_function(reward_model, tokenizer),
            max_tokens=spec.max_new_tokens,
            seed=spec.seed,
            tokenizer=tokenizer,
            group_size=spec.group_size,
        )
        # An instance attribute shadows the method for this environment only.
        setattr(env, "step", timers.wrap(env.step, "scoring"))
        envs.append(env)
        return env

    rollout = RolloutCoordinator(
        env_fn=make_env,
        policy_fn=lambda: policy,
        algorithm="grpo",
        num_workers=0,
        max_steps=spec.rollout_size,
        max_episodes=spec.rollout_size,
        batch_size=spec.group_size,
    )
    if len(envs) != 1:
        raise ValueError(f"textpolicy's rollout made {len(envs)} environments, expected 1")
    optimizer = optim.AdamW(learning_rate=LEARNING_RATE, eps=ADAM_EPS, weight_decay=0.0)
    trainer = Trainer(
        model=model,
        advantage_fn=grpo.compute_advantages,
        loss_fn=grpo.policy_loss,
        optimizer=optimizer,
        max_grad_norm=MAX_GRAD_NORM,
        compile_training=False,  # its compiled step keeps the first weights: module docstring
        data_selector_fn=grpo.select_all_data,
    )
    train = timers.wrap(trainer.train, "update")

    # What the decoder must see per iteration: each prompt's raw tokens, group_size times in turn.
    expected = [
        mlx_generation.encode(tokenizer, p).tolist()
        for p in prompts
        for _ in range(spec.group_size)
    ]
    initial = dict(cast(list[tuple[str, mx.array]], tree_flatten(model.parameters())))
    params = sum(v.size for v in initial.values()) / 1e6
    seconds: list[float] = []
    split: dict[str, list[float]] = {k: [] for k in SPLIT_KEYS}
    monitor = CpuMonitor()
    for i in range(spec.warmup + spec.iterations):
        if i == spec.warmup:
            mx.reset_peak_memory()
            monitor.start()
        timers.reset()
        widths.clear()
        fed.clear()
        start = time.perf_counter()
        buffer = rollout.collect()
        episodes = len(buffer.episodes)
        trainer.link_buffer(buffer)
        train()  # on-policy: the trainer clears the buffer after its step
        wall = time.perf_counter() - start
        if episodes != spec.rollout_size:
            raise ValueError(
                f"textpolicy collected {episodes} episodes, expected {spec.rollout_size}"
            )
        bad = sorted({w for w in widths if w != spec.max_new_tokens})
        if len(widths) != spec.rollout_size or bad:
            raise ValueError(
                f"textpolicy generated {len(widths)} completions with lengths {bad or 'ok'}; "
                f"the benchmark needs {spec.rollout_size} of max_new_tokens="
                f"{spec.max_new_tokens} tokens"
            )
        if [ids.tolist() for ids in fed] != expected:
            raise ValueError(
                "textpolicy's rollout did not generate group_size completions of each prompt in "
                "turn; the benchmark needs batch_size prompts x group_size completions"
            )
        if i < spec.warmup:
            continue
        parts = timers.current
        seconds.append(wall)
        for key, value in parts.items():
            split[key].append(value)
        split["other"].append(wall - sum(parts.values()))
    other_load = monitor.other_cores()
    mlx_peak = mx.get_peak_memory() / 2**20
    rss = peak_rss_mb()
    rollout.close()

    final = dict(cast(list[tuple[str, mx.array]], tree_flatten(model.parameters())))
    unchanged = [name for name, value in final.items() if mx.array_equal(value, initial[name])]
    if unchanged:
        raise ValueError(
            f"{len(unchanged)} of {len(final)} policy parameters did not change after "
            f"{spec.warmup + spec.iterations} textpolicy updates (e.g. {unchanged[:3]})"
        )
    return RunResult(
        spec=spec,
        seconds=seconds,
        split=split,
        peak_rss_mb=rss,
        mlx_peak_mb=mlx_peak,
        params_millions=params,
        other_load=other_load,
        versions={
            **package_versions("mlx", "mlx-lm", "textpolicy"),
            "python": platform.python_version(),
        },
    )
