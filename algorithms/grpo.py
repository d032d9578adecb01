"""GRPO (Shao et al. 2024, *DeepSeekMath*) with TRL's defaults: group-relative advantages from
``group_size`` responses per prompt, no value model, the KL in the loss (``beta``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from algorithms.base import GROUP_KEYS, AdvantageInputs, AdvantageSettings, PolicyLoss

if TYPE_CHECKING:
    import mlx.core as mx


class GRPO:
    """Advantage = (score - group mean) / std (``grpo_advantage_scale``), one per sequence;
    GRPO's loss with its k3 KL term weighted by ``beta``, its ``loss_type`` and
    ``importance_sampling_level`` (GSPO).

    Its defaults are TRL's (1.x ``GRPOConfig``): no KL term (``beta`` 0, so no reference model),
    one update pass per batch, the ``"dapo"`` loss, temperature 1.0."""

    name = "grpo"
    title = "GRPO"
    defaults: Mapping[str, Any] = {
        "beta": 0.0,
        "num_ppo_epochs": 1,
        "loss_type": "dapo",
        "temperature": 1.0,
    }
    keys = GROUP_KEYS | {"beta", "grpo_advantage_scale", "loss_type", "importance_sampling_level"}
    value_model = False
    kl_in_reward = False
    grouped = True
    policy_loss: PolicyLoss = "grpo"

    def check(self, config: Any) -> None:
        """A loss_type of GRPO's (not one of DPO's)."""
        losses = ("grpo", "dr_grpo", "dapo", "bnpo")
        if config.loss_type not in losses:
            raise ValueError(
                f'algorithm "grpo" makes its loss with loss_type {", ".join(losses)} (got '
                f"{config.loss_type!r}, a DPO loss: algorithm online_dpo learns with it)"
            )

    def advantages(
        self, x: AdvantageInputs, settings: AdvantageSettings
    ) -> tuple[mx.array, mx.array | None]:
        """The scores' group-relative advantages (B,); no returns."""
        from advantage.group_advantage import group_advantages

        scale: Any = settings.grpo_advantage_scale
        return group_advantages(x.scores, settings.group_size, scale, group=x.group), None
