"""Peak memory and seconds of the reward stage with LoRA on a 4-bit base (QLoRA reward models).

Usage::

    python -m benchmarks.qlora_reward                         # SmolLM2-135M's shape (~2 min)
    python -m benchmarks.qlora_reward --model qwen3-0.6b      # Qwen3-0.6B's shape (~6 min)

The reward stage (``finetune.reward_trainer.RewardTrainer``: Bradley-Terry loss on preference
pairs, ``--steps`` steps of ``--batch-size`` pairs) trains LoRA adapters (rank 16, alpha 32, every
linear layer of every block, as the throughput benchmark's real shapes) and the scalar head on a
random-weight checkpoint of a real shape (``benchmarks.ppo_throughput.MODEL_SHAPES``, plus
``qwen3-1.7b`` of ``benchmarks.shared_value``), three ways, each in its own fresh worker process
(its peak resident memory its own):

* ``float32 base``: the checkpoint as written (float32);
* ``4-bit, dequantized``: its mlx-lm 4-bit copy (group size 64), dequantized to float32 before
  the adapters are added (what the reward stage did before it kept a LoRA model's base
  quantized; a reward or value model that trains its backbone still does);
* ``4-bit, kept``: the same 4-bit copy, its layers left quantized (``use_lora: true`` now).

Prints, per way: the peak resident memory of the load and of the training (the kernel's
``VmHWM``, reset after loading on Linux), MLX's peak array memory, the model's weights, and the
median seconds of a training step after the first; and the kept 4-bit base's peak as a ratio of
the dequantized one's, measured in the same run.
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a script: MLX's fast BLAS before anything imports mlx
    from base_setup import setup_blas

    setup_blas()

import argparse
import json
import platform
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.ppo_throughput import REAL_LORA_ALPHA, REAL_LORA_MODULES, REAL_LORA_RANK
from benchmarks.shared_value import SHAPES
from benchmarks.throughput_models import RealShape, build_real_checkpoint
from benchmarks.throughput_spec import (
    load_average,
    parameters_mb,
    peak_rss_mb,
    reset_peak_rss,
    run_module_worker,
    write_worker_result,
)

#: The three ways, in the order they run: (label, which checkpoint, keep it quantized).
WAYS: tuple[tuple[str, str, bool], ...] = (
    ("float32 base", "float_dir", False),
    ("4-bit, dequantized", "q4_dir", False),
    ("4-bit, kept", "q4_dir", True),
)


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the LoRA reward model ``spec`` names and train it; peaks and step seconds."""
    import mlx.core as mx

    from base_setup.backend import run_scope
    from base_setup.lora_setup import LoraSettings, apply_lora, is_quantized_layer
    from config.reward_config import RewardConfig
    from finetune.reward_trainer import RewardTrainer
    from training.callbacks import TrainerCallback
    from fixtures.demo_data import preference_records
    from models.reward_model import RewardModel

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []

        def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
            self.seconds.append(float(metrics["time/step"]))

    with run_scope():
        model = RewardModel.from_causal_lm(
            spec["checkpoint"], head_init="normal", keep_quantized=spec["keep_quantized"]
        )
        model.lora = LoraSettings(
            r=REAL_LORA_RANK, alpha=REAL_LORA_ALPHA, dropout=0.0, keys=REAL_LORA_MODULES
        )
        apply_lora(model, model.lora)
        model.head.unfreeze()
        mx.eval(model.parameters())
        quantized = sum(is_quantized_layer(m) for _, m in model.named_modules())
        config = RewardConfig(
            model_name=spec["checkpoint"],
            output_dir=spec["output_dir"],
            overwrite_output_dir=True,
            use_lora=True,
            lora_r=REAL_LORA_RANK,
            lora_alpha=REAL_LORA_ALPHA,
            learning_rate=1e-4,
            batch_size=spec["batch_size"],
            total_steps=spec["steps"],
            eval_fraction=0.0,
            progress_bar=False,
        )
        trainer = RewardTrainer(config, model=model)
        load_peak = peak_rss_mb()
        reset = reset_peak_rss()
        mx.reset_peak_memory()
        times = StepTimes()
        trainer.train(preference_records(spec["batch_size"] * spec["steps"]), callbacks=[times])
        return {
            "load_peak_mb": load_peak,
            "train_peak_mb": peak_rss_mb() if reset else None,
            "mlx_peak_mb": mx.get_peak_memory() / 2**20,
            "weights_mb": parameters_mb(model.parameters()),
            "quantized_layers": quantized,
            "step_seconds": times.seconds,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        write_worker_result(worker(json.loads(args.worker.read_text(encoding="utf-8"))))
        return
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is not timed)")
    from fixtures.checkpoint_families import quantize_checkpoint

    shape = SHAPES[args.model]
    assert isinstance(shape, RealShape), f"{args.model} is not a real shape"
    print(
        f"reward stage, LoRA r={REAL_LORA_RANK} on every linear layer + head, {args.model}'s "
        f"shape, {args.steps} steps of {args.batch_size} pairs, {platform.machine()} CPU"
    )
    print(
        "base | train peak RSS MB | load peak RSS MB | MLX peak MB | weights MB | "
        "quantized layers | s/step (median after the first) | load avg"
    )
    peaks: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        dirs = {"float_dir": build_real_checkpoint(work / "float", shape)}
        dirs["q4_dir"] = quantize_checkpoint(dirs["float_dir"], work / "q4")
        for label, checkpoint, keep in WAYS:
            spec = {
                "checkpoint": str(dirs[checkpoint]),
                "keep_quantized": keep,
                "output_dir": str(work / "run"),
                "batch_size": args.batch_size,
                "steps": args.steps,
            }
            r = run_module_worker("benchmarks.qlora_reward", spec, work)
            train_peak = r["train_peak_mb"]
            peaks[label] = max(train_peak or 0.0, r["load_peak_mb"])
            print(
                f"{label} | {'-' if train_peak is None else f'{train_peak:.0f}'} | "
                f"{r['load_peak_mb']:.0f} | {r['mlx_peak_mb']:.0f} | {r['weights_mb']:.0f} | "
                f"{r['quantized_layers']} | {statistics.median(r['step_seconds'][1:]):.2f} | "
                f"{load_average()}",
                flush=True,
            )
    ratio = peaks["4-bit, kept"] / peaks["4-bit, dequantized"]
    print(f"peak (load and training) of the kept 4-bit base / the dequantized one: {ratio:.2f}")


if __name__ == "__main__":
    main()
