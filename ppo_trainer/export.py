"""Export a trained policy as a self-contained model directory that people can use as it is.

:func:`export_model` takes any RUN_OR_DIR that :mod:`ppo_trainer.trained_model` resolves (a run,
adapters, a checkpoint, a model directory) and writes::

    config.json               the model's config (quantization keys dropped by --dequantize)
    model.safetensors(.index.json)   the weights, as mlx-lm saves them (Hugging Face names)
    tokenizer files           with the chat template
    generation_config.json    eos_token_id = every stop id (EOS and the chat end-of-turn token)
    adapters/                 LoRA without --fuse: the adapters, in mlx-lm's format
    README.md                 model card: base model, training, config, final metrics, usage

``mlx_lm.load(DIR)`` and ``mlx_lm.generate --model DIR`` read it as it is, and so does
transformers' ``AutoModelForCausalLM`` when the weights are float (not quantized) and the
architecture is one whose weight names mlx-lm keeps as transformers has them
(:data:`TRANSFORMERS_LAYOUT`; mlx-lm renames others, e.g. GPT-2's, which the card then says).

LoRA runs: with ``fuse=True`` the adapters are merged into the weights (mlx-lm's ``fuse``; on a
quantized base the merged weights are quantized again, unless ``dequantize=True``). Without it the
base weights are exported with the adapters in ``adapters/`` (``mlx_lm.generate --model DIR
--adapter-path DIR/adapters``; this project's generate / chat apply them by themselves); mlx-lm
and transformers reading DIR alone get the base model.

The export is written to a hidden sibling directory and renamed into place at the end, so a crash
never leaves a half-written export; a non-empty output directory is replaced only with
``overwrite=True``.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import yaml
from mlx.utils import tree_flatten, tree_unflatten

from algorithms.registry import ALGORITHMS
from base_setup.backend import process_running
from base_setup.lora_setup import lora_modules, save_adapters
from base_setup.tokenizer_setup import eos_token_ids
from models.backbone_loading import QUANTIZATION_KEYS
from models.policy_model import PolicyModel
from ppo_trainer.trained_model import (
    EXPORTED_ADAPTERS_DIR,
    TrainedModel,
    load_trained_model,
    resolve_trained_model,
)

logger = logging.getLogger("ppo_mlx")

_ALGORITHMS = {
    "ppo": "PPO (policy, frozen reference, reward model or function, value model with GAE)",
    "grpo": "GRPO (group-relative advantages, frozen reference, no value model)",
    "sft": "supervised fine-tuning (next-token cross-entropy on the completions)",
}


def _training(algorithm: str | None) -> str:
    """The model card's line on how the weights were trained."""
    if algorithm is None:
        return "unknown (no training run found)"
    if algorithm in _ALGORITHMS:
        return _ALGORITHMS[algorithm]
    if algorithm in ALGORITHMS:
        return f"{ALGORITHMS[algorithm].title} (`algorithm: {algorithm}`, docs/algorithms.md)"
    return "unknown (no training run found)"


#: ``model_type`` values whose mlx-lm weights carry transformers' names and shapes, so that a
#: float export loads in ``AutoModelForCausalLM`` (each checked in tests/test_export.py).
TRANSFORMERS_LAYOUT = ("llama", "mistral", "qwen2", "qwen3")


def check_output_dir(
    out: Path, *, overwrite: bool, sources: list[Path], run_dir: Path | None = None
) -> None:
    """Refuse an output directory that would lose data.

    Raises:
        ValueError: ``out`` is a file, a non-empty directory without ``overwrite``, or overlaps
            what is exported: one of ``sources`` (model, adapter, checkpoint or base directory;
            the same directory, inside it, or containing it) or ``run_dir`` (the same
            directory or containing it; a new directory inside a run is fine).
    """
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a directory path")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(
            f"--out {out} is not empty; choose a new directory or pass --overwrite to replace it"
        )
    target = out.resolve()
    for source, inside_is_fine in [(s, False) for s in sources] + [(run_dir, True)]:
        if source is None:
            continue
        source = source.resolve()
        inside = source in target.parents and not inside_is_fine
        if target == source or target in source.parents or inside:
            raise ValueError(
                f"--out {out} overlaps the model being exported ({source}); choose a directory "
                "outside it"
            )


def export_model(
    source: str | Path,
    out: str | Path,
    *,
    fuse: bool = False,
    dequantize: bool = False,
    overwrite: bool = False,
) -> Path:
    """Export the policy at ``source`` (see the module docstring) to the directory ``out``.

    Args:
        source: RUN_OR_DIR (see :func:`ppo_trainer.trained_model.resolve_trained_model`).
        out: the directory to create.
        fuse: merge LoRA adapters into the weights (nothing to do without adapters).
        dequantize: turn quantized layers back into float ones (mlx-lm's ``dequantize_model``)
            and drop the quantization keys of the config (nothing to do for float weights).
        overwrite: replace a non-empty ``out``.

    Returns:
        ``out``.

    Raises:
        FileNotFoundError / ValueError: see :func:`resolve_trained_model` and
            :func:`check_output_dir`; both are checked before any weights are read.
    """
    out = Path(out)
    found = resolve_trained_model(source)
    sources = [found.path] + ([Path(found.base_model)] if Path(found.base_model).exists() else [])
    check_output_dir(out, overwrite=overwrite, sources=sources, run_dir=found.run_dir)

    policy = load_trained_model(found)
    if fuse and not lora_modules(policy.model):
        logger.info("--fuse: the model has no LoRA adapters, nothing to fuse")
    if dequantize and not any(k in policy.config for k in QUANTIZATION_KEYS):
        logger.info("--dequantize: the weights are not quantized, nothing to dequantize")

    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_exports(out)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    if partial.exists():
        shutil.rmtree(partial)
    try:
        partial.mkdir()
        layout = _write_export(policy, partial, fuse=fuse, dequantize=dequantize)
        _write_model_card(partial / "README.md", found, out, layout, config_of=partial)
        _move_into_place(partial, out)
    except (OSError, RuntimeError) as err:  # MLX reports a failed write as RuntimeError
        shutil.rmtree(partial, ignore_errors=True)  # never leave a half-written export
        free = shutil.disk_usage(out.parent).free
        raise OSError(
            f"could not write the export {out} ({type(err).__name__}: {err}). The file system "
            f"has {free / 2**20:.1f} MB free: free some space (or choose another --out) and "
            "export again"
        ) from None
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # never leave a half-written export
        raise
    logger.info("exported %s to %s", found.describe(), out)
    return out


def remove_stale_exports(out: Path) -> None:
    """Delete the hidden ``.<out>.partial-<pid>`` / ``.<out>.old-<pid>`` siblings of ``out``
    that exports killed before their cleanup left (their process is gone); those of a running
    export stay."""
    for leftover in out.parent.glob(f".{glob.escape(out.name)}.*-*"):
        kind, _, pid = leftover.name[len(out.name) + 2 :].rpartition("-")
        if kind not in ("partial", "old") or not pid.isdigit() or process_running(int(pid)):
            continue
        logger.info("removing %s, left by an export that was killed", leftover)
        shutil.rmtree(leftover, ignore_errors=True)


def _write_export(
    policy: PolicyModel, dest: Path, *, fuse: bool, dequantize: bool
) -> dict[str, Any]:
    """Write weights, config, tokenizer and generation config of ``policy`` into ``dest``;
    returns what the model card needs to say about the layout."""
    from mlx_lm.utils import dequantize_model, save_config, save_model

    lm = policy.model  # loaded for this export only: changed in place below
    config = policy.config
    adapted = lora_modules(lm)
    was_quantized = any(k in config for k in QUANTIZATION_KEYS)
    adapters_exported = False
    if adapted and fuse:
        lm.update_modules(tree_unflatten([(n, m.fuse(dequantize=dequantize)) for n, m in adapted]))
    elif adapted:
        assert policy.lora is not None
        # ".." = the exported model this adapters/ folder sits in (adapter_base_model).
        save_adapters(lm, policy.lora, dest / EXPORTED_ADAPTERS_DIR, base_model="..")
        base_layers = [(n, m.get("linear", m.get("embedding"))) for n, m in adapted]
        lm.update_modules(tree_unflatten(base_layers))
        adapters_exported = True
    if dequantize and was_quantized:
        dequantize_model(lm)
        for key in QUANTIZATION_KEYS:
            config.pop(key, None)
    quantized = any(k in config for k in QUANTIZATION_KEYS)
    params = cast(list[tuple[str, mx.array]], tree_flatten(lm.parameters()))
    # The float dtypes of the weights (quantized layers also hold packed integer arrays).
    dtypes = sorted(
        {str(v.dtype).split(".")[-1] for _, v in params if mx.issubdtype(v.dtype, mx.floating)}
    )
    if not quantized and len(dtypes) == 1:  # keep the config's dtype truthful
        config["dtype"] = dtypes[0]
        if "torch_dtype" in config:  # the name transformers < 5 reads
            config["torch_dtype"] = dtypes[0]

    tokenizer = policy.tokenizer
    stop_ids = eos_token_ids(tokenizer)
    if stop_ids:
        config["eos_token_id"] = stop_ids if len(stop_ids) > 1 else stop_ids[0]
    mx.eval(lm.parameters())
    save_model(dest, lm)
    save_config(config, config_path=dest / "config.json")
    tokenizer.save_pretrained(str(dest))
    _write_generation_config(dest, policy.model_path, tokenizer, stop_ids)
    for code in glob.glob(str(policy.model_path / "*.py")):  # custom model code, as mlx-lm does
        shutil.copy(code, dest)
    return {
        "fused": bool(adapted) and fuse,
        "adapters": adapters_exported,
        "quantized": quantized,
        "dequantized": was_quantized and not quantized,
        "dtypes": dtypes,
        "stop_ids": stop_ids,
        "stop_tokens": [tokenizer.convert_ids_to_tokens(i) for i in stop_ids],
        "chat_template": bool(getattr(tokenizer, "chat_template", None)),
        "lora": policy.lora,
    }


def _write_generation_config(
    dest: Path, source_dir: Path, tokenizer: Any, stop_ids: list[int]
) -> None:
    """The source's generation_config.json (sampling defaults), with every stop id as
    ``eos_token_id``, which both mlx-lm and transformers stop generation at."""
    source = source_dir / "generation_config.json"
    generation: dict[str, Any] = {}
    if source.is_file():
        generation = json.loads(source.read_text(encoding="utf-8"))
    if stop_ids:
        generation["eos_token_id"] = stop_ids if len(stop_ids) > 1 else stop_ids[0]
    for key in ("bos_token_id", "pad_token_id"):
        value = getattr(tokenizer, key, None)
        if value is not None:
            generation.setdefault(key, int(value))
    text = json.dumps(generation, indent=2, sort_keys=True) + "\n"
    (dest / "generation_config.json").write_text(text, encoding="utf-8")


def _move_into_place(partial: Path, out: Path) -> None:
    """Rename the finished export to ``out`` (replacing an existing directory there)."""
    if not out.exists():
        partial.rename(out)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    out.rename(old)
    partial.rename(out)
    shutil.rmtree(old)


def _format_metrics(record: dict[str, Any]) -> str:
    rows = ["| metric | value |", "|---|---|"]
    for key, value in record.items():
        if isinstance(value, float):
            value = f"{value:.6g}"
        if isinstance(value, (int, float, str)):
            rows.append(f"| `{key}` | {value} |")
    return "\n".join(rows)


def _weights_description(
    found: TrainedModel, layout: dict[str, Any], config: dict[str, Any]
) -> tuple[str, str]:
    """The model card's two halves of its weights line: what was trained (all weights, LoRA
    fused or as adapters) and how they are stored (dtypes, quantization)."""
    lora = layout["lora"]
    if lora is None:
        weights_kind = "all weights trained" if found.run_config else "the weights as found"
    elif layout["fused"]:
        weights_kind = f"LoRA (r={lora.r}, alpha={lora.alpha:g}), fused into the weights"
    else:
        weights_kind = (
            f"LoRA (r={lora.r}, alpha={lora.alpha:g}), adapters in `{EXPORTED_ADAPTERS_DIR}/` "
            "(the weights here are the base model's)"
        )
    if layout["quantized"]:
        q = config.get("quantization", {})
        storage = f"quantized ({q.get('bits', '?')}-bit, group size {q.get('group_size', '?')})"
        if layout["fused"]:
            storage += "; fused weights re-quantized (use --dequantize for exact float weights)"
    else:
        storage = ", ".join(layout["dtypes"]) or "float"
        if layout["dequantized"]:
            storage += " (dequantized from a quantized model)"
    return weights_kind, storage


def _loading_lines(layout: dict[str, Any], out: Path, model_type: str | None) -> list[str]:
    """The model card's note on who reads the weights: mlx-lm only (quantized, or names that
    are not transformers'), else transformers too, with its snippet."""
    if layout["quantized"]:
        return [
            "The weights are in mlx-lm's quantized format: mlx-lm reads them, transformers does "
            "not (export again with `--dequantize` for float weights).",
            "",
        ]
    if model_type not in TRANSFORMERS_LAYOUT:
        return [
            f"The weights are stored under mlx-lm's names for `{model_type}`, which need not be "
            "transformers' (GPT-2's are not): use mlx-lm. transformers is known to read float "
            f"exports of {', '.join(TRANSFORMERS_LAYOUT)} models.",
            "",
        ]
    lines = []
    if layout["adapters"]:
        lines += [
            "transformers reads the base model only (the adapters are in mlx-lm's format): "
            "export with `--fuse` for a transformers-ready model.",
            "",
        ]
    return lines + [
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'tokenizer = AutoTokenizer.from_pretrained("{out}")',
        f'model = AutoModelForCausalLM.from_pretrained("{out}")',
        'ids = tokenizer("Hello", return_tensors="pt").input_ids',
        "print(tokenizer.decode(model.generate(ids, max_new_tokens=32)[0]))",
        "```",
        "",
    ]


def _write_model_card(
    path: Path, found: TrainedModel, out: Path, layout: dict[str, Any], *, config_of: Path
) -> None:
    """README.md: what the model is, how it was trained, its final metrics, how to use it."""
    config = json.loads((config_of / "config.json").read_text(encoding="utf-8"))
    architecture = (config.get("architectures") or [config.get("model_type", "?")])[0]
    name = out.name
    weights_kind, storage = _weights_description(found, layout, config)
    stops = ", ".join(f"{i} (`{t}`)" for i, t in zip(layout["stop_ids"], layout["stop_tokens"]))
    base = found.base_model if found.kind != "model" else None
    if base is None and found.run_config:
        base = str(found.run_config.get("model_name"))
    algorithm = found.algorithm
    lines = [
        f"# {name}",
        "",
        f"A {architecture} exported by ppo-mlx (`python main.py export`) from `{found.path}`.",
        "",
        f"- **Base model:** `{base}`" if base else "- **Base model:** not recorded",
        f"- **Training:** {_training(algorithm)}",
        f"- **Weights:** {weights_kind}; {storage}",
        f"- **Stops at token ids:** {stops or 'none recorded'}",
        f"- **Chat template:** {'yes' if layout['chat_template'] else 'no'}",
        "",
        "## Use it",
        "",
        "```bash",
    ]
    adapter_flag = f" --adapter-path {out}/{EXPORTED_ADAPTERS_DIR}" if layout["adapters"] else ""
    lines += [
        f'mlx_lm.generate --model {out}{adapter_flag} --prompt "Hello"',
        f"python main.py chat --model {out}       # or: ppo-mlx chat --model {out}",
        f'python main.py generate --model {out} --prompt "Hello"',
        "```",
        "",
    ]
    lines += _loading_lines(layout, out, config.get("model_type"))
    if found.run_config is not None:
        lines += [
            "## Training",
            "",
            f"Run: `{found.run_dir}`" if found.run_dir else f"Checkpoint: `{found.path}`",
            "",
            "```yaml",
            yaml.safe_dump(found.run_config, sort_keys=False, default_flow_style=False).rstrip(),
            "```",
            "",
        ]
    if found.final_metrics:
        step = found.final_metrics.get("step")
        lines += [f"## Final metrics (step {step})", "", _format_metrics(found.final_metrics), ""]
    if found.eval_results:
        lines += ["## Evaluation", "", _format_metrics(found.eval_results), ""]
    path.write_text("\n".join(lines), encoding="utf-8")
