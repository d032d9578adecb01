"""Reward-model training: the second stage of RLHF, and PPO's reward model (and value model).

A :class:`RewardModel` (a causal LM's backbone with a fresh scalar head, usually the SFT output's)
learns from preference pairs that ``r(prompt + chosen) > r(prompt + rejected)``, with the
Bradley-Terry loss of "Fine-Tuning Language Models from Human Preferences" / InstructGPT. The
reward of a sequence is the head's output at its last token (the EOS), the token PPO scores a
response at. The saved model is a one-label Hugging Face ``*ForSequenceClassification``
checkpoint, which ``RewardModel.from_pretrained`` (PPO's ``reward_model_name``) and
``ValueModel.from_pretrained`` (PPO's value model starts from it) load. With ``use_lora`` the
backbone stays frozen, LoRA adapters and the head train, and the saved model is an adapter
checkpoint on its base (``RewardModel.save_pretrained``), which the same loaders read and PPO's
``share_reward_base`` puts on the policy's base.

::

    config = RewardConfig(model_name="runs/sft/model", dataset="preferences.jsonl")
    reward_dir = run_reward_training(config)       # <output_dir>/model
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from base_setup import seed_everything
from base_setup.lora_setup import LoraSettings, apply_lora, warn_quantized_on_cpu
from base_setup.tokenizer_setup import load_tokenizer
from config.reward_config import RewardConfig
from models.backbone import last_token_values, resolve_model_path
from models.reward_model import RewardModel
from finetune.records import load_preference_data
from finetune.tokenize import (
    PreferenceBatch,
    PreferenceExample,
    collate_preferences,
    tokenize_preferences,
)
from training.checkpoint import atomic_directory, check_save_target
from training.fingerprints import model_fingerprint
from training.run_control import in_run_scope
from finetune.supervised_trainer import SupervisedTrainer, run_stage


def bradley_terry_loss(
    r_chosen: mx.array,
    r_rejected: mx.array,
    margin: mx.array | float | None = None,
    center_coef: float = 0.0,
) -> tuple[mx.array, dict[str, mx.array]]:
    """Bradley-Terry preference loss with an optional margin and reward centering.

    ``loss = mean_b[-log sigmoid(r_chosen[b] - r_rejected[b] - margin[b])]
    + center_coef * mean_b[(r_chosen[b] + r_rejected[b])^2]``

    The first term is the negative log-likelihood that the chosen answer wins under the
    Bradley-Terry model ``P(chosen > rejected) = sigmoid(r_chosen - r_rejected)``; a margin asks
    for a gap of at least ``margin`` (Llama 2's margin loss); the second term (TRL's
    ``center_rewards_coefficient``, Eisenstein et al. 2023) pulls the rewards towards zero mean,
    since the first term only sees their differences.

    Args:
        r_chosen: (B,) rewards of the preferred sequences.
        r_rejected: (B,) rewards of the other sequences of the same pairs.
        margin: (B,) per-pair margins, a scalar, or None for 0.
        center_coef: weight of the centering term (0 = off).

    Returns:
        ``(loss, metrics)`` with ``loss/bradley_terry`` (the first term), ``reward/accuracy``
        (fraction of pairs with ``r_chosen > r_rejected``; ties count as wrong),
        ``reward/margin`` (mean ``r_chosen - r_rejected``), ``reward/chosen``,
        ``reward/rejected`` (mean rewards) and ``reward/centering`` (mean of
        ``(r_chosen + r_rejected)^2``).
    """
    diff = r_chosen - r_rejected  # (B,)
    logits = diff if margin is None else diff - margin  # (B,)
    bt = -nn.log_sigmoid(logits).mean()  # log_sigmoid(x) = -softplus(-x): stable for any x
    centering = mx.mean((r_chosen + r_rejected) ** 2)
    loss = bt + center_coef * centering if center_coef else bt
    metrics = {
        "loss/bradley_terry": bt,
        "reward/accuracy": (diff > 0).astype(mx.float32).mean(),
        "reward/margin": diff.mean(),
        "reward/chosen": r_chosen.mean(),
        "reward/rejected": r_rejected.mean(),
        "reward/centering": centering,
    }
    return loss, metrics


class RewardTrainer(SupervisedTrainer[PreferenceExample, PreferenceBatch]):
    """Reward-model training on preference pairs (see the module docstring).

    Args:
        config: the run's :class:`RewardConfig`.
        model: a ready reward model; default: ``RewardModel.from_causal_lm(config.model_name)``
            (the causal LM's backbone, its LM head dropped, and a fresh scalar head), with fresh
            LoRA adapters on the frozen backbone when ``config.use_lora`` (the head trains too).
            A given model must have adapters exactly when ``config.use_lora``.
        tokenizer: default: the tokenizer of ``config.model_name``. PPO scores the policy's
            token ids with the reward model, so it must be the policy's tokenizer.

    Metrics per step: ``loss/reward`` (the loss optimised), ``loss/bradley_terry``,
    ``reward/accuracy``, ``reward/margin``, ``reward/chosen``, ``reward/rejected``,
    ``reward/centering``, ``grad_norm``, ``lr``, ``time/step``; on the held-out pairs
    ``eval/loss``, ``eval/accuracy``, ``eval/margin``, ``eval/reward_mean``, ``eval/reward_std``.
    """

    name = "RM"
    loss_key = "loss/reward"

    def __init__(
        self, config: RewardConfig, model: RewardModel | None = None, tokenizer: Any = None
    ) -> None:
        seed_everything(config.seed)
        if model is None:
            model = RewardModel.from_causal_lm(
                config.model_name,
                head_init=config.head_init,
                seed=config.seed,
                dtype=config.dtype,
                fast_math=config.fast_math and not config.plain_mlx,
                # Under LoRA the backbone stays frozen: a quantized base stays quantized (QLoRA).
                keep_quantized=config.use_lora,
            )
            if config.use_lora:
                model.lora = LoraSettings.from_model_config(config)
                apply_lora(model, model.lora)  # freezes the backbone and the head ...
                model.head.unfreeze()  # ... and the head trains with the adapters
        elif (model.lora is not None) != config.use_lora:
            has = "has" if model.lora is not None else "has no"
            raise ValueError(
                f"the given reward model {has} LoRA adapters but config.use_lora="
                f"{config.use_lora}: set use_lora to match, or pass model=None to load "
                "config.model_name"
            )
        warn_quantized_on_cpu(model, f"the reward model on {config.model_name}")
        #: The fingerprint of the base a LoRA reward model's adapters are trained on, which its
        #: adapter checkpoint records (PPO's share_reward_base compares the policy's with it).
        self.base_fingerprint = model_fingerprint(config.model_name) if config.use_lora else None
        if tokenizer is None:
            tokenizer = load_tokenizer(resolve_model_path(config.model_name))
        self.reward_model = model
        self.tokenizer = tokenizer
        self.pad_token_id = int(tokenizer.pad_token_id)
        super().__init__(config, model)
        self.config: RewardConfig = config

    def prepare(self, data: Iterable[Mapping[str, Any]]) -> list[PreferenceExample]:
        return tokenize_preferences(data, self.tokenizer, self.config.max_length)

    def collate(self, examples: Sequence[PreferenceExample]) -> tuple[PreferenceBatch, int]:
        batch = collate_preferences(
            examples, self.pad_token_id, self.config.margin, self.pad_to_multiple_of
        )
        return batch, batch.num_pairs

    def rewards(self, model: nn.Module, batch: PreferenceBatch) -> tuple[mx.array, mx.array]:
        """``(r_chosen, r_rejected)``, each (B,): the head's output at each row's last token."""
        values = model(batch.input_ids)  # (2B, L)
        rewards = last_token_values(values, batch.lengths)  # (2B,)
        return rewards[: batch.num_pairs], rewards[batch.num_pairs :]

    def loss_fn(
        self, model: nn.Module, batch: PreferenceBatch
    ) -> tuple[mx.array, dict[str, mx.array]]:
        r_chosen, r_rejected = self.rewards(model, batch)
        return bradley_terry_loss(
            r_chosen, r_rejected, batch.margins, self.config.center_rewards_coefficient
        )

    @in_run_scope
    def evaluate(self, examples: Sequence[PreferenceExample]) -> dict[str, float]:
        """Loss, accuracy, mean reward gap, and the rewards' mean and spread on held-out pairs."""
        if not examples:
            raise ValueError("evaluate() got no examples")
        was_training = self.model.training
        self.model.eval()
        chosen: list[np.ndarray] = []
        rejected: list[np.ndarray] = []
        margins: list[np.ndarray] = []
        for chunk in self.eval_chunks(examples):
            batch = collate_preferences(chunk, self.pad_token_id, self.config.margin)
            r_c, r_r = self.rewards(self.model, batch)
            mx.eval(r_c, r_r)
            chosen.append(np.array(r_c))
            rejected.append(np.array(r_r))
            margins.append(np.array(batch.margins))
        self.model.train(was_training)
        r_chosen = mx.array(np.concatenate(chosen))
        r_rejected = mx.array(np.concatenate(rejected))
        loss, metrics = bradley_terry_loss(
            r_chosen,
            r_rejected,
            mx.array(np.concatenate(margins)),
            self.config.center_rewards_coefficient,
        )
        both = mx.concatenate([r_chosen, r_rejected])
        return {
            "eval/loss": float(loss),
            "eval/accuracy": float(metrics["reward/accuracy"]),
            "eval/margin": float(metrics["reward/margin"]),
            "eval/reward_mean": float(both.mean()),
            "eval/reward_std": float(mx.sqrt(mx.var(both))),
        }

    def save_pretrained(self, path: str | Path, overwrite: bool = False) -> Path:
        """The one-label ``*ForSequenceClassification`` layout with the tokenizer (with LoRA: the
        adapter checkpoint, its base and the base's fingerprint recorded), which
        ``RewardModel.from_pretrained`` and ``ValueModel.from_pretrained`` load. Only rank 0 of a
        data-parallel run writes."""
        if not self.is_main_process:
            return Path(path)
        check_save_target(path, overwrite=overwrite)  # never destroy what is there
        with atomic_directory(path) as tmp:  # a kill mid-save never leaves half a model
            self.reward_model.save_pretrained(
                tmp, tokenizer=self.tokenizer, base_fingerprint=self.base_fingerprint
            )
        return Path(path)

    def _resume_keys(self) -> tuple[str, ...]:
        return ("head_init", "use_lora", "lora_r", "lora_alpha", "lora_layers", "lora_keys")


def run_reward_training(config: RewardConfig, *, resume_from: str | Path | None = None) -> Path:
    """Reward-model training from the config alone (what ``main.py reward`` calls).

    Reads ``config.dataset`` and the held-out pairs (:func:`load_run_data`), trains, and saves
    the model to ``<output_dir>/model``.

    Returns:
        The saved reward-model directory (PPO's ``reward_model_name``).

    Raises:
        ValueError: ``config.dataset`` is not set, or the data is malformed.
        TrainingStopped: Ctrl-C or SIGTERM stopped the run (after saving a checkpoint).
    """
    return run_stage(RewardTrainer, config, load_preference_data, resume_from)
