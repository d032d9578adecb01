"""The one switch back to plain MLX (``plain_mlx: true`` / ``PPO_MLX_PLAIN=1``): the same run
with every speed trick off gives the same metrics and weights within float rounding, the tricks
are really off (and really on without it), and what a run sets up it undoes."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any, Callable, cast

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten

from base_setup import backend, fast_layers, fast_math, plain
from config.ppo_config import PPOConfig
from fixtures.tiny_corpus import review_prompts
from ppo_trainer.callbacks import TrainerCallback
from ppo_trainer.ppo_trainer import PPOTrainer
from tests.test_ppo_trainer import make_config

PROMPTS = review_prompts(8, seed=0)


def e_rate(prompts: list[str], completions: list[str]) -> list[float]:
    return [c.count("e") / max(len(c), 1) for c in completions]


def _config(tiny_model_dir: Path, out: Path, algorithm: str, plain_mlx: bool) -> PPOConfig:
    return PPOConfig(
        model_name=str(tiny_model_dir),
        algorithm=algorithm,
        group_size=2 if algorithm == "grpo" else 1,
        batch_size=4 if algorithm == "ppo" else 2,
        use_lora=True,  # a frozen head (blockwise log-probs) and adapters to merge for sampling
        max_new_tokens=8,
        learning_rate=1e-3,
        num_ppo_epochs=2,
        num_mini_batches=2,
        total_steps=2,
        output_dir=str(out),
        progress_bar=False,
        seed=0,
        plain_mlx=plain_mlx,
    )


class _CacheProbe(TrainerCallback):
    """Records, at each step's end, the buffer-cache limit the run's policy set (None: none)."""

    def __init__(self) -> None:
        self.limits: list[int | None] = []

    def on_step_end(self, trainer: PPOTrainer, step: int, metrics: dict[str, float]) -> None:
        self.limits.append(backend._CACHE_STATE.get("limit"))


def _spy(monkeypatch: pytest.MonkeyPatch, calls: Counter, module: Any, name: str) -> None:
    original: Callable[..., Any] = getattr(module, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)


def _run(
    tiny_model_dir: Path, out: Path, algorithm: str, plain_mlx: bool
) -> tuple[list[dict[str, float]], dict[str, np.ndarray], Counter, list[int | None]]:
    """A two-step run; its history, trained weights, the tricks it called and its cache limits."""
    from ppo_trainer import rollout
    from token_attribution import sequences
    from training import optimizer

    calls: Counter = Counter()
    with pytest.MonkeyPatch.context() as mp:
        _spy(mp, calls, sequences, "head_token_logprobs")  # blockwise LM-head log-probs
        _spy(mp, calls, rollout, "adapters_merged")  # merged adapters for sampling
        _spy(mp, calls, optimizer, "_adamw_update_corrected")  # the compiled AdamW
        _spy(mp, calls, fast_math, "_exp2_parts")  # every fast exp-based function
        _spy(mp, calls, fast_math, "_native")  # ... or the native kernels in its place
        _spy(mp, calls, fast_layers, "rms_norm")  # the fast layers' RMSNorm
        trainer = PPOTrainer(
            _config(tiny_model_dir, out, algorithm, plain_mlx), reward_model=e_rate
        )
        probe = _CacheProbe()
        history = trainer.train(PROMPTS, callbacks=[probe])
    flat = cast(list[tuple[str, mx.array]], tree_flatten(trainer.policy.trainable_parameters()))
    weights = {k: np.array(v) for k, v in flat}
    if trainer.value_model is not None:
        value = cast(
            list[tuple[str, mx.array]], tree_flatten(trainer.value_model.trainable_parameters())
        )
        weights.update({f"value.{k}": np.array(v) for k, v in value})
    return history, weights, calls, probe.limits


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_plain_mlx_run_equals_the_run_with_every_trick(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, algorithm: str
) -> None:
    monkeypatch.setenv("PPO_MLX_ADAPTIVE_BLAS", "off")  # the same BLAS threads both ways
    monkeypatch.delenv("PPO_MLX_PLAIN", raising=False)
    limit_before = mx.set_cache_limit(backend.MLX_CPU_DEFAULT_CACHE_BYTES)
    try:
        fast = _run(tiny_model_dir, tmp_path / "fast", algorithm, plain_mlx=False)
        assert mx.set_cache_limit(limit_before) == backend.MLX_CPU_DEFAULT_CACHE_BYTES  # undone
        mx.set_cache_limit(backend.MLX_CPU_DEFAULT_CACHE_BYTES)
        slow = _run(tiny_model_dir, tmp_path / "plain", algorithm, plain_mlx=True)
        assert mx.set_cache_limit(limit_before) == backend.MLX_CPU_DEFAULT_CACHE_BYTES
    finally:
        mx.set_cache_limit(limit_before)
    fast_history, fast_weights, fast_calls, fast_limits = fast
    plain_history, plain_weights, plain_calls, plain_limits = slow

    # Every trick ran in the default run (on the CPU) and none in the plain one.
    tricks = ["head_token_logprobs", "adapters_merged", "_adamw_update_corrected"]
    if fast_math.fast_math_enabled():  # MLX could compile the fast kernels on this machine
        tricks += ["rms_norm"]
        assert fast_calls["_exp2_parts"] + fast_calls["_native"] > 0, fast_calls
    assert all(fast_calls[t] > 0 for t in tricks), fast_calls
    assert not any(plain_calls[t] for t in [*tricks, "_exp2_parts", "_native"]), plain_calls
    assert all(limit is not None for limit in fast_limits) and len(fast_limits) == 2
    assert plain_limits == [None, None]
    assert not plain.plain_mlx()  # the run's scope is closed

    # The same run: every metric and weight within float32 rounding.
    assert len(fast_history) == len(plain_history) == 2
    for want, got in zip(fast_history, plain_history):
        keys = [k for k in want if not k.startswith("time/") and k != "tokens_per_second"]
        assert keys and set(keys) <= set(got)
        for key in keys:
            assert math.isclose(got[key], want[key], rel_tol=1e-4, abs_tol=1e-4), (
                key,
                got[key],
                want[key],
            )
    assert fast_weights.keys() == plain_weights.keys() and fast_weights
    # atol 5e-5: the default run prefills a prompt once for the rows that share it, so its
    # prefill matmuls have fewer rows and round differently in float32 (the LoRA weights here
    # are ~3e-3, moved from 0 by two steps).
    for key, want_w in fast_weights.items():
        np.testing.assert_allclose(plain_weights[key], want_w, rtol=1e-3, atol=5e-5, err_msg=key)


def test_env_switch_turns_every_trick_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PPO_MLX_PLAIN=1`` acts like a run's scope, everywhere in the process."""
    from token_attribution.logprob_computer import selective_log_softmax
    from training.optimizer import AdamW

    monkeypatch.setenv("PPO_MLX_PLAIN", "1")
    assert plain.plain_mlx() and not plain.speed_tricks()
    assert not fast_math.fast_math_enabled()
    with backend.side_by_side(2) as lanes:
        assert all(type(lane).__name__ == "nullcontext" for lane in lanes)
    assert backend.run_blas_threads() == backend._OPENBLAS.get("max_threads")
    with backend.run_buffer_cache() as limit:
        assert limit is None

    # The plain functions are MLX's own: AdamW's update is mlx.optimizers.AdamW's, bit for bit.
    rng = np.random.default_rng(0)
    grad, param = (mx.array(rng.normal(size=(3, 5)).astype(np.float32)) for _ in range(2))
    ours, theirs = AdamW(learning_rate=1e-2, bias_correction=True), optim.AdamW(
        learning_rate=1e-2, bias_correction=True
    )
    got = ours.apply_gradients({"w": grad}, {"w": param})["w"]
    want = theirs.apply_gradients({"w": grad}, {"w": param})["w"]
    assert np.array_equal(np.array(got), np.array(want))
    logits = mx.array(rng.normal(size=(2, 3, 7)).astype(np.float32))
    tokens = mx.array(rng.integers(0, 7, size=(2, 3)).astype(np.int32))
    naive = mx.take_along_axis(
        logits - mx.logsumexp(logits, axis=-1, keepdims=True), tokens[..., None], axis=-1
    )[..., 0]
    assert np.array_equal(np.array(selective_log_softmax(logits, tokens)), np.array(naive))

    monkeypatch.setenv("PPO_MLX_PLAIN", "maybe")
    with pytest.raises(ValueError, match="PPO_MLX_PLAIN='maybe' is not a setting"):
        plain.plain_mlx()


def test_plain_scope_nests_and_is_undone_on_an_exception(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PPO_MLX_PLAIN", raising=False)
    assert not plain.plain_mlx()
    with pytest.raises(KeyError):
        with plain.plain_mlx_scope():
            with plain.plain_mlx_scope(False):
                assert plain.plain_mlx()
            raise KeyError("boom")
    assert not plain.plain_mlx()
    with plain.plain_mlx_scope(False):
        assert not plain.plain_mlx()


def test_building_a_model_leaves_mlx_settings_alone(tiny_model_dir: Path) -> None:
    """No process-wide side effect from building a model: MLX's buffer-cache limit belongs to a
    run (base_setup.backend.run_buffer_cache), not to the model."""
    from models.policy_model import PolicyModel

    before = mx.set_cache_limit(backend.MLX_CPU_DEFAULT_CACHE_BYTES)
    try:
        PolicyModel.from_pretrained(tiny_model_dir)
        assert mx.set_cache_limit(before) == backend.MLX_CPU_DEFAULT_CACHE_BYTES
    finally:
        mx.set_cache_limit(before)


def test_off_the_cpu_no_trick_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tricks were measured on the CPU only: on another device (a GPU) the plain path runs,
    whatever the switches say."""
    monkeypatch.delenv("PPO_MLX_PLAIN", raising=False)
    monkeypatch.delenv("PPO_MLX_FAST_MATH", raising=False)
    assert plain.speed_tricks() == (mx.default_device().type == mx.DeviceType.cpu)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.DeviceType.gpu))
    assert not plain.speed_tricks() and not fast_math.fast_math_enabled()


def test_the_update_runs_mlx_math_and_the_rollout_the_fast_functions(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fast_math.mlx_math_scope turns the fast functions off within it (nesting counts, undone
    on exit); a PPO step's update runs inside one, its rollout outside."""
    from ppo_trainer import update

    if not fast_math.fast_math_enabled():
        pytest.skip("the fast functions are off on this machine (no CPU device or no compiler)")
    with fast_math.mlx_math_scope():
        with fast_math.mlx_math_scope():
            assert not fast_math.fast_math_enabled()
        assert not fast_math.fast_math_enabled()
    assert fast_math.fast_math_enabled()

    seen: list[bool] = []
    epochs = update.ppo_epochs

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(fast_math.fast_math_enabled())
        return epochs(*args, **kwargs)

    monkeypatch.setattr(update, "ppo_epochs", spy)
    trainer = PPOTrainer(make_config(tiny_model_dir, tmp_path), reward_model=e_rate)
    trainer.step(PROMPTS[:4])
    assert seen == [False] and fast_math.fast_math_enabled()
