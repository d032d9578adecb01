"""Per-candidate time of sandboxed scoring: the bundled code tasks' reference solutions, scored
one sandbox at a time (``max_workers=1``), so each figure is one program's whole round trip
(launch, isolation set-up, running its tests, judging, cleanup). Two figures per candidate: wall
time, and CPU time (this process and every sandbox process it reaped, user + system), which
other processes on a busy machine disturb far less.

Usage::

    python -m benchmarks.sandbox_scoring               # 3 rounds over the 32 bundled tasks
    python -m benchmarks.sandbox_scoring --rounds 5

To compare two checkouts on the same machine, run this file from one checkout with the other on
``PYTHONPATH`` (``PYTHONPATH=/path/to/other python /this/checkout/benchmarks/sandbox_scoring.py``):
it imports whichever ``sandbox`` package comes first on the path and prints where it came from.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import sandbox
from sandbox import SandboxLimits, detect_isolation, score_completions

TASKS = Path(__file__).resolve().parents[1] / "examples" / "data" / "code_tasks.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="passes over the tasks")
    args = parser.parse_args()
    records = [json.loads(line) for line in TASKS.read_text().splitlines() if line.strip()]
    codes = [r["prompt"] + r["solution"] for r in records]
    tests = [r["tests"] for r in records]
    print(f"sandbox package: {Path(sandbox.__file__).parent}")
    started = time.perf_counter()
    isolation = detect_isolation()
    print(f"isolation: {isolation.describe()} (detected in {time.perf_counter() - started:.2f} s)")
    limits = SandboxLimits()
    score_completions(codes[:2], tests[:2], limits, max_workers=1)  # warm-up
    wall, cpu = [], []
    for _ in range(args.rounds):
        started, cpu_started = time.perf_counter(), _cpu_seconds()
        scores = score_completions(codes, tests, limits, max_workers=1)
        wall.append((time.perf_counter() - started) / len(codes) * 1000)
        cpu.append((_cpu_seconds() - cpu_started) / len(codes) * 1000)
        if min(scores) < 1.0:
            raise SystemExit(f"a reference solution did not score 1.0: {scores}")
    for name, values in (("wall", wall), ("CPU", cpu)):
        print(
            f"{len(codes)} candidates x {args.rounds} rounds, {name} time per candidate: "
            f"median {statistics.median(values):.1f} ms, min {min(values):.1f} ms, "
            f"max {max(values):.1f} ms"
        )


def _cpu_seconds() -> float:
    """User + system CPU of this process and of every child process it (or they) waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


if __name__ == "__main__":
    main()
