"""Discounted returns (reward-to-go) over the action tokens, and the reverse scan GAE shares."""

from __future__ import annotations

import mlx.core as mx

from advantage.td_error import check_gamma
from token_attribution.extractor import check_token_arrays, valid_mask


def discounted_cumsum(x: mx.array, valid: mx.array, discount: float) -> mx.array:
    """Reverse discounted sum over the valid steps of each row.

    ``y_t = x_t + discount * y_{t'}`` for valid ``t``, where ``t'`` is the next valid position
    (``y = 0`` past the last one); ``y_t = 0`` at invalid positions, and invalid ``x_t`` are ignored.

    One reversed Python loop over T building lazy (B,) ops: no host sync, vectorised over B.

    Args:
        x: (B, T) float32.
        valid: (B, T) bool.
        discount: factor per valid step.

    Returns:
        (B, T) float32.
    """
    B, T = x.shape
    running = mx.zeros((B,), dtype=mx.float32)  # y at the next valid step
    out = []
    for t in reversed(range(T)):
        step = x[:, t] + discount * running  # (B,)
        # Invalid positions are skipped: the running sum passes through them unchanged.
        running = mx.where(valid[:, t], step, running)
        out.append(mx.where(valid[:, t], step, 0.0))
    return mx.stack(out[::-1], axis=1)  # (B, T)


def reward_to_go(rewards: mx.array, mask: mx.array, gamma: float) -> mx.array:
    """Discounted sum of the future rewards of each action token.

    ``G_t = sum_{k >= 0} gamma^k r_{t_k}`` over the action tokens ``t = t_0 < t_1 < ...`` of the
    row from ``t`` on (holes in the mask are not steps); 0 on invalid tokens.

    Args:
        rewards: (B, T) per-token rewards (constants).
        mask: (B, T), nonzero on action tokens.
        gamma: discount in [0, 1].

    Returns:
        (B, T) float32.
    """
    check_token_arrays("rewards", rewards, mask=mask)
    check_gamma("gamma", gamma)
    return discounted_cumsum(rewards.astype(mx.float32), valid_mask(mask), gamma)
