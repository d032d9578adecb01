"""The first compiled training step on a machine with no MLX kernels cached, with and without
the precompiled header for MLX's kernel compiler (``base_setup/jit_header.py``).

Usage::

    python -m benchmarks.kernel_build                 # SmolLM2-135M-Instruct (~4 min)
    python -m benchmarks.kernel_build --model /path/to/checkpoint

Each case runs in a fresh process with a temporary folder of its own (``$TMPDIR``, where MLX
keeps its kernels), so nothing is cached from another case or an earlier run. The step is one
GRPO step (2 prompts x 2, 24 new tokens, LoRA, two updates) with the compiled training gradient,
as the real checkpoint's test takes it:

* ``cold``: no kernel and no header (``PPO_MLX_JIT_HEADER=0``): what a fresh machine paid
  before the header.
* ``cold + header``: no kernel; the header built first, in the process (its seconds printed
  apart: on a user's machine it builds in the background while the model loads).
* ``warm``: the second case's folder again, every kernel cached.

Prints each case's seconds for the step, the kernels g++ built during it, and the step's time
against ``cold``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # python benchmarks/kernel_build.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = ["Write one short sentence about the sea.", "Name a colour and say why you like it."]


def kernels(temp: Path) -> int:
    """The compiled kernels MLX keeps under ``temp``."""
    return len(list((temp / "mlx").glob("*/cpu/lib*.so")))


def worker(model: str, out_dir: str, header: bool) -> dict[str, float]:
    """One case in this process (its ``$TMPDIR`` set by the caller): the header first if
    ``header``, then one compiled GRPO step; seconds and kernels built."""
    from base_setup.jit_header import prepare_jit_header, temp_directory

    header_s = 0.0
    if header:  # before setup_blas(), which would start it in the background
        start = time.perf_counter()
        if prepare_jit_header(wait=True) is None:
            raise SystemExit("no precompiled header applies here (Linux, g++, MLX's headers)")
        header_s = time.perf_counter() - start
    from base_setup import setup_blas

    setup_blas()  # before mlx is imported (it does not import mlx itself)
    from config.ppo_config import PPOConfig
    from ppo_trainer.ppo_trainer import PPOTrainer

    config = PPOConfig(
        model_name=model,
        algorithm="grpo",
        group_size=2,
        batch_size=2,
        max_new_tokens=24,
        num_ppo_epochs=2,
        output_dir=out_dir,
        progress_bar=False,
        log_rollouts_every=0,
    )
    trainer = PPOTrainer(config, reward_model=lambda p, c: [-len(x) / 50 for x in c])
    if not trainer.updater.compiled:
        raise SystemExit("the training gradient is not compiled here: nothing to measure")
    before = kernels(temp_directory())
    start = time.perf_counter()
    trainer.step(PROMPTS)
    return {
        "header_s": header_s,
        "step_s": time.perf_counter() - start,
        "kernels": kernels(temp_directory()) - before,
    }


def run_case(model: str, temp: Path, header: bool) -> dict[str, float]:
    """:func:`worker` in a fresh process whose ``$TMPDIR`` is ``temp``."""
    temp.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "TMPDIR": str(temp),
        "PPO_MLX_COMPILED_GRADIENT": "1",
        "PPO_MLX_JIT_HEADER": "1" if header else "0",
    }
    code = (
        "import json, sys; from benchmarks.kernel_build import worker; "
        "print(json.dumps(worker(sys.argv[1], sys.argv[2], sys.argv[3] == '1')))"
    )
    args = [model, str(temp / "run"), "1" if header else "0"]
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"the case failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: SmolLM2-135M-Instruct)")
    args = parser.parse_args(argv)
    model = args.model
    if model is None:
        from fixtures.real_checkpoint import smollm2_checkpoint

        model = str(smollm2_checkpoint())
    lines = []
    with tempfile.TemporaryDirectory(prefix="kernel_build_") as tmp:
        cases = [
            ("cold", run_case(model, Path(tmp) / "off", header=False)),
            ("cold + header", run_case(model, Path(tmp) / "on", header=True)),
            ("warm", run_case(model, Path(tmp) / "on", header=False)),
        ]
    base = cases[0][1]["step_s"]
    lines.append(f"model: {model}")
    lines.append(f"{'case':<15}{'step s':>9}{'kernels':>9}{'header s':>10}{'/ cold':>8}")
    for name, result in cases:
        header_s = f"{result['header_s']:.1f}" if result["header_s"] else "-"
        lines.append(
            f"{name:<15}{result['step_s']:>9.1f}{int(result['kernels']):>9}{header_s:>10}"
            f"{result['step_s'] / base:>7.2f}x"
        )
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
