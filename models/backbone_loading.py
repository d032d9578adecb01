"""Reading a transformer backbone out of a checkpoint: the loading half of the reward and value
models (:mod:`models.backbone`).

Any checkpoint mlx-lm can build: a causal LM (its LM head dropped) or a one-label
``*ForSequenceClassification`` (its ``score.weight`` returned apart), sharded or not, written by
transformers or by this project (GPT-2's sequence-classification layout, ``transformer.*`` with
Conv1D weights, is converted both ways), quantized (the backbone is dequantized when it trains,
and kept quantized for a model that trains LoRA adapters on it), with the config fixes of
:mod:`models.checkpoint_config`.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import re
import struct
from pathlib import Path
from typing import Any, Mapping, Union, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from models.checkpoint_config import check_config_is_read, config_updates

logger = logging.getLogger("ppo_mlx")

#: A parameter dtype: an ``mx.Dtype``, its name ("float32", "bfloat16", "float16"), or None for
#: float32.
DtypeLike = Union[mx.Dtype, str, None]

_DTYPES: dict[str, mx.Dtype] = {
    "float32": mx.float32,
    "bfloat16": mx.bfloat16,
    "float16": mx.float16,
}
#: Hugging Face's name of the scalar head's weight (``self.score`` in transformers).
HF_HEAD_WEIGHT = "score.weight"
BACKBONE_PREFIX = "model."
ARCH_SUFFIX = re.compile(
    r"(ForSequenceClassification|ForCausalLM|ForConditionalGeneration|LMHeadModel)$"
)


def resolve_dtype(dtype: DtypeLike) -> mx.Dtype:
    """The parameter dtype meant by ``dtype``: None -> float32, a name -> that dtype."""
    if dtype is None:
        return mx.float32
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    if dtype not in _DTYPES.values():
        raise ValueError(
            f"dtype {dtype} is not supported; use mx.float32, mx.bfloat16 or mx.float16"
        )
    return dtype


def dtype_name(dtype: mx.Dtype) -> str:
    return next(name for name, d in _DTYPES.items() if d == dtype)


def resolve_model_path(path_or_repo: str | Path) -> Path:
    """The local directory of a checkpoint: ``path_or_repo`` itself if it exists, otherwise a
    Hugging Face Hub snapshot of the repository of that name (downloaded, or from the cache).

    Raises:
        FileNotFoundError: the path does not exist and is not a repo id that could be fetched
            (offline, no such repository), or it is a file, not a directory.
    """
    path = Path(path_or_repo).expanduser()
    if path.exists():
        if not path.is_dir():
            raise FileNotFoundError(
                f"model path {str(path)!r} is a file; pass the checkpoint directory (the one "
                "holding config.json and the *.safetensors weights)"
            )
        check_model_files(path)
        return path
    name = str(path_or_repo)
    if not re.fullmatch(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+", name):
        raise FileNotFoundError(
            f"model path {name!r} does not exist (and is not a Hugging Face repo id of the form "
            "'owner/name'); pass an existing checkpoint directory"
        )
    import huggingface_hub
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    try:
        snapshot = huggingface_hub.snapshot_download(name, allow_patterns=DEFAULT_ALLOW_PATTERNS)
    except OSError as e:  # every hub failure (offline, no such repo, gated) is an OSError
        raise FileNotFoundError(
            f"model path {name!r} is not a local directory and could not be fetched from the "
            f"Hugging Face Hub ({type(e).__name__}: {e}); pass an existing checkpoint directory, "
            "or download it first where there is network"
        ) from e
    return Path(snapshot)


def check_model_files(path: Path) -> None:
    """Raise ``ValueError`` naming the file if the model folder ``path`` has a ``config.json``
    that is not JSON, or a ``*.safetensors`` file shorter than its header says (a download or
    copy that did not finish). Reads only the headers."""
    config = path / "config.json"
    if config.is_file():
        try:
            json.loads(config.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(
                f"{config} is not valid JSON ({err}): restore the model's config.json (copy or "
                "download it again)"
            ) from None
    for file in sorted(path.glob("*.safetensors")):
        size = file.stat().st_size
        problem = None
        with open(file, "rb") as f:
            head = f.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if length is None or 8 + length > size:
                problem = "its header is cut short"
            else:
                try:
                    header = json.loads(f.read(length))
                    end = max(
                        (
                            int(v["data_offsets"][1])
                            for k, v in header.items()
                            if k != "__metadata__"
                        ),
                        default=0,
                    )
                except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
                    problem = f"its header is not readable ({type(err).__name__})"
                else:
                    if 8 + length + end > size:
                        problem = f"it has {size} bytes, its header needs {8 + length + end}"
        if problem is not None:
            raise ValueError(
                f"{file} is damaged or incomplete ({problem}): the download or copy did not "
                "finish; copy or download the model again"
            )


def read_checkpoint_weights(path: Path) -> dict[str, mx.array]:
    """All tensors of the safetensors checkpoint in ``path`` (one file or the shards that
    ``model.safetensors.index.json`` lists), under their stored names."""
    index_file = path / "model.safetensors.index.json"
    if index_file.exists():
        with open(index_file) as f:
            files = sorted({str(path / name) for name in json.load(f)["weight_map"].values()})
    else:
        files = sorted(glob.glob(str(path / "model*.safetensors")))
    if not files:
        raise FileNotFoundError(
            f"no model*.safetensors weights in {path}; a PyTorch *.bin checkpoint must be re-saved "
            "with transformers' save_pretrained(..., safe_serialization=True) first"
        )
    weights: dict[str, mx.array] = {}
    for file in files:
        weights.update(cast(dict[str, mx.array], mx.load(file)))
    return weights


def num_labels_of(config: Mapping[str, Any]) -> int | None:
    """``num_labels`` of a Hugging Face config: the field if written, else ``len(id2label)``
    (transformers writes only id2label), else None."""
    if "num_labels" in config:
        return int(config["num_labels"])
    if "id2label" in config:
        return len(config["id2label"])
    return None


#: The config keys that say a checkpoint's weights are quantized (mlx-lm's, and transformers').
QUANTIZATION_KEYS = ("quantization", "quantization_config")


def _is_quantized(config: Mapping[str, Any]) -> bool:
    return any(key in config for key in QUANTIZATION_KEYS)


# Architectures whose Hugging Face *ForSequenceClassification layout differs from mlx-lm's
# backbone beyond the "model." prefix: GPT-2 names its backbone "transformer." and stores its
# projections as Conv1D weights, (in, out), where mlx-lm's Linear holds (out, in).
_HFBACKBONE_PREFIX = {"gpt2": "transformer."}
_CONV1D_SUFFIXES = (
    ".attn.c_attn.weight",
    ".attn.c_proj.weight",
    ".mlp.c_fc.weight",
    ".mlp.c_proj.weight",
)
_HF_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def from_hf_layout(config: Mapping[str, Any], weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Checkpoint weights of a sequence-classification layout under mlx-lm's backbone names (a
    no-op for architectures that share them, and for causal-LM checkpoints)."""
    prefix = _HFBACKBONE_PREFIX.get(str(config.get("model_type")))
    if prefix is None or not any(k.startswith(prefix) for k in weights):
        return weights
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        if not name.startswith(prefix):
            out[name] = value
        elif not name.endswith(_HF_BUFFER_SUFFIXES):
            mlx_name = BACKBONE_PREFIX + name[len(prefix) :]
            out[mlx_name] = value.T if name.endswith(_CONV1D_SUFFIXES) else value
    return out


def to_hf_layout(config: Mapping[str, Any], weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The inverse of :func:`_from_hf_layout`: what transformers' class of the architecture
    loads."""
    prefix = _HFBACKBONE_PREFIX.get(str(config.get("model_type")))
    if prefix is None:
        return weights
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        if name.startswith(BACKBONE_PREFIX):
            hf_name = prefix + name[len(BACKBONE_PREFIX) :]
            out[hf_name] = value.T if name.endswith(_CONV1D_SUFFIXES) else value
        else:
            out[name] = value
    return out


def _classes_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` as mlx-lm's ``_get_classes`` expects it: a causal-LM architecture name, so its
    (model_type, architecture) remapping applies to sequence-classification checkpoints too."""
    architectures = config.get("architectures") or []
    if isinstance(architectures, str):
        architectures = [architectures]
    return {
        **config,
        "architectures": [ARCH_SUFFIX.sub("ForCausalLM", a) for a in architectures],
    }


def _hidden_size(args: Any, where: str) -> int:
    hidden_size = getattr(args, "hidden_size", None)
    if hidden_size is None:
        hidden_size = getattr(args, "n_embd", None)  # GPT-2's name
    if not isinstance(hidden_size, int):
        raise ValueError(
            f"cannot tell the hidden size of {where}: its mlx-lm ModelArgs has no integer "
            "`hidden_size`, so this architecture is not supported as a reward/value backbone"
        )
    return hidden_size


def _inner_backbone(full_model: nn.Module, where: str) -> nn.Module:
    backbone = getattr(full_model, "model", None)
    if not isinstance(backbone, nn.Module):
        raise ValueError(
            f"{where}: the mlx-lm model {type(full_model).__module__} has no inner `model` "
            "transformer (token ids -> hidden states); this architecture is not supported as a "
            "reward/value backbone"
        )
    return backbone


@dataclasses.dataclass
class LoadedBackbone:
    """A backbone read from a checkpoint directory.

    Attributes:
        backbone: the mlx-lm inner ``model`` with the checkpoint's weights (ids -> (B, L, D)).
        hidden_size: D.
        head_weight: the checkpoint's ``score.weight`` (1, D), or None when it has no scalar
            head (a causal LM).
        config: the checkpoint's config.json (as mlx-lm's ``load_config`` reads it).
        path: the local checkpoint directory.
    """

    backbone: nn.Module
    hidden_size: int
    head_weight: mx.array | None
    config: dict[str, Any]
    path: Path


def load_backbone(path_or_repo: str | Path, *, keep_quantized: bool = False) -> LoadedBackbone:
    """Load the transformer backbone of any checkpoint mlx-lm can read, without its LM head.

    The architecture comes from ``model_type`` (mlx-lm's ``_get_classes``), the weights are
    passed through the architecture's ``sanitize`` (the conversions mlx-lm applies to Hugging
    Face weights), ``lm_head.*`` is dropped and ``score.weight`` is returned apart. Weights keep
    their stored dtype.

    A quantized checkpoint (an mlx-lm 4-/8-bit causal LM) is dequantized, since quantized
    weights cannot train; with ``keep_quantized`` its layers stay quantized, for a model whose
    backbone stays frozen (LoRA adapters and a head train on it: a QLoRA reward model).

    Raises:
        FileNotFoundError: no such directory / repo, no config.json or no safetensors weights.
        ValueError: unsupported or quantized architecture, ``num_labels != 1``, a head with a
            bias, or weights the backbone does not have.
    """
    from mlx_lm.utils import _get_classes, load_config  # here: mlx-lm imports transformers

    path = resolve_model_path(path_or_repo)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no config.json in {path}; is it a model checkpoint directory?")
    config = load_config(path)
    updates = config_updates(config)
    config.update(updates)
    if _is_quantized(config):
        return _quantized_backbone(path, config, updates, dequantize=not keep_quantized)
    weights = read_checkpoint_weights(path)
    weights = from_hf_layout(config, weights)
    head_weight = weights.pop(HF_HEAD_WEIGHT, None)
    if head_weight is not None:
        # Causal-LM configs often carry transformers' default two labels; only a head counts.
        num_labels = num_labels_of(config)
        if num_labels not in (None, 1) or head_weight.shape[0] != 1:
            raise ValueError(
                f"the checkpoint at {path} is a classifier with num_labels="
                f"{num_labels if num_labels is not None else head_weight.shape[0]}; reward and "
                "value models need num_labels == 1 (one scalar per sequence). Train a reward "
                "model with one output (transformers' num_labels=1, or "
                "RewardModel.from_causal_lm)"
            )
    if "score.bias" in weights:
        raise ValueError(
            f"the checkpoint at {path} has a `score.bias`; the scalar head here is bias-free "
            "(as transformers' *ForSequenceClassification). Fold the bias away or drop it"
        )

    model_class, args_class = _get_classes(_classes_config(config))
    args = args_class.from_dict(config)
    check_config_is_read(config, args, f"the checkpoint at {path}")
    full_model = model_class(args)  # lazy random init: the LM head is never materialised
    backbone = _inner_backbone(full_model, f"the checkpoint at {path}")
    hidden_size = _hidden_size(args, f"the checkpoint at {path}")
    if head_weight is not None and tuple(head_weight.shape) != (1, hidden_size):
        raise ValueError(
            f"`score.weight` in {path} has shape {tuple(head_weight.shape)}, expected "
            f"(1, {hidden_size}) for one scalar per position (num_labels == 1)"
        )

    if hasattr(full_model, "sanitize"):
        weights = full_model.sanitize(weights)
    unexpected = [
        k for k in weights if not k.startswith(BACKBONE_PREFIX) and not k.startswith("lm_head.")
    ]
    if unexpected:
        raise ValueError(
            f"the checkpoint at {path} has weights outside the backbone (`model.*`), the LM head "
            f"and `score.weight`: {sorted(unexpected)[:8]}; it is not a plain causal-LM or "
            "*ForSequenceClassification checkpoint"
        )
    backbone_weights = [
        (k[len(BACKBONE_PREFIX) :], v) for k, v in weights.items() if k.startswith(BACKBONE_PREFIX)
    ]
    backbone.load_weights(backbone_weights, strict=True)
    return LoadedBackbone(backbone, hidden_size, head_weight, config, path)


def _quantized_backbone(
    path: Path, config: dict[str, Any], updates: dict[str, Any], *, dequantize: bool
) -> LoadedBackbone:
    """The backbone of a quantized causal LM (an mlx-lm 4-/8-bit checkpoint): dequantized (a
    backbone that trains), or kept quantized (``dequantize`` False: a frozen backbone under
    LoRA adapters, the config keeping its ``quantization``).

    Dequantized, the backbone is rebuilt in float weights (as ``mlx_lm.convert --dequantize``
    would) and takes the memory of the unquantized model, hence the warning.
    """
    from mlx_lm.utils import dequantize_model, load_model

    if any(name == HF_HEAD_WEIGHT for name in read_checkpoint_weights(path)):
        raise ValueError(
            f"the checkpoint at {path} is a quantized reward/value model; load an unquantized "
            "one (reward and value models train their backbone)"
        )
    full_model, config = load_model(path, model_config=updates or None)
    check_config_is_read(config, getattr(full_model, "args", None), f"the checkpoint at {path}")
    if dequantize:
        dequantize_model(full_model)
    backbone = _inner_backbone(full_model, f"the checkpoint at {path}")
    hidden_size = _hidden_size(full_model.args, f"the checkpoint at {path}")
    if not dequantize:
        return LoadedBackbone(backbone, hidden_size, None, config, path)
    size_mb = sum(v.nbytes for v in flat_parameters(backbone).values()) / 2**20
    logger.warning(
        "%s is quantized: its backbone was dequantized (%.0f MB) to build a reward/value model "
        "that trains it; set value_model_name (or reward_model_name) to a smaller float "
        "checkpoint to save that memory, or train a reward model with use_lora (its base stays "
        "quantized)",
        path,
        size_mb,
    )
    config = {k: v for k, v in config.items() if k not in QUANTIZATION_KEYS}
    return LoadedBackbone(backbone, hidden_size, None, config, path)


def flat_parameters(module: nn.Module) -> dict[str, mx.array]:
    """``{dotted name: array}`` of a module's parameters."""
    return dict(cast(list[tuple[str, mx.array]], tree_flatten(module.parameters())))


def backbone_from_causal_lm(model: nn.Module) -> tuple[nn.Module, int, dict[str, Any]]:
    """A fresh copy of an in-memory mlx-lm causal LM's backbone: ``(backbone, D, config)``.

    The copy is a new module of the same architecture whose parameters are the source's arrays;
    MLX arrays are immutable, so training the copy never changes ``model``. ``config`` is the
    model's ``args`` as a dict (unset fields dropped).

    Raises:
        ValueError: ``model`` is not an mlx-lm causal LM (``args`` and an inner ``model``), or its
            backbone has parameters a fresh one lacks (LoRA adapters, quantised layers).
    """
    args = getattr(model, "args", None)
    if args is None or not dataclasses.is_dataclass(args):
        raise ValueError(
            f"expected an mlx-lm causal LM (a `Model` with `args` and an inner `model`), got "
            f"{type(model).__name__}; pass its checkpoint path instead"
        )
    source = _inner_backbone(model, "the in-memory model")
    fresh = _inner_backbone(cast(Any, type(model))(args), "the in-memory model")
    source_params = flat_parameters(source)
    fresh_params = flat_parameters(fresh)
    if source_params.keys() != fresh_params.keys():
        extra = sorted(source_params.keys() - fresh_params.keys())[:6]
        missing = sorted(fresh_params.keys() - source_params.keys())[:6]
        raise ValueError(
            "the in-memory model's backbone does not match a fresh one of its architecture "
            f"(extra {extra}, missing {missing}): LoRA adapters or quantised layers? Build the "
            "reward/value model before adding adapters, fuse them first, or pass the checkpoint "
            "path"
        )
    fresh.load_weights(list(source_params.items()), strict=True)
    config = {k: v for k, v in dataclasses.asdict(cast(Any, args)).items() if v is not None}
    return fresh, _hidden_size(args, "the in-memory model"), config
