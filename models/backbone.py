"""A transformer backbone with a scalar head: the shared half of the reward and value models.

A Hugging Face ``*ForSequenceClassification`` checkpoint is a backbone plus a linear head named
``score``. With one label (``num_labels == 1``) the head gives one scalar per position; on disk::

    config.json                   architectures ["<Arch>ForSequenceClassification"], model_type,
                                  id2label {"0": "LABEL_0"} (one label), pad_token_id
    model.safetensors             ``model.*`` (the backbone, under its Hugging Face names) and
                                  ``score.weight`` of shape (1, D); a large model is split into
                                  model-0000i-of-0000n.safetensors + model.safetensors.index.json

:class:`ScalarHeadModel` holds ``model``, the inner ``model`` of the mlx-lm architecture named by
``model_type`` (token ids (B, L) -> final-normed hidden states (B, L, D); the causal LM's
``lm_head`` is dropped), and the head ``score = nn.Linear(D, 1, bias=False)``, so its parameter
names are Hugging Face's (``model.*``, ``score.weight``). It reads and writes that layout, and
builds one from a causal LM's backbone with a fresh head.
:class:`models.reward_model.RewardModel` and :class:`models.value_model.ValueModel` subclass it.
"""

from __future__ import annotations

import copy
import dataclasses
import glob
import json
import logging
import math
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, Literal, Mapping, Sequence, TypeVar, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from base_setup.fast_layers import accelerate_model
from base_setup.lora_setup import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    LoraSettings,
    adapter_base_model,
    adapters_disabled,
    is_quantized_layer,
    load_adapters,
    lora_modules,
)
from models.backbone_loading import (
    ARCH_SUFFIX,
    BACKBONE_PREFIX,
    HF_HEAD_WEIGHT,
    QUANTIZATION_KEYS,
    DtypeLike,
    backbone_from_causal_lm,
    dtype_name,
    flat_parameters,
    from_hf_layout,
    load_backbone,
    read_checkpoint_weights,
    resolve_dtype,
    resolve_model_path,
    to_hf_layout,
)

logger = logging.getLogger("ppo_mlx")

#: How a fresh scalar head starts: "zeros" (every score 0 at first, so the first gradient reaches
#: only the head) or "normal" (N(0, 1/(D+1)), as in OpenAI's lm-human-preferences).
HeadInit = Literal["zeros", "normal"]

_DEFAULT_MAX_SHARD_BYTES = 5 << 30  # transformers' and mlx-lm's default shard size (5 GiB)

M = TypeVar("M", bound="ScalarHeadModel")

#: The head's weight (``score.weight``) in an adapter checkpoint, beside mlx-lm's
#: ``adapters.safetensors`` and ``adapter_config.json`` (see :func:`is_adapter_checkpoint`).
ADAPTER_HEAD_FILE = "score.safetensors"
#: The key of adapter_config.json where an adapter checkpoint records its base's fingerprint
#: (``training.fingerprints.model_fingerprint`` when it was trained; absent when unknown).
BASE_FINGERPRINT_KEY = "base_model_fingerprint"


def is_adapter_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a local adapter checkpoint of a scalar-head model: LoRA adapters in
    mlx-lm's format (``adapters.safetensors``, ``adapter_config.json`` naming the base under
    ``"model"``) and the head (:data:`ADAPTER_HEAD_FILE`), as ``RewardModel.save_pretrained``
    writes for a LoRA reward model."""
    folder = Path(path)
    return all(
        (folder / name).is_file()
        for name in (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, ADAPTER_HEAD_FILE)
    )


def adapter_checkpoint_base(path: str | Path) -> tuple[str, str | None]:
    """``(base model, its fingerprint when trained or None)`` an adapter checkpoint records.

    Raises:
        ValueError: the checkpoint names no base model.
    """
    base = adapter_base_model(path)
    if base is None:
        raise ValueError(
            f'{path}/{ADAPTER_CONFIG_FILE} names no base model ("model"): the adapters cannot '
            "be loaded without the weights they were trained on; add the base's path or repo "
            'id as "model"'
        )
    config = json.loads((Path(path) / ADAPTER_CONFIG_FILE).read_text(encoding="utf-8"))
    fingerprint = config.get(BASE_FINGERPRINT_KEY)
    return base, fingerprint if isinstance(fingerprint, str) else None


def check_lengths(lengths: mx.array | Sequence[int], batch_size: int, seq_len: int) -> mx.array:
    """Validate the number of valid tokens of each right-padded row: shape (B,), integers,
    ``1 <= lengths <= L``. Returns them as an int32 ``mx.array`` (B,)."""
    arr = np.asarray(lengths)
    if arr.shape != (batch_size,):
        raise ValueError(
            f"lengths must have shape ({batch_size},) (one count per row of input_ids), got "
            f"shape {arr.shape}"
        )
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"lengths must be integers (valid tokens per row), got dtype {arr.dtype}")
    if arr.min() < 1 or arr.max() > seq_len:
        raise ValueError(
            f"lengths must lie in [1, {seq_len}] (each row has at least one valid token and at "
            f"most L={seq_len}), got min {arr.min()} and max {arr.max()}"
        )
    return mx.array(arr.astype(np.int32))


def last_token_values(values: mx.array, lengths: mx.array) -> mx.array:
    """The entry of each row at its last valid token: ``out[b] = values[b, lengths[b] - 1]``.

    Args:
        values: (B, L) per-position scalars of right-padded rows.
        lengths: (B,) integer number of valid tokens per row, in [1, L] (not checked here, so
            this can run inside ``mx.compile``; see :func:`check_lengths`).

    Returns:
        (B,) values.
    """
    index = (lengths.astype(mx.int32) - 1)[:, None]  # (B, 1)
    return mx.take_along_axis(values, index, axis=1).squeeze(1)  # (B,)


class ScalarHeadModel(nn.Module):
    """A transformer backbone with a scalar head: token ids (B, L) -> one scalar per position.

    Parameters are named as in Hugging Face checkpoints: ``model.*`` and ``score.weight``. The
    head is stored under the key ``"score"`` but reached as :attr:`head`, because
    ``RewardModel.score`` is the method that gives sequence rewards.

    Attributes:
        model: the mlx-lm inner transformer, ids (B, L) -> final-normed hidden states (B, L, D).
        head: ``nn.Linear(D, 1, bias=False)`` (parameter ``score.weight``, shape (1, D)).
        config: the Hugging Face config the model was read from (read-only).
        architecture: the ``<Arch>ForSequenceClassification`` name :meth:`save_pretrained` writes.

    ``fast_math`` (default True) runs the backbone's layers through the fast CPU functions of
    :mod:`base_setup.fast_math` (this instance only; False: mlx-lm's own layers).

    A model may carry LoRA adapters on a frozen backbone: ``lora`` then holds their settings
    (None: no adapters) and ``base_model`` names the causal LM whose backbone it is (a resolved
    local path or a Hub id; None when unknown, e.g. built from an in-memory model).
    """

    lora: LoraSettings | None = None
    base_model: str | None = None
    #: Whether :meth:`from_pretrained` keeps an adapter checkpoint's quantized base quantized
    #: (the base stays frozen under the adapters); a subclass whose loaded model trains every
    #: weight sets it False, and the base is dequantized.
    keeps_adapter_base_quantized: ClassVar[bool] = True

    def __init__(
        self,
        backbone: nn.Module,
        hidden_size: int,
        config: Mapping[str, Any],
        *,
        fast_math: bool = True,
    ) -> None:
        super().__init__()
        self.model = backbone
        accelerate_model(backbone, enabled=fast_math)  # fast SwiGLU, attention ... on the CPU
        # Item, not attribute, assignment: a subclass method named `score` must not shadow it.
        self["score"] = nn.Linear(hidden_size, 1, bias=False)
        # A read-only mapping, so nn.Module keeps it out of the parameter tree.
        self.config: Mapping[str, Any] = MappingProxyType(copy.deepcopy(dict(config)))
        # Named now, so a model that cannot be saved fails before any training is lost.
        self.architecture = _sequence_classification_architecture(self.config)

    @property
    def head(self) -> nn.Linear:
        """The scalar head, ``nn.Linear(D, 1, bias=False)``; its weight is ``score.weight``."""
        return cast(nn.Linear, self["score"])

    @property
    def layers(self) -> list[nn.Module]:
        """The backbone's transformer blocks (what mlx-lm's LoRA tools adapt)."""
        return cast(list[nn.Module], self.model.layers)

    def __call__(self, input_ids: mx.array) -> mx.array:
        """Scalar outputs at every position.

        Args:
            input_ids: (B, L) token ids, right-padded (causal attention: a position never sees
                the padding after it).

        Returns:
            (B, L) ``head(model(input_ids))``; entries at padded positions are meaningless.
        """
        if input_ids.ndim != 2 or not mx.issubdtype(input_ids.dtype, mx.integer):
            raise ValueError(
                "input_ids must be a (B, L) integer array of token ids, got shape "
                f"{tuple(input_ids.shape)} and dtype {input_ids.dtype}"
            )
        hidden = self.model(input_ids)  # (B, L, D)
        return self.head(hidden).squeeze(-1)  # (B, L)

    @classmethod
    def from_pretrained(
        cls: type[M], path_or_repo: str | Path, *, dtype: DtypeLike = None, fast_math: bool = True
    ) -> M:
        """Load a ``*ForSequenceClassification`` checkpoint with one label (backbone + scalar
        head), e.g. one written by transformers or by :meth:`save_pretrained`.

        An adapter checkpoint (:func:`is_adapter_checkpoint`) loads too: its base model (the
        causal LM it names, ``lm_head`` dropped), its adapters and its head, in eval mode, the
        adapters and head trainable (:meth:`attach_adapter_checkpoint`).

        Args:
            path_or_repo: checkpoint directory, or a Hugging Face repo id when it is not a local
                path (needs network or the hub cache).
            dtype: parameter dtype; None = float32.
            fast_math: run the layers through :mod:`base_setup.fast_math` (False: mlx-lm's).

        Raises:
            FileNotFoundError: missing path (named in the message) or files.
            ValueError: the checkpoint has no scalar head (a causal LM), ``num_labels != 1``, or
                an architecture mlx-lm cannot build.
        """
        if is_adapter_checkpoint(path_or_repo):
            base, _ = adapter_checkpoint_base(path_or_repo)
            keep = cls.keeps_adapter_base_quantized
            model = cls.from_causal_lm(base, dtype=dtype, fast_math=fast_math, keep_quantized=keep)
            model.attach_adapter_checkpoint(path_or_repo, dtype=dtype)
            return model
        loaded = load_backbone(path_or_repo)
        if loaded.head_weight is None:
            architectures = loaded.config.get("architectures")
            raise ValueError(
                f"the checkpoint at {loaded.path} (architectures {architectures}) has no scalar "
                f"head: a reward/value checkpoint stores one as `{HF_HEAD_WEIGHT}` of shape "
                f"(1, hidden_size), as transformers' *ForSequenceClassification with "
                "num_labels=1 does; this looks like a causal LM (lm_head). Train a reward model "
                "from it first (RewardModel.from_causal_lm(path) adds a fresh head for the "
                "reward trainer), or for a value model use ValueModel.from_policy_backbone(path)"
            )
        model = cls(loaded.backbone, loaded.hidden_size, loaded.config, fast_math=fast_math)
        model.head.weight = loaded.head_weight
        model.set_dtype(resolve_dtype(dtype))
        mx.eval(model.parameters())
        return model

    @classmethod
    def on_policy_base(cls: type[M], policy_lm: nn.Module, *, fast_math: bool = True) -> M:
        """A model whose backbone is the base of ``policy_lm`` (a LoRA policy's mlx-lm causal LM)
        with its adapters off, and a zero head (float32); no adapters of its own yet.

        The module tree is new (a copy of the policy's inner model taken with its adapters
        swapped out), but every array in it is the policy's own base array, quantised layers
        included: no base weight is copied, and adapters added to this model (or the policy's,
        and their merging for sampling) are invisible to the other. The base must stay frozen
        (a LoRA policy's is), or the two models would drift apart.

        Raises:
            ValueError: ``policy_lm`` is no mlx-lm causal LM, or has no LoRA adapters (its base
                would train).
        """
        args = getattr(policy_lm, "args", None)
        inner = getattr(policy_lm, "model", None)
        if args is None or not dataclasses.is_dataclass(args) or not isinstance(inner, nn.Module):
            raise ValueError(
                f"expected the policy's mlx-lm causal LM (`args` and an inner `model`), got "
                f"{type(policy_lm).__name__}"
            )
        if not lora_modules(policy_lm):
            raise ValueError(
                f"a {cls.__name__} sharing the policy's base needs a LoRA policy (use_lora: "
                "true): a policy that trains all weights changes the base it stands on"
            )
        with adapters_disabled(policy_lm):
            # Every array maps to itself: the module tree is copied, the weights are not.
            flat = cast(list[tuple[str, mx.array]], tree_flatten(inner.parameters()))
            shared = {id(a): a for _, a in flat}
            backbone = copy.deepcopy(inner, memo=cast(dict[int, Any], shared))
        hidden_size = int(getattr(args, "hidden_size", 0) or getattr(args, "n_embd", 0))
        if hidden_size <= 0:
            raise ValueError(f"cannot read the hidden size of {type(policy_lm).__name__}")
        config = {k: v for k, v in dataclasses.asdict(cast(Any, args)).items() if v is not None}
        model = cls(backbone, hidden_size, config, fast_math=fast_math)
        model.head.weight = mx.zeros((1, hidden_size))  # (1, D)
        model.train(policy_lm.training)
        return model

    def attach_adapter_checkpoint(self, path: str | Path, *, dtype: DtypeLike = None) -> None:
        """Add the LoRA adapters of the adapter checkpoint at ``path`` to this model (which has
        none) and set its head, in place; the model is then in eval mode (no adapter dropout),
        its backbone frozen, the adapters and head trainable, ``lora`` and ``base_model`` those
        the checkpoint records.

        The adapters keep their saved dtype and the head is cast to ``dtype`` (None = float32),
        so a model loaded on its own (:meth:`from_pretrained`) and one on a shared base of the
        same weights and dtype compute the same function.

        Raises:
            ValueError: a head that is not ``score.weight`` of shape (1, hidden_size), or
                adapters that do not fit the backbone (mlx-lm's names and shapes check).
        """
        head = cast(dict[str, mx.array], mx.load(str(Path(path) / ADAPTER_HEAD_FILE)))
        hidden_size = int(self.head.weight.shape[1])
        weight = head.get(HF_HEAD_WEIGHT)
        if set(head) != {HF_HEAD_WEIGHT} or weight is None or weight.shape != (1, hidden_size):
            shapes = {k: tuple(v.shape) for k, v in head.items()}
            raise ValueError(
                f"{path}/{ADAPTER_HEAD_FILE} must hold only {HF_HEAD_WEIGHT} of shape "
                f"(1, {hidden_size}) (this backbone's hidden size), got {shapes}"
            )
        self.lora = load_adapters(self, path)  # freezes the backbone
        self.head.weight = weight.astype(resolve_dtype(dtype))
        self.head.unfreeze()
        self.base_model, _ = adapter_checkpoint_base(path)
        self.eval()  # LoRA dropout of the reward training must not act when scoring
        mx.eval(self.parameters())

    @classmethod
    def from_causal_lm(
        cls: type[M],
        path_or_model: str | Path | nn.Module,
        *,
        head_init: HeadInit = "zeros",
        seed: int = 0,
        dtype: DtypeLike = None,
        fast_math: bool = True,
        keep_quantized: bool = False,
    ) -> M:
        """A causal LM's backbone (its ``lm_head`` dropped) with a fresh scalar head.

        Args:
            path_or_model: a checkpoint directory or repo id of any model mlx-lm can load (any
                head it has, ``lm_head`` or ``score``, is dropped), or an in-memory mlx-lm
                causal LM (``mlx_lm.models.<arch>.Model``), whose weights are shared, not copied,
                until the new model is trained (MLX arrays are immutable).
            head_init: "zeros" (all outputs 0 at first; the first gradient then reaches only
                the head) or "normal" (N(0, 1/(D+1)) from ``seed``).
            seed: seed of the "normal" head.
            dtype: parameter dtype; None = float32.
            fast_math: run the layers through :mod:`base_setup.fast_math` (False: mlx-lm's).
            keep_quantized: a quantized checkpoint's layers stay quantized, for a backbone that
                stays frozen (LoRA adapters and the head train: QLoRA); False dequantizes them,
                so that the backbone can train.
        """
        if head_init not in ("zeros", "normal"):
            raise ValueError(f"head_init must be 'zeros' or 'normal', got {head_init!r}")
        base_model = None
        if isinstance(path_or_model, nn.Module):
            backbone, hidden_size, config = backbone_from_causal_lm(path_or_model)
        else:
            loaded = load_backbone(path_or_model, keep_quantized=keep_quantized)
            backbone, hidden_size, config = loaded.backbone, loaded.hidden_size, loaded.config
            local = Path(path_or_model).exists()
            base_model = str(Path(path_or_model).resolve()) if local else str(path_or_model)
        model = cls(backbone, hidden_size, config, fast_math=fast_math)
        model.base_model = base_model
        if head_init == "zeros":
            model.head.weight = mx.zeros((1, hidden_size))  # (1, D)
        else:
            std = 1.0 / math.sqrt(hidden_size + 1)
            key = mx.random.key(seed)
            model.head.weight = std * mx.random.normal((1, hidden_size), key=key)  # (1, D)
        model.set_dtype(resolve_dtype(dtype))
        mx.eval(model.parameters())
        return model

    def hf_config(self) -> dict[str, Any]:
        """The config.json :meth:`save_pretrained` writes: this model's config as a one-label
        ``<Arch>ForSequenceClassification`` in its current parameter dtype."""
        config = copy.deepcopy(dict(self.config))
        for key in QUANTIZATION_KEYS:  # the checkpoint's weights are float (save_pretrained)
            config.pop(key, None)
        config["architectures"] = [self.architecture]
        config.pop("num_labels", None)  # transformers writes the labels, not their count
        config["id2label"] = {"0": "LABEL_0"}
        config["label2id"] = {"LABEL_0": 0}
        config["dtype"] = dtype_name(self.head.weight.dtype)
        if "torch_dtype" in config:  # the name transformers < 5 reads
            config["torch_dtype"] = config["dtype"]
        return config

    def load_pretrained_weights(self, path: str | Path) -> None:
        """Load, in place, the weights of a checkpoint directory this model's architecture wrote
        (e.g. with :meth:`save_pretrained`; one file or shards), cast to the current dtype.
        Every parameter must be present (strict), so a partial checkpoint raises ValueError."""
        dtype = self.head.weight.dtype
        weights = from_hf_layout(self.config, read_checkpoint_weights(resolve_model_path(path)))
        self.load_weights([(k, v.astype(dtype)) for k, v in weights.items()], strict=True)
        mx.eval(self.parameters())

    def save_pretrained(
        self,
        save_dir: str | Path,
        tokenizer: Any = None,
        *,
        max_shard_bytes: int = _DEFAULT_MAX_SHARD_BYTES,
    ) -> Path:
        """Write the Hugging Face ``*ForSequenceClassification`` layout (see the module doc),
        loadable by transformers' ``AutoModelForSequenceClassification`` and by
        :meth:`from_pretrained`.

        Args:
            save_dir: directory to write (created if needed).
            tokenizer: saved alongside with its ``save_pretrained`` when given, and the config
                gets a pad token that is no end token (see :meth:`_with_export_pad_token`), which
                transformers needs to find the scored token of a padded batch.
            max_shard_bytes: largest weights file; bigger models are split into shards.

        Returns:
            The directory.
        """
        if max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
        quantized = [name for name, m in self.named_modules() if is_quantized_layer(m)]
        if quantized:
            raise ValueError(
                f"{len(quantized)} layers of this model are quantized (e.g. {quantized[0]}), "
                "which a *ForSequenceClassification checkpoint cannot hold: save a LoRA model's "
                "adapters, or save it merged (RewardModel.save_pretrained(merged=True) "
                "dequantizes the base)"
            )
        save_dir = Path(save_dir)
        save_dir.mkdir(parents=True, exist_ok=True)
        weights = flat_parameters(self)  # Hugging Face names: model.*, score.weight
        config = self.hf_config()
        if tokenizer is not None:
            tokenizer.save_pretrained(str(save_dir))
            weights = self._with_export_pad_token(save_dir, tokenizer, config, weights)
        weights = to_hf_layout(config, weights)
        shards: list[dict[str, mx.array]] = []
        shard_bytes = 0
        for name, value in weights.items():
            if not shards or shard_bytes + value.nbytes > max_shard_bytes:
                shards.append({})
                shard_bytes = 0
            shards[-1][name] = value
            shard_bytes += value.nbytes
        # Stale files of an earlier save in another layout would be read back with these.
        for old in glob.glob(str(save_dir / "model*.safetensors*")):
            Path(old).unlink()
        if len(shards) == 1:
            mx.save_safetensors(str(save_dir / "model.safetensors"), shards[0], {"format": "pt"})
        else:
            weight_map: dict[str, str] = {}
            for i, shard in enumerate(shards, start=1):
                file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                mx.save_safetensors(str(save_dir / file_name), shard, {"format": "pt"})
                weight_map.update({name: file_name for name in shard})
            index = {
                "metadata": {"total_size": sum(v.nbytes for v in weights.values())},
                "weight_map": dict(sorted(weight_map.items())),
            }
            with open(save_dir / "model.safetensors.index.json", "w") as f:
                json.dump(index, f, indent=2)
        from mlx_lm.utils import save_config

        save_config(config, save_dir / "config.json")
        return save_dir

    def _with_export_pad_token(
        self,
        save_dir: Path,
        tokenizer: Any,
        config: dict[str, Any],
        weights: dict[str, mx.array],
    ) -> dict[str, mx.array]:
        """Give the saved checkpoint a pad token that is no end token; returns the weights.

        transformers' ``*ForSequenceClassification`` scores a sequence at its last token that
        is not ``config.pad_token_id``. With pad == EOS (SmolLM2, Qwen2.5 base; GPT-2 and
        Llama-2 have no pad at all) it would score the token *before* the EOS this model is read
        at. So the saved config names a pad of its own: the tokenizer's pad when it is no end
        token, else an existing pad-like token, else a new ``<|pad|>`` in the saved tokenizer
        (in a free embedding row, or a new zero row: padding comes after the scored token, so
        the row never changes a score). Sets ``config["pad_token_id"]`` (and ``vocab_size`` when
        a row is added) and rewrites the saved tokenizer when its pad changes.
        """
        from transformers import AutoTokenizer

        from base_setup.tokenizer_setup import PAD_TOKEN_CANDIDATES, eos_token_ids

        ends = set(eos_token_ids(tokenizer))
        config_eos = config.get("eos_token_id")
        ends |= set(config_eos if isinstance(config_eos, list) else [config_eos]) - {None}
        embedding = self._embedding_weight_name(weights)
        rows = int(weights[embedding].shape[0])
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is not None and pad not in ends and pad < rows:
            config["pad_token_id"] = int(pad)
            return weights
        saved = AutoTokenizer.from_pretrained(str(save_dir))
        vocab = saved.get_vocab()
        usable = [t for t in PAD_TOKEN_CANDIDATES if vocab.get(t, rows) < rows]
        usable = [t for t in usable if vocab[t] not in ends]
        if usable:
            saved.pad_token = usable[0]
        else:
            saved.add_special_tokens({"pad_token": "<|pad|>"})
        pad = int(saved.pad_token_id)
        saved.save_pretrained(str(save_dir))
        config["pad_token_id"] = pad
        if pad >= rows:
            extra = pad - rows + 1
            table = weights[embedding]
            zeros = mx.zeros((extra, table.shape[1]), dtype=table.dtype)  # (extra, D)
            weights = {**weights, embedding: mx.concatenate([table, zeros], axis=0)}
            config["vocab_size"] = rows + extra
        return weights

    def _embedding_weight_name(self, weights: Mapping[str, mx.array]) -> str:
        """The name of the token-embedding table among ``weights`` (``model.embed_tokens.weight``
        for most architectures, ``model.wte.weight`` for GPT-2)."""
        for name, module in self.model.named_modules():
            if isinstance(module, nn.Embedding) and int(module.weight.shape[0]) == int(
                self.config.get("vocab_size", -1)
            ):
                full = f"{BACKBONE_PREFIX}{name}.weight"
                if full in weights:
                    return full
        raise ValueError(
            "cannot find the token-embedding table (vocab_size rows) of this model's backbone, "
            "so no pad token can be given to the saved reward/value checkpoint"
        )


def _sequence_classification_architecture(config: Mapping[str, Any]) -> str:
    """``<Arch>ForSequenceClassification`` for a config: from its ``architectures`` (e.g.
    Qwen3ForCausalLM -> Qwen3ForSequenceClassification), else transformers' class for its
    ``model_type``."""
    architectures = config.get("architectures") or []
    if isinstance(architectures, str):
        architectures = [architectures]
    for architecture in architectures:
        if ARCH_SUFFIX.search(architecture):
            return ARCH_SUFFIX.sub("ForSequenceClassification", architecture)
    model_type = config.get("model_type")
    # Imported only here (seconds to import): configs of in-memory models name no architecture.
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    )

    name = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(str(model_type))
    if name is None:
        raise ValueError(
            f"cannot name the *ForSequenceClassification architecture of model_type "
            f"{model_type!r}: the config has no `architectures` and transformers has no such "
            "class for it; load the model from its checkpoint directory instead"
        )
    return name
