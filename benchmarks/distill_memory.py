"""Memory of on-policy distillation at real shapes: a Qwen3-1.7B teacher and a Qwen3-0.6B LoRA
student (random weights, the published configs' sizes, vocabulary 151,936 included).

Usage::

    python -m benchmarks.distill_memory                  # every mode, 4 prompts x 64 tokens
    python -m benchmarks.distill_memory --modes student teacher-4bit --new-tokens 128

Each mode runs in a subprocess of its own, so each peak is measured alone: it builds the
trainer of ``python main.py distill`` (``algorithm: distill``, LoRA r16 on the student, gradient
checkpointing) and runs one step (the student samples, the teacher scores every token, one
update). The modes:

* ``student``: the student alone, the same step without a teacher (GRPO with ``beta: 0`` and a
  length reward): what the student itself costs;
* ``teacher-4bit``: the teacher as mlx-lm's 4-bit copy (group size 64), the student float32;
* ``teacher-float32``: the teacher float32 beside the float32 student;
* ``gkd-float32``: the same pair with GKD's loss (``algorithm: gkd``, ``lmbda: 1``: the
  student's samples; the generalized JSD over the whole vocabulary, the teacher's pass inside
  the update);
* ``bfloat16``: teacher and student in bfloat16 (``dtype: bfloat16``, which applies to every
  model of a run).

It prints, per mode, MLX's allocator figures (``mx.get_active_memory`` once the trainer is
built, ``mx.get_peak_memory`` over the whole run: load, sampling, the teacher's pass and the
update), the process's peak resident memory, and the step's seconds, then each mode's peak as a
ratio of the student's alone, measured in the same run.
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a script: MLX's fast BLAS before anything imports mlx
    from base_setup import setup_blas

    setup_blas()

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from benchmarks.ppo_throughput import MODEL_SHAPES
from benchmarks.throughput_spec import peak_rss_mb
from benchmarks.throughput_models import RealShape, benchmark_prompts, build_real_checkpoint

#: Qwen/Qwen3-0.6B's sizes, the student.
QWEN3_0_6B = cast(RealShape, MODEL_SHAPES["qwen3-0.6b"])

#: Qwen/Qwen3-1.7B's config.json sizes (its other settings are Qwen3-0.6B's).
QWEN3_1_7B = replace(
    QWEN3_0_6B,
    source="Qwen/Qwen3-1.7B",
    hidden_size=2048,
    intermediate_size=6144,
)
MODES = ("student", "teacher-4bit", "teacher-float32", "gkd-float32", "bfloat16")


def _length_reward(prompts: list[str], completions: list[str]) -> list[float]:
    """The student-alone mode's reward (any reward: only the memory is measured)."""
    return [float(len(c)) for c in completions]


def _worker(mode: str, dirs: dict[str, str], batch: int, new_tokens: int) -> dict[str, Any]:
    """Build the mode's trainer, run one step, return its memory figures and seconds."""
    import mlx.core as mx

    from config.ppo_config import PPOConfig
    from ppo_trainer.ppo_trainer import PPOTrainer

    settings: dict[str, Any] = dict(
        model_name=dirs["student"],
        use_lora=True,
        lora_r=16,
        lora_alpha=32.0,
        batch_size=batch,
        max_new_tokens=new_tokens,
        gradient_checkpointing=True,
        output_dir=dirs["run"],
        progress_bar=False,
        seed=0,
    )
    if mode == "student":
        settings.update(algorithm="grpo", group_size=batch, batch_size=1, beta=0.0)
    else:
        teacher = dirs["teacher_q4"] if mode == "teacher-4bit" else dirs["teacher"]
        algorithm = "gkd" if mode == "gkd-float32" else "distill"
        settings.update(algorithm=algorithm, teacher_model_name=teacher)
        if algorithm == "gkd":
            settings.update(lmbda=1.0)
        if mode == "bfloat16":
            settings.update(dtype="bfloat16")
    config = PPOConfig(**settings)
    mx.reset_peak_memory()
    trainer = PPOTrainer(config, reward_model=_length_reward if mode == "student" else None)
    built = mx.get_active_memory()
    prompts = benchmark_prompts(Path(dirs["student"]), config.batch_size, seed=0)
    start = time.perf_counter()
    metrics = trainer.step(prompts)
    seconds = time.perf_counter() - start
    return {
        "built_gb": built / 1e9,
        "peak_gb": mx.get_peak_memory() / 1e9,
        "max_rss_gb": peak_rss_mb() * 2**20 / 1e9,  # VmHWM: not the parent's peak
        "step_seconds": seconds,
        "kl": metrics.get("objective/kl", float("nan")),
    }


def _run_mode(mode: str, dirs: dict[str, str], batch: int, new_tokens: int) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.distill_memory",
        "--worker",
        mode,
        json.dumps(dirs),
        "--batch",
        str(batch),
        "--new-tokens",
        str(new_tokens),
    ]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def build_pair(work: Path) -> dict[str, str]:
    """The student (Qwen3-0.6B's shape), the teacher (Qwen3-1.7B's, the same tokenizer) and the
    teacher's 4-bit copy, float32 random weights, in ``work`` (kept from an earlier run there)."""
    from fixtures.checkpoint_families import quantize_checkpoint

    def build(name: str, shape: RealShape) -> Path:
        out = work / name
        if (out / "model.safetensors").is_file():  # a --workdir of an earlier run: kept
            return out
        return build_real_checkpoint(out, shape, seed=0)  # seed 0 both: the same tokenizer

    student, teacher = build("student", QWEN3_0_6B), build("teacher", QWEN3_1_7B)
    teacher_q4 = quantize_checkpoint(teacher, work / "teacher_q4", bits=4, group_size=64)
    return {"student": str(student), "teacher": str(teacher), "teacher_q4": str(teacher_q4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--batch", type=int, default=4, help="prompts (one sample each)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--workdir", help="keep the checkpoints here (default: a temporary one)")
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "DIRS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        mode, dirs = args.worker[0], json.loads(args.worker[1])
        print(json.dumps(_worker(mode, dirs, args.batch, args.new_tokens)))
        return

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        dirs = build_pair(work)
        print(
            f"# {args.batch} prompts x {args.new_tokens} new tokens, LoRA r16 student, "
            "gradient checkpointing, one step"
        )
        print("| mode | built (GB) | peak (GB) | peak RSS (GB) | step (s) | peak / student |")
        print("|---|---|---|---|---|---|")
        results: dict[str, dict[str, Any]] = {}
        for mode in args.modes:
            run = work / f"run_{mode}"
            results[mode] = _run_mode(mode, {**dirs, "run": str(run)}, args.batch, args.new_tokens)
            r = results[mode]
            base = results.get("student")
            ratio = f"{r['peak_gb'] / base['peak_gb']:.2f}" if base else "-"
            print(
                f"| {mode} | {r['built_gb']:.2f} | {r['peak_gb']:.2f} | {r['max_rss_gb']:.2f} | "
                f"{r['step_seconds']:.1f} | {ratio} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
