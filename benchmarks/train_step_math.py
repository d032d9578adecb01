"""Whether the fast functions (``base_setup.fast_math``) pay in a training step, against plain MLX.

Usage::

    python -m benchmarks.train_step_math                 # SmolLM2-135M's shape, LoRA, 4 x 142
    python -m benchmarks.train_step_math --full --batch 2 --repeats 3

One process: the policy's training step (``nn.value_and_grad`` of the token-mean log-prob of the
response tokens, as the policy loss takes it: ``response_logprobs``, so the blockwise head of a
frozen head) on mlx-lm's model of the real shape (random float32 weights, LoRA rank 16 on every
linear layer unless ``--full``). Inside the gradient trace ``mx.compile`` runs the fast functions'
compiled pieces as their plain graphs. The ways are timed round-robin, each repeat taking every
way once after one warm-up each; the table gives wall and CPU medians and the ratio to plain MLX.
(Until 2026-11-28 a third way built the bodies on a second thread: results/HISTORY.md.)
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a script: MLX's fast BLAS before anything imports mlx
    from base_setup import setup_blas

    setup_blas()

import argparse
import contextlib
import statistics
import time
from typing import Any, Iterator

import mlx.core as mx
import mlx.nn as nn

from base_setup.lora_setup import LoraSettings, apply_lora
from base_setup.plain import plain_mlx_scope
from benchmarks.decode_profile import build_model
from models.policy_model import PolicyModel
from token_attribution.sequences import response_logprobs

#: The ways a step is timed: this project's fast functions, or plain MLX (every speed trick off).
WAYS = ("fast", "plain")


@contextlib.contextmanager
def way(name: str) -> Iterator[None]:
    """Plain MLX within the block for ``"plain"``; nothing changes for ``"fast"``."""
    with plain_mlx_scope(enabled=name == "plain"):
        yield


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=14, help="prompt tokens per sequence")
    parser.add_argument("--new", type=int, default=128, help="response tokens per sequence")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--full", action="store_true", help="train every weight, not LoRA")
    args = parser.parse_args(argv)

    model = build_model(args.model)
    if not args.full:
        model.freeze()
        apply_lora(model, LoraSettings(r=16, alpha=32.0, dropout=0.0))
    policy = PolicyModel(model, None, model_path=".", config={})
    policy.train()
    mx.eval(policy.parameters())
    vocab = int(model.args.vocab_size)
    length = args.prompt + args.new
    mx.random.seed(1)
    ids = mx.random.randint(4, vocab, (args.batch, length))  # (B, L)
    positions = mx.broadcast_to(mx.arange(args.prompt - 1, length - 1), (args.batch, args.new))
    responses = ids[:, args.prompt :]  # (B, T)
    mx.eval(ids, positions, responses)

    def loss_fn(m: Any) -> mx.array:
        logprobs, _ = response_logprobs(m, ids, positions, responses)
        return -logprobs.mean()

    step = nn.value_and_grad(policy, loss_fn)

    def timed() -> tuple[float, float]:
        """Wall and CPU seconds (this process, every thread) of one step."""
        start, cpu = time.perf_counter(), time.process_time()
        loss, grads = step(policy)
        mx.eval(loss, grads)
        return time.perf_counter() - start, time.process_time() - cpu

    ways = list(WAYS)
    times: dict[str, list[tuple[float, float]]] = {w: [] for w in ways}
    for w in ways:  # warm-up: compile and trace each way once
        with way(w):
            print(f"warm-up {w}: %.2f s wall, %.2f s CPU" % timed(), flush=True)
    for r in range(args.repeats):
        for w in ways[r % len(ways) :] + ways[: r % len(ways)]:
            with way(w):
                times[w].append(timed())
            print(f"repeat {r + 1} {w}: %.2f s wall, %.2f s CPU" % times[w][-1], flush=True)
    plain = [statistics.median(t[i] for t in times["plain"]) for i in (0, 1)]
    kind = "full weights" if args.full else "LoRA r16"
    print(f"{args.model}, {kind}, forward + backward at {args.batch} x {length} tokens")
    print("| way | wall s (median) | / plain | CPU s (median) | / plain | wall s of each run |")
    print("|---|---|---|---|---|---|")
    for w in ways:
        wall, cpu = (statistics.median(t[i] for t in times[w]) for i in (0, 1))
        runs = ", ".join(f"{t[0]:.2f}" for t in times[w])
        print(
            f"| {w} | {wall:.2f} | {wall / plain[0]:.2f} | {cpu:.2f} | {cpu / plain[1]:.2f} "
            f"| {runs} |"
        )


if __name__ == "__main__":
    main()
