"""config.json as mlx-lm reads it: values moved by newer transformers are put back, and a config
that mlx-lm would silently misread is refused.

mlx-lm builds a model's ``ModelArgs`` from the top-level keys of config.json and drops every key it
does not know. transformers 5 writes some values elsewhere: ``rope_theta`` and the RoPE scaling of a
Llama, Qwen or Mistral config now live under ``rope_parameters: {"rope_theta": ..., "rope_type":
...}``. mlx-lm 0.32 reads only a top-level ``rope_theta``, so such a checkpoint loads without an
error, with RoPE base 10000 instead of the trained one, and gives wrong logits.

* :func:`config_updates` lifts those values to the keys mlx-lm reads (``rope_theta``,
  ``rope_scaling``, ``partial_rotary_factor``); the loaders pass them to mlx-lm.
* :func:`check_config_is_read` guards the whole class of mismatch: after the model is built, every
  ``ModelArgs`` field that config.json does not set at the top level, but does set in a nested
  section, must have been given that nested value; and a setting that changes the model's
  function (RoPE scaling, soft-capping, biases, ...) must be one the architecture reads. Otherwise
  it raises, naming the key, instead of returning a model with wrong logits.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Mapping

# Nested sections that hold another model's settings (vision/audio towers, a wrapped text model
# that mlx-lm's class reads itself) or quantisation: not values of this ModelArgs.
_OTHER_SECTIONS = frozenset(
    {
        "text_config",
        "vision_config",
        "audio_config",
        "quantization",
        "quantization_config",
        "id2label",
        "label2id",
        "task_specific_params",
    }
)
# Top-level settings that change the model's function when set: an architecture whose ModelArgs
# has no such field would ignore them. "Inactive" values are the ones that change nothing.
_FUNCTIONAL_KEYS: dict[str, tuple[Any, ...]] = {
    "rope_scaling": (None, {}),
    "partial_rotary_factor": (None, 1, 1.0),
    "attn_logit_softcapping": (None, 0, 0.0),
    "final_logit_softcapping": (None, 0, 0.0),
    "attention_bias": (None, False),
    "mlp_bias": (None, False),
    "rope_theta": (10000, 10000.0),  # the base an architecture without the field hard-codes
}


def config_updates(config: Mapping[str, Any]) -> dict[str, Any]:
    """The top-level keys to add to ``config`` so that mlx-lm reads what transformers wrote.

    GPT-2's ``n_ctx`` (dropped by transformers 5, required by mlx-lm) from ``n_positions``.
    From a ``rope_parameters`` section (transformers >= 5) of one RoPE (not one per layer type):
    ``rope_theta``, ``partial_rotary_factor`` and, for a scaled RoPE (``rope_type`` other than
    "default"), ``rope_scaling`` (the section without ``rope_theta``), each only when the top
    level does not already set it. Empty when there is nothing to move.
    """
    updates: dict[str, Any] = {}
    # GPT-2 configs of transformers >= 5 no longer write n_ctx, which mlx-lm requires (and
    # which always equalled n_positions).
    if config.get("model_type") == "gpt2" and "n_ctx" not in config and "n_positions" in config:
        updates["n_ctx"] = config["n_positions"]
    rope = config.get("rope_parameters")
    if not isinstance(rope, Mapping) or "rope_theta" not in rope and "rope_type" not in rope:
        return updates  # absent, or one section per layer type: check_config_is_read decides
    if "rope_theta" in rope and config.get("rope_theta") is None:
        updates["rope_theta"] = rope["rope_theta"]
    if "partial_rotary_factor" in rope and config.get("partial_rotary_factor") is None:
        updates["partial_rotary_factor"] = rope["partial_rotary_factor"]
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default" and not config.get("rope_scaling"):
        updates["rope_scaling"] = {
            k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")
        }
    return updates


def _nested_values(value: Any, path: str) -> Iterator[tuple[str, str, Any]]:
    """``(dotted path, key, value)`` of every key inside nested sections of a config."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield f"{path}.{key}", str(key), item
            if str(key) not in _OTHER_SECTIONS:
                yield from _nested_values(item, f"{path}.{key}")


def check_config_is_read(config: Mapping[str, Any], args: Any, where: str) -> None:
    """Raise ``ValueError`` unless the model built from ``config`` reads what it says.

    Args:
        config: the config.json the model was built from (after :func:`config_updates`).
        args: the architecture's ``ModelArgs`` instance mlx-lm built from it.
        where: the checkpoint, for the message.
    """
    if not dataclasses.is_dataclass(args):
        return
    fields = {f.name for f in dataclasses.fields(args)}
    for name in sorted(fields):
        if name in config:
            continue
        for key, value in config.items():
            if key in fields or key in _OTHER_SECTIONS or not isinstance(value, Mapping):
                continue  # a section the model reads as a whole is its own business
            for path, nested_key, nested in _nested_values(value, key):
                if nested_key == name and nested != getattr(args, name):
                    raise ValueError(
                        f"{where}: config.json sets {name}={nested!r} only under {path}, and "
                        f"mlx-lm's {type(args).__module__}.ModelArgs reads it from the top "
                        f"level, so the model would load with {name}="
                        f"{getattr(args, name)!r} and compute wrong logits. Add "
                        f'"{name}": {nested!r} at the top level of config.json'
                    )
    for key, inactive in _FUNCTIONAL_KEYS.items():
        value = config.get(key)
        if key in config and key not in fields and not _is_inactive(value, inactive):
            raise ValueError(
                f"{where}: config.json sets {key}={value!r}, which changes the model's output, "
                f"but mlx-lm's {type(args).__module__}.ModelArgs has no such setting, so it "
                "would be ignored and the logits would be wrong. This architecture is not "
                "supported with that setting"
            )


def _is_inactive(value: Any, inactive: tuple[Any, ...]) -> bool:
    """Whether ``value`` equals one of ``inactive`` (booleans only as booleans)."""
    for v in inactive:
        if isinstance(value, bool) or isinstance(v, bool) or value is None or v is None:
            if value is v:
                return True
        elif value == v:
            return True
    return False
