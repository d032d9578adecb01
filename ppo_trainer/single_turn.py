"""The rollout source of a run without agents: one sampled response per sequence (batched, KV
cache), scored by every model and the run's scorer (:func:`ppo_trainer.rollout.collect_rollout`).

The agents' and the asynchronous worker's sources end in its :meth:`SingleTurn.collect` with a
generation of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import mlx.core as mx

from models.policy_model import PolicyModel
from models.sft_model import ReferenceModel
from models.value_model import ValueModel
from ppo_trainer.generator import GenerationOutput
from ppo_trainer.rollout import (
    PromptBatch,
    Rollout,
    SamplingSettings,
    StepPlan,
    collect_rollout,
    decode_completions,
)
from ppo_trainer.scorer import Scorer


@dataclass(frozen=True)
class SingleTurn:
    """Phases 1-3 with the run's models and scorer.

    Attributes:
        policy, ref_model, value_model: the run's models (no reference: no KL term; no value
            model: GRPO and the others).
        scorer: the run's scores (:class:`~ppo_trainer.scorer.Scorer`).
        decode_completion: a response's text from its tokens (the trainer's seam).
    """

    policy: PolicyModel
    ref_model: ReferenceModel | None
    value_model: ValueModel | None
    scorer: Scorer
    decode_completion: Callable[[Sequence[int]], str]

    def rollout(
        self,
        batch: PromptBatch,
        sampling: SamplingSettings,
        keys: mx.array | None,
        plan: StepPlan | None = None,
    ) -> Rollout:
        """The rollout of ``batch`` (:class:`~ppo_trainer.rollout.RolloutSource`)."""
        return self.collect(batch, sampling, keys, with_values=plan is not None)

    def collect(
        self,
        batch: PromptBatch,
        sampling: SamplingSettings,
        keys: mx.array | None,
        *,
        with_values: bool,
        generation: GenerationOutput | None = None,
        environment_scores: mx.array | None = None,
    ) -> Rollout:
        """Phases 1-3 for ``batch``; ``generation``: responses sampled elsewhere (phase 1 is
        then skipped); ``environment_scores`` (B,): the environments' rewards, added to the
        scores (:meth:`Scorer.score`)."""

        def score(completions: list[str], query_responses: mx.array, lengths: mx.array) -> Any:
            return self.scorer.score(
                batch.texts,
                batch.prompt_ids,
                batch.columns,
                completions,
                query_responses,
                lengths,
                environment_scores,
            )

        return collect_rollout(
            self.policy,
            self.ref_model,
            self.value_model if with_values else None,
            batch.texts,
            batch.prompt_ids,
            sampling,
            decode=lambda gen: decode_completions(
                gen, self.decode_completion, sampling.stop_strings
            ),
            score=score,
            score_source=self.scorer.source,
            keys=keys,
            generation=generation,
            # Environments' rewards are added on the host: the scores are then no model pass
            # to run beside the reference's.
            model_reward=self.scorer.is_model_pass and environment_scores is None,
        )
