"""The throughput benchmark: its smoke run end to end, and the pieces it is built from."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from benchmarks import ppo_throughput
from benchmarks.ppo_throughput import (
    MODEL_SHAPES,
    REAL_LORA_MODULES,
    REAL_MODELS,
    build_plan,
    design_floor,
    main,
    parse_args,
    scaling_points,
)
from benchmarks.throughput_models import (
    RealShape,
    benchmark_prompts,
    build_benchmark_checkpoints,
    pad_vocabulary,
    real_config,
)
from benchmarks.throughput_spec import (
    FLOOR_KEYS,
    PHASE_NAMES,
    SPLIT_KEYS,
    CpuMonitor,
    RunResult,
    RunSpec,
    System,
    reset_peak_rss,
)
from benchmarks.throughput_worker import PARENT_ENV
from fixtures.tiny_model import TINY_SIZES, build_checkpoint


def _spec(**overrides: object) -> RunSpec:
    fields: dict = dict(
        system="mlx",
        algorithm="ppo",
        label="tiny",
        model="tiny",
        policy_dir="/p",
        reward_dir="/r",
        prompts=("a", "b", "c", "d"),
        batch_size=4,
        group_size=1,
        max_new_tokens=8,
        warmup=1,
        iterations=3,
    )
    fields.update(overrides)
    return RunSpec(**fields)


def _result(
    spec: RunSpec, seconds: list[float], floor: dict[str, float] | None = None
) -> RunResult:
    split = {k: [0.1] * len(seconds) for k in SPLIT_KEYS}
    return RunResult(spec, seconds, split, 100.0, 10.0, 1.0, floor=floor)


def test_a_missing_baseline_is_refused_before_any_run(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--smoke", "--baseline", str(tmp_path / "none.json")])


def test_a_floors_doc_without_its_markers_is_refused_before_any_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.phase_floors import DOC_BEGIN, DOC_END

    with pytest.raises(SystemExit):
        parse_args(["--smoke", "--floors-doc", str(tmp_path / "none.md")])
    assert "no such file" in capsys.readouterr().err
    doc = tmp_path / "perf.md"
    doc.write_text("# Performance\n", encoding="utf-8")
    with pytest.raises(SystemExit):
        parse_args(["--smoke", "--floors-doc", str(doc)])
    assert "markers" in capsys.readouterr().err
    doc.write_text(f"# Performance\n{DOC_BEGIN}\nold\n{DOC_END}\n", encoding="utf-8")
    assert parse_args(["--smoke", "--floors-doc", str(doc)]).floors_doc == doc


@pytest.mark.slow
def test_smoke_run_prints_every_section_and_skips_trl_when_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real_version = importlib.metadata.version

    def version(name: str) -> str:
        if name == "trl":
            raise importlib.metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    from benchmarks.phase_floors import DOC_BEGIN, DOC_END

    doc = tmp_path / "performance.md"
    doc.write_text(f"# Performance\n{DOC_BEGIN}\n{DOC_END}\n", encoding="utf-8")
    smoke = ["--smoke", "--compare", "trl", "--out", str(tmp_path), "--floors-doc", str(doc)]
    results = main(smoke)
    out = capsys.readouterr().out

    skipped = next(line for line in out.splitlines() if line.startswith("--compare trl skipped"))
    assert "trl" in skipped and "not installed" in skipped  # (torch may be missing too)
    assert "requirements-bench.txt" in out
    for section in (
        "== Machine ==",
        "== Iterations ==",
        "== Floor (MLX",
        "== Scaling with response length (PPO) ==",
        "== Scaling with batch size (PPO) ==",
        "== Phases beside the machine's floor",
        "== Peak memory by phase (MLX) ==",
    ):
        assert section in out
    # The real shapes' path measured the machine's limits; the doc's table has their phases.
    assert all((r.limits is not None) == (r.spec.label == "toy-llama") for r in results)
    floors_table = doc.read_text(encoding="utf-8")
    for algorithm in ("ppo", "grpo"):
        for phase in ("generation", "scoring", "update"):
            assert f"| toy-llama | {algorithm} | {phase} |" in floors_table
    # A second run compares itself with the first (its results.json): the growth section.
    baseline = str(tmp_path / "results.json")
    main(["--smoke", "--no-real", "--out", str(tmp_path / "second"), "--baseline", baseline])
    assert f"== Against the baseline ({baseline}" in capsys.readouterr().out
    assert "== MLX / TRL" not in out
    # The real shapes' path at toy sizes (toy-llama, LoRA), the two main configurations (PPO,
    # GRPO) and the two sweep points, MLX only, 2 timed iterations.
    assert [(r.spec.algorithm, r.spec.label) for r in results] == [
        ("ppo", "toy-llama"),
        ("grpo", "toy-llama"),
        ("ppo", "toy"),
        ("grpo", "toy"),
        ("ppo", "tokens=8"),
        ("ppo", "batch=2"),
    ]
    for r in results:
        assert r.spec.system == "mlx"
        assert len(r.seconds) == 2 and all(s > 0 for s in r.seconds)
        # the parts of an iteration add up to its wall time
        for i, wall in enumerate(r.seconds):
            assert sum(r.split[k][i] for k in SPLIT_KEYS) == pytest.approx(wall, rel=1e-6)
        assert r.mlx_peak_mb is not None and r.mlx_peak_mb > 0
        # Each phase's peaks: none above the run's, the largest MLX one the run's own (the
        # phases cover the timed iterations but for the prompts' preparation).
        assert r.phase_peaks is not None and list(r.phase_peaks) == list(PHASE_NAMES)
        arrays = [peak["mlx_mb"] for peak in r.phase_peaks.values()]
        assert all(a is not None and 0 < a <= r.mlx_peak_mb for a in arrays)
        assert max(a for a in arrays if a is not None) == pytest.approx(r.mlx_peak_mb, rel=0.05)
        if reset_peak_rss():  # where the worker could reset VmHWM between phases (Linux)
            resident = [peak["rss_mb"] for peak in r.phase_peaks.values()]
            assert all(m is not None and 0 < m <= r.peak_rss_mb for m in resident)
        assert r.trainable_millions is not None and r.trainable_millions > 0
        lora = r.spec.label == "toy-llama"
        assert r.spec.uses_lora == lora
        assert r.spec.lora_modules == (REAL_LORA_MODULES if lora else ())
        # LoRA trains a fraction of the policy (its adapters), full-weight training all of it
        if lora:
            assert r.trainable_millions < 0.5 * r.params_millions
        else:
            assert r.trainable_millions == pytest.approx(r.params_millions)
    floors = [r.floor for r in results]
    assert floors[4] is None and floors[5] is None  # the floor is measured for main configs only
    for floor in floors[:4]:
        assert floor is not None and set(floor) == set(FLOOR_KEYS)
        assert all(v > 0 for v in floor.values())
    png = tmp_path / "ppo_throughput.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [item["spec"]["label"] for item in saved] == [
        "toy-llama",
        "toy-llama",
        "toy",
        "toy",
        "tokens=8",
        "batch=2",
    ]
    report = (tmp_path / "report.txt").read_text()
    assert report.startswith("== Machine ==") and "== Iterations ==" in report
    assert "== Scaling with batch size (PPO) ==" in report
    lora_line = next(line for line in report.splitlines() if line.startswith("LoRA (toy-llama"))
    assert "rank 16, alpha 32" in lora_line and "q_proj/k_proj/v_proj/o_proj" in lora_line
    # the real shapes' path trains with gradient checkpointing (Qwen3-0.6B's needs it), the tiny
    # ones without
    assert [r.spec.gradient_checkpointing for r in results] == [True, True, *[False] * 4]
    assert "gradient checkpointing (toy-llama): on both systems" in report
    # every row prints peak RSS, MLX's peak array memory and their ratio
    table = report.split("== Iterations ==")[1].split("\n\n")[0].splitlines()
    assert "RSS/MLX" in next(line for line in table if line.startswith("config"))
    for r in results:
        row = next(
            line for line in table if line.startswith(f"{r.spec.label:<12} {r.spec.algorithm}")
        )
        assert r.mlx_peak_mb is not None
        assert f"{r.peak_rss_mb / r.mlx_peak_mb:.2f}" in row.split("|")[-1]
    # the tables and the chart again from results.json alone, without a run
    capsys.readouterr()
    again = main(["--chart-from", str(tmp_path / "results.json"), "--out", str(tmp_path / "again")])
    reprinted = capsys.readouterr().out
    assert "== Iterations ==" in reprinted and "== Floor" in reprinted
    assert [(r.spec.label, r.spec.algorithm, r.seconds, r.split) for r in again] == [
        (r.spec.label, r.spec.algorithm, r.seconds, r.split) for r in results
    ]
    assert all(r.spec.prompts[0] == ppo_throughput.PROMPTS_NOT_SAVED for r in again)
    assert (tmp_path / "again" / "ppo_throughput.png").read_bytes()[:4] == b"\x89PNG"


def test_multi_turn_benchmark_prefills_each_token_once_with_the_cache_kept(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from benchmarks import multi_turn

    batch, prompt, turns, context = 2, 4, 2, 3
    multi_turn.main(
        ["--model", "toy-llama", "--batch", str(batch), "--prompt", str(prompt)]
        + ["--turns", str(turns), "--turn-tokens", "4", "--context", str(context)]
        + ["--max-new-tokens", "64", "--repeats", "1"]
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == [
        *("CPU", "s/turn", "wall", "s/turn", "CPU", "ms/token"),
        *("turns", "policy", "tok", "prefilled"),
    ]
    rows = {line[:22].strip(): [float(x) for x in line[22:].split()] for line in lines[2:]}
    assert set(rows) == {"KV cache kept", "re-prefill each turn"}
    kept, again = rows["KV cache kept"], rows["re-prefill each turn"]
    for name, (cpu_turn, wall_turn, cpu_token, n_turns, policy, prefilled) in rows.items():
        assert 0 < cpu_turn < 60 and 0 < wall_turn < 60 and 0 < cpu_token < 60_000, name
        assert n_turns == batch * turns, name  # the budget has room for every turn
        assert policy >= n_turns  # a turn samples at least its stop token
    # Kept: each prompt and tool token prefilled once. Re-prefilled: every turn prefills its
    # episode's prompt again, and its history.
    assert kept[5] == batch * prompt + batch * (turns - 1) * context
    assert again[5] >= batch * turns * prompt + batch * (turns - 1) * context
    assert again[5] > kept[5]


@pytest.mark.slow
def test_qlora_reward_worker_keeps_the_4bit_base_quantized_or_dequantizes_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from benchmarks.qlora_reward import worker
    from fixtures.checkpoint_families import quantize_checkpoint

    q4 = quantize_checkpoint(tiny_model_dir, tmp_path / "q4")
    results = {}
    for keep in (True, False):
        spec = dict(checkpoint=str(q4), keep_quantized=keep, batch_size=2, steps=2)
        results[keep] = worker({**spec, "output_dir": str(tmp_path / f"run_{keep}")})
    kept, dequantized = results[True], results[False]
    assert kept["quantized_layers"] > 0 and dequantized["quantized_layers"] == 0
    assert kept["weights_mb"] < dequantized["weights_mb"]
    for result in (kept, dequantized):
        assert len(result["step_seconds"]) == 2 and min(result["step_seconds"]) > 0
        assert result["load_peak_mb"] > 0 and result["mlx_peak_mb"] > 0


def test_full_plan_leads_with_the_real_shapes_with_lora_and_fewer_iterations(
    tmp_path: Path,
) -> None:
    plan = build_plan(parse_args([]))
    real = [
        (c.label, c.algorithm, c.batch_size, c.group_size, c.max_new_tokens) for c in plan.main[:4]
    ]
    assert real == [
        ("smollm2-135m", "ppo", 16, 1, 128),
        ("smollm2-135m", "grpo", 4, 4, 128),
        ("qwen3-0.6b", "ppo", 16, 1, 128),
        ("qwen3-0.6b", "grpo", 4, 4, 128),
    ]
    assert [c.label for c in plan.main[4:]] == ["tiny", "tiny", "medium", "medium"]
    dirs = {m: (tmp_path / "p", tmp_path / "r", ["x"] * 16) for m in (*REAL_MODELS, "tiny")}
    systems: tuple[System, ...] = ("mlx", "trl")
    for system in systems:
        spec = ppo_throughput._spec(plan.main[0], system, plan, dirs, measure_floor=True)
        assert (spec.warmup, spec.iterations) == (1, 2)
        assert (spec.lora_rank, spec.lora_alpha, spec.lora_modules) == (16, 32.0, REAL_LORA_MODULES)
        assert not spec.measure_floor  # the real shapes' floor only with --real-floor
    tiny = ppo_throughput._spec(plan.main[4], "mlx", plan, dirs, measure_floor=True)
    assert not tiny.uses_lora and tiny.measure_floor and (tiny.warmup, tiny.iterations) == (2, 5)

    floor_plan = build_plan(parse_args(["--real-floor", "--real-models", "qwen3-0.6b"]))
    assert {c.label for c in floor_plan.main} == {"qwen3-0.6b", "tiny", "medium"}
    spec = ppo_throughput._spec(floor_plan.main[0], "mlx", floor_plan, dirs, measure_floor=True)
    assert spec.measure_floor
    full_plan = build_plan(parse_args(["--real-full", "--real-models", "smollm2-135m"]))
    assert [(c.label, c.algorithm) for c in full_plan.main[:2]] == [
        ("smollm2-135m full", "ppo"),
        ("smollm2-135m full", "grpo"),
    ]
    for system in systems:  # every weight of the policy, on both sides
        spec = ppo_throughput._spec(full_plan.main[0], system, full_plan, dirs, measure_floor=True)
        assert not spec.uses_lora and spec.model == "smollm2-135m"
        assert (spec.warmup, spec.iterations) == (1, 2)
    no_real = build_plan(parse_args(["--no-real"]))
    assert {c.label for c in no_real.main} == {"tiny", "medium"}
    assert [c.label for c in build_plan(parse_args(["--smoke", "--no-real"])).main] == [
        "toy",
        "toy",
    ]


def _parameter_count(shape: RealShape) -> int:
    """Parameters of the mlx-lm model of ``shape`` (built lazily: nothing is allocated)."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from models.checkpoint_config import config_updates

    config = real_config(shape).to_dict()
    config.update(config_updates(config))
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    flat = cast(list[tuple[str, Any]], tree_flatten(model.parameters()))
    return sum(v.size for _, v in flat)


def test_real_shapes_are_the_published_architectures() -> None:
    smol, qwen = MODEL_SHAPES["smollm2-135m"], MODEL_SHAPES["qwen3-0.6b"]
    assert isinstance(smol, RealShape) and isinstance(qwen, RealShape)
    assert (smol.model_type, smol.vocab_size, smol.num_hidden_layers) == ("llama", 49152, 30)
    assert (qwen.model_type, qwen.vocab_size, qwen.num_hidden_layers) == ("qwen3", 151936, 28)
    assert smol.tie_word_embeddings and qwen.tie_word_embeddings
    # The published parameter counts: SmolLM2-135M 134,515,008; Qwen3-0.6B 596,049,920.
    assert _parameter_count(smol) == 134_515_008
    assert _parameter_count(qwen) == 596_049_920


def test_real_checkpoint_loads_in_our_loader_with_its_config_and_vocabulary(
    tmp_path: Path,
) -> None:
    from mlx.utils import tree_flatten
    from tokenizers import Tokenizer

    from models.policy_model import PolicyModel
    from models.reward_model import RewardModel

    shape = MODEL_SHAPES["toy-llama"]
    assert isinstance(shape, RealShape)
    policy_dir, reward_dir = build_benchmark_checkpoints(tmp_path / "m", shape)
    config = json.loads((policy_dir / "config.json").read_text())
    # what current transformers writes: rope_parameters, no top-level rope_theta
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["rope_parameters"]["rope_theta"] == shape.rope_theta
    assert "rope_theta" not in config and config["dtype"] == "float32"
    assert config["vocab_size"] == shape.vocab_size and config["tie_word_embeddings"]
    tokenizer = Tokenizer.from_file(str(policy_dir / "tokenizer.json"))
    assert tokenizer.get_vocab_size(with_added_tokens=True) == shape.vocab_size
    reward_config = json.loads((reward_dir / "config.json").read_text())
    assert reward_config["architectures"] == ["LlamaForSequenceClassification"]

    policy = PolicyModel.from_pretrained(str(policy_dir), dtype="float32")
    assert policy.config["vocab_size"] == shape.vocab_size
    flat = cast(list[tuple[str, Any]], tree_flatten(policy.parameters()))
    assert _parameter_count(shape) == sum(v.size for _, v in flat)
    reward = RewardModel.from_pretrained(str(reward_dir), dtype="float32")
    assert reward.head.weight.shape == (1, shape.hidden_size)
    # prompt building works on the padded tokenizer: 12 to 16 tokens, no padding token in them
    prompts = benchmark_prompts(policy_dir, 8)
    for prompt in prompts:
        ids = tokenizer.encode(prompt, add_special_tokens=False).ids
        assert 11 <= len(ids) <= 17 and max(ids) < 1000


def test_missing_compare_requirements_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    def version(name: str) -> str:
        if name == "torch":
            raise importlib.metadata.PackageNotFoundError(name)
        return "1.0"

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert ppo_throughput.missing_compare_requirements() == "torch is not installed"

    def version_without_torch_and_trl(name: str) -> str:
        if name in ("torch", "trl"):
            raise importlib.metadata.PackageNotFoundError(name)
        return "1.0"

    monkeypatch.setattr(importlib.metadata, "version", version_without_torch_and_trl)
    assert ppo_throughput.missing_compare_requirements() == "torch, trl are not installed"
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.0")
    assert ppo_throughput.missing_compare_requirements() is None


def test_pad_vocabulary_grows_tokenizer_embedding_and_config(tmp_path: Path) -> None:
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    model_dir = build_checkpoint(tmp_path / "m", TINY_SIZES["test"], seed=0)
    before = load_file(str(model_dir / "model.safetensors"))["model.embed_tokens.weight"]
    have = before.shape[0]
    pad_vocabulary(model_dir, have + 40, seed=3)

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tokenizer.get_vocab_size(with_added_tokens=True) == have + 40
    after = load_file(str(model_dir / "model.safetensors"))["model.embed_tokens.weight"]
    assert after.shape == (have + 40, before.shape[1])
    np.testing.assert_array_equal(after[:have], before)  # old rows untouched
    new_std = after[have:].std()
    assert 0.5 < new_std / (2.5 / np.sqrt(before.shape[1])) < 1.5  # drawn like the others
    config = json.loads((model_dir / "config.json").read_text())
    assert config["vocab_size"] == have + 40
    # every added id decodes to text that encodes back to that one id
    for token_id in (have, have + 17, have + 39):
        text = tokenizer.decode([token_id])
        assert tokenizer.encode(text, add_special_tokens=False).ids == [token_id]
    with pytest.raises(ValueError, match="more than"):
        pad_vocabulary(model_dir, have, seed=0)


def test_benchmark_prompts_have_12_to_16_tokens(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    model_dir = build_checkpoint(tmp_path / "m", TINY_SIZES["test"], seed=0)
    prompts = benchmark_prompts(model_dir, 10)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    lengths = [len(tokenizer.encode(p, add_special_tokens=False).ids) for p in prompts]
    assert len(set(prompts)) == 10
    assert all(11 <= n <= 17 for n in lengths)  # 12 + i % 5 tokens, +-1 after re-encoding
    assert abs(np.mean(lengths) - 14) < 1


def test_design_floor_counts_the_models_each_algorithm_runs() -> None:
    floor = {
        "sample": 1.0,
        "lm_forward": 0.1,
        "head_forward": 0.01,
        "lm_train_step": 0.3,
        "head_train_step": 0.03,
    }
    ppo = _result(_spec(), [2.0], floor)
    # PPO: sampling + reference LM + value and reward heads + policy and value updates
    assert design_floor(ppo) == pytest.approx((1.4, 1.0 + 0.1 + 0.02 + 0.3 + 0.03))
    grpo = _result(_spec(algorithm="grpo", group_size=2), [2.0], floor)
    assert design_floor(grpo) == pytest.approx((1.4, 1.0 + 0.1 + 0.01 + 0.3))
    with pytest.raises(ValueError, match="no floor"):
        design_floor(_result(_spec(), [1.0]))


def test_scaling_points_join_the_main_config_and_the_sweep() -> None:
    base = _result(_spec(max_new_tokens=32), [1.0])
    base_trl = _result(_spec(system="trl", max_new_tokens=32), [2.0])
    long = _result(_spec(label="tokens=64", max_new_tokens=64), [1.5])
    small = _result(_spec(label="batch=2", batch_size=2, max_new_tokens=32), [0.5])
    grpo = _result(_spec(algorithm="grpo", group_size=2, max_new_tokens=32), [9.0])
    results = [base, base_trl, grpo, long, small]
    tokens = scaling_points(results, "tokens")
    assert [(x, o.median, t.median if t else None) for x, o, t in tokens] == [
        (32, 1.0, 2.0),
        (64, 1.5, None),
    ]
    batch = scaling_points(results, "batch")
    assert [(x, o.median) for x, o, _ in batch] == [(2, 0.5), (4, 1.0)]
    assert scaling_points([base, grpo], "tokens") == []  # no sweep, no points


def test_run_spec_and_result_round_trip_through_json() -> None:
    spec = _spec(measure_floor=True)
    assert RunSpec.from_json(spec.to_json()) == spec
    lora = _spec(lora_rank=16, lora_alpha=32.0, lora_modules=("self_attn.q_proj",))
    assert RunSpec.from_json(lora.to_json()) == lora and lora.uses_lora
    assert spec.rollout_size == 4 and spec.tokens_per_iteration == 32
    result = _result(spec, [1.0, 3.0, 2.0], {k: 0.5 for k in FLOOR_KEYS})
    back = RunResult.from_json(result.to_json())
    assert back == result
    assert back.median == 2.0 and back.tokens_per_second == 16.0


def test_run_spec_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="at least that many prompts"):
        _spec(batch_size=5)
    with pytest.raises(ValueError, match="iterations >= 1"):
        _spec(iterations=0)
    with pytest.raises(ValueError, match="group_size >= 2"):
        _spec(algorithm="grpo", group_size=1)
    with pytest.raises(ValueError, match="runs only 'grpo'"):
        _spec(system="mlx-lm-lora")
    with pytest.raises(ValueError, match="lora_rank must be >= 0"):
        _spec(lora_rank=-1)
    with pytest.raises(ValueError, match="needs lora_alpha > 0 and lora_modules"):
        _spec(lora_rank=8, lora_alpha=16.0)
    with pytest.raises(ValueError, match="trains full weights"):
        _spec(system="mlx-lm-lora", algorithm="grpo", group_size=2, lora_rank=8)
    with pytest.raises(ValueError, match="device must be 'cpu' or 'gpu'"):
        _spec(device="cuda")
    with pytest.raises(ValueError, match="tf32 is a GPU setting"):
        _spec(tf32=True)
    with pytest.raises(ValueError, match="reward_function is the MLX worker's"):
        _spec(reward_function="repetition_penalty")  # the value model would need the checkpoint
    lora = dict(lora_rank=8, lora_alpha=16.0, lora_modules=("self_attn.q_proj",))
    with pytest.raises(ValueError, match="reward_function is the MLX worker's"):
        _spec(system="trl", reward_function="repetition_penalty", **lora)
    shared = _spec(value_init="shared", reward_function="repetition_penalty", **lora)
    assert RunSpec.from_json(shared.to_json()) == shared
    with pytest.raises(ValueError, match="share_reward_base is the MLX worker's"):
        _spec(share_reward_base=True)  # a full-weight policy
    with pytest.raises(ValueError, match="share_reward_base is the MLX worker's"):
        _spec(share_reward_base=True, value_init="shared", reward_function="x", **lora)
    one_base = _spec(share_reward_base=True, value_init="shared", **lora)
    assert RunSpec.from_json(one_base.to_json()) == one_base


def test_device_and_tf32_travel_from_the_arguments_to_every_spec() -> None:
    args = ppo_throughput.parse_args(["--device", "gpu", "--tf32", "--no-medium", "--no-sweep"])
    plan = ppo_throughput.build_plan(args)
    assert (plan.device, plan.tf32) == ("gpu", True)
    smoke = ppo_throughput.build_plan(ppo_throughput.parse_args(["--smoke", "--device", "gpu"]))
    assert (smoke.device, smoke.tf32) == ("gpu", False)
    dirs = {c.model: (Path("/p"), Path("/r"), ["a"] * 16) for c in plan.main}
    for config in plan.main:
        for system in ("mlx", "trl"):
            spec = ppo_throughput._spec(config, system, plan, dirs, measure_floor=False)
            assert (spec.device, spec.tf32) == ("gpu", True)
            assert RunSpec.from_json(spec.to_json()) == spec
    with pytest.raises(SystemExit):
        ppo_throughput.parse_args(["--tf32"])  # a GPU setting without --device gpu


def test_machine_lines_name_the_gpu_and_the_backend_on_the_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ppo_throughput, "gpu_name", lambda: "NVIDIA H200, 143771 MiB")
    cpu = "\n".join(ppo_throughput.machine_lines(True))
    assert "GPU:" not in cpu and "(CPU backend)" in cpu and "torch.set_num_threads" in cpu
    gpu = "\n".join(ppo_throughput.machine_lines(True, device="gpu", tf32=True))
    assert (
        "GPU: NVIDIA H200, 143771 MiB (both systems compute there; float32 matmuls in TF32)" in gpu
    )
    assert "PyTorch" in gpu and "(CUDA)" in gpu and "(CPU backend)" not in gpu


def test_gpu_name_says_when_there_is_no_nvidia_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    if sys.platform == "darwin":
        assert ppo_throughput.gpu_name() == "Apple GPU (Metal)"
        return
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi to run
    assert ppo_throughput.gpu_name().startswith("no NVIDIA GPU found")


def test_gpu_rows_report_both_frameworks_peak_gpu_memory_and_no_rss_ratio() -> None:
    ours_spec = _spec(device="gpu")
    theirs_spec = _spec(system="trl", device="gpu")
    split = {k: [0.1] for k in SPLIT_KEYS}
    ours = RunResult(ours_spec, [1.0], split, 2000.0, 800.0, 1.0)
    theirs = RunResult(theirs_spec, [4.0], split, 1000.0, None, 1.0, torch_peak_mb=400.0)
    assert ppo_throughput.memory_ratio(ours) is None  # MLX's arrays are not in the RSS
    rows = ppo_throughput.iteration_table([ours, theirs])
    assert "peak MB" in rows[0]
    assert rows[2].split("|")[-1].split()[:3] == ["2000", "800", "-"]
    assert rows[3].split("|")[-1].split()[:3] == ["1000", "400", "-"]
    table = ppo_throughput.compare_table([(ours, theirs)])
    assert table[0].endswith("| GPU MLX/TRL")
    assert table[2].split("|")[-1].strip() == "2.00" and table[2].split("|")[-2].strip() == "2.00"
    cpu_table = ppo_throughput.compare_table([(_result(_spec(), [1.0]), _result(_spec(), [2.0]))])
    assert "GPU" not in cpu_table[0]  # no PyTorch CUDA peak: no GPU column


def test_chart_title_names_where_the_results_were_measured() -> None:
    assert ppo_throughput.chart_device([_result(_spec(), [1.0])]) == "CPU, float32"
    gpu = _result(_spec(device="gpu"), [1.0])
    gpu.versions["device"] = "Device(gpu, 0): NVIDIA H200"
    trl = _result(_spec(system="trl", device="gpu"), [2.0])  # no device name recorded
    assert ppo_throughput.chart_device([gpu, trl]) == "NVIDIA H200, float32"
    tf32 = _result(_spec(device="gpu", tf32=True), [1.0])
    assert ppo_throughput.chart_device([tf32]) == "GPU, TF32 matmuls"


def test_mlx_worker_on_the_gpu_says_how_to_get_one_where_mlx_has_none() -> None:
    import mlx.core as mx

    from benchmarks.throughput_worker import use_mlx_device

    if mx.is_available(mx.gpu):
        pytest.skip("this MLX has a GPU device")
    previous = mx.default_device()
    try:
        with pytest.raises(RuntimeError, match=r"no GPU device.*mlx\[cuda13\]"):
            use_mlx_device(_spec(device="gpu"))
        use_mlx_device(_spec())
        assert mx.default_device() == mx.cpu
    finally:
        mx.set_default_device(previous)


def test_gpu_run_stops_before_building_anything_where_mlx_has_no_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlx.core as mx

    if mx.is_available(mx.gpu):
        pytest.skip("this MLX has a GPU device")
    built: list[str] = []
    monkeypatch.setattr(ppo_throughput, "_prepare_models", lambda *a: built.append("models"))
    with pytest.raises(SystemExit, match=r"--device gpu: this MLX has no GPU device"):
        ppo_throughput.main(["--smoke", "--device", "gpu", "--out", str(tmp_path)])
    assert built == []


def test_gpu_run_with_trl_needs_a_pytorch_that_sees_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx.core as mx

    torch = pytest.importorskip("torch", reason="needs pip install -r requirements-bench.txt")
    if torch.cuda.is_available():
        pytest.skip("this PyTorch has a CUDA device")
    monkeypatch.setattr(mx, "is_available", lambda device: True)  # as if MLX had a GPU
    assert ppo_throughput.gpu_problem(compare=False) is None
    problem = ppo_throughput.gpu_problem(compare=True)
    assert problem is not None and "sees no CUDA device" in problem


def test_trl_worker_on_the_gpu_refuses_a_torch_without_cuda(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch", reason="needs pip install -r requirements-bench.txt")
    pytest.importorskip("trl", reason="needs pip install -r requirements-bench.txt")
    if torch.cuda.is_available():
        pytest.skip("this PyTorch has a CUDA device")
    from benchmarks.throughput_trl import run_trl

    with pytest.raises(RuntimeError, match="sees no CUDA device"):
        run_trl(_spec(system="trl", device="gpu"))


def test_cpu_monitor_reports_other_cores() -> None:
    monitor = CpuMonitor()
    with pytest.raises(ValueError, match="start"):
        monitor.other_cores()
    monitor.start()
    sum(i * i for i in range(200_000))  # some CPU time of our own, which must not count
    busy = monitor.other_cores()
    if Path("/proc/stat").exists():
        assert busy is not None and 0.0 <= busy
    else:
        assert busy is None


@pytest.mark.slow
@pytest.mark.parametrize("model", ["toy", "toy-llama"])
def test_trl_worker_runs_ppo_and_grpo_on_the_same_checkpoints(tmp_path: Path, model: str) -> None:
    """TRL's PPO and GRPO on our checkpoints: full weights on the tiny qwen3, LoRA through PEFT
    on the real shapes' path (toy-llama), with as many adapter parameters as our side trains."""
    pytest.importorskip("trl", reason="needs pip install -r requirements-bench.txt")
    pytest.importorskip("peft", reason="needs pip install -r requirements-bench.txt")
    real = model == "toy-llama"
    policy_dir, reward_dir = build_benchmark_checkpoints(tmp_path / "m", MODEL_SHAPES[model])
    prompts = tuple(benchmark_prompts(policy_dir, 4))
    lora = {}
    if real:
        lora = dict(
            lora_rank=ppo_throughput.REAL_LORA_RANK,
            lora_alpha=ppo_throughput.REAL_LORA_ALPHA,
            lora_modules=REAL_LORA_MODULES,
            gradient_checkpointing=True,
        )
    for algorithm, batch, group in (("ppo", 4, 1), ("grpo", 2, 2)):
        spec = RunSpec(
            system="trl",
            algorithm=algorithm,  # type: ignore[arg-type]
            label=model,
            model=model,
            policy_dir=str(policy_dir),
            reward_dir=str(reward_dir),
            prompts=prompts,
            batch_size=batch,
            group_size=group,
            max_new_tokens=4,
            warmup=0,
            iterations=1,
            **lora,  # type: ignore[arg-type]
        )
        result = ppo_throughput.run_spec(spec, isolate=True, log_dir=tmp_path)
        assert len(result.seconds) == 1 and result.seconds[0] > 0
        assert result.split["generation"][0] > 0 and result.split["scoring"][0] > 0
        assert result.mlx_peak_mb is None and result.peak_rss_mb > 0
        assert "trl" in result.versions
        assert result.trainable_millions is not None
        if real:  # toy-llama: 2 blocks x r 16 x (in + out) of q, k, v, o, gate, up, down
            per_block = 16 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 3 * (64 + 128))
            assert result.trainable_millions == pytest.approx(2 * per_block / 1e6)
        else:
            assert result.trainable_millions == pytest.approx(result.params_millions)


def test_what_was_measured_stays_on_disk_when_a_later_configuration_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    measured: list[str] = []

    def measure(spec: RunSpec, *args: object) -> RunResult:
        if measured:
            raise RuntimeError("the second worker failed")
        measured.append(spec.label)
        return _result(spec, [1.0, 2.0])

    monkeypatch.setattr(ppo_throughput, "_measure", measure)
    with pytest.raises(RuntimeError, match="second worker failed"):
        main(["--smoke", "--no-real", "--out", str(tmp_path)])
    saved = ppo_throughput.load_results(tmp_path / "results.json")
    assert [(r.spec.label, r.seconds) for r in saved] == [(measured[0], [1.0, 2.0])]
    assert not list(tmp_path.glob("*.partial"))  # written aside, renamed into place


def test_a_worker_killed_by_the_kernel_is_reported_not_raised_as_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = RunSpec(
        system="trl",
        algorithm="ppo",
        label="qwen3-0.6b",
        model="qwen3-0.6b",
        policy_dir="p",
        reward_dir="r",
        prompts=("a",),
        batch_size=1,
        group_size=1,
        max_new_tokens=4,
        warmup=0,
        iterations=1,
    )
    killed: subprocess.CompletedProcess[bytes] = subprocess.CompletedProcess([], -9)
    monkeypatch.setattr(ppo_throughput.subprocess, "run", lambda *a, **k: killed)
    with pytest.raises(ppo_throughput.WorkerKilled, match="signal 9 .*out of memory"):
        ppo_throughput.run_spec(spec, isolate=True, log_dir=tmp_path)


def _ended(pid: int) -> bool:
    """Whether process ``pid`` has ended (gone, or a zombie its new parent has not reaped)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text(encoding="utf-8")
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_worker_ends_when_the_benchmark_that_started_it_is_killed(tmp_path: Path) -> None:
    # The benchmark's process starts a worker, as run_spec does, then dies without cleaning up.
    parent = tmp_path / "parent.py"
    parent.write_text(
        textwrap.dedent(f"""
            import os, subprocess, sys, time
            code = (
                "import time; from benchmarks.throughput_worker import end_with_parent; "
                "end_with_parent(); print('ready', flush=True); time.sleep(120)"
            )
            env = dict(os.environ, {PARENT_ENV}=str(os.getpid()))
            worker = subprocess.Popen(
                [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True
            )
            assert worker.stdout.readline().strip() == "ready"
            print(worker.pid, flush=True)
            time.sleep(120)
            """),
        encoding="utf-8",
    )
    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(repo))
    bench = subprocess.Popen(
        [sys.executable, str(parent)], stdout=subprocess.PIPE, text=True, cwd=repo, env=env
    )
    assert bench.stdout is not None
    worker_pid = int(bench.stdout.readline())
    assert not _ended(worker_pid)
    bench.kill()
    bench.wait()
    deadline = time.monotonic() + 20
    while not _ended(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _ended(worker_pid)


def test_a_worker_whose_benchmark_has_already_ended_stops() -> None:
    repo = Path(__file__).resolve().parent.parent
    code = "from benchmarks.throughput_worker import end_with_parent; end_with_parent()"

    def start(parent: str | None) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, PYTHONPATH=str(repo))
        env.pop(PARENT_ENV, None)
        if parent is not None:
            env[PARENT_ENV] = parent
        return subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=repo, capture_output=True, text=True
        )

    gone = start(str(os.getpid() + 1_000_000))  # not the worker's parent: it has ended
    if sys.platform.startswith("linux"):
        assert gone.returncode == 1 and "has ended" in gone.stderr
    else:
        assert gone.returncode == 0  # nothing to follow off Linux
    assert start(None).returncode == 0  # a worker started by hand


@pytest.mark.slow
def test_compare_peers_runs_them_on_grpo_and_reports_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--compare peers``: a peer that can run is measured on the main GRPO configurations only
    and gets its own MLX / peer table; one that cannot is skipped with how to install it."""
    monkeypatch.setattr(
        ppo_throughput,
        "peer_versions",
        lambda python: {"mlx-lm-lora": "5.10.2", "textpolicy": None},
    )
    real_run_spec = ppo_throughput.run_spec
    peer_calls: list[tuple[RunSpec, str | None]] = []

    def run_spec(spec: RunSpec, isolate: bool, log_dir: Path, python: str | None = None) -> object:
        if spec.system == "mlx":
            return real_run_spec(spec, isolate, log_dir, python)
        peer_calls.append((spec, python))
        return _result(spec, [4.0, 4.0])

    monkeypatch.setattr(ppo_throughput, "run_spec", run_spec)
    results = main(["--smoke", "--compare", "peers", "--out", str(tmp_path)])
    out = capsys.readouterr().out

    assert [(s.system, s.algorithm, s.label) for s, _ in peer_calls] == [
        ("mlx-lm-lora", "grpo", "toy")
    ]
    assert peer_calls[0][1] is None  # this interpreter
    assert "MLX peers (GRPO): mlx-lm-lora 5.10.2" in out
    skipped = next(line for line in out.splitlines() if "textpolicy skipped" in line)
    assert "requirements-bench-textpolicy.txt" in skipped and "--textpolicy-python" in skipped
    table = out.split("== MLX / mlx-lm-lora")[1].splitlines()
    row = next(line for line in table if line.startswith("toy"))
    ours = next(
        r
        for r in results
        if (r.spec.system, r.spec.algorithm, r.spec.label) == ("mlx", "grpo", "toy")
    )
    assert f"{ours.median / 4.0:.2f}" in row.split("|")[0]
    assert "== MLX / TRL" not in out and "== MLX / textpolicy" not in out


def test_textpolicy_interpreter_comes_from_the_flag_the_environment_or_the_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(ppo_throughput.TEXTPOLICY_PYTHON_ENV, raising=False)
    assert ppo_throughput.textpolicy_python(None) == ppo_throughput.DEFAULT_TEXTPOLICY_PYTHON
    monkeypatch.setenv(ppo_throughput.TEXTPOLICY_PYTHON_ENV, "/opt/tp/bin/python")
    assert ppo_throughput.textpolicy_python(None) == Path("/opt/tp/bin/python")
    assert ppo_throughput.textpolicy_python(tmp_path / "py") == tmp_path / "py"
    # an interpreter that is not there: textpolicy cannot run
    assert ppo_throughput.peer_versions(tmp_path / "missing")["textpolicy"] is None


def _toy_peer_spec(tmp_path: Path, system: str) -> RunSpec:
    """Two iterations of a peer's GRPO, 2 prompts x 2 completions x 4 tokens, on toy checkpoints."""
    from benchmarks.throughput_models import build_benchmark_checkpoints

    policy_dir, reward_dir = build_benchmark_checkpoints(tmp_path / "m", TINY_SIZES["test"])
    return _spec(
        system=system,
        algorithm="grpo",
        label="toy",
        model="toy",
        policy_dir=str(policy_dir),
        reward_dir=str(reward_dir),
        prompts=tuple(benchmark_prompts(policy_dir, 2)),
        batch_size=2,
        group_size=2,
        max_new_tokens=4,
        warmup=0,
        iterations=2,
    )


@pytest.mark.slow
def test_mlx_lm_lora_worker_trains_on_the_same_checkpoints(tmp_path: Path) -> None:
    pytest.importorskip("mlx_lm_lora", reason="needs pip install -r requirements-bench.txt")
    spec = _toy_peer_spec(tmp_path, "mlx-lm-lora")
    # The worker raises if a completion is not max_new_tokens long or the weights did not change.
    result = ppo_throughput.run_spec(spec, isolate=True, log_dir=tmp_path)
    assert len(result.seconds) == 2 and all(s > 0 for s in result.seconds)
    assert result.split["generation"][0] > 0 and result.split["update"][0] > 0
    assert result.mlx_peak_mb is not None and "mlx_lm_lora" in result.versions


@pytest.mark.slow
def test_textpolicy_worker_trains_on_the_same_checkpoints(tmp_path: Path) -> None:
    python = ppo_throughput.textpolicy_python(None)
    if ppo_throughput.peer_versions(python)["textpolicy"] is None:
        pytest.skip(f"needs textpolicy's Python >= 3.12 environment at {python}")
    spec = _toy_peer_spec(tmp_path, "textpolicy")
    # The worker raises if a completion is not max_new_tokens long or the weights did not change.
    result = ppo_throughput.run_spec(spec, isolate=True, log_dir=tmp_path, python=str(python))
    assert len(result.seconds) == 2 and all(s > 0 for s in result.seconds)
    assert result.split["generation"][0] > 0 and result.split["update"][0] > 0
    assert result.versions.get("textpolicy") == "0.1.11"


@pytest.mark.slow
def test_contention_measures_with_busy_processes_and_stops_them(tmp_path: Path) -> None:
    import multiprocessing

    from benchmarks import contention
    from benchmarks.throughput_models import build_benchmark_checkpoints

    with pytest.raises(SystemExit):
        contention.main(["--busy", "-1"])
    policy_dir, reward_dir = build_benchmark_checkpoints(tmp_path / "m", TINY_SIZES["test"])
    spec = _spec(
        policy_dir=str(policy_dir),
        reward_dir=str(reward_dir),
        prompts=tuple(benchmark_prompts(policy_dir, 4)),
        max_new_tokens=4,
        iterations=1,
    )
    result = contention.measure(spec, busy=2, adaptive=True, log_dir=tmp_path)
    assert len(result.seconds) == 1 and result.seconds[0] > 0
    if Path("/proc/stat").exists():
        assert result.other_load is not None and result.other_load > 0.5  # the busy ones ran
    assert multiprocessing.active_children() == []  # and was stopped


def test_decode_profile_prints_every_piece_against_the_floor(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from benchmarks import decode_profile

    decode_profile.main(
        ["--model", "toy-llama", "--batch", "2", "--prompt-len", "4", "--context", "8"]
        + ["--repeats", "1", "--generator-tokens", "2", "3", "1"]
    )
    out = capsys.readouterr().out
    for piece in ("forward pass", "attention core", "sampling", "matmul floor", "generator step"):
        assert piece in out
    assert "load average" in out


def test_head_logprobs_benchmark_prints_both_paths_and_the_floor(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from benchmarks import head_logprobs

    head_logprobs.main(["--model", "toy-llama", "--rows", "8", "--repeats", "1", "--blocks", "7"])
    out = capsys.readouterr().out
    for piece in (
        "floor: head matmul",
        "training, logits path",
        "scoring, logits path",
        "training, blockwise (7 vocabulary rows)",
        "scoring, blockwise (7 vocabulary rows)",
    ):
        assert piece in out


@pytest.mark.slow
def test_train_step_math_benchmark_times_every_way(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import train_step_math

    argv = ["--model", "toy-llama", "--batch", "1", "--prompt", "2", "--new", "4"]
    train_step_math.main([*argv, "--repeats", "1"])
    out = capsys.readouterr().out
    assert all(f"| {way} |" in out for way in train_step_math.WAYS)


@pytest.mark.slow
def test_cpu_streams_benchmark_times_every_configuration(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from benchmarks import cpu_streams

    cpu_streams.main(["--model", "toy-llama", "--batch", "2", "--length", "8", "--repeats", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + len(cpu_streams.CONFIGS)
    assert lines[1].endswith("1.00x") and "2 streams, OpenBLAS threads 1" in lines[3]


@pytest.mark.slow
def test_async_rollout_benchmark_smoke(tmp_path: Path) -> None:
    """benchmarks.async_rollout runs its sync/async pair end to end and reports the ratio."""
    from benchmarks import async_rollout

    lines = async_rollout.main(["--smoke", "--repeats", "1", "--out", str(tmp_path)])
    assert any(line.startswith("median s/iteration") and "sync/async" in line for line in lines)
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["async"] for r in results] == [False, True]
    assert results[0]["scores"][0] == results[1]["scores"][0]  # step 1: the same, synchronous


def test_step_files_traces_one_step_through_the_library() -> None:
    """benchmarks/step_files: the files one PPO step enters, the trainer and the losses among
    them, the script's own reward not."""
    from benchmarks.step_files import traced_step

    entered = traced_step("ppo")
    assert {"ppo_trainer/ppo_trainer.py", "training/policy_loss.py"} <= set(entered)
    assert "step" in entered["ppo_trainer/ppo_trainer.py"]
    assert not any(path.startswith(("benchmarks/", "tests/")) for path in entered)
