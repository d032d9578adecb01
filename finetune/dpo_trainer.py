"""Direct preference optimisation (DPO) and its family: the policy learns from preference pairs
directly, with no reward model and no rollouts (Rafailov et al. 2023).

Each step scores both answers of every pair under the policy (``log pi(y | x)``, summed over the
answer's tokens and EOS; the prompt is context) and applies the configured loss
(:func:`training.preference_loss.preference_loss`: sigmoid, ipo, hinge, robust, simpo, orpo). The
reference's log-probs are computed once, before the first step, and cached in
``<output_dir>/reference_logps/``: a resumed run reads them back instead of recomputing them, and a
separately loaded reference is dropped before training, so it holds no memory while the policy
trains. With LoRA the reference is the policy with its adapters off (no second copy).

The loop, checkpoints, exact resume, signals, metrics and curves are those of every stage
(:class:`training.loop.TrainingLoop`, through
:class:`finetune.supervised_trainer.SupervisedTrainer`); the saved model is a full model
directory (LoRA merged), like SFT's, which ``generate``, ``chat``, ``export`` and PPO load.

::

    config = DPOConfig(model_name="runs/sft/model", dataset="preferences.jsonl", beta=0.1)
    model_dir = run_dpo(config)            # <output_dir>/model
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from base_setup import distributed as dist
from base_setup import seed_everything
from base_setup.tokenizer_setup import vocabulary_difference
from config.dpo_config import DPOConfig
from models.policy_model import PolicyModel
from models.sft_model import ReferenceModel
from finetune.records import load_preference_data
from finetune.sft_trainer import load_policy
from finetune.supervised_trainer import SupervisedTrainer, run_stage
from finetune.tokenize import DPOBatch, DPOExample, collate_dpo, tokenize_dpo_pairs
from token_attribution.sequences import next_token_scores
from training.callbacks import CallbackLike
from training.compiled_gradient import gradient_arithmetic
from training.fingerprints import model_fingerprint
from training.run_control import in_run_scope
from training.checkpoint import atomic_directory, check_save_target
from training.preference_loss import answer_logps, preference_loss

logger = logging.getLogger("ppo_mlx")

#: Folder under ``output_dir`` of the cached reference log-probs (one ``<digest>.npz`` per data).
REFERENCE_CACHE = "reference_logps"


def check_same_tokenizer(policy_tokenizer: Any, reference_tokenizer: Any, reference: str) -> None:
    """Raise ``ValueError`` unless both tokenizers map the same strings to the same ids (the same
    vocabulary, special tokens and EOS): the loss compares log-probs of one token sequence."""
    difference = vocabulary_difference(policy_tokenizer, reference_tokenizer)
    if difference is not None:
        raise ValueError(
            f"the reference model {reference} uses another tokenizer than the policy (the "
            f"policy first: {difference}), so it cannot score the policy's token ids: use a "
            "reference trained with the policy's tokenizer, or ref_model_name: null (the "
            "policy's start)"
        )
    if policy_tokenizer.eos_token_id != reference_tokenizer.eos_token_id:
        raise ValueError(
            f"the reference model {reference} ends answers with EOS id "
            f"{reference_tokenizer.eos_token_id}, the policy with {policy_tokenizer.eos_token_id}: "
            "use a reference with the policy's tokenizer, or ref_model_name: null"
        )


def answer_token_logps(
    model: Any, batch: DPOBatch, *, differentiable: bool = True
) -> tuple[mx.array, mx.array]:
    """``(token_logps, mask)``, each (2B, L-1): ``log p(token t+1 | tokens <= t)`` under
    ``model`` (:func:`token_attribution.sequences.next_token_scores`: blockwise from a policy's
    or reference's hidden states, or through a callable's logits) and 1 where token t+1 is an
    answer token; ``differentiable=False`` where no gradient is taken (constants)."""
    scores = next_token_scores(model, batch.input_ids, differentiable=differentiable)
    return scores.logprobs, batch.answer_mask[:, 1:]


def dpo_batch_loss(
    model: Any, batch: DPOBatch, config: DPOConfig
) -> tuple[mx.array, dict[str, mx.array]]:
    """``(loss, metrics)`` of ``config.loss_type`` on one batch of pairs: the policy ``model``'s
    summed answer log-probs against the batch's cached reference log-probs
    (:func:`training.preference_loss.preference_loss`); orpo's NLL is the mean per token over
    the chosen answers.

    Raises:
        ValueError: the loss needs reference log-probs and the batch has none.
    """
    token_logps, mask = answer_token_logps(model, batch)  # (2B, L-1) each
    logps = answer_logps(token_logps, mask)  # (2B,)
    lengths = mask.sum(axis=-1)  # (2B,)
    n = batch.num_pairs
    ref_chosen = ref_rejected = None
    if config.needs_reference:
        if batch.ref_logps is None:
            raise ValueError("the batch has no reference log-probs: DPOTrainer.prepare adds them")
        # Computed before training: constants, no gradient reaches the reference.
        ref_chosen, ref_rejected = batch.ref_logps[:n], batch.ref_logps[n:]
    chosen_nll = None
    if config.loss_type == "orpo":
        chosen_nll = -(token_logps[:n] * mask[:n]).sum() / mx.maximum(mask[:n].sum(), 1.0)
    return preference_loss(
        config.loss_type,
        logps[:n],
        logps[n:],
        ref_chosen,
        ref_rejected,
        lengths[:n],
        lengths[n:],
        beta=config.beta,
        label_smoothing=config.label_smoothing,
        simpo_gamma=config.simpo_gamma,
        chosen_nll=chosen_nll,
    )


class DPOTrainer(SupervisedTrainer[DPOExample, DPOBatch]):
    """Preference optimisation of a :class:`PolicyModel` (see the module docstring).

    Args:
        config: the run's :class:`DPOConfig`.
        model: a ready policy; default: loaded from ``config.model_name`` with fresh LoRA
            adapters when ``config.use_lora`` (it must match ``config.use_lora``).
        ref_model: a ready reference; default (losses that use one): ``config.ref_model_name``,
            else the policy's starting weights (adapters off, or a frozen copy of
            ``config.model_name``). Loaded only when log-probs are not in the run's cache.

    Metrics per step (TRL's names): ``loss/dpo``, ``rewards/chosen``, ``rewards/rejected``,
    ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``, ``logps/rejected`` (orpo adds
    ``nll_loss``, ``log_odds_ratio``), ``grad_norm``, ``lr``, ``time/step``; on the held-out pairs
    the same under ``eval/`` (``eval/loss``, ``eval/rewards/accuracies`` ...).
    """

    name = "DPO"
    loss_key = "loss/dpo"

    def __init__(
        self,
        config: DPOConfig,
        model: PolicyModel | None = None,
        ref_model: ReferenceModel | None = None,
    ) -> None:
        seed_everything(config.seed)
        self.policy = load_policy(config, model)
        self.tokenizer = self.policy.tokenizer
        self.pad_token_id = int(self.tokenizer.pad_token_id)
        if ref_model is not None:
            check_same_tokenizer(self.tokenizer, ref_model.tokenizer, "given as ref_model")
        self._reference = ref_model
        self._resuming = False
        super().__init__(config, self.policy)
        self.config: DPOConfig = config
        # Recorded and compared on resume like the base model's (None: a Hub name, or none).
        self.inputs["ref_model_name"] = model_fingerprint(config.ref_model_name)

    # ------------------------------------------------------------------ the reference
    def reference(self) -> ReferenceModel:
        """The reference model, loaded on first use (see the class docstring)."""
        if self._reference is None:
            cfg = self.config
            if cfg.ref_model_name is not None:
                ref = ReferenceModel.from_pretrained(
                    cfg.ref_model_name,
                    dtype=cfg.dtype,
                    fast_math=cfg.fast_math and not cfg.plain_mlx,
                )
                check_same_tokenizer(self.tokenizer, ref.tokenizer, cfg.ref_model_name)
            elif self.policy.lora is not None:
                ref = ReferenceModel.from_policy(self.policy)  # adapters off: the base
            else:
                ref = ReferenceModel.from_pretrained(
                    cfg.model_name, dtype=cfg.dtype, fast_math=cfg.fast_math and not cfg.plain_mlx
                )
            self._reference = ref
        return self._reference

    def reference_logps(self, examples: Sequence[DPOExample]) -> np.ndarray:
        """(N, 2) the reference's summed log-probs of each pair's (chosen, rejected) answer,
        in evaluation batches. In a data-parallel run each rank computes every N-th batch and
        the ranks' arrays (zero elsewhere) are summed: every rank gets the whole array, each
        value computed once, as one process computes it."""
        out = np.zeros((len(examples), 2), dtype=np.float32)
        size = self.config.eval_micro_batch_size
        order = sorted(range(len(examples)), key=lambda i: len(examples[i]))  # little padding
        ref = self.reference()
        starts = range(0, len(order), size)
        for start in starts[self.rank :: self.world_size]:
            index = order[start : start + size]
            batch = collate_dpo([examples[i] for i in index], self.pad_token_id)
            # With the policy's arithmetic: at the start, policy and reference agree exactly.
            with gradient_arithmetic(self._value_and_grad):
                logps = answer_logps(*answer_token_logps(ref, batch, differentiable=False))
            mx.eval(logps)
            values = np.array(logps).reshape(2, len(index))  # (chosen, rejected) x B
            out[index] = values.T
        if self.world_size > 1:  # x + 0 is exact: the sum is each value from the rank it is on
            out = np.array(dist.all_sum(mx.array(out), self.group))
        return out

    def _cache_path(self, examples: Sequence[DPOExample]) -> Path:
        """Where the reference log-probs of ``examples`` are cached: named by a digest of the
        token ids and of what the reference is (its name and its weights' fingerprint, so new
        weights at the same path are not read as the old ones' log-probs)."""
        cfg = self.config
        digest = hashlib.sha256()
        fingerprint = self.inputs["ref_model_name" if cfg.ref_model_name else "model"]
        what = {
            "reference": cfg.ref_model_name or cfg.model_name,
            "fingerprint": fingerprint,
            "dtype": cfg.dtype,
            "adapters_off": cfg.ref_model_name is None and cfg.use_lora,
        }
        digest.update(json.dumps(what, sort_keys=True).encode())
        for e in examples:
            digest.update(
                np.array(
                    [e.chosen_start, len(e.chosen_ids), e.rejected_start, len(e.rejected_ids)]
                    + e.chosen_ids
                    + e.rejected_ids,
                    dtype=np.int64,
                ).tobytes()
            )
        return self.run_dir / REFERENCE_CACHE / f"{digest.hexdigest()[:24]}.npz"

    def _with_reference(self, examples: list[DPOExample]) -> list[DPOExample]:
        """``examples`` with their reference log-probs: from the run's cache when resuming and
        it holds them, else computed and cached (written aside, then renamed)."""
        path = self._cache_path(examples)
        # Read the cache only if every rank finds it (computing the log-probs is collective).
        if not dist.any_rank(not (self._resuming and path.is_file()), self.group):
            with np.load(path) as data:
                logps = data["logps"]
            logger.info("reference log-probs of %d pairs read from %s", len(examples), path)
        else:
            if self._resuming:
                logger.warning("no cached reference log-probs at %s: computing them", path)
            logps = self.reference_logps(examples)
            if self.is_main_process:  # the one writer of the run folder
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".{path.stem}.tmp.npz")
                np.savez(tmp, logps=logps)
                os.replace(tmp, path)
        return [
            DPOExample(
                e.chosen_ids, e.chosen_start, e.rejected_ids, e.rejected_start, float(c), float(r)
            )
            for e, (c, r) in zip(examples, logps)
        ]

    # ------------------------------------------------------------------ task seams
    def train(
        self,
        train_data: Iterable[Mapping[str, Any]],
        eval_data: Iterable[Mapping[str, Any]] | None = None,
        resume_from: str | Path | None = None,
        callbacks: Sequence[CallbackLike] = (),
    ) -> list[dict[str, Any]]:
        self._resuming = resume_from is not None  # the reference cache is read on resume only
        return super().train(train_data, eval_data, resume_from, callbacks)

    def prepare(self, data: Iterable[Mapping[str, Any]]) -> list[DPOExample]:
        """Check and tokenise the pairs; add the reference's log-probs (losses that use them)."""
        examples = tokenize_dpo_pairs(data, self.tokenizer, self.config.max_length)
        if not self.config.needs_reference:
            return examples
        return self._with_reference(examples)

    def collate(self, examples: Sequence[DPOExample]) -> tuple[DPOBatch, int]:
        return collate_dpo(examples, self.pad_token_id, self.pad_to_multiple_of), len(examples)

    def loss_fn(self, model: nn.Module, batch: DPOBatch) -> tuple[mx.array, dict[str, mx.array]]:
        return dpo_batch_loss(model, batch, self.config)

    def step(self, examples: Sequence[DPOExample]) -> dict[str, float]:
        # The reference's log-probs are all computed by now: a separate copy frees its memory.
        if self._reference is not None and not self._reference.shares_policy_weights:
            self._reference = None
        return super().step(examples)

    @in_run_scope
    def evaluate(self, examples: Sequence[DPOExample]) -> dict[str, float]:
        """The loss and TRL's metrics on held-out pairs (means over pairs), as ``eval/...``."""
        if not examples:
            raise ValueError("evaluate() got no examples")
        was_training = self.model.training
        self.model.eval()
        sums: dict[str, float] = {}
        for chunk in self.eval_chunks(examples):
            loss, metrics = self.loss_fn(self.model, collate_dpo(chunk, self.pad_token_id))
            mx.eval(loss, metrics)
            for key, value in {"loss": loss, **metrics}.items():
                sums[key] = sums.get(key, 0.0) + float(value) * len(chunk)
        self.model.train(was_training)
        return {f"eval/{key}": total / len(examples) for key, total in sums.items()}

    def _postfix(self, record: Mapping[str, Any]) -> dict[str, str]:
        keys = {"loss": self.loss_key, "acc": "rewards/accuracies", "margin": "rewards/margins"}
        keys.update({"eval_loss": "eval/loss", "eval_acc": "eval/rewards/accuracies"})
        return {short: f"{record[key]:.3f}" for short, key in keys.items() if key in record}

    def save_pretrained(self, path: str | Path, overwrite: bool = False) -> Path:
        """A full model directory (LoRA adapters merged into the weights) that ``generate``,
        ``chat``, ``export``, ``PolicyModel.from_pretrained`` and ``mlx_lm.load`` read. A file,
        or a non-empty directory without ``overwrite``, is refused (``ValueError``). Only rank 0
        of a data-parallel run writes."""
        if not self.is_main_process:
            return Path(path)
        check_save_target(path, overwrite=overwrite)  # never destroy what is there
        with atomic_directory(path) as tmp:  # a kill mid-save never leaves half a model
            self.policy.save_pretrained(tmp, merged=True)
        return Path(path)

    def _resume_keys(self) -> tuple[str, ...]:
        return (
            "use_lora",
            "lora_r",
            "lora_alpha",
            "lora_layers",
            "lora_keys",
            "loss_type",
            "ref_model_name",
        )


def run_dpo(config: DPOConfig, *, resume_from: str | Path | None = None) -> Path:
    """Preference optimisation from the config alone (what ``main.py dpo`` calls).

    Reads ``config.dataset`` (TRL's preference format: ``prompt``, ``chosen``, ``rejected``) and
    the held-out pairs, trains, and saves the model to ``<output_dir>/model``.

    Returns:
        The saved model directory (PPO's ``model_name``, ``generate`` / ``chat`` / ``export``).

    Raises:
        ValueError: ``config.dataset`` is not set, or the data is malformed.
        TrainingStopped: Ctrl-C or SIGTERM stopped the run (after saving a checkpoint).
    """
    return run_stage(DPOTrainer, config, load_preference_data, resume_from)
