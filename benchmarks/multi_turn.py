"""Cost per turn of multi-turn episodes (agents): the KV cache kept across turns
(:func:`ppo_trainer.multi_turn.generate_turns`) against re-running generation from scratch at every
turn (the whole history re-prefilled, as a loop over :func:`ppo_trainer.generator.generate` does).

Usage::

    python -m benchmarks.multi_turn                          # SmolLM2-135M's shape
    python -m benchmarks.multi_turn --model toy-llama --turns 3 --repeats 1

The model is the shape of :data:`benchmarks.ppo_throughput.MODEL_SHAPES`, random float32 weights
(:func:`benchmarks.decode_profile.build_model`; nothing is downloaded). ``--batch`` episodes of a
``--prompt``-token prompt; each policy turn ends at a stop token (a fixed ``1/--turn-tokens`` of
the vocabulary), then gets ``--context`` tool tokens, for ``--turns`` turns. Sampled at
``--temperature 1``: a random model's greedy text repeats one token and never stops (greedy, the
two ways give the same episodes: tests/test_multi_turn.py). Sampled, their episodes differ (each
way splits the PRNG keys its own way), so the table gives each way's seconds per turn and per
policy token (CPU seconds of this process and wall seconds; medians over ``--repeats``), with
the policy tokens it generated and the tokens it prefilled.
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a script: MLX's fast BLAS before anything imports mlx
    import os

    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from base_setup import setup_blas

    setup_blas()

import argparse
import statistics
import time
from typing import Any

import mlx.core as mx
import numpy as np

from benchmarks.decode_profile import build_model
from ppo_trainer.generator import generate
from ppo_trainer.multi_turn import generate_turns


def _context(row: int, turn: int, length: int, vocab: int) -> list[int]:
    """The tool tokens of ``row``'s ``turn``: fixed ids (what they are does not change the cost)."""
    return [(97 * row + 31 * turn + j) % (vocab - 2) + 2 for j in range(length)]


def cached(
    model: Any, prompts: list[list[int]], args: argparse.Namespace, stops: list[int]
) -> dict[str, float]:
    """The episodes with the KV cache kept: ``{"turns", "policy_tokens", "prefilled"}``."""
    vocab = model.args.vocab_size
    turns = [0] * len(prompts)

    def continue_fn(row: int, _: list[int]) -> list[int] | None:
        turns[row] += 1
        return _context(row, turns[row], args.context, vocab) if turns[row] < args.turns else None

    out = generate_turns(
        model,
        prompts,
        continue_fn=continue_fn,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        stop_token_ids=stops,
        pad_token_id=0,
        keys=mx.random.split(mx.random.key(args.seed), len(prompts)),
    )
    assert out.turn_spans is not None and out.action_mask is not None
    policy = float(np.asarray(out.action_mask).sum())
    total = float(np.asarray(out.lengths).sum())
    return {
        "turns": float(sum(len(s) for s in out.turn_spans)),
        "policy_tokens": policy,
        "prefilled": float(sum(len(p) for p in prompts)) + total - policy,
    }


def reprefilled(
    model: Any, prompts: list[list[int]], args: argparse.Namespace, stops: list[int]
) -> dict[str, float]:
    """The same episodes re-generated from scratch at every turn (batched over the live ones)."""
    vocab = model.args.vocab_size
    history: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    counts = {"turns": 0.0, "policy_tokens": 0.0, "prefilled": 0.0}
    keys = mx.random.split(mx.random.key(args.seed), len(prompts))
    for turn in range(args.turns):
        if not live:
            break
        budget = min(args.max_new_tokens - len(history[i]) for i in live)
        sequences = [prompts[i] + history[i] for i in live]
        counts["prefilled"] += sum(len(s) for s in sequences)
        out = generate(
            model,
            sequences,
            max_new_tokens=budget,
            temperature=args.temperature,
            stop_token_ids=stops,
            pad_token_id=0,
            keys=mx.random.split(keys[turn], len(live)),
        )
        lengths = np.asarray(out.lengths).tolist()
        ended = np.asarray(out.ended_with_stop).tolist()
        responses = np.asarray(out.responses).tolist()
        still = []
        for row, i in enumerate(live):
            history[i] += responses[row][: lengths[row]]
            counts["turns"] += 1
            counts["policy_tokens"] += lengths[row]
            room = args.max_new_tokens - len(history[i]) > args.context
            if ended[row] and turn + 1 < args.turns and room:
                history[i] += _context(i, turn + 1, args.context, vocab)
                still.append(i)
        live = still
    return counts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    parser.add_argument("--turns", type=int, default=4, help="policy turns per episode")
    parser.add_argument("--turn-tokens", type=int, default=24, help="mean policy tokens per turn")
    parser.add_argument("--context", type=int, default=48, help="tool tokens after each turn")
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model = build_model(args.model)
    vocab = model.args.vocab_size
    stops = [t for t in range(2, vocab) if t % args.turn_tokens == 0]
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(2, vocab, args.prompt).tolist() for _ in range(args.batch)]
    ways = {"KV cache kept": cached, "re-prefill each turn": reprefilled}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    counts: dict[str, dict[str, float]] = {}
    for _ in range(args.repeats):  # round-robin: a change of the machine's load hits both
        for name, way in ways.items():
            cpu, wall = time.process_time(), time.perf_counter()
            counts[name] = way(model, prompts, args, stops)
            times[name].append((time.process_time() - cpu, time.perf_counter() - wall))
    print(
        f"{args.model}: {args.batch} episodes, prompt {args.prompt} tokens, {args.turns} turns of "
        f"~{args.turn_tokens} policy tokens + {args.context} tool tokens, {args.repeats} repeats"
    )
    header = ["CPU s/turn", "wall s/turn", "CPU ms/token", "turns", "policy tok", "prefilled"]
    print(f"{'':22}" + "".join(f"{h:>13}" for h in header))
    for name in ways:
        c = counts[name]
        cpu = statistics.median(t[0] for t in times[name])
        wall = statistics.median(t[1] for t in times[name])
        shares = [cpu / c["turns"], wall / c["turns"], 1000 * cpu / c["policy_tokens"]]
        totals = [c["turns"], c["policy_tokens"], c["prefilled"]]
        print(
            f"{name:22}"
            + "".join(f"{x:13.4f}" for x in shares + [])
            + "".join(f"{x:13.0f}" for x in totals)
        )


if __name__ == "__main__":
    main()
