"""RLOO (Ahmadian et al. 2024, *Back to Basics*) as TRL's ``RLOOTrainer``: the summed KL in the
sequence reward, a leave-one-out baseline over the group, a clipped sequence-level loss."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from algorithms.base import (
    GROUP_KEYS,
    KL_REWARD_KEYS,
    AdvantageInputs,
    AdvantageSettings,
    PolicyLoss,
)

if TYPE_CHECKING:
    import mlx.core as mx


class RLOO:
    """Sequence reward = score - ``kl_coef`` * (the response's summed KL); advantage = that
    reward less the mean of the other responses to the prompt; the loss clips the whole-sequence
    ratio and averages over sequences."""

    name = "rloo"
    title = "RLOO"
    defaults: Mapping[str, Any] = {}
    keys = KL_REWARD_KEYS | GROUP_KEYS
    value_model = False
    kl_in_reward = True
    grouped = True
    policy_loss: PolicyLoss = "sequence"

    def check(self, config: Any) -> None:
        """Nothing beyond the config's own checks."""

    def advantages(
        self, x: AdvantageInputs, settings: AdvantageSettings
    ) -> tuple[mx.array, mx.array | None]:
        """Leave-one-out advantages (B,) of the KL-penalised sequence rewards; no returns."""
        from advantage.group_advantage import rloo_advantages

        advantages, _ = rloo_advantages(x.scores, x.kl, x.mask, x.kl_coef, settings.group_size)
        return advantages, None
