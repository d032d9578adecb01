"""Reward models: a learned scalar head on a transformer, or a plain Python function.

A learned reward model is a Hugging Face ``*ForSequenceClassification`` checkpoint with one label:
the backbone gives hidden states (B, L, D), the head ``score`` maps each to a scalar, and the
sequence's reward is the scalar at its last token (what transformers pools, and what
summarize_from_feedback_details' ``get_reward`` reads). :class:`RewardModel` loads and saves that
layout with mlx-lm's architectures (see :mod:`models.backbone`).

A reward can also be a function of the texts, :data:`RewardFunction` (e.g. a verifier or a
heuristic); the trainer accepts either.
"""

from __future__ import annotations

from typing import Callable, Sequence

import mlx.core as mx

from models.backbone import HeadInit, ScalarHeadModel, check_lengths, last_token_values

#: A programmatic reward: ``(prompts, completions, **columns) -> one float per completion`` (same
#: order and length as ``completions``); ``columns`` are the other fields of prompt records, the
#: ones the function names (all with ``**kwargs``), see :mod:`ppo_trainer.prompt_records`.
RewardFunction = Callable[..., list[float]]

__all__ = ["HeadInit", "RewardFunction", "RewardModel"]


class RewardModel(ScalarHeadModel):
    """A transformer backbone with a scalar head ``r(x)``; a sequence's reward is ``r`` at its last
    token.

    Build it with :meth:`from_pretrained` (a trained ``*ForSequenceClassification`` checkpoint)
    or :meth:`from_causal_lm` (a causal LM's backbone with a fresh head, for the reward trainer).
    ``model(input_ids)`` gives (B, L) per-position scalars; :meth:`score` the (B,) rewards.
    The head is :attr:`head` (parameter ``score.weight``, (1, D), as in Hugging Face checkpoints).
    """

    def score(self, input_ids: mx.array, lengths: mx.array | Sequence[int]) -> mx.array:
        """Reward of each right-padded row: the head's output at its last valid token.

        ``score[b] = self(input_ids)[b, lengths[b] - 1]``, as transformers' sequence
        classifiers pool at the last non-pad token.

        Args:
            input_ids: (B, L) token ids, each row right-padded.
            lengths: (B,) number of valid tokens per row, in [1, L].

        Returns:
            (B,) rewards.
        """
        batch_size, seq_len = input_ids.shape
        lengths = check_lengths(lengths, batch_size, seq_len)  # (B,)
        return last_token_values(self(input_ids), lengths)  # (B,)
