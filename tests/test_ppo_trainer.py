"""PPOTrainer end to end on the embedded tiny model: updates, learning, resume, callbacks, errors."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from config.ppo_config import PPOConfig
from experience_buffer.buffer import RolloutBatch
from fixtures.tiny_corpus import review_prompts
from ppo_trainer.callbacks import TrainerCallback
from ppo_trainer.ppo_trainer import PPOTrainer
from tests.resume_checks import without_timings

PROMPTS = review_prompts(16, seed=0)


def e_rate(prompts: list[str], completions: list[str]) -> list[float]:
    """A reward the tiny model can move: the share of the letter 'e' in the completion."""
    return [c.count("e") / max(len(c), 1) for c in completions]


def make_config(tiny_model_dir: Path, tmp_path: Path, **overrides: Any) -> PPOConfig:
    settings: dict[str, Any] = dict(
        model_name=str(tiny_model_dir),
        max_new_tokens=8,
        batch_size=4,
        learning_rate=1e-3,
        num_ppo_epochs=2,
        num_mini_batches=2,
        output_dir=str(tmp_path / "run"),
        progress_bar=False,
        seed=0,
    )
    settings.update(overrides)
    return PPOConfig(**settings)


def trainable(model: Any) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in dict(tree_flatten(model.trainable_parameters())).items()}


def assert_all_changed(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> None:
    assert before.keys() == after.keys() and before
    unchanged = [k for k in before if np.array_equal(before[k], after[k])]
    assert not unchanged, f"parameters not updated: {unchanged}"


@pytest.mark.parametrize("use_lora", [True, False])
def test_ppo_step_updates_every_trainable_parameter(
    tiny_model_dir: Path, tmp_path: Path, use_lora: bool
) -> None:
    trainer = PPOTrainer(
        make_config(tiny_model_dir, tmp_path, use_lora=use_lora), reward_model=e_rate
    )
    assert trainer.value_model is not None
    policy_before = trainable(trainer.policy)
    value_before = trainable(trainer.value_model)
    if use_lora:
        assert all("lora_" in k for k in policy_before)
    frozen_before = {
        k: np.array(v) for k, v in dict(tree_flatten(trainer.policy.parameters())).items()
    }
    metrics = trainer.step(PROMPTS[:4])
    assert_all_changed(policy_before, trainable(trainer.policy))
    assert_all_changed(value_before, trainable(trainer.value_model))
    if use_lora:  # the base weights stay frozen
        after = dict(tree_flatten(trainer.policy.parameters()))
        for k, v in frozen_before.items():
            if "lora_" not in k:
                assert np.array_equal(v, np.array(after[k])), k
    for key in (
        "objective/kl",
        "objective/entropy",
        "objective/scores",
        "objective/non_score_reward",
        "objective/rlhf_reward",
        "policy/approxkl",
        "policy/clipfrac",
        "loss/policy",
        "loss/value",
        "val/clipfrac",
        "val/explained_variance",
        "val/num_eos_tokens",
        "objective/kl_coef",
        "lr",
        "avg_reward",
        "tokens_per_second",
    ):
        assert math.isfinite(metrics[key]), key
    assert trainer.global_step == 1


def test_lora_policy_samples_with_merged_adapters(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A float32 LoRA policy samples with its adapters merged (one matmul per layer), and what
    it samples is the adapted policy: the sampler's log-probs agree with the loss's pass."""
    from base_setup.lora_setup import lora_modules
    from ppo_trainer import rollout
    from token_attribution.sequences import (
        build_query_responses,
        response_logprobs,
        response_positions,
    )

    trainer = PPOTrainer(make_config(tiny_model_dir, tmp_path, use_lora=True), reward_model=e_rate)
    adapters_while_sampling = []
    original = rollout.generate

    def spy(model: Any, *args: Any, **kwargs: Any) -> Any:
        adapters_while_sampling.append(len(lora_modules(model.model)))
        return original(model, *args, **kwargs)

    monkeypatch.setattr(rollout, "generate", spy)
    trainer.step(PROMPTS[:4])  # lora_b moves off zero
    assert adapters_while_sampling == [0] and len(lora_modules(trainer.policy.model)) == 14
    ids = [trainer.encode_prompt(trainer.format_prompt(p)) for p in PROMPTS[4:8]]
    gen = rollout.sample_responses(trainer.policy, ids, trainer.sampling)
    query_responses, prompt_lengths = build_query_responses(
        ids, gen.responses, trainer.sampling.pad_token_id
    )
    positions = response_positions(prompt_lengths, gen.responses.shape[1])
    recomputed, _ = response_logprobs(
        trainer.policy, query_responses, positions, gen.responses, trainer.sampling.temperature
    )
    assert gen.logprobs is not None
    on = np.arange(gen.responses.shape[1])[None, :] < np.array(gen.lengths)[:, None]
    assert np.allclose(np.array(recomputed)[on], np.array(gen.logprobs)[on], atol=1e-4)


@pytest.mark.slow
def test_gradient_checkpointing_gives_the_same_ppo_step(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from base_setup.grad_checkpoint import is_checkpointed

    results = []
    for checkpointing in (False, True):
        config = make_config(
            tiny_model_dir,
            tmp_path / str(checkpointing),
            use_lora=False,
            gradient_checkpointing=checkpointing,
        )
        trainer = PPOTrainer(config, reward_model=e_rate)
        assert trainer.value_model is not None
        trained = (trainer.policy.model, trainer.value_model.model)
        assert all(is_checkpointed(b) == checkpointing for m in trained for b in m.layers)
        before = trainable(trainer.policy), trainable(trainer.value_model)
        metrics = trainer.step(PROMPTS[:4])
        after = trainable(trainer.policy), trainable(trainer.value_model)
        assert_all_changed(before[0], after[0])
        assert_all_changed(before[1], after[1])
        results.append((after, metrics["loss/policy"], metrics["loss/value"]))
    (plain, *plain_losses), (checkpointed, *checkpointed_losses) = results
    np.testing.assert_allclose(checkpointed_losses, plain_losses, rtol=1e-5)
    for want, got in zip(plain, checkpointed):
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_grpo_step_updates_policy_without_value_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = make_config(tiny_model_dir, tmp_path, algorithm="grpo", group_size=4, batch_size=2)
    trainer = PPOTrainer(config, reward_model=e_rate)
    assert trainer.value_model is None
    before = trainable(trainer.policy)
    metrics = trainer.step(PROMPTS[:2])
    assert_all_changed(before, trainable(trainer.policy))
    assert "loss/value" not in metrics
    assert "objective/kl_coef" not in metrics  # GRPO's KL weight is beta; kl_coef is unused
    assert all(math.isfinite(v) for v in metrics.values())


def test_first_update_starts_from_the_rollout_policy(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Rollout log-probs and the first training forward agree: ratio 1, nothing clipped."""
    config = make_config(
        tiny_model_dir, tmp_path, num_ppo_epochs=1, num_mini_batches=1, learning_rate=1e-12
    )
    metrics = PPOTrainer(config, reward_model=e_rate).step(PROMPTS[:4])
    assert metrics["policy/approxkl"] < 1e-10
    assert metrics["policy/clipfrac"] == 0.0
    assert abs(metrics["policy/ratio"] - 1.0) < 1e-5


class KeepRollouts(TrainerCallback):
    """Keeps each step's rollout batch with the step's metrics: ``kept[i] = (batch, metrics)``."""

    def __init__(self) -> None:
        self.kept: list[tuple[RolloutBatch, dict[str, float]]] = []

    def on_rollout_end(self, trainer: PPOTrainer, step: int, batch: RolloutBatch) -> None:
        self.kept.append((batch, {}))

    def on_step_end(self, trainer: PPOTrainer, step: int, metrics: dict) -> None:
        self.kept[-1][1].update(metrics)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_sampling_logprobs_equal_a_forward_pass(
    tiny_model_dir: Path, tmp_path: Path, algorithm: str
) -> None:
    """rollout_logprobs="sampling" (the default) keeps the sampler's log-probs; they equal the
    "forward" ones (a forward pass over the whole sequences) on the same responses."""
    batches = {}
    for mode in ("sampling", "forward"):
        config = make_config(
            tiny_model_dir,
            tmp_path / mode,
            algorithm=algorithm,
            group_size=2 if algorithm == "grpo" else 1,
            rollout_logprobs=mode,
            learning_rate=1e-12,
        )
        keep = KeepRollouts()
        PPOTrainer(config, reward_model=e_rate).train(
            PROMPTS[: config.batch_size], num_epochs=1, callbacks=[keep]
        )
        batches[mode] = keep.kept[0]
    (ours, our_metrics), (theirs, their_metrics) = batches["sampling"], batches["forward"]
    assert mx.array_equal(ours.responses, theirs.responses).item()
    mask = np.array(ours.mask) > 0
    np.testing.assert_allclose(
        np.array(ours.logprobs)[mask], np.array(theirs.logprobs)[mask], atol=1e-4
    )
    assert abs(our_metrics["objective/entropy"] - their_metrics["objective/entropy"]) < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_scoring_side_by_side_equals_one_stream(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, algorithm: str
) -> None:
    """The rollout's scoring passes on two CPU streams (the reference beside the value model,
    or beside the reward model when there is none) give the one-stream rollout's reference
    log-probs, values and scores (PPO_MLX_CPU_STREAMS=off: one stream). The tiny model is
    below the size where two streams pay, so the bound is lowered here."""
    from base_setup import backend
    from models.reward_model import RewardModel
    from ppo_trainer import rollout

    monkeypatch.setenv("PPO_MLX_ADAPTIVE_BLAS", "off")  # every BLAS thread: two lanes where 2+
    counts: list[int] = []

    def recorded(count: int = 2) -> Any:
        counts.append(count)
        return backend.side_by_side(count)

    monkeypatch.setattr(rollout, "side_by_side", recorded)
    sized = PPOTrainer(make_config(tiny_model_dir, tmp_path / "size"), reward_model=e_rate)
    assert sized.ref_model is not None
    assert not rollout.side_by_side_pays(
        sized.ref_model, mx.zeros((16, 46), dtype=mx.int32)
    )  # any rollout of the tiny model is below the bound
    monkeypatch.setattr(rollout, "MIN_SIDE_BY_SIDE_WORK", 0)
    rollouts = {}
    for mode in ("on", "off"):
        monkeypatch.setenv("PPO_MLX_CPU_STREAMS", mode)
        config = make_config(
            tiny_model_dir,
            tmp_path / mode,
            algorithm=algorithm,
            group_size=2 if algorithm == "grpo" else 1,
            use_lora=True,
            learning_rate=1e-12,
            beta=0.04,  # GRPO's KL term: a reference model to score beside the reward model
        )
        reward = RewardModel.from_causal_lm(tiny_model_dir, head_init="normal", seed=3)
        trainer = PPOTrainer(config, reward_model=reward)
        assert trainer.scorer.is_model_pass
        keep = KeepRollouts()
        trainer.train(PROMPTS[: config.batch_size], num_epochs=1, callbacks=[keep])
        rollouts[mode] = keep.kept[0][0]
    assert counts and set(counts) == {2}  # the reference beside the value or reward model
    two, one = rollouts["on"], rollouts["off"]
    assert mx.array_equal(two.responses, one.responses).item()
    assert float(mx.abs(one.scores).max()) > 0  # the reward model's head is not zero
    pairs = [(two.ref_logprobs, one.ref_logprobs), (two.scores, one.scores)]
    if algorithm == "ppo":
        assert two.values is not None and one.values is not None
        pairs.append((two.values, one.values))
    for got, want in pairs:
        np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5, rtol=1e-5)


def test_a_reward_model_beside_the_reference_runs_in_its_lane(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no value model, the reward model's pass runs beside the reference's: the scores a
    scorer returns inside a ``Scored`` (with its logged columns) are evaluated by the lanes'
    ``mx.eval``, not later on one stream (a judge's columns once hid them, and GRPO's scoring
    took 1.5x as long at SmolLM2-135M's shape: issue #49)."""
    from ppo_trainer import rollout

    monkeypatch.setattr(rollout, "MIN_SIDE_BY_SIDE_WORK", 0)
    config = make_config(tiny_model_dir, tmp_path, algorithm="grpo", group_size=2, beta=0.04)
    trainer = PPOTrainer(config, reward_model=e_rate)
    assert trainer.ref_model is not None
    query_responses = mx.array([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    positions = mx.array([[2, 3, 4], [2, 3, 4]])
    scores = mx.array([1.0, 2.0]) * 3  # unevaluated until someone evaluates it
    evaluated: list[mx.array] = []
    real_eval = mx.eval

    def spy(*args: Any) -> None:
        evaluated.extend(rollout.arrays_in(list(args)))
        real_eval(*args)

    monkeypatch.setattr(mx, "eval", spy)
    passes = rollout.model_passes(
        trainer.policy,
        trainer.ref_model,
        None,
        query_responses,
        positions,
        forward=False,
        reward=lambda: rollout.Scored(scores, {"judge/prompt": ["a", "b"]}),
    )
    assert passes.reward_in_lane
    assert any(a is scores for a in evaluated)


def brevity(prompts: list[str], completions: list[str]) -> list[float]:
    """A reward the random tiny model can learn in a few steps: end the response early."""
    return [-len(c) / 50 for c in completions]


@pytest.mark.slow
def test_short_ppo_run_raises_the_reward(tiny_model_dir: Path, tmp_path: Path) -> None:
    """20 PPO steps make the random tiny model's responses shorter.

    A run on the random tiny model can collapse without learning (about one seed in five at the
    rate tuned before AdamW's bias correction became the default; with it, 1e-2 raised the reward
    by 0.32 to 0.72 on each of seeds 0-4), so one float-rounding change can flip a given seed.
    The test needs one of two seeds to learn: a trainer that does not learn fails both. Seeds
    2 and 3 each learn today (+0.69, +0.66; seed 1 does not: +0.09), so the first one usually
    decides and the test runs one training, not two.
    """
    results = []
    for seed in (2, 3):
        config = make_config(
            tiny_model_dir,
            tmp_path / f"seed{seed}",
            batch_size=8,
            max_new_tokens=16,
            num_ppo_epochs=4,
            learning_rate=1e-2,
            kl_coef=0.01,
            seed=seed,
        )
        trainer = PPOTrainer(config, reward_model=brevity)
        eval_prompts = review_prompts(32, seed=7)
        before = trainer.evaluate(eval_prompts, temperature=config.temperature)["eval/mean_reward"]
        trainer.train(review_prompts(80, seed=1), num_epochs=2)
        after = trainer.evaluate(eval_prompts, temperature=config.temperature)["eval/mean_reward"]
        results.append((seed, before, after))
        if after > before + 0.2:
            return
    raise AssertionError(f"no seed raised the mean reward by 0.2: (seed, before, after) {results}")


class Recorder(TrainerCallback):
    def __init__(self, stop_at: int | None = None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.stop_at = stop_at

    def on_train_begin(self, trainer: PPOTrainer) -> None:
        self.calls.append(("begin", trainer.global_step))

    def on_rollout_end(self, trainer: PPOTrainer, step: int, batch: RolloutBatch) -> None:
        self.calls.append(("rollout", step, len(batch)))

    def on_step_end(self, trainer: PPOTrainer, step: int, metrics: dict[str, float]) -> None:
        self.calls.append(("step", step, "objective/kl" in metrics))
        if self.stop_at == step:
            trainer.request_stop()

    def on_epoch_end(self, trainer: PPOTrainer, epoch: int, metrics: dict[str, float]) -> None:
        self.calls.append(("epoch", epoch, metrics["steps"]))

    def on_save(self, trainer: PPOTrainer, step: int, path: Path) -> None:
        self.calls.append(("save", step, path.is_dir()))

    def on_train_end(self, trainer: PPOTrainer, history: list[dict[str, float]]) -> None:
        self.calls.append(("end", len(history)))


@pytest.mark.slow
def test_callbacks_are_called_with_the_right_arguments(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = make_config(tiny_model_dir, tmp_path, save_every=2, num_ppo_epochs=1)
    recorder = Recorder()
    epoch_calls: list[tuple[int, float]] = []
    PPOTrainer(config, reward_model=e_rate).train(
        PROMPTS[:8],
        num_epochs=2,
        callbacks=[recorder, lambda epoch, m: epoch_calls.append((epoch, m["avg_reward"]))],
    )
    assert recorder.calls == [
        ("begin", 0),
        ("rollout", 1, 4),
        ("step", 1, True),
        ("rollout", 2, 4),
        ("step", 2, True),
        ("epoch", 0, 2.0),
        ("save", 2, True),
        ("rollout", 3, 4),
        ("step", 3, True),
        ("rollout", 4, 4),
        ("step", 4, True),
        ("epoch", 1, 2.0),
        ("save", 4, True),
        ("end", 4),
    ]
    assert [e for e, _ in epoch_calls] == [0, 1]
    assert all(math.isfinite(r) for _, r in epoch_calls)


@pytest.mark.plots
@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [{}, {"normalize_reward": True, "value_warmup_steps": 2}],
    ids=["plain", "normalized-warmup"],
)
def test_stop_and_resume_equals_an_uninterrupted_run(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: dict[str, Any]
) -> None:
    # Two fresh runs must start with the same BLAS threads whatever the load (a resumed run takes
    # its checkpoint's count by itself).
    monkeypatch.setenv("PPO_MLX_ADAPTIVE_BLAS", "off")
    prompts = PROMPTS[:12]
    straight_cfg = make_config(tiny_model_dir, tmp_path / "a", save_every=100, **extra)
    straight = PPOTrainer(straight_cfg, reward_model=e_rate)
    straight_history = straight.train(prompts, num_epochs=2)
    assert len(straight_history) == 6

    resumed_cfg = make_config(tiny_model_dir, tmp_path / "b", save_every=100, **extra)
    first = PPOTrainer(resumed_cfg, reward_model=e_rate)
    first.train(prompts, num_epochs=2, callbacks=[Recorder(stop_at=4)])  # like Ctrl-C at step 4
    assert first.global_step == 4
    second = PPOTrainer(resumed_cfg, reward_model=e_rate)
    resumed_history = second.train(prompts, num_epochs=2, resume_from="latest")
    assert second.reward_moments == straight.reward_moments  # normalize_reward's statistics

    assert without_timings(resumed_history) == without_timings(straight_history)
    for a, b in ((straight.policy, second.policy), (straight.value_model, second.value_model)):
        wa, wb = trainable(a), trainable(b)
        assert wa.keys() == wb.keys()
        for k in wa:
            np.testing.assert_array_equal(wa[k], wb[k], err_msg=k)
    lines = (Path(resumed_cfg.output_dir) / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert (Path(resumed_cfg.output_dir) / "training_curves.png").is_file()


@pytest.mark.slow
def test_bad_inputs_fail_before_training_state_is_lost(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = make_config(tiny_model_dir, tmp_path)
    trainer = PPOTrainer(config, reward_model=e_rate)
    with pytest.raises(ValueError, match="empty prompt list"):
        trainer.train([])
    with pytest.raises(ValueError, match="context|max_prompt_length"):
        trainer.train(["word " * 2000])
    assert trainer.global_step == 0

    calls = {"n": 0}

    def flaky(prompts: list[str], completions: list[str]) -> list[float]:
        calls["n"] += 1  # call 1 is train()'s trial call, call 4 step 3's scoring
        return (
            [float("nan")] * len(completions) if calls["n"] == 4 else e_rate(prompts, completions)
        )

    trainer = PPOTrainer(config, reward_model=flaky)
    with pytest.raises(ValueError, match="non-finite"):
        trainer.train(PROMPTS[:12], num_epochs=1)
    # Steps 1-2 completed and were saved before the error surfaced; nothing was half-applied.
    assert trainer.global_step == 2
    saved = trainer.checkpoints.latest()
    assert saved is not None and saved.name == "step_000002"
    restored = PPOTrainer(config, reward_model=e_rate)
    restored.load_checkpoint(saved)
    for k, v in trainable(trainer.policy).items():
        np.testing.assert_array_equal(v, trainable(restored.policy)[k])

    wrong_count = PPOTrainer(config, reward_model=lambda p, c: [0.0])
    with pytest.raises(ValueError, match="1 scores for 4 completions"):
        wrong_count.step(PROMPTS[:4])
    with pytest.raises(ValueError, match="reward"):
        PPOTrainer(make_config(tiny_model_dir, tmp_path))  # no reward at all


def test_batch_that_does_not_split_into_minibatches_is_rejected(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="num_mini_batches"):
        PPOConfig(model_name=str(tiny_model_dir), batch_size=6, num_mini_batches=4)


def test_evaluate_and_save_load_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = PPOTrainer(make_config(tiny_model_dir, tmp_path), reward_model=e_rate)
    trainer.step(PROMPTS[:4])
    result = trainer.evaluate(PROMPTS[:6], num_samples=3)
    assert set(result) >= {"eval/mean_reward", "eval/kl", "eval/response_length", "samples"}
    assert len(result["samples"]) == 3
    assert {"prompt", "completion", "reward"} <= set(result["samples"][0])
    out = trainer.save_model(tmp_path / "saved")
    fresh = PPOTrainer(make_config(tiny_model_dir, tmp_path), reward_model=e_rate)
    fresh.load_model(out)
    probe = mx.array([[5, 6, 7, 8]])
    np.testing.assert_allclose(np.array(fresh.policy(probe)), np.array(trainer.policy(probe)))
    assert fresh.value_model is not None and trainer.value_model is not None
    np.testing.assert_allclose(
        np.array(fresh.value_model(probe)), np.array(trainer.value_model(probe)), atol=1e-6
    )


def test_lora_dropout_is_named_as_unused_by_ppo(
    tiny_model_dir: Path, tmp_path: Path, caplog: Any
) -> None:
    """PPO runs without dropout (as TRL's trainers): a lora_dropout given to it was silently
    ignored; now a warning says so, and the policy stays in eval mode (no dropout acts)."""
    config = make_config(tiny_model_dir, tmp_path, use_lora=True, lora_dropout=0.1)
    with caplog.at_level("WARNING", logger="ppo_mlx"):
        trainer = PPOTrainer(config, reward_model=e_rate)
    assert "lora_dropout 0.1 is not used by PPO / GRPO" in caplog.text
    assert not trainer.policy.model.training


def test_split_scores_takes_the_scores_alone_or_with_their_metrics() -> None:
    """compute_scores may return the scores (an array or a list) or (scores, metrics)."""
    from ppo_trainer.rollout import split_scores

    scores = mx.array([0.5, 1.0])
    assert split_scores(scores, "f") == (scores, {})
    assert split_scores([0.5, 1.0], "f") == ([0.5, 1.0], {})
    assert split_scores((0.5, 1.0), "f") == ((0.5, 1.0), {})  # two scores, not a pair
    got, metrics = split_scores((scores, {"rewards/a/mean": 0.75, "b": mx.array([2.0])}), "f")
    assert got is scores and set(metrics) == {"rewards/a/mean", "b"}
    assert float(metrics["rewards/a/mean"]) == 0.75 and metrics["b"].shape == ()
    with pytest.raises(ValueError, match=r"f returned the metric 'c' of shape \(2,\)"):
        split_scores((scores, {"c": scores}), "f")


# --------------------------------------------------------------------------- steps and schedules


def test_a_binding_total_steps_is_named(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = make_config(tiny_model_dir, tmp_path, total_steps=1, num_epochs=5, max_new_tokens=2)
    with caplog.at_level("INFO", logger="ppo_mlx"):
        history = PPOTrainer(config, reward_model=e_rate).train(PROMPTS[:4])
    assert len(history) == 1
    assert "total_steps=1 caps the run at 1 steps (num_epochs=5 x 1 steps per epoch" in caplog.text


def test_an_extension_that_cannot_train_is_refused_naming_the_setting_that_ends_the_run(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """issue #47: a resume with a larger total_steps trained nothing and returned in silence
    when num_epochs already ended the run (the docs give it as the way to extend a run)."""
    settings: dict[str, Any] = dict(num_ppo_epochs=1, num_mini_batches=1, max_new_tokens=2)
    first = make_config(tiny_model_dir, tmp_path, num_epochs=1, **settings)
    PPOTrainer(first, reward_model=e_rate).train(PROMPTS[:4])  # 1 step: the run is done
    more_steps = make_config(tiny_model_dir, tmp_path, num_epochs=1, total_steps=3, **settings)
    trainer = PPOTrainer(more_steps, reward_model=e_rate)
    with pytest.raises(
        ValueError,
        match=r"num_epochs=1 \(1 x 1 steps per epoch\) ends the run at "
        r"step 1.*--set num_epochs=3",
    ):
        trainer.train(PROMPTS[:4], resume_from="latest")
    assert trainer.global_step <= 1 and (tmp_path / "run" / "checkpoints" / "step_000001").is_dir()
    # Resuming the finished run as it was still works (it saves what a kill left unsaved).
    PPOTrainer(first, reward_model=e_rate).train(PROMPTS[:4], resume_from="latest")


@pytest.mark.slow
def test_extending_a_finished_run_starts_a_new_schedule_segment(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from training.metrics_logger import read_metrics

    settings: dict[str, Any] = dict(
        lr_scheduler="linear", num_ppo_epochs=1, num_mini_batches=1, max_new_tokens=2
    )
    first = make_config(tiny_model_dir, tmp_path, num_epochs=1, **settings)
    PPOTrainer(first, reward_model=e_rate).train(PROMPTS[:8])  # 2 steps, decayed to ~0
    longer = make_config(tiny_model_dir, tmp_path, num_epochs=2, **settings)
    with caplog.at_level("WARNING", logger="ppo_mlx"):
        PPOTrainer(longer, reward_model=e_rate).train(PROMPTS[:8], resume_from="latest")
    assert "had finished its schedule of 2 updates" in caplog.text
    lrs = [r["lr"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert len(lrs) == 4
    # the new segment: the configured peak, decaying linearly to 0 at update 4 (not ~1e-11)
    assert lrs[2:] == pytest.approx([1e-3, 5e-4], rel=1e-5)


def test_value_warmup_trains_the_value_model_alone_first(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = make_config(tiny_model_dir, tmp_path, value_warmup_steps=1, normalize_reward=True)
    trainer = PPOTrainer(config, reward_model=e_rate)
    policy, value = trainable(trainer.policy), trainable(trainer.value_model)
    metrics = trainer.step(PROMPTS[:4])
    assert "loss/value" in metrics and "loss/policy" not in metrics
    assert all(np.array_equal(policy[k], v) for k, v in trainable(trainer.policy).items())
    assert_all_changed(value, trainable(trainer.value_model))
    assert trainer.reward_moments.count == 4
    trainer.step(PROMPTS[4:8])  # after the warm-up, the policy trains too
    assert_all_changed(policy, trainable(trainer.policy))
    assert trainer.reward_moments.count == 8
    with pytest.raises(ValueError, match="value_warmup_steps=2 needs a value model"):
        make_config(tiny_model_dir, tmp_path, algorithm="grpo", group_size=2, value_warmup_steps=2)


def test_explained_variance_is_undefined_when_the_returns_do_not_vary() -> None:
    """issue #47: val/explained_variance read 1.0 on a batch whose returns were all 0 (with
    constant values), where Var[R] = 0 leaves it undefined."""
    from ppo_trainer.metrics import explained_variance

    mask = mx.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    returns = mx.array([[1.0, 2.0, 9.0], [3.0, 4.0, 5.0]])
    values = mx.array([[1.0, 2.0, 0.0], [3.0, 5.0, 5.0]])
    # Valid returns 1 2 3 4 5 (variance 2); residuals 0 0 0 -1 0 (variance 0.16).
    assert float(explained_variance(returns, values, mask)) == pytest.approx(1 - 0.16 / 2)
    assert float(explained_variance(returns, returns, mask)) == 1.0
    zeros = mx.zeros((2, 3))
    assert math.isnan(float(explained_variance(zeros, zeros, mask)))
    assert math.isnan(float(explained_variance(zeros, mx.full((2, 3), 0.5), mask)))


def test_reward_funcs_beside_a_passed_reward_is_refused_before_any_model_loads(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ppo_trainer.components as components

    def no_loading(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(components, "load_policy", no_loading)
    config = make_config(tiny_model_dir, tmp_path, reward_funcs=["think_format"])
    with pytest.raises(ValueError, match="reward_funcs is set in the config and a reward was"):
        PPOTrainer(config, reward_model=e_rate)
