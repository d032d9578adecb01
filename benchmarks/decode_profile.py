"""Where one decoding step of a real shape goes: the generator's step, the model's forward pass,
its pieces per layer, sampling and the generator's bookkeeping, against the matmul floor.

Usage::

    python -m benchmarks.decode_profile                      # SmolLM2-135M's shape, 16 sequences
    python -m benchmarks.decode_profile --model qwen3-0.6b --repeats 10

The model is the shape of :data:`benchmarks.ppo_throughput.MODEL_SHAPES` built from mlx-lm's
``ModelArgs`` with random float32 weights (nothing is written or downloaded), with the fast layers
on (:func:`base_setup.fast_layers.accelerate_model`). Every piece is a graph of the step's real
shapes, evaluated with one ``mx.eval``; a per-layer piece is built for all the model's layers in
one graph, as the forward pass has them. The pieces are timed round-robin in one process (so a
change of the machine's load touches them alike), each repeat taking every piece once, and the
table gives medians in CPU milliseconds of this process (``time.process_time``: on a machine other
processes keep busy, the wall clock mostly measures them) and in wall milliseconds, each with its
ratio to the matmul floor measured in the same rounds: the step's matmuls alone through MLX's
matmul (OpenBLAS), beside them through the native few-row kernel (``fast_math.few_row_matmul``,
which the layers of a model this size run at a decoding step). OpenBLAS runs one thread by
default (``--blas-threads``), so CPU time is the work done.

The generator's step is the median of ``generate(max_new_tokens=N2)`` minus that of ``N1``, over
``N2 - N1`` (no stop ids: no host sync but the last); it is timed in its own rounds, as it takes
seconds.
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a script: MLX's fast BLAS before anything imports mlx
    import os

    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from base_setup import setup_blas

    setup_blas()

import argparse
import os
import statistics
import time
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from base_setup import fast_math
from base_setup.fast_layers import accelerate_model, mlx_lm_replacements
from benchmarks.ppo_throughput import MODEL_SHAPES
from benchmarks.throughput_models import RealShape
from ppo_trainer.generator import _batch_cache, _sample, generate

Piece = Callable[[], Any]


def build_model(name: str) -> nn.Module:
    """mlx-lm's model of the real shape ``name``, random float32 weights, fast layers on."""
    shape = MODEL_SHAPES[name]
    if not isinstance(shape, RealShape):
        raise ValueError(f"{name} is not a real shape; pick smollm2-135m, qwen3-0.6b or toy-llama")
    from mlx_lm.utils import _get_classes

    config = {
        "model_type": shape.model_type,
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "intermediate_size": shape.intermediate_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "rope_theta": shape.rope_theta,
        "rms_norm_eps": shape.rms_norm_eps,
        "tie_word_embeddings": shape.tie_word_embeddings,
    }
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    model.eval()
    accelerate_model(model)
    return model


def decode_pieces(model: nn.Module, batch: int, prompt_len: int, context: int) -> dict[str, Piece]:
    """The pieces of one decoding step at a cache of ``context`` tokens (``prompt_len`` of them
    prompt, left-padded by ``0..4`` per row), each a function that returns the arrays to eval."""
    layers = model.model.layers
    hidden = model.args.hidden_size
    left_padding = [i % 5 for i in range(batch)]
    prompts = mx.random.randint(2, model.args.vocab_size, (batch, prompt_len)).astype(mx.int32)
    cache = _batch_cache(model, left_padding)
    mx.eval(model(prompts, cache=cache))
    token = mx.zeros((batch, 1), dtype=mx.int32)  # (B, 1)
    for _ in range(context - prompt_len - 1):
        mx.eval(model(token, cache=cache))
    # The cache holds context - 1 tokens; a step adds one, and trim(1) takes it back.

    x = mx.random.normal((batch, 1, hidden))  # (B, 1, D)
    mx.eval(x)
    attn0 = layers[0].self_attn
    heads, kv_heads = attn0.n_heads, attn0.n_kv_heads
    head_dim = attn0["q_proj"]["weight"].shape[0] // heads
    q = mx.random.normal((batch, heads, 1, head_dim))  # (B, H, 1, D)
    k = mx.random.normal((batch, kv_heads, 1, head_dim))  # (B, Hkv, 1, D)
    attn_out = mx.random.normal((batch, 1, heads * head_dim))  # (B, 1, H * Dh)
    mx.eval(q, k, attn_out)
    attention = mlx_lm_replacements()["scaled_dot_product_attention"][1]
    mask = cache[0].make_mask(1)  # (B, 1, 1, S)
    mx.eval(mask)
    logits = model(token, cache=cache)[:, -1, :]  # (B, V)
    cached = [c.keys_and_values() for c in cache]  # (B, Hkv, S, Dh) each: what a step attends to
    mx.eval(logits, cached)
    for c in cache:
        c.trim(1)
    done = mx.zeros((batch,), dtype=mx.bool_)
    stop_ids = mx.array([0], dtype=mx.int32)
    pad = mx.array(1, dtype=mx.int32)
    weight_of = lambda linear: linear["weight"]  # noqa: E731

    def forward() -> Any:
        out = model(token, cache=cache)
        mx.eval(out)
        for c in cache:
            c.trim(1)
        return out

    def projections() -> Any:
        a = [l.self_attn for l in layers]
        return [(p.q_proj(x), p.k_proj(x), p.v_proj(x), p.o_proj(attn_out)) for p in a]

    def rope() -> Any:
        offset = cache[0].offset
        return [
            (l.self_attn.rope(q, offset=offset), l.self_attn.rope(k, offset=offset)) for l in layers
        ]

    def cache_update() -> Any:
        out = [c.update_and_fetch(k, k) for c in cache]
        mx.eval(out)
        for c in cache:
            c.trim(1)
        return out

    def attention_core() -> Any:
        out = []
        for c, l, (keys, values) in zip(cache, layers, cached):
            out.append(attention(q, keys, values, cache=c, scale=l.self_attn.scale, mask=mask))
        return out

    def attention_composed() -> Any:
        """The attention core as it ran before :func:`fast_math.one_query_attention`: MLX's
        composed fallback below the fast attention's size threshold, the composed fast one above."""
        out = []
        for l, (keys, values) in zip(layers, cached):
            if batch * heads * keys.shape[2] < fast_math._MIN_FAST_ATTENTION:
                out.append(
                    mx.fast.scaled_dot_product_attention(
                        q, keys, values, scale=l.self_attn.scale, mask=mask
                    )
                )
            else:
                out.append(
                    fast_math.scaled_dot_product_attention(
                        q, keys, values, scale=l.self_attn.scale, mask=mask
                    )
                )
        return out

    def norms() -> Any:
        return [(l.input_layernorm(x), l.post_attention_layernorm(x)) for l in layers] + [
            model.model.norm(x)
        ]

    def mlp() -> Any:
        return [l.mlp(x) for l in layers]

    def lm_head() -> Any:
        return model.model.embed_tokens.as_linear(x)

    def matmul_chain(product: Callable[[mx.array, mx.array], mx.array]) -> Any:
        """The forward pass's matmuls alone (``product(x, weight)``: ``x @ weight.T``), chained as
        the layers chain them."""
        h, outs = x, []
        for l in layers:
            a, m = l.self_attn, l.mlp
            qh = product(h, weight_of(a.q_proj))
            outs += [product(h, weight_of(a.k_proj)), product(h, weight_of(a.v_proj))]
            h = h + product(qh, weight_of(a.o_proj))
            gated = product(h, weight_of(m.gate_proj)) * product(h, weight_of(m.up_proj))
            h = h + product(gated, weight_of(m.down_proj))
        return outs + [product(h, model.model.embed_tokens["weight"])]

    def matmul_floor() -> Any:
        """The forward pass's matmuls alone through MLX's matmul (OpenBLAS)."""
        return matmul_chain(lambda a, w: a @ w.T)

    def few_row_matmuls() -> Any:
        """The same through the native few-row kernel where it runs (MLX's matmul elsewhere)."""

        def product(a: mx.array, w: mx.array) -> mx.array:
            out = fast_math.few_row_matmul(a, w)
            return a @ w.T if out is None else out

        return matmul_chain(product)

    def sampling() -> Any:
        return _sample(logits, 1.0, 1.0, 0, with_entropy=True)

    def bookkeeping() -> Any:
        """The generator's per-step array work around sampling (alive mask, stop check, pads)."""
        tokens = logits[:, 0].astype(mx.int32)
        alive = mx.logical_not(done)
        tokens = mx.where(alive, tokens, pad)
        new_done = mx.logical_or(done, (tokens[:, None] == stop_ids[None, :]).any(axis=1))
        return (
            tokens,
            new_done,
            mx.where(alive, logits[:, 1], 0.0),
            mx.where(alive, logits[:, 2], 0.0),
        )

    def host_sync() -> Any:
        done.all().item()
        return done

    return {
        "forward pass (one token)": forward,
        "  q/k/v/o projections": projections,
        "  RoPE (q and k)": rope,
        "  KV cache update": cache_update,
        "  attention core": attention_core,
        "  (attention core, composed: before)": attention_composed,
        "  RMSNorms": norms,
        "  MLP (gate, up, SwiGLU, down)": mlp,
        "  LM head": lm_head,
        "sampling + log-prob + entropy": sampling,
        "generator bookkeeping": bookkeeping,
        "host sync (.item())": host_sync,
        "matmuls, the few-row kernel": few_row_matmuls,
        "matmul floor": matmul_floor,
    }


def time_rounds(pieces: dict[str, Piece], repeats: int) -> dict[str, tuple[float, float]]:
    """Median (CPU ms, wall ms) of each piece over ``repeats`` round-robin rounds."""
    cpu: dict[str, list[float]] = {name: [] for name in pieces}
    wall: dict[str, list[float]] = {name: [] for name in pieces}
    for piece in pieces.values():  # warm-up: traces, kernels, buffers
        mx.eval(piece())
    for _ in range(repeats):
        for name, piece in pieces.items():
            c0, w0 = time.process_time(), time.perf_counter()
            mx.eval(piece())
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - w0)
    return {
        name: (1e3 * statistics.median(cpu[name]), 1e3 * statistics.median(wall[name]))
        for name in pieces
    }


def generator_step(
    model: nn.Module, batch: int, prompt_len: int, n1: int, n2: int, repeats: int
) -> tuple[float, float]:
    """Median (CPU ms, wall ms) of one generator step: ``generate`` at ``n2`` minus ``n1`` new
    tokens, over ``n2 - n1``."""
    prompts = [
        [
            int(t)
            for t in np.random.default_rng(i).integers(2, model.args.vocab_size, prompt_len - i % 5)
        ]
        for i in range(batch)
    ]

    def run(n: int) -> tuple[float, float]:
        c0, w0 = time.process_time(), time.perf_counter()
        generate(
            model,
            prompts,
            max_new_tokens=n,
            temperature=1.0,
            stop_token_ids=[],
            pad_token_id=1,
            return_logprobs=True,
        )
        return time.process_time() - c0, time.perf_counter() - w0

    run(n1)
    times: dict[int, list[tuple[float, float]]] = {n1: [], n2: []}
    for _ in range(repeats):
        for n in (n1, n2):
            times[n].append(run(n))
    cpu = [statistics.median(t[0] for t in times[n]) for n in (n1, n2)]
    wall = [statistics.median(t[1] for t in times[n]) for n in (n1, n2)]
    return 1e3 * (cpu[1] - cpu[0]) / (n2 - n1), 1e3 * (wall[1] - wall[0]) / (n2 - n1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        choices=["smollm2-135m", "qwen3-0.6b", "toy-llama"],
        help="a real shape (toy-llama: the smoke test's)",
    )
    parser.add_argument("--batch", type=int, default=16, help="sequences decoded together")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--context", type=int, default=40, help="cache length at the step timed")
    parser.add_argument("--repeats", type=int, default=20, help="rounds of the pieces")
    parser.add_argument(
        "--generator-tokens",
        type=int,
        nargs=3,
        default=(8, 24, 3),
        metavar=("N1", "N2", "REPEATS"),
        help="the generator's step from generate at N1 and N2 new tokens (REPEATS 0: skip)",
    )
    parser.add_argument("--blas-threads", type=int, default=None, help="(default: 1)")
    args = parser.parse_args(argv)
    if args.blas_threads is not None:
        from base_setup.backend import _OPENBLAS

        if "lib" in _OPENBLAS:
            _OPENBLAS["lib"].openblas_set_num_threads(args.blas_threads)

    load_before = os.getloadavg()
    model = build_model(args.model)
    pieces = decode_pieces(model, args.batch, args.prompt_len, args.context)
    figures = time_rounds(pieces, args.repeats)
    n1, n2, gen_repeats = args.generator_tokens
    if gen_repeats > 0:
        figures["generator step (generate, per token)"] = generator_step(
            model, args.batch, args.prompt_len, n1, n2, gen_repeats
        )
    load_after = os.getloadavg()

    floor_cpu, floor_wall = figures["matmul floor"]
    print(
        f"{args.model}, {args.batch} sequences, one token at a cache of {args.context}; "
        f"OpenBLAS threads {os.environ.get('OPENBLAS_NUM_THREADS', '?')}"
        f"{'' if args.blas_threads is None else f' -> {args.blas_threads}'}; medians of "
        f"{args.repeats} rounds (generator: {gen_repeats}); load average "
        f"{load_before[0]:.1f} -> {load_after[0]:.1f}"
    )
    print(f"{'piece':40s} {'CPU ms':>8s} {'x floor':>8s} {'wall ms':>8s} {'x floor':>8s}")
    for name, (cpu, wall) in figures.items():
        print(f"{name:40s} {cpu:8.2f} {cpu / floor_cpu:8.2f} {wall:8.2f} {wall / floor_wall:8.2f}")


if __name__ == "__main__":
    main()
