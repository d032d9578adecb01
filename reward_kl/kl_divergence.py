"""Per-token KL estimators between the policy and the reference, and the KL coefficient controllers.

The estimators (Schulman, "Approximating KL Divergence", 2020) estimate ``KL(pi || pi_ref)`` from
samples ``x ~ pi`` using ``log_ratio = logp(x) - ref_logp(x)``:

* ``k1 = log_ratio``: unbiased, high variance, can be negative per token.
* ``k2 = 0.5 * log_ratio^2``: biased, low variance, >= 0.
* ``k3 = exp(-log_ratio) + log_ratio - 1``: unbiased, low variance, >= 0 (GRPO's KL term).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import mlx.core as mx

from token_attribution.extractor import check_same_shape

KLEstimator = Literal["k1", "k2", "k3"]


def kl_estimate(logprobs: mx.array, ref_logprobs: mx.array, estimator: KLEstimator) -> mx.array:
    """Per-token KL estimate from the log-probs of the sampled tokens.

    With ``d = logprobs - ref_logprobs``: ``k1 = d``, ``k2 = 0.5 d^2``,
    ``k3 = exp(ref - logp) - (ref - logp) - 1 = exp(-d) + d - 1``.

    Args:
        logprobs: (B, T) log-probs of the sampled tokens under the policy.
        ref_logprobs: (B, T) log-probs under the reference model (a constant: it comes from a frozen
            model; wrap it in ``mx.stop_gradient`` if it was computed inside a differentiated function).
        estimator: ``"k1"``, ``"k2"`` or ``"k3"``.

    Returns:
        (B, T) float32, computed at every position: mask it (pad positions hold meaningless values).
        Differentiable w.r.t. ``logprobs``.
    """
    check_same_shape("ref_logprobs", ref_logprobs, "logprobs", logprobs)
    log_ratio = logprobs.astype(mx.float32) - ref_logprobs.astype(mx.float32)  # (B, T)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio * log_ratio
    if estimator == "k3":
        return mx.exp(-log_ratio) + log_ratio - 1.0
    raise ValueError(f"estimator must be 'k1', 'k2' or 'k3', got {estimator!r}")


def _finite_float(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return value


class FixedKLController:
    """A constant KL coefficient (``kl_coef``); ``update`` does nothing.

    Python floats on the host: the trainer reads ``value`` once per step.
    """

    def __init__(self, kl_coef: float) -> None:
        self.value = _finite_float("kl_coef", kl_coef)
        if self.value < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")

    def update(self, current_kl: float, n_steps: int) -> None:
        """Keep the coefficient (the arguments are accepted for a common interface)."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to restore this controller exactly."""
        return {"type": "fixed", "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`'s output."""
        if state.get("type") != "fixed" or "value" not in state:
            raise ValueError(
                f"not a FixedKLController state (expected keys 'type'='fixed', 'value'): {state!r}"
            )
        self.value = _finite_float("value", state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences").

    After each rollout with measured KL ``current_kl`` over ``n_steps`` samples:
    ``error = clip(current_kl / target - 1, -0.2, 0.2)``,
    ``value *= 1 + error * n_steps / horizon``.

    Python floats on the host (one update per step); ``current_kl`` is a float the trainer has
    already read back from the device.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        self.value = _finite_float("init_kl_coef", init_kl_coef)
        self.target = _finite_float("target", target)
        self.horizon = _finite_float("horizon", horizon)
        if self.value < 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef}")
        if self.target <= 0:
            raise ValueError(f"target (the KL to aim for) must be > 0, got {target}")
        if self.horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move ``value`` towards the coefficient that gives KL = ``target``."""
        current_kl = _finite_float("current_kl", current_kl)
        if n_steps < 0:
            raise ValueError(f"n_steps must be >= 0, got {n_steps}")
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to restore this controller exactly."""
        return {
            "type": "adaptive",
            "value": self.value,
            "target": self.target,
            "horizon": self.horizon,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`'s output (value, target and horizon)."""
        missing = {"value", "target", "horizon"} - set(state)
        if state.get("type") != "adaptive" or missing:
            raise ValueError(
                f"not an AdaptiveKLController state (expected 'type'='adaptive', 'value', "
                f"'target', 'horizon'): {state!r}"
            )
        self.value = _finite_float("value", state["value"])
        self.target = _finite_float("target", state["target"])
        self.horizon = _finite_float("horizon", state["horizon"])
