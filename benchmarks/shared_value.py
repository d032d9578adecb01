"""Memory and speed of the value model on the policy's base, and of the group prefill.

Usage::

    python -m benchmarks.shared_value                  # both parts, SmolLM2-135M's shape (~10 min)
    python -m benchmarks.shared_value --part prefill   # the group prefill only (~1 min)
    # Qwen3-1.7B's shape, value model on the policy's base, a reward function (no reward model)
    python -m benchmarks.shared_value --part value --model qwen3-1.7b --value-init shared \
        --reward-function repetition_penalty --batch-size 8 --new-tokens 64 --warmup 1 \
        --iterations 1 --gradient-checkpointing
    # Qwen3-0.6B's shape, both value models and TRL 1.12, alternated twice
    python -m benchmarks.shared_value --part value --model qwen3-0.6b --rounds 2 \
        --trl-python /path/to/trl-venv/bin/python --gradient-checkpointing
    # TRL 1.12's run alone at that shape (no value model of ours: --value-init with no value)
    python -m benchmarks.shared_value --part value --model qwen3-0.6b --value-init \
        --trl-python /path/to/trl-venv/bin/python --gradient-checkpointing
    # SmolLM2-135M's shape, shared value model, the reward model on its own base or on the
    # policy's (one base for the four models)
    python -m benchmarks.shared_value --part value --value-init shared --reward-base own shared

* ``value``: PPO at a real shape (``benchmarks.ppo_throughput.MODEL_SHAPES``, plus
  ``qwen3-1.7b`` here), LoRA policy (rank 16, all linear layers, as the throughput benchmark's
  real shapes), reward model, value model either a full-weight copy started from the reward
  checkpoint (``value_init: reward``, the default) or adapters and a head on the policy's base
  (``value_init: shared``); each in its own fresh worker process
  (``benchmarks.throughput_worker``), so each peak resident memory is its own. Prints seconds
  per iteration, the time split, peak RSS and MLX's peak array memory.
  ``--reward-function`` scores with a built-in reward instead of the reward model (shared value
  model only: no reward checkpoint is loaded). ``--reward-base own shared`` runs each value
  model with the reward model on its own copy of the base (a full-weight checkpoint, the
  default) and on the policy's base (``share_reward_base``: a LoRA reward model's adapter
  checkpoint, rank 16 on the policy's modules, with random adapters and head). ``--trl-python`` adds TRL 1.12's PPO (LoRA policy,
  full-weight value model from the reward checkpoint; an interpreter with
  ``requirements-bench.txt``); ``--rounds`` repeats every configuration in turn, for medians
  on a noisy machine.
* ``prefill``: ``ppo_trainer.generator.generate`` on GRPO's batch (``--prompts`` prompts of
  ``--prompt-tokens`` tokens, each ``--group`` times) with ``prefill_once`` on and off, on the
  benchmark's ``tiny`` shape; prints the median seconds of each and their ratio.
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a script: MLX's fast BLAS before anything imports mlx
    from base_setup import setup_blas

    setup_blas()

import argparse
import platform
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import cast

from benchmarks.ppo_throughput import (
    MODEL_SHAPES,
    REAL_LORA_ALPHA,
    REAL_LORA_MODULES,
    REAL_LORA_RANK,
    run_spec,
)
from benchmarks.throughput_models import RealShape, benchmark_prompts, build_benchmark_checkpoints
from benchmarks.throughput_spec import RunSpec, System

#: Qwen3-1.7B's published config.json sizes (random weights, float32, tied embeddings).
QWEN3_1_7B = replace(
    cast(RealShape, MODEL_SHAPES["qwen3-0.6b"]),
    source="Qwen/Qwen3-1.7B",
    hidden_size=2048,
    intermediate_size=6144,
)
SHAPES = {**MODEL_SHAPES, "qwen3-1.7b": QWEN3_1_7B}


def build_reward_adapters(policy_dir: Path, out_dir: Path, seed: int = 0) -> Path:
    """A reward adapter checkpoint on ``policy_dir``'s base, as the reward stage saves it with
    ``use_lora``: the policy's LoRA rank, alpha and modules, random ``N(0, 0.01^2)`` adapters
    (both matrices, so they change the scores) and a random ``N(0, 1/(D+1))`` head."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    from base_setup.lora_setup import LoraSettings, apply_lora
    from models.reward_model import RewardModel
    from training.fingerprints import model_fingerprint

    reward = RewardModel.from_causal_lm(policy_dir, head_init="normal", seed=seed + 2)
    reward.lora = LoraSettings(
        r=REAL_LORA_RANK, alpha=REAL_LORA_ALPHA, dropout=0.0, keys=REAL_LORA_MODULES
    )
    apply_lora(reward, reward.lora)
    trainable = cast(list[tuple[str, mx.array]], tree_flatten(reward.trainable_parameters()))
    adapters = [
        (name, 0.01 * mx.random.normal(value.shape, key=mx.random.key(seed + i)))
        for i, (name, value) in enumerate(trainable)
    ]
    reward.update(tree_unflatten(adapters))
    out = reward.save_pretrained(out_dir, base_fingerprint=model_fingerprint(policy_dir))
    del reward
    mx.clear_cache()  # this process goes on while the workers run: keep no freed buffers
    return out


def value_part(args: argparse.Namespace, work: Path) -> None:
    shape = SHAPES[args.model]
    assert isinstance(shape, RealShape), f"{args.model} is not a real shape"
    if not args.value_init and args.trl_python is None:
        raise SystemExit("nothing to run: give --value-init values, or --trl-python for TRL's")
    if args.reward_function is not None and "reward" in args.value_init:
        raise SystemExit("--reward-function loads no reward model: use --value-init shared")
    start = time.perf_counter()
    policy_dir, reward_dir = build_benchmark_checkpoints(work / args.model, shape)
    reward_dirs = {"own": reward_dir}
    if "shared" in args.reward_base:
        reward_dirs["shared"] = build_reward_adapters(policy_dir, work / args.model / "reward-lora")
    prompts = tuple(benchmark_prompts(policy_dir, args.batch_size))
    print(f"built the {args.model} checkpoints in {time.perf_counter() - start:.0f} s")
    reward = (
        f"reward model on base: {' / '.join(args.reward_base)}"
        if args.reward_function is None
        else f"reward function {args.reward_function} (no reward model)"
    )
    print(
        f"PPO, {args.model}, {args.batch_size} prompts x {args.new_tokens} new tokens, LoRA r="
        f"{REAL_LORA_RANK} policy, {reward}, {args.warmup} + {args.iterations} iterations, "
        f"gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}, "
        f"{platform.machine()} CPU, 2 threads, {args.rounds} round(s)"
    )
    print("run | s/iter (median) | generation / scoring / update s | peak RSS MB | MLX peak MB")
    bases = ["own"] if args.reward_function is not None else args.reward_base
    runs = [("mlx", value_init, base) for value_init in args.value_init for base in bases]
    if args.trl_python is not None:
        runs.append(("trl", "reward", "own"))
    seconds: dict[str, list[float]] = {}
    peaks: dict[str, list[float]] = {}
    for round_ in range(args.rounds):
        for system, value_init, base in runs:
            spec = RunSpec(
                system=cast(System, system),
                algorithm="ppo",
                label=f"value-{value_init}-reward-{base}-{round_}",
                model=args.model,
                policy_dir=str(policy_dir),
                reward_dir=str(reward_dirs[base]),
                prompts=prompts,
                batch_size=args.batch_size,
                group_size=1,
                max_new_tokens=args.new_tokens,
                warmup=args.warmup,
                iterations=args.iterations,
                lora_rank=REAL_LORA_RANK,
                lora_alpha=REAL_LORA_ALPHA,
                lora_modules=REAL_LORA_MODULES,
                gradient_checkpointing=args.gradient_checkpointing,
                value_init=value_init,
                reward_function=args.reward_function if system == "mlx" else None,
                share_reward_base=base == "shared",
            )
            python = str(args.trl_python) if system == "trl" else None
            result = run_spec(spec, isolate=True, log_dir=work, python=python)
            name = "TRL 1.12 (separate value model)" if system == "trl" else value_init
            if system == "mlx" and args.reward_function is None and len(bases) > 1:
                name = f"value {value_init}, reward on {base} base"
            split = " / ".join(
                f"{statistics.median(result.split[k]):.2f}"
                for k in ("generation", "scoring", "update")
            )
            print(
                f"{name} | {result.median:.2f} | {split} | {result.peak_rss_mb:.0f} | "
                f"{result.mlx_peak_mb or 0:.0f}",
                flush=True,
            )
            seconds.setdefault(name, []).append(result.median)
            peaks.setdefault(name, []).append(result.peak_rss_mb)
    if args.rounds > 1:
        print("median over rounds: run | s/iter | peak RSS MB (max)")
        for name, values in seconds.items():
            print(f"{name} | {statistics.median(values):.2f} | {max(peaks[name]):.0f}")


def prefill_part(args: argparse.Namespace, work: Path) -> None:
    import mlx.core as mx

    from fixtures.tiny_model import TinyModelSpec, build_checkpoint
    from models.policy_model import PolicyModel
    from ppo_trainer.generator import generate

    spec = replace(cast(TinyModelSpec, MODEL_SHAPES["tiny"]), max_position_embeddings=4096)
    policy = PolicyModel.from_pretrained(build_checkpoint(work / "tiny", spec))
    vocab = int(policy.model.args.vocab_size)
    distinct = mx.random.randint(4, vocab, (args.prompts, args.prompt_tokens), key=mx.random.key(0))
    rows = cast(list[list[int]], distinct.tolist())
    prompt_ids = [row for row in rows for _ in range(args.group)]  # (P * G, L)
    keys = mx.random.split(mx.random.key(1), len(prompt_ids))
    print(
        f"generate: {args.prompts} prompts x {args.group} samples, {args.prompt_tokens} prompt "
        f"tokens, {args.new_tokens} new tokens, tiny shape (hidden 256, 4 layers), 2 threads"
    )
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.repeats + 1):  # the first round warms up
        for once in (False, True):
            start = time.perf_counter()
            generate(
                policy,
                prompt_ids,
                max_new_tokens=args.new_tokens,
                temperature=1.0,
                stop_token_ids=[],
                pad_token_id=0,
                return_logprobs=True,
                keys=keys,
                prefill_once=once,
            )
            times[once].append(time.perf_counter() - start)
    every, once_ = (statistics.median(times[k][1:]) for k in (False, True))
    print(
        f"every row prefilled: {every:.3f} s; each prompt once: {once_:.3f} s; {every / once_:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["value", "prefill", "both"], default="both")
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument(
        "--value-init",
        nargs="*",
        default=["reward", "shared"],
        help="our value models to run (none given: only TRL's, with --trl-python)",
    )
    parser.add_argument(
        "--reward-base",
        nargs="+",
        choices=["own", "shared"],
        default=["own"],
        help="the reward model on its own copy of the base, or on the policy's "
        "(share_reward_base, a LoRA reward adapter checkpoint; needs --value-init shared or "
        "policy for one base)",
    )
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument(
        "--reward-function",
        default=None,
        help="score with this built-in reward (e.g. repetition_penalty) instead of a reward model",
    )
    parser.add_argument(
        "--trl-python",
        type=Path,
        default=None,
        help="also run TRL 1.12's PPO (separate value model) in this interpreter's environment",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="run the configurations this many times, alternating"
    )
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.part in ("prefill", "both"):
            prefill_part(args, Path(tmp))
        if args.part in ("value", "both"):
            value_part(args, Path(tmp))


if __name__ == "__main__":
    main()
