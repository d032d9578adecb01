"""On-policy distillation (Agarwal et al. 2024, "On-Policy Distillation of Language Models";
Thinking Machines 2025): the student samples, a frozen teacher scores every token of the
student's own samples, and the student moves toward the teacher by the per-token reverse KL.

The teacher is the run's reference model (``teacher_model_name``), so its log-probs come from the
rollout's reference pass, and ``objective/kl`` is the student's reverse KL to the teacher. A
verifiable reward, when the run has one, adds its score to every token's advantage, weighted by
``reward_coef`` (each function's by ``reward_weights``); without one the teacher's signal is the
whole signal. ``algorithms/gkd.py`` is the other form: TRL's GKD, the generalized JSD over the
whole vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from algorithms.base import AdvantageInputs, AdvantageSettings, PolicyLoss

if TYPE_CHECKING:
    import mlx.core as mx


class Distill:
    """Advantage per token: ``-kl_coef (log pi - log pi_teacher)`` at the sampled token plus the
    sequence's score; one on-policy update (TRL's and the paper's), the clipped surrogate."""

    name = "distill"
    title = "on-policy distillation"
    defaults: Mapping[str, Any] = {"kl_coef": 1.0, "num_ppo_epochs": 1, "temperature": 1.0}
    keys = frozenset({"teacher_model_name", "kl_coef", "reward_coef", "mask_truncated_completions"})
    value_model = False
    kl_in_reward = True
    grouped = False
    policy_loss: PolicyLoss = "token"

    def check(self, config: Any) -> None:
        """A teacher is needed; its term's weight is fixed and measured with k1."""
        check_teacher(self.name, config)
        if config.adaptive_kl:
            raise ValueError(
                'algorithm "distill" weighs the teacher\'s term with a fixed kl_coef: set '
                "adaptive_kl: false"
            )
        if config.kl_estimator != "k1":
            raise ValueError(
                'algorithm "distill" credits each token with log pi - log pi_teacher (k1), got '
                f'kl_estimator "{config.kl_estimator}": set kl_estimator: k1'
            )
        if not config.kl_coef > 0:
            raise ValueError(
                'algorithm "distill" needs kl_coef > 0 (the teacher\'s weight), got '
                f"{config.kl_coef}"
            )

    def advantages(
        self, x: AdvantageInputs, settings: AdvantageSettings
    ) -> tuple[mx.array, mx.array | None]:
        """Per-token distillation advantages (B, T); no returns (no value model)."""
        from advantage.distillation import distillation_advantages

        advantages = distillation_advantages(
            x.kl, x.scores, x.mask, x.kl_coef, settings.reward_coef
        )
        return advantages, None


def check_teacher(name: str, config: Any) -> None:
    """Raise ``ValueError`` unless ``config`` names a teacher and no other reference: what
    every distillation algorithm (``name``) needs."""
    if config.teacher_model_name is None:
        raise ValueError(
            f'algorithm "{name}" learns from a teacher: set teacher_model_name to its '
            "folder or Hub id (same tokenizer as model_name)"
        )
    if config.sft_model_name is not None:
        raise ValueError(
            f'algorithm "{name}" measures the KL to the teacher (teacher_model_name), not to '
            "sft_model_name: leave sft_model_name unset"
        )
