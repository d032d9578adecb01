"""Dynamic sampling (DAPO): groups whose scores are all equal are dropped and the batch is
refilled from the next prompts, with a bounded number of generation batches and an exact data
cursor on resume."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from config.ppo_config import PPOConfig
from ppo_trainer.callbacks import TrainerCallback
from ppo_trainer.dynamic_sampling import choose_groups, informative_groups, take_groups
from ppo_trainer.generator import GenerationOutput
from ppo_trainer.ppo_trainer import PPOTrainer
from ppo_trainer.rollout import Rollout
from tests.test_algorithms_learn import config
from tests.test_ppo_trainer import assert_all_changed, trainable


def test_informative_groups_are_those_whose_scores_differ() -> None:
    scores = np.array([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, -0.0, 0.0])
    assert informative_groups(scores, 2).tolist() == [False, True, False, False]
    assert informative_groups(scores, 4).tolist() == [True, True]


@pytest.mark.parametrize(
    "flags, num_groups, expected",
    [
        # enough informative groups: the first num_groups of them, in generation order
        ([False, True, True, False, True, True], 3, ([1, 2, 4], 0)),
        ([True, True, False, True], 2, ([0, 1], 0)),
        # too few: all informative ones, then the earliest uninformative ones
        ([False, True, False, False, True, False], 4, ([0, 1, 2, 4], 2)),
        ([False, False, False, False], 2, ([0, 1], 2)),
    ],
)
def test_choose_groups_by_hand(
    flags: list[bool], num_groups: int, expected: tuple[list[int], int]
) -> None:
    assert choose_groups(flags, num_groups) == expected


def test_choose_groups_needs_enough_groups() -> None:
    with pytest.raises(ValueError, match="3 groups generated, 4 needed"):
        choose_groups([True, True, True], 4)


def _rollout(base: float, lengths: list[int], width: int, prompt_len: int) -> Rollout:
    """A rollout whose every per-token value is ``base + row + column / 100``."""
    b = len(lengths)
    values = base + mx.arange(b)[:, None] + mx.arange(width)[None, :] / 100  # (B, T)
    mask = (mx.arange(width)[None, :] < mx.array(lengths)[:, None]).astype(mx.float32)
    gen = GenerationOutput(
        responses=(values * 10).astype(mx.int32),
        lengths=mx.array(lengths),
        ended_with_stop=mx.array([True] * b),
        logprobs=values,
        entropy=values,
    )
    prompts = [[int(base) + r + 1] * prompt_len for r in range(b)]
    return Rollout(
        [f"p{base}-{r}" for r in range(b)],
        [f"c{base}-{r}" for r in range(b)],
        prompts,
        gen,
        mx.zeros((b, prompt_len + width), mx.int32),
        mx.array([prompt_len] * b),
        mask,
        values,
        values + 0.5,
        values,
        None,
        base + mx.arange(b).astype(mx.float32),
        {"rewards/r/mean": mx.array(base)},
    )


def test_take_groups_keeps_whole_groups_and_pads_to_the_longest() -> None:
    first = _rollout(0.0, [1, 2, 2, 1], width=2, prompt_len=3)  # groups 0, 1
    second = _rollout(10.0, [3, 1, 2, 3], width=3, prompt_len=2)  # groups 2, 3
    out = take_groups([first, second], [1, 2], group_size=2, pad_token_id=0)
    assert out.texts == ["p0.0-2", "p0.0-3", "p10.0-0", "p10.0-1"]
    assert out.completions == ["c0.0-2", "c0.0-3", "c10.0-0", "c10.0-1"]
    np.testing.assert_allclose(np.array(out.scores), [2.0, 3.0, 10.0, 11.0])
    expected = np.array(
        [[2.0, 2.01, 0.0], [3.0, 3.01, 0.0], [10.0, 10.01, 10.02], [11.0, 11.01, 11.02]]
    )
    np.testing.assert_allclose(np.array(out.logprobs), expected, rtol=1e-6)
    np.testing.assert_allclose(np.array(out.ref_logprobs)[:, :2], expected[:, :2] + 0.5, rtol=1e-6)
    np.testing.assert_array_equal(np.array(out.generation.lengths), [2, 1, 3, 1])
    np.testing.assert_array_equal(np.array(out.mask), [[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]])
    # The sequences are rebuilt: prompt, response columns, padding (L = 3 + 3).
    assert out.query_responses.shape == (4, 6)
    np.testing.assert_array_equal(np.array(out.prompt_lengths), [3, 3, 2, 2])
    np.testing.assert_array_equal(np.array(out.query_responses)[2], [11, 11, 100, 100, 100, 0])
    assert out.reward_metrics == first.reward_metrics


def _flat_reward(completions: list[str], flat: list[bool], **kwargs: Any) -> list[float]:
    """Equal scores in a group of a ``flat`` prompt; 0, 1 alternating in the others."""
    return [1.0 if f else float(i % 2) for i, f in enumerate(flat)]


def _records(n: int) -> list[dict[str, Any]]:
    return [{"prompt": f"Say {i}", "flat": i % 3 != 0} for i in range(n)]


class _Keep(TrainerCallback):
    """Keeps each step's rollout and data cursor; stops the run after ``stop_at`` steps."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.rollouts: list[Rollout] = []
        self.cursors: list[int] = []
        self.stop_at = stop_at

    def on_rollout_scored(self, trainer: PPOTrainer, step: int, rollout: Any) -> None:
        self.rollouts.append(rollout)

    def on_step_end(self, trainer: PPOTrainer, step: int, metrics: dict[str, float]) -> None:
        self.cursors.append(trainer.extra_gen_batches)
        if step == self.stop_at:
            trainer.request_stop()


def _config(model: Path, out: Path, **settings: Any) -> PPOConfig:
    values: dict[str, Any] = dict(
        algorithm="grpo",
        group_size=2,
        beta=0.0,
        use_lora=False,
        dynamic_sampling=True,
        max_num_gen_batches=3,
        num_ppo_epochs=1,
        max_new_tokens=4,
    )
    values.update(settings)
    return config(model, out, **values)


def test_a_short_batch_is_completed_with_a_warning(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # step() without more prompts: one generation batch, 2 of its 4 groups informative (0, 3).
    trainer = PPOTrainer(_config(tiny_model_dir, tmp_path), reward_model=_flat_reward)
    keep = _Keep()
    trainer.run.callbacks.append(keep)
    before = trainable(trainer.policy.model)
    with caplog.at_level(logging.WARNING, logger="ppo_mlx"):
        metrics = trainer.step(_records(4))
    assert_all_changed(before, trainable(trainer.policy.model))
    assert "found 2 of the batch's 4 groups with differing scores" in caplog.text
    assert "completed with 2 groups" in caplog.text
    assert metrics["dynamic_sampling/num_gen_batches"] == 1.0
    assert metrics["dynamic_sampling/groups_dropped"] == 0.0
    assert metrics["dynamic_sampling/extra_rollouts"] == 0.0
    assert metrics["frac_reward_zero_std"] == 0.5
    assert len(keep.rollouts[0].completions) == 8


@pytest.mark.slow
def test_groups_are_refilled_from_the_next_prompts_and_resume_exactly(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    records = _records(24)  # 8 informative prompts; 6 steps per epoch of 4 prompts

    def run(out: Path, stop_at: int | None = None, resume: bool = False) -> Any:
        cfg = _config(tiny_model_dir, out, total_steps=2)
        trainer = PPOTrainer(cfg, reward_model=_flat_reward)
        keep = _Keep(stop_at)
        history = trainer.train(records, callbacks=[keep], resume_from="latest" if resume else None)
        return trainer, keep, history

    full, keep, history = run(tmp_path / "full")
    for rollout in keep.rollouts:  # every group trained on teaches something
        scores = np.array(rollout.scores).reshape(-1, 2)
        assert (scores.max(axis=1) > scores.min(axis=1)).all()
        said = [int(re.search(r"Say (\d+)", text).group(1)) for text in rollout.texts]  # type: ignore[union-attr]
        assert all(i % 3 == 0 for i in said)  # the informative prompts only
    rounds = [h["dynamic_sampling/num_gen_batches"] for h in history]
    assert rounds[0] > 1  # the first batch alone holds too few informative groups
    for h, n in zip(history, rounds):
        assert h["dynamic_sampling/extra_rollouts"] == (n - 1) * 8
        assert h["dynamic_sampling/groups_dropped"] == n * 4 - 4
    assert keep.cursors == [rounds[0] - 1, rounds[0] + rounds[1] - 2]
    # The refills consumed their prompts: step 2 trains on others than step 1.
    assert not set(keep.rollouts[0].texts) & set(keep.rollouts[1].texts)

    # Stopped after step 1 and resumed: step 2 draws the prompts the full run drew.
    run(tmp_path / "part", stop_at=1)
    resumed, keep2, history2 = run(tmp_path / "part", resume=True)
    assert keep2.rollouts[0].texts == keep.rollouts[1].texts
    assert keep2.cursors == keep.cursors[1:]
    assert history2[-1]["dynamic_sampling/num_gen_batches"] == rounds[1]
    a, b = trainable(full.policy.model), trainable(resumed.policy.model)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_dynamic_sampling_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="dynamic_sampling must be false when algorithm is 'ppo'"):
        PPOConfig(model_name="m", dynamic_sampling=True)
    with pytest.raises(ValueError, match="max_num_gen_batches must be >= 1"):
        PPOConfig(model_name="m", algorithm="grpo", group_size=2, max_num_gen_batches=0)
    with pytest.raises(ValueError, match="false when async_rollout is on"):
        PPOConfig(
            model_name="m",
            algorithm="grpo",
            group_size=2,
            dynamic_sampling=True,
            async_rollout=True,
        )
