"""How far each phase of an iteration is from what this machine can do: its floor from memory
bandwidth and matmul peak, measured in the same process as the iteration.

Usage (``benchmarks.ppo_throughput`` prints the table after every run at the real shapes)::

    python -m benchmarks.ppo_throughput --no-medium --no-sweep --floors-doc docs/performance.md
    python -m benchmarks.ppo_throughput --chart-from runs/benchmarks/results.json \
        --floors-doc docs/performance.md

The first runs the benchmark (the real shapes measure the machine's limits) and rewrites the table
in docs/performance.md between its markers; the second does it from a saved run.

**The machine's limits** (:func:`measure_limits`, in the MLX worker, after its iterations): the
memory bandwidth, the best of a large array's copy into an array already in memory (read + write
counted) and of a matrix-vector product over a large float32 matrix (the weights read once, as a
decode step reads them); and the matmul peak, a 2048 x 2048 float32 product. Each is the best of
a few repeats. (Until 2026-12-02 the copy made a new array each time, and what it timed was the
kernel's first touch of its pages: 3-4 GB/s on the 2-core EPYC whose memory a summing loop reads
at 25-30 GB/s.)

**What each phase must do** (:func:`phase_work`), counted from the model's shape (a decoder:
attention with grouped KV heads, a gated MLP, an LM head of ``vocab x hidden``; norms and
element-wise work are not counted, so the floor is below what any implementation reaches):

* generation: a prefill over the prompts, then one decode step per new token that reads every
  weight once (float32) and the KV cache so far, and multiplies the batch's tokens through them.
  Each step's floor is the larger of its bytes / bandwidth and its FLOPs / peak (a roofline);
  the prefill's is its FLOPs / peak.
* scoring: the passes this design runs over the sequences (prompt + response) without gradients:
  the reference's (its body, and its LM head at the response positions), the reward model's
  (none with a reward function), and with PPO the value model's (bodies only: their heads are one
  scalar). With GRPO's ``beta`` 0 there is no reference pass. The policy's log-probs come from
  sampling: no pass.
* update: one forward and backward pass per model per minibatch: the policy's body forward, its
  LM head at the response positions (logits and their input gradient), the backward through the
  body (with LoRA, the input gradients only, about one forward's FLOPs; with full training, input
  and weight gradients, two forwards'), one more forward under gradient checkpointing, and with
  PPO the value model's forward and backward (full, or with ``value_init: shared`` adapters on
  the policy's base: input gradients only). Compute-bound: FLOPs / peak.

A phase's ratio is its measured median over its floor: 1 would be the machine's limit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping, Protocol, Sequence

from benchmarks.throughput_spec import GRPO_BETA, RunResult, RunSpec, find_result

#: Bytes of a float32 value: the benchmark's weights, caches and activations.
FLOAT32 = 4
#: The phases of an iteration that have a floor (``RunResult.split``'s keys).
PHASES = ("generation", "scoring", "update")
#: The markers between which docs/performance.md holds the table (:func:`write_doc`).
DOC_BEGIN = "<!-- phase-floors:begin (python -m benchmarks.ppo_throughput --floors-doc) -->"
DOC_END = "<!-- phase-floors:end -->"
#: A phase that grew by more than this fraction since the baseline run is reported.
GROWTH_REPORTED = 0.10
#: A best matmul peak that moved by more than this fraction between two runs: the machine changed.
MACHINE_CHANGE = 0.25


class DecoderShape(Protocol):
    """The sizes of a decoder that its work is counted from (``RealShape`` has them)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def num_hidden_layers(self) -> int: ...

    @property
    def num_attention_heads(self) -> int: ...

    @property
    def num_key_value_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def intermediate_size(self) -> int: ...


@dataclass(frozen=True)
class Work:
    """What a phase must do: FLOPs and bytes moved, and the seconds they take at the limits."""

    flops: float
    bytes: float
    seconds: float  # the floor

    def __add__(self, other: Work) -> Work:
        return Work(
            self.flops + other.flops, self.bytes + other.bytes, self.seconds + other.seconds
        )


@dataclass(frozen=True)
class Limits:
    """The machine's measured limits: bytes per second and float32 matmul FLOPs per second."""

    bandwidth: float
    peak_flops: float

    def roofline(self, flops: float, nbytes: float) -> Work:
        """The work of ``flops`` over ``nbytes`` (its floor: the slower of the two)."""
        return Work(flops, nbytes, max(flops / self.peak_flops, nbytes / self.bandwidth))


def body_parameters(shape: DecoderShape) -> int:
    """The parameters every token multiplies through, the LM head and embedding left out:
    per layer the attention's q, k, v, o and the gated MLP's three matrices (norms: none)."""
    d, hd = shape.hidden_size, shape.head_dim
    attention = d * hd * (2 * shape.num_attention_heads + 2 * shape.num_key_value_heads)
    mlp = 3 * d * shape.intermediate_size
    return shape.num_hidden_layers * (attention + mlp)


def head_parameters(shape: DecoderShape) -> int:
    """The LM head's parameters (vocabulary x hidden; tied or not, a decode step reads it)."""
    return shape.vocab_size * shape.hidden_size


def attention_flops(shape: DecoderShape, queries: int, context: int) -> float:
    """FLOPs of the scores and the weighted values of ``queries`` positions that each attend
    to ``context`` positions, over every layer (``2 * 2 * context * heads * head_dim`` each)."""
    per_query = 4 * context * shape.num_attention_heads * shape.head_dim
    return float(shape.num_hidden_layers * queries * per_query)


def causal_attention_flops(shape: DecoderShape, length: int) -> float:
    """FLOPs of causal attention over one sequence of ``length`` (position i sees i + 1)."""
    return attention_flops(shape, 1, length * (length + 1) // 2)


def kv_bytes(shape: DecoderShape, context: int) -> float:
    """Bytes of one sequence's float32 KV cache over ``context`` positions, every layer."""
    per_position = 2 * shape.num_key_value_heads * shape.head_dim * FLOAT32
    return float(shape.num_hidden_layers * context * per_position)


def generation_work(
    shape: DecoderShape, prompt_tokens: Sequence[int], new_tokens: int, limits: Limits
) -> Work:
    """Prefill over the prompts, then ``new_tokens`` decode steps for the batch (one sequence
    per entry of ``prompt_tokens``), each reading every weight and the KV cache so far."""
    body, head = body_parameters(shape), head_parameters(shape)
    batch = len(prompt_tokens)
    prefill_flops = sum(
        2 * body * p + causal_attention_flops(shape, p) + 2 * head for p in prompt_tokens
    )
    work = Work(prefill_flops, 0.0, prefill_flops / limits.peak_flops)
    for step in range(1, new_tokens):  # the prefill gave the first token's logits
        contexts = [p + step for p in prompt_tokens]
        flops = batch * 2 * (body + head) + sum(attention_flops(shape, 1, c) for c in contexts)
        nbytes = (body + head) * FLOAT32 + sum(kv_bytes(shape, c) for c in contexts)
        work = work + limits.roofline(flops, nbytes)
    return work


def body_pass_flops(shape: DecoderShape, lengths: Sequence[int]) -> float:
    """FLOPs of one pass of a model's body over sequences of ``lengths`` (no head)."""
    body = body_parameters(shape)
    return sum(2 * body * n + causal_attention_flops(shape, n) for n in lengths)


def scoring_work(
    shape: DecoderShape, spec: RunSpec, prompt_tokens: Sequence[int], limits: Limits
) -> Work:
    """The no-gradient passes: the reference (body and LM head at the response positions), the
    reward model, and PPO's value model (bodies: their heads are a scalar)."""
    lengths = [p + spec.max_new_tokens for p in prompt_tokens]
    responses = len(prompt_tokens) * spec.max_new_tokens
    body = body_pass_flops(shape, lengths)
    has_reference = spec.algorithm != "grpo" or GRPO_BETA > 0
    has_reward_model = spec.reward_function is None
    bodies = has_reward_model + (spec.algorithm == "ppo") + has_reference
    flops = bodies * body + has_reference * 2 * head_parameters(shape) * responses
    weights = (bodies * body_parameters(shape) + head_parameters(shape)) * FLOAT32
    return limits.roofline(flops, weights)


def update_work(
    shape: DecoderShape, spec: RunSpec, prompt_tokens: Sequence[int], limits: Limits
) -> Work:
    """One forward and backward per model (one epoch of one minibatch, the benchmark's): the
    policy's body (backward: input gradients with LoRA, input and weight gradients without; one
    more forward with gradient checkpointing), its LM head's logits and input gradient at the
    response positions; PPO's value model, fully trained."""
    lengths = [p + spec.max_new_tokens for p in prompt_tokens]
    responses = len(prompt_tokens) * spec.max_new_tokens
    forward = body_pass_flops(shape, lengths)
    backward = (1 if spec.uses_lora else 2) * forward
    recompute = forward if spec.gradient_checkpointing else 0.0
    policy = forward + backward + recompute + 2 * 2 * head_parameters(shape) * responses
    value = 0.0
    if spec.algorithm == "ppo":  # a full value model, or adapters on the policy's base
        value = forward + (forward if spec.value_init == "shared" else 2 * forward) + recompute
    models = 2 if spec.algorithm == "ppo" else 1
    weights = models * 2 * body_parameters(shape) * FLOAT32  # read forward and backward
    return limits.roofline(policy + value, weights)


def phase_work(
    shape: DecoderShape, spec: RunSpec, prompt_tokens: Sequence[int], limits: Limits
) -> dict[str, Work]:
    """Each phase's floor (:data:`PHASES`) for ``spec`` at ``shape``, with the rollout's
    prompts of ``prompt_tokens`` tokens (one entry per sequence)."""
    return {
        "generation": generation_work(shape, prompt_tokens, spec.max_new_tokens, limits),
        "scoring": scoring_work(shape, spec, prompt_tokens, limits),
        "update": update_work(shape, spec, prompt_tokens, limits),
    }


# ---------------------------------------------------------------------------- measuring


def timings(run: Callable[[], None], repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``run``, after one untimed call (allocation,
    page faults)."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return times


#: :func:`measure_limits` on small arrays, once: ``--smoke``'s (its code path in milliseconds;
#: the real runs' 256 MB arrays, five times, take seconds).
QUICK_LIMITS: dict[str, int] = {"megabytes": 8, "repeats": 1, "matmul": 512}


def measure_limits(megabytes: int = 256, repeats: int = 5, matmul: int = 2048) -> dict[str, float]:
    """This process's memory bandwidth and matmul peak (bytes and FLOPs per second):
    ``copy_bandwidth`` (an array of ``megabytes`` copied into another already in memory, with
    NumPy: read + write; a new array would time the first touch of its pages),
    ``gemv_bandwidth`` (a float32 matrix of ``megabytes`` times a vector on MLX's default device:
    the matrix read once), ``bandwidth`` (the larger), ``matmul_flops`` (``matmul`` x ``matmul``
    float32 on MLX's default device)."""
    import mlx.core as mx
    import numpy as np

    n = megabytes * 2**20 // FLOAT32
    source = np.random.default_rng(0).random(n, dtype=np.float32)
    target = np.zeros_like(source)  # its pages touched before any copy is timed
    cols = 4096
    matrix = mx.random.uniform(shape=(n // cols, cols))
    vector = mx.random.uniform(shape=(cols, 1))
    a = mx.random.uniform(shape=(matmul, matmul))
    b = mx.random.uniform(shape=(matmul, matmul))
    mx.eval(matrix, vector, a, b)
    copy = min(timings(lambda: np.copyto(target, source), repeats))
    gemv = min(timings(lambda: mx.eval(matrix @ vector), repeats))
    product = min(timings(lambda: mx.eval(a @ b), repeats))
    limits = {
        "copy_bandwidth": 2 * n * FLOAT32 / copy,
        "gemv_bandwidth": matrix.size * FLOAT32 / gemv,
        "matmul_flops": 2 * matmul**3 / product,
    }
    limits["bandwidth"] = max(limits["copy_bandwidth"], limits["gemv_bandwidth"])
    return limits


# ---------------------------------------------------------------------------- reporting


FloorRow = tuple[RunResult, dict[str, Work], Limits]


def floor_rows(results: Sequence[RunResult], shapes: Mapping[str, object]) -> list[FloorRow]:
    """The MLX results whose model is a real shape (``shapes[spec.model]`` a ``RealShape``) and
    that carry the machine's limits and their prompts' lengths, with each phase's floor. The
    limits are the best each worker of the run measured (one machine: a lower measurement is
    the noise of its moment, and the floor is what the machine can do)."""
    from benchmarks.throughput_models import RealShape

    kept: list[tuple[RunResult, RealShape, dict[str, float], list[int]]] = []
    for result in results:
        shape = shapes.get(result.spec.model)
        if result.spec.system != "mlx" or not isinstance(shape, RealShape):
            continue
        if result.limits is not None and result.prompt_tokens is not None:
            kept.append((result, shape, result.limits, result.prompt_tokens))
    if not kept:
        return []
    limits = Limits(
        max(m["bandwidth"] for _, _, m, _ in kept), max(m["matmul_flops"] for _, _, m, _ in kept)
    )
    return [
        (result, phase_work(shape, result.spec, prompts, limits), limits)
        for result, shape, _, prompts in kept
    ]


def _phase_cells(rows: Sequence[FloorRow]) -> Iterator[tuple[RunResult, str, float, Work, str]]:
    """Per row of :func:`floor_rows` and phase: the result, the phase, its measured median,
    its floor's work and what bounds that floor (the cells of both tables)."""
    for result, work, limits in rows:
        for phase in PHASES:
            yield result, phase, result.split_median(phase), work[phase], _bound(
                work[phase], limits
            )


def floor_lines(rows: Sequence[FloorRow]) -> list[str]:
    """The printed table of :func:`floor_rows`: per configuration and phase, the measured
    median, the floor, the ratio, and what bounds the floor."""
    head = (
        f"{'config':<12} {'algo':<5} {'phase':<10} {'time s':>8} {'floor s':>8} {'ratio':>6} "
        f"{'GFLOP':>8} {'GB':>7}  bound"
    )
    lines = [head, "-" * len(head)]
    for result, phase, measured, w, bound in _phase_cells(rows):
        lines.append(
            f"{result.spec.label:<12} {result.spec.algorithm:<5} {phase:<10} "
            f"{measured:>8.2f} {w.seconds:>8.2f} {measured / w.seconds:>6.1f} "
            f"{w.flops / 1e9:>8.0f} {w.bytes / 1e9:>7.1f}  {bound}"
        )
    return lines


def _bound(work: Work, limits: Limits) -> str:
    memory = work.bytes / limits.bandwidth
    compute = work.flops / limits.peak_flops
    return "memory" if memory > compute else "compute"


def limits_line(rows: Sequence[FloorRow]) -> str:
    """The limits each worker measured (they should agree on a quiet machine), and the best,
    which the floors use."""
    if not rows:
        return "no worker measured the machine's limits"
    best = rows[0][2]
    parts = []
    for result, _, _ in rows:
        assert result.limits is not None
        lim = result.limits
        parts.append(
            f"{result.spec.label} {result.spec.algorithm}: copy {lim['copy_bandwidth'] / 1e9:.1f}"
            f" GB/s, gemv {lim['gemv_bandwidth'] / 1e9:.1f} GB/s, matmul "
            f"{lim['matmul_flops'] / 1e9:.0f} GFLOP/s"
        )
    return (
        f"floors at the best limits the workers measured: {best.bandwidth / 1e9:.1f} GB/s, "
        f"{best.peak_flops / 1e9:.0f} GFLOP/s (each worker: " + "; ".join(parts) + ")"
    )


def markdown_table(rows: Sequence[FloorRow], machine: str) -> list[str]:
    """The table of docs/performance.md (between :data:`DOC_BEGIN` and :data:`DOC_END`)."""
    lines = [
        DOC_BEGIN,
        f"Measured on {machine}; {limits_line(rows)}.",
        "",
        "| shape | algorithm | phase | measured s | floor s | measured / floor | floor bound by |",
        "|---|---|---|---|---|---|---|",
    ]
    for result, phase, measured, w, bound in _phase_cells(rows):
        lines.append(
            f"| {result.spec.label} | {result.spec.algorithm} | {phase} | {measured:.1f} | "
            f"{w.seconds:.1f} | {measured / w.seconds:.1f} | {bound} |"
        )
    return [*lines, DOC_END]


def markers_problem(path: Path, text: str) -> str | None:
    """Why ``text`` (``path``'s) cannot take the table: no :data:`DOC_BEGIN` ...
    :data:`DOC_END` markers in that order; None when it can."""
    begin, end = text.find(DOC_BEGIN), text.find(DOC_END)
    if begin < 0 or end < begin:
        return f"{path} has no {DOC_BEGIN!r} ... {DOC_END!r} markers: add them where the table goes"
    return None


def write_doc(path: Path, table: Sequence[str]) -> None:
    """Replace the text between the markers in ``path`` with ``table`` (markers included).

    Raises:
        ValueError: ``path`` lacks the markers (say where the table goes by adding them).
    """
    text = path.read_text(encoding="utf-8")
    problem = markers_problem(path, text)
    if problem is not None:
        raise ValueError(problem)
    begin, end = text.find(DOC_BEGIN), text.find(DOC_END)
    updated = text[:begin] + "\n".join(table) + text[end + len(DOC_END) :]
    path.write_text(updated, encoding="utf-8")


def _phase_seconds(result: RunResult) -> list[tuple[str, float]]:
    """The iteration's median seconds and each measured phase's."""
    return [("iteration", result.median)] + [
        (phase, result.split_median(phase)) for phase in PHASES if result.split.get(phase)
    ]


def machine_change(results: Sequence[RunResult], baseline: Sequence[RunResult]) -> str | None:
    """Why a growth against ``baseline`` may be the machine's rather than the code's: the workers
    ran on another CPU, or measured a matmul peak more than :data:`MACHINE_CHANGE` away; None when
    neither (or when the runs did not record it)."""

    def devices(runs: Sequence[RunResult]) -> set[str]:
        return {r.versions["device"] for r in runs if r.versions.get("device")}

    def peak(runs: Sequence[RunResult]) -> float | None:
        peaks = [r.limits["matmul_flops"] for r in runs if r.limits and "matmul_flops" in r.limits]
        return max(peaks, default=None)

    reasons = []
    was, now = devices(baseline), devices(results)
    if was and now and was != now:
        reasons.append(
            f"the baseline ran on {', '.join(sorted(was))}, this run on {', '.join(sorted(now))}"
        )
    peak_was, peak_now = peak(baseline), peak(results)
    if peak_was and peak_now and abs(peak_now / peak_was - 1) > MACHINE_CHANGE:
        reasons.append(f"matmul peak {peak_was / 1e9:.0f} -> {peak_now / 1e9:.0f} GFLOP/s")
    if not reasons:
        return None
    return (
        f"NOTE: the machine changed ({'; '.join(reasons)}): where TRL's same phase grew as much, "
        "the growth is the machine's"
    )


def growth_lines(results: Sequence[RunResult], baseline: Sequence[RunResult]) -> list[str]:
    """Each phase (and iteration) of ``results`` that grew by more than
    :data:`GROWTH_REPORTED` against the same configuration and system in ``baseline``.

    A line of ours says how much TRL's same phase grew where both runs measured TRL (the
    control: a slower machine slows both), and a first line says so when the machine changed
    (:func:`machine_change`)."""
    lines = []
    for result in results:
        spec = result.spec
        before = find_result(baseline, spec.label, spec.algorithm, spec.system)
        if before is None:
            continue
        control: dict[str, float] = {}
        if spec.system != "trl":
            trl_now = find_result(results, spec.label, spec.algorithm, "trl")
            trl_was = find_result(baseline, spec.label, spec.algorithm, "trl")
            if trl_now is not None and trl_was is not None:
                was_trl = dict(_phase_seconds(trl_was))
                control = {
                    name: now / was_trl[name]
                    for name, now in _phase_seconds(trl_now)
                    if was_trl.get(name, 0.0) > 0
                }
        was_seconds = dict(_phase_seconds(before))
        for name, now in _phase_seconds(result):
            was = was_seconds.get(name, 0.0)
            if was > 0 and now > was * (1 + GROWTH_REPORTED):
                line = (
                    f"GREW: {spec.label} {spec.algorithm} {spec.system} {name}: {was:.2f} s -> "
                    f"{now:.2f} s ({now / was:.2f}x)"
                )
                if name in control:
                    line += f"; TRL's {name}: {control[name]:.2f}x"
                lines.append(line)
    note = machine_change(results, baseline)
    return [note, *lines] if lines and note else lines
