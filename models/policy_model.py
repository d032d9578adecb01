"""The policy: an mlx-lm causal LM (any architecture mlx-lm supports) with its tokenizer.

:class:`PolicyModel` wraps the module ``mlx_lm.load`` builds, so generation, log-probs and the PPO
loss all call the same forward pass, and saves in formats the mlx-lm tools read back:

* full weights: a model directory (``config.json``, ``model.safetensors``, tokenizer files) for
  ``mlx_lm.load`` and the ``mlx_lm.generate --model <dir>`` command line;
* LoRA: an adapter directory (``adapters.safetensors`` + ``adapter_config.json``) for
  ``mlx_lm.generate --model <base> --adapter-path <dir>``, or, with ``merged=True``, the adapters
  fused into the base weights and saved as a full model (mlx-lm's fuse logic).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import mlx.core as mx
import mlx.nn as nn

from base_setup.lora_setup import (
    LoraSettings,
    adapters_fused,
    apply_lora,
    load_adapters,
    save_adapters,
)
from base_setup.tokenizer_setup import load_tokenizer

_DTYPES: dict[str, mx.Dtype] = {
    "float32": mx.float32,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
}
# "name" or "namespace/name", as the Hugging Face Hub accepts them.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def resolve_model_path(path_or_hub_id: str | Path) -> Path:
    """A local directory for ``path_or_hub_id``: the path itself, or the Hub snapshot mlx-lm fetches.

    Raises:
        FileNotFoundError: a local path that does not exist, a path without config.json, or a
            hub id that cannot be fetched (offline and not in the local cache, or unknown).
    """
    path = Path(path_or_hub_id)
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{path} exists but holds no config.json; pass the directory of a Hugging Face "
                "or mlx-lm checkpoint"
            )
        return path
    text = str(path_or_hub_id)
    if not _HUB_ID.match(text) or text.startswith("."):
        raise FileNotFoundError(f"model path {text} does not exist")

    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    from mlx_lm.utils import _download

    try:
        return Path(_download(text))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as err:
        first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise FileNotFoundError(
            f"{text} is not a local directory and the Hugging Face Hub could not provide it "
            f"({type(err).__name__}: {first_line}). Check the path, or download the model "
            "while online (it is then read from the local cache)."
        ) from err


class PolicyModel(nn.Module):
    """An mlx-lm causal LM and its tokenizer, optionally with LoRA adapters.

    Attributes:
        model: the mlx-lm module (``logits = model(input_ids, cache)``).
        tokenizer: mlx-lm's ``TokenizerWrapper`` with a pad token distinct from EOS
            (:mod:`base_setup.tokenizer_setup`).
        model_path: the local directory the base weights came from.
        lora: the LoRA settings, or ``None`` when every weight trains.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        model_path: str | Path,
        config: Mapping[str, Any],
        lora: LoraSettings | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.model_path = Path(model_path)
        self.lora = lora
        # A read-only mapping, not a dict: nn.Module would file a dict among its children.
        self._config = MappingProxyType(copy.deepcopy(dict(config)))
        self.train(model.training)  # the wrapper reports the wrapped model's mode

    @classmethod
    def from_pretrained(
        cls,
        path_or_hub_id: str | Path,
        *,
        dtype: str | None = None,
        lora: LoraSettings | None = None,
        adapter_path: str | Path | None = None,
    ) -> PolicyModel:
        """Load a model with mlx-lm's loader (``mlx_lm.utils.load_model``) and its tokenizer.

        Args:
            path_or_hub_id: a local checkpoint directory, or a Hub id where there is network
                (or the model is in the local Hugging Face cache).
            dtype: cast floating-point weights to ``"float32"``, ``"float16"`` or
                ``"bfloat16"``; ``None`` keeps the checkpoint's dtype.
            lora: add fresh LoRA adapters and freeze the base weights.
            adapter_path: instead, load adapters saved by :meth:`save_pretrained` (or
                ``mlx_lm.lora``) to continue training them.

        The model comes back in eval mode, as mlx-lm loads it; call ``.train()`` where dropout
        (LoRA dropout) should act.

        Raises:
            FileNotFoundError: see :func:`resolve_model_path`.
            ValueError: unknown ``dtype``, both ``lora`` and ``adapter_path``, an architecture
                mlx-lm does not support, or no usable pad token.
        """
        if dtype is not None and dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or None, got {dtype!r}")
        if lora is not None and adapter_path is not None:
            raise ValueError("pass either lora (new adapters) or adapter_path (saved ones)")
        from mlx_lm.utils import load_model

        model_path = resolve_model_path(path_or_hub_id)
        model, config = load_model(model_path)
        if dtype is not None:
            model.set_dtype(_DTYPES[dtype])
            for key in ("dtype", "torch_dtype"):  # keep a saved config.json truthful
                if key in config:
                    config[key] = dtype
        tokenizer = load_tokenizer(model_path)
        if lora is not None:
            apply_lora(model, lora)
        elif adapter_path is not None:
            lora = load_adapters(model, adapter_path)
        return cls(model, tokenizer, model_path=model_path, config=config, lora=lora)

    @property
    def config(self) -> dict[str, Any]:
        """A copy of the model's config.json (as mlx-lm read it)."""
        return copy.deepcopy(dict(self._config))

    def __call__(self, input_ids: mx.array, cache: list[Any] | None = None) -> mx.array:
        """Logits ``(B, L, V)`` for ``input_ids`` ``(B, L)``; ``cache`` is mlx-lm's KV cache."""
        return self.model(input_ids, cache=cache)

    def save_pretrained(self, save_dir: str | Path, *, merged: bool = False) -> Path:
        """Save what ``mlx_lm.load`` / the mlx-lm command line can load back.

        * no LoRA, or ``merged=True``: a full model directory, via mlx-lm's ``save`` (weights,
          config.json, tokenizer, generation_config.json); with LoRA the adapters are fused into
          the base weights first (mlx-lm's ``fuse``), without changing this model.
        * LoRA and ``merged=False``: an adapter directory (see :mod:`base_setup.lora_setup`),
          to be loaded on top of :attr:`model_path`.
        """
        out = Path(save_dir)
        if self.lora is not None and not merged:
            return save_adapters(self.model, self.lora, out)
        from mlx_lm.utils import save

        with adapters_fused(self.model):
            save(out, self.model_path, self.model, self.tokenizer, self.config, donate_model=False)
        return out
