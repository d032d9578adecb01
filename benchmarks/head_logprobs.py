"""The LM head's log-probs at real vocabularies: through the (B, T, V) logits (autodiff's path,
the trainer's before ``token_attribution.head_logprobs``) against blockwise from the hidden states,
for a training step's forward + backward and for a scoring pass, with the head's matmuls alone as
the floor.

Usage::

    python -m benchmarks.head_logprobs                    # SmolLM2-135M's head, 16 x 128
    python -m benchmarks.head_logprobs --model qwen3-0.6b --blocks 512 1024 2048

The head is the tied embedding of :data:`benchmarks.ppo_throughput.MODEL_SHAPES`'s model (random
float32 weights, frozen, as a LoRA policy's), applied to ``rows`` = sequences x new tokens hidden
states, the shape a PPO/GRPO update and the reference's scoring pass give it. The pieces are
timed round-robin in one process, each repeat taking every piece once; the table gives medians
in wall and CPU seconds of this process and each one's ratio to the logits path of the same kind,
measured in the same rounds, with MLX's peak memory of each piece alone (its own
``mx.reset_peak_memory``). The floor is the head's forward matmul (scoring) and forward plus the
input gradient's matmul (training).
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a script: MLX's fast BLAS before anything imports mlx
    from base_setup import setup_blas

    setup_blas()

import argparse
import statistics
import time
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from benchmarks.ppo_throughput import MODEL_SHAPES
from benchmarks.throughput_models import RealShape
from token_attribution.head_logprobs import LinearHead, default_block_rows, head_token_logprobs
from token_attribution.sequences import token_logprobs

Piece = Callable[[], Any]


def build_pieces(
    vocab: int, dims: int, rows: int, blocks: list[int], seed: int = 0
) -> dict[str, Piece]:
    """Each piece over one frozen (vocab, dims) tied head and (1, rows, dims) hidden states."""
    mx.random.seed(seed)
    embedding = nn.Embedding(vocab, dims)
    embedding.freeze()
    head = embedding.as_linear
    frozen = LinearHead.of(head)
    assert frozen is not None
    hidden = mx.random.normal((1, rows, dims)) * 0.5  # (1, N, D)
    tokens = mx.random.randint(0, vocab, (1, rows))  # (1, N)
    cotangent = mx.random.normal((1, rows))  # (1, N): the loss's per-token weights
    mx.eval(embedding.parameters(), hidden, tokens, cotangent)

    def logits_loss(h: mx.array) -> mx.array:
        return (cotangent * token_logprobs(head(h), tokens)[0]).sum()

    logits_train = mx.value_and_grad(logits_loss)
    pieces: dict[str, Piece] = {
        "floor: head matmul": lambda: head(hidden),
        "floor: head matmul + input gradient": lambda: head(hidden) @ embedding.weight,
        "scoring, logits path": lambda: token_logprobs(head(hidden), tokens)[0],
        "training, logits path": lambda: logits_train(hidden),
    }
    for block in blocks:
        label = f"{block} vocabulary rows"
        pieces[f"scoring, blockwise ({label})"] = _blockwise_scoring(hidden, frozen, tokens, block)
        pieces[f"training, blockwise ({label})"] = _blockwise_training(
            hidden, frozen, tokens, cotangent, block
        )
    return pieces


def _blockwise_scoring(hidden: mx.array, head: LinearHead, tokens: mx.array, block: int) -> Piece:
    return lambda: head_token_logprobs(
        hidden, head, tokens, differentiable=False, block_rows=block
    )[0]


def _blockwise_training(
    hidden: mx.array, head: LinearHead, tokens: mx.array, cotangent: mx.array, block: int
) -> Piece:
    def loss(h: mx.array) -> mx.array:
        return (cotangent * head_token_logprobs(h, head, tokens, block_rows=block)[0]).sum()

    train = mx.value_and_grad(loss)
    return lambda: train(hidden)


def time_pieces(pieces: dict[str, Piece], repeats: int) -> dict[str, dict[str, float]]:
    """Round-robin medians: wall s, CPU s and peak MB of each piece (one warm-up round first)."""
    wall: dict[str, list[float]] = {name: [] for name in pieces}
    cpu: dict[str, list[float]] = {name: [] for name in pieces}
    peak: dict[str, float] = {}
    for round_ in range(repeats + 1):
        for name, piece in pieces.items():
            mx.clear_cache()
            mx.reset_peak_memory()
            start, start_cpu = time.perf_counter(), time.process_time()
            mx.eval(piece())
            if round_ > 0:
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
            peak[name] = mx.get_peak_memory() / 1e6
    return {
        name: {
            "wall": statistics.median(wall[name]),
            "cpu": statistics.median(cpu[name]),
            "peak_mb": peak[name],
        }
        for name in pieces
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a real shape of MODEL_SHAPES")
    parser.add_argument("--rows", type=int, default=16 * 128, help="sequences x new tokens")
    parser.add_argument(
        "--blocks",
        type=int,
        nargs="+",
        help="vocabulary rows per block to time (default: the library's choice)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    shape = MODEL_SHAPES[args.model]
    if not isinstance(shape, RealShape):
        raise SystemExit(f"{args.model} is not a real shape")
    blocks = args.blocks or [default_block_rows(shape.vocab_size, args.rows)]
    pieces = build_pieces(shape.vocab_size, shape.hidden_size, args.rows, blocks)
    results = time_pieces(pieces, args.repeats)
    print(
        f"{args.model} head: V={shape.vocab_size}, D={shape.hidden_size}, {args.rows} rows, "
        f"medians of {args.repeats}; ratio: to the logits path of the same kind"
    )
    print(f"{'piece':44s} {'wall s':>8s} {'ratio':>6s} {'CPU s':>8s} {'ratio':>6s} {'peak MB':>8s}")
    for name, r in results.items():
        kind = "training" if name.startswith("training") else "scoring"
        base = results.get(f"{kind}, logits path") if not name.startswith("floor") else None
        ratio = f"{r['wall'] / base['wall']:6.2f}" if base else " " * 6
        cpu_ratio = f"{r['cpu'] / base['cpu']:6.2f}" if base else " " * 6
        print(
            f"{name:44s} {r['wall']:8.3f} {ratio} {r['cpu']:8.3f} {cpu_ratio} "
            f"{r['peak_mb']:8.0f}"
        )


if __name__ == "__main__":
    main()
