"""A lower bound on the memory a PPO configuration needs, checked before any model is built.

From the run's sizes and the policy's ``config.json`` and weight files (local folders only):

* the rollout's arrays: response ids, mask and three log-probs, ``B * T_new`` 4-byte values
  each (whatever the model);
* weights: the policy's files, twice without LoRA (the frozen reference is a second copy);
* KV cache of one rollout: ``2 * L * B * T_new * H_kv * d_head`` values in the weights' dtype
  (``B`` sequences of this process, ``T_new = max_new_tokens``: prompts only add to it);
* the LM head's log-probs of one micro-batch: on plain MLX and on a GPU their logits,
  ``b * T_new * V`` float32 values (the log-softmax over the vocabulary of every response
  token); with the CPU's speed tricks, which take them a vocabulary block at a time
  (:mod:`token_attribution.head_logprobs`), one block of at least ``MIN_BLOCK_ROWS`` rows.

Each part is what the run holds at once at least, so a configuration whose bound exceeds the
machine's memory cannot run: it is refused with the figures, instead of growing until the
kernel kills it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from base_setup.plain import speed_tricks
from config.ppo_config import PPOConfig
from token_attribution.head_logprobs import MIN_BLOCK_ROWS

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
GB = 2**30


def machine_memory() -> int | None:
    """The machine's physical memory in bytes (on Apple silicon, what the GPU shares), or None
    where the system does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _model_shape(model_dir: Path) -> dict[str, Any] | None:
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # loading the model names what is wrong
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    try:
        hidden = int(text["hidden_size"])
        heads = int(text.get("num_attention_heads", 1))
        return {
            "layers": int(text["num_hidden_layers"]),
            "vocab": int(text["vocab_size"]),
            "kv_dim": int(text.get("num_key_value_heads", heads))
            * int(text.get("head_dim") or hidden // heads),
            "weight_bytes": sum(f.stat().st_size for f in model_dir.glob("*.safetensors")),
        }
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


def memory_lower_bound(config: PPOConfig, world_size: int = 1) -> list[tuple[str, int]]:
    """``[(what, bytes), ...]``: the parts of the bound (see the module docstring); only the
    rollout's arrays when the policy is not a local folder with a readable config."""
    local = max(config.rollout_batch_size // world_size, 1)
    micro = max(config.micro_batch_size // world_size, 1)
    # Whatever the model: the rollout's response ids, mask, and sampling, policy and reference
    # log-probs, (B, T_new) 4-byte values each.
    parts = [
        (
            f"rollout arrays (5 x {local} sequences x {config.max_new_tokens} tokens)",
            5 * local * config.max_new_tokens * 4,
        )
    ]
    model_dir = Path(config.model_name)
    shape = _model_shape(model_dir) if model_dir.is_dir() else None
    if shape is None:
        return parts
    value_bytes = _DTYPE_BYTES.get(str(config.dtype), 2)
    copies = 1 if config.use_lora else 2
    rows = shape["vocab"]
    head = "logits"
    if speed_tricks() and not config.plain_mlx:  # the head's log-probs by vocabulary blocks
        rows, head = min(rows, MIN_BLOCK_ROWS), "logits of a vocabulary block"
    return parts + [
        (
            f"weights ({copies} x {shape['weight_bytes'] / GB:.2f} GB)",
            copies * shape["weight_bytes"],
        ),
        (
            f"KV cache ({local} sequences x {config.max_new_tokens} tokens x {shape['layers']} "
            "layers)",
            2 * shape["layers"] * local * config.max_new_tokens * shape["kv_dim"] * value_bytes,
        ),
        (
            f"{head} ({micro} sequences x {config.max_new_tokens} tokens x {rows} rows of the "
            "vocabulary, float32)",
            micro * config.max_new_tokens * rows * 4,
        ),
    ]


def check_memory(config: PPOConfig, world_size: int = 1, available: int | None = None) -> None:
    """Raise ``ValueError`` with the estimate when :func:`memory_lower_bound` exceeds
    ``available`` bytes (default: :func:`machine_memory`)."""
    available = machine_memory() if available is None else available
    parts = memory_lower_bound(config, world_size)
    needed = sum(n for _, n in parts)
    if available is None or needed <= available:
        return
    detail = ", ".join(f"{what}: {n / GB:.1f} GB" for what, n in parts)
    raise ValueError(
        f"this configuration needs at least {needed / GB:.1f} GB ({detail}) but the machine has "
        f"{available / GB:.1f} GB: lower batch_size, group_size or max_new_tokens, raise "
        "num_mini_batches or gradient_accumulation_steps, or use LoRA"
    )
