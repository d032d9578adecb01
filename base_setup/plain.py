"""One switch back to plain MLX: every speed trick of this project off at once.

Plain MLX is straightforward MLX and mlx-lm code: mlx-lm's own layers (``nn.Linear``, its
``LoRALinear``, ``nn.RMSNorm``, ``mx.fast.*``), ``model(x)`` logits then ``log_softmax`` and a
gather, ``mlx.optimizers.AdamW`` uncompiled, one stream, MLX's own buffer cache. The tricks it
turns off, each described with its own switch in docs/environment.md ("Speed tricks and how to
turn them off"): fast CPU math and the fast layers, the custom gradient of the log-softmax
gather, the split and blockwise LM head, the compiled AdamW, merged LoRA adapters for sampling,
the scoring passes on two CPU streams, the run's buffer-cache policy and the adaptive BLAS thread
count.

Two ways to turn it on, either enough: ``PPO_MLX_PLAIN=1`` for the whole process (read at every
check), or a trainer config's ``plain_mlx: true`` for one trainer's work (its models are built
with mlx-lm's layers, and it holds :func:`plain_mlx_scope` while it trains, steps and
evaluates: ``base_setup.backend.run_scope``).

The tricks were measured to pay on MLX's CPU device only, so off the CPU (a GPU)
:func:`speed_tricks` is False whatever the switch says: the GPU path is the plain one.

This module imports no mlx at import time (``base_setup.setup_blas`` must run before mlx loads).
It also holds :func:`env_mode`, which reads every other ``PPO_MLX_`` switch with a choice of
values, for modules that ``base_setup.backend`` itself imports.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, contextmanager
from typing import Iterator

ENV = "PPO_MLX_PLAIN"
_ON = {"1": True, "on": True, "true": True, "0": False, "off": False, "false": False, "": False}
#: How many :func:`plain_mlx_scope` blocks with ``enabled=True`` are open (nesting counts).
_DEPTH = [0]


def env_mode(name: str, aliases: dict[str, str], choices: str) -> str:
    """The setting environment variable ``name`` names, through ``aliases`` (the first entry's
    value is the default); ``ValueError`` naming ``choices`` for anything else."""
    value = os.environ.get(name, next(iter(aliases))).strip().lower()
    if value not in aliases:
        raise ValueError(f"{name}={value!r} is not a setting: use {choices} (docs/environment.md)")
    return aliases[value]


def plain_env() -> bool:
    """``PPO_MLX_PLAIN``: "1" / "on" / "true", or "0" / "off" / "false" / unset (the default)."""
    value = os.environ.get(ENV, "0").strip().lower()
    if value not in _ON:
        raise ValueError(f"{ENV}={value!r} is not a setting: use 1 or 0 (docs/environment.md)")
    return _ON[value]


def plain_mlx() -> bool:
    """Whether plain MLX is asked for: ``PPO_MLX_PLAIN=1``, or inside a :func:`plain_mlx_scope`
    of a run whose config says ``plain_mlx: true``."""
    return _DEPTH[0] > 0 or plain_env()


@contextmanager
def counted_scope(depth: list[int], enabled: bool = True) -> Iterator[None]:
    """A switch's block: ``depth[0]`` (how many of its blocks are open) one higher within it
    when ``enabled`` (a no-op otherwise), undone on exit, also on an exception; blocks nest."""
    if not enabled:
        yield
        return
    depth[0] += 1
    try:
        yield
    finally:
        depth[0] -= 1


def plain_mlx_scope(enabled: bool = True) -> AbstractContextManager[None]:
    """Within the block, :func:`plain_mlx` is True when ``enabled`` (a no-op otherwise); undone
    on exit, also on an exception. Blocks nest; the trainers hold one while they work."""
    return counted_scope(_DEPTH, enabled)


def speed_tricks() -> bool:
    """Whether this project's speed tricks apply now: plain MLX is not asked for
    (:func:`plain_mlx`) and MLX's default device is the CPU, the only device they were measured
    on (a GPU runs the plain path)."""
    if plain_mlx():
        return False
    import mlx.core as mx

    return bool(mx.default_device().type == mx.DeviceType.cpu)
