"""A PPO iteration on a machine that other processes keep busy: adaptive BLAS threads on and off.

Usage::

    python -m benchmarks.contention               # 0, 1 and 2 busy processes (about 5 min on 2 cores)
    python -m benchmarks.contention --busy 0 2    # chosen counts

OpenBLAS's threads wait for each other by spinning, so when other processes hold the cores a
multi-threaded matmul waits for a descheduled thread, once per matmul.
:func:`base_setup.backend.adapt_blas_threads` (with ``PPO_MLX_ADAPTIVE_BLAS=step``, at every
trainer step) gives OpenBLAS only the cores the others leave free; the trainers' default does the
same once per run. This script times the throughput benchmark's tiny PPO configuration (16
prompts x 32 new tokens, a fresh worker process per measurement, calling ``trainer.step``) while
``N`` busy processes run (each a Python loop that keeps one core busy), with
``PPO_MLX_ADAPTIVE_BLAS=step`` and ``=off`` (OpenBLAS keeps every thread), and prints the median
seconds per iteration and their ratio. The first two iterations are not timed: the
trainer's first step only takes the first load sample.
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a script: MLX's fast BLAS before anything imports mlx
    from base_setup import setup_blas

    setup_blas()

import argparse
import multiprocessing
import os
import tempfile
import time
from pathlib import Path
from typing import Sequence

from benchmarks.ppo_throughput import MODEL_SHAPES, cpu_threads, run_spec
from benchmarks.throughput_spec import RunResult, RunSpec


def _spin() -> None:
    """Keep one core busy until terminated."""
    while True:
        pass


def measure(spec: RunSpec, busy: int, adaptive: bool, log_dir: Path) -> RunResult:
    """``spec`` in a fresh worker while ``busy`` spinning processes run."""
    hogs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(busy)]
    for hog in hogs:
        hog.start()
    previous = os.environ.get("PPO_MLX_ADAPTIVE_BLAS")
    os.environ["PPO_MLX_ADAPTIVE_BLAS"] = "step" if adaptive else "off"
    try:
        time.sleep(0.5 if busy else 0.0)
        return run_spec(spec, isolate=True, log_dir=log_dir)
    finally:
        if previous is None:
            os.environ.pop("PPO_MLX_ADAPTIVE_BLAS")
        else:
            os.environ["PPO_MLX_ADAPTIVE_BLAS"] = previous
        for hog in hogs:
            hog.terminate()
        for hog in hogs:
            hog.join()


def main(argv: Sequence[str] | None = None) -> list[tuple[int, float, float]]:
    """Run the measurements, print the table; returns ``(busy, adaptive s, fixed s)`` rows."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--busy", type=int, nargs="+", default=[0, 1, 2], help="numbers of busy processes"
    )
    parser.add_argument("--iterations", type=int, default=3, help="timed iterations")
    args = parser.parse_args(argv)
    if any(n < 0 for n in args.busy) or args.iterations < 1:
        parser.error("--busy counts must be >= 0 and --iterations >= 1")
    from benchmarks.throughput_models import benchmark_prompts, build_benchmark_checkpoints

    rows: list[tuple[int, float, float]] = []
    with tempfile.TemporaryDirectory(prefix="contention_") as tmp:
        work = Path(tmp)
        policy_dir, reward_dir = build_benchmark_checkpoints(work / "tiny", MODEL_SHAPES["tiny"])
        spec = RunSpec(
            system="mlx",
            algorithm="ppo",
            label="tiny",
            model="tiny",
            policy_dir=str(policy_dir),
            reward_dir=str(reward_dir),
            prompts=tuple(benchmark_prompts(policy_dir, 16)),
            batch_size=16,
            group_size=1,
            max_new_tokens=32,
            warmup=2,
            iterations=args.iterations,
            threads=cpu_threads(),
        )
        print(f"tiny PPO (16 x 32 new tokens) on {cpu_threads()} cores")
        head = f"{'busy processes':>14} {'adaptive s':>11} {'fixed s':>9} {'fixed/adaptive':>15}"
        print(head + "\n" + "-" * len(head), flush=True)
        for busy in args.busy:
            adaptive = measure(spec, busy, True, work).median
            fixed = measure(spec, busy, False, work).median
            rows.append((busy, adaptive, fixed))
            print(
                f"{busy:>14} {adaptive:>11.3f} {fixed:>9.3f} {fixed / adaptive:>15.2f}", flush=True
            )
    return rows


if __name__ == "__main__":
    main()
