"""GKD's parts of a step (``algorithm: gkd``, :mod:`algorithms.gkd`): where a step's completions
come from, and its loss.

**Completions.** With probability ``lmbda`` a step's completions are the student's own samples
(the run's single-turn rollout), otherwise the data's (:class:`GKDRollouts`); the draw is a
function of (seed, step), so a resumed run draws what an uninterrupted one did. The data's
completion of a prompt is its record's ``"completion"`` column: text (TRL's standard
prompt-completion format) or one assistant message ``[{"role": "assistant", "content": ...}]``
(its conversational format). Chat messages whose last turn is the assistant's become a prompt
(the turns before it) and that completion (:func:`split_completion`), as TRL's GKD reads its
``messages`` datasets. A completion's tokens are its text's, then the end-of-turn token for a chat
prompt (the tokenizer's EOS where the template has none) or EOS for plain text, as SFT ends
them; one longer than ``max_new_tokens`` is cut there, without its end token, as a sample would
be. They are scored like samples: the student's log-probs by a forward pass, the teacher's,
the reward's score of their text.

**Loss.** :func:`gkd_policy_loss`: TRL's generalized JSD (``beta``, ``temperature``) between the
student's and the teacher's next-token distributions at every completion token, averaged over
the tokens (TRL's ``batchmean``), computed from the two models' last hidden states a chunk of
positions at a time (:func:`training.distillation_loss.chunked_generalized_jsd`): no (B, T, V)
logits of either model. Plus the clipped policy-gradient loss with the token advantages of the
reward's scores (``reward_coef`` times the score; 0 without a reward).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

import mlx.core as mx
import numpy as np

from base_setup.tokenizer_setup import end_of_turn_token_id
from config.ppo_config import PPOConfig
from experience_buffer.buffer import RolloutBatch
from ppo_trainer.generator import GenerationOutput
from ppo_trainer.prompt_records import PROMPT_KEY, Columns, PromptInput
from ppo_trainer.rollout import PromptBatch, Rollout, SamplingSettings, StepPlan
from ppo_trainer.single_turn import SingleTurn
from token_attribution.sequences import ScoringModel, response_positions
from training.distillation_loss import chunked_generalized_jsd
from training.policy_loss import ppo_policy_loss

#: The record column that holds a prompt's completion from the data.
COMPLETION_KEY = "completion"


def takes_data_completions(config: PPOConfig) -> bool:
    """Whether the run's algorithm mixes the data's completions with the student's samples
    (it has ``lmbda``: GKD)."""
    return "lmbda" in config.algorithm_object.keys


def split_completion(item: PromptInput) -> PromptInput:
    """A prompt whose chat messages end with the assistant's turn as a record of the turns
    before it (``"prompt"``) and that turn (``"completion"``, one assistant message), its
    other columns kept; any other prompt as it is."""
    record: Mapping[str, Any] = item if isinstance(item, Mapping) else {PROMPT_KEY: item}
    messages = record.get(PROMPT_KEY)
    if (
        COMPLETION_KEY in record
        or not isinstance(messages, list)
        or len(messages) < 2
        or not isinstance(messages[-1], Mapping)
        or messages[-1].get("role") != "assistant"
    ):
        return item
    return {**record, PROMPT_KEY: messages[:-1], COMPLETION_KEY: [messages[-1]]}


def completion_text(completion: Any, where: str) -> tuple[str, bool]:
    """``(text, conversational)`` of a data completion: text, or one assistant message.

    Raises:
        ValueError: ``where`` and what to give instead.
    """
    if isinstance(completion, str):
        return completion, False
    if (
        isinstance(completion, list)
        and len(completion) == 1
        and isinstance(completion[0], Mapping)
        and completion[0].get("role") == "assistant"
        and isinstance(completion[0].get("content"), str)
    ):
        return str(completion[0]["content"]), True
    raise ValueError(
        f"{where}: the completion must be text or one assistant message "
        f'[{{"role": "assistant", "content": "..."}}], got {completion!r:.80}'
    )


def check_completions(config: PPOConfig, columns: Columns) -> None:
    """Raise ``ValueError`` before any work when a GKD run with ``lmbda`` < 1 has training
    prompts without completions, or a completion that is neither text nor one assistant
    message (``columns``: the prepared prompts')."""
    if not takes_data_completions(config) or config.lmbda >= 1:
        return
    if COMPLETION_KEY not in columns:
        raise ValueError(
            f'algorithm "gkd" with lmbda={config.lmbda} trains {1 - config.lmbda:.0%} of its '
            "steps on the data's completions, but the prompts carry none: give prompt records "
            '{"prompt": ..., "completion": ...} (the completion as text, or as '
            '[{"role": "assistant", "content": ...}]) or chat messages whose last turn is the '
            "assistant's; or set lmbda: 1 to train on the student's samples only"
        )
    for i, completion in enumerate(columns[COMPLETION_KEY]):
        completion_text(completion, f"prompt {i}")


def student_samples(seed: int, step: int, lmbda: float) -> bool:
    """Whether step ``step`` (0-based) trains on the student's samples: a draw with
    probability ``lmbda`` from ``(seed, step)`` (TRL draws from the process's state)."""
    return bool(np.random.default_rng([seed, step, 3]).random() < lmbda)


def completion_generation(
    completions: Sequence[Any],
    prompts: Sequence[Any],
    tokenizer: Any,
    *,
    chat: bool,
    max_new_tokens: int,
    pad_token_id: int,
) -> GenerationOutput:
    """The data's completions as a generation of the student's (no log-probs: the rollout
    computes them by a forward pass), one row per sequence.

    Args:
        completions: each sequence's completion (text or one assistant message).
        prompts: each sequence's prompt as given (chat messages end their completion with the
            end-of-turn token).
        chat: plain-text prompts go through the chat template (then so do their completions).
    """
    eos = int(tokenizer.eos_token_id)
    end_of_turn = end_of_turn_token_id(tokenizer)
    rows: list[list[int]] = []
    ended: list[bool] = []
    for i, (completion, prompt) in enumerate(zip(completions, prompts)):
        text, conversational = completion_text(completion, f"sequence {i}")
        in_chat = conversational or chat or isinstance(prompt, list)
        end = end_of_turn if in_chat and end_of_turn is not None else eos
        ids = [int(t) for t in tokenizer.encode(text, add_special_tokens=False)] + [end]
        ended.append(len(ids) <= max_new_tokens)
        rows.append(ids[:max_new_tokens])
    width = max(len(r) for r in rows)
    responses = np.full((len(rows), width), pad_token_id, dtype=np.int32)  # (B, T)
    for i, row in enumerate(rows):
        responses[i, : len(row)] = row
    return GenerationOutput(
        responses=mx.array(responses),
        lengths=mx.array([len(r) for r in rows], dtype=mx.int32),
        ended_with_stop=mx.array(ended),
    )


@dataclass(frozen=True)
class GKDRollouts:
    """The rollout source of a GKD run (without ``async_rollout``): the student's samples (``models``)
    with probability ``lmbda`` per step, else the data's completions scored as samples are;
    evaluations always sample. Its ``source_metrics``: ``gkd/on_policy``, 1 for a step of
    the student's samples, 0 for one of the data's.

    Attributes:
        models: the run's single-turn source (its models and scorer).
        tokenizer: the student's.
        lmbda: the share of steps that are the student's samples.
        seed: the run's seed (with the step, it draws which).
        chat: plain-text prompts go through the chat template.
    """

    models: SingleTurn
    tokenizer: Any
    lmbda: float
    seed: int
    chat: bool

    def rollout(
        self,
        batch: PromptBatch,
        sampling: SamplingSettings,
        keys: mx.array | None,
        plan: StepPlan | None = None,
    ) -> Rollout:
        """The rollout of ``batch`` (:class:`~ppo_trainer.rollout.RolloutSource`)."""
        if plan is None:
            return self.models.rollout(batch, sampling, keys, plan)
        if student_samples(self.seed, plan.step, self.lmbda):
            rollout = self.models.rollout(batch, sampling, keys, plan)
            rollout.source_metrics["gkd/on_policy"] = 1.0
            return rollout
        if COMPLETION_KEY not in batch.columns:
            raise ValueError(
                f"step {plan.step + 1} trains on the data's completions (lmbda={self.lmbda}), "
                'but its prompts carry none: give records {"prompt": ..., "completion": ...}'
            )
        generation = completion_generation(
            batch.columns[COMPLETION_KEY],
            batch.columns[PROMPT_KEY],
            self.tokenizer,
            chat=self.chat,
            max_new_tokens=sampling.max_new_tokens,
            pad_token_id=sampling.pad_token_id,
        )
        # No behaviour policy: the student's log-probs come from a forward pass.
        forward = replace(sampling, logprobs_from="forward")
        rollout = self.models.collect(
            batch, forward, keys, with_values=False, generation=generation
        )
        rollout.source_metrics["gkd/on_policy"] = 0.0
        return rollout


def check_split_heads(models: Mapping[str, ScoringModel]) -> None:
    """Raise ``ValueError`` unless each model's logits are its LM head of its last hidden
    states (mlx-lm's layout), which the chunked loss needs (``models``: by what to call them)."""
    for name, model in models.items():
        if model.output_head() is None:
            raise ValueError(
                f"the {name}'s logits are not its LM head of its last hidden states (a model "
                "that soft-caps or scales them): algorithm gkd computes the divergence over the "
                "vocabulary a chunk of positions at a time from the hidden states; use "
                "algorithm distill (per sampled token) with this model"
            )


def gkd_policy_loss(
    policy: ScoringModel,
    teacher: ScoringModel,
    mb: RolloutBatch,
    *,
    beta: float,
    temperature: float,
    cliprange: float,
    cliprange_high: float | None = None,
    chunk_size: int | None = None,
) -> tuple[mx.array, dict[str, mx.array]]:
    """GKD's loss on a micro-batch: ``jsd + pg``.

    ``jsd`` is the generalized JSD (:func:`training.distillation_loss.generalized_jsd_loss`'s,
    ``beta``, ``temperature``) between the student's and the teacher's distributions at each
    of the ``N`` action tokens (``mb.mask``), summed over the vocabulary and averaged over the
    tokens. ``pg`` is :func:`training.policy_loss.ppo_policy_loss` on the student's log-probs
    of those tokens at ``temperature`` with ``mb.advantages`` (``reward_coef`` times the score).
    The student's hidden states carry the gradient; the teacher's, the rollout's log-probs and
    the advantages are constants.

    Returns:
        ``(loss, metrics)``: ``jsd``, and ``ppo_policy_loss``'s ``clipfrac``, ``approxkl``,
        ``ratio`` and ``clip_ratio/*``.
    """
    check_split_heads({"student": policy, "teacher": teacher})
    positions = response_positions(mb.prompt_lengths, mb.responses.shape[1])  # (b, T)
    # The action tokens' rows; the mask is a rollout constant, read on the host.
    rows = mx.array(np.flatnonzero(np.asarray(mb.mask).reshape(-1) != 0).astype(np.int32))  # (N,)

    def at_rows(x: mx.array) -> mx.array:  # (b, T, ...) -> (N, ...)
        return x.reshape(-1, *x.shape[2:])[rows]

    student = at_rows(policy.hidden_at(mb.query_responses, positions))  # (N, D)
    teacher_states = at_rows(teacher.hidden_at(mb.query_responses, positions))  # (N, D')
    jsd, logprobs = chunked_generalized_jsd(
        student,
        teacher_states,
        policy.output_head(),
        teacher.output_head(),
        at_rows(mb.responses),
        beta=beta,
        temperature=temperature,
        chunk_size=chunk_size,
    )
    assert logprobs is not None
    divergence = jsd.sum() / max(jsd.shape[0], 1)  # TRL's batchmean over the tokens
    pg, metrics = ppo_policy_loss(
        logprobs[None],  # (1, N)
        at_rows(mb.logprobs)[None],
        at_rows(mb.advantages)[None],
        mx.ones((1, jsd.shape[0])),
        cliprange,
        cliprange_high=cliprange_high,
    )
    return divergence + pg, {"jsd": divergence, **metrics}
