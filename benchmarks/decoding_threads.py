"""A decoding step's threads: the trainer's sampling with OpenBLAS and the native kernels on one
core fewer than the process has (``base_setup.backend.decoding_threads``, what a model the
few-row kernel serves gets) against the run's full count.

Usage::

    python -m benchmarks.decoding_threads                          # SmolLM2-135M's shape
    python -m benchmarks.decoding_threads --model qwen3-0.6b --rounds 2 --new-tokens 64

One process, both ways alternating (the machine's drift touches them alike): the trainer's
``ppo_trainer.rollout.sample_responses`` on the throughput benchmark's LoRA r16 policy (random
float32 weights of the shape, merged for sampling where ``auto`` merges) of ``--prompts`` prompts
x ``--samples`` samples x ``--new-tokens`` tokens, temperature 1, no stop tokens, under the
trainer's ``run_scope`` and BLAS threads. Prints each round's wall and CPU seconds, the medians
and their ratio, and whether both ways sampled the same tokens in a short warm-up (they may not:
OpenBLAS's thread count changes the rounding of the matmuls it still runs).
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a script: MLX's fast BLAS before anything imports mlx
    from base_setup import setup_blas

    setup_blas()

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx

from benchmarks.ppo_throughput import MODEL_SHAPES
from benchmarks.throughput_models import RealShape, build_real_checkpoint


def main(argv: list[str] | None = None) -> None:
    from base_setup.backend import run_blas_threads, run_scope
    from base_setup.native import process_cpus
    from benchmarks.sampling_memory import adapter_policy_batch, timed_sampling
    from ppo_trainer import rollout

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", choices=["smollm2-135m", "qwen3-0.6b"])
    parser.add_argument("--rounds", type=int, default=6, help="sampling rounds, each both ways")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args(argv)

    shape = MODEL_SHAPES[args.model]
    assert isinstance(shape, RealShape)
    few_row_model = rollout.few_row_model
    with tempfile.TemporaryDirectory(prefix="decoding_threads_") as tmp, run_scope():
        policy_dir = build_real_checkpoint(Path(tmp) / "policy", shape)
        threads = run_blas_threads()
        policy, ids, keys = adapter_policy_batch(policy_dir, args.prompts, args.samples)
        if not few_row_model(policy):
            raise SystemExit(f"{args.model} is below FEW_ROW_MIN_PARAMETERS: nothing to compare")

        def sample(fewer: bool, new_tokens: int) -> tuple[float, float, Any]:
            setattr(rollout, "few_row_model", few_row_model if fewer else (lambda _: False))
            try:
                return timed_sampling(policy, ids, keys, new_tokens)
            finally:
                rollout.few_row_model = few_row_model

        same = mx.array_equal(sample(True, 4)[2].responses, sample(False, 4)[2].responses)
        print(
            f"{args.model}: {len(ids)} x {args.new_tokens} tokens, {process_cpus()} cores, "
            f"run's BLAS threads {threads}; the warm-up's tokens "
            f"{'equal' if same.item() else 'differ'} both ways",
            flush=True,
        )
        walls: dict[bool, list[float]] = {True: [], False: []}
        for r in range(args.rounds):
            for fewer in (True, False) if r % 2 == 0 else (False, True):
                wall, cpu, _ = sample(fewer, args.new_tokens)
                walls[fewer].append(wall)
                way = "one core fewer" if fewer else "every thread  "
                print(f"  round {r}, {way}: {wall:6.2f} s wall, {cpu:6.2f} s CPU", flush=True)
        full, fewer_median = statistics.median(walls[False]), statistics.median(walls[True])
        print(
            f"sampling: every thread {full:.2f} s, one core fewer {fewer_median:.2f} s "
            f"(medians), ratio {fewer_median / full:.3f}"
        )


if __name__ == "__main__":
    main()
