"""Online DPO (Guo et al. 2024; TRL's ``OnlineDPOTrainer``): two samples per prompt from the
policy, ranked by the run's reward (a reward model, functions or a judge), DPO's loss
(``loss_type``: sigmoid, ipo or hinge, as finetune's DPO computes them) on the pair against the
reference, weighted by ``beta``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from algorithms.base import AdvantageInputs, AdvantageSettings, PolicyLoss

if TYPE_CHECKING:
    import mlx.core as mx


class OnlineDPO:
    """Advantages: DPO's gradient weights per sample (``advantage/online_dpo.py``), learned by
    the sequence-level loss in one on-policy pass, so the update follows DPO's gradient; TRL's
    defaults (``beta`` 0.1, temperature 0.9, two samples per prompt, the sigmoid loss) and its
    metrics of the pairs (``rewards/chosen``, ``rewards/margins``, ...)."""

    name = "online_dpo"
    title = "online DPO"
    defaults: Mapping[str, Any] = {
        "group_size": 2,
        "beta": 0.1,
        "num_ppo_epochs": 1,
        "temperature": 0.9,
        "loss_type": "sigmoid",
    }
    keys = frozenset({"beta", "loss_type"})
    value_model = False
    kl_in_reward = False
    grouped = True
    policy_loss: PolicyLoss = "sequence"

    def check(self, config: Any) -> None:
        """Two samples per prompt, one pass, a reference (``beta`` > 0), a loss it has."""
        from advantage.online_dpo import ONLINE_DPO_LOSSES

        if config.loss_type not in ONLINE_DPO_LOSSES:
            raise ValueError(
                f'algorithm "online_dpo" learns with loss_type {", ".join(ONLINE_DPO_LOSSES)} '
                f"(got {config.loss_type!r}): robust needs label_smoothing and simpo and orpo "
                "no reference, which online DPO does not take; the others are GRPO's"
            )
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
        """DPO's per-sample weights (B,) for ``loss_type``; no returns."""
        from advantage.online_dpo import online_dpo_advantages

        assert x.log_ratio is not None, "online DPO needs the reference's log-probs"
        advantages = online_dpo_advantages(
            x.scores, x.log_ratio, x.mask, settings.beta, settings.loss_type
        )
        return advantages, None

    def metrics(self, x: AdvantageInputs, settings: AdvantageSettings) -> dict[str, mx.array]:
        """TRL's metrics of the pairs (:func:`advantage.online_dpo.online_dpo_metrics`)."""
        from advantage.online_dpo import online_dpo_metrics

        assert x.log_ratio is not None and x.logprobs is not None
        assert x.ended_with_stop is not None
        return online_dpo_metrics(
            x.scores, x.logprobs, x.log_ratio, x.mask, x.ended_with_stop, settings.beta
        )
