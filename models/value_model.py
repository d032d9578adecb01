"""The value model (critic): a transformer backbone with a scalar head, ``V(s_t)`` at every
position.

It has the reward model's layout (a one-label ``*ForSequenceClassification``, see
:mod:`models.backbone`), so it usually starts from the reward model's weights (the choice of
"Fine-Tuning Language Models from Human Preferences" and summarize_from_feedback_details), or from
the policy's backbone with a fresh head.

:meth:`ValueModel.sharing_base` instead trains LoRA adapters of its own and the head on the
policy's frozen base weights, held once in memory (TRL's value head on the policy, PEFT's
multi-adapter PPO): the value model's module tree is a copy of the policy backbone's whose
arrays are the policy's own, so the two trees never share a trainable parameter, and the
policy's adapters (and their merging for sampling) never see the value adapters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from base_setup.lora_setup import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    LoraSettings,
    adapter_parameters,
    apply_lora,
    lora_modules,
    read_adapter_settings,
    save_adapters,
)
from models.backbone import DtypeLike, HeadInit, ScalarHeadModel
from models.backbone_loading import HF_HEAD_WEIGHT, resolve_dtype

#: The head's weight in a shared-base value model's directory (beside its adapters).
VALUE_HEAD_FILE = "value_head.safetensors"

__all__ = ["ValueModel"]


class ValueModel(ScalarHeadModel):
    """``values = model(input_ids)``: (B, L) token ids -> (B, L) value estimates, ``values[b, t]``
    being the value of the state that ends with token t.

    Build it with :meth:`from_pretrained` (a reward-model or value-model checkpoint),
    :meth:`from_policy_backbone` or :meth:`sharing_base`; save with :meth:`save_pretrained`.

    Attributes:
        lora: the value adapters' settings when the model trains LoRA adapters on a base it
            shares (:meth:`sharing_base`); None when every weight trains.
    """

    #: A loaded value model trains every weight: an adapter checkpoint's quantized base is
    #: dequantized (:meth:`from_pretrained`).
    keeps_adapter_base_quantized = False

    @classmethod
    def from_pretrained(
        cls, path_or_repo: str | Path, *, dtype: DtypeLike = None, fast_math: bool = True
    ) -> ValueModel:
        """Load a reward- or value-model checkpoint (see :meth:`ScalarHeadModel.from_pretrained`)
        as a value model that trains every weight; a LoRA reward model's adapter checkpoint has
        its adapters merged into the weights (``W + scale * B^T A^T``), so the value model
        starts from the reward model's function (on a quantized base, the base dequantized: the
        value model trains it)."""
        model = super().from_pretrained(path_or_repo, dtype=dtype, fast_math=fast_math)
        if model.lora is not None:
            fused = [(name, m.fuse(dequantize=False)) for name, m in lora_modules(model)]
            model.update_modules(tree_unflatten(fused))
            model.unfreeze()
            model.lora = None
            model.train()
            mx.eval(model.parameters())
        return model

    @classmethod
    def from_policy_backbone(
        cls,
        path_or_model: str | Path | nn.Module,
        *,
        head_init: HeadInit = "zeros",
        seed: int = 0,
        dtype: DtypeLike = None,
        fast_math: bool = True,
    ) -> ValueModel:
        """The policy's backbone (``lm_head`` dropped) with a fresh scalar head.

        Args:
            path_or_model: the policy's checkpoint directory or repo id, or the in-memory mlx-lm
                causal LM (its weights are shared until the value model is trained; MLX arrays
                are immutable, so training one never changes the other).
            head_init: "zeros" (every value 0 at first; the first gradient then reaches only the
                head) or "normal" (N(0, 1/(D+1)) from ``seed``).
            seed: seed of the "normal" head.
            dtype: parameter dtype; None = float32.
            fast_math: run the layers through :mod:`base_setup.fast_math` (False: mlx-lm's).
        """
        return cls.from_causal_lm(
            path_or_model, head_init=head_init, seed=seed, dtype=dtype, fast_math=fast_math
        )

    @classmethod
    def sharing_base(
        cls,
        policy_lm: nn.Module,
        lora: LoraSettings,
        *,
        head_init: HeadInit = "zeros",
        seed: int = 0,
        dtype: DtypeLike = None,
        fast_math: bool = True,
    ) -> ValueModel:
        """A value model on the base weights of ``policy_lm`` (a LoRA policy's mlx-lm causal
        LM), with LoRA adapters of its own and a fresh scalar head, the only parameters it trains.

        The backbone is a new module tree (the policy's with its adapters off) whose arrays are
        the policy's base arrays themselves, quantised layers included: no base weight is
        copied, and gradients and optimiser state exist for the value adapters and head only.
        The base must stay frozen (a LoRA policy's is), or the two models would drift apart.

        Args:
            policy_lm: the policy's mlx-lm model, with its LoRA adapters.
            lora: the value adapters' rank, scale, layers and keys (usually the policy's).
            head_init, seed: the head's start, as in :meth:`from_policy_backbone`.
            dtype: the head's dtype; None = float32 (the base keeps the policy's dtype).
            fast_math: run the layers through :mod:`base_setup.fast_math` (False: mlx-lm's).

        Raises:
            ValueError: ``policy_lm`` has no LoRA adapters (its base would train).
        """
        if head_init not in ("zeros", "normal"):
            raise ValueError(f"head_init must be 'zeros' or 'normal', got {head_init!r}")
        model = cls.on_policy_base(policy_lm, fast_math=fast_math)
        hidden_size = int(model.head.weight.shape[1])
        head_dtype = resolve_dtype(dtype)
        if head_init == "zeros":
            model.head.weight = mx.zeros((1, hidden_size), dtype=head_dtype)  # (1, D)
        else:
            std = 1.0 / (hidden_size + 1) ** 0.5
            weight = std * mx.random.normal((1, hidden_size), key=mx.random.key(seed))  # (1, D)
            model.head.weight = weight.astype(head_dtype)
        apply_lora(model, lora)  # freezes the backbone and the head ...
        model.head.unfreeze()  # ... and the head trains with the adapters
        model.lora = lora
        mx.eval(model.trainable_parameters())
        return model

    def save_pretrained(self, save_dir: str | Path, tokenizer: Any = None, **kwargs: Any) -> Path:
        """Write the model (see :meth:`ScalarHeadModel.save_pretrained`); a shared-base model
        (:meth:`sharing_base`) writes only what it trains: its adapters in mlx-lm's format
        (``adapters.safetensors``, ``adapter_config.json``) and the head (``value_head.safetensors``,
        ``score.weight``), which :meth:`load_pretrained_weights` reads back onto the base."""
        if self.lora is None:
            return super().save_pretrained(save_dir, tokenizer, **kwargs)
        out = save_adapters(self, self.lora, save_dir)
        mx.save_safetensors(str(out / VALUE_HEAD_FILE), {HF_HEAD_WEIGHT: self.head.weight})
        return out

    def load_pretrained_weights(self, path: str | Path) -> None:
        """Load, in place, what :meth:`save_pretrained` wrote; a shared-base model reads its
        adapters and head (every one of them, with the saved LoRA settings its own)."""
        if self.lora is None:
            super().load_pretrained_weights(path)
            return
        path = Path(path)
        for name in (ADAPTER_WEIGHTS_FILE, ADAPTER_CONFIG_FILE, VALUE_HEAD_FILE):
            if not (path / name).is_file():
                raise FileNotFoundError(
                    f"{path} has no {name}: a value model sharing the policy's base loads the "
                    "adapter directory its save_pretrained wrote"
                )
        saved = read_adapter_settings(path)
        if (saved.r, saved.num_layers, saved.keys) != (
            self.lora.r,
            self.lora.num_layers,
            self.lora.keys,
        ):
            raise ValueError(
                f"{path}: the saved value adapters (r={saved.r}, layers={saved.num_layers}, "
                f"keys={saved.keys}) differ from this model's (r={self.lora.r}, layers="
                f"{self.lora.num_layers}, keys={self.lora.keys})"
            )
        weights = cast(dict[str, mx.array], mx.load(str(path / ADAPTER_WEIGHTS_FILE)))
        head = cast(dict[str, mx.array], mx.load(str(path / VALUE_HEAD_FILE)))
        expected = set(adapter_parameters(self)) | {HF_HEAD_WEIGHT}
        found = set(weights) | set(head)
        if found != expected:
            raise ValueError(
                f"{path}: the saved value adapters and head do not match this model's "
                f"(missing {sorted(expected - found)[:4]}, extra {sorted(found - expected)[:4]})"
            )
        self.load_weights(list(weights.items()) + list(head.items()), strict=False)
        mx.eval(self.trainable_parameters())
