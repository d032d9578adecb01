"""Gradient checkpointing of a model's transformer blocks (activation recomputation).

A training step keeps every block's intermediate activations (attention projections, scores, the
MLP's 3-4 wide tensors) until the backward pass uses them: ``B * T * d_model`` times a few dozen
floats per block, over every block of one model, and PPO trains two (policy and value). With
:func:`checkpoint_blocks` each block keeps only its input; the backward pass runs the block's
forward again (``mx.checkpoint``) before differentiating it: one extra forward pass of compute for
most of the activation memory, as ``gradient_checkpointing=True`` does in transformers / TRL.

Only the model instances given change (each block gets a subclass of its own class, as
:func:`base_setup.fast_layers.accelerate_model` does); a call with a KV cache (a decoding step,
never differentiated) runs the block as before. Dropout stays exact: the recomputation draws the
same masks as the forward pass (a seed is pinned per block call, as PyTorch's
``checkpoint(preserve_rng_state=True)`` keeps the random state).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, cast

import mlx.core as mx
import mlx.nn as nn

_CHECKPOINTED: dict[type, type] = {}


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of ``model``: an mlx-lm model's ``.layers``, or those of the
    mlx-lm model inside a wrapper (``PolicyModel.model``; reward and value models' ``.layers``).
    """
    for candidate in (model, getattr(model, "model", None)):
        blocks = getattr(candidate, "layers", None)
        if isinstance(blocks, (list, tuple)) and all(isinstance(b, nn.Module) for b in blocks):
            return list(blocks)
    raise ValueError(
        f"{type(model).__name__} has no transformer blocks to checkpoint (no .layers list on it "
        "or on its .model)"
    )


def checkpoint_blocks(model: nn.Module, *, enabled: bool = True) -> int:
    """Recompute each transformer block's activations in the backward pass instead of keeping
    them (``enabled``), or keep them again (``enabled=False``); in place, this instance only.

    Same values and gradients either way (the recomputation is the same computation); with it a
    training step holds one block's activations at a time, plus every block's input.

    Returns:
        The number of blocks changed.

    Raises:
        ValueError: ``model`` has no transformer blocks (see :func:`transformer_blocks`).
    """
    changed = 0
    for block in transformer_blocks(model):
        cls = type(block)
        if enabled and cls not in _CHECKPOINTED.values():
            block.__class__ = _checkpointed_class(cls)
            changed += 1
        elif not enabled and cls in _CHECKPOINTED.values():
            block.__class__ = cls.__bases__[0]
            changed += 1
    return changed


def is_checkpointed(block: nn.Module) -> bool:
    """Whether ``block`` recomputes its activations in the backward pass."""
    return type(block) in _CHECKPOINTED.values()


def _checkpointed_class(cls: type) -> type:
    """The subclass of block class ``cls`` whose ``__call__`` goes through ``mx.checkpoint``
    when there is no KV cache (made once per class)."""
    if cls not in _CHECKPOINTED:
        call: Callable[..., Any] = cls.__call__
        signature = inspect.signature(call)
        has_cache = "cache" in signature.parameters

        def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if has_cache and signature.bind(self, *args, **kwargs).arguments.get("cache"):
                return call(self, *args, **kwargs)  # a decoding step: nothing to differentiate
            seed = _pinned_seed(self)

            def block(params: dict[str, Any], *inputs: Any) -> Any:
                # Runs twice under a gradient: the forward pass, then again in the backward.
                self.update(params)
                if seed is not None:
                    mx.random.seed(seed)  # the same dropout masks both times
                return call(self, *inputs, **kwargs)

            return mx.checkpoint(block)(self.trainable_parameters(), *args)

        _CHECKPOINTED[cls] = type(
            cls.__name__,
            (cls,),
            {"__call__": __call__, "__module__": cls.__module__, "__doc__": cls.__doc__},
        )
    return _CHECKPOINTED[cls]


def _pinned_seed(block: nn.Module) -> int | None:
    """A seed drawn from the global random state for a block whose forward pass draws random
    numbers (a dropout in training mode), else None (the global state is left untouched).

    MLX's global key can be reseeded but not saved and restored, so the block's forward pass
    and its recomputation both start from ``mx.random.seed(seed)``; the run stays deterministic
    for its seed (its random stream differs from the same run without checkpointing).
    """
    # nn.Dropout keeps its keep-probability 1 - p only as the private `_p_1` (MLX has no public
    # attribute for p); read it directly, so that a rename fails loudly here instead of
    # silently leaving the recomputation unseeded (tests/test_backend.py has its canary).
    drops = any(
        isinstance(m, nn.Dropout) and m.training and m._p_1 < 1.0 for _, m in block.named_modules()
    )
    if not drops:
        return None
    return cast(int, mx.random.randint(0, 2**31 - 1, ()).item())
