"""Seconds and peak memory of LoRA sampling with the adapters merged and unmerged.

Usage::

    python -m benchmarks.sampling_memory                       # SmolLM2-135M's shape (~5 min)
    python -m benchmarks.sampling_memory --model qwen3-0.6b --batch-size 16 --new-tokens 128
    python -m benchmarks.sampling_memory --model qwen3-1.7b --new-tokens 8 --repeats 1
    # Qwen3-0.6B's layer sizes, 6 of its 28 blocks (under 2 GB resident)
    python -m benchmarks.sampling_memory --model qwen3-0.6b --layers 6 --rounds 2

What the trainer's phase 1 runs: ``ppo_trainer.rollout.sample_responses`` (batched, KV cache,
sampling log-probs, temperature 1, no stop tokens: every response ``--new-tokens`` long) on a
float32 random-weight checkpoint of a real shape (``benchmarks.ppo_throughput.MODEL_SHAPES``,
plus ``qwen3-1.7b`` of ``benchmarks.shared_value``), with the throughput benchmark's LoRA (rank
16, alpha 32, every linear layer of every block; ``lora_b`` drawn at random so the merged
weights differ from the base), under the trainer's ``run_scope`` and its OpenBLAS thread count for the load
(``run_blas_threads``), once with
``merge_adapters=True`` and once with ``False`` (config ``merge_adapters_for_sampling``). Each
runs in its own fresh worker process: after loading, the worker resets the kernel's peak
resident memory (``VmHWM``, via /proc/self/clear_refs), so the sampling peak printed is that of
sampling alone (weights included), the load's printed beside it. Seconds: the median of
``--repeats`` calls after a warm-up call of 4 tokens, the merge included (the trainer merges at
every rollout), wall-clock and the process's CPU time (steadier than the wall clock on a busy
machine).
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a script: MLX's fast BLAS before anything imports mlx
    from base_setup import setup_blas

    setup_blas()

import argparse
import json
import platform
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.ppo_throughput import REAL_LORA_ALPHA, REAL_LORA_MODULES, REAL_LORA_RANK
from benchmarks.shared_value import SHAPES
from benchmarks.throughput_models import RealShape, benchmark_prompts, build_real_checkpoint
from benchmarks.throughput_spec import (
    load_average,
    parameters_mb,
    peak_rss_mb,
    reset_peak_rss,
    run_module_worker,
    write_worker_result,
)


def random_adapter_policy(policy_dir: Path) -> Any:
    """The throughput benchmark's LoRA policy (rank 16, alpha 32, every linear layer) on the
    float32 checkpoint at ``policy_dir``, its ``lora_b`` drawn at random (fresh adapters are zero,
    and merged weights would equal the base's)."""
    import mlx.core as mx

    from base_setup.lora_setup import LoraSettings, lora_modules
    from models.policy_model import PolicyModel

    lora = LoraSettings(
        r=REAL_LORA_RANK, alpha=REAL_LORA_ALPHA, dropout=0.0, keys=REAL_LORA_MODULES
    )
    policy = PolicyModel.from_pretrained(policy_dir, dtype="float32", lora=lora)
    key = mx.random.key(1)
    for _, module in lora_modules(policy.model):
        key, sub = mx.random.split(key)
        module.lora_b = 0.01 * mx.random.normal(module.lora_b.shape, key=sub)
        mx.eval(module.lora_b)
    return policy


def adapter_policy_batch(
    policy_dir: Path, prompts: int, samples: int
) -> tuple[Any, list[list[int]], Any]:
    """:func:`random_adapter_policy` on ``policy_dir``, the token ids of ``prompts`` of the
    throughput benchmark's prompts, each ``samples`` times, and one PRNG key per sequence: the
    batch the sampling A/B benchmarks (``benchmarks.few_row_matmul``,
    ``benchmarks.decoding_threads``) sample."""
    import mlx.core as mx

    policy = random_adapter_policy(policy_dir)
    texts = benchmark_prompts(policy_dir, prompts)
    ids = [list(policy.tokenizer.encode(t)) for t in texts for _ in range(samples)]
    return policy, ids, mx.random.split(mx.random.key(0), len(ids))


def timed_sampling(
    policy: Any, prompt_ids: list[list[int]], keys: Any, new_tokens: int, merge: Any = "auto"
) -> tuple[float, float, Any]:
    """The trainer's ``sample_responses`` of ``prompt_ids`` (``keys``: one PRNG key each),
    ``new_tokens`` tokens each at temperature 1, no filters and no stop tokens (every response
    full length), adapters merged as ``merge`` says: wall and CPU seconds of this process, and
    the output (evaluated)."""
    import mlx.core as mx

    from ppo_trainer.rollout import SamplingSettings, sample_responses

    sampling = SamplingSettings(
        max_new_tokens=new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        stop_token_ids=[],
        pad_token_id=0,
        merge_adapters=merge,
    )
    start, cpu = time.perf_counter(), time.process_time()
    out = sample_responses(policy, prompt_ids, sampling, keys)
    mx.eval(out.responses)
    return time.perf_counter() - start, time.process_time() - cpu, out


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Load the LoRA policy, sample ``spec``'s batch merged or not; seconds and peaks."""
    import mlx.core as mx

    from base_setup.backend import run_blas_threads, run_scope
    from base_setup.lora_setup import mergeable_weight_bytes

    with run_scope():
        blas_threads = run_blas_threads()  # as a trainer's run: fitted to the free cores
        policy = random_adapter_policy(spec["policy_dir"])
        load_peak = peak_rss_mb()
        reset = reset_peak_rss()
        mx.reset_peak_memory()
        prompts = spec["prompts"]
        prompt_ids = [list(policy.tokenizer.encode(p)) for p in prompts]
        keys = mx.random.split(mx.random.key(0), len(prompt_ids))

        def sample(new_tokens: int) -> tuple[float, float]:
            wall, cpu, _ = timed_sampling(policy, prompt_ids, keys, new_tokens, spec["merge"])
            return wall, cpu

        sample(4)  # warm-up
        times = [sample(spec["new_tokens"]) for _ in range(spec["repeats"])]
        return {
            "seconds": [wall for wall, _ in times],
            "cpu_seconds": [cpu for _, cpu in times],
            "blas_threads": blas_threads,
            "load_peak_mb": load_peak,
            "sampling_peak_mb": peak_rss_mb() if reset else None,
            "mlx_peak_mb": mx.get_peak_memory() / 2**20,
            "merged_mb": sum(mergeable_weight_bytes(policy.model)) / 2**20,
            "weights_mb": parameters_mb(policy.model.parameters()),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["smollm2-135m"], choices=sorted(SHAPES))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--rounds", type=int, default=1, help="run merged and unmerged this many times, alternating"
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="keep only this many of the shape's blocks (its layer sizes, less memory)",
    )
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        spec = json.loads(args.worker.read_text(encoding="utf-8"))
        write_worker_result(worker(spec))
        return
    print(
        f"sample_responses, LoRA r={REAL_LORA_RANK} on every linear layer, float32, "
        f"{args.batch_size} prompts x {args.new_tokens} new tokens, {platform.machine()} CPU, "
        f"median of {args.repeats} after a warm-up, {args.rounds} round(s)"
    )
    print(
        "model | adapters | s (median) | CPU s (median) | sampling peak RSS MB | load peak RSS MB | MLX peak MB "
        "| merged copy MB | weights MB | BLAS threads | load avg"
    )
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for model in args.model:
            shape = SHAPES[model]
            assert isinstance(shape, RealShape), f"{model} is not a real shape"
            if args.layers is not None:
                shape = replace(shape, num_hidden_layers=args.layers)
            policy_dir = build_real_checkpoint(work / model, shape)
            prompts = benchmark_prompts(policy_dir, args.batch_size)
            for _ in range(args.rounds):
                for merge in (True, False):
                    spec = {
                        "policy_dir": str(policy_dir),
                        "prompts": prompts,
                        "new_tokens": args.new_tokens,
                        "repeats": args.repeats,
                        "merge": merge,
                    }
                    r = run_module_worker("benchmarks.sampling_memory", spec, work)
                    sampling_peak = r["sampling_peak_mb"]
                    name = model if args.layers is None else f"{model} ({args.layers} blocks)"
                    print(
                        f"{name} | {'merged' if merge else 'unmerged'} | "
                        f"{statistics.median(r['seconds']):.2f} | "
                        f"{statistics.median(r['cpu_seconds']):.2f} | "
                        f"{'-' if sampling_peak is None else f'{sampling_peak:.0f}'} | "
                        f"{r['load_peak_mb']:.0f} | {r['mlx_peak_mb']:.0f} | "
                        f"{r['merged_mb']:.0f} | {r['weights_mb']:.0f} | {r['blas_threads']} | {load_average()}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
