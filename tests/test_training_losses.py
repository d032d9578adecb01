"""training/: PPO and GRPO policy losses and the clipped value loss.

Values and metrics against naive float64 loops; gradients w.r.t. logprobs / values against central
finite differences of those loops; constants (old log-probs, reference, advantages, returns) get no
gradient; the losses run under mx.compile (so they never sync with the host).
"""

from __future__ import annotations

import math
from typing import Any, cast
from collections.abc import Callable

import mlx.core as mx
import numpy as np
import pytest

from training.policy_loss import grpo_policy_loss, ppo_policy_loss
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
