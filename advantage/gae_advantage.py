"""Generalised advantage estimation (Schulman et al. 2016) over the action tokens."""

from __future__ import annotations

import mlx.core as mx

from advantage.reward_to_go import discounted_cumsum
from advantage.td_error import check_gamma, td_errors
from token_attribution.extractor import check_token_arrays, valid_mask


def compute_gae(
    rewards: mx.array, values: mx.array, mask: mx.array, gamma: float, lam: float
) -> tuple[mx.array, mx.array]:
    """GAE advantages and the returns the value head regresses to.

    ``delta_t = r_t + gamma V_{t+1} - V_t`` (:func:`advantage.td_error.td_errors`, V = 0 after the last
    action token), ``A_t = delta_t + gamma * lam * A_{t+1}`` (reverse scan over action tokens; holes
    in the mask are not steps), ``returns_t = A_t + V_t``. Both are 0 on invalid tokens and are not
    whitened (call :func:`advantage.whitening.masked_whiten` on the advantages if wanted).

    Args:
        rewards: (B, T) per-token rewards (constants).
        values: (B, T) value estimates from the rollout (constants: the result carries their graph,
            so compute them outside the differentiated step or wrap in ``mx.stop_gradient``).
        mask: (B, T), nonzero on action tokens.
        gamma: discount in [0, 1].
        lam: GAE lambda in [0, 1].

    Returns:
        ``(advantages, returns)``, each (B, T) float32.
    """
    check_token_arrays("rewards", rewards, values=values, mask=mask)
    check_gamma("gamma", gamma)
    check_gamma("lam", lam)
    valid = valid_mask(mask)
    delta = td_errors(rewards, values, valid, gamma)  # (B, T)
    advantages = discounted_cumsum(delta, valid, gamma * lam)  # (B, T)
    returns = mx.where(valid, advantages + values.astype(mx.float32), 0.0)  # (B, T)
    return advantages, returns
