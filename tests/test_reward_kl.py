"""reward_kl/: KL estimators, KL controllers, per-token rewards and the missing-EOS penalty."""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from reward_kl.kl_divergence import AdaptiveKLController, FixedKLController, kl_estimate
from reward_kl.combined_reward import combine_rewards, reward_matrix, reward_metrics
from reward_kl.reward_computer import (
    apply_missing_eos_penalty,
    per_token_rewards,
    sequence_rewards,
)


def naive_kl(logp: float, ref: float, estimator: str) -> float:
    if estimator == "k1":
        return logp - ref
    if estimator == "k2":
        return 0.5 * (logp - ref) ** 2
    return math.exp(ref - logp) - (ref - logp) - 1


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (4, 33)])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimate_matches_naive(seed, shape, estimator):
    rng = np.random.default_rng(seed)
    logp = -rng.exponential(2.0, size=shape)
    ref = logp + rng.normal(0, 0.7, size=shape)
    got = kl_estimate(
        mx.array(logp.astype(np.float32)).astype(mx.bfloat16 if seed else mx.float32),
        mx.array(ref.astype(np.float32)),
        estimator,
    )
    assert got.dtype == mx.float32 and got.shape == shape
    logp_in = logp.astype(np.float32)
    if seed:  # the bfloat16 input is the rounded value
        logp_in = np.array(mx.array(logp_in).astype(mx.bfloat16).astype(mx.float32))
    expected = np.vectorize(lambda a, b: naive_kl(float(a), float(b), estimator))(
        logp_in, ref.astype(np.float32)
    )
    np.testing.assert_allclose(np.array(got), expected, rtol=1e-5, atol=1e-6)
    if estimator != "k1":
        assert (np.array(got) >= 0).all()


def test_kl_estimate_errors():
    with pytest.raises(
        ValueError, match=r"ref_logprobs has shape \(2, 4\) but logprobs has \(2, 3\)"
    ):
        kl_estimate(mx.zeros((2, 3)), mx.zeros((2, 4)), "k1")
    with pytest.raises(ValueError, match="estimator"):
        kl_estimate(mx.zeros((2, 3)), mx.zeros((2, 3)), "k4")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- controllers


def test_fixed_kl_controller():
    ctl = FixedKLController(0.05)
    ctl.update(100.0, 512)
    assert ctl.value == 0.05
    restored = FixedKLController(1.0)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == 0.05
    with pytest.raises(ValueError, match="kl_coef"):
        FixedKLController(-0.1)


def test_adaptive_kl_controller_hand_case():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    ctl.update(9.0, 256)  # 9 / 6 - 1 = 0.5 -> clipped to 0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000), rel=1e-12)
    ctl.update(3.0, 512)  # 3 / 6 - 1 = -0.5 -> clipped to -0.2
    expected = 0.1 * (1 + 0.2 * 256 / 10000) * (1 - 0.2 * 512 / 10000)
    assert ctl.value == pytest.approx(expected, rel=1e-12)
    ctl.update(6.6, 100)  # 6.6 / 6 - 1 = 0.1, inside the clip
    expected *= 1 + 0.1 * 100 / 10000
    assert ctl.value == pytest.approx(expected, rel=1e-12)
    ctl.update(6.0, 1000)  # on target: unchanged
    assert ctl.value == pytest.approx(expected, rel=1e-12)

    # Checkpoint round trip restores it exactly, and both then evolve identically.
    restored = AdaptiveKLController(init_kl_coef=1.0, target=1.0, horizon=1.0)
    restored.load_state_dict(ctl.state_dict())
    assert restored.state_dict() == ctl.state_dict()
    ctl.update(7.0, 64)
    restored.update(7.0, 64)
    assert restored.value == ctl.value


def test_kl_controller_errors():
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(0.1, 0.0, 10000)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, 6.0, 0)
    ctl = AdaptiveKLController(0.1, 6.0, 10000)
    with pytest.raises(ValueError, match="current_kl"):
        ctl.update(float("nan"), 10)
    with pytest.raises(ValueError, match="AdaptiveKLController"):
        ctl.load_state_dict(FixedKLController(0.1).state_dict())
    with pytest.raises(ValueError, match="FixedKLController"):
        FixedKLController(0.1).load_state_dict(ctl.state_dict())


def test_reward_functions_name_the_argument_of_a_wrong_shape() -> None:
    scores, kl, mask = mx.zeros((2,)), mx.zeros((2, 3)), mx.ones((2, 3))
    column = mx.zeros((2, 1))
    for fn in (per_token_rewards, sequence_rewards):
        with pytest.raises(ValueError, match=r"^scores must have shape \(B,\), got \(2, 1\)$"):
            fn(column, kl, mask, 0.1)
        with pytest.raises(ValueError, match=r"^kl must have shape \(B, T\), got \(2,\)$"):
            fn(scores, scores, mask, 0.1)
        with pytest.raises(ValueError, match=r"^mask has shape \(2, 4\) but kl has \(2, 3\)"):
            fn(scores, kl, mx.ones((2, 4)), 0.1)
        with pytest.raises(ValueError, match=r"^scores has shape \(3,\) but kl has \(2, 3\)"):
            fn(mx.zeros((3,)), kl, mask, 0.1)
    ended = mx.array([True, False])
    with pytest.raises(ValueError, match=r"^scores must have shape \(B,\), got \(2, 1\)$"):
        apply_missing_eos_penalty(column, ended, 1.0)
    with pytest.raises(ValueError, match=r"^penalty must be >= 0 .*got -2.0; pass 2.0 to lower"):
        apply_missing_eos_penalty(scores, ended, -2.0)
    # a penalty of 0 is allowed (and changes nothing)
    assert apply_missing_eos_penalty(mx.array([1.0, 2.0]), ended, 0.0).tolist() == [1.0, 2.0]


def test_kl_controllers_name_the_bad_value() -> None:
    """Every number a controller takes or restores is checked, and the message names it."""
    nan, inf = float("nan"), float("inf")
    cases: list[tuple[Any, str]] = [
        (lambda: FixedKLController(nan), r"^kl_coef must be a finite number, got nan$"),
        (lambda: FixedKLController(-0.5), r"^kl_coef must be >= 0, got -0.5$"),
        (lambda: AdaptiveKLController(inf, 6.0, 1.0), r"^init_kl_coef must be a finite number"),
        (lambda: AdaptiveKLController(-0.5, 6.0, 1.0), r"^init_kl_coef must be >= 0, got -0.5$"),
        (lambda: AdaptiveKLController(0.1, nan, 1.0), r"^target must be a finite number"),
        (lambda: AdaptiveKLController(0.1, -1.0, 1.0), r"^target \(the KL to aim for\) must be"),
        (lambda: AdaptiveKLController(0.1, 6.0, inf), r"^horizon must be a finite number"),
        (lambda: AdaptiveKLController(0.1, 6.0, -2.0), r"^horizon must be > 0, got -2.0$"),
        (lambda: AdaptiveKLController(0.1, 6.0, 1.0).update(nan, 1), r"^current_kl must be a"),
        (lambda: AdaptiveKLController(0.1, 6.0, 1.0).update(1.0, -1), r"^n_steps must be >= 0"),
    ]
    state = AdaptiveKLController(0.1, 6.0, 1.0).state_dict()
    for key in ("value", "target", "horizon"):
        cases.append(
            (
                lambda key=key: AdaptiveKLController(1.0, 1.0, 1.0).load_state_dict(
                    {**state, key: nan}
                ),
                rf"^{key} must be a finite number",
            )
        )
        cases.append(
            (
                lambda key=key: AdaptiveKLController(1.0, 1.0, 1.0).load_state_dict(
                    {k: v for k, v in state.items() if k != key}
                ),
                r"^not an AdaptiveKLController state",
            )
        )
    cases.append(
        (
            lambda: FixedKLController(1.0).load_state_dict({"type": "fixed", "value": inf}),
            r"^value must be a finite number, got inf$",
        )
    )
    cases.append(
        (
            lambda: FixedKLController(1.0).load_state_dict({"type": "fixed"}),
            r"^not a FixedKLController state",
        )
    )
    for make, message in cases:
        with pytest.raises(ValueError, match=message):
            make()


def test_kl_controllers_accept_a_zero_coefficient_and_no_steps() -> None:
    assert FixedKLController(0.0).value == 0.0
    ctl = AdaptiveKLController(0.0, 6.0, 1.0)
    ctl.update(12.0, 0)
    assert ctl.value == 0.0
    ctl = AdaptiveKLController(0.5, 6.0, 10.0)
    ctl.update(12.0, 0)  # no samples: no move
    assert ctl.value == 0.5


# ----------------------------------------------------------------------------- per-token rewards

PAD, EOS = 0, 2


def test_score_lands_on_stop_token_not_pad():
    # Responses [5, 6, EOS | pad pad], [7, 8, 9, 4, 3] (no stop), [EOS | ...]: the mask covers
    # each response up to and including its stop token.
    mask = mx.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=mx.float32)
    kl = mx.array(
        [[0.1, 0.2, 0.3, 9.0, 9.0], [0.1, -0.1, 0.0, 0.2, 0.4], [1.0, 5.0, 5.0, 5.0, 5.0]]
    )
    scores = mx.array([2.0, -1.0, 0.5])
    rewards, non_score = per_token_rewards(scores, kl, mask, 0.5)
    assert rewards.dtype == mx.float32 and non_score.dtype == mx.float32
    np.testing.assert_allclose(
        np.array(non_score),
        [[-0.05, -0.1, -0.15, 0, 0], [-0.05, 0.05, 0, -0.1, -0.2], [-0.5, 0, 0, 0, 0]],
        atol=1e-7,
    )
    np.testing.assert_allclose(
        np.array(rewards),
        [[-0.05, -0.1, 1.85, 0, 0], [-0.05, 0.05, 0, -0.1, -1.2], [0.0, 0, 0, 0, 0]],
        atol=1e-7,
    )


def naive_rewards(scores, kl, mask, kl_coef):
    rewards = np.zeros_like(kl, dtype=np.float64)
    non_score = np.zeros_like(kl, dtype=np.float64)
    for b in range(kl.shape[0]):
        last = max(t for t in range(kl.shape[1]) if mask[b, t])
        for t in range(kl.shape[1]):
            if mask[b, t]:
                non_score[b, t] = -kl_coef * kl[b, t]
                rewards[b, t] = non_score[b, t] + (scores[b] if t == last else 0.0)
    return rewards, non_score


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shape", [(1, 1), (4, 9), (6, 40)])
@pytest.mark.parametrize("mask_dtype", [mx.bool_, mx.int32, mx.float32])
def test_per_token_rewards_match_naive(seed, shape, mask_dtype):
    rng = np.random.default_rng(seed)
    B, T = shape
    mask = rng.random(shape) < 0.7  # holes anywhere, including at the end
    mask[np.arange(B), rng.integers(0, T, size=B)] = True
    kl = rng.normal(size=shape)
    scores = rng.normal(size=B)
    kl_coef = [0.05, 0.0, 1.3][seed]
    rewards, non_score = per_token_rewards(
        mx.array(scores.astype(np.float32)),
        mx.array(kl.astype(np.float32)),
        mx.array(mask).astype(mask_dtype),
        kl_coef,
    )
    ref_rewards, ref_non_score = naive_rewards(scores, kl, mask, kl_coef)
    np.testing.assert_allclose(np.array(rewards), ref_rewards, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array(non_score), ref_non_score, rtol=1e-5, atol=1e-6)


def test_per_token_rewards_errors():
    with pytest.raises(ValueError, match=r"rows \[1\] of mask have no action token"):
        per_token_rewards(mx.zeros((2,)), mx.zeros((2, 3)), mx.array([[1, 0, 0], [0, 0, 0]]), 0.1)
    with pytest.raises(ValueError, match=r"mask has shape \(2, 4\) but kl has \(2, 3\)"):
        per_token_rewards(mx.zeros((2,)), mx.zeros((2, 3)), mx.ones((2, 4)), 0.1)
    with pytest.raises(ValueError, match=r"scores has shape \(3,\) but kl has \(2, 3\)"):
        per_token_rewards(mx.zeros((3,)), mx.zeros((2, 3)), mx.ones((2, 3)), 0.1)


def test_missing_eos_penalty():
    # [5, EOS, pad], [5, 6, 7], [EOS, pad, pad], [5, 6, pad]: the first and third ended.
    ended = mx.array([True, False, True, False])
    scores = mx.array([1.0, 1.0, -2.0, 0.5])
    got = apply_missing_eos_penalty(scores, ended, 1.5)
    assert got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), [1.0, -0.5, -2.0, -1.0])
    # int masks work too
    got_int = apply_missing_eos_penalty(scores, ended.astype(mx.int32), 1.5)
    np.testing.assert_allclose(np.array(got_int), np.array(got))
    with pytest.raises(ValueError, match="penalty must be >= 0"):
        apply_missing_eos_penalty(scores, ended, -1.0)
    with pytest.raises(ValueError, match=r"ended_with_stop has shape \(3,\) but scores has \(4,\)"):
        apply_missing_eos_penalty(scores, ended[:3], 1.0)


# ----------------------------------------------------------------------------- RLOO's sequence reward


def test_sequence_rewards_equal_the_row_sums_of_per_token_rewards():
    rng = np.random.default_rng(4)
    scores = mx.array(rng.normal(size=(5,)).astype(np.float32))
    kl = mx.array(rng.normal(size=(5, 7)).astype(np.float32))
    mask = mx.array(np.arange(7)[None, :] < np.array([1, 3, 7, 2, 5])[:, None])
    rewards, _ = per_token_rewards(scores, kl, mask, 0.1)
    np.testing.assert_allclose(
        np.array(sequence_rewards(scores, kl, mask, 0.1)), np.array(rewards.sum(axis=1)), rtol=1e-5
    )
    # Hand case: 2 - 0.5 * (1 + 3), the masked 100 ignored.
    got = sequence_rewards(
        mx.array([2.0]), mx.array([[1.0, 3.0, 100.0]]), mx.array([[1, 1, 0]]), 0.5
    )
    assert got.item() == pytest.approx(0.0)
    with pytest.raises(ValueError, match="one entry per row"):
        sequence_rewards(mx.zeros((3,)), mx.zeros((2, 4)), mx.ones((2, 4)), 0.1)


# ----------------------------------------------------------------------------- several rewards


def test_combine_rewards_matches_naive_nansum():
    rng = np.random.default_rng(5)
    K, B = 3, 8
    scores = rng.normal(size=(K, B))
    scores[rng.random((K, B)) < 0.3] = np.nan
    scores[0, np.isnan(scores).all(axis=0)] = 1.5  # every completion scored by some function
    weights = [0.5, 2.0, -1.0]
    got = combine_rewards(mx.array(scores.astype(np.float32)), weights)
    want = [
        sum(weights[k] * scores[k, b] for k in range(K) if not math.isnan(scores[k, b]))
        for b in range(B)
    ]
    np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-6)
    # One function, weight 1: its scores unchanged.
    single = mx.array([[0.25, -3.0]])
    assert mx.array_equal(combine_rewards(single, [1.0]), single[0]).item()


def test_combine_rewards_refuses_unscored_completions_and_bad_weights():
    scores = mx.array([[1.0, float("nan"), 2.0], [float("nan"), float("nan"), 0.0]])
    with pytest.raises(ValueError, match=r"completions \[1\] were scored by no reward function"):
        combine_rewards(scores, [1.0, 1.0])
    with pytest.raises(
        ValueError, match=r"^weights has shape \(1,\) but there are 2 reward functions; pass one"
    ):
        combine_rewards(mx.ones((2, 3)), [1.0])
    with pytest.raises(ValueError, match=r"^weights has shape \(\) but there are 2 reward"):
        combine_rewards(mx.ones((2, 3)), mx.array(1.0))  # an mx.array is used as it is
    with pytest.raises(
        ValueError, match=r"^rewards_per_func must have shape \(K, B\), got \(3,\)$"
    ):
        combine_rewards(mx.ones((3,)), [1.0])


def test_reward_matrix_reads_none_as_not_applicable_and_refuses_nan():
    got = reward_matrix([[1.0, None], [0.5, 2]], ["fmt", "acc"], 2)
    np.testing.assert_array_equal(np.isnan(np.array(got)), [[False, True], [False, False]])
    assert got[1, 1].item() == 2.0
    assert got.dtype == mx.float32
    # A None before a score skips that completion only.
    assert reward_matrix([[None, 3.0]], ["acc"], 2)[0, 1].item() == 3.0
    with pytest.raises(ValueError, match=r"^got scores from 1 reward functions for 2 names$"):
        reward_matrix([[1.0, 2.0]], ["fmt", "acc"], 2)
    with pytest.raises(ValueError, match=r"'acc' returned nan for completion 0.*or None"):
        reward_matrix([[1.0, 2.0], [float("nan"), 1.0]], ["fmt", "acc"], 2)
    with pytest.raises(ValueError, match=r"'fmt' returned 1 scores for 2 completions"):
        reward_matrix([[1.0], [1.0, 1.0]], ["fmt", "acc"], 2)


@pytest.mark.parametrize(
    "score", [10**400, -(10**400), 1e39, np.float64(-1e39)], ids=["int", "-int", "1e39", "-1e39"]
)
def test_reward_matrix_refuses_scores_beyond_float32_as_non_finite(score: float) -> None:
    """issue #47: a Python int beyond float's range raised OverflowError (a traceback), and a
    float beyond float32's became inf in the matrix without a word."""
    with pytest.raises(ValueError, match=r"'acc' returned .* for completion 1.*finite number"):
        reward_matrix([[1.0, score]], ["acc"], 2)
    assert reward_matrix([[1.0, 10**30]], ["acc"], 2)[0, 1].item() == pytest.approx(1e30)


def test_reward_metrics_are_trls_nan_aware_mean_and_std():
    scores = np.array([[1.0, 2.0, 4.0], [np.nan, 3.0, np.nan], [np.nan] * 3])
    metrics = reward_metrics(mx.array(scores.astype(np.float32)), ["a", "b", "c"])
    assert metrics["rewards/a/mean"].item() == pytest.approx(7 / 3)
    assert metrics["rewards/a/std"].item() == pytest.approx(np.std([1, 2, 4], ddof=1), rel=1e-6)
    assert metrics["rewards/b/mean"].item() == pytest.approx(3.0)
    # Undefined statistics are left out, not logged as NaN.
    assert set(metrics) == {"rewards/a/mean", "rewards/a/std", "rewards/b/mean"}
    # K != B, two stds, one of exactly two scores beside not-applicable ones.
    scores = np.array([[1.0, np.nan, 3.0, np.nan], [2.0, 4.0, 6.0, 0.0]])
    metrics = reward_metrics(mx.array(scores.astype(np.float32)), ["a", "b"])
    assert {k: v.item() for k, v in metrics.items()} == pytest.approx(
        {
            "rewards/a/mean": 2.0,
            "rewards/a/std": np.sqrt(2.0),
            "rewards/b/mean": 3.0,
            "rewards/b/std": np.sqrt(20 / 3),
        },
        rel=1e-6,
    )
    with pytest.raises(ValueError, match=r"^got 1 names for 2 reward functions$"):
        reward_metrics(mx.ones((2, 3)), ["a"])
    with pytest.raises(
        ValueError, match=r"^rewards_per_func must have shape \(K, B\), got \(3,\)$"
    ):
        reward_metrics(mx.ones((3,)), ["a"])


# --------------------------------------------------------------------------- reward normalisation


def test_running_moments_equal_the_statistics_of_all_scores_at_once() -> None:
    from reward_kl.reward_normalization import RunningMoments, normalize_scores, update_moments

    rng = np.random.default_rng(0)
    batches = [rng.normal(-20, 3, size=n).astype(np.float32) for n in (4, 7, 1, 16)]
    moments = RunningMoments()
    for k, batch in enumerate(batches):
        moments = update_moments(moments, mx.array(batch))
        seen = np.concatenate(batches[: k + 1]).astype(np.float64)
        assert moments.count == len(seen)
        assert moments.mean == pytest.approx(seen.mean(), rel=1e-6)
        assert moments.var == pytest.approx(seen.var(), rel=1e-5)  # population variance
    scores = mx.array([-25.0, -20.0, -15.0])
    expected = (np.array([-25.0, -20.0, -15.0]) - moments.mean) / np.sqrt(moments.var + 1e-8)
    np.testing.assert_allclose(np.array(normalize_scores(scores, moments)), expected, rtol=1e-5)
    # a round trip through the checkpoint's JSON is exact
    assert RunningMoments.from_dict(moments.to_dict()) == moments
