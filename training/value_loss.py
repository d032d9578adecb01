"""Clipped value loss (the PPO2 / OpenAI baselines form used by TRL and OpenRLHF)."""

from __future__ import annotations

import mlx.core as mx

from advantage.whitening import masked_mean
from token_attribution.extractor import check_token_arrays, valid_mask


def clipped_value_loss(
    values: mx.array,
    old_values: mx.array,
    returns: mx.array,
    mask: mx.array,
    cliprange_value: float,
) -> tuple[mx.array, dict[str, mx.array]]:
    """Clipped squared error between the value predictions and the returns.

    ``v_clip = clip(v, v_old - eps, v_old + eps)``,
    ``loss = 0.5 * masked_mean(max((v - R)^2, (v_clip - R)^2))``.

    ``old_values`` (rollout values) and ``returns`` are constants: they are wrapped in
    ``mx.stop_gradient`` here, so only ``values`` carries a gradient. Runs inside the training
    step: no host sync, and the mask must have a valid token (not checked).

    Args:
        values: (B, T) value predictions of the current value model (differentiated).
        old_values: (B, T) value predictions at rollout time.
        returns: (B, T) regression targets (GAE advantages + old values).
        mask: (B, T), nonzero on action tokens.
        cliprange_value: eps, how far a prediction may move from ``old_values`` before it is clipped.

    Returns:
        ``(loss, metrics)``: scalar float32 loss; metrics (scalar float32 arrays) ``clipfrac``
        (fraction of tokens where the clipped loss is the larger one) and ``vpred`` (masked mean of
        ``values``).
    """
    check_token_arrays("values", values, old_values=old_values, returns=returns, mask=mask)
    if not cliprange_value >= 0:
        raise ValueError(f"cliprange_value must be >= 0, got {cliprange_value}")
    valid = valid_mask(mask)
    values = values.astype(mx.float32)
    # Rollout values and returns enter as constants.
    old_values = mx.stop_gradient(old_values.astype(mx.float32))
    returns = mx.stop_gradient(returns.astype(mx.float32))
    values_clipped = mx.clip(values, old_values - cliprange_value, old_values + cliprange_value)
    vf_losses1 = mx.square(values - returns)  # (B, T)
    vf_losses2 = mx.square(values_clipped - returns)  # (B, T)
    loss = 0.5 * masked_mean(mx.maximum(vf_losses1, vf_losses2), valid, validate=False)
    metrics = {
        "clipfrac": masked_mean(
            (vf_losses2 > vf_losses1).astype(mx.float32), valid, validate=False
        ),
        "vpred": masked_mean(values, valid, validate=False),
    }
    return loss, metrics
