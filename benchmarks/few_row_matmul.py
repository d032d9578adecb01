"""The native few-row matmul (``base_setup.fast_math.few_row_matmul``) against MLX's matmul
(OpenBLAS) at a real shape: a decoding step's matmuls, then the trainer's sampling phase.

Usage::

    python -m benchmarks.few_row_matmul                          # SmolLM2-135M's shape
    python -m benchmarks.few_row_matmul --model qwen3-0.6b --rounds 2

One process, both ways alternating (the machine's drift touches them alike), random float32
weights of the shape (``benchmarks.ppo_throughput.MODEL_SHAPES``):

* **The step's matmuls**: every linear weight of every block and the tied head (out of cache, as
  a decoding step reads them), each multiplied by ``rows`` rows, one ``mx.eval`` for the step;
  the median over ``--repeats`` for each row count of ``--rows``, and its ratio to MLX's.
* **Sampling**: the trainer's ``ppo_trainer.rollout.sample_responses`` on a LoRA r16 policy
  (every linear layer; merged for sampling where ``auto`` merges) of ``--prompts`` prompts x
  ``--samples`` samples x ``--new-tokens`` tokens, temperature 1, no stop tokens, under the
  trainer's ``run_scope`` and BLAS threads; with the kernel, and with
  ``few_row_matmul`` answering None (MLX's matmul), ``--rounds`` each (``--rounds 0``: skip).
  Wall and CPU seconds (this process's).
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a script: MLX's fast BLAS before anything imports mlx
    from base_setup import setup_blas

    setup_blas()

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

from base_setup import fast_math
from benchmarks.ppo_throughput import MODEL_SHAPES
from benchmarks.throughput_models import RealShape, build_real_checkpoint


def step_weights(shape: RealShape) -> list[mx.array]:
    """Random float32 weights of every linear layer of ``shape``'s blocks and its head."""
    hidden, heads = shape.hidden_size, shape.num_attention_heads
    head_dim = shape.head_dim or hidden // heads
    kv = shape.num_key_value_heads * head_dim
    attention = heads * head_dim
    mlp = shape.intermediate_size
    block = [
        (attention, hidden),
        (kv, hidden),
        (kv, hidden),
        (hidden, attention),
        (mlp, hidden),
        (mlp, hidden),
        (hidden, mlp),
    ]
    weights = [mx.random.normal(s) * 0.02 for _ in range(shape.num_hidden_layers) for s in block]
    weights.append(mx.random.normal((shape.vocab_size, hidden)) * 0.02)
    mx.eval(weights)
    return weights


def time_step_matmuls(
    weights: list[mx.array], rows: int, repeats: int
) -> tuple[float, float, float]:
    """Median seconds of one step's matmuls with MLX's and with the kernel, and their ratio."""
    sizes = {int(w.shape[1]) for w in weights}
    inputs = {k: mx.random.normal((rows, 1, k)) for k in sizes}
    mx.eval(list(inputs.values()))
    kernels = fast_math.native_kernels(*weights[:1])
    if kernels is None:
        raise SystemExit("the native kernels are off here (see the log): nothing to compare")

    def mlx() -> list[mx.array]:
        return [inputs[int(w.shape[1])] @ w.T for w in weights]

    def ours() -> list[mx.array]:
        return [kernels.few_row_matmul(inputs[int(w.shape[1])], w) for w in weights]

    times: dict[str, list[float]] = {"mlx": [], "ours": []}
    for _ in range(repeats):
        for name, fn in (("mlx", mlx), ("ours", ours)):
            start = time.perf_counter()
            mx.eval(fn())
            times[name].append(time.perf_counter() - start)
    theirs, mine = statistics.median(times["mlx"]), statistics.median(times["ours"])
    return theirs, mine, mine / theirs


def time_sampling(name: str, args: argparse.Namespace) -> None:
    """The sampling A/B (module docstring), printed as it goes."""
    from base_setup.backend import run_blas_threads, run_scope
    from benchmarks.sampling_memory import adapter_policy_batch, timed_sampling

    shape = MODEL_SHAPES[name]
    assert isinstance(shape, RealShape)
    with tempfile.TemporaryDirectory(prefix="few_row_") as tmp, run_scope():
        policy_dir = build_real_checkpoint(Path(tmp) / "policy", shape)
        threads = run_blas_threads()
        policy, ids, keys = adapter_policy_batch(policy_dir, args.prompts, args.samples)
        real = fast_math.few_row_matmul
        never: Callable[..., Any] = lambda x, w: None  # noqa: E731

        def sample(kernel: bool, new_tokens: int) -> tuple[float, float]:
            fast_math.few_row_matmul = real if kernel else never
            try:
                wall, cpu, _ = timed_sampling(policy, ids, keys, new_tokens)
                return wall, cpu
            finally:
                fast_math.few_row_matmul = real

        sample(True, 4)  # warm-up, both ways
        sample(False, 4)
        walls: dict[bool, list[float]] = {True: [], False: []}
        for r in range(args.rounds):
            for kernel in (False, True) if r % 2 == 0 else (True, False):
                wall, cpu = sample(kernel, args.new_tokens)
                walls[kernel].append(wall)
                way = "kernel" if kernel else "MLX's "
                print(f"  round {r}, {way}: {wall:6.2f} s wall, {cpu:6.2f} s CPU", flush=True)
        off, on = statistics.median(walls[False]), statistics.median(walls[True])
        print(
            f"sampling {len(ids)} x {args.new_tokens} tokens ({name}, BLAS threads {threads}): "
            f"MLX's matmul {off:.2f} s, the kernel {on:.2f} s (medians), ratio {on / off:.3f}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", choices=["smollm2-135m", "qwen3-0.6b"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 24, 32])
    parser.add_argument("--repeats", type=int, default=7, help="rounds of the step's matmuls")
    parser.add_argument("--rounds", type=int, default=3, help="sampling rounds (0: skip)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args(argv)

    shape = MODEL_SHAPES[args.model]
    assert isinstance(shape, RealShape)
    weights = step_weights(shape)
    megabytes = sum(w.nbytes for w in weights) / 2**20
    print(f"{args.model}: a decoding step's matmuls ({megabytes:.0f} MiB of float32 weights)")
    print("rows | MLX's matmul ms | the kernel ms | ratio")
    for rows in args.rows:
        theirs, mine, ratio = time_step_matmuls(weights, rows, args.repeats)
        print(f"{rows:4d} | {1e3 * theirs:15.1f} | {1e3 * mine:13.1f} | {ratio:.2f}", flush=True)
    del weights
    if args.rounds:
        time_sampling(args.model, args)


if __name__ == "__main__":
    main()
