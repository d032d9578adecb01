"""advantage/: whitening, TD errors, GAE, reward-to-go, group advantages vs naive float64 loops."""

from __future__ import annotations

import threading
from typing import Any, Callable, Literal

import mlx.core as mx
import numpy as np
import pytest

from advantage.gae_advantage import compute_gae
from advantage.group_advantage import (
    group_advantages,
    leave_one_out_advantages,
    rloo_advantages,
)
from advantage.reinforce_pp import reinforce_pp_advantages, reinforce_pp_baseline_advantages
from advantage.reward_to_go import reward_to_go
from advantage.td_error import td_errors
from advantage.whitening import masked_mean, masked_var, masked_whiten

SHAPES = [(1, 1), (2, 5), (4, 17), (3, 64)]
MASK_KINDS = ["prefix", "full", "single", "holes"]
MASK_DTYPES = [mx.bool_, mx.int32, mx.float32]


def make_mask(rng: np.random.Generator, B: int, T: int, kind: str) -> np.ndarray:
    """(B, T) bool mask, at least one valid token per row.

    prefix: random length valid prefix, pad at the end (what the rollout makes);
    full: all valid; single: one valid token per row (row 0 at the start, others anywhere);
    holes: random holes anywhere, including in the middle.
    """
    positions = np.arange(T)[None, :]
    if kind == "prefix":
        lengths = rng.integers(1, T + 1, size=B)
        return positions < lengths[:, None]
    if kind == "full":
        return np.ones((B, T), dtype=bool)
    if kind == "single":
        where = rng.integers(0, T, size=B)
        where[0] = 0
        return positions == where[:, None]
    mask = rng.random((B, T)) < 0.6
    mask[np.arange(B), rng.integers(0, T, size=B)] = True
    return mask


def as_mx_mask(mask: np.ndarray, dtype: mx.Dtype) -> mx.array:
    return mx.array(mask).astype(dtype)


def cases() -> list[tuple[int, tuple[int, int], str]]:
    return [(seed, shape, kind) for seed in (0, 1) for shape in SHAPES for kind in MASK_KINDS]


# ----------------------------------------------------------------------------- naive references


def naive_td(r: np.ndarray, v: np.ndarray, mask: np.ndarray, gamma: float) -> np.ndarray:
    out = np.zeros_like(r, dtype=np.float64)
    for b in range(r.shape[0]):
        steps = [t for t in range(r.shape[1]) if mask[b, t]]
        for k, t in enumerate(steps):
            next_v = v[b, steps[k + 1]] if k + 1 < len(steps) else 0.0
            out[b, t] = r[b, t] + gamma * next_v - v[b, t]
    return out


def naive_gae(r, v, mask, gamma, lam):
    delta = naive_td(r, v, mask, gamma)
    adv = np.zeros_like(delta)
    for b in range(r.shape[0]):
        running = 0.0
        for t in reversed(range(r.shape[1])):
            if mask[b, t]:
                running = delta[b, t] + gamma * lam * running
                adv[b, t] = running
    returns = np.where(mask, adv + v, 0.0)
    return adv, returns


def naive_rtg(r, mask, gamma):
    out = np.zeros_like(r, dtype=np.float64)
    for b in range(r.shape[0]):
        running = 0.0
        for t in reversed(range(r.shape[1])):
            if mask[b, t]:
                running = r[b, t] + gamma * running
                out[b, t] = running
    return out


def naive_masked_stats(x, mask):
    vals = [float(x[i]) for i in np.ndindex(x.shape) if mask[i]]
    n = len(vals)
    mean = sum(vals) / n
    sq = sum((a - mean) ** 2 for a in vals)
    return mean, sq / n, (sq / (n - 1) if n > 1 else float("nan"))


# ----------------------------------------------------------------------------- whitening


@pytest.mark.parametrize("seed,shape,kind", cases())
def test_masked_stats_match_naive(seed, shape, kind):
    rng = np.random.default_rng(seed)
    B, T = shape
    x = rng.normal(2.0, 3.0, size=shape)
    mask = make_mask(rng, B, T, kind)
    mean, var_b, var_u = naive_masked_stats(x, mask)
    dtype = MASK_DTYPES[seed % len(MASK_DTYPES)]
    m = as_mx_mask(mask, dtype)
    xm = mx.array(x.astype(np.float32))
    got = masked_mean(xm, m)
    assert got.dtype == mx.float32 and got.ndim == 0
    np.testing.assert_allclose(got.item(), mean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(masked_var(xm, m, unbiased=False).item(), var_b, rtol=1e-4)
    # Row means (axis=1): every row has a valid token.
    row_means = [np.mean(x[b][mask[b]]) for b in range(B)]
    np.testing.assert_allclose(
        np.array(masked_mean(xm, m, axis=1)), row_means, rtol=1e-5, atol=1e-5
    )
    if mask.sum() >= 2:
        np.testing.assert_allclose(masked_var(xm, m).item(), var_u, rtol=1e-4)
        for shift_mean in (True, False):
            expected = (x - mean) / np.sqrt(var_u + 1e-8)
            if not shift_mean:
                expected = expected + mean
            expected = np.where(mask, expected, 0.0)
            got_w = masked_whiten(xm, m, shift_mean=shift_mean)
            assert got_w.dtype == mx.float32
            np.testing.assert_allclose(np.array(got_w), expected, rtol=1e-4, atol=1e-4)
    else:
        with pytest.raises(ValueError, match="at least 2"):
            masked_var(xm, m)
        with pytest.raises(ValueError, match="at least 2"):
            masked_whiten(xm, m)


def test_masked_stats_ignore_nan_at_invalid_positions():
    x = mx.array([[1.0, 3.0, float("nan")], [5.0, float("inf"), 7.0]])
    mask = mx.array([[1, 1, 0], [1, 0, 1]])
    assert masked_mean(x, mask).item() == pytest.approx(4.0)
    assert masked_var(x, mask).item() == pytest.approx(np.var([1, 3, 5, 7], ddof=1))
    white = np.array(masked_whiten(x, mask))
    assert np.isfinite(white).all() and white[0, 2] == 0 and white[1, 1] == 0


def test_masked_whiten_hand_case():
    x = mx.array([[1.0, 2.0, 3.0, 100.0]])
    mask = mx.array([[True, True, True, False]])
    # mean 2, unbiased var 1 -> (x - 2) / sqrt(1 + 1e-8)
    np.testing.assert_allclose(np.array(masked_whiten(x, mask)), [[-1, 0, 1, 0]], atol=1e-6)
    np.testing.assert_allclose(
        np.array(masked_whiten(x, mask, shift_mean=False)), [[1, 2, 3, 0]], atol=1e-6
    )


def test_masked_stats_errors():
    x = mx.zeros((2, 3))
    with pytest.raises(ValueError, match=r"mask has shape \(2, 4\) but x has \(2, 3\)"):
        masked_mean(x, mx.ones((2, 4)))
    with pytest.raises(ValueError, match="at least 1"):
        masked_mean(x, mx.zeros((2, 3)))
    with pytest.raises(ValueError, match="at least 1"):
        masked_mean(x, mx.array([[1, 0, 0], [0, 0, 0]]), axis=1)
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(x, mx.array([[1, 0, 0], [0, 0, 0]]))
    with pytest.raises(ValueError, match="at least 1"):
        masked_var(x, mx.zeros((2, 3)), unbiased=False)
    # One valid entry is enough for the biased variance (it is 0).
    assert masked_var(x + 5, mx.array([[1, 0, 0], [0, 0, 0]]), unbiased=False).item() == 0.0
    # validate=False: no host sync, an empty mask gives NaN instead of raising.
    assert np.isnan(masked_mean(x, mx.zeros((2, 3)), validate=False).item())


# ----------------------------------------------------------------------------- TD, GAE, RTG


@pytest.mark.parametrize("seed,shape,kind", cases())
def test_td_gae_rtg_match_naive(seed, shape, kind):
    rng = np.random.default_rng(100 + seed)
    B, T = shape
    r = rng.normal(size=shape)
    v = rng.normal(size=shape)
    mask = make_mask(rng, B, T, kind)
    gamma, lam = [(1.0, 0.95), (0.9, 0.8), (0.99, 1.0)][seed % 3]
    m = as_mx_mask(mask, MASK_DTYPES[(seed + len(kind)) % 3])
    rm, vm = mx.array(r.astype(np.float32)), mx.array(v.astype(np.float32))

    delta = td_errors(rm, vm, m, gamma)
    np.testing.assert_allclose(np.array(delta), naive_td(r, v, mask, gamma), rtol=1e-5, atol=1e-5)

    adv, ret = compute_gae(rm, vm, m, gamma, lam)
    adv_ref, ret_ref = naive_gae(r, v, mask, gamma, lam)
    assert adv.dtype == mx.float32 and ret.dtype == mx.float32
    np.testing.assert_allclose(np.array(adv), adv_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(ret), ret_ref, rtol=1e-4, atol=1e-4)

    rtg = reward_to_go(rm, m, gamma)
    np.testing.assert_allclose(np.array(rtg), naive_rtg(r, mask, gamma), rtol=1e-4, atol=1e-4)
    # With V = 0 and lam = 1, GAE is the reward-to-go.
    adv0, _ = compute_gae(rm, mx.zeros_like(rm), m, gamma, 1.0)
    np.testing.assert_allclose(np.array(adv0), np.array(rtg), rtol=1e-5, atol=1e-5)


def test_gae_hand_case():
    rewards = mx.array([[0.0, 0.0, 1.0, 9.0]])
    values = mx.array([[0.5, 0.5, 0.5, 9.0]])
    mask = mx.array([[1, 1, 1, 0]])
    # gamma = lam = 1: delta = [0, 0, 0.5], A = [0.5, 0.5, 0.5], returns = [1, 1, 1]
    adv, ret = compute_gae(rewards, values, mask, 1.0, 1.0)
    np.testing.assert_allclose(np.array(adv), [[0.5, 0.5, 0.5, 0.0]], atol=1e-7)
    np.testing.assert_allclose(np.array(ret), [[1.0, 1.0, 1.0, 0.0]], atol=1e-7)
    # gamma = 0.5, lam = 0.5: delta = [-0.25, -0.25, 0.5], A2 = 0.5, A1 = -0.25 + 0.125,
    # A0 = -0.25 + 0.25 * A1
    adv, _ = compute_gae(rewards, values, mask, 0.5, 0.5)
    a1 = -0.25 + 0.25 * 0.5
    np.testing.assert_allclose(np.array(adv), [[-0.25 + 0.25 * a1, a1, 0.5, 0.0]], atol=1e-7)
    # V past the last valid token is 0, not the pad value 9.
    np.testing.assert_allclose(
        np.array(td_errors(rewards, values, mask, 1.0)), [[0, 0, 0.5, 0]], atol=1e-7
    )
    np.testing.assert_allclose(
        np.array(reward_to_go(rewards, mask, 0.5)), [[0.25, 0.5, 1.0, 0.0]], atol=1e-7
    )


def test_td_gae_errors():
    r = mx.zeros((2, 3))
    with pytest.raises(ValueError, match=r"values has shape \(2, 4\) but rewards has \(2, 3\)"):
        compute_gae(r, mx.zeros((2, 4)), mx.ones((2, 3)), 1.0, 0.95)
    with pytest.raises(ValueError, match=r"mask has shape \(3, 3\) but rewards has \(2, 3\)"):
        td_errors(r, r, mx.ones((3, 3)), 1.0)
    with pytest.raises(ValueError, match=r"mask has shape"):
        reward_to_go(r, mx.ones((2,)), 1.0)
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        reward_to_go(mx.zeros((6,)), mx.ones((6,)), 1.0)
    with pytest.raises(ValueError, match="lam"):
        compute_gae(r, r, mx.ones((2, 3)), 1.0, 1.5)
    with pytest.raises(ValueError, match=r"^gamma must be in \[0, 1\], got -0.1$"):
        td_errors(r, r, mx.ones((2, 3)), -0.1)
    with pytest.raises(ValueError, match=r"^values has shape \(2, 4\) but rewards has \(2, 3\)"):
        td_errors(r, mx.zeros((2, 4)), mx.ones((2, 3)), 1.0)


def test_td_errors_at_the_ends_of_the_discount_range():
    """gamma = 0 (allowed): delta = r - V, no look-ahead; gamma = 1: r + V_next - V."""
    rewards, values = mx.array([[1.0, 2.0, 3.0]]), mx.array([[0.5, -1.0, 4.0]])
    mask = mx.ones((1, 3))
    np.testing.assert_allclose(np.array(td_errors(rewards, values, mask, 0.0)), [[0.5, 3.0, -1.0]])
    np.testing.assert_allclose(np.array(td_errors(rewards, values, mask, 1.0)), [[-0.5, 7.0, -1.0]])


# ----------------------------------------------------------------------------- group advantages


def naive_group(scores: np.ndarray, g: int, scale: str) -> np.ndarray:
    out = np.zeros_like(scores, dtype=np.float64)
    batch_std = np.std(scores, ddof=1)
    for start in range(0, len(scores), g):
        grp = scores[start : start + g]
        for i in range(g):
            centred = grp[i] - np.mean(grp)
            if scale == "group":
                centred /= np.std(grp, ddof=1) + 1e-4
            elif scale == "batch":
                centred /= batch_std + 1e-4
            out[start + i] = centred
    return out


def naive_rloo(scores: np.ndarray, g: int) -> np.ndarray:
    out = np.zeros_like(scores, dtype=np.float64)
    for start in range(0, len(scores), g):
        grp = scores[start : start + g]
        for i in range(g):
            others = [grp[j] for j in range(g) if j != i]
            out[start + i] = grp[i] - sum(others) / len(others)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("n_prompts,g", [(1, 2), (3, 4), (5, 8)])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_naive(seed, n_prompts, g, scale):
    scores = np.random.default_rng(seed).normal(1.0, 2.0, size=n_prompts * g)
    got = group_advantages(mx.array(scores.astype(np.float32)), g, scale)
    assert got.dtype == mx.float32 and got.shape == (n_prompts * g,)
    np.testing.assert_allclose(np.array(got), naive_group(scores, g, scale), rtol=1e-4, atol=1e-5)
    got_loo = leave_one_out_advantages(mx.array(scores.astype(np.float32)), g)
    np.testing.assert_allclose(np.array(got_loo), naive_rloo(scores, g), rtol=1e-4, atol=1e-5)


def test_group_advantages_hand_case():
    scores = mx.array([1.0, 3.0, 0.0, 0.0])  # two prompts, g = 2
    # group 1: mean 2, std (ddof=1) sqrt(2); group 2: all equal -> 0
    s2 = np.sqrt(2.0)
    np.testing.assert_allclose(
        np.array(group_advantages(scores, 2, "group")),
        [-1 / (s2 + 1e-4), 1 / (s2 + 1e-4), 0, 0],
        rtol=1e-6,
    )
    np.testing.assert_allclose(np.array(group_advantages(scores, 2, "none")), [-1, 1, 0, 0])
    # The default scale is the group's std (GRPO's).
    assert mx.array_equal(group_advantages(scores, 2), group_advantages(scores, 2, "group")).item()
    batch_std = float(np.std([1.0, 3.0, 0.0, 0.0], ddof=1))
    np.testing.assert_allclose(
        np.array(group_advantages(scores, 2, "batch")),
        [-1 / (batch_std + 1e-4), 1 / (batch_std + 1e-4), 0, 0],
        rtol=1e-6,
    )
    # RLOO, g = 3: [1, 2, 6] -> 1 - 4, 2 - 3.5, 6 - 1.5
    np.testing.assert_allclose(
        np.array(leave_one_out_advantages(mx.array([1.0, 2.0, 6.0]), 3)), [-3.0, -1.5, 4.5]
    )


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_advantages(mx.zeros((6,)), 4, "group")
    with pytest.raises(ValueError, match="multiple of group_size"):
        leave_one_out_advantages(mx.zeros((5,)), 2)
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        group_advantages(mx.zeros((4,)), 1, "group")
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        leave_one_out_advantages(mx.zeros((4,)), 1)
    with pytest.raises(ValueError, match="scale"):
        group_advantages(mx.zeros((4,)), 2, "std")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^scores must have shape \(B,\), got \(2, 2\)$"):
        group_advantages(mx.zeros((2, 2)), 2, "group")


# ----------------------------------------------------------------------------- RLOO, REINFORCE++


def f32(x: np.ndarray) -> mx.array:
    return mx.array(x.astype(np.float32))


def naive_sequence_rewards(scores, kl, mask, kl_coef):
    return np.array(
        [
            scores[b] - kl_coef * sum(kl[b, t] for t in range(kl.shape[1]) if mask[b, t])
            for b in range(len(scores))
        ]
    )


def naive_reinforce_pp(scores, kl, mask, kl_coef, gamma):
    """Per-token rewards (score on the last action token), discounted return over the action
    tokens (holes skipped), whitened over all action tokens (Bessel, +1e-8); float64 loops."""
    B, T = kl.shape
    returns = np.zeros((B, T))
    for b in range(B):
        steps = [t for t in range(T) if mask[b, t]]
        running = 0.0
        for t in reversed(steps):
            reward = -kl_coef * kl[b, t] + (scores[b] if t == steps[-1] else 0.0)
            running = reward + gamma * running
            returns[b, t] = running
    values = [returns[b, t] for b in range(B) for t in range(T) if mask[b, t]]
    mean, var = np.mean(values), np.var(values, ddof=1)
    whitened = np.where(mask, (returns - mean) / np.sqrt(var + 1e-8), 0.0)
    return whitened, returns


def rl_inputs(seed: int, n_prompts: int, g: int, T: int, kind: str):
    rng = np.random.default_rng(seed + 300)
    B = n_prompts * g
    scores = rng.normal(1.0, 2.0, size=B)
    kl = rng.normal(0.0, 0.3, size=(B, T))
    mask = make_mask(rng, B, T, kind)
    kl = np.where(mask, kl, 1e6)  # garbage at invalid positions must not leak in
    return scores, kl, mask


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("n_prompts,g,T", [(1, 2, 1), (3, 4, 6)])
@pytest.mark.parametrize("kind", ["prefix", "holes"])
def test_rloo_advantages_match_naive(seed, n_prompts, g, T, kind):
    scores, kl, mask = rl_inputs(seed, n_prompts, g, T, kind)
    advantages, rewards = rloo_advantages(f32(scores), f32(kl), mx.array(mask), 0.05, g)
    want_rewards = naive_sequence_rewards(scores, kl, mask, 0.05)
    np.testing.assert_allclose(np.array(rewards), want_rewards, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(
        np.array(advantages), naive_rloo(want_rewards, g), rtol=1e-4, atol=1e-5
    )


def test_rloo_hand_case():
    # Two samples of one prompt: rewards 1 - 0.1 * (0.5 + 0.5) = 0.9 and 3 - 0.1 * 2 = 2.8.
    scores = mx.array([1.0, 3.0])
    kl = mx.array([[0.5, 0.5, 7.0], [2.0, 0.0, 0.0]])
    mask = mx.array([[1, 1, 0], [1, 0, 0]])
    advantages, rewards = rloo_advantages(scores, kl, mask, 0.1, 2)
    np.testing.assert_allclose(np.array(rewards), [0.9, 2.8], rtol=1e-6)
    np.testing.assert_allclose(np.array(advantages), [0.9 - 2.8, 2.8 - 0.9], rtol=1e-6)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("n_prompts,g,T", [(1, 2, 1), (3, 4, 6), (2, 3, 17)])
@pytest.mark.parametrize("kind", ["prefix", "holes", "single"])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_advantages_match_naive(seed, n_prompts, g, T, kind, gamma):
    scores, kl, mask = rl_inputs(seed, n_prompts, g, T, kind)
    m = mx.array(mask).astype(MASK_DTYPES[seed % 3])
    advantages, returns = reinforce_pp_advantages(f32(scores), f32(kl), m, 0.05, gamma)
    want_adv, want_ret = naive_reinforce_pp(scores, kl, mask, 0.05, gamma)
    np.testing.assert_allclose(np.array(returns), want_ret, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(advantages), want_adv, rtol=1e-4, atol=1e-4)
    # -baseline: the group mean of the scores is subtracted first, gamma is 1.
    advantages, returns = reinforce_pp_baseline_advantages(f32(scores), f32(kl), m, 0.05, g)
    centred = scores - np.repeat(scores.reshape(-1, g).mean(axis=1), g)
    want_adv, want_ret = naive_reinforce_pp(centred, kl, mask, 0.05, 1.0)
    np.testing.assert_allclose(np.array(returns), want_ret, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(advantages), want_adv, rtol=1e-4, atol=1e-4)


def test_reinforce_pp_hand_case():
    # Row 0: rewards [-0.1, -0.1 + 2] -> returns (gamma 0.5) [-0.1 + 0.5 * 1.9, 1.9] = [0.85, 1.9].
    # Row 1: one token, reward -0.2 + 0 = -0.2.
    scores = mx.array([2.0, 0.0])
    kl = mx.array([[1.0, 1.0], [2.0, 5.0]])
    mask = mx.array([[1, 1], [1, 0]])
    advantages, returns = reinforce_pp_advantages(scores, kl, mask, 0.1, 0.5)
    np.testing.assert_allclose(np.array(returns), [[0.85, 1.9], [-0.2, 0.0]], rtol=1e-6, atol=1e-7)
    values = np.array([0.85, 1.9, -0.2])
    whitened = (values - values.mean()) / np.sqrt(values.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(
        np.array(advantages), [[whitened[0], whitened[1]], [whitened[2], 0.0]], rtol=1e-5
    )
    # Baseline variant, one group of 2: scores 2, 0 -> +1, -1 before the KL terms.
    _, returns = reinforce_pp_baseline_advantages(scores, kl, mask, 0.1, 2)
    np.testing.assert_allclose(np.array(returns), [[0.8, 0.9], [-1.2, 0.0]], rtol=1e-6, atol=1e-7)


def test_gae_and_reward_to_go_name_the_bad_argument() -> None:
    z, wide, flat = mx.zeros((2, 3)), mx.zeros((2, 4)), mx.zeros((3,))
    with pytest.raises(ValueError, match=r"^values has shape \(2, 4\) but rewards has \(2, 3\)"):
        compute_gae(z, wide, z, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"^mask has shape \(2, 4\) but rewards has \(2, 3\)"):
        compute_gae(z, z, wide, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"^gamma must be in \[0, 1\], got 1.5$"):
        compute_gae(z, z, z, 1.5, 1.0)
    with pytest.raises(ValueError, match=r"^lam must be in \[0, 1\], got -0.5$"):
        compute_gae(z, z, z, 1.0, -0.5)
    with pytest.raises(ValueError, match=r"^rewards must have shape \(B, T\), got \(3,\)$"):
        reward_to_go(flat, flat, 1.0)
    with pytest.raises(ValueError, match=r"^mask has shape \(2, 4\) but rewards has \(2, 3\)"):
        reward_to_go(z, wide, 1.0)
    with pytest.raises(ValueError, match=r"^gamma must be in \[0, 1\], got 2.0$"):
        reward_to_go(z, z, 2.0)


def test_masked_statistics_say_what_is_missing() -> None:
    x, none, one = mx.zeros((2, 3)), mx.zeros((2, 3)), mx.array([[1, 0, 0], [0, 0, 0]])
    with pytest.raises(ValueError, match=r"^mask has shape \(2, 4\) but x has \(2, 3\)"):
        masked_mean(x, mx.zeros((2, 4)))
    with pytest.raises(ValueError, match=r"^mask has shape \(2, 4\) but x has \(2, 3\)"):
        masked_var(x, mx.zeros((2, 4)))
    with pytest.raises(ValueError, match=r"^mask has shape \(2, 4\) but x has \(2, 3\)"):
        masked_whiten(x, mx.zeros((2, 4)))
    more = "; pass a mask with more action tokens$"
    with pytest.raises(ValueError, match=r"^masked_mean needs at least 1 valid .* has 0" + more):
        masked_mean(x, none)
    with pytest.raises(ValueError, match=r"^masked_mean needs .* has 0 in some slice" + more):
        masked_mean(x, one, axis=1)
    with pytest.raises(
        ValueError, match=r"^unbiased masked_var needs at least 2 valid .* has 1" + more
    ):
        masked_var(x, one)
    with pytest.raises(ValueError, match=r"^masked_var needs at least 1 valid .* has 0" + more):
        masked_var(x, none, unbiased=False)
    assert (
        masked_var(mx.array([[3.0, 5.0, 0.0]]), mx.array([[1, 0, 0]]), unbiased=False).item() == 0.0
    )


def test_masked_statistics_without_validation_and_of_a_constant() -> None:
    """validate=False never syncs nor raises (an empty mask gives NaN statistics and an
    all-zero whitening); a constant input whitens to 0, not NaN (the epsilon is added)."""
    x, none = mx.array([[1.0, 2.0, 3.0]]), mx.zeros((1, 3))
    assert np.isnan(np.array(masked_var(x, none, validate=False)))
    assert masked_whiten(x, none, validate=False).tolist() == [[0.0, 0.0, 0.0]]
    assert masked_whiten(x, none, shift_mean=False, validate=False).tolist() == [[0.0] * 3]
    assert masked_whiten(mx.full((1, 3), 4.0), mx.ones((1, 3))).tolist() == [[0.0] * 3]


class _TwoIdenticalRanks:
    """A group of two ranks holding the same rows (``mx.distributed.all_sum`` doubles)."""

    def size(self) -> int:
        return 2


def test_masked_statistics_over_two_identical_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over two ranks holding the same rows, the statistics are those of the rows twice over:
    the same mean, the unbiased variance of 2n entries (n - 1 would tell the local one)."""
    x = mx.array([[1.0, 4.0, 2.0], [0.5, -3.0, 9.0]])
    mask = mx.array([[1, 1, 0], [1, 1, 1]])
    twice, twice_mask = mx.concatenate([x, x]), mx.concatenate([mask, mask])
    monkeypatch.setattr(mx.distributed, "all_sum", lambda a, group=None, stream=None: 2 * a)
    group: Any = _TwoIdenticalRanks()  # stands in for an mx.distributed.Group
    assert masked_mean(x, mask, group=group).item() == pytest.approx(
        masked_mean(twice, twice_mask).item(), rel=1e-6
    )
    np.testing.assert_allclose(
        np.array(masked_mean(x, mask, axis=1, group=group)), np.array(masked_mean(x, mask, axis=1))
    )
    assert masked_var(x, mask, group=group).item() == pytest.approx(
        masked_var(twice, twice_mask).item(), rel=1e-6
    )
    assert masked_var(x, mask, group=group).item() != pytest.approx(
        masked_var(x, mask).item(), rel=1e-3
    )
    np.testing.assert_allclose(
        np.array(masked_whiten(x, mask, group=group)),
        np.array(masked_whiten(twice, twice_mask))[:2],
        rtol=1e-5,
    )
    np.testing.assert_allclose(
        np.array(masked_whiten(x, mask, shift_mean=False, group=group)),
        np.array(masked_whiten(twice, twice_mask, shift_mean=False))[:2],
        rtol=1e-5,
    )


class _ThreadRanks:
    """Two data-parallel ranks with different rows, run as two threads that take turns (one runs
    at a time: the other waits in a collective). ``all_sum`` adds what both ranks pass it, in
    call order, as ``mx.distributed.all_sum`` does across processes."""

    def __init__(self) -> None:
        self.turn = threading.Condition()  # held by the running rank; released while waiting
        self.sums: list[dict[int, np.ndarray]] = []
        self.calls = [0, 0]

    def all_sum(self, rank: int, a: mx.array) -> mx.array:
        call = self.calls[rank]
        self.calls[rank] += 1
        if call == len(self.sums):
            self.sums.append({})
        self.sums[call][rank] = np.array(a)
        self.turn.notify_all()
        if not self.turn.wait_for(lambda: len(self.sums[call]) == 2, timeout=20):
            raise TimeoutError(f"rank {rank}: the other rank made no all_sum call {call}")
        return mx.array(self.sums[call][0] + self.sums[call][1])

    def run(self, on_rank: Callable[[Any, int], mx.array]) -> list[np.ndarray]:
        """``on_rank(group, r)`` on each rank r -> each rank's result."""
        results: list[Any] = [None, None]
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            with self.turn:
                try:
                    results[rank] = np.array(on_rank(_ThreadRank(self, rank), rank))
                except BaseException as error:  # re-raised in the test's thread below
                    errors.append(error)
                self.turn.notify_all()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return results


class _ThreadRank:
    """Rank ``rank`` of a :class:`_ThreadRanks` (stands in for an ``mx.distributed.Group``)."""

    def __init__(self, ranks: _ThreadRanks, rank: int) -> None:
        self.ranks, self._rank = ranks, rank

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return self._rank


@pytest.fixture
def threaded_all_sum(monkeypatch: pytest.MonkeyPatch) -> None:
    """``mx.distributed.all_sum`` over a :class:`_ThreadRank` group exchanges with its other rank."""
    monkeypatch.setattr(
        mx.distributed,
        "all_sum",
        lambda a, group, stream=None: group.ranks.all_sum(group.rank(), a),
    )


def test_masked_statistics_over_two_ranks_with_different_rows(threaded_all_sum: None) -> None:
    """Two ranks holding different rows get the statistics of all the rows together: the global
    mean (not each rank's own) inside the variance and the whitening."""
    x = [mx.array([[1.0, 4.0, 2.0], [0.5, -3.0, 9.0]]), mx.array([[7.0, 8.0, -2.0]])]
    mask = [mx.array([[1, 1, 0], [1, 1, 1]]), mx.array([[1, 0, 1]])]
    both, both_mask = np.concatenate([np.array(a) for a in x]), np.concatenate(
        [np.array(m) for m in mask]
    )
    values = both[both_mask != 0].astype(np.float64)
    mean, var = values.mean(), values.var(ddof=1)
    got = _ThreadRanks().run(lambda g, r: masked_mean(x[r], mask[r], group=g))
    np.testing.assert_allclose(got, [mean, mean], rtol=1e-6)
    got = _ThreadRanks().run(lambda g, r: masked_var(x[r], mask[r], group=g))
    np.testing.assert_allclose(got, [var, var], rtol=1e-5)
    for shift_mean in (True, False):
        want = np.where(
            both_mask != 0, (both - mean) / np.sqrt(var + 1e-8) + (0 if shift_mean else mean), 0
        )
        got = _ThreadRanks().run(
            lambda g, r: masked_whiten(x[r], mask[r], shift_mean=shift_mean, group=g)
        )
        np.testing.assert_allclose(np.concatenate(got), want, rtol=1e-5, atol=1e-6)


def test_group_advantages_over_two_ranks_with_different_rows(threaded_all_sum: None) -> None:
    """``"batch"`` over two ranks divides by the std of both ranks' scores; ``"group"`` and
    ``"none"`` use each rank's own prompts only, whatever the group."""
    scores = [np.array([1.0, 3.0, 0.0, 0.0]), np.array([5.0, -1.0])]  # g = 2: 2 + 1 prompts
    both = np.concatenate(scores)
    scales: tuple[Literal["group", "batch", "none"], ...] = ("batch", "group", "none")
    for scale in scales:
        got = _ThreadRanks().run(
            lambda g, r: group_advantages(mx.array(scores[r]), 2, scale, group=g)
        )
        np.testing.assert_allclose(
            np.concatenate(got), naive_group(both, 2, scale), rtol=1e-5, atol=1e-6, err_msg=scale
        )
