"""One-step temporal-difference errors over the action tokens.

The MDP's steps are the action tokens (``mask != 0``) of a row, in order. The state after the last
action is terminal (value 0). An invalid token inside a row (e.g. a tool's output in a multi-turn
episode) is not a step: the next state of the action before it is the next *action* token. With the
usual masks (valid prefix, pad at the end) this is just ``V_{t+1}``, and 0 after the last token.
"""

from __future__ import annotations

import mlx.core as mx

from token_attribution.extractor import check_token_arrays, valid_mask


def check_gamma(name: str, value: float) -> None:
    """Raise ``ValueError`` unless ``0 <= value <= 1`` (a discount or a GAE lambda)."""
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


def next_valid_values(values: mx.array, valid: mx.array) -> mx.array:
    """Value of the next action token after each position, 0 past the last one.

    ``out[b, t] = values[b, t']`` for the smallest ``t' > t`` with ``valid[b, t']``, else 0.

    Args:
        values: (B, T) float32.
        valid: (B, T) bool.

    Returns:
        (B, T) float32.
    """
    B, T = values.shape
    positions = mx.arange(T, dtype=mx.int32)[None, :]  # (1, T)
    # Index of each valid position, T (a zero column appended below) elsewhere.
    index = mx.where(valid, positions, T)  # (B, T)
    shifted = mx.concatenate([index[:, 1:], mx.full((B, 1), T, dtype=mx.int32)], axis=1)  # (B, T)
    next_index = mx.cummin(shifted, axis=1, reverse=True)  # (B, T): smallest valid index > t
    padded = mx.concatenate([mx.where(valid, values, 0.0), mx.zeros((B, 1))], axis=1)  # (B, T + 1)
    return mx.take_along_axis(padded, next_index, axis=1)  # (B, T)


def td_errors(rewards: mx.array, values: mx.array, mask: mx.array, gamma: float) -> mx.array:
    """TD errors ``delta_t = r_t + gamma * V_{t+1} - V_t`` on action tokens, 0 elsewhere.

    ``V_{t+1}`` is the value of the next action token of the row (0 after the last one: the episode
    ends there); see the module docstring for masks with holes.

    Args:
        rewards: (B, T) per-token rewards (constants).
        values: (B, T) value estimates V(s_t) (constants when used for advantages).
        mask: (B, T), nonzero on action tokens.
        gamma: discount in [0, 1].

    Returns:
        (B, T) float32.
    """
    check_token_arrays("rewards", rewards, values=values, mask=mask)
    check_gamma("gamma", gamma)
    valid = valid_mask(mask)
    rewards = rewards.astype(mx.float32)
    values = values.astype(mx.float32)
    delta = rewards + gamma * next_valid_values(values, valid) - values  # (B, T)
    return mx.where(valid, delta, 0.0)
