"""REINFORCE++-baseline (Hu et al. 2025) as OpenRLHF's ``reinforce_baseline``: REINFORCE++ after
subtracting the prompt group's mean score, undiscounted."""

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


class ReinforcePPBaseline:
    """As :class:`algorithms.reinforce_pp.ReinforcePP` on group-centred scores, with gamma 1
    (OpenRLHF silently sets it to 1; here another value is refused)."""

    name = "reinforce_pp_baseline"
    title = "REINFORCE++-baseline"
    defaults: Mapping[str, Any] = {}
    keys = KL_REWARD_KEYS | GROUP_KEYS
    value_model = False
    kl_in_reward = True
    grouped = True
    policy_loss: PolicyLoss = "token"

    def check(self, config: Any) -> None:
        """Refuse a discount: its returns are undiscounted.

        Raises:
            ValueError: ``gamma`` is not 1.
        """
        if config.gamma != 1.0:
            raise ValueError(
                f'gamma must be 1.0 when algorithm is "reinforce_pp_baseline", got '
                f"{config.gamma!r}: REINFORCE++-baseline uses undiscounted returns (as "
                "OpenRLHF); set gamma: 1.0, or use algorithm: reinforce_pp for a discount"
            )

    def advantages(
        self, x: AdvantageInputs, settings: AdvantageSettings
    ) -> tuple[mx.array, mx.array | None]:
        """Whitened returns-to-go (B, T) of the group-centred scores, and the returns (B, T)."""
        from advantage.reinforce_pp import reinforce_pp_baseline_advantages

        return reinforce_pp_baseline_advantages(
            x.scores, x.kl, x.mask, x.kl_coef, settings.group_size, group=x.group
        )
