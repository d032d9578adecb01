"""Online DPO (Guo et al. 2024; TRL's ``OnlineDPOTrainer``): two samples per prompt from the
policy, ranked by the run's reward (a reward model, functions or a judge), DPO's sigmoid loss on
the pair against the reference, weighted by ``beta``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from algorithms.base import AdvantageInputs, AdvantageSettings, PolicyLoss

if TYPE_CHECKING:
    import mlx.core as mx


class OnlineDPO:
    """Advantages: DPO's gradient weights per sample (``advantage/online_dpo.py``), learned by
    the sequence-level loss in one on-policy pass, so the update follows DPO's gradient; TRL's
    defaults (``beta`` 0.1, temperature 0.9, two samples per prompt)."""

    name = "online_dpo"
    title = "online DPO"
    defaults: Mapping[str, Any] = {
        "group_size": 2,
        "beta": 0.1,
        "num_ppo_epochs": 1,
        "temperature": 0.9,
    }
    keys = frozenset({"beta"})
    value_model = False
    kl_in_reward = False
    grouped = True
    policy_loss: PolicyLoss = "sequence"

    def check(self, config: Any) -> None:
        """Two samples per prompt, one pass, a reference (``beta`` > 0)."""
        if config.group_size != 2:
            raise ValueError(
                'algorithm "online_dpo" learns from pairs: set group_size: 2 (got '
                f"{config.group_size})"
            )
        if config.num_ppo_epochs != 1:
            raise ValueError(
                'algorithm "online_dpo" follows DPO\'s gradient at the sampling policy in one '
                f"pass: set num_ppo_epochs: 1 (got {config.num_ppo_epochs})"
            )
        if not config.beta > 0:
            raise ValueError(
                'algorithm "online_dpo" weighs the log-ratio to the reference by beta: set beta '
                f"> 0, e.g. 0.1 (got {config.beta})"
            )

    def advantages(
        self, x: AdvantageInputs, settings: AdvantageSettings
    ) -> tuple[mx.array, mx.array | None]:
        """DPO's per-sample weights (B,); no returns."""
        from advantage.online_dpo import online_dpo_advantages

        assert x.log_ratio is not None, "online DPO needs the reference's log-probs"
        return online_dpo_advantages(x.scores, x.log_ratio, x.mask, settings.beta), None
