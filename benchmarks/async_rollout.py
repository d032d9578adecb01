"""Synchronous against asynchronous rollouts (``async_rollout``): seconds per PPO iteration and the
reward curve of each, in the same run.

Usage::

    python -m benchmarks.async_rollout                        # the demo's PPO stage, 3 x 2 runs
    python -m benchmarks.async_rollout --setup smollm2-135m   # a real shape (random weights)
    python -m benchmarks.async_rollout --smoke                # toy sizes, seconds (the test)

Setups:

* ``demo``: the PPO stage of ``python main.py demo`` (its ``PPO_SETTINGS``: LoRA policy over the
  SFT model, the demo's reward model, 16 prompts x 24 new tokens, 40 iterations), from the SFT and
  reward models a demo run left in ``--demo-dir`` (default ``runs/demo``; run the demo first).
  Each run ends with the demo's evaluation (mean reward on 48 held-out prompts at temperature 0.7).
* ``smollm2-135m``: the throughput benchmark's real shape (SmolLM2-135M's architecture and
  vocabulary, random weights, LoRA r 16 on every linear layer, a full-weight value model), 16
  prompts x 64 new tokens; its rewards are those of a random reward model, so only its times mean
  something.
* ``--smoke``: the embedded test-size model and a letter-count reward, 3 iterations.

Every run is a fresh process (``--repeats`` pairs, sync and async interleaved, the order
alternating), training ``--steps`` iterations; pair ``i`` trains with seed ``--seed + i`` in both
modes, so the spread over pairs is the seed noise the two curves are compared within. Per run: the median of
``time/step`` over the iterations after the first two (the first step of an async run is
synchronous and its second waits for the worker to load), the whole of ``train()``'s wall time,
the reward curve (``objective/scores`` per iteration: for an async run the reward of batches the
policy of one update earlier sampled), and the cores other processes kept busy meanwhile (the
machine may be shared). Prints the medians and their ratio, and the curves side by side.
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a script: MLX's fast BLAS before anything imports mlx
    from base_setup import setup_blas

    setup_blas()

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

SETUPS = ("demo", "smollm2-135m")


def e_rate(prompts: list[str], completions: list[str]) -> list[float]:
    """The smoke run's reward: the share of the letter 'e' in the completion."""
    return [c.count("e") / max(len(c), 1) for c in completions]


def _busy_seconds() -> float:
    with open("/proc/stat", encoding="ascii") as f:
        fields = f.readline().split()
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def run_once(
    setup: str, async_rollout: bool, steps: int, work: Path, demo_dir: Path, seed: int
) -> dict:
    """Train one run in this process; returns its per-step records, wall time and evaluation."""
    from config.ppo_config import PPOConfig
    from ppo_trainer.ppo_trainer import PPOTrainer

    out = work / f"run_{'async' if async_rollout else 'sync'}_{os.getpid()}"
    common: dict[str, Any] = dict(
        output_dir=str(out),
        overwrite_output_dir=True,
        progress_bar=False,
        total_steps=steps,
        async_rollout=async_rollout,
        seed=seed,
        log_rollouts_every=0,
        save_every=0,
        use_chat_template=False,  # the plain prompts of the figures recorded so far
    )
    eval_prompts: list[Any] | None = None
    if setup == "smoke":
        from fixtures.tiny_corpus import review_prompts
        from fixtures.tiny_model import build_tiny_checkpoint

        model = build_tiny_checkpoint(work / "tiny", size="test", seed=0)
        config = PPOConfig(model_name=str(model), max_new_tokens=8, batch_size=4, **common)
        trainer = PPOTrainer(config, reward_model=e_rate)
        prompts = review_prompts(steps * config.batch_size, seed=2)
    elif setup == "demo":
        from examples.sentiment_demo import PPO_SETTINGS
        from fixtures.tiny_corpus import review_prompts

        sft, reward = demo_dir / "sft" / "model", demo_dir / "reward" / "model"
        if not (sft.is_dir() and reward.is_dir()):
            raise ValueError(
                f"no demo models in {demo_dir}: run `python main.py demo` first (it caches its "
                "SFT and reward models there), or pass --demo-dir"
            )
        settings = {**PPO_SETTINGS, **common, "save_every": 0}
        config = PPOConfig(model_name=str(sft), reward_model_name=str(reward), **settings)
        trainer = PPOTrainer(config)
        prompts = review_prompts(steps * config.batch_size, seed=2)
        eval_prompts = review_prompts(48, seed=3)
    else:
        from benchmarks.ppo_throughput import (
            MODEL_SHAPES,
            REAL_LORA_ALPHA,
            REAL_LORA_MODULES,
            REAL_LORA_RANK,
        )
        from benchmarks.throughput_models import (
            POLICY_DIR,
            REWARD_DIR,
            benchmark_prompts,
            build_benchmark_checkpoints,
        )

        # Built once per benchmark run (the first run builds it; the pairs alternate order).
        policy_dir, reward_dir = work / "real" / POLICY_DIR, work / "real" / REWARD_DIR
        if not (reward_dir / "config.json").is_file():
            policy_dir, reward_dir = build_benchmark_checkpoints(work / "real", MODEL_SHAPES[setup])
        config = PPOConfig(
            model_name=str(policy_dir),
            reward_model_name=str(reward_dir),
            use_lora=True,
            lora_r=REAL_LORA_RANK,
            lora_alpha=REAL_LORA_ALPHA,
            lora_dropout=0.0,
            lora_keys=list(REAL_LORA_MODULES),
            batch_size=16,
            max_new_tokens=64,
            temperature=1.0,
            num_ppo_epochs=1,
            num_mini_batches=1,
            learning_rate=1e-5,
            **common,
        )
        trainer = PPOTrainer(config)
        prompts = benchmark_prompts(policy_dir, steps * config.batch_size)
    start = time.perf_counter()
    history = trainer.train(prompts, num_epochs=1)
    wall = time.perf_counter() - start
    result: dict[str, Any] = {
        "async": async_rollout,
        "seed": seed,
        "wall": wall,
        "blas_threads": trainer.blas_threads,
        "step_times": [h["time/step"] for h in history],
        "scores": [h["objective/scores"] for h in history],
        "kl": [h["objective/kl"] for h in history],
    }
    if eval_prompts is not None:
        evaluation = trainer.evaluate(eval_prompts, temperature=config.temperature)
        result["eval_reward"] = evaluation["eval/mean_reward"]
        result["eval_kl"] = evaluation["eval/kl"]
    return result


def measure(
    setup: str, async_rollout: bool, steps: int, work: Path, demo_dir: Path, seed: int
) -> dict:
    """:func:`run_once` in a fresh process, with the cores other processes kept busy."""
    out = work / f"result_{time.monotonic_ns()}.json"
    command = [
        sys.executable,
        "-m",
        "benchmarks.async_rollout",
        "--one",
        "async" if async_rollout else "sync",
        "--setup",
        setup,
        "--steps",
        str(steps),
        "--work",
        str(work),
        "--demo-dir",
        str(demo_dir),
        "--result",
        str(out),
        "--seed",
        str(seed),
    ]
    busy0, own0, wall0 = _busy_seconds(), _children_seconds(), time.perf_counter()
    subprocess.run(command, check=True, cwd=Path(__file__).resolve().parent.parent)
    busy1, own1, wall1 = _busy_seconds(), _children_seconds(), time.perf_counter()
    result = json.loads(out.read_text())
    result["other_cores"] = max(0.0, ((busy1 - busy0) - (own1 - own0)) / (wall1 - wall0))
    return dict(result)


def _children_seconds() -> float:
    times = os.times()
    return times.children_user + times.children_system


def _median_step(result: dict) -> float:
    times = result["step_times"][2:] or result["step_times"]
    return float(statistics.median(times))


def report(results: list[dict], setup: str) -> list[str]:
    """The table of runs, the medians and their ratio, and the reward curves."""
    lines = [f"setup {setup}: {len(results) // 2} sync/async pairs, interleaved"]
    head = (
        f"{'run':>4} {'seed':>4} {'mode':>5} {'s/iter':>7} {'train s':>8} {'BLAS thr':>8} {'others':>6}"
        f" {'last5 reward':>12} {'eval reward':>11}"
    )
    lines += [head, "-" * len(head)]
    for i, r in enumerate(results):
        last = statistics.mean(r["scores"][-5:])
        evaluation = f"{r['eval_reward']:+11.3f}" if "eval_reward" in r else f"{'-':>11}"
        lines.append(
            f"{i:>4} {r['seed']:>4} {'async' if r['async'] else 'sync':>5} {_median_step(r):>7.3f} "
            f"{r['wall']:>8.1f} {str(r['blas_threads']):>8} {r['other_cores']:>6.2f}"
            f" {last:>+12.3f} {evaluation}"
        )
    by_mode = {mode: [r for r in results if r["async"] == mode] for mode in (False, True)}
    sync_step = statistics.median(_median_step(r) for r in by_mode[False])
    async_step = statistics.median(_median_step(r) for r in by_mode[True])
    sync_wall = statistics.median(r["wall"] for r in by_mode[False])
    async_wall = statistics.median(r["wall"] for r in by_mode[True])
    lines.append(
        f"median s/iteration: sync {sync_step:.3f}, async {async_step:.3f}, "
        f"sync/async {sync_step / async_step:.2f}; median train() s: sync {sync_wall:.1f}, "
        f"async {async_wall:.1f}, sync/async {sync_wall / async_wall:.2f}"
    )
    pairs = [
        _median_step(a) / _median_step(b) if not a["async"] else _median_step(b) / _median_step(a)
        for a, b in zip(results[0::2], results[1::2])
    ]
    lines.append("sync/async s/iteration per pair: " + ", ".join(f"{p:.2f}" for p in pairs))
    if all("eval_reward" in r for r in results):
        for mode, name in ((False, "sync"), (True, "async")):
            values = [r["eval_reward"] for r in by_mode[mode]]
            lines.append(f"{name} final eval reward: " + ", ".join(f"{v:+.3f}" for v in values))
    steps = len(results[0]["scores"])
    width = 5 if steps >= 10 else 1
    lines.append(
        f"reward curve (objective/scores per {width} iteration(s): mean over runs [range of the "
        "runs' window means])"
    )
    lines.append(f"{'iterations':>12} {'sync':>24} {'async':>24}")
    for first in range(0, steps, width):
        cells = []
        for mode in (False, True):
            means = [statistics.mean(r["scores"][first : first + width]) for r in by_mode[mode]]
            low, high = min(means), max(means)
            cells.append(f"{statistics.mean(means):+7.3f} [{low:+7.3f}, {high:+7.3f}]")
        label = f"{first + 1:>5}-{min(first + width, steps):<6}"
        lines.append(f"{label} {cells[0]:>24} {cells[1]:>24}")
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--setup", choices=(*SETUPS, "smoke"), default="demo")
    parser.add_argument("--smoke", action="store_true", help="toy sizes, in seconds (tests)")
    parser.add_argument("--steps", type=int, default=None, help="iterations per run")
    parser.add_argument("--repeats", type=int, default=3, help="sync/async pairs")
    parser.add_argument("--demo-dir", type=Path, default=Path("runs/demo"))
    parser.add_argument("--out", type=Path, default=None, help="write report.txt and results.json")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the first pair; pair i trains with seed + i (both modes the same seed), so "
        "the spread over pairs shows the seed noise of the reward curve",
    )
    parser.add_argument(
        "--report", type=Path, help="print the report of an earlier run's results.json, no run"
    )
    parser.add_argument("--one", choices=("sync", "async"), help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.setup = "smoke"
    if args.steps is None:
        args.steps = {"smoke": 3, "demo": 40}.get(args.setup, 6)
    if args.steps < 3 or args.repeats < 1:
        parser.error("--steps must be >= 3 and --repeats >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> list[str]:
    """Run the pairs and print the report; returns its lines."""
    args = parse_args(argv)
    if args.one is not None:  # one run, in this fresh process
        result = run_once(
            args.setup, args.one == "async", args.steps, args.work, args.demo_dir, args.seed
        )
        args.result.write_text(json.dumps(result))
        return []
    if args.report is not None:
        earlier = json.loads(args.report.read_text())
        lines = report(earlier, args.setup)
        print("\n".join(lines))
        return lines
    results = []
    with tempfile.TemporaryDirectory(prefix="async_rollout_") as tmp:
        work = Path(tmp)
        for repeat in range(args.repeats):
            order = (False, True) if repeat % 2 == 0 else (True, False)
            for mode in order:
                results.append(
                    measure(args.setup, mode, args.steps, work, args.demo_dir, args.seed + repeat)
                )
                r = results[-1]
                print(
                    f"[{len(results)}/{2 * args.repeats}] {'async' if mode else 'sync'}: "
                    f"{_median_step(r):.3f} s/iteration, others {r['other_cores']:.2f} cores",
                    flush=True,
                )
    lines = [f"machine: {os.cpu_count()} cores; load average {os.getloadavg()}"]
    lines += report(results, args.setup)
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.txt").write_text("\n".join(lines) + "\n")
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
    return lines


if __name__ == "__main__":
    main()
