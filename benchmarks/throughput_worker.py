"""Run one throughput measurement in this process: ``python -m benchmarks.throughput_worker
SPEC.json RESULT.json`` (what ``benchmarks.ppo_throughput`` starts for every configuration).

A separate module, so that a TRL worker neither imports MLX nor loads MLX's BLAS (this one imports
only the standard library and the worker of the spec's system, after ``setup_blas`` for an MLX
system).
"""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.throughput_spec import RunResult, RunSpec


def run_spec(spec: RunSpec) -> RunResult:
    """Measure ``spec`` on its system, in this process."""
    if spec.system != "trl":  # an MLX system: the fast BLAS before its module imports mlx
        from base_setup import setup_blas

        setup_blas()
    if spec.system == "mlx":
        from benchmarks.throughput_mlx import run_mlx

        return run_mlx(spec)
    if spec.system == "trl":
        from benchmarks.throughput_trl import run_trl

        return run_trl(spec)
    if spec.system == "mlx-lm-lora":
        from benchmarks.throughput_mlx_lm_lora import run_mlx_lm_lora

        return run_mlx_lm_lora(spec)
    if spec.system == "textpolicy":
        from benchmarks.throughput_textpolicy import run_textpolicy

        return run_textpolicy(spec)
    raise ValueError(
        f"unknown system {spec.system!r}; use 'mlx', 'trl', 'mlx-lm-lora' or 'textpolicy'"
    )


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise SystemExit("usage: python -m benchmarks.throughput_worker SPEC.json RESULT.json")
    spec = RunSpec.from_json(Path(argv[0]).read_text(encoding="utf-8"))
    run_spec(spec).save(Path(argv[1]))


if __name__ == "__main__":
    main(sys.argv[1:])
