"""Per-candidate time of sandboxed scoring: the bundled code tasks' reference solutions, each run
in its own sandbox (:func:`sandbox.run_tests`), so each figure is one program's whole round trip
(launch, isolation set-up, running its tests, judging, cleanup). Two figures per candidate: wall
time, and CPU time (this process and every sandbox process it reaped, user + system), which other
processes on a busy machine disturb less.

Usage::

    python -m benchmarks.sandbox_scoring                          # 3 rounds over the 32 tasks
    python -m benchmarks.sandbox_scoring --baseline /path/to/other/checkout

``--baseline`` times another checkout's ``sandbox/`` in the same process, candidate by candidate
in alternation with this one (the order flips every round), so that both see the same load; its
package is copied to a temporary directory as ``sandbox_baseline``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import sandbox

TASKS = Path(__file__).resolve().parents[1] / "examples" / "data" / "code_tasks.jsonl"


def load_baseline(checkout: Path, into: Path) -> ModuleType:
    """``checkout/sandbox`` imported as ``sandbox_baseline`` (a copy under ``into``)."""
    target = into / "sandbox_baseline"
    shutil.copytree(checkout / "sandbox", target)
    for path in target.glob("*.py"):
        text = path.read_text()
        text = re.sub(r"^(\s*)(from|import) sandbox\b", r"\1\2 sandbox_baseline", text, flags=re.M)
        path.write_text(text)
    sys.path.insert(0, str(into))
    return importlib.import_module("sandbox_baseline")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="passes over the tasks")
    parser.add_argument("--baseline", type=Path, help="a checkout whose sandbox/ is compared")
    args = parser.parse_args()
    records = [json.loads(line) for line in TASKS.read_text().splitlines() if line.strip()]
    programs = [(r["prompt"] + r["solution"], r["tests"]) for r in records]
    packages = {"this": sandbox}
    with tempfile.TemporaryDirectory() as scratch:
        if args.baseline is not None:
            packages["baseline"] = load_baseline(args.baseline, Path(scratch))
        for name, package in packages.items():
            isolation = package.detect_isolation()
            print(f"{name}: {Path(str(package.__file__)).parent}: {isolation.describe()}")
            package.run_tests(*programs[0], package.SandboxLimits())  # warm-up
        times: dict[str, dict[str, list[float]]] = {n: {"wall": [], "CPU": []} for n in packages}
        for round_ in range(args.rounds):
            order = list(packages) if round_ % 2 == 0 else list(reversed(packages))
            for code, tests in programs:
                for name in order:
                    _time_one(packages[name], code, tests, times[name])
    for name, figures in times.items():
        for kind, values in figures.items():
            print(
                f"{name}: {len(values)} runs, {kind} time per candidate: median "
                f"{statistics.median(values):.1f} ms, mean {statistics.fmean(values):.1f} ms"
            )


def _time_one(package: Any, code: str, tests: list[str], into: dict[str, list[float]]) -> None:
    wall, cpu = time.perf_counter(), _cpu_seconds()
    result = package.run_tests(code, tests, package.SandboxLimits())
    into["wall"].append((time.perf_counter() - wall) * 1000)
    into["CPU"].append((_cpu_seconds() - cpu) * 1000)
    if result.fraction < 1.0:
        raise SystemExit(f"a reference solution did not score 1.0: {result.detail}")


def _cpu_seconds() -> float:
    """User + system CPU of this process and of every child process it (or they) waited for."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


if __name__ == "__main__":
    main()
