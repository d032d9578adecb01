"""Two independent forward passes on MLX's CPU backend: one stream (today's scoring phase) against
two CPU streams evaluated together, with OpenBLAS at 1 and at all threads.

Usage::

    python -m benchmarks.cpu_streams                      # SmolLM2-135M's shape, 16 x 142 tokens
    python -m benchmarks.cpu_streams --model toy-llama --batch 2 --length 8 --repeats 1

MLX's CPU element-wise ops run on one thread, but each stream has a thread of its own, so two
independent graphs on two CPU streams can keep two cores busy where one stream keeps one (and
OpenBLAS's threads, for the matmuls only). The scoring phase of a PPO step runs the reference's,
the value model's and the reward model's forward passes, which depend on nothing but the rollout;
this measures what running them side by side would buy. Each configuration runs in its own
process (OpenBLAS's thread count is read as it loads): two models of the real shape (random
float32 weights, fast layers on), one backbone forward pass each over the same token batch, one
warm-up and ``--repeats`` timed rounds, medians; the ratio is to one stream at all threads
measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CONFIGS = (
    ("1 stream", 1, "all"),
    ("1 stream", 1, "1"),
    ("2 streams", 2, "1"),
    ("2 streams", 2, "all"),
)


def worker(model: str, batch: int, length: int, streams: int, repeats: int) -> float:
    """Median seconds of two backbone forward passes on ``streams`` CPU streams (this process)."""
    from base_setup import setup_blas

    setup_blas()
    import mlx.core as mx

    from benchmarks.decode_profile import build_model

    models = [build_model(model), build_model(model)]
    vocab = int(models[0].args.vocab_size)
    ids = mx.random.randint(4, vocab, (batch, length))  # (B, L)
    mx.eval(ids)
    lanes = [mx.new_stream(mx.cpu) for _ in range(streams)]
    times = []
    for round_ in range(repeats + 1):
        start = time.perf_counter()
        outs = []
        for i, m in enumerate(models):
            with mx.stream(lanes[i % streams]):
                outs.append(m.model(ids).sum())
        mx.eval(*outs)
        if round_ > 0:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a real shape of MODEL_SHAPES")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=142, help="prompt + response tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # streams, in a child
    args = parser.parse_args(argv)
    if args.worker is not None:
        seconds = worker(args.model, args.batch, args.length, args.worker, args.repeats)
        print(json.dumps({"seconds": seconds}))
        return
    common = ["--model", args.model, "--batch", str(args.batch), "--length", str(args.length)]
    common += ["--repeats", str(args.repeats)]
    load_at_start = os.getloadavg()[0]
    results = []
    for label, streams, threads in CONFIGS:
        env = dict(os.environ)
        env.pop("OPENBLAS_NUM_THREADS", None)
        if threads != "all":
            env["OPENBLAS_NUM_THREADS"] = threads
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.cpu_streams", "--worker", str(streams), *common],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        seconds = json.loads(out.strip().splitlines()[-1])["seconds"]
        results.append((f"{label}, OpenBLAS threads {threads}", seconds))
    base = results[0][1]
    print(
        f"{args.model}: two backbone forward passes over {args.batch} x {args.length} tokens, "
        f"medians of {args.repeats}, load average at start {load_at_start:.2f}"
    )
    for label, seconds in results:
        print(f"{label:36s} {seconds:8.3f} s   {seconds / base:5.2f}x")


if __name__ == "__main__":
    main()
