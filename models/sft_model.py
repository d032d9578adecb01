"""The frozen reference (SFT) model of PPO's KL penalty.

Two ways to hold it:

* :meth:`ReferenceModel.from_pretrained` loads a separate copy of the weights, frozen. Needed when
  the policy trains all of its weights.
* :meth:`ReferenceModel.from_policy` shares the policy's base weights when the policy trains LoRA
  adapters: the reference is the policy with its adapters switched off
  (:func:`base_setup.lora_setup.adapters_disabled`), which is exactly the base model, so no
  second copy of the base weights is held (``benchmarks/reference_memory.py`` measures it).

Either way the logits are constants for the PPO loss: they pass through ``mx.stop_gradient`` and
the reference never appears among any optimizer's parameters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from base_setup.lora_setup import adapters_disabled, lora_modules
from models.policy_model import PolicyModel, lm_head, lm_hidden_at, lm_logits_at


class ReferenceModel:
    """Logits of the frozen reference model; never trains.

    Attributes:
        model: the mlx-lm module it runs (the policy's own module when weights are shared).
        tokenizer: the tokenizer of the model.
        shares_policy_weights: ``True`` for :meth:`from_policy`.
    """

    def __init__(self, model: nn.Module, tokenizer: Any, *, shares_policy_weights: bool) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.shares_policy_weights = shares_policy_weights

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: str | None = None, fast_math: bool = True
    ) -> ReferenceModel:
        """A separate, frozen copy of the model at ``path`` (see ``PolicyModel.from_pretrained``)."""
        policy = PolicyModel.from_pretrained(path, dtype=dtype, fast_math=fast_math)
        policy.model.freeze()
        policy.model.eval()
        return cls(policy.model, policy.tokenizer, shares_policy_weights=False)

    @classmethod
    def from_policy(cls, policy: PolicyModel) -> ReferenceModel:
        """The policy's base model (adapters off), sharing its weights.

        Raises ``ValueError`` if the policy has no LoRA adapters: then every weight trains and the
        reference needs its own copy (use :meth:`from_pretrained` with the policy's path).
        """
        if policy.lora is None or not lora_modules(policy.model):
            raise ValueError(
                "ReferenceModel.from_policy needs a policy with LoRA adapters (its base weights "
                "stay frozen); this policy trains all weights, so load a separate reference with "
                f"ReferenceModel.from_pretrained({str(policy.model_path)!r})"
            )
        return cls(policy.model, policy.tokenizer, shares_policy_weights=True)

    def _base_constant(self, fn: Callable[..., mx.array], *args: mx.array) -> mx.array:
        """``fn(self.model, *args)`` on the base weights (the shared policy's adapters off), as a
        constant (no gradient)."""
        if self.shares_policy_weights:
            with adapters_disabled(self.model):
                out = fn(self.model, *args)
        else:
            out = fn(self.model, *args)
        return mx.stop_gradient(out)

    def __call__(self, input_ids: mx.array) -> mx.array:
        """Logits ``(B, L, V)`` for ``input_ids`` ``(B, L)``, as a constant (no gradient)."""
        return self._base_constant(lambda model, ids: model(ids), input_ids)

    def logits_at(self, input_ids: mx.array, positions: mx.array) -> mx.array:
        """Logits ``(B, T, V)`` at ``positions`` ``(B, T)`` only, as a constant (see
        :func:`models.policy_model.lm_logits_at`)."""
        return self._base_constant(lm_logits_at, input_ids, positions)

    def output_head(self) -> Any:
        """The LM head, a function of the hidden states :meth:`hidden_at` gives, or None (see
        :func:`models.policy_model.lm_head`); LoRA never adapts it, so it is the base's."""
        return lm_head(self.model)

    def hidden_at(self, input_ids: mx.array, positions: mx.array) -> mx.array:
        """Last hidden states ``(B, T, D)`` at ``positions`` ``(B, T)``, as a constant (see
        :func:`models.policy_model.lm_hidden_at`)."""
        return self._base_constant(lm_hidden_at, input_ids, positions)
