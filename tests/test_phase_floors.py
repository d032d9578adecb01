"""The phases' floors (benchmarks/phase_floors.py): the work counted from a model's shape against
a naive count over every matrix, token and layer; the roofline; the machine's limits; the growth
report and the doc's table."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest

from benchmarks import phase_floors as pf
from benchmarks.ppo_throughput import MODEL_SHAPES
from benchmarks.throughput_models import RealShape
from benchmarks.throughput_spec import SPLIT_KEYS, RunResult, RunSpec
from tests.test_benchmarks import _spec as benchmark_spec

TOY = cast(RealShape, MODEL_SHAPES["toy-llama"])


def _spec(**overrides: object) -> RunSpec:
    """tests/test_benchmarks' spec at the toy-llama shape, LoRA as the real shapes train."""
    toy_lora: dict = dict(
        label="toy-llama",
        model="toy-llama",
        batch_size=2,
        max_new_tokens=5,
        warmup=0,
        iterations=1,
        lora_rank=4,
        lora_alpha=8.0,
        lora_modules=("self_attn.q_proj",),
    )
    return benchmark_spec(**{**toy_lora, **overrides})


def _matrices(shape: RealShape) -> list[tuple[int, int]]:
    """Every (in, out) matrix one token goes through in one layer, written out."""
    d, hd = shape.hidden_size, shape.head_dim
    q, kv = shape.num_attention_heads * hd, shape.num_key_value_heads * hd
    i = shape.intermediate_size
    return [(d, q), (d, kv), (d, kv), (q, d), (d, i), (d, i), (i, d)]


def _naive_token_flops(shape: RealShape, context: int, head: bool) -> float:
    """FLOPs of one token attending to ``context`` positions: a multiply-add per weight, per
    layer; scores and weighted values per head and position; the head when asked."""
    flops = 0.0
    for _ in range(shape.num_hidden_layers):
        flops += sum(2 * a * b for a, b in _matrices(shape))
        for _ in range(shape.num_attention_heads):
            flops += 2 * context * shape.head_dim  # q . k for each position
            flops += 2 * context * shape.head_dim  # the weighted sum of the values
    if head:
        flops += 2 * shape.vocab_size * shape.hidden_size
    return flops


def test_smollm2_parameters_add_up_to_its_published_count() -> None:
    """SmolLM2-135M: 134,515,008 parameters, of which 35,136 are norms (not counted)."""
    shape = MODEL_SHAPES["smollm2-135m"]
    assert isinstance(shape, RealShape)
    norms = shape.num_hidden_layers * 2 * shape.hidden_size + shape.hidden_size
    assert pf.body_parameters(shape) + pf.head_parameters(shape) + norms == 134_515_008


def test_generation_work_equals_a_naive_count_token_by_token() -> None:
    limits = pf.Limits(bandwidth=1e9, peak_flops=1e10)
    prompts, new = [3, 5], 4
    got = pf.generation_work(TOY, prompts, new, limits)
    flops = 0.0
    seconds = 0.0
    weight_bytes = 4 * sum(
        a * b for _ in range(TOY.num_hidden_layers) for a, b in _matrices(TOY)
    ) + 4 * (TOY.vocab_size * TOY.hidden_size)
    for p in prompts:  # the prefill: position i sees i + 1 positions; the head at the last
        flops += sum(_naive_token_flops(TOY, i + 1, head=i == p - 1) for i in range(p))
    prefill = flops
    seconds += prefill / limits.peak_flops
    total_bytes = 0.0
    for step in range(1, new):
        step_flops = sum(_naive_token_flops(TOY, p + step, head=True) for p in prompts)
        cache = sum(
            TOY.num_hidden_layers * (p + step) * 2 * TOY.num_key_value_heads * TOY.head_dim * 4
            for p in prompts
        )
        step_bytes = weight_bytes + cache
        flops += step_flops
        total_bytes += step_bytes
        seconds += max(step_flops / limits.peak_flops, step_bytes / limits.bandwidth)
    assert got.flops == pytest.approx(flops)
    assert got.bytes == pytest.approx(total_bytes)
    assert got.seconds == pytest.approx(seconds)


@pytest.mark.parametrize("algorithm, bodies", [("ppo", 3), ("grpo", 2)])
def test_scoring_counts_each_pass_of_the_design(algorithm: str, bodies: int) -> None:
    """PPO: reference, value and reward bodies; GRPO (beta 0.04): reference and reward; the
    reference's head at the response positions only."""
    limits = pf.Limits(bandwidth=1e20, peak_flops=1e9)
    spec = _spec(algorithm=algorithm, group_size=1 if algorithm == "ppo" else 2)
    prompts = [3, 5]
    got = pf.scoring_work(TOY, spec, prompts, limits)
    body = 0.0
    for p in prompts:
        body += sum(_naive_token_flops(TOY, i + 1, head=False) for i in range(p + 5))
    head = 2 * TOY.vocab_size * TOY.hidden_size * len(prompts) * 5
    assert got.flops == pytest.approx(bodies * body + head)
    assert got.seconds == pytest.approx(got.flops / limits.peak_flops)


def test_update_counts_lora_full_and_checkpointed_backward_passes() -> None:
    limits = pf.Limits(bandwidth=1e20, peak_flops=1e9)
    prompts = [3, 5]
    forward = sum(
        sum(_naive_token_flops(TOY, i + 1, head=False) for i in range(p + 5)) for p in prompts
    )
    head = 2 * 2 * TOY.vocab_size * TOY.hidden_size * len(prompts) * 5  # logits, input grad
    grpo = _spec(algorithm="grpo", group_size=2)
    assert pf.update_work(TOY, grpo, prompts, limits).flops == pytest.approx(2 * forward + head)
    full = _spec(algorithm="grpo", group_size=2, lora_rank=0, lora_alpha=0.0, lora_modules=())
    assert pf.update_work(TOY, full, prompts, limits).flops == pytest.approx(3 * forward + head)
    checkpointed = _spec(algorithm="grpo", group_size=2, gradient_checkpointing=True)
    assert pf.update_work(TOY, checkpointed, prompts, limits).flops == pytest.approx(
        3 * forward + head
    )
    ppo = _spec()  # the LoRA policy and a fully trained value model
    assert pf.update_work(TOY, ppo, prompts, limits).flops == pytest.approx(
        2 * forward + head + 3 * forward
    )


def test_roofline_takes_the_slower_of_memory_and_compute() -> None:
    limits = pf.Limits(bandwidth=10.0, peak_flops=100.0)
    assert limits.roofline(1000.0, 10.0).seconds == 10.0  # compute: 10 s, memory 1 s
    assert limits.roofline(100.0, 50.0).seconds == 5.0  # memory: 5 s, compute 1 s


def test_measure_limits_gives_positive_rates() -> None:
    limits = pf.measure_limits(megabytes=8, repeats=1)
    assert set(limits) == {"copy_bandwidth", "gemv_bandwidth", "bandwidth", "matmul_flops"}
    assert all(v > 0 for v in limits.values())
    assert limits["bandwidth"] == max(limits["copy_bandwidth"], limits["gemv_bandwidth"])


def _result(spec: RunSpec, seconds: float, phases: dict[str, float]) -> RunResult:
    split = {k: [phases.get(k, 0.0)] for k in SPLIT_KEYS}
    limits = {"bandwidth": 1e10, "matmul_flops": 1e11, "copy_bandwidth": 1e10}
    limits["gemv_bandwidth"] = 5e9
    return RunResult(spec, [seconds], split, 1.0, 1.0, 1.0, limits=limits, prompt_tokens=[3, 5])


def test_growth_reports_only_phases_past_ten_percent() -> None:
    spec = _spec()
    before = _result(spec, 10.0, {"generation": 4.0, "scoring": 2.0, "update": 4.0})
    now = _result(spec, 10.8, {"generation": 4.2, "scoring": 2.5, "update": 4.1})
    other = _result(_spec(label="other"), 99.0, {"generation": 99.0})
    lines = pf.growth_lines([now, other], [before])
    assert lines == ["GREW: toy-llama ppo mlx scoring: 2.00 s -> 2.50 s (1.25x)"]
    assert pf.growth_lines([before], [now]) == []


def test_growth_beside_trl_and_a_changed_machine_is_said() -> None:
    """A slower machine slows both systems: our grown phase carries TRL's growth of the same
    phase, and a first line says the machine changed (another CPU, another matmul peak)."""
    ours, trl = _spec(), _spec(system="trl")
    before = [
        _result(ours, 10.0, {"generation": 4.0, "update": 4.0}),
        _result(trl, 12.0, {"generation": 5.0, "update": 6.0}),
    ]
    now = [
        _result(ours, 13.0, {"generation": 6.0, "update": 4.0}),
        _result(trl, 19.0, {"generation": 9.0, "update": 6.0}),
    ]
    lines = pf.growth_lines(now, before)
    assert lines[0] == (
        "GREW: toy-llama ppo mlx iteration: 10.00 s -> 13.00 s (1.30x); TRL's iteration: 1.58x"
    )
    assert lines[1].endswith("4.00 s -> 6.00 s (1.50x); TRL's generation: 1.80x")
    assert lines[2] == "GREW: toy-llama ppo trl iteration: 12.00 s -> 19.00 s (1.58x)"
    assert pf.machine_change(now, before) is None  # same device, same peak
    for run in before:
        run.versions["device"] = "Device(cpu, 0): Intel Xeon"
    for run in now:
        run.versions["device"] = "Device(cpu, 0): AMD EPYC"
        assert run.limits is not None
        run.limits["matmul_flops"] = 0.5e11
    note = pf.growth_lines(now, before)[0]
    assert note.startswith("NOTE: the machine changed (the baseline ran on Device(cpu, 0): Intel")
    assert "this run on Device(cpu, 0): AMD EPYC; matmul peak 100 -> 50 GFLOP/s" in note
    assert pf.growth_lines(before, before) == []  # nothing grew: no note either


def test_the_doc_table_replaces_only_the_text_between_its_markers(tmp_path: Path) -> None:
    doc = tmp_path / "performance.md"
    doc.write_text(f"before\n{pf.DOC_BEGIN}\nold table\n{pf.DOC_END}\nafter\n", encoding="utf-8")
    result = _result(_spec(), 3.0, {"generation": 1.0, "scoring": 1.0, "update": 1.0})
    rows = pf.floor_rows([result], MODEL_SHAPES)
    assert len(rows) == 1
    pf.write_doc(doc, pf.markdown_table(rows, "a test CPU"))
    text = doc.read_text(encoding="utf-8")
    assert text.startswith("before\n") and text.endswith("\nafter\n")
    assert "old table" not in text and "a test CPU" in text
    assert text.count("| toy-llama | ppo |") == 3  # generation, scoring, update
    doc.write_text("no markers\n", encoding="utf-8")
    with pytest.raises(ValueError, match="markers"):
        pf.write_doc(doc, ["x"])


def test_floor_rows_use_the_best_limits_any_worker_measured() -> None:
    fast = _result(_spec(), 3.0, {"generation": 1.0})
    slow = _result(_spec(algorithm="grpo", group_size=2), 3.0, {"generation": 1.0})
    assert slow.limits is not None
    slow.limits = {**slow.limits, "bandwidth": 1e9, "matmul_flops": 2e11}
    rows = pf.floor_rows([fast, slow], MODEL_SHAPES)
    assert {(r[2].bandwidth, r[2].peak_flops) for r in rows} == {(1e10, 2e11)}
    assert "10.0 GB/s, 200 GFLOP/s" in pf.limits_line(rows)


def test_floor_rows_skip_results_without_limits_or_a_real_shape() -> None:
    with_limits = _result(_spec(), 3.0, {"generation": 1.0})
    tiny = _result(_spec(model="toy", label="toy", lora_rank=0, lora_alpha=0.0), 3.0, {})
    bare = RunResult(_spec(), [1.0], {k: [0.1] for k in SPLIT_KEYS}, 1.0, 1.0, 1.0)
    trl = _result(_spec(system="trl"), 3.0, {})
    assert [r[0] for r in pf.floor_rows([with_limits, tiny, bare, trl], MODEL_SHAPES)] == [
        with_limits
    ]
