"""Reward models: a learned scalar head on a transformer, or a plain Python function.

A learned reward model is a Hugging Face ``*ForSequenceClassification`` checkpoint with one label:
the backbone gives hidden states (B, L, D), the head ``score`` maps each to a scalar, and the
sequence's reward is the scalar at its last token (what transformers pools, and what
summarize_from_feedback_details' ``get_reward`` reads). :class:`RewardModel` loads and saves that
layout with mlx-lm's architectures (see :mod:`models.backbone`).

A reward can also be a function of the texts, :data:`RewardFunction` (e.g. a verifier or a
heuristic); the trainer accepts either.

A reward model trained with LoRA (the reward trainer's ``use_lora``) is saved as an adapter
checkpoint: its adapters, its head and the name and fingerprint of its base (see
:meth:`RewardModel.save_pretrained`). It loads on its own (:meth:`RewardModel.from_pretrained`:
the base, then the adapters) or on a PPO policy's base, held once in memory
(:meth:`RewardModel.sharing_base`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

import mlx.core as mx
import mlx.nn as nn

from base_setup.lora_setup import ADAPTER_CONFIG_FILE, adapters_fused, save_adapters
from models.backbone import (
    ADAPTER_HEAD_FILE,
    BASE_FINGERPRINT_KEY,
    DtypeLike,
    HeadInit,
    ScalarHeadModel,
    check_lengths,
    last_token_values,
)
from models.backbone_loading import HF_HEAD_WEIGHT

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
    With LoRA adapters (``lora`` set) it saves and loads as an adapter checkpoint on its base.
    """

    @classmethod
    def sharing_base(
        cls,
        policy_lm: nn.Module,
        path: str | Path,
        *,
        dtype: DtypeLike = None,
        fast_math: bool = True,
    ) -> RewardModel:
        """The reward model of the adapter checkpoint at ``path`` on the base weights of
        ``policy_lm`` (a LoRA policy's mlx-lm causal LM), held once in memory: a new module tree
        whose base arrays are the policy's own (:meth:`ScalarHeadModel.on_policy_base`), with
        the checkpoint's adapters and head, every parameter frozen, in eval mode.

        The caller checks that the checkpoint's base is the policy's (same weights): the scores
        then equal :meth:`from_pretrained`'s of the same checkpoint in the same ``dtype`` (the
        policy's), and neither the policy, nor its reference (adapters off), nor a value model
        on the same base sees these adapters.

        Raises:
            ValueError: ``policy_lm`` has no LoRA adapters, or the checkpoint does not fit its
                backbone.
        """
        model = cls.on_policy_base(policy_lm, fast_math=fast_math)
        model.attach_adapter_checkpoint(path, dtype=dtype)
        model.freeze()  # the reward model never trains in PPO
        return model

    def save_pretrained(
        self,
        save_dir: str | Path,
        tokenizer: Any = None,
        *,
        merged: bool = False,
        base_fingerprint: str | None = None,
        **kwargs: Any,
    ) -> Path:
        """Write the model: without adapters, or with ``merged``, the one-label
        ``*ForSequenceClassification`` layout (:meth:`ScalarHeadModel.save_pretrained`; a LoRA
        model's adapters merged into the weights, ``W + scale * B^T A^T``, a quantized base
        dequantized: the checkpoint is float); with adapters, an
        adapter checkpoint, only what trained:

        * ``adapters.safetensors`` and ``adapter_config.json`` in mlx-lm's format, which records
          the base model (``"model"``, :attr:`base_model`) and ``base_fingerprint`` (the base's
          ``training.fingerprints.model_fingerprint``, under ``"base_model_fingerprint"``, so a
          loader can check it has the weights the adapters were trained on);
        * ``score.safetensors``: the head, ``score.weight`` (1, D);
        * the tokenizer's files when ``tokenizer`` is given.

        :meth:`from_pretrained` loads either; PPO's ``share_reward_base`` puts an adapter
        checkpoint on the policy's base.

        Raises:
            ValueError: an adapter checkpoint of a model whose base is unknown (built from an
                in-memory model).
        """
        if self.lora is None:
            return super().save_pretrained(save_dir, tokenizer, **kwargs)
        if merged:  # a float checkpoint, also of adapters on a quantized base
            with adapters_fused(self, dequantize=True):
                return super().save_pretrained(save_dir, tokenizer, **kwargs)
        if self.base_model is None:
            raise ValueError(
                "this LoRA reward model does not know its base model (it was built from an "
                "in-memory model), so its adapters cannot be saved alone: set base_model to the "
                "base's path or repo id, or save with merged=True"
            )
        out = save_adapters(self, self.lora, save_dir, base_model=self.base_model)
        config_path = out / ADAPTER_CONFIG_FILE
        config = json.loads(config_path.read_text(encoding="utf-8"))
        if base_fingerprint is not None:
            config[BASE_FINGERPRINT_KEY] = base_fingerprint
        config_path.write_text(json.dumps(config, indent=4) + "\n", encoding="utf-8")
        mx.save_safetensors(str(out / ADAPTER_HEAD_FILE), {HF_HEAD_WEIGHT: self.head.weight})
        if tokenizer is not None:
            tokenizer.save_pretrained(str(out))
        return out

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
