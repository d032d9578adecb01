"""Mutation testing of the RL math and its glue with mutmut, one source file at a time.

Each target file is mutated in a scratch copy of the working tree (``--workdir``, default
``/tmp/ppo-mlx-mutation/<file>``), against the FAST tests of its room only (``TARGETS``), so
a run stays small on a shared machine. mutmut runs each mutant's covering tests in a child forked
from a server that has only collected the tests (``forkserver_warmup = "collect"``): MLX and
BLAS thread pools do not survive a fork, so forking from a process that has already run MLX
code (mutmut's default) hangs the children, and their timeouts would pass for kills.
``MUTATION_WARMUP=none`` imports nothing before the fork (slower, for a doubt about that).

    python mutation/run.py                              # every target, one after the other
    python mutation/run.py ppo_trainer/experience.py    # one file
    python mutation/run.py --list                       # the targets and their tests
    python mutation/run.py training/policy_loss.py \\
        --mutants 'training.policy_loss.x_entropy_bonus__mutmut_*'   # some mutants (globs)

Prints, per file, the mutants killed, survived and timed out, then each survivor's diff (a
survivor listed in ``mutation/equivalent.txt`` is reported as equivalent, with its reason).
Exit status 1 when a non-equivalent mutant survives. docs/mutation.md records the last scores.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: file to mutate -> the fast tests that guard it (mutmut runs, per mutant, those that cover it).
TARGETS: dict[str, list[str]] = {
    "ppo_trainer/experience.py": ["tests/test_experience.py", "tests/test_agent_math.py"],
    "ppo_trainer/update.py": ["tests/test_update.py", "tests/test_reasoning_losses.py"],
    "ppo_trainer/sft_mix.py": ["tests/test_reasoning_losses.py"],
    "training/policy_loss.py": [
        "tests/test_training_losses.py",
        "tests/test_update.py",
        "tests/test_reasoning_losses.py",
    ],
    "training/value_loss.py": ["tests/test_training_losses.py", "tests/test_update.py"],
    "reward_kl/kl_divergence.py": ["tests/test_reward_kl.py"],
    "reward_kl/reward_computer.py": [
        "tests/test_reward_kl.py",
        "tests/test_experience.py",
        "tests/test_agent_math.py",
    ],
    "reward_kl/combined_reward.py": ["tests/test_reward_kl.py"],
    "advantage/gae_advantage.py": ["tests/test_advantage.py"],
    "advantage/group_advantage.py": ["tests/test_advantage.py", "tests/test_experience.py"],
    "advantage/reinforce_pp.py": ["tests/test_advantage.py", "tests/test_experience.py"],
    "advantage/reward_to_go.py": ["tests/test_advantage.py"],
    "advantage/td_error.py": ["tests/test_advantage.py"],
    "advantage/whitening.py": ["tests/test_advantage.py", "tests/test_experience.py"],
    **{
        f"algorithms/{name}.py": [
            "tests/test_algorithms.py",
            "tests/test_experience.py",
            "tests/test_config.py",
        ]
        for name in ("ppo", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "registry")
    },
    "token_attribution/extractor.py": ["tests/test_token_attribution.py"],
    "token_attribution/logprob_computer.py": ["tests/test_token_attribution.py"],
    "token_attribution/sequences.py": ["tests/test_token_attribution.py"],
    "token_attribution/head_logprobs.py": ["tests/test_token_attribution.py"],
    "token_attribution/token_weights.py": ["tests/test_reasoning_losses.py"],
    "agents/tool_calls.py": ["tests/test_agents.py"],
    "agents/execution.py": ["tests/test_agents.py"],
    "agents/episode.py": ["tests/test_agents.py"],
    "agents/rendering.py": ["tests/test_agents.py"],  # not run yet
}

#: Every top-level package and module the tests import (copied unmutated beside the target).
PACKAGES = [
    "config", "base_setup", "models", "fixtures", "token_attribution", "reward_kl",
    "advantage", "experience_buffer", "training", "finetune", "ppo_trainer", "sandbox",
    "agents", "examples", "main.py",
]  # fmt: skip

EQUIVALENT = Path(__file__).with_name("equivalent.txt")


def equivalent_mutants() -> dict[str, str]:
    """``mutant name -> one-line reason`` from ``equivalent.txt`` (``name: reason`` lines)."""
    out: dict[str, str] = {}
    if EQUIVALENT.exists():
        for line in EQUIVALENT.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                name, _, reason = line.partition(":")
                out[name.strip()] = reason.strip()
    return out


def scratch_copy(workdir: Path, target: str, tests: list[str], warmup: str) -> None:
    """The working tree's files (tracked and untracked, not ignored) under ``workdir``, with
    mutmut's configuration for ``target`` appended to its pyproject.toml."""
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT, check=True, capture_output=True,
    ).stdout.split(b"\0")  # fmt: skip
    for name in filter(None, files):
        source = ROOT / name.decode()
        if source.is_file():
            dest = workdir / name.decode()
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest)
    also = [p if p.endswith(".py") else p + "/" for p in PACKAGES]
    config = f"""

[tool.mutmut]
source_paths = ["{target}"]
also_copy = {also!r}
pytest_add_cli_args_test_selection = {tests!r}
pytest_add_cli_args = ["-p", "no:cacheprovider", "-q", "-x", "-m", "not slow"]
process_isolation = "forkserver"
forkserver_warmup = "{warmup}"
use_git_change_detection = false
"""
    with open(workdir / "pyproject.toml", "a") as f:
        f.write(config.replace("'", '"'))


def run_target(
    target: str, workdir: Path, max_children: int, limit: float, mutants: list[str]
) -> dict[str, list[str]]:
    """Mutate ``target`` (only the ``mutants`` named, globs allowed, when given); returns
    ``status -> mutant names``."""
    # mutmut 3.8.1 fails its clean run of a selection of tests after a "collect" warm-up.
    warmup = os.environ.get("MUTATION_WARMUP", "none" if mutants else "collect")
    scratch_copy(workdir, target, TARGETS[target], warmup)
    start = time.monotonic()
    try:
        subprocess.run(
            ["mutmut", "run", "--max-children", str(max_children), *mutants],
            cwd=workdir, timeout=limit, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        print(f"{target}: stopped after {limit:.0f} s (--limit); the results are partial")
    print(f"{target}: mutmut ran {time.monotonic() - start:.0f} s")
    listing = subprocess.run(
        ["mutmut", "results", "--all", "true"], cwd=workdir, capture_output=True, text=True
    ).stdout
    by_status: dict[str, list[str]] = {}
    for match in re.finditer(r"^\s*(\S+__mutmut_\d+): (.+)$", listing, re.M):
        by_status.setdefault(match.group(2).strip(), []).append(match.group(1))
    return by_status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("targets", nargs="*", help="files to mutate (default: every target)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ppo-mlx-mutation"))
    parser.add_argument("--max-children", type=int, default=1, help="mutants run at once")
    parser.add_argument("--limit", type=float, default=1800.0, help="seconds per file at most")
    parser.add_argument("--list", action="store_true", help="print the targets and exit")
    parser.add_argument(
        "--mutants", nargs="+", default=[], help="only these mutant names (globs), one target"
    )
    args = parser.parse_args()
    if args.list:
        for target, tests in TARGETS.items():
            print(f"{target}: {' '.join(tests)}")
        return 0
    unknown = [t for t in args.targets if t not in TARGETS]
    if unknown:
        parser.error(f"not a target: {unknown}; see --list")
    if args.mutants and len(args.targets) != 1:
        parser.error("--mutants needs exactly one target file")
    equivalent = equivalent_mutants()
    failed = False
    for target in args.targets or list(TARGETS):
        workdir = args.workdir / target.replace("/", "__")
        by_status = run_target(target, workdir, args.max_children, args.limit, args.mutants)
        survived = by_status.get("survived", [])
        real = [m for m in survived if m not in equivalent]
        total = sum(len(v) for v in by_status.values())
        counts = ", ".join(f"{k} {len(v)}" for k, v in sorted(by_status.items()))
        print(f"{target}: {total} mutants: {counts}; {len(survived) - len(real)} equivalent")
        for name in survived:
            if name in equivalent:
                print(f"  equivalent {name}: {equivalent[name]}")
                continue
            diff = subprocess.run(
                ["mutmut", "show", name], cwd=workdir, capture_output=True, text=True
            ).stdout
            changed = [line for line in diff.splitlines() if line[:2] in ("- ", "+ ")]
            print(f"  SURVIVED {name}\n" + "\n".join(f"    {line}" for line in changed))
        failed = failed or bool(real)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
