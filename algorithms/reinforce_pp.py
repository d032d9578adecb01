"""REINFORCE++ (Hu et al. 2025) as OpenRLHF's ``reinforce``: per-token KL in the reward,
discounted returns whitened over the whole batch, the clipped PPO loss, no value model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from algorithms.base import (
    KL_REWARD_KEYS,
    AdvantageInputs,
    AdvantageSettings,
    PolicyLoss,
)

if TYPE_CHECKING:
    import mlx.core as mx


class ReinforcePP:
    """Advantage = the per-token rewards' discounted return-to-go (``gamma``), whitened over
    the batch (every rank's tokens); the returns are the un-whitened returns-to-go."""

    name = "reinforce_pp"
    title = "REINFORCE++"
    defaults: Mapping[str, Any] = {}
    keys = KL_REWARD_KEYS | {"gamma", "mask_truncated_completions"}
    value_model = False
    kl_in_reward = True
    grouped = False
    policy_loss: PolicyLoss = "token"

    def check(self, config: Any) -> None:
        """Nothing beyond the config's own checks."""

    def advantages(
        self, x: AdvantageInputs, settings: AdvantageSettings
    ) -> tuple[mx.array, mx.array | None]:
        """Whitened returns-to-go (B, T) and the returns (B, T)."""
        from advantage.reinforce_pp import reinforce_pp_advantages

        return reinforce_pp_advantages(
            x.scores, x.kl, x.mask, x.kl_coef, settings.gamma, group=x.group
        )
