"""Generalized knowledge distillation (Agarwal et al. 2024, "On-Policy Distillation of Language
Models"; TRL's ``GKDTrainer``): the student moves toward a frozen teacher by the generalized
Jensen-Shannon divergence between their next-token distributions over the whole vocabulary, on
completions that are, with probability ``lmbda``, the student's own samples and otherwise the
data's.

The teacher is the run's reference model (``teacher_model_name``), as for ``distill``; the loss
is ``training.distillation_loss.chunked_generalized_jsd`` (``beta`` 0 forward KL, 1 reverse KL;
``temperature``) on the completion tokens, from both models' hidden states a chunk of positions
at a time (``ppo_trainer/gkd.py``). A verifiable reward, when the run has one, adds a
policy-gradient term: the clipped surrogate with the score, times ``reward_coef``, on every token.
``objective/kl`` is the k1 estimate of the student's reverse KL to the teacher on the batch's
completions (a metric here: the KL trains through the loss).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from algorithms.base import AdvantageInputs, AdvantageSettings, PolicyLoss
from algorithms.distill import check_teacher

if TYPE_CHECKING:
    import mlx.core as mx


class GKD:
    """TRL's GKD: the generalized JSD to the teacher over the vocabulary, on the student's
    samples (probability ``lmbda``) or the data's completions; TRL's defaults (``lmbda`` 0.5,
    ``beta`` 0.5, temperature 0.9, one update per batch)."""

    name = "gkd"
    title = "generalized knowledge distillation (GKD)"
    defaults: Mapping[str, Any] = {
        "beta": 0.5,
        "lmbda": 0.5,
        "temperature": 0.9,
        "num_ppo_epochs": 1,
    }
    keys = frozenset(
        {"teacher_model_name", "lmbda", "beta", "reward_coef", "mask_truncated_completions"}
    )
    value_model = False
    kl_in_reward = True  # measured (k1) for objective/kl; the KL trains through the loss
    grouped = False
    policy_loss: PolicyLoss = "gkd"

    def check(self, config: Any) -> None:
        """A teacher; ``lmbda`` and ``beta`` in [0, 1]; no option that weighs the tokens of a
        loss this one does not compute per sampled token."""
        check_teacher(self.name, config)
        if not 0.0 <= config.lmbda <= 1.0:
            raise ValueError(
                f"lmbda must be in [0, 1] (the share of batches that are the student's own "
                f"samples; TRL's default 0.5), got {config.lmbda}"
            )
        if not 0.0 <= config.beta <= 1.0:
            raise ValueError(
                f'beta of algorithm "gkd" must be in [0, 1] (0 forward KL, 1 reverse KL, '
                f"between them the generalized JSD; TRL's default 0.5), got {config.beta}"
            )
        if config.adaptive_kl:
            raise ValueError(
                'algorithm "gkd" learns the teacher through its loss, not a KL penalty in the '
                "reward: set adaptive_kl: false"
            )
        if config.async_rollout and config.lmbda < 1:
            raise ValueError(
                f"async_rollout with lmbda={config.lmbda}: the worker samples every batch, but "
                "gkd takes a share of its batches from the data's completions; set "
                "async_rollout: false, or lmbda: 1"
            )
        weighted = [
            (config.entropy_coef > 0, f"entropy_coef={config.entropy_coef}", "0"),
            (config.top_entropy_quantile < 1, "top_entropy_quantile", "1.0"),
            (config.think_loss_weight != 1, "think_loss_weight", "1.0"),
            (config.answer_loss_weight != 1, "answer_loss_weight", "1.0"),
        ]
        for on, what, value in weighted:
            if on:
                raise ValueError(
                    f'{what} weighs the tokens of a sampled-token loss; algorithm "gkd"\'s '
                    f"loss is the divergence over the whole vocabulary: set it to {value}, or "
                    "use algorithm distill"
                )

    def advantages(
        self, x: AdvantageInputs, settings: AdvantageSettings
    ) -> tuple[mx.array, mx.array | None]:
        """``reward_coef`` times each sequence's score on its tokens (B, T), the
        policy-gradient term's; no returns."""
        from advantage.distillation import score_advantages

        return score_advantages(x.scores, x.mask, settings.reward_coef), None
