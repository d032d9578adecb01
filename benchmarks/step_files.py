"""Which library files and functions one RL step enters: a trace of ``PPOTrainer.step`` on the
embedded tiny model, after a first step (so that one-time work, such as building the
optimisers, is not counted).

Usage::

    python -m benchmarks.step_files                 # PPO
    python -m benchmarks.step_files --algorithm grpo --list

It prints, per folder of the package, the files the step called into and how many of their
functions, then the totals; ``--list`` names the functions. A reader who follows one step reads
these files; the count says how far a step's path is spread.
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a script: MLX's fast BLAS before anything imports mlx
    from base_setup import setup_blas

    setup_blas()

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: Not the library: this script's reward, the tests, virtual environments in the repository.
NOT_LIBRARY = frozenset({"benchmarks", "tests", ".venv", ".venv-dev"})


def traced_step(algorithm: str) -> dict[str, set[str]]:
    """``{file relative to the repository: the functions one step called in it}``."""
    from config.ppo_config import PPOConfig
    from fixtures.tiny_corpus import review_prompts
    from fixtures.tiny_model import build_tiny_checkpoint
    from ppo_trainer.ppo_trainer import PPOTrainer

    def e_rate(prompts: list[str], completions: list[str]) -> list[float]:
        return [c.count("e") / max(len(c), 1) for c in completions]

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_checkpoint(Path(tmp) / "model", size="test", seed=0)
        grouped: dict[str, Any] = {"group_size": 4} if algorithm != "ppo" else {}
        config = PPOConfig(
            model_name=str(model),
            algorithm=algorithm,
            max_new_tokens=8,
            batch_size=4,
            output_dir=str(Path(tmp) / "run"),
            progress_bar=False,
            seed=0,
            **grouped,
        )
        trainer = PPOTrainer(config, reward_model=e_rate)
        prompts = review_prompts(8, seed=0)
        trainer.step(prompts[:4])
        entered: dict[str, set[str]] = defaultdict(set)
        root = str(ROOT) + "/"

        def profile(frame: FrameType, event: str, arg: Any) -> None:
            name = frame.f_code.co_filename
            if event == "call" and name.startswith(root):
                path = name[len(root) :]
                if path.split("/")[0] not in NOT_LIBRARY:
                    entered[path].add(frame.f_code.co_name)

        sys.setprofile(profile)
        try:
            trainer.step(prompts[4:])
        finally:
            sys.setprofile(None)
    return dict(entered)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", default="ppo")
    parser.add_argument("--list", action="store_true", help="name each file's functions")
    args = parser.parse_args()
    entered = traced_step(args.algorithm)
    by_folder: dict[str, list[str]] = defaultdict(list)
    for path in sorted(entered):
        by_folder[path.split("/")[0]].append(path)
    for folder, paths in by_folder.items():
        functions = sum(len(entered[p]) for p in paths)
        print(f"{folder + '/':20s} {len(paths):3d} files {functions:4d} functions")
        if args.list:
            for path in paths:
                print(f"    {path}: {', '.join(sorted(entered[path]))}")
    total = sum(len(f) for f in entered.values())
    print(f"{'one ' + args.algorithm + ' step':20s} {len(entered):3d} files {total:4d} functions")


if __name__ == "__main__":
    main()
