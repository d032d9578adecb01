"""Run one throughput measurement in this process: ``python -m benchmarks.throughput_worker
SPEC.json RESULT.json`` (what ``benchmarks.ppo_throughput`` starts for every configuration).

A separate module, so that a TRL worker neither imports MLX nor loads MLX's BLAS (this one imports
only the standard library, ``sandbox.launcher``'s libc calls (standard library only) and the worker
of the spec's system, after ``setup_blas`` for an MLX system).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from benchmarks.throughput_spec import RunResult, RunSpec

#: The benchmark's process id, which it gives each worker it starts (:func:`end_with_parent`).
PARENT_ENV = "PPO_MLX_BENCH_PARENT"


def end_with_parent() -> None:
    """On Linux, have the kernel kill this worker (SIGKILL) when the benchmark process named by
    :data:`PARENT_ENV` ends, killed or not (the sandbox launcher's ``PR_SET_PDEATHSIG``): a
    worker left behind would keep the cores busy under the next measurement. Without the
    variable (a worker started by hand), or off Linux, nothing.

    Raises:
        SystemExit: the benchmark had already ended when this worker started.
    """
    parent = os.environ.get(PARENT_ENV)
    if parent is None or not sys.platform.startswith("linux"):
        return
    from sandbox.launcher import Libc

    Libc().die_with_parent()
    if os.getppid() != int(parent):  # it ended before the prctl: no signal will come
        raise SystemExit(f"the benchmark that started this worker (process {parent}) has ended")


#: MLX's switch between TF32 and full float32 matrix products on CUDA (read once, at first use).
MLX_TF32_ENV = "MLX_ENABLE_TF32"
#: What is wrong, and the fix, where ``--device gpu`` meets an MLX without a GPU device (said by
#: the benchmark before it builds anything, and by a worker started by hand).
NO_MLX_GPU = (
    "this MLX has no GPU device (a CPU-only wheel, or no GPU here); on Linux with CUDA, pip "
    'uninstall -y mlx-cpu && pip install "mlx[cuda13]" (or "mlx[cuda12]")'
)


def use_mlx_device(spec: RunSpec) -> None:
    """Make the spec's device MLX's default in this process (MLX's CPU device, or its GPU, with
    the spec's TF32 setting), before any array is made.

    Raises:
        RuntimeError: the spec asks for the GPU and this MLX has none (the CPU or a CPU-only
            wheel: :data:`NO_MLX_GPU` says how to give MLX its CUDA backend).
    """
    if spec.device == "gpu":
        os.environ[MLX_TF32_ENV] = "1" if spec.tf32 else "0"
    import mlx.core as mx

    if spec.device == "cpu":
        mx.set_default_device(mx.cpu)
        return
    if not mx.is_available(mx.gpu):
        raise RuntimeError(f"--device gpu: {NO_MLX_GPU}")
    mx.set_default_device(mx.gpu)


def run_spec(spec: RunSpec) -> RunResult:
    """Measure ``spec`` on its system, in this process."""
    if spec.system != "trl":  # an MLX system: the fast BLAS before its module imports mlx
        from base_setup import setup_blas

        setup_blas()
        use_mlx_device(spec)
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
    end_with_parent()
    spec = RunSpec.from_json(Path(argv[0]).read_text(encoding="utf-8"))
    run_spec(spec).save(Path(argv[1]))


if __name__ == "__main__":
    main(sys.argv[1:])
