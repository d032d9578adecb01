"""training/: PPO and GRPO policy losses and the clipped value loss.

Values and metrics against naive float64 loops; gradients w.r.t. logprobs / values against central
finite differences of those loops; constants (old log-probs, reference, advantages, returns) get no
gradient; the losses run under mx.compile (so they never sync with the host).
"""

from __future__ import annotations

import gc
import math
from typing import Any, cast
from collections.abc import Callable

import mlx.core as mx
import numpy as np
import pytest

from training.policy_loss import (
    aggregate_loss,
    grpo_policy_loss,
    micro_batch_weights,
    ppo_policy_loss,
    rloo_policy_loss,
)
from training.value_loss import clipped_value_loss

SHAPES = [(1, 1), (3, 6), (4, 9)]
MASK_KINDS = ["prefix", "full", "single", "holes"]
MASK_DTYPES = [mx.bool_, mx.int32, mx.float32]
CLIPRANGE = 0.2
MARGIN = 1e-3  # keep every token this far from a kink so finite differences are valid
FD_STEP = 1e-6


def make_mask(rng: np.random.Generator, B: int, T: int, kind: str) -> np.ndarray:
    """(B, T) bool; every row has a valid token. prefix: pad at the end; single: one token."""
    positions = np.arange(T)[None, :]
    if kind == "prefix":
        return positions < rng.integers(1, T + 1, size=B)[:, None]
    if kind == "full":
        return np.ones((B, T), dtype=bool)
    if kind == "single":
        return positions == rng.integers(0, T, size=B)[:, None]
    mask = rng.random((B, T)) < 0.6
    mask[np.arange(B), rng.integers(0, T, size=B)] = True
    return mask


def cases() -> list[tuple[int, tuple[int, int], str]]:
    return [(seed, shape, kind) for seed in (0, 1) for shape in SHAPES for kind in MASK_KINDS]


def f32(x: np.ndarray) -> mx.array:
    return mx.array(x.astype(np.float32))


def central_differences(fn: Callable[[np.ndarray], float], x: np.ndarray) -> np.ndarray:
    grad = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[i] += FD_STEP
        down[i] -= FD_STEP
        grad[i] = (fn(up) - fn(down)) / (2 * FD_STEP)
    return grad


# ----------------------------------------------------------------------------- naive references


def naive_policy(logp, old, ref, adv, mask, eps, beta=0.0):
    """Loops over tokens in float64. ``adv`` is (B, T); ``ref`` is used only when beta or kl asked."""
    total = clipped = approxkl = ratio_sum = kl_sum = 0.0
    n = 0
    for b, t in np.ndindex(logp.shape):
        if not mask[b, t]:
            continue
        ratio = math.exp(logp[b, t] - old[b, t])
        loss1 = -adv[b, t] * ratio
        loss2 = -adv[b, t] * min(max(ratio, 1 - eps), 1 + eps)
        kl = math.exp(ref[b, t] - logp[b, t]) - (ref[b, t] - logp[b, t]) - 1
        total += max(loss1, loss2) + beta * kl
        clipped += float(loss2 > loss1)
        approxkl += 0.5 * (logp[b, t] - old[b, t]) ** 2
        ratio_sum += ratio
        kl_sum += kl
        n += 1
    metrics = {"clipfrac": clipped / n, "approxkl": approxkl / n, "ratio": ratio_sum / n}
    return total / n, metrics, kl_sum / n


def naive_value(v, old_v, returns, mask, eps):
    total = clipped = vpred = 0.0
    n = 0
    for b, t in np.ndindex(v.shape):
        if not mask[b, t]:
            continue
        v_clip = min(max(v[b, t], old_v[b, t] - eps), old_v[b, t] + eps)
        loss1 = (v[b, t] - returns[b, t]) ** 2
        loss2 = (v_clip - returns[b, t]) ** 2
        total += max(loss1, loss2)
        clipped += float(loss2 > loss1)
        vpred += v[b, t]
        n += 1
    return 0.5 * total / n, {"clipfrac": clipped / n, "vpred": vpred / n}


def policy_inputs(seed: int, shape: tuple[int, int], kind: str):
    """Random log-probs with ratios both inside and outside the clip range, away from its edges."""
    rng = np.random.default_rng(seed)
    B, T = shape
    while True:
        logp = -rng.exponential(1.5, size=shape)
        old = logp + rng.normal(0, 0.25, size=shape)
        ratio = np.exp(logp - old)
        if np.abs(np.abs(ratio - 1) - CLIPRANGE).min() > MARGIN:
            break
    ref = logp + rng.normal(0, 0.3, size=shape)
    adv = rng.normal(size=shape)
    return logp, old, ref, adv, make_mask(rng, B, T, kind)


def assert_metrics(got: dict[str, mx.array], expected: dict[str, float]) -> None:
    for key, value in expected.items():
        assert got[key].dtype == mx.float32 and got[key].ndim == 0, key
        np.testing.assert_allclose(got[key].item(), value, rtol=1e-4, atol=1e-6, err_msg=key)


# ----------------------------------------------------------------------------- PPO


@pytest.mark.parametrize("seed,shape,kind", cases())
def test_ppo_policy_loss_values_and_gradient(seed, shape, kind):
    logp, old, ref, adv, mask = policy_inputs(seed, shape, kind)
    m = mx.array(mask).astype(MASK_DTYPES[seed % 3])

    def loss_fn(lp: mx.array) -> tuple[mx.array, dict[str, mx.array]]:
        return ppo_policy_loss(lp, f32(old), f32(adv), m, CLIPRANGE)

    loss, metrics = loss_fn(f32(logp))
    ref_loss, ref_metrics, _ = naive_policy(logp, old, ref, adv, mask, CLIPRANGE)
    assert loss.dtype == mx.float32 and loss.ndim == 0
    np.testing.assert_allclose(loss.item(), ref_loss, rtol=1e-4, atol=1e-6)
    assert_metrics(metrics, ref_metrics)

    grad = mx.grad(lambda lp: loss_fn(lp)[0])(f32(logp))
    fd = central_differences(lambda lp: naive_policy(lp, old, ref, adv, mask, CLIPRANGE)[0], logp)
    np.testing.assert_allclose(np.array(grad), fd, rtol=1e-3, atol=1e-5)


def test_ppo_constants_get_no_gradient():
    logp, old, _, adv, mask = policy_inputs(7, (3, 6), "holes")
    m = mx.array(mask)

    def wrt_constants(o: mx.array, a: mx.array) -> mx.array:
        return ppo_policy_loss(f32(logp), o, a, m, CLIPRANGE)[0]

    g_old, g_adv = mx.grad(wrt_constants, argnums=(0, 1))(f32(old), f32(adv))
    assert not np.array(g_old).any() and not np.array(g_adv).any()


def test_ppo_hand_case():
    # ratio e^{0.5} ~ 1.65 with A = 1: clipped term -1.2 is chosen (max(-1.65, -1.2));
    # ratio 1 with A = -2: both 2; masked token ignored.
    logp = mx.array([[0.5, 0.0, 3.0]])
    old = mx.array([[0.0, 0.0, 0.0]])
    adv = mx.array([[1.0, -2.0, 5.0]])
    mask = mx.array([[True, True, False]])
    loss, metrics = ppo_policy_loss(logp, old, adv, mask, 0.2)
    assert loss.item() == pytest.approx((-1.2 + 2.0) / 2, rel=1e-6)
    assert metrics["clipfrac"].item() == pytest.approx(0.5)
    assert metrics["approxkl"].item() == pytest.approx(0.5 * 0.25 / 2, rel=1e-6)
    assert metrics["ratio"].item() == pytest.approx((math.exp(0.5) + 1) / 2, rel=1e-6)
    # The clipped token passes no gradient; the unclipped one gets -A r / n = 2 / 2.
    grad = mx.grad(lambda lp: ppo_policy_loss(lp, old, adv, mask, 0.2)[0])(logp)
    np.testing.assert_allclose(np.array(grad), [[0.0, 1.0, 0.0]], atol=1e-6)


# ----------------------------------------------------------------------------- GRPO


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("seed,shape,kind", cases())
def test_grpo_policy_loss_values_and_gradient(seed, shape, kind, beta):
    logp, old, ref, _, mask = policy_inputs(seed, shape, kind)
    seq_adv = np.random.default_rng(seed + 10).normal(size=shape[0])
    adv = np.repeat(seq_adv[:, None], shape[1], axis=1)  # (B, T) for the naive loop
    m = mx.array(mask).astype(MASK_DTYPES[(seed + 1) % 3])

    def loss_fn(lp: mx.array) -> tuple[mx.array, dict[str, mx.array]]:
        return grpo_policy_loss(lp, f32(old), f32(ref), f32(seq_adv), m, CLIPRANGE, beta)

    loss, metrics = loss_fn(f32(logp))
    ref_loss, ref_metrics, ref_kl = naive_policy(logp, old, ref, adv, mask, CLIPRANGE, beta)
    np.testing.assert_allclose(loss.item(), ref_loss, rtol=1e-4, atol=1e-6)
    assert_metrics(metrics, {**ref_metrics, "kl": ref_kl})

    grad = mx.grad(lambda lp: loss_fn(lp)[0])(f32(logp))
    fd = central_differences(
        lambda lp: naive_policy(lp, old, ref, adv, mask, CLIPRANGE, beta)[0], logp
    )
    np.testing.assert_allclose(np.array(grad), fd, rtol=1e-3, atol=1e-5)


def test_grpo_constants_get_no_gradient():
    logp, old, ref, _, mask = policy_inputs(8, (3, 6), "prefix")
    adv = mx.array([1.0, -0.5, 2.0])

    def wrt_constants(o: mx.array, r: mx.array, a: mx.array) -> mx.array:
        return grpo_policy_loss(f32(logp), o, r, a, mx.array(mask), CLIPRANGE, 0.1)[0]

    grads = mx.grad(wrt_constants, argnums=(0, 1, 2))(f32(old), f32(ref), adv)
    assert all(not np.array(g).any() for g in grads)


def test_grpo_shape_errors():
    z = mx.zeros((2, 3))
    with pytest.raises(
        ValueError, match=r"advantages has shape \(2, 3\) but logprobs has \(2, 3\)"
    ):
        grpo_policy_loss(z, z, z, z, z, 0.2, 0.1)
    with pytest.raises(ValueError, match=r"ref_logprobs has shape \(2, 4\) but logprobs has"):
        grpo_policy_loss(z, z, mx.zeros((2, 4)), mx.zeros((2,)), z, 0.2, 0.1)
    with pytest.raises(ValueError, match="beta"):
        grpo_policy_loss(z, z, z, mx.zeros((2,)), z, 0.2, -1.0)


# ----------------------------------------------------------------------------- value loss


def value_inputs(seed: int, shape: tuple[int, int], kind: str):
    rng = np.random.default_rng(seed + 50)
    B, T = shape
    while True:
        old_v = rng.normal(size=shape)
        v = old_v + rng.normal(0, 0.3, size=shape)
        returns = old_v + rng.normal(0, 0.5, size=shape)
        v_clip = np.clip(v, old_v - CLIPRANGE, old_v + CLIPRANGE)
        gap = np.abs((v - returns) ** 2 - (v_clip - returns) ** 2)
        outside = np.abs(v - old_v) > CLIPRANGE
        edge_ok = np.abs(np.abs(v - old_v) - CLIPRANGE).min() > MARGIN
        if edge_ok and (gap[outside].min(initial=1.0) > MARGIN):
            return v, old_v, returns, make_mask(rng, B, T, kind)


@pytest.mark.parametrize("seed,shape,kind", cases())
def test_clipped_value_loss_values_and_gradient(seed, shape, kind):
    v, old_v, returns, mask = value_inputs(seed, shape, kind)
    m = mx.array(mask).astype(MASK_DTYPES[(seed + 2) % 3])

    def loss_fn(values: mx.array) -> tuple[mx.array, dict[str, mx.array]]:
        return clipped_value_loss(values, f32(old_v), f32(returns), m, CLIPRANGE)

    loss, metrics = loss_fn(f32(v))
    ref_loss, ref_metrics = naive_value(v, old_v, returns, mask, CLIPRANGE)
    assert loss.dtype == mx.float32 and loss.ndim == 0
    np.testing.assert_allclose(loss.item(), ref_loss, rtol=1e-4, atol=1e-6)
    assert_metrics(metrics, ref_metrics)

    grad = mx.grad(lambda values: loss_fn(values)[0])(f32(v))
    fd = central_differences(lambda x: naive_value(x, old_v, returns, mask, CLIPRANGE)[0], v)
    np.testing.assert_allclose(np.array(grad), fd, rtol=1e-3, atol=1e-5)


def test_value_loss_hand_case_and_constants():
    values = mx.array([[1.0, 0.0, 7.0]])
    old_values = mx.array([[0.0, 0.0, 0.0]])
    returns = mx.array([[2.0, 1.0, 0.0]])
    mask = mx.array([[1, 1, 0]])
    # token 0: (1 - 2)^2 = 1 vs clipped (0.2 - 2)^2 = 3.24 -> 3.24, clipped; token 1: 1 vs 1.
    loss, metrics = clipped_value_loss(values, old_values, returns, mask, 0.2)
    assert loss.item() == pytest.approx(0.5 * (3.24 + 1.0) / 2, rel=1e-6)
    assert metrics["clipfrac"].item() == pytest.approx(0.5)
    assert metrics["vpred"].item() == pytest.approx(0.5)

    def wrt_constants(o: mx.array, r: mx.array) -> mx.array:
        return clipped_value_loss(values, o, r, mask, 0.2)[0]

    g_old, g_ret = mx.grad(wrt_constants, argnums=(0, 1))(old_values, returns)
    assert not np.array(g_old).any() and not np.array(g_ret).any()


def test_value_loss_shape_errors():
    z = mx.zeros((2, 3))
    with pytest.raises(ValueError, match=r"returns has shape \(2, 4\) but values has \(2, 3\)"):
        clipped_value_loss(z, z, mx.zeros((2, 4)), z, 0.2)
    with pytest.raises(ValueError, match=r"mask has shape \(2, 4\) but logprobs has \(2, 3\)"):
        ppo_policy_loss(z, z, z, mx.zeros((2, 4)), 0.2)
    with pytest.raises(ValueError, match="cliprange_value"):
        clipped_value_loss(z, z, z, z, -0.2)


# ----------------------------------------------------------------------------- compiled step


def test_losses_run_compiled_without_host_sync():
    """mx.compile refuses host syncs (item(), shape-dependent Python control flow on values)."""
    logp, old, ref, adv, mask = policy_inputs(3, (3, 6), "prefix")
    v, old_v, returns, _ = value_inputs(3, (3, 6), "prefix")
    m = mx.array(mask)
    seq_adv = f32(adv[:, 0])

    def step(lp: mx.array, values: mx.array) -> tuple[mx.array, dict[str, mx.array]]:
        pg, pg_metrics = ppo_policy_loss(lp, f32(old), f32(adv), m, CLIPRANGE)
        gr, gr_metrics = grpo_policy_loss(lp, f32(old), f32(ref), seq_adv, m, CLIPRANGE, 0.1)
        vf, vf_metrics = clipped_value_loss(values, f32(old_v), f32(returns), m, CLIPRANGE)
        return pg + gr + vf, {**pg_metrics, **gr_metrics, **vf_metrics}

    eager = mx.value_and_grad(step, argnums=(0, 1))(f32(logp), f32(v))
    compiled = mx.compile(mx.value_and_grad(step, argnums=(0, 1)))(f32(logp), f32(v))
    (loss_e, metrics_e), grads_e = eager
    (loss_c, metrics_c), grads_c = compiled
    assert loss_c.item() == pytest.approx(loss_e.item(), rel=1e-6)
    for key in metrics_e:
        assert metrics_c[key].item() == pytest.approx(metrics_e[key].item(), rel=1e-6, abs=1e-7)
    for g_e, g_c in zip(grads_e, grads_c):
        np.testing.assert_allclose(np.array(g_c), np.array(g_e), rtol=1e-5, atol=1e-7)


def test_losses_compile_with_every_array_an_input():
    """The mask, the old values and the returns as traced inputs of the compiled function (not
    constants captured by it): a loss that validated its mask on the host could not compile."""
    logp, old, ref, adv, mask = policy_inputs(3, (3, 6), "prefix")
    v, old_v, returns, _ = value_inputs(3, (3, 6), "prefix")
    seq_adv = f32(adv[:, 0])

    def step(*arrays: mx.array) -> mx.array:
        lp, o, r, a, sa, m, values, ov, ret = arrays
        total = ppo_policy_loss(lp, o, a, m, CLIPRANGE)[0]
        total = total + rloo_policy_loss(lp, o, sa, m, CLIPRANGE)[0]
        for level in ("token", "sequence"):
            total = (
                total
                + grpo_policy_loss(
                    lp, o, r, sa, m, CLIPRANGE, 0.1, importance_sampling_level=level
                )[0]
            )
        return total + clipped_value_loss(values, ov, ret, m, CLIPRANGE)[0]

    arrays = [f32(logp), f32(old), f32(ref), f32(adv), seq_adv, mx.array(mask)]
    arrays += [f32(v), f32(old_v), f32(returns)]
    assert mx.compile(step)(*arrays).item() == pytest.approx(step(*arrays).item(), rel=1e-6)


def test_value_loss_with_no_clip_range():
    """cliprange_value = 0 is allowed: every move from the rollout value is clipped away."""
    values, old_values = mx.array([[1.0, -1.0]]), mx.array([[0.5, 0.0]])
    returns = mx.array([[0.0, 0.0]])
    loss, metrics = clipped_value_loss(values, old_values, returns, mx.array([[1, 1]]), 0.0)
    # max((v - R)^2, (v_old - R)^2): max(1, 0.25) and max(1, 0)
    assert loss.item() == pytest.approx(0.5 * (1.0 + 1.0) / 2)
    assert metrics["clipfrac"].item() == 0.0


def test_value_loss_checks_every_shape():
    z = mx.zeros((2, 3))
    with pytest.raises(ValueError, match=r"old_values has shape \(2, 4\) but values has"):
        clipped_value_loss(z, mx.zeros((2, 4)), z, z, 0.2)
    with pytest.raises(ValueError, match=r"mask has shape \(2, 4\) but values has"):
        clipped_value_loss(z, z, z, mx.zeros((2, 4)), 0.2)


def test_policy_losses_name_the_argument_of_a_wrong_shape():
    z, wide = mx.zeros((2, 3)), mx.zeros((2, 4))
    seq = mx.zeros((2,))
    cases = [
        (lambda: aggregate_loss(z, wide, "bnpo"), r"^mask has shape \(2, 4\) but per_token has"),
        (lambda: aggregate_loss(seq, seq, "bnpo"), r"^per_token must have shape \(B, T\)"),
        (
            lambda: ppo_policy_loss(z, wide, z, z, 0.2),
            r"^old_logprobs has shape \(2, 4\) but logprobs",
        ),
        (
            lambda: ppo_policy_loss(z, z, wide, z, 0.2),
            r"^advantages has shape \(2, 4\) but logprobs",
        ),
        (lambda: ppo_policy_loss(seq, seq, seq, seq, 0.2), r"^logprobs must have shape \(B, T\)"),
        (
            lambda: grpo_policy_loss(z, wide, z, seq, z, 0.2, 0.0),
            r"^old_logprobs has shape \(2, 4\)",
        ),
        (
            lambda: grpo_policy_loss(z, z, wide, seq, z, 0.2, 0.0),
            r"^ref_logprobs has shape \(2, 4\)",
        ),
        (
            lambda: grpo_policy_loss(z, z, z, seq, wide, 0.2, 0.0),
            r"^mask has shape \(2, 4\) but logprobs",
        ),
        (lambda: grpo_policy_loss(seq, seq, seq, seq, seq, 0.2, 0.0), r"^logprobs must have shape"),
        (lambda: grpo_policy_loss(z, z, z, z, z, 0.2, 0.0), r"GRPO takes one advantage per row"),
        (lambda: rloo_policy_loss(z, wide, seq, z, 0.2), r"^old_logprobs has shape \(2, 4\)"),
        (lambda: rloo_policy_loss(z, z, seq, wide, 0.2), r"^mask has shape \(2, 4\)"),
        (lambda: rloo_policy_loss(seq, seq, seq, seq, 0.2), r"^logprobs must have shape"),
        (lambda: rloo_policy_loss(z, z, z, z, 0.2), r"RLOO takes one advantage per row"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


def test_micro_batch_weights_edge_cases():
    """One micro-batch; counts of one token (the clamp at 1 must not touch them); bad input."""
    assert micro_batch_weights("bnpo", mx.array([4.0])).tolist() == [1.0]
    assert micro_batch_weights("dapo", mx.array([4.0])).tolist() == [1.0]
    assert micro_batch_weights("bnpo", mx.array([1.0, 0.0])).tolist() == [0.5, 0.0]
    assert micro_batch_weights("dapo", mx.array([1.0, 0.0])).tolist() == [1.0, 0.0]
    grpo = micro_batch_weights("grpo", mx.array([1.0, 2.0, 3.0, 4.0]))
    assert grpo.dtype == mx.float32 and grpo.tolist() == [0.25] * 4
    with pytest.raises(
        ValueError, match=r"^token_counts must have shape \(n,\), n >= 1, got \(2, 2\)$"
    ):
        micro_batch_weights("bnpo", mx.ones((2, 2)))
    with pytest.raises(
        ValueError, match=r"^token_counts must have shape \(n,\), n >= 1, got \(0,\)$"
    ):
        micro_batch_weights("bnpo", mx.zeros((0,)))
    with pytest.raises(
        ValueError, match="^loss_type must be one of grpo, dr_grpo, dapo, bnpo; got 'x'$"
    ):
        micro_batch_weights("x", mx.ones((2,)))  # type: ignore[arg-type]


def test_clip_bounds_and_indicators_at_their_edges():
    """A clip range of 0 is allowed (the ratio is pinned at 1); a ratio exactly at a bound is
    not outside it, and an advantage of 0 is neither low nor high."""
    logp = mx.array([[-1.0, -1.0, -1.0, -1.0]])
    old = mx.array([[-1.0, -1.0, 0.0, -2.0]])  # ratios 1, 1, e^-1, e^1
    adv = mx.array([[-1.0, 1.0, 0.0, 0.0]])
    mask = mx.ones((1, 4))
    _, metrics = ppo_policy_loss(logp, old, adv, mask, 0.0, cliprange_high=0.0)
    assert metrics["clip_ratio/low_mean"].item() == 0.0
    assert metrics["clip_ratio/high_mean"].item() == 0.0
    assert metrics["clip_ratio/region_mean"].item() == 0.0
    with pytest.raises(ValueError, match=r"^cliprange must be >= 0, got -0.1$"):
        ppo_policy_loss(logp, old, adv, mask, -0.1)
    with pytest.raises(ValueError, match=r"^cliprange_high must be >= 0, got -0.1$"):
        ppo_policy_loss(logp, old, adv, mask, 0.2, cliprange_high=-0.1)


def test_aggregate_loss_edges():
    per_token, mask = mx.array([[2.0, 4.0]]), mx.array([[1, 0]])
    assert aggregate_loss(per_token, mask, "dr_grpo", max_completion_length=1).item() == 2.0
    with pytest.raises(ValueError, match=r"max_completion_length >= 1 .*got 0$"):
        aggregate_loss(per_token, mask, "dr_grpo", max_completion_length=0)
    with pytest.raises(
        ValueError, match="^loss_type must be one of grpo, dr_grpo, dapo, bnpo; got 'x'$"
    ):
        aggregate_loss(per_token, mask, "x")  # type: ignore[arg-type]


def test_grpo_with_beta_one_and_a_row_without_tokens():
    """beta = 1 adds the whole k3; with sequence ratios, a row without tokens (every token
    masked) is left out of the ratio metrics."""
    logp = mx.array([[-1.0, -2.0], [-0.5, -0.5], [-1.0, -1.0]])
    old = mx.array([[-1.2, -2.4], [-0.5, -0.7], [-3.0, -3.0]])
    ref = mx.array([[-0.9, -2.5], [-0.4, -0.6], [-1.0, -1.0]])
    adv = mx.array([1.0, -1.0, 2.0])
    mask = mx.array([[1, 1], [1, 0], [0, 0]])
    loss, metrics = grpo_policy_loss(
        logp, old, ref, adv, mask, 10.0, 1.0, importance_sampling_level="sequence",
        loss_type="bnpo",
    )  # fmt: skip
    d = np.array(ref) - np.array(logp)
    k3 = np.exp(d) - d - 1
    ratio0 = math.exp((0.2 + 0.4) / 2)  # row 0: the mean of its log-ratios 0.2 and 0.4
    ratio1 = math.exp(0.0)
    # the clip (10) never binds: l = -A r + k3, token mean over the 3 valid tokens
    expected = (-1.0 * ratio0 + k3[0, 0] - 1.0 * ratio0 + k3[0, 1] + 1.0 * ratio1 + k3[1, 0]) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert metrics["ratio"].item() == pytest.approx((ratio0 + ratio1) / 2, rel=1e-6)


def test_rloo_metrics_by_hand():
    logp = mx.array([[-1.0, -2.0], [-0.5, -0.5]])
    old = mx.array([[-1.5, -2.0], [-0.5, -0.3]])
    mask = mx.array([[1, 1], [1, 0]])
    _, metrics = rloo_policy_loss(logp, old, mx.array([1.0, -1.0]), mask, 0.2)
    # log-ratios 0.5, 0 | 0 (the masked -0.2 is not counted); sequence ratios e^0.5 and e^0
    assert metrics["approxkl"].item() == pytest.approx(0.5 * 0.25 / 3, rel=1e-6)
    assert metrics["ratio"].item() == pytest.approx((math.exp(0.5) + 1.0) / 2, rel=1e-6)
    assert metrics["clipfrac"].item() == pytest.approx(0.5)  # row 0: r = 1.65 > 1.2, A > 0


# ------------------------------------------------ GRPO variants, asymmetric clip, GSPO, RLOO
EPS_HIGH = 0.28
CLIP_EDGES = (1 - CLIPRANGE, 1 + CLIPRANGE, 1 + EPS_HIGH)


def naive_grpo_variant(logp, old, ref, seq_adv, mask, eps_high, beta, loss_type, level, max_len):
    """Float64 loops: GRPO's per-token loss with ratio r_bt (token) or r_b (sequence: exp of the
    row's mean log-ratio), clip to [1 - CLIPRANGE, 1 + eps_high], aggregated per loss_type."""
    B, T = logp.shape
    losses = np.zeros((B, T))
    ratios = np.ones((B, T))
    for b in range(B):
        tokens = [t for t in range(T) if mask[b, t]]
        seq = sum(logp[b, t] - old[b, t] for t in tokens) / max(len(tokens), 1)
        for t in range(T):
            ratio = math.exp(seq if level == "sequence" else logp[b, t] - old[b, t])
            ratios[b, t] = ratio
            clipped = min(max(ratio, 1 - CLIPRANGE), 1 + eps_high)
            kl = math.exp(ref[b, t] - logp[b, t]) - (ref[b, t] - logp[b, t]) - 1
            losses[b, t] = max(-seq_adv[b] * ratio, -seq_adv[b] * clipped) + beta * kl
    n = [sum(1 for t in range(T) if mask[b, t]) for b in range(B)]
    total = sum(losses[b, t] for b in range(B) for t in range(T) if mask[b, t])
    if loss_type == "grpo":
        loss = (
            sum(sum(losses[b, t] for t in range(T) if mask[b, t]) / max(n[b], 1) for b in range(B))
            / B
        )
    elif loss_type == "dr_grpo":
        loss = total / (B * max_len)
    else:  # dapo, bnpo: the micro-batch's token mean
        loss = total / max(sum(n), 1)
    # Ratio metrics: per token, or per sequence (rows that have a token).
    if level == "sequence":
        units = [(b, 0) for b in range(B) if n[b] > 0]
    else:
        units = [(b, t) for b in range(B) for t in range(T) if mask[b, t]]
    low = [ratios[u] < 1 - CLIPRANGE and seq_adv[u[0]] < 0 for u in units]
    high = [ratios[u] > 1 + eps_high and seq_adv[u[0]] > 0 for u in units]
    metrics = {
        "ratio": np.mean([ratios[u] for u in units]),
        "clipfrac": np.mean([lo or hi for lo, hi in zip(low, high)]),
        "clip_ratio/low_mean": np.mean(low),
        "clip_ratio/high_mean": np.mean(high),
        "clip_ratio/region_mean": np.mean([lo or hi for lo, hi in zip(low, high)]),
    }
    return loss, metrics


def variant_inputs(seed: int, shape: tuple[int, int], kind: str):
    """Log-probs whose token and sequence ratios lie inside and outside both clip ranges, away
    from every clip edge (finite differences stay valid)."""
    rng = np.random.default_rng(seed + 100)
    B, T = shape
    mask = make_mask(rng, B, T, kind)
    while True:
        logp = -rng.exponential(1.5, size=shape)
        row_shift = rng.normal(0, 0.25, size=(B, 1))
        old = logp + rng.normal(0, 0.25, size=shape) + row_shift
        d = logp - old
        seq = np.array([np.exp(d[b][mask[b]].mean()) for b in range(B)])
        ratios = np.concatenate([np.exp(d).ravel(), seq])
        if min(np.abs(ratios - e).min() for e in CLIP_EDGES) > MARGIN:
            break
    ref = logp + rng.normal(0, 0.3, size=shape)
    seq_adv = rng.normal(size=B)
    return logp, old, ref, seq_adv, mask


VARIANT_CASES = [(0, (1, 1), "prefix"), (0, (4, 7), "prefix"), (1, (4, 7), "holes")]


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("eps_high", [None, EPS_HIGH])
@pytest.mark.parametrize("seed,shape,kind", VARIANT_CASES)
def test_grpo_variants_values_and_gradient(loss_type, level, eps_high, seed, shape, kind):
    logp, old, ref, seq_adv, mask = variant_inputs(seed, shape, kind)
    beta, max_len = 0.04, shape[1] + 3
    upper = CLIPRANGE if eps_high is None else eps_high

    def loss_fn(lp: mx.array) -> tuple[mx.array, dict[str, mx.array]]:
        return grpo_policy_loss(
            lp,
            f32(old),
            f32(ref),
            f32(seq_adv),
            mx.array(mask),
            CLIPRANGE,
            beta,
            cliprange_high=eps_high,
            loss_type=loss_type,
            importance_sampling_level=level,
            max_completion_length=max_len,
        )

    def naive(lp: np.ndarray) -> tuple[float, dict[str, float]]:
        return naive_grpo_variant(
            lp, old, ref, seq_adv, mask, upper, beta, loss_type, level, max_len
        )

    loss, metrics = loss_fn(f32(logp))
    want_loss, want_metrics = naive(logp)
    np.testing.assert_allclose(loss.item(), want_loss, rtol=1e-4, atol=1e-6)
    assert_metrics(metrics, want_metrics)
    grad = mx.grad(lambda lp: loss_fn(lp)[0])(f32(logp))
    fd = central_differences(lambda lp: naive(lp)[0], logp)
    np.testing.assert_allclose(np.array(grad), fd, rtol=1e-3, atol=1e-5)


def test_asymmetric_clip_hand_case():
    # Token 0: r = e^0.25 = 1.284 with A = 1: above 1 + 0.28, clipped high (loss -1.28).
    # Token 1: r = e^0.25 with A = 1 and symmetric eps 0.2 would be clipped at 1.2; here not.
    # Token 2: r = e^-0.3 = 0.741 with A = -1: below 0.8, clipped low (loss 0.8).
    logp = mx.array([[0.25, 0.22, -0.3]])
    old = mx.zeros((1, 3))
    adv = mx.array([[1.0, 1.0, -1.0]])
    mask = mx.ones((1, 3))
    loss, metrics = ppo_policy_loss(logp, old, adv, mask, 0.2, cliprange_high=0.28)
    assert loss.item() == pytest.approx((-1.28 - math.exp(0.22) + 0.8) / 3, rel=1e-6)
    assert metrics["clip_ratio/high_mean"].item() == pytest.approx(1 / 3)
    assert metrics["clip_ratio/low_mean"].item() == pytest.approx(1 / 3)
    assert metrics["clip_ratio/region_mean"].item() == pytest.approx(2 / 3)
    assert metrics["clipfrac"].item() == pytest.approx(2 / 3)
    # The clipped tokens pass no gradient; token 1 gets -A r / 3.
    grad = mx.grad(lambda lp: ppo_policy_loss(lp, old, adv, mask, 0.2, cliprange_high=0.28)[0])(
        logp
    )
    np.testing.assert_allclose(np.array(grad), [[0.0, -math.exp(0.22) / 3, 0.0]], rtol=1e-6)
    # Symmetric: token 1 is clipped too.
    _, symmetric = ppo_policy_loss(logp, old, adv, mask, 0.2)
    assert symmetric["clip_ratio/high_mean"].item() == pytest.approx(2 / 3)


def test_sequence_level_ratio_hand_case():
    """GSPO: one ratio per row, exp of the mean log-ratio over its valid tokens (TRL)."""
    logp = mx.array([[0.1, 0.3, 9.0], [0.0, 0.0, 0.0]])
    old = mx.zeros((2, 3))
    adv = mx.array([1.0, -1.0])
    mask = mx.array([[1, 1, 0], [1, 0, 0]])
    loss, metrics = grpo_policy_loss(
        logp, old, old, adv, mask, 0.2, 0.0, importance_sampling_level="sequence", loss_type="grpo"
    )
    # Row 0: r = e^0.2 = 1.2214 > 1.2 with A = 1 -> clipped, loss -1.2; row 1: r = 1, loss 1.
    assert loss.item() == pytest.approx((-1.2 + 1.0) / 2, rel=1e-6)
    assert metrics["ratio"].item() == pytest.approx((math.exp(0.2) + 1) / 2, rel=1e-6)
    assert metrics["clip_ratio/high_mean"].item() == pytest.approx(0.5)
    # Row 1's gradient: d/dlogp [-A exp(mean)] = -A r / n_b = 1 on its one token, / B = 0.5.
    grad = mx.grad(
        lambda lp: grpo_policy_loss(
            lp,
            old,
            old,
            adv,
            mask,
            0.2,
            0.0,
            importance_sampling_level="sequence",
            loss_type="grpo",
        )[0]
    )(logp)
    np.testing.assert_allclose(np.array(grad), [[0.0, 0.0, 0.0], [0.5, 0.0, 0.0]], atol=1e-7)


def test_aggregate_loss_hand_case():
    per_token = mx.array([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [7.0, 7.0, 7.0]])
    mask = mx.array([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # the last row masked out (truncated)
    assert aggregate_loss(per_token, mask, "grpo").item() == pytest.approx((2.0 + 4.0 + 0.0) / 3)
    assert aggregate_loss(per_token, mask, "dapo").item() == pytest.approx(10.0 / 4)
    assert aggregate_loss(per_token, mask, "bnpo").item() == pytest.approx(10.0 / 4)
    dr = aggregate_loss(per_token, mask, "dr_grpo", max_completion_length=5)
    assert dr.item() == pytest.approx(10.0 / (3 * 5))
    # Every row masked: 0, not NaN (a micro-batch of truncated completions only).
    assert aggregate_loss(per_token, mx.zeros((3, 3)), "dapo").item() == 0.0


def test_micro_batch_weights_give_the_whole_batch_loss():
    """Simulated data parallelism: R ranks x n micro-batches of b rows. (1/R) sum_r sum_k
    w_rk loss_rk equals each loss_type's formula over the whole batch (naive, float64)."""
    R, n, b, T, max_len = 2, 3, 2, 5, 8
    rng = np.random.default_rng(5)
    per_token = rng.normal(size=(R, n, b, T))
    mask = rng.random((R, n, b, T)) < 0.6
    mask[0, 1] = False  # a micro-batch with no valid token at all
    counts = mask.sum(axis=(2, 3)).astype(np.float32)  # (R, n)
    for loss_type in ("grpo", "dr_grpo", "dapo", "bnpo"):
        total = mx.array(0.0)
        for r in range(R):
            weights = micro_batch_weights(
                loss_type, mx.array(counts[r]), mx.array(counts.sum(axis=0)), world_size=R
            )
            for k in range(n):
                loss = aggregate_loss(
                    f32(per_token[r, k]), mx.array(mask[r, k]), loss_type, max_len
                )
                total = total + weights[k] * loss / R
        rows = [(r, k, i) for r in range(R) for k in range(n) for i in range(b)]
        token_sum = float((per_token * mask).sum())
        if loss_type == "grpo":
            want = np.mean(
                [(per_token[row] * mask[row]).sum() / max(mask[row].sum(), 1) for row in rows]
            )
        elif loss_type == "dr_grpo":
            want = token_sum / (len(rows) * max_len)
        elif loss_type == "dapo":
            want = token_sum / mask.sum()
        else:  # bnpo: token mean of step k over all ranks, averaged over the n steps
            want = np.mean(
                [(per_token[:, k] * mask[:, k]).sum() / max(mask[:, k].sum(), 1) for k in range(n)]
            )
        assert total.item() == pytest.approx(want, rel=1e-5), loss_type
    # One process: bnpo and the grpo family weigh micro-batches equally (the trainer's 1/n).
    ones = micro_batch_weights("bnpo", mx.array([3.0, 5.0]))
    np.testing.assert_allclose(np.array(ones), [0.5, 0.5])


def naive_rloo(logp, old, seq_adv, mask, eps_high):
    B, T = logp.shape
    total = 0.0
    for b in range(B):
        ratio = math.exp(sum(logp[b, t] - old[b, t] for t in range(T) if mask[b, t]))
        clipped = min(max(ratio, 1 - CLIPRANGE), 1 + eps_high)
        total += max(-seq_adv[b] * ratio, -seq_adv[b] * clipped)
    return total / B


@pytest.mark.parametrize("eps_high", [None, EPS_HIGH])
@pytest.mark.parametrize("seed,shape,kind", VARIANT_CASES)
def test_rloo_policy_loss_values_and_gradient(eps_high, seed, shape, kind):
    rng = np.random.default_rng(seed + 200)
    B, T = shape
    mask = make_mask(rng, B, T, kind)
    while True:  # sequence ratios (sums of log-ratios) away from the clip edges
        logp = -rng.exponential(1.5, size=shape)
        old = logp + rng.normal(0, 0.15, size=shape)
        seq = np.exp(((logp - old) * mask).sum(axis=1))
        if min(np.abs(seq - e).min() for e in CLIP_EDGES) > MARGIN:
            break
    seq_adv = rng.normal(size=B)
    upper = CLIPRANGE if eps_high is None else eps_high

    def loss_fn(lp: mx.array) -> mx.array:
        return rloo_policy_loss(
            lp, f32(old), f32(seq_adv), mx.array(mask), CLIPRANGE, cliprange_high=eps_high
        )[0]

    np.testing.assert_allclose(
        loss_fn(f32(logp)).item(), naive_rloo(logp, old, seq_adv, mask, upper), rtol=1e-4, atol=1e-6
    )
    grad = mx.grad(loss_fn)(f32(logp))
    fd = central_differences(lambda lp: naive_rloo(lp, old, seq_adv, mask, upper), logp)
    np.testing.assert_allclose(np.array(grad), fd, rtol=1e-3, atol=1e-5)


def test_rloo_loss_hand_case_and_constants():
    # Row 0: log-ratios 0.1 + 0.05 -> r = e^0.15 = 1.162 (inside), A = 2: loss -2 r.
    # Row 1: r = e^0.3 = 1.35 > 1.2 with A = 1: clipped, loss -1.2, no gradient.
    logp = mx.array([[0.1, 0.05, 4.0], [0.3, 0.0, 0.0]])
    old = mx.zeros((2, 3))
    adv = mx.array([2.0, 1.0])
    mask = mx.array([[1, 1, 0], [1, 1, 1]])
    loss, metrics = rloo_policy_loss(logp, old, adv, mask, 0.2)
    assert loss.item() == pytest.approx((-2 * math.exp(0.15) - 1.2) / 2, rel=1e-6)
    assert metrics["clipfrac"].item() == pytest.approx(0.5)
    assert metrics["clip_ratio/high_mean"].item() == pytest.approx(0.5)
    grad = mx.grad(lambda lp: rloo_policy_loss(lp, old, adv, mask, 0.2)[0])(logp)
    # Every valid token of row 0 gets -A r / B = -e^0.15; the masked token and row 1 get 0.
    want = [[-math.exp(0.15), -math.exp(0.15), 0.0], [0.0, 0.0, 0.0]]
    np.testing.assert_allclose(np.array(grad), want, rtol=1e-6)
    g_old, g_adv = mx.grad(lambda o, a: rloo_policy_loss(logp, o, a, mask, 0.2)[0], argnums=(0, 1))(
        old, adv
    )
    assert not np.array(g_old).any() and not np.array(g_adv).any()


def test_loss_variant_errors():
    z = mx.zeros((2, 3))
    a = mx.zeros((2,))
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo_policy_loss(z, z, z, a, z, 0.2, 0.0, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="loss_type must be one of"):
        grpo_policy_loss(z, z, z, a, z, 0.2, 0.0, loss_type="seq_mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="importance_sampling_level"):
        grpo_policy_loss(z, z, z, a, z, 0.2, 0.0, importance_sampling_level="row")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cliprange_high must be >= 0"):
        ppo_policy_loss(z, z, z, z, 0.2, cliprange_high=-0.1)
    with pytest.raises(ValueError, match=r"RLOO takes one advantage per row"):
        rloo_policy_loss(z, z, z, z, 0.2)
    with pytest.raises(ValueError, match="global_token_counts"):
        micro_batch_weights("dapo", mx.array([1.0, 2.0]), mx.array([3.0]))


def test_loss_variants_run_compiled_without_host_sync():
    logp, old, ref, seq_adv, mask = variant_inputs(4, (3, 6), "prefix")
    m = mx.array(mask)

    def step(lp: mx.array) -> tuple[mx.array, dict[str, mx.array]]:
        total, metrics = rloo_policy_loss(lp, f32(old), f32(seq_adv), m, CLIPRANGE)
        for loss_type in ("grpo", "dr_grpo", "dapo"):
            for level in ("token", "sequence"):
                loss, more = grpo_policy_loss(
                    lp,
                    f32(old),
                    f32(ref),
                    f32(seq_adv),
                    m,
                    CLIPRANGE,
                    0.04,
                    cliprange_high=EPS_HIGH,
                    loss_type=loss_type,
                    importance_sampling_level=level,
                    max_completion_length=8,
                )
                total = total + loss
                metrics.update({f"{loss_type}/{level}/{k}": v for k, v in more.items()})
        return total, metrics

    (loss_e, metrics_e), grad_e = mx.value_and_grad(step)(f32(logp))
    (loss_c, metrics_c), grad_c = mx.compile(mx.value_and_grad(step))(f32(logp))
    assert loss_c.item() == pytest.approx(loss_e.item(), rel=1e-6)
    for key in metrics_e:
        assert metrics_c[key].item() == pytest.approx(metrics_e[key].item(), rel=1e-6, abs=1e-7)
    np.testing.assert_allclose(np.array(grad_c), np.array(grad_e), rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------ compiled AdamW
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("bias_correction", [False, True])
def test_compiled_adamw_equals_mlx_adamw(weight_decay: float, bias_correction: bool) -> None:
    """training.optimizer.AdamW gives MLX's AdamW's parameters and state, bit for bit."""
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten

    from training.optimizer import AdamW

    models = [nn.Linear(24, 8), nn.Linear(24, 8)]
    models[1].update(models[0].parameters())
    optimizers = [
        cls(
            learning_rate=optim.linear_schedule(1e-2, 1e-3, 5),
            weight_decay=weight_decay,
            bias_correction=bias_correction,
        )
        for cls in (optim.AdamW, AdamW)
    ]
    rng = np.random.default_rng(0)
    for _ in range(4):
        grads = {
            "weight": mx.array(rng.normal(size=(8, 24)).astype(np.float32)),
            "bias": mx.array(rng.normal(size=(8,)).astype(np.float32)),
        }
        for model, optimizer in zip(models, optimizers):
            optimizer.update(model, grads)
            mx.eval(model.parameters(), optimizer.state)
    ours, theirs = (dict(tree_flatten(m.parameters())) for m in (models[1], models[0]))
    assert optimizers[0].step.item() == 4
    for name in theirs:
        assert mx.array_equal(ours[name], theirs[name]).item(), name
    state_ours, state_theirs = (dict(tree_flatten(o.state)) for o in optimizers[::-1])
    for name in state_theirs:
        assert mx.array_equal(state_ours[name], state_theirs[name]).item(), name


def numpy_adamw(
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> dict[str, np.ndarray]:
    """torch.optim.AdamW's documented algorithm (amsgrad off), in float64, one step per entry of
    ``grads``: p <- p - lr wd p; m <- b1 m + (1 - b1) g; v <- b2 v + (1 - b2) g^2;
    m_hat = m / (1 - b1^t); v_hat = v / (1 - b2^t); p <- p - lr m_hat / (sqrt(v_hat) + eps)."""
    b1, b2 = betas
    p = {k: v.astype(np.float64).copy() for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v2 = {k: np.zeros_like(v) for k, v in p.items()}
    for t, g in enumerate(grads, start=1):
        for k in p:
            p[k] = p[k] - lr * weight_decay * p[k]
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v2[k] = b2 * v2[k] + (1 - b2) * g[k] ** 2
            m_hat = m[k] / (1 - b1**t)
            v_hat = v2[k] / (1 - b2**t)
            p[k] = p[k] - lr * m_hat / (np.sqrt(v_hat) + eps)
    return p


def _adamw_problem() -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    rng = np.random.default_rng(3)
    params = {"weight": rng.normal(size=(8, 24)), "bias": rng.normal(size=(8,))}
    # Gradients of mixed scale (some entries far below eps) so eps and the corrections matter.
    grads = [
        {
            k: rng.normal(size=v.shape) * rng.choice([1e-7, 1e-3, 1.0], size=v.shape)
            for k, v in params.items()
        }
        for _ in range(6)
    ]
    return params, grads


def _run_ours(
    params: dict[str, np.ndarray], grads: list[dict[str, np.ndarray]], **kwargs: Any
) -> dict[str, np.ndarray]:
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from training.optimizer import AdamW

    model = nn.Linear(24, 8)
    model.update({k: f32(v) for k, v in params.items()})
    optimizer = AdamW(**kwargs)
    for g in grads:
        optimizer.update(model, {k: f32(v) for k, v in g.items()})
        mx.eval(model.parameters(), optimizer.state)
    return {
        k: np.array(v) for k, v in cast(list[tuple[str, Any]], tree_flatten(model.parameters()))
    }


ADAMW_SETTINGS = dict(learning_rate=1e-2, betas=[0.9, 0.999], eps=1e-5, weight_decay=0.01)


def test_adamw_with_bias_correction_matches_pytorch_algorithm() -> None:
    """AdamW(bias_correction=True) follows torch.optim.AdamW's documented update (NumPy, float64)."""
    params, grads = _adamw_problem()
    ours = _run_ours(params, grads, bias_correction=True, **ADAMW_SETTINGS)
    want = numpy_adamw(params, grads, 1e-2, (0.9, 0.999), 1e-5, 0.01)
    for k in want:
        np.testing.assert_allclose(ours[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_adamw_without_bias_correction_takes_larger_first_steps() -> None:
    """MLX's default (no correction): the first update is (1 - b1) / sqrt(1 - b2) = 3.16 times
    the bias-corrected one (lr * sign(g) when |g| >> eps), as the issue measured."""
    params, grads = _adamw_problem()
    big = {k: np.sign(v) for k, v in grads[0].items()}  # |g| = 1 >> eps: the ratio is clean
    settings = {**ADAMW_SETTINGS, "weight_decay": 0.0}
    moved = {
        bc: {
            k: v - params[k]
            for k, v in _run_ours(params, [big], bias_correction=bc, **settings).items()
        }
        for bc in (False, True)
    }
    for k in params:
        np.testing.assert_allclose(moved[True][k], -1e-2 * big[k], rtol=1e-4)
        np.testing.assert_allclose(
            moved[False][k] / moved[True][k], math.sqrt(1000) / 10, rtol=1e-3
        )


def test_adamw_with_bias_correction_matches_torch() -> None:
    """The same run through torch.optim.AdamW itself (skipped when torch is not installed)."""
    torch = pytest.importorskip("torch")
    params, grads = _adamw_problem()
    ours = _run_ours(params, grads, bias_correction=True, **ADAMW_SETTINGS)
    tensors = {k: torch.tensor(v.astype(np.float32), requires_grad=True) for k, v in params.items()}
    optimizer = torch.optim.AdamW(
        list(tensors.values()), lr=1e-2, betas=(0.9, 0.999), eps=1e-5, weight_decay=0.01
    )
    for g in grads:
        for k, t in tensors.items():
            t.grad = torch.tensor(g[k].astype(np.float32))
        optimizer.step()
    for k, t in tensors.items():
        np.testing.assert_allclose(ours[k], t.detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=k)


# ------------------------------------------------------------------ the shared optimiser step
def _regression_problem() -> tuple[Any, Any, list[tuple[mx.array, mx.array]]]:
    import mlx.nn as nn

    model = nn.Linear(6, 1)
    rng = np.random.default_rng(1)
    rows = [
        (mx.array(rng.normal(size=(n, 6)).astype(np.float32)), mx.array(rng.normal(size=(n, 1))))
        for n in (3, 5)
    ]

    def loss_fn(m: Any, batch: tuple[mx.array, mx.array]) -> tuple[mx.array, dict]:
        x, y = batch
        loss = ((m(x) - y) ** 2).mean()
        return loss, {"mse": loss}

    return model, nn.value_and_grad(model, loss_fn), rows


def _flat(model: Any) -> dict[str, np.ndarray]:
    from mlx.utils import tree_flatten

    return {
        k: np.array(v) for k, v in cast(list[tuple[str, Any]], tree_flatten(model.parameters()))
    }


def test_optimizer_step_accumulates_to_the_whole_batch_gradient() -> None:
    """Weighted micro-batch gradients (target shares) equal the whole batch's gradient."""
    import mlx.optimizers as optim

    from training.optimizer import optimizer_step

    model_a, vg_a, rows = _regression_problem()
    model_b, vg_b, _ = _regression_problem()
    model_b.update(model_a.parameters())
    whole = (mx.concatenate([r[0] for r in rows]), mx.concatenate([r[1] for r in rows]))
    out_a = optimizer_step(
        model_a, optim.SGD(0.1), vg_a, [whole], [1.0], max_grad_norm=math.inf, step=1
    )
    out_b = optimizer_step(
        model_b, optim.SGD(0.1), vg_b, rows, [3 / 8, 5 / 8], max_grad_norm=math.inf, step=1
    )
    assert out_a["loss"].item() == pytest.approx(out_b["loss"].item(), rel=1e-6)
    assert out_a["mse"].item() == pytest.approx(out_b["mse"].item(), rel=1e-6)
    params_b = _flat(model_b)
    for name, a in _flat(model_a).items():
        np.testing.assert_allclose(a, params_b[name], rtol=1e-5, atol=1e-6, err_msg=name)
    # Clipping: the reported norm is the pre-clip norm, the update uses the clipped gradient.
    model_c, vg_c, _ = _regression_problem()
    before = _flat(model_c)
    out_c = optimizer_step(
        model_c, optim.SGD(1.0), vg_c, [whole], [1.0], max_grad_norm=1e-3, step=1
    )
    assert float(np.asarray(out_c["grad_norm"])) > 1e-3
    moved = np.sqrt(sum(((v - before[k]) ** 2).sum() for k, v in _flat(model_c).items()))
    assert moved == pytest.approx(1e-3, rel=1e-3)


def test_optimizer_step_refuses_a_non_finite_loss_before_updating() -> None:
    import mlx.optimizers as optim

    from training.optimizer import optimizer_step

    model, vg, rows = _regression_problem()
    optimizer = optim.Adam(1e-2)
    optimizer.init(model.trainable_parameters())
    before = _flat(model)
    x, y = rows[0]
    with pytest.raises(ValueError, match="the value loss is inf .* at step 7; no update"):
        optimizer_step(
            model,
            optimizer,
            vg,
            [(x, y * 1e30)],
            [1.0],
            max_grad_norm=1.0,
            step=7,
            what="the value loss",
        )
    after = _flat(model)
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert optimizer.state["step"].item() == 0


@pytest.mark.slow
def test_optimizer_step_updates_a_group_of_parameters_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The update's evaluation by groups of parameters: the same weights and optimiser state as
    one evaluation, with a lower peak (one group's new weights and moments at a time)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from training import optimizer as opt

    def run(group_bytes: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], int]:
        # MLX may hand out a larger cached buffer than asked for, which active memory counts:
        # the peaks compared start from an empty cache, whatever the tests before left there.
        gc.collect()
        mx.clear_cache()
        mx.random.seed(0)
        model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])  # 1 MB per weight
        x = mx.random.normal((64, 512))

        def loss_fn(m: Any, batch: mx.array) -> tuple[mx.array, dict]:
            return (m(batch) ** 2).mean(), {}

        optimizer = opt.AdamW(learning_rate=1e-3)
        value_and_grad = nn.value_and_grad(model, loss_fn)
        monkeypatch.setattr(opt, "UPDATE_GROUP_BYTES", group_bytes)
        opt.optimizer_step(model, optimizer, value_and_grad, [x], [1.0], max_grad_norm=1.0, step=1)
        mx.reset_peak_memory()
        opt.optimizer_step(model, optimizer, value_and_grad, [x], [1.0], max_grad_norm=1.0, step=2)
        peak = mx.get_peak_memory()
        flat = cast(list[tuple[str, mx.array]], tree_flatten(optimizer.state))
        state = {k: np.array(v) for k, v in flat}
        return _flat(model), state, peak

    one_params, one_state, one_peak = run(1 << 40)
    params, state, peak = run(1 << 20)
    assert one_params.keys() == params.keys() and one_state.keys() == state.keys()
    assert all(np.array_equal(one_params[k], params[k]) for k in params)
    assert all(np.array_equal(one_state[k], state[k]) for k in state)
    # 8 MB of weights: in one evaluation their clipped gradients and new weights and moments
    # exist at once beside the old ones; by groups, about 1 MB's worth at a time.
    assert peak < one_peak - 8 * 2**20, (peak, one_peak)


def test_optimizer_step_updates_the_largest_parameter_last(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A parameter's update holds its new weight and moments beside the old ones, and each
    group's evaluation frees that group's gradients: the largest parameter (listed first, as an
    embedding is) updated last finds the other gradients freed, so the step peaks lower. The same
    weights and optimiser state either way."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from training import optimizer as opt

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(4096, 512)  # 8 MB, listed first
            self.layers = [nn.Linear(512, 512) for _ in range(8)]  # 1 MB each

        def __call__(self, ids: mx.array) -> mx.array:
            h = self.embed(ids)
            for layer in self.layers:
                h = layer(h)
            return h

    def run(order: Any) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], int]:
        mx.random.seed(0)
        model = Model()
        ids = mx.random.randint(0, 4096, (4, 8))

        def loss_fn(m: Any, batch: mx.array) -> tuple[mx.array, dict]:
            return (m(batch) ** 2).mean(), {}

        optimizer = opt.AdamW(learning_rate=1e-3)
        value_and_grad = nn.value_and_grad(model, loss_fn)
        monkeypatch.setattr(opt, "UPDATE_GROUP_BYTES", 1 << 20)  # a parameter per group
        monkeypatch.setattr(opt, "largest_last", order)
        opt.optimizer_step(
            model, optimizer, value_and_grad, [ids], [1.0], max_grad_norm=1.0, step=1
        )
        mx.eval(model.parameters(), optimizer.state)
        mx.reset_peak_memory()
        opt.optimizer_step(
            model, optimizer, value_and_grad, [ids], [1.0], max_grad_norm=1.0, step=2
        )
        peak = mx.get_peak_memory()
        flat = cast(list[tuple[str, mx.array]], tree_flatten(optimizer.state))
        return _flat(model), {k: np.array(v) for k, v in flat}, peak

    largest_last = opt.largest_last
    params, state, peak = run(largest_last)
    as_listed, listed_state, listed_peak = run(list)
    assert all(np.array_equal(params[k], as_listed[k]) for k in params)
    assert all(np.array_equal(state[k], listed_state[k]) for k in state)
    # Listed first, the embedding's update (its new weight and moments: 24 MB) ran beside the 8
    # linear layers' gradients (8 MB); last, beside none of them.
    assert peak < listed_peak - 6 * 2**20, (peak, listed_peak)
    sizes = [a.nbytes for a in largest_last([mx.zeros((3,)), mx.zeros((1,)), mx.zeros((2,))])]
    assert sizes == sorted(sizes)


def test_evaluate_in_groups_counts_its_evaluations() -> None:
    from base_setup.backend import evaluate_in_groups

    arrays = [mx.zeros((256,)) + i for i in range(10)]  # 1 KB each
    assert evaluate_in_groups(arrays, 3 * 1024) == 4  # 3 + 3 + 3 + 1
    assert evaluate_in_groups(arrays, 1) == 10
    assert evaluate_in_groups([], 1024) == 0
    assert all(np.array_equal(np.array(a), np.full(256, i)) for i, a in enumerate(arrays))


def test_entropy_bonus_against_a_naive_mean_with_its_gradient() -> None:
    from training.policy_loss import entropy_bonus

    rng = np.random.default_rng(0)
    logits = mx.array(rng.normal(size=(2, 3, 5)).astype(np.float32))  # (B, T, V)
    mask = mx.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])

    def entropy_of(z: mx.array) -> mx.array:
        logp = z - mx.logsumexp(z, axis=-1, keepdims=True)
        return -(mx.exp(logp) * logp).sum(axis=-1)  # (B, T)

    def total(z: mx.array) -> mx.array:
        loss, _ = entropy_bonus(mx.array(0.5), {}, entropy_of(z), mask, 0.1)
        return loss

    h = np.array(entropy_of(logits))
    naive_h = (h[0, 0] + h[0, 1] + h[1, 0]) / 3
    assert float(total(logits)) == pytest.approx(0.5 - 0.1 * naive_h, rel=1e-6)
    _, metrics = entropy_bonus(mx.array(0.5), {"x": mx.array(1.0)}, entropy_of(logits), mask, 0.1)
    assert set(metrics) == {"x", "entropy"}
    grad = np.array(mx.grad(total)(logits))
    assert np.abs(grad[0, 2]).max() == 0.0 and np.abs(grad[1, 1:]).max() == 0.0  # masked out
    assert np.abs(grad[0, 0]).max() > 0.0  # the bonus is differentiated
    # entropy_coef 0 is no bonus at all (the config's default): the loss bit for bit.
    loss0, metrics0 = entropy_bonus(mx.array(0.5), {}, entropy_of(logits), mask, 0.0)
    assert float(loss0) == 0.5 and float(metrics0["entropy"]) == pytest.approx(naive_h, rel=1e-6)


def test_entropy_bonus_refuses_bad_arguments_by_name() -> None:
    from training.policy_loss import entropy_bonus

    entropy, mask, loss = mx.ones((2, 3)), mx.ones((2, 3)), mx.array(0.5)
    with pytest.raises(ValueError, match=r"^entropy must have shape \(B, T\), got \(6,\)$"):
        entropy_bonus(loss, {}, entropy.reshape(6), mask.reshape(6), 0.1)
    with pytest.raises(
        ValueError, match=r"^mask has shape \(2, 4\) but entropy has \(2, 3\); they must match$"
    ):
        entropy_bonus(loss, {}, entropy, mx.ones((2, 4)), 0.1)
    # Negative (an entropy penalty), infinite and NaN weights are refused, as the config does.
    for coef in (-1.0, -1e-9, math.inf, math.nan):
        with pytest.raises(ValueError) as err:
            entropy_bonus(loss, {}, entropy, mask, coef)
        assert str(err.value) == (
            f"entropy_coef must be a finite number >= 0 (0 for no entropy bonus), got {coef}"
        )


def test_entropy_bonus_of_a_micro_batch_without_action_tokens_is_zero() -> None:
    """Every row dropped by mask_truncated_completions: H counts 0 (as the GRPO losses), not
    NaN, so the update neither logs NaN nor refuses a step."""
    from training.policy_loss import entropy_bonus

    h = mx.array([[0.7, 1.3], [0.2, 0.4]])

    def total(x: mx.array) -> mx.array:
        return entropy_bonus(mx.array(0.5), {}, x, mx.zeros((2, 2)), 0.1)[0]

    _, metrics = entropy_bonus(mx.array(0.5), {}, h, mx.zeros((2, 2), dtype=mx.bool_), 0.1)
    assert float(total(h)) == 0.5 and float(metrics["entropy"]) == 0.0
    assert np.array_equal(np.array(mx.grad(total)(h)), np.zeros((2, 2)))
