"""LoRA adapters on an mlx-lm model, in mlx-lm's own layers and on-disk format.

* :func:`apply_lora` freezes the model and swaps linear layers for mlx-lm's ``LoRALinear`` (via
  ``mlx_lm.tuner.utils.linear_to_lora_layers``), so only ``lora_a`` / ``lora_b`` train.
* :func:`save_adapters` / :func:`load_adapters` write and read an adapter directory exactly as
  ``mlx_lm.lora`` does (``adapters.safetensors`` + ``adapter_config.json``, the base model under
  ``"model"``), so ``mlx_lm.generate --model <base> --adapter-path <dir>`` and ``mlx_lm.fuse``
  accept it, and :func:`adapter_base_model` tells which base it belongs to.
* :func:`adapters_disabled` runs the base model through the same module tree: the reference model
  of PPO when the policy trains LoRA, without a second copy of the base weights.
* :func:`adapters_fused` temporarily replaces each LoRA layer by its fused linear layer (mlx-lm's
  ``fuse``), e.g. to save a merged model without changing the live one.
* :func:`adapters_merged` does the same for sampling, where it is exact enough to: float32 bases
  only, and no random state used. :func:`merge_adapters_for_sampling` decides whether to
  (config ``merge_adapters_for_sampling``): the merged copy costs as much memory as the
  adapted base weights (:func:`mergeable_weight_bytes`) and pays only for small layers.

Convention: LoRA papers (and PEFT) write the update as ``(alpha / r) * B A x``; mlx-lm stores the
product ``scale = alpha / r`` instead of ``alpha``. :class:`LoraSettings` takes ``alpha`` and
converts; the adapter config records mlx-lm's ``scale``.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal, Sequence, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from base_setup.backend import evaluate_in_groups
from base_setup.fast_layers import few_row_like

logger = logging.getLogger("ppo_mlx")

ADAPTER_WEIGHTS_FILE = "adapters.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
# Leaf names of adapter parameters in mlx-lm's LoRA / DoRA layers.
_ADAPTER_LEAVES = ("lora_a", "lora_b")


@dataclass(frozen=True)
class LoraSettings:
    """Where and how big the LoRA adapters are.

    Attributes:
        r: rank of each adapter (``lora_a``: (in, r), ``lora_b``: (r, out)).
        alpha: LoRA alpha; the update is scaled by ``alpha / r`` (mlx-lm's ``scale``).
        dropout: dropout on the adapter's input while training (never at generation or in the
            reference model).
        num_layers: adapt the last ``num_layers`` transformer blocks; ``-1`` means all of them.
        keys: module paths inside a block to adapt, e.g. ``("self_attn.q_proj",
            "self_attn.v_proj")``; ``None`` adapts every linear layer of the block (mlx-lm's
            default).
    """

    r: int
    alpha: float
    dropout: float
    num_layers: int = -1
    keys: Sequence[str] | None = None

    def __post_init__(self) -> None:
        if self.r <= 0:
            raise ValueError(f"LoRA rank r must be positive, got {self.r}")
        if self.alpha <= 0:
            raise ValueError(f"LoRA alpha must be positive, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        if self.num_layers != -1 and self.num_layers <= 0:
            raise ValueError(f"num_layers must be -1 (all) or positive, got {self.num_layers}")
        if self.keys is not None:
            if isinstance(self.keys, str) or not self.keys:
                raise ValueError(f"keys must be a non-empty list of module paths, got {self.keys}")
            object.__setattr__(self, "keys", tuple(self.keys))

    @property
    def scale(self) -> float:
        """mlx-lm's ``scale`` = ``alpha / r``."""
        return self.alpha / self.r

    @classmethod
    def from_model_config(cls, cfg: Any) -> LoraSettings:
        """Read ``lora_r``, ``lora_alpha``, ``lora_dropout`` (required) and ``lora_layers``,
        ``lora_keys`` (optional: -1 and None) from any object, e.g. the model config."""
        missing = [f for f in ("lora_r", "lora_alpha", "lora_dropout") if not hasattr(cfg, f)]
        if missing:
            raise ValueError(f"{type(cfg).__name__} has no field(s) {missing} for LoRA settings")
        return cls(
            r=int(cfg.lora_r),
            alpha=float(cfg.lora_alpha),
            dropout=float(cfg.lora_dropout),
            num_layers=int(getattr(cfg, "lora_layers", -1)),
            keys=getattr(cfg, "lora_keys", None),
        )

    def to_mlx_lm(self) -> dict[str, Any]:
        """``lora_parameters`` as mlx-lm's ``linear_to_lora_layers`` and adapter_config want."""
        params: dict[str, Any] = {"rank": self.r, "scale": self.scale, "dropout": self.dropout}
        if self.keys is not None:
            params["keys"] = list(self.keys)
        return params


def _lm(model: nn.Module) -> nn.Module:
    """The mlx-lm model (with ``.layers``) inside ``model`` (e.g. a PolicyModel wrapper)."""
    if hasattr(model, "layers"):
        return model
    inner = getattr(model, "model", None)
    if isinstance(inner, nn.Module) and hasattr(inner, "layers"):
        return inner
    raise ValueError(f"{type(model).__name__} is not an mlx-lm model (no .layers)")


def _is_adapter_module(module: nn.Module) -> bool:
    return "lora_a" in module and "lora_b" in module


def lora_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` of every LoRA/DoRA layer in ``model``."""
    return [(name, m) for name, m in model.named_modules() if _is_adapter_module(m)]


def apply_lora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """Freeze ``model`` and add LoRA adapters in place (mlx-lm's ``linear_to_lora_layers``).

    Afterwards ``model.trainable_parameters()`` holds only ``lora_a`` / ``lora_b``; ``lora_b``
    starts at zero, so the adapted model computes the same function as the base. The model keeps
    its train/eval mode (adapter dropout acts only in train mode). Returns the mlx-lm model (the
    same object, or the one inside a wrapper).

    Raises:
        ValueError: the model already has adapters, ``num_layers`` exceeds its blocks, or no
            module matched ``settings.keys``.
    """
    from mlx_lm.tuner.utils import linear_to_lora_layers

    lm = _lm(model)
    if lora_modules(lm):
        raise ValueError("the model already has LoRA adapters; apply_lora once per model")
    n_blocks = len(lm.layers)
    if settings.num_layers > n_blocks:
        raise ValueError(
            f"num_layers={settings.num_layers} but the model has {n_blocks} blocks; "
            "use -1 for all"
        )
    was_training = lm.training
    lm.freeze()
    num_layers = n_blocks if settings.num_layers == -1 else settings.num_layers
    linear_to_lora_layers(lm, num_layers, settings.to_mlx_lm())
    lm.train(was_training)  # new layers start in train mode; keep the model's mode
    if not lora_modules(lm):
        block_keys = sorted(
            name for name, m in lm.layers[-1].named_modules() if isinstance(m, nn.Linear)
        )
        raise ValueError(f"no module matched LoRA keys {settings.keys}; choose from {block_keys}")
    return lm


def adapter_parameters(model: nn.Module) -> dict[str, mx.array]:
    """Flat ``{name: array}`` of the adapter weights (``...lora_a`` / ``...lora_b``)."""
    flat = cast(list[tuple[str, mx.array]], tree_flatten(_lm(model).parameters()))
    return {name: value for name, value in flat if name.rsplit(".", 1)[-1] in _ADAPTER_LEAVES}


def save_adapters(
    model: nn.Module,
    settings: LoraSettings,
    adapter_dir: str | Path,
    *,
    base_model: str | None = None,
) -> Path:
    """Write ``adapters.safetensors`` and ``adapter_config.json`` in mlx-lm's format.

    The directory loads with :func:`load_adapters`, with ``mlx_lm.load(base,
    adapter_path=dir)`` and with the ``mlx_lm.generate`` / ``mlx_lm.fuse`` command lines.
    ``base_model`` (a Hub id or a local path) is recorded under the key ``"model"``, where
    ``mlx_lm.lora`` records the base of its adapters, so the adapters say what they belong to
    (:func:`adapter_base_model`).
    """
    weights = adapter_parameters(model)
    if not weights:
        raise ValueError("the model has no LoRA adapters to save; call apply_lora first")
    out = Path(adapter_dir)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / ADAPTER_WEIGHTS_FILE), weights)
    config = {
        "fine_tune_type": "lora",
        "num_layers": settings.num_layers,
        "lora_parameters": settings.to_mlx_lm(),
        "lora_alpha": settings.alpha,  # informational; mlx-lm reads lora_parameters.scale
    }
    if base_model is not None:
        config["model"] = base_model
    (out / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=4) + "\n", encoding="utf-8")
    return out


def read_adapter_settings(adapter_dir: str | Path) -> LoraSettings:
    """The :class:`LoraSettings` recorded in an mlx-lm adapter directory."""
    path = Path(adapter_dir) / ADAPTER_CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {ADAPTER_CONFIG_FILE} in {adapter_dir}")
    config = json.loads(path.read_text(encoding="utf-8"))
    fine_tune_type = config.get("fine_tune_type", "lora")
    if fine_tune_type != "lora":
        raise ValueError(f"{path}: fine_tune_type {fine_tune_type!r} is not supported, only 'lora'")
    params = config["lora_parameters"]
    rank = int(params["rank"])
    return LoraSettings(
        r=rank,
        alpha=float(config.get("lora_alpha", params["scale"] * rank)),
        dropout=float(params.get("dropout", 0.0)),
        num_layers=int(config["num_layers"]),
        keys=params.get("keys"),
    )


def adapter_base_model(adapter_dir: str | Path) -> str | None:
    """The base model an adapter directory records (``"model"`` in adapter_config.json, as
    :func:`save_adapters` and ``mlx_lm.lora`` write it), or None when it records none.

    A relative path is resolved against the adapter directory when a model is there (an exported
    model's ``adapters/`` records ``".."``), else returned as written (a Hub id, or a path
    relative to the working directory).
    """
    path = Path(adapter_dir) / ADAPTER_CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {ADAPTER_CONFIG_FILE} in {adapter_dir}")
    base = json.loads(path.read_text(encoding="utf-8")).get("model")
    if base is None:
        return None
    if not isinstance(base, str) or not base.strip():
        raise ValueError(f'{path}: "model" must be a model path or Hub id, got {base!r}')
    beside = Path(adapter_dir) / base
    if not Path(base).is_absolute() and (beside / "config.json").is_file():
        return str(beside.resolve())
    return base


def load_adapters(model: nn.Module, adapter_dir: str | Path) -> LoraSettings:
    """Add the adapters saved in ``adapter_dir`` to ``model`` (in place) and return their settings.

    Uses mlx-lm's loader (which checks every tensor's name and shape), then freezes the base so
    that, as after :func:`apply_lora`, only the adapters train.
    """
    from mlx_lm.tuner.utils import load_adapters as _mlx_load_adapters

    if not Path(adapter_dir).is_dir():
        raise FileNotFoundError(f"adapter directory {adapter_dir} does not exist")
    settings = read_adapter_settings(adapter_dir)
    lm = _lm(model)
    if lora_modules(lm):
        raise ValueError("the model already has LoRA adapters; load adapters into a fresh model")
    was_training = lm.training
    _mlx_load_adapters(lm, str(adapter_dir))
    lm.train(was_training)  # new layers start in train mode; keep the model's mode
    lm.freeze()
    for _, module in lora_modules(lm):
        module.unfreeze(keys=list(_ADAPTER_LEAVES), recurse=False)
    return settings


@contextmanager
def _layers_swapped(lm: nn.Module, swaps: list[tuple[str, nn.Module, nn.Module]]) -> Iterator[None]:
    """Within the block, each ``(name, layer, replacement)`` of ``swaps`` has ``replacement`` in
    ``layer``'s place in ``lm``; the layers are put back on exit, also on an exception."""
    if swaps:
        lm.update_modules(tree_unflatten([(name, new) for name, _, new in swaps]))
    try:
        yield
    finally:
        if swaps:
            lm.update_modules(tree_unflatten([(name, old) for name, old, _ in swaps]))


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, ``model`` computes its base function exactly: adapters off, no dropout.

    Each LoRA layer is swapped for the base layer it wraps (``.linear`` / ``.embedding``), so the
    computation is the base model's own, bit for bit, and adapter dropout cannot apply; the model
    is also put in eval mode. Everything is restored on exit, even on an exception. No weights are
    copied. Arrays computed inside stay valid after the block (they hold weights, not modules).
    Do not take gradients or optimizer steps inside the block: the trainable tree is different.
    """
    lm = _lm(model)
    swaps: list[tuple[str, nn.Module, nn.Module]] = []
    for name, module in lora_modules(lm):
        base = module.get("linear", module.get("embedding"))
        if not isinstance(base, nn.Module):
            raise ValueError(f"{name}: {type(module).__name__} has no base layer to restore")
        swaps.append((name, module, base))
    was_training = lm.training
    try:
        with _layers_swapped(lm, swaps):
            lm.eval()
            yield lm
    finally:
        lm.train(was_training)


def is_quantized_layer(module: nn.Module) -> bool:
    """Whether ``module`` holds quantized weights: MLX's ``QuantizedLinear`` /
    ``QuantizedEmbedding``, or another layer with ``scales`` and ``bits`` (mlx-lm's quantized
    switch layers)."""
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return True
    return "scales" in module and hasattr(module, "bits")


_warned_quantized_on_cpu = False


def warn_quantized_on_cpu(model: nn.Module, what: str) -> None:
    """Warn, once per process, when ``model`` holds quantized layers and MLX computes on the
    CPU: there MLX's quantized matrix products (training, scoring, prefill) run one to two
    orders of magnitude slower than float32 ones through OpenBLAS (docs/performance.md), so 4-bit
    weights save memory at a large cost in time. ``what`` names the model in the message."""
    global _warned_quantized_on_cpu
    if _warned_quantized_on_cpu or mx.default_device().type != mx.DeviceType.cpu:
        return
    if not any(is_quantized_layer(m) for _, m in model.named_modules()):
        return
    _warned_quantized_on_cpu = True
    logger.warning(
        "%s has quantized (4-/8-bit) layers and MLX runs on the CPU, where its quantized matrix "
        "products are one to two orders of magnitude slower than float32 ones (a LoRA reward "
        "stage's step 12-29x slower at SmolLM2-135M's and Qwen3-0.6B's shapes: "
        "docs/performance.md). If memory allows, "
        "dequantize the checkpoint first (python main.py export MODEL --out DIR --dequantize, or "
        "mlx_lm.convert --dequantize)",
        what,
    )


class _Holder(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer


def _dequantized(layer: nn.Module) -> nn.Module:
    """A float layer computing what the quantized ``layer`` does (mlx-lm's
    ``dequantize_model``, applied to a holder of that one layer: ``layer`` is left as it is)."""
    from mlx_lm.utils import dequantize_model

    holder = _Holder(layer)
    dequantize_model(holder)
    if is_quantized_layer(holder.layer):
        raise ValueError(f"cannot dequantize a {type(layer).__name__} layer")
    return holder.layer


@contextmanager
def adapters_fused(model: nn.Module, *, dequantize: bool = False) -> Iterator[nn.Module]:
    """Within the block, each LoRA layer is replaced by one linear layer with the adapter merged
    in (``W + scale * B^T A^T``, mlx-lm's ``LoRALinear.fuse``), as ``mlx_lm.fuse`` does.

    With ``dequantize`` every quantized layer is float within the block: a merged layer on a
    quantized base as well as the layers without adapters (the float model a full checkpoint
    holds); without it a merged layer on a quantized base is quantized again.

    The fused weights are new arrays (one per adapted matrix); the LoRA layers, and so the
    trainable adapters, and the quantized layers are put back on exit. Used to save a merged
    checkpoint mid-training.
    """
    lm = _lm(model)
    adapted = lora_modules(lm)
    swaps = [(name, m, m.fuse(dequantize=dequantize)) for name, m in adapted]
    if dequantize:
        inside_adapters = tuple(f"{name}." for name, _ in adapted)
        swaps += [
            (name, m, _dequantized(m))
            for name, m in lm.named_modules()
            if is_quantized_layer(m) and not name.startswith(inside_adapters)
        ]
    with _layers_swapped(lm, swaps):
        yield lm


#: About how many bytes of merged weights :func:`adapters_merged` computes per evaluation.
MERGE_GROUP_BYTES = 64 << 20


class _MergedLinear(nn.Linear):
    """An ``nn.Linear`` holding given arrays, built without ``nn.Linear``'s random
    initialisation (which would draw from, and so move, MLX's global random state)."""

    def __init__(self, weight: mx.array, bias: mx.array | None = None) -> None:
        nn.Module.__init__(self)
        self.weight = weight
        if bias is not None:
            self.bias = bias


def _mergeable(module: nn.Module) -> bool:
    """A plain LoRA layer (not DoRA, not an embedding or switch layer) on a float32
    ``nn.Linear`` with float32 adapters."""
    from mlx_lm.tuner.lora import LoRALinear

    base = module.get("linear")
    return (
        isinstance(module, LoRALinear)  # the fast layers give instances a subclass
        and isinstance(base, nn.Linear)
        and not isinstance(base, nn.QuantizedLinear)
        and all(a.dtype == mx.float32 for a in (base["weight"], module.lora_a, module.lora_b))
    )


@contextmanager
def adapters_merged(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, each LoRA layer on a float32 linear base computes with one merged
    weight, ``W + scale * B^T A^T``: the layer's function up to float32 rounding, in one matmul
    per call instead of the base's, the adapter's two and their sum.

    For sampling, where the adapters are constants and a decoding step's few rows make every
    call's fixed cost count. Layers on a quantized, bfloat16 or float16 base keep their adapters
    (a merged weight rounded to the base's precision can lose a small adapter update entirely),
    as do DoRA, embedding and switch layers. The merged weights are new arrays (as much memory
    as the adapted base weights), computed on entry a few at a time and freed on exit, where the
    LoRA layers are put back (also on an exception); no random state is drawn. Take no
    gradients inside the block: the adapters are not parameters of the merged layers.
    """
    lm = _lm(model)
    swaps: list[tuple[str, nn.Module, nn.Module]] = []
    for name, module in lora_modules(lm):
        if _mergeable(module):
            base = module.linear
            # W + scale * B^T A^T in one array: (out, r) @ (r, in) accumulated into a copy of W.
            weight = mx.addmm(base["weight"], module.lora_b.T, module.lora_a.T, alpha=module.scale)
            merged = few_row_like(_MergedLinear(weight, base.get("bias")), base)
            swaps.append((name, module, merged))
    # A few layers at a time: together, MLX would hold every layer's product at once.
    evaluate_in_groups([merged["weight"] for _, _, merged in swaps], MERGE_GROUP_BYTES)
    with _layers_swapped(lm, swaps):
        yield lm


#: ``merge_adapters_for_sampling``: merge always, never, or "auto" (:func:`merge_adapters_for_sampling`).
MergeSetting = bool | Literal["auto"]
#: "auto" merges only where the adapted weight matrices average at most this many bytes: there a
#: layer's matmul is cheap enough that the adapter's two extra products and add are a share of
#: it worth removing (between SmolLM2-135M's 1.9 MiB, where merging paid, and Qwen3-0.6B's
#: 8.6 MiB, where it did not: docs/performance.md).
AUTO_MERGE_MAX_MEAN_MATRIX_BYTES = 4 << 20
#: ... and where the merged copy is at most this fraction of the memory MLX may use.
AUTO_MERGE_MEMORY_FRACTION = 1 / 8


def mergeable_weight_bytes(model: nn.Module) -> list[int]:
    """The bytes of each base weight :func:`adapters_merged` would merge in ``model`` (the float32
    linear layers under plain LoRA layers): the merged copy is one new array of each size."""
    return [
        int(module.linear["weight"].nbytes)
        for _, module in lora_modules(_lm(model))
        if _mergeable(module)
    ]


def merge_adapters_for_sampling(
    setting: MergeSetting, matrix_bytes: Sequence[int], memory_bytes: int
) -> bool:
    """Whether to sample with the adapters merged (:func:`adapters_merged`), given the bytes of
    each weight matrix it would merge (:func:`mergeable_weight_bytes`) and ``memory_bytes``, the
    memory MLX may use (``mx.get_memory_limit()``).

    ``True`` / ``False`` say so (nothing to merge is never merged). ``"auto"`` merges when the
    matrices average at most :data:`AUTO_MERGE_MAX_MEAN_MATRIX_BYTES` (small layers, where one
    matmul instead of three pays) and their merged copy, ``sum(matrix_bytes)``, is at most
    :data:`AUTO_MERGE_MEMORY_FRACTION` of ``memory_bytes`` (the copy is a second set of nearly
    all the weights while sampling: at large shapes, the run's peak).

    Raises:
        ValueError: ``setting`` is not True, False or "auto", or a size is negative.
    """
    if setting not in (True, False, "auto") or not isinstance(setting, (bool, str)):
        raise ValueError(
            f'merge_adapters_for_sampling must be true, false or "auto", got {setting!r}'
        )
    smallest = min(matrix_bytes, default=0)
    if memory_bytes < 0 or smallest < 0:
        raise ValueError(f"sizes must be >= 0, got {smallest} and {memory_bytes} bytes")
    merged = sum(matrix_bytes)
    if merged == 0 or setting is False:
        return False
    if setting is True:
        return True
    small_layers = merged <= AUTO_MERGE_MAX_MEAN_MATRIX_BYTES * len(matrix_bytes)
    return small_layers and merged <= memory_bytes * AUTO_MERGE_MEMORY_FRACTION
