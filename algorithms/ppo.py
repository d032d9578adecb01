"""PPO (Schulman et al. 2017) as RLHF runs it (Huang et al. 2024, *The N+ Implementation Details
of RLHF with PPO*): a learned value model, GAE advantages, the per-token KL penalty in the
reward."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from algorithms.base import KL_REWARD_KEYS, AdvantageInputs, AdvantageSettings, PolicyLoss

if TYPE_CHECKING:
    import mlx.core as mx


class PPO:
    """Per-token rewards ``-kl_coef * kl`` plus the score at the last token (optionally whitened,
    ``whiten_rewards``), GAE over the value model's predictions (``gamma``, ``lam``), advantages
    whitened over the batch (``whiten_advantages``); the clipped surrogate and the clipped value
    loss (``vf_coef``, ``cliprange_value``). The config fields' own defaults are PPO's."""

    name = "ppo"
    title = "PPO"
    defaults: Mapping[str, Any] = {}
    keys = KL_REWARD_KEYS | {
        "gamma",
        "lam",
        "whiten_rewards",
        "whiten_advantages",
        "vf_coef",
        "cliprange_value",
        "value_warmup_steps",
        "value_model_name",
        "value_init",
        "value_learning_rate",
    }
    value_model = True
    kl_in_reward = True
    grouped = False
    policy_loss: PolicyLoss = "token"

    def check(self, config: Any) -> None:
        """Nothing beyond the config's own checks (``vf_coef`` > 0 for a value model)."""

    def advantages(
        self, x: AdvantageInputs, settings: AdvantageSettings
    ) -> tuple[mx.array, mx.array | None]:
        """GAE advantages (B, T), whitened when ``whiten_advantages``, and returns (B, T)."""
        from advantage.gae_advantage import compute_gae
        from advantage.whitening import masked_whiten

        assert x.values is not None, "PPO needs the rollout's values"
        rewards = x.rewards
        if settings.whiten_rewards:
            rewards = masked_whiten(rewards, x.mask, shift_mean=False, group=x.group)  # (B, T)
        advantages, returns = compute_gae(
            rewards, x.values, x.mask, settings.gamma, settings.lam
        )  # (B, T) each
        if settings.whiten_advantages:
            advantages = masked_whiten(advantages, x.mask, group=x.group)
        return advantages, returns
