"""Supervised fine-tuning (SFT): the first stage of RLHF, and PPO's policy and reference.

The policy learns to continue prompts with the demonstrated completions: next-token
cross-entropy on the completion tokens (and EOS) only, the prompt being context. Full fine-tuning
or LoRA; with LoRA the saved model has the adapters merged, so the output is a plain model
directory that ``PolicyModel.from_pretrained`` (PPO's policy and reference) and ``mlx_lm.load``
read.

::

    config = SFTConfig(model_name="Qwen/Qwen3-0.6B-Base", dataset="sft.jsonl", learning_rate=2e-5)
    model_dir = run_sft(config)            # <output_dir>/model

or, with records in memory, ``SFTTrainer(config).train(train_records, eval_records)`` and
``trainer.save_pretrained(dir)``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import mlx.core as mx
import mlx.nn as nn

from base_setup import seed_everything
from base_setup.lora_setup import LoraSettings
from config.dpo_config import DPOConfig
from config.sft_config import SFTConfig
from models.policy_model import PolicyModel
from finetune.records import load_sft_data
from finetune.tokenize import SFTBatch, SFTExample, collate_sft, tokenize_sft
from token_attribution.sequences import next_token_scores
from training.checkpoint import atomic_directory, check_save_target
from training.run_control import in_run_scope
from finetune.supervised_trainer import SupervisedTrainer, run_stage


def sft_loss(
    logprobs: mx.array, top: mx.array, mask: mx.array
) -> tuple[mx.array, dict[str, mx.array]]:
    """Mean next-token cross-entropy over the target tokens.

    ``loss = sum_{b,t} mask[b,t] * -logprobs[b,t] / sum_{b,t} mask[b,t]``

    Args:
        logprobs: (B, T) each target's log-prob, ``log softmax(logits[b,t])[targets[b,t]]``
            (:func:`token_attribution.sequences.next_token_scores`).
        top: (B, T) the highest log-prob at each position (a constant).
        mask: (B, T) 1 where the target is a completion token, 0 for prompt tokens and padding.

    Returns:
        ``(loss, metrics)``: ``sft/token_accuracy``, the fraction of targets that are the
        model's most likely token (``logprobs >= top``).
    """
    num_targets = mx.maximum(mask.sum(), 1.0)
    loss = -(logprobs * mask).sum() / num_targets
    correct = (logprobs >= top).astype(mx.float32)  # (B, T)
    return loss, {"sft/token_accuracy": (correct * mask).sum() / num_targets}


def load_policy(config: SFTConfig | DPOConfig, model: PolicyModel | None = None) -> PolicyModel:
    """The policy a supervised stage trains: ``model``, or ``config.model_name`` loaded with fresh
    LoRA adapters when ``config.use_lora``.

    Raises:
        ValueError: a given model with LoRA adapters exactly when ``config.use_lora`` is false
            (or without them when true), or a quantized model without adapters (QLoRA trains
            adapters only).
    """
    if model is None:
        lora = None
        if config.use_lora:
            lora = LoraSettings(
                r=config.lora_r,
                alpha=config.lora_alpha,
                dropout=config.lora_dropout,
                num_layers=config.lora_layers,
                keys=config.lora_keys,
            )
        model = PolicyModel.from_pretrained(
            config.model_name,
            dtype=config.dtype,
            lora=lora,
            fast_math=config.fast_math and not config.plain_mlx,
        )
    elif (model.lora is not None) != config.use_lora:
        has = "has" if model.lora is not None else "has no"
        raise ValueError(
            f"the given model {has} LoRA adapters but config.use_lora={config.use_lora}: set "
            "use_lora to match, or pass model=None to load config.model_name"
        )
    model.check_trainable()  # a quantized model trains through adapters only (QLoRA)
    return model


class SFTTrainer(SupervisedTrainer[SFTExample, SFTBatch]):
    """Supervised fine-tuning of a :class:`PolicyModel` (see the module docstring).

    Args:
        config: the run's :class:`SFTConfig`.
        model: a ready policy; default: loaded from ``config.model_name`` with fresh LoRA
            adapters when ``config.use_lora``. A given model must match ``config.use_lora``
            (have adapters exactly when it is true).

    Metrics per step: ``loss/sft``, ``sft/perplexity`` (``exp`` of it), ``sft/token_accuracy``,
    ``sft/tokens`` (target tokens in the batch), ``grad_norm``, ``lr``, ``time/step``; on the
    held-out data ``eval/loss``, ``eval/perplexity``, ``eval/token_accuracy``.
    """

    name = "SFT"
    loss_key = "loss/sft"

    def __init__(self, config: SFTConfig, model: PolicyModel | None = None) -> None:
        seed_everything(config.seed)
        model = load_policy(config, model)
        self.policy = model
        self.tokenizer = model.tokenizer
        self.pad_token_id = int(model.tokenizer.pad_token_id)
        super().__init__(config, model)
        self.config: SFTConfig = config

    def prepare(self, data: Iterable[Mapping[str, Any]]) -> list[SFTExample]:
        return tokenize_sft(data, self.tokenizer, self.config.max_length)

    def collate(self, examples: Sequence[SFTExample]) -> tuple[SFTBatch, int]:
        batch = collate_sft(examples, self.pad_token_id, self.pad_to_multiple_of)
        return batch, batch.num_targets

    def loss_fn(self, model: nn.Module, batch: SFTBatch) -> tuple[mx.array, dict[str, mx.array]]:
        scores = next_token_scores(model, batch.input_ids)  # (B, L-1) each
        return sft_loss(scores.logprobs, scores.top, batch.loss_mask[:, 1:])

    def step(self, examples: Sequence[SFTExample]) -> dict[str, float]:
        metrics = super().step(examples)
        metrics["sft/perplexity"] = math.exp(min(metrics[self.loss_key], 50.0))
        metrics["sft/tokens"] = float(sum(e.num_targets for e in examples))
        return metrics

    @in_run_scope
    def evaluate(self, examples: Sequence[SFTExample]) -> dict[str, float]:
        """Token-weighted cross-entropy, perplexity and token accuracy on held-out examples."""
        if not examples:
            raise ValueError("evaluate() got no examples")
        was_training = self.model.training
        self.model.eval()
        loss_sum = correct_sum = 0.0
        count = 0
        for chunk in self.eval_chunks(examples):
            batch = collate_sft(chunk, self.pad_token_id)
            loss, metrics = self.loss_fn(self.model, batch)
            mx.eval(loss, metrics)
            loss_sum += float(loss) * batch.num_targets
            correct_sum += float(metrics["sft/token_accuracy"]) * batch.num_targets
            count += batch.num_targets
        self.model.train(was_training)
        loss_mean = loss_sum / count
        return {
            "eval/loss": loss_mean,
            "eval/perplexity": math.exp(min(loss_mean, 50.0)),
            "eval/token_accuracy": correct_sum / count,
        }

    def save_pretrained(self, path: str | Path, overwrite: bool = False) -> Path:
        """A full model directory (LoRA adapters merged into the weights) that
        ``PolicyModel.from_pretrained`` and ``mlx_lm.load`` read: PPO's policy and reference.
        Only rank 0 of a data-parallel run writes."""
        if not self.is_main_process:
            return Path(path)
        check_save_target(path, overwrite=overwrite)  # never destroy what is there
        with atomic_directory(path) as tmp:  # a kill mid-save never leaves half a model
            self.policy.save_pretrained(tmp, merged=True)
        return Path(path)

    def _resume_keys(self) -> tuple[str, ...]:
        return ("use_lora", "lora_r", "lora_alpha", "lora_layers", "lora_keys")


def run_sft(config: SFTConfig, *, resume_from: str | Path | None = None) -> Path:
    """Supervised fine-tuning from the config alone (what ``main.py sft`` calls).

    Reads ``config.dataset`` and the held-out data (:func:`load_run_data`), trains, and saves
    the model to ``<output_dir>/model``.

    Returns:
        The saved model directory (load it with ``PolicyModel.from_pretrained``; use it as
        PPO's ``model_name`` and reward-model training's ``model_name``).

    Raises:
        ValueError: ``config.dataset`` is not set, or the data is malformed.
        TrainingStopped: Ctrl-C or SIGTERM stopped the run (after saving a checkpoint).
    """
    return run_stage(SFTTrainer, config, load_sft_data, resume_from)
