"""Dynamic sampling (DAPO): groups whose scores are all equal are dropped and the batch is
refilled from the next prompts, with a bounded number of generation batches and an exact data
cursor on resume."""

from __future__ import annotations

import logging
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from config.ppo_config import PPOConfig
from ppo_trainer.callbacks import TrainerCallback
from ppo_trainer.dynamic_sampling import (
    GENERATION_FIELDS,
    ROLLOUT_FIELDS,
    choose_groups,
    informative_groups,
    take_groups,
)
from ppo_trainer.generator import GenerationOutput
from ppo_trainer.ppo_trainer import PPOTrainer
from ppo_trainer.rollout import Rollout
from tests.test_agent_trainer import frequent_tokens, lookup, tools_model  # noqa: F401 (fixtures)
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


def _agent_rollout(seed: int, b: int, width: int, turns: int, prompt_len: int) -> Rollout:
    """A rollout of ``b`` agent episodes with every field set (random values): responses of
    ``width`` columns, at most ``turns`` policy turns, prompts of 1 to ``prompt_len`` tokens."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, width + 1, b)
    spans = []
    for n in lengths.tolist():  # turns of at most 2 tokens each, a context token between
        starts = list(range(0, n, 3))[:turns]
        spans.append([(s, min(s + 2, n)) for s in starts])
    ends = np.full((b, turns), -1, np.int32)
    for row, row_spans in enumerate(spans):
        ends[row, : len(row_spans)] = [e - 1 for _, e in row_spans]

    def real(*shape: int) -> mx.array:
        return mx.array(rng.normal(size=shape).astype(np.float32))

    gen = GenerationOutput(
        responses=mx.array(rng.integers(1, 90, (b, width)).astype(np.int32)),
        lengths=mx.array(lengths.astype(np.int32)),
        ended_with_stop=mx.array(rng.random(b) < 0.5),
        logprobs=real(b, width),
        entropy=real(b, width),
        stopped_by_string=mx.array(rng.random(b) < 0.5),
        action_mask=mx.array((rng.random((b, width)) < 0.7).astype(np.float32)),
        turn_spans=spans,
    )
    prompts = [rng.integers(1, 90, rng.integers(1, prompt_len + 1)).tolist() for _ in range(b)]
    return Rollout(
        texts=[f"p{seed}-{r}" for r in range(b)],
        completions=[f"c{seed}-{r}" for r in range(b)],
        prompt_ids=prompts,
        generation=gen,
        query_responses=mx.zeros((b, prompt_len + width), mx.int32),
        prompt_lengths=mx.array([len(p) for p in prompts]),
        mask=real(b, width),
        logprobs=real(b, width),
        ref_logprobs=real(b, width),
        entropy=real(b, width),
        values=real(b, width),
        scores=real(b),
        reward_metrics={"rewards/r/mean": mx.array(float(seed))},
        action_rewards=real(b, turns),
        turn_ends=mx.array(ends),
        agent_counts={"turns": real(b), "tool_calls": real(b)},
        source_metrics={"time/generation_wait": float(seed)},
        reward_details={"judge/prompt": [f"judge {seed}.{i}" for i in range(b)]},
    )


def _naive_take(
    rollouts: list[Rollout], groups: list[int], group_size: int, pad: int
) -> dict[str, Any]:
    """What :func:`take_groups` should give, field by field, built row by row: the kept rows
    in order, each per-token row padded to the longest response, each per-turn row to the
    most turns (turn ends with -1), the sequences rebuilt."""
    kept = [(r, i) for r in rollouts for i in range(len(r.texts))]
    chosen = [kept[g * group_size + k] for g in groups for k in range(group_size)]
    width = max(r.generation.responses.shape[1] for r in rollouts)
    turns = max(r.turn_ends.shape[1] for r in rollouts if r.turn_ends is not None)

    def padded(rows: list[list[Any]], to: int, value: Any) -> np.ndarray:
        return np.array([row + [value] * (to - len(row)) for row in rows])

    def tokens(get: Any, value: Any = 0) -> np.ndarray:
        return padded([np.array(get(r)[i]).tolist() for r, i in chosen], width, value)

    def per_turn(get: Any, value: Any) -> np.ndarray:
        rows = []
        for r, i in chosen:
            got = get(r)
            rows.append([0.0] if got is None else np.array(got[i]).tolist())
        return padded(rows, turns, value)

    def rows(get: Any) -> list[Any]:
        return [
            np.array(get(r))[i].tolist() if isinstance(get(r), mx.array) else get(r)[i]
            for r, i in chosen
        ]

    prompts = [r.prompt_ids[i] for r, i in chosen]
    responses = tokens(lambda r: r.generation.responses, pad)
    longest = max(len(p) for p in prompts)
    sequences = [
        p + row + [pad] * (longest - len(p)) for p, row in zip(prompts, responses.tolist())
    ]
    generation = {
        "responses": responses,
        "lengths": rows(lambda r: r.generation.lengths),
        "ended_with_stop": rows(lambda r: r.generation.ended_with_stop),
        "logprobs": tokens(lambda r: r.generation.logprobs),
        "entropy": tokens(lambda r: r.generation.entropy),
        "stopped_by_string": rows(lambda r: r.generation.stopped_by_string),
        "action_mask": tokens(lambda r: r.generation.action_mask),
        "turn_spans": rows(lambda r: r.generation.turn_spans),
    }
    return {
        "texts": rows(lambda r: r.texts),
        "completions": rows(lambda r: r.completions),
        "prompt_ids": prompts,
        "generation": generation,
        "query_responses": np.array(sequences),
        "prompt_lengths": [len(p) for p in prompts],
        "mask": tokens(lambda r: r.mask),
        "logprobs": tokens(lambda r: r.logprobs),
        "ref_logprobs": tokens(lambda r: r.ref_logprobs),
        "entropy": tokens(lambda r: r.entropy),
        "values": tokens(lambda r: r.values),
        "scores": rows(lambda r: r.scores),
        "reward_metrics": rollouts[0].reward_metrics,
        "action_rewards": per_turn(lambda r: r.action_rewards, 0.0),
        "turn_ends": per_turn(lambda r: r.turn_ends, -1),
        "agent_counts": {
            key: rows(lambda r, key=key: r.agent_counts[key]) for key in rollouts[0].agent_counts
        },
        "source_metrics": rollouts[0].source_metrics,
        "reward_details": {"judge/prompt": rows(lambda r: r.reward_details["judge/prompt"])},
    }


def _assert_same(name: str, got: Any, want: Any) -> None:
    assert got is not None, f"{name} was dropped"
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), name
        for key in want:
            _assert_same(f"{name}.{key}", got[key], want[key])
    elif isinstance(got, mx.array):
        np.testing.assert_array_equal(np.array(got), np.asarray(want), err_msg=name)
    else:
        assert got == want, name


@pytest.mark.parametrize("no_action_rewards", [None, 1])
def test_take_groups_carries_every_field_of_agent_rollouts_row_aligned(
    no_action_rewards: int | None,
) -> None:
    # Three rounds of 3 groups of 2 episodes, with different response widths and turn counts
    # (a round may have no per-action rewards: 0 on its turns).
    rollouts = [
        _agent_rollout(0, 6, width=5, turns=2, prompt_len=3),
        _agent_rollout(1, 6, width=8, turns=3, prompt_len=6),
        _agent_rollout(2, 6, width=4, turns=1, prompt_len=2),
    ]
    for r in rollouts:  # every field is set: a new field must be given a value here
        for f in [*fields(Rollout), *fields(GenerationOutput)]:
            source = r if f in fields(Rollout) else r.generation
            assert getattr(source, f.name) is not None, f.name
    if no_action_rewards is not None:
        rollouts[no_action_rewards].action_rewards = None
    groups = [0, 4, 5, 7]
    out = take_groups(rollouts, groups, group_size=2, pad_token_id=99)
    want = _naive_take(rollouts, groups, group_size=2, pad=99)
    # Field by field, of the dataclasses as they are: a field the naive construction does not
    # know (a KeyError here) or that take_groups does not carry fails.
    for f in fields(Rollout):
        if f.name == "generation":
            for g in fields(GenerationOutput):
                _assert_same(g.name, getattr(out.generation, g.name), want["generation"][g.name])
        else:
            _assert_same(f.name, getattr(out, f.name), want[f.name])
    assert set(ROLLOUT_FIELDS) == {f.name for f in fields(Rollout)}
    assert set(GENERATION_FIELDS) == {f.name for f in fields(GenerationOutput)}


def test_take_groups_names_a_field_it_has_no_rule_for(monkeypatch: pytest.MonkeyPatch) -> None:
    rollouts = [_agent_rollout(0, 4, width=3, turns=2, prompt_len=2)]
    monkeypatch.delitem(ROLLOUT_FIELDS, "turn_ends")
    with pytest.raises(ValueError, match="no rule for the Rollout field 'turn_ends'"):
        take_groups(rollouts, [1], group_size=2, pad_token_id=0)


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


def _agent_settings(request: pytest.FixtureRequest) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """A GRPO run with a function tool (tests/test_agent_trainer.py's tiny tool-template model,
    whose turns end on frequent tokens): the model, the config settings, the trainer's tools."""
    model = request.getfixturevalue("tools_model")
    settings = dict(
        stop_token_ids=request.getfixturevalue("frequent_tokens"),
        max_new_tokens=56,
        max_prompt_length=128,
        max_tool_calling_iterations=2,
        tool_call_parser="tests.test_agent_trainer:every_turn_calls",
    )
    return model, settings, {"tools": [lookup]}


def _assert_agent_rows_aligned(rollout: Rollout, metrics: dict[str, float]) -> None:
    """The kept episodes' agent fields belong to their rows: the mask is the action mask, the
    turn ends are the turn spans' last columns, the per-episode turn counts theirs, and the
    logged ``agent/turns`` is the kept episodes' mean."""
    gen = rollout.generation
    assert gen.action_mask is not None and gen.turn_spans is not None
    assert rollout.turn_ends is not None and rollout.agent_counts
    np.testing.assert_array_equal(np.array(rollout.mask), np.array(gen.action_mask))
    ends = np.array(rollout.turn_ends)
    turns = np.array(rollout.agent_counts["turns"])
    for row, spans in enumerate(gen.turn_spans):
        assert turns[row] == len(spans)
        assert ends[row].tolist() == [e - 1 for _, e in spans] + [-1] * (ends.shape[1] - len(spans))
        inside = np.zeros(gen.responses.shape[1])
        for start, end in spans:
            inside[start:end] = 1
        assert (np.array(gen.action_mask)[row] <= inside).all()  # actions only inside turns
    assert metrics["agent/turns"] == pytest.approx(turns.mean())
    assert (turns > 1).any() and metrics["agent/tool_calls"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("agent", [False, True], ids=["single_turn", "agent"])
def test_groups_are_refilled_from_the_next_prompts_and_resume_exactly(
    tiny_model_dir: Path,
    tmp_path: Path,
    agent: bool,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PPO_MLX_ADAPTIVE_BLAS", "off")  # two fresh runs: the same BLAS threads
    records = _records(24)  # 8 informative prompts; 6 steps per epoch of 4 prompts
    model, settings, extra = _agent_settings(request) if agent else (tiny_model_dir, {}, {})

    def run(out: Path, stop_at: int | None = None, resume: bool = False) -> Any:
        cfg = _config(model, out, total_steps=2, **settings)
        trainer = PPOTrainer(cfg, reward_model=_flat_reward, **extra)
        keep = _Keep(stop_at)
        initial = trainable(trainer.policy.model)
        history = trainer.train(records, callbacks=[keep], resume_from="latest" if resume else None)
        return trainer, keep, history, initial

    full, keep, history, initial = run(tmp_path / "full")
    assert_all_changed(initial, trainable(full.policy.model))
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
    if agent:  # the kept episodes carry their own turns, masks and counts
        for rollout, h in zip(keep.rollouts, history):
            _assert_agent_rows_aligned(rollout, h)
    assert keep.cursors == [rounds[0] - 1, rounds[0] + rounds[1] - 2]
    # The refills consumed their prompts: step 2 trains on others than step 1.
    assert not set(keep.rollouts[0].texts) & set(keep.rollouts[1].texts)

    # Stopped after step 1 and resumed: step 2 draws the prompts the full run drew.
    run(tmp_path / "part", stop_at=1)
    resumed, keep2, history2, _ = run(tmp_path / "part", resume=True)
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
