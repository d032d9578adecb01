"""The fast layers of one model instance: :func:`accelerate_model` gives a model's layers
subclasses whose ``__call__`` runs :mod:`base_setup.fast_math`'s functions (``nn.RMSNorm``,
``nn.RoPE``, and the mlx-lm MLP / attention layers that call ``swiglu`` /
``scaled_dot_product_attention``), and mlx-lm's ``LoRALinear`` a ``__call__`` that adds the
adapter's product inside the matmul (:func:`lora_linear`). No module of mlx-lm is changed: another
model of the same architecture keeps mlx-lm's functions.
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from base_setup.backend import blas_info, parameter_count
from base_setup import fast_math
from base_setup.fast_math import _MIN_FAST_ATTENTION, fast_math_enabled, rms_norm, rope, swiglu


class _FastRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` through :func:`rms_norm` (same parameters, same results)."""

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self["weight"], self.eps)


class _FastRoPE(nn.RoPE):
    """``nn.RoPE`` through :func:`rope` (same settings, same results)."""

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        return rope(
            x,
            self.dims,
            traditional=self.traditional,
            base=self.base,
            scale=self.scale,
            offset=offset,
        )


class _FewRowLinear(nn.Linear):
    """``nn.Linear`` whose calls on a decoding step's few rows run the native few-row kernel
    (:func:`fast_math.few_row_matmul`); every other call is ``nn.Linear``'s."""

    def __call__(self, x: mx.array) -> mx.array:
        y = fast_math.few_row_matmul(x, self["weight"])
        if y is None:  # nn.Linear's (not super(): few_row_like reuses this on other classes)
            return nn.Linear.__call__(self, x)
        return y + self["bias"] if "bias" in self else y


class _FewRowEmbedding(nn.Embedding):
    """``nn.Embedding`` whose ``as_linear`` (a tied LM head) on few rows runs the native
    few-row kernel; the lookup and every other call are ``nn.Embedding``'s."""

    def as_linear(self, x: mx.array) -> mx.array:
        y = fast_math.few_row_matmul(x, self["weight"])
        return nn.Embedding.as_linear(self, x) if y is None else y


#: Parameters from which :func:`accelerate_model` gives a model's ``nn.Linear`` and
#: ``nn.Embedding`` layers the few-row kernel: SmolLM2-135M's size is well above. The kernel was
#: measured at the real shapes only, and below this project's test, golden and demo models keep
#: MLX's matmuls (and so their records' bits: the kernel sums in another order).
FEW_ROW_MIN_PARAMETERS = 50_000_000


def few_row_sized(model: nn.Module) -> bool:
    """Whether ``model`` has :data:`FEW_ROW_MIN_PARAMETERS` or more: a model whose decoding
    steps the few-row kernel serves (:func:`accelerate_model`) and which decodes on one core
    fewer (``base_setup.backend.decoding_threads``)."""
    return parameter_count(model) >= FEW_ROW_MIN_PARAMETERS


#: The exact layer classes that get the few-row kernel -> their few-row subclasses.
_FEW_ROW_CLASSES: dict[type, type] = {nn.Linear: _FewRowLinear, nn.Embedding: _FewRowEmbedding}
#: Linear classes :func:`few_row_like` gave the kernel -> their few-row subclasses.
_FEW_ROW_LIKE: dict[type, type] = {}


def few_row_like(layer: nn.Linear, base: nn.Module) -> nn.Linear:
    """``layer``, a linear layer that stands in for ``base`` (e.g. a LoRA layer's merged weight,
    ``base_setup.lora_setup.adapters_merged``), with the few-row kernel where ``base`` has it:
    its class becomes a subclass of its own with :class:`_FewRowLinear`'s ``__call__``."""
    if isinstance(base, _FewRowLinear) and type(layer).__call__ is not _FewRowLinear.__call__:
        cls = type(layer)
        if cls not in _FEW_ROW_LIKE:
            _FEW_ROW_LIKE[cls] = type(
                f"FewRow{cls.__name__}",
                (cls,),
                {"__call__": _FewRowLinear.__call__, "__module__": __name__},
            )
        layer.__class__ = _FEW_ROW_LIKE[cls]
    return layer


def lora_linear(
    y: mx.array, x: mx.array, lora_a: mx.array, lora_b: mx.array, scale: float
) -> mx.array:
    """``y + scale * (x @ lora_a) @ lora_b``: a LoRA layer's output from its base layer's output
    ``y`` and its (dropped-out) input ``x``, as mlx-lm's ``LoRALinear`` computes it, but with the
    adapter's product accumulated into ``y`` by the matmul itself (``mx.addmm``, BLAS's
    ``C += alpha A B``).

    mlx-lm's layer computes ``y + (scale * z)``: two passes over the (tokens, out) output, and
    in the backward pass a third (the cotangent times ``scale``), for each of the up to seven
    adapted matrices of every block; here the scale rides in the small (tokens, r) x (r, out)
    matmul and the base output is its accumulator. Same function up to float rounding (the
    tests compare values and gradients). mlx-lm's own computation where the adapters' dtype is
    not the input's (its ``astype`` would then decide the result's dtype), off the CPU, and
    with ``PPO_MLX_FAST_MATH=0``.
    """
    if lora_a.dtype != y.dtype or lora_b.dtype != y.dtype or not fast_math_enabled():
        return y + (scale * ((x @ lora_a) @ lora_b)).astype(x.dtype)
    return mx.addmm(y, x @ lora_a, lora_b, alpha=scale)


def _lora_call(self: Any, x: mx.array) -> mx.array:
    """``LoRALinear.__call__`` through :func:`lora_linear` (the base layer sees ``x``, the
    adapter its dropout, as in mlx-lm's)."""
    return lora_linear(self.linear(x), self.dropout(x), self.lora_a, self.lora_b, self.scale)


def _code_names(code: types.CodeType) -> set[str]:
    """The global and attribute names ``code`` and the functions nested in it use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


#: See :func:`mlx_lm_replacements` (filled on first use: importing mlx-lm takes seconds), one
#: table for other models and one for those the few-row kernel serves.
_REPLACEMENTS: dict[bool, dict[str, tuple[Callable[..., Any], Callable[..., Any]]]] = {}


def mlx_lm_replacements(
    few_rows: bool = False,
) -> dict[str, tuple[Callable[..., Any], Callable[..., Any]]]:
    """What the fast layers replace in mlx-lm's architecture modules: ``{global name: (mlx-lm's
    function, ours)}``; with ``few_rows``, what a model the few-row kernel serves gets
    (:func:`few_row_sized`: a decoding step's attention in the native kernel).

    mlx-lm's llama / qwen2 / qwen3 / mistral / phi3 ... modules call ``swiglu(gate, x)`` (from
    ``mlx_lm.models.activations``) and ``scaled_dot_product_attention(queries, keys, values,
    cache=..., scale=..., mask=...)`` (from ``mlx_lm.models.base``) by these global names.
    ``tests/test_backend.py`` checks that mlx-lm's functions still have the signature and the
    results ours assume.
    """
    if few_rows not in _REPLACEMENTS:
        from mlx_lm.models import activations, base

        _REPLACEMENTS[few_rows] = {
            "swiglu": (activations.swiglu, swiglu),
            "scaled_dot_product_attention": (
                base.scaled_dot_product_attention,
                _mlx_lm_attention(base.scaled_dot_product_attention, native=few_rows),
            ),
        }
    return _REPLACEMENTS[few_rows]


def _mlx_lm_attention(
    original: Callable[..., mx.array], *, native: bool = False
) -> Callable[..., mx.array]:
    """mlx-lm's ``scaled_dot_product_attention`` (``original``) with the fast attention on the
    CPU (:func:`fast_math.one_query_attention` at one query position, a decoding step, in the
    native kernel with ``native``); ``original`` for attention sinks, quantised KV caches,
    other small inputs and GPUs."""

    def attention(
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        cache: Any,
        scale: float,
        mask: mx.array | str | None,
        sinks: mx.array | None = None,
    ) -> mx.array:
        b, h, length, _ = queries.shape
        if sinks is not None or hasattr(cache, "bits") or not fast_math_enabled():
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        if length == 1:  # a decoding step; "causal" hides nothing from the last position
            one_mask = None if isinstance(mask, str) else mask
            return fast_math.one_query_attention(
                queries, keys, values, scale=scale, mask=one_mask, native=native
            )
        if b * h * length * keys.shape[2] < _MIN_FAST_ATTENTION:
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        return fast_math.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)

    attention.__wrapped__ = original  # type: ignore[attr-defined]
    return attention


#: Each layer class a model was seen with -> its fast subclass (None: nothing to replace); for
#: models the few-row kernel serves, the classes whose replacements differ (the attention's).
_FAST_CLASSES: dict[type, type | None] = {nn.RMSNorm: _FastRMSNorm, nn.RoPE: _FastRoPE}
_FEW_ROW_FAST_CLASSES: dict[type, type | None] = {}


def _fast_class(cls: type, few_rows: bool = False) -> type | None:
    """The fast subclass of layer class ``cls``, made once: :class:`_FastRMSNorm` /
    :class:`_FastRoPE` for exactly ``nn.RMSNorm`` / ``nn.RoPE``; for an mlx-lm layer whose
    ``__call__`` calls a function of :func:`mlx_lm_replacements` (``few_rows``: its table for a
    model the few-row kernel serves) by its global name, a subclass whose ``__call__`` is that
    same code run with the name bound to ours: the function is re-made from its code object
    with a copy of its module's globals (taken now) in which the name is ours, so mlx-lm's
    module itself is not changed. None for any other class."""
    table = _FEW_ROW_FAST_CLASSES if few_rows else _FAST_CLASSES
    if cls in table:
        return table[cls]
    ours = _replaced(cls, few_rows)
    if few_rows and ours == _replaced(cls, False):  # nothing differs: the same class
        table[cls] = _fast_class(cls)
        return table[cls]
    fast: type | None = None
    if cls.__module__ == "mlx_lm.tuner.lora" and cls.__name__ == "LoRALinear":
        fast = type(
            "FastLoRALinear",
            (cls,),
            {"__call__": _lora_call, "__module__": __name__, "fast_math_replaces": ("addmm",)},
        )
        table[cls] = fast
        return fast
    if ours:
        call = getattr(cls, "__call__")
        fast_call = types.FunctionType(
            call.__code__,
            {**call.__globals__, **ours},
            call.__name__,
            call.__defaults__,
            call.__closure__,
        )
        fast_call.__kwdefaults__ = call.__kwdefaults__
        functools.update_wrapper(fast_call, call)
        fast = type(
            f"Fast{'FewRow' if few_rows else ''}{cls.__name__}",
            (cls,),
            {
                "__call__": fast_call,
                "__module__": __name__,
                "fast_math_replaces": tuple(sorted(ours)),
            },
        )
    table[cls] = fast
    return fast


def _replaced(cls: type, few_rows: bool) -> dict[str, Callable[..., Any]]:
    """The globals of ``cls.__call__`` (an mlx-lm model module's function) that
    :func:`mlx_lm_replacements` (``few_rows``' table) replaces, by name -> ours."""
    call = getattr(cls, "__call__", None)
    if not (isinstance(call, types.FunctionType) and call.__module__.startswith("mlx_lm.models.")):
        return {}
    module_globals = call.__globals__
    used = _code_names(call.__code__)
    return {
        name: replacement
        for name, (original, replacement) in mlx_lm_replacements(few_rows).items()
        if name in used and module_globals.get(name) is original
    }


def _is_fast(cls: type) -> bool:
    kinds = (_FAST_CLASSES, _FEW_ROW_FAST_CLASSES, _FEW_ROW_CLASSES, _FEW_ROW_LIKE)
    return any(cls in kind.values() for kind in kinds)


def accelerate_model(model: nn.Module, *, enabled: bool = True) -> bool:
    """Run ``model``'s layers through this module's fast CPU functions (``enabled``), or back
    through mlx-lm's and MLX's own (``enabled=False``); in place, this model instance only.

    Each layer that has a fast counterpart (see :func:`_fast_class`: ``nn.RMSNorm``,
    ``nn.RoPE``, and the mlx-lm MLP / attention layers that call ``swiglu`` /
    ``scaled_dot_product_attention``) gets the fast subclass of its class: its parameters,
    settings and every other method stay, only ``__call__`` changes. In a model of
    :data:`FEW_ROW_MIN_PARAMETERS` or more, ``nn.Linear`` and ``nn.Embedding`` layers also get
    :class:`_FewRowLinear` / :class:`_FewRowEmbedding`: on a decoding step's few rows their
    matmul (a tied head's ``as_linear``) runs the native few-row kernel
    (:func:`fast_math.few_row_matmul`), and its attention layers' decoding steps the native
    one-query kernel (:func:`fast_math.native_one_query_attention`, a ``FastFewRow`` class).
    Nothing else in the process changes: another model of
    the same architecture (e.g. one a user loads with ``mlx_lm.load``) keeps mlx-lm's
    functions. Every fast function defers to MLX's own on a GPU device, with
    ``PPO_MLX_FAST_MATH=0`` and under plain MLX, checked at each call, so a later change of any
    is safe. Returns whether the model now uses any of them (False: ``enabled`` is
    False, fast math is off, or the architecture uses none of the functions replaced).

    Plain MLX (:mod:`base_setup.plain`) leaves the layers as they are, as fast math off does.
    Either way, one warning if MLX missed the fast BLAS because mlx was imported before
    :func:`base_setup.backend.setup_blas` ran. Nothing process-wide changes (MLX's buffer-cache
    limit belongs to a run: :func:`base_setup.backend.run_scope`).
    """
    blas_info()  # the first call after a missed set-up logs the warning
    layers = [layer for _, layer in model.named_modules()]
    if not enabled:
        for layer in layers:
            if _is_fast(type(layer)):
                layer.__class__ = type(layer).__bases__[0]
        return False
    if not fast_math_enabled():
        return False
    few_rows = few_row_sized(model)
    changed = False
    for layer in layers:
        if type(layer) in _FEW_ROW_CLASSES:
            if few_rows:
                layer.__class__ = _FEW_ROW_CLASSES[type(layer)]
                changed = True
            continue
        fast = type(layer) if _is_fast(type(layer)) else _fast_class(type(layer), few_rows)
        if fast is not None:
            layer.__class__ = fast
            changed = True
    return changed
