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
import logging
import re
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import mlx.core as mx
import mlx.nn as nn

from base_setup.fast_layers import accelerate_model
from base_setup.plain import speed_tricks
from base_setup.lora_setup import (
    LoraSettings,
    adapters_fused,
    apply_lora,
    is_quantized_layer,
    load_adapters,
    save_adapters,
    warn_quantized_on_cpu,
)
from base_setup.tokenizer_setup import load_tokenizer
from models.backbone_loading import check_model_files
from models.checkpoint_config import check_config_is_read, config_updates

logger = logging.getLogger("ppo_mlx")

_DTYPES: dict[str, mx.Dtype] = {
    "float32": mx.float32,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
}
# "name" or "namespace/name", as the Hugging Face Hub accepts them.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def looks_like_hub_id(text: str) -> bool:
    """Whether ``text``, which is no local path, has the shape of a Hub repo id ("owner/name")."""
    return bool(_HUB_ID.match(text)) and text.count("/") == 1 and not text.startswith(".")


def resolve_model_path(path_or_hub_id: str | Path) -> Path:
    """A local directory for ``path_or_hub_id``: the path itself, or its Hub snapshot (the files
    ``mlx_lm.load`` fetches: ``mlx_lm.utils.DEFAULT_ALLOW_PATTERNS``).

    Raises:
        FileNotFoundError: a local path that does not exist, a path without config.json, or a
            hub id that cannot be fetched (offline and not in the local cache, or unknown).
        ValueError: a local config.json that is not JSON, or a weights file cut short.
    """
    path = Path(path_or_hub_id)
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{path} exists but holds no config.json; pass the directory of a Hugging Face "
                "or mlx-lm checkpoint"
            )
        check_model_files(path)  # a config.json that is not JSON, a cut weights file: named
        return path
    text = str(path_or_hub_id)
    if not _HUB_ID.match(text) or text.startswith("."):
        raise FileNotFoundError(f"model path {text} does not exist")

    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    try:  # the files mlx-lm's own loader fetches (its public list of them)
        return Path(huggingface_hub.snapshot_download(text, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as err:
        first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise FileNotFoundError(
            f"{text} is not a local directory and the Hugging Face Hub could not provide it "
            f"({type(err).__name__}: {first_line}). Check the path, or download the model "
            "while online (it is then read from the local cache)."
        ) from err


def lm_logits_at(lm: nn.Module, input_ids: mx.array, positions: mx.array) -> mx.array:
    """Logits ``(B, T, V)`` of the causal LM ``lm`` at ``positions`` ``(B, T)`` of ``input_ids``.

    Equal to ``take_along_axis(lm(input_ids), positions)``, but the LM head runs on the ``T``
    gathered hidden states only, and the gradient of the gather is a (B, L, D) scatter instead
    of a (B, L, V) one (the vocabulary is usually far wider than the hidden size). That takes the
    mlx-lm layout ``lm(x) = head(lm.model(x))``, with ``head`` the ``lm_head`` or the tied
    embedding; it is checked once per model on a 3-token input, and a model that computes its
    logits some other way (soft-capping, scaling) gets the full forward pass and the gather, as
    does every model under plain MLX and off the CPU (:func:`base_setup.plain.speed_tricks`).
    """
    head = lm_head(lm) if speed_tricks() else None
    if head is None:
        logits = lm(input_ids)  # (B, L, V)
        return mx.take_along_axis(logits, positions[..., None], axis=1)  # (B, T, V)
    return head(lm_hidden_at(lm, input_ids, positions))  # (B, T, V)


def lm_hidden_at(lm: nn.Module, input_ids: mx.array, positions: mx.array) -> mx.array:
    """Last hidden states ``(B, T, D)`` of ``lm``'s backbone at ``positions`` ``(B, T)``: what
    :func:`lm_head` maps to the logits :func:`lm_logits_at` gives (call only where that head is
    not None)."""
    hidden = lm.model(input_ids)  # (B, L, D)
    return mx.take_along_axis(hidden, positions[..., None], axis=1)  # (B, T, D)


def lm_head(lm: nn.Module) -> Any:
    """The LM head of ``lm`` as a function of its backbone's last hidden states (``lm_head`` or the
    tied embedding's ``as_linear``), or None for a model whose logits are computed some other way
    (soft-capping, scaling). Whether the split reproduces ``lm(x)`` is checked once and kept on
    the module; the head itself is looked up on every call (LoRA may wrap it later)."""
    inner: Any = getattr(lm, "model", None)
    head: Any = None
    if inner is not None and "lm_head" in lm:
        head = lm["lm_head"]
    elif inner is not None and hasattr(getattr(inner, "embed_tokens", None), "as_linear"):
        head = inner.embed_tokens.as_linear
    if head is None:
        return None
    verified = lm.__dict__.get("_ppo_mlx_split_head_ok")
    if verified is None:
        was_training = lm.training
        lm.eval()
        probe = mx.array([[1, 2, 3]], dtype=mx.int32)  # (1, 3)
        try:
            full = lm(probe)
            split = head(inner(probe))
            verified = tuple(full.shape) == tuple(split.shape) and bool(
                mx.allclose(full, split, rtol=1e-4, atol=1e-4).item()
            )
        finally:
            lm.train(was_training)
        lm.__dict__["_ppo_mlx_split_head_ok"] = verified
    return head if verified else None


class PolicyModel(nn.Module):
    """An mlx-lm causal LM and its tokenizer, optionally with LoRA adapters.

    Attributes:
        model: the mlx-lm module (``logits = model(input_ids, cache)``).
        tokenizer: mlx-lm's ``TokenizerWrapper`` with a pad token distinct from EOS
            (:mod:`base_setup.tokenizer_setup`).
        model_path: the local directory the base weights came from.
        name_or_path: the base model as the user named it: a Hub id as given, or the absolute
            path of a local directory. Saved adapters record it as their base.
        lora: the LoRA settings, or ``None`` when every weight trains.

    ``fast_math`` (default True) runs ``model``'s layers through the fast CPU functions of
    :mod:`base_setup.fast_math` (this instance only; False: mlx-lm's own layers).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        model_path: str | Path,
        config: Mapping[str, Any],
        lora: LoraSettings | None = None,
        name_or_path: str | None = None,
        fast_math: bool = True,
    ) -> None:
        super().__init__()
        self.model = model
        accelerate_model(model, enabled=fast_math)  # fast SwiGLU, attention ... on the CPU
        self.tokenizer = tokenizer
        self.model_path = Path(model_path)
        self.name_or_path = name_or_path or str(self.model_path.resolve())
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
        fast_math: bool = True,
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
            fast_math: run the layers through :mod:`base_setup.fast_math` (False: mlx-lm's).

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
        from mlx_lm.utils import load_config, load_model

        model_path = resolve_model_path(path_or_hub_id)
        local = Path(path_or_hub_id).exists()
        name_or_path = str(Path(path_or_hub_id).resolve()) if local else str(path_or_hub_id)
        # Values newer transformers moved (rope_parameters) go where mlx-lm reads them, and a
        # config mlx-lm would misread is refused rather than loaded with wrong logits.
        updates = config_updates(load_config(model_path))
        model, config = load_model(model_path, model_config=updates or None)
        check_config_is_read(
            config, getattr(model, "args", None), f"the checkpoint at {model_path}"
        )
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
        return cls(
            model,
            tokenizer,
            model_path=model_path,
            config=config,
            lora=lora,
            name_or_path=name_or_path,
            fast_math=fast_math,
        )

    @property
    def config(self) -> dict[str, Any]:
        """A copy of the model's config.json (as mlx-lm read it)."""
        return copy.deepcopy(dict(self._config))

    @property
    def is_quantized(self) -> bool:
        """Whether the base weights are quantized (an mlx-lm 4-bit / 8-bit checkpoint): they can
        only be trained through LoRA adapters."""
        return any(is_quantized_layer(m) for _, m in self.model.named_modules())

    def check_trainable(self) -> None:
        """Raise ``ValueError`` if training would not reach the weights it should: a quantized
        model without LoRA adapters (its quantized weights are frozen; QLoRA trains adapters).
        A quantized model that trains on the CPU gets a warning of the cost in time
        (:func:`base_setup.lora_setup.warn_quantized_on_cpu`)."""
        if self.lora is None and self.is_quantized:
            raise ValueError(
                f"the model at {self.model_path} is quantized, and quantized weights cannot be "
                "trained directly: train LoRA adapters on it (use_lora: true, QLoRA), or "
                "dequantize it first (python main.py export ... --dequantize, or "
                "mlx_lm.convert --dequantize)"
            )
        warn_quantized_on_cpu(self.model, f"the model at {self.model_path}")

    def __call__(self, input_ids: mx.array, cache: list[Any] | None = None) -> mx.array:
        """Logits ``(B, L, V)`` for ``input_ids`` ``(B, L)``; ``cache`` is mlx-lm's KV cache."""
        return self.model(input_ids, cache=cache)

    def logits_at(self, input_ids: mx.array, positions: mx.array) -> mx.array:
        """Logits ``(B, T, V)`` at ``positions`` ``(B, T)`` only (see :func:`lm_logits_at`)."""
        return lm_logits_at(self.model, input_ids, positions)

    def output_head(self) -> Any:
        """The LM head, a function of the hidden states :meth:`hidden_at` gives, or None (see
        :func:`lm_head`)."""
        return lm_head(self.model)

    def hidden_at(self, input_ids: mx.array, positions: mx.array) -> mx.array:
        """Last hidden states ``(B, T, D)`` at ``positions`` ``(B, T)`` (see :func:`lm_hidden_at`)."""
        return lm_hidden_at(self.model, input_ids, positions)

    def _warn_if_mlx_lm_misreads_the_base(self) -> None:
        """Adapters are used over the base as it is on disk, where mlx-lm on its own misreads a
        config that keeps values where transformers >= 5 writes them (rope_parameters): say so,
        and which commands read it right."""
        from mlx_lm.utils import load_config

        moved = sorted(config_updates(load_config(self.model_path)))
        if moved:
            logger.warning(
                "the base model's config.json (%s) gives %s only where mlx-lm does not read it, "
                "so `mlx_lm.generate --model BASE --adapter-path ADAPTERS` would misread it or "
                "fail: use `python main.py generate|chat --model ADAPTERS`, or `python main.py "
                "export ADAPTERS --out DIR --fuse` for a model that mlx-lm reads as it is",
                self.model_path,
                ", ".join(moved),
            )

    def save_pretrained(self, save_dir: str | Path, *, merged: bool = False) -> Path:
        """Save what ``mlx_lm.load`` / the mlx-lm command line can load back.

        * no LoRA, or ``merged=True``: a full model directory, via mlx-lm's ``save`` (weights,
          config.json, tokenizer, generation_config.json); with LoRA the adapters are fused into
          the base weights first (mlx-lm's ``fuse``), without changing this model.
        * LoRA and ``merged=False``: an adapter directory (see :mod:`base_setup.lora_setup`)
          that records :attr:`name_or_path` as its base (what ``mlx_lm.generate --model <base>
          --adapter-path <dir>`` needs; ``python main.py generate --model <dir>`` reads it).
        """
        out = Path(save_dir)
        if self.lora is not None and not merged:
            save_adapters(self.model, self.lora, out, base_model=self.name_or_path)
            self._warn_if_mlx_lm_misreads_the_base()
            return out
        from mlx_lm.utils import save

        with adapters_fused(self.model):
            save(out, self.model_path, self.model, self.tokenizer, self.config, donate_model=False)
        return out
