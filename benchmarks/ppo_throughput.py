"""Throughput of a PPO / GRPO iteration: how long it takes, where the time goes, how far it is from
the floor of this design, how it grows, and how it compares with TRL and the MLX peers on the same
weights.

Usage::

    python -m benchmarks.ppo_throughput                   # MLX only
    python -m benchmarks.ppo_throughput --compare trl     # and TRL (pip install -r requirements-bench.txt)
    python -m benchmarks.ppo_throughput --compare peers   # and mlx-lm-lora's and textpolicy's GRPO
    python -m benchmarks.ppo_throughput --compare all     # TRL and the peers, in one run
    python -m benchmarks.ppo_throughput --smoke           # toy sizes, seconds (what the test runs)
    python -m benchmarks.ppo_throughput --no-real         # without the real shapes (minutes each)
    python -m benchmarks.ppo_throughput --device gpu --compare trl   # both on the GPU (CUDA)

The MLX peers run GRPO only (neither has PPO with a value model), on the main configurations
other than the real shapes:
mlx-lm-lora (``benchmarks.throughput_mlx_lm_lora``) in this environment, textpolicy
(``benchmarks.throughput_textpolicy``, Python >= 3.12) with the interpreter of its own virtual
environment (``--textpolicy-python``; see ``requirements-bench-textpolicy.txt``).

Configurations (every one: random weights, float32, temperature 1, no stop token, so every
response has exactly the stated number of tokens; one PPO epoch over one minibatch; reward model =
value model's start = the same ``<Arch>ForSequenceClassification`` checkpoint, one label; the
value model trains all its weights):

* real shapes (``--real``, the default; ``--no-real`` leaves them out): the architectures of
  published checkpoints, their config.json's sizes and vocabulary, random weights
  (``benchmarks.throughput_models.build_real_checkpoint``), LoRA on the policy on both systems
  (r 16, alpha 32, no dropout, on q/k/v/o/gate/up/down of every block: ``REAL_LORA_*``; TRL
  through PEFT), the reference = the policy with its adapters off. ``smollm2-135m``: llama
  (SmolLM2-135M), hidden 576, 30 layers, 9 heads (3 KV heads, head_dim 64), MLP 1536, vocabulary
  49152, tied embeddings (134.5M parameters). ``qwen3-0.6b``: qwen3 (Qwen3-0.6B), hidden 1024, 28
  layers, 16 heads (8 KV heads, head_dim 128), MLP 3072, vocabulary 151936, tied embeddings
  (596M parameters), with gradient checkpointing on both systems (``CHECKPOINTED_SHAPES``: it
  does not fit a 24 GiB machine without). PPO: 16 prompts x 128 new tokens; GRPO: 4 prompts x 4
  completions x 128.
  ``--real-warmup`` (1) and ``--real-iterations`` (2), no floor unless ``--real-floor``.
* ``tiny`` (full-weight training, a separate frozen reference, as ``medium`` and the sweep):
  qwen3, hidden 256, 4 layers, 4 heads (2 KV heads, head_dim 64), MLP 768, vocabulary
  2048, tied embeddings (3.7M parameters). PPO: 16 prompts of about 14 tokens x 32 new tokens;
  GRPO: 4 prompts x 4 completions x 32 new tokens.
* ``medium``: hidden 768, 12 layers, 12 heads (4 KV heads), MLP 3072, vocabulary 2048 (about
  100M parameters). PPO: 8 prompts x 128 new tokens; GRPO: 2 prompts x 4 completions x 128.
* scaling (tiny PPO): 32, 64, 128 and 256 new tokens at batch 16; batch 8, 16 and 32 at 32 tokens.

Device (``--device``): the CPU by default (MLX's CPU device, PyTorch on the CPU); ``gpu`` runs
both on the GPU (MLX's GPU device, CUDA or Metal; PyTorch's CUDA device), in full float32 unless
``--tf32`` (``benchmarks.throughput_worker.use_mlx_device``, ``throughput_trl``).

Each configuration runs in a fresh subprocess per system (so peak memory is its own): ``warmup``
untimed iterations, then ``iterations`` timed ones. The MLX worker then times, in the same process,
the irreducible pieces of an iteration (``benchmarks.throughput_mlx``): batched KV-cache sampling,
one forward pass, one forward+backward+AdamW step, for the policy (LM head) and a scalar-head
model. Printed ratios:

* ``iter / (sample + fwd + train)``: the iteration against its three basic pieces;
* ``iter / design floor``: against what this design cannot avoid: sampling, the reference
  forward, the reward (and PPO's value) forward, and one training step per model per minibatch
  (policy log-probs could come from sampling, so they do not count).

Machine noise: before every configuration the script waits (up to ``--quiet-wait`` seconds) for
the other processes on the machine to go idle, each row reports how many cores others kept busy
while it was measured (``other``), and a configuration measured while others used more than 0.3
cores is measured again (``--retries``), keeping the quieter result.
Writes ``report.txt`` (the machine and the tables it prints), ``results.json`` and
``ppo_throughput.png`` under ``--out`` (default ``runs/benchmarks``).
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a script: MLX's fast BLAS before anything imports mlx
    from base_setup import setup_blas

    setup_blas()

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence, cast

from benchmarks.phase_floors import (
    DOC_BEGIN,
    DOC_END,
    floor_lines,
    floor_rows,
    growth_lines,
    limits_line,
    markdown_table,
    markers_problem,
    write_doc,
)
from benchmarks.throughput_models import RealShape
from benchmarks.throughput_spec import (
    FLOOR_KEYS,
    Device,
    PEER_SYSTEMS,
    PHASE_NAMES,
    SPLIT_KEYS,
    RunResult,
    RunSpec,
    System,
    find_result,
    package_version,
)
from benchmarks.throughput_worker import NO_MLX_GPU, PARENT_ENV
from fixtures.tiny_model import TINY_SIZES, TinyModelSpec

#: The benchmark's model sizes: the real shapes (``RealShape``, LoRA), the tiny ones; ``toy`` and
#: ``toy-llama`` (the real shapes' code path at toy sizes) are the smoke test's.
MODEL_SHAPES: dict[str, TinyModelSpec | RealShape] = {
    "smollm2-135m": RealShape(
        source="HuggingFaceTB/SmolLM2-135M",
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1536,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
    ),
    "qwen3-0.6b": RealShape(
        source="Qwen/Qwen3-0.6B",
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    ),
    "tiny": TinyModelSpec(
        vocab_size=2048,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=768,
    ),
    "medium": TinyModelSpec(
        vocab_size=2048,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=3072,
    ),
    "toy": TINY_SIZES["test"],
    "toy-llama": RealShape(
        source="none: the smoke test's toy llama",
        model_type="llama",
        vocab_size=1024,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_position_embeddings=2048,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
    ),
}

#: The real shapes of a full run, in report order.
REAL_MODELS: tuple[str, ...] = ("smollm2-135m", "qwen3-0.6b")

#: The shapes trained with gradient checkpointing on both systems (ours: ``gradient_checkpointing``;
#: TRL: transformers' ``gradient_checkpointing_enable`` on the policy and the value model, and
#: GRPOConfig's ``gradient_checkpointing``). Qwen3-0.6B's PPO without it went past this 24 GiB
#: machine (our worker was killed by the kernel's out-of-memory killer at 24 GB resident,
#: 2026-11-25): its value model trains all 0.6B weights (AdamW state included), beside the policy
#: and the reward model. ``toy-llama`` is the smoke test's path through it.
CHECKPOINTED_SHAPES: frozenset[str] = frozenset({"qwen3-0.6b", "toy-llama"})

#: LoRA of the real shapes, the same on both systems: rank 16, alpha 32 (PEFT's and TRL's usual
#: pair), on every linear layer of every block (PEFT's "all-linear", the QLoRA paper's choice).
REAL_LORA_RANK = 16
REAL_LORA_ALPHA = 32.0
REAL_LORA_MODULES: tuple[str, ...] = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)

#: What ``--compare trl`` needs, and the versions it was written against.
COMPARE_REQUIREMENTS: dict[str, str] = {
    "torch": "2.13.0",
    "trl": "1.12.0",
    "peft": "0.21.2",
    "requests": "",
}

#: Where ``--compare peers`` looks for textpolicy's interpreter unless told
#: (``--textpolicy-python`` or this environment variable).
TEXTPOLICY_PYTHON_ENV = "PPO_MLX_TEXTPOLICY_PYTHON"
DEFAULT_TEXTPOLICY_PYTHON = Path(__file__).resolve().parent.parent / ".venv-textpolicy/bin/python"

SweepKind = Literal["tokens", "batch"]
SWEEP_KINDS: tuple[SweepKind, ...] = ("tokens", "batch")

QUIET_CORES = 0.3  # other processes' CPU use below which the machine counts as quiet


@dataclass(frozen=True)
class Config:
    """One configuration of the plan: ``batch_size`` prompts x ``group_size`` completions x
    ``max_new_tokens`` tokens of model ``model``."""

    label: str
    model: str
    algorithm: Literal["ppo", "grpo"]
    batch_size: int
    group_size: int
    max_new_tokens: int
    kind: Literal["main", "tokens", "batch"] = "main"
    #: A real shape trained in full (every weight of the policy) instead of with LoRA.
    full_weights: bool = False


@dataclass(frozen=True)
class Plan:
    """What a run measures: the main configurations (floor measured too, on the real shapes only
    with ``real_floor``), the scaling sweep (tiny PPO), and how many iterations each gets."""

    main: tuple[Config, ...]
    sweep: tuple[Config, ...]
    warmup: int
    iterations: int
    medium_warmup: int
    medium_iterations: int
    floor_repeats: int
    isolate: bool  # each configuration in its own subprocess
    real_warmup: int = 1
    real_iterations: int = 2
    real_floor: bool = False
    device: Device = "cpu"
    tf32: bool = False
    quick_limits: bool = False  # the machine's limits on small arrays, once (``--smoke``)
    offload_frozen_models: bool = False  # the MLX worker's (``--offload-frozen-models``)


def is_real(model: str) -> bool:
    """``model`` is a real shape (LoRA, its own iteration counts), not a tiny qwen3 size."""
    return isinstance(MODEL_SHAPES[model], RealShape)


def build_plan(args: argparse.Namespace) -> Plan:
    """The configurations of a full run, or the toy ones of ``--smoke``."""
    if args.smoke:
        toy_main: tuple[Config, ...] = (
            Config("toy", "toy", "ppo", 4, 1, 4),
            Config("toy", "toy", "grpo", 2, 2, 4),
        )
        if args.real:  # the real shapes' path (llama, LoRA on both systems) at toy sizes
            toy_main = (
                Config("toy-llama", "toy-llama", "ppo", 4, 1, 4),
                Config("toy-llama", "toy-llama", "grpo", 2, 2, 4),
                *toy_main,
            )
        toy_sweep = (
            Config("tokens=8", "toy", "ppo", 4, 1, 8, "tokens"),
            Config("batch=2", "toy", "ppo", 2, 1, 4, "batch"),
        )
        return Plan(
            toy_main,
            toy_sweep,
            1,
            2,
            1,
            2,
            1,
            isolate=False,
            real_floor=True,
            device=args.device,
            tf32=args.tf32,
            quick_limits=True,
            offload_frozen_models=args.offload_frozen_models,
        )
    main_list: list[Config] = []
    if args.real:
        full = args.real_full
        for model in args.real_models:
            label = f"{model} full" if full else model
            main_list += [
                Config(label, model, "ppo", 16, 1, 128, full_weights=full),
                Config(label, model, "grpo", 4, 4, 128, full_weights=full),
            ]
        main_list = [c for c in main_list if c.algorithm in args.algorithms]
    main_list += [
        Config("tiny", "tiny", "ppo", 16, 1, 32),
        Config("tiny", "tiny", "grpo", 4, 4, 32),
    ]
    if not args.no_medium:
        main_list += [
            Config("medium", "medium", "ppo", 8, 1, 128),
            Config("medium", "medium", "grpo", 2, 4, 128),
        ]
    sweep: tuple[Config, ...] = ()
    if not args.no_sweep:
        sweep = tuple(
            Config(f"tokens={t}", "tiny", "ppo", 16, 1, t, "tokens") for t in (64, 128, 256)
        ) + tuple(Config(f"batch={b}", "tiny", "ppo", b, 1, 32, "batch") for b in (8, 32))
    return Plan(
        tuple(main_list),
        sweep,
        args.warmup,
        args.iterations,
        args.medium_warmup,
        args.medium_iterations,
        args.floor_repeats,
        isolate=True,
        real_warmup=args.real_warmup,
        real_iterations=args.real_iterations,
        real_floor=args.real_floor,
        device=args.device,
        tf32=args.tf32,
        offload_frozen_models=args.offload_frozen_models,
    )


# ---------------------------------------------------------------------------------- environment
def missing_compare_requirements() -> str | None:
    """Why ``--compare trl`` cannot run in this environment (every missing package named), or
    None when it can."""
    missing = [name for name in COMPARE_REQUIREMENTS if package_version(name) is None]
    if not missing:
        return None
    return f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed"


def textpolicy_python(arg: Path | None) -> Path:
    """textpolicy's interpreter: ``--textpolicy-python``, else ``$PPO_MLX_TEXTPOLICY_PYTHON``,
    else ``.venv-textpolicy/bin/python`` in the repository."""
    if arg is not None:
        return arg
    from_env = os.environ.get(TEXTPOLICY_PYTHON_ENV)
    return Path(from_env) if from_env else DEFAULT_TEXTPOLICY_PYTHON


def peer_versions(textpolicy: Path) -> dict[str, str | None]:
    """Each MLX peer's version where it can run, else None: mlx-lm-lora in this environment,
    textpolicy under ``textpolicy`` (an interpreter that must also import this repository's
    ``base_setup``: the worker needs it)."""
    versions = {"mlx-lm-lora": package_version("mlx-lm-lora"), "textpolicy": None}
    if textpolicy.is_file():
        probe = subprocess.run(
            [
                str(textpolicy),
                "-c",
                "import importlib.metadata as m, base_setup, mlx_lm, textpolicy; "
                "print(m.version('textpolicy'))",
            ],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent.parent,
            timeout=300,
        )
        if probe.returncode == 0:
            versions["textpolicy"] = probe.stdout.strip().splitlines()[-1]
        else:
            print(
                f"textpolicy's interpreter {textpolicy} cannot import textpolicy, mlx_lm and "
                f"base_setup:\n{probe.stderr.strip()[-800:]}"
            )
    return versions


def _version(name: str) -> str:
    return package_version(name) or "not installed"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return None


def cpu_threads() -> int:
    """Cores this process may run on: what OpenBLAS (MLX's BLAS here) uses, and what PyTorch
    gets for the comparison."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def gpu_name() -> str:
    """The GPU's name, memory and driver as ``nvidia-smi`` gives them (Apple's GPU on macOS), or
    a sentence saying none was found."""
    if sys.platform == "darwin":
        return "Apple GPU (Metal)"
    try:
        query = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,memory.total,driver_version",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"no NVIDIA GPU found ({err})"
    first = query.stdout.strip().splitlines()[:1]
    if query.returncode != 0 or not first:
        return f"no NVIDIA GPU found (nvidia-smi exit {query.returncode})"
    name, memory, driver = (part.strip() for part in first[0].split(",")[:3])
    return f"{name}, {memory}, driver {driver}"


def gpu_problem(compare: bool) -> str | None:
    """Why ``--device gpu`` cannot run here, checked before any model is built: MLX has no GPU
    device, or (with ``compare``) PyTorch sees no CUDA device (asked in a subprocess: PyTorch
    must not load into the MLX process). None when both can."""
    import mlx.core as mx

    if not mx.is_available(mx.gpu):
        return NO_MLX_GPU
    if not compare:
        return None
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.is_available(), torch.__version__)"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if probe.returncode != 0:
        return f"PyTorch does not import for --compare trl:\n{probe.stderr.strip()[-800:]}"
    available, _, version = probe.stdout.strip().partition(" ")
    if available != "True":
        return f"PyTorch {version} sees no CUDA device (a CPU build?); TRL would run on the CPU"
    return None


def mlx_backend(device: Device) -> str:
    """Which MLX backend computes on ``device``: its CPU backend, Metal, or CUDA (the wheel)."""
    if device == "cpu":
        return "CPU backend"
    if sys.platform == "darwin":
        return "Metal backend"
    for wheel in ("mlx-cuda-13", "mlx-cuda-12"):
        version = package_version(wheel)
        if version is not None:
            return f"CUDA backend, {wheel} {version}"
    return "no GPU backend installed"


def machine_lines(
    compare: bool, peers: dict[str, str] | None = None, device: Device = "cpu", tf32: bool = False
) -> list[str]:
    """A few lines that describe the machine and the libraries (TRL's when ``compare``, and
    the versions of the MLX ``peers`` that run), and the GPU with ``device == "gpu"``."""
    memory = _memory_gib()
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    lines = [
        f"CPU: {_cpu_name()}, {cpu_threads()} cores"
        + (f", {memory:.0f} GiB memory" if memory else ""),
        f"OS: {platform.system()} {platform.release()}; Python {platform.python_version()}",
    ]
    precision = ""
    if device == "gpu":
        precision = "; float32 matmuls in TF32" if tf32 else "; float32 matmuls in full float32"
        lines.append(f"GPU: {gpu_name()} (both systems compute there{precision})")
    lines.append(
        f"MLX {_version('mlx')} ({mlx_backend(device)}), mlx-lm {_version('mlx-lm')}; "
        f"math threads: {cpu_threads()}"
    )
    if device == "cpu":  # the workers load the same BLAS (the same environment)
        from base_setup import blas_info

        lines.append(blas_info().describe())
    if compare:
        torch_device = "CUDA" if device == "gpu" else f"torch.set_num_threads({cpu_threads()})"
        lines.append(
            f"PyTorch {_version('torch')} ({torch_device}), "
            f"TRL {_version('trl')}, transformers {_version('transformers')}"
        )
    if peers:
        lines.append(
            "MLX peers (GRPO): "
            + ", ".join(f"{name} {version}" for name, version in peers.items())
            + (" (in its own Python >= 3.12 environment)" if "textpolicy" in peers else "")
        )
    if load is not None:
        quiet = "quiet" if load[0] < 1.5 else "BUSY: timings are inflated"
        lines.append(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} ({quiet})")
    return lines


def wait_for_quiet(max_wait: float) -> float | None:
    """Wait up to ``max_wait`` seconds for other processes to use less than ``QUIET_CORES``
    cores over a 1-second window; returns the last window's busy cores (None without
    /proc/stat)."""
    from benchmarks.throughput_spec import CpuMonitor

    deadline = time.monotonic() + max_wait
    while True:
        monitor = CpuMonitor()
        monitor.start()
        time.sleep(1.0)
        busy = monitor.other_cores()
        if busy is None or busy < QUIET_CORES or time.monotonic() >= deadline:
            return busy


# ---------------------------------------------------------------------------------- running
class WorkerKilled(RuntimeError):
    """A measurement's worker process ended by a signal (SIGKILL: out of memory). The run goes
    on without that configuration, and the report names it."""


def run_spec(spec: RunSpec, isolate: bool, log_dir: Path, python: str | None = None) -> RunResult:
    """Measure one spec: in a fresh ``benchmarks.throughput_worker`` subprocess (run by
    ``python``, default this interpreter) when ``isolate`` or for another system than ours (TRL
    must not share a process with MLX's BLAS; a peer must not share MLX's caches), else here."""
    if not isolate and spec.system == "mlx":
        from benchmarks.throughput_worker import run_spec as run_here

        return run_here(spec)
    name = f"{spec.system}_{spec.algorithm}_{spec.label}".replace("=", "")
    spec_file = log_dir / f"{name}.spec.json"
    result_file = log_dir / f"{name}.result.json"
    log_file = log_dir / f"{name}.log"
    spec_file.write_text(spec.to_json(), encoding="utf-8")
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1", TOKENIZERS_PARALLELISM="false")
    env[PARENT_ENV] = str(os.getpid())  # the worker ends with this process (end_with_parent)
    with open(log_file, "w", encoding="utf-8") as log:
        done = subprocess.run(
            [
                python or sys.executable,
                "-m",
                "benchmarks.throughput_worker",
                str(spec_file),
                str(result_file),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=Path(__file__).resolve().parent.parent,
        )
    if done.returncode < 0:  # a signal: SIGKILL is the kernel's out-of-memory killer's
        raise WorkerKilled(
            f"the {spec.system} worker for {spec.algorithm} {spec.label} was killed by signal "
            f"{-done.returncode}"
            + (" (SIGKILL: out of memory, most likely)" if done.returncode == -9 else "")
        )
    if done.returncode != 0:
        tail = log_file.read_text(encoding="utf-8").splitlines()[-25:]
        raise RuntimeError(
            f"the {spec.system} worker for {spec.algorithm} {spec.label} failed (exit "
            f"{done.returncode}); its log is {log_file}:\n" + "\n".join(tail)
        )
    return RunResult.load(result_file)


def _spec(
    config: Config,
    system: System,
    plan: Plan,
    dirs: dict[str, tuple[Path, Path, list[str]]],
    measure_floor: bool,
) -> RunSpec:
    policy_dir, reward_dir, prompts = dirs[config.model]
    real = is_real(config.model)
    lora = real and not config.full_weights
    if real:
        warmup, iterations = plan.real_warmup, plan.real_iterations
    elif config.model == "medium":
        warmup, iterations = plan.medium_warmup, plan.medium_iterations
    else:
        warmup, iterations = plan.warmup, plan.iterations
    return RunSpec(
        system=system,
        algorithm=config.algorithm,
        label=config.label,
        model=config.model,
        policy_dir=str(policy_dir),
        reward_dir=str(reward_dir),
        prompts=tuple(prompts),
        batch_size=config.batch_size,
        group_size=config.group_size,
        max_new_tokens=config.max_new_tokens,
        warmup=warmup,
        iterations=iterations,
        threads=cpu_threads(),
        measure_floor=measure_floor and system == "mlx" and (plan.real_floor or not real),
        floor_repeats=plan.floor_repeats,
        lora_rank=REAL_LORA_RANK if lora else 0,
        lora_alpha=REAL_LORA_ALPHA if lora else 0.0,
        lora_modules=REAL_LORA_MODULES if lora else (),
        gradient_checkpointing=config.model in CHECKPOINTED_SHAPES,
        device=plan.device,
        tf32=plan.tf32,
        measure_limits=real and system == "mlx",
        quick_limits=plan.quick_limits,
        offload_frozen_models=plan.offload_frozen_models and system == "mlx",
    )


# ---------------------------------------------------------------------------------- reporting
def design_floor(result: RunResult) -> tuple[float, float]:
    """``(basic, design)`` floors in seconds of a result with ``floor`` pieces.

    basic = sample + lm_forward + lm_train_step. design = sample + reference forward (LM) +
    reward forward (head) [+ value forward (head)] + one training step of the policy [+ the value
    model] per minibatch (one here).
    """
    f = result.floor
    if f is None:
        raise ValueError("this result has no floor measurement")
    basic = f["sample"] + f["lm_forward"] + f["lm_train_step"]
    if result.spec.algorithm == "ppo":
        design = (
            f["sample"]
            + f["lm_forward"]
            + 2 * f["head_forward"]
            + f["lm_train_step"]
            + f["head_train_step"]
        )
    else:
        design = f["sample"] + f["lm_forward"] + f["head_forward"] + f["lm_train_step"]
    return basic, design


def _fmt_load(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def memory_ratio(result: RunResult) -> float | None:
    """Peak resident memory over MLX's peak array memory (None without the latter: TRL; and on a
    GPU, where MLX's arrays are in the GPU's memory, not in the process's resident memory)."""
    if not result.mlx_peak_mb or result.spec.device == "gpu":
        return None
    return result.peak_rss_mb / result.mlx_peak_mb


def iteration_table(results: Sequence[RunResult]) -> list[str]:
    head = (
        f"{'config':<12} {'algo':<5} {'system':<11} {'seqs x new':>10} {'median s':>9} "
        f"{'min s':>7} {'max s':>7} {'tok/s':>7} | {'gen':>6} {'score':>6} {'update':>6} "
        f"{'other':>6} | {'RSS MB':>7} {'peak MB':>7} {'RSS/MLX':>7} {'other':>5}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        s = r.spec
        split = " ".join(f"{r.split_median(k):>6.3f}" for k in SPLIT_KEYS)
        arrays = r.mlx_peak_mb if r.mlx_peak_mb is not None else r.torch_peak_mb
        mlx_mb = "-" if arrays is None else f"{arrays:.0f}"
        ratio = memory_ratio(r)
        rss_ratio = "-" if ratio is None else f"{ratio:.2f}"
        lines.append(
            f"{s.label:<12} {s.algorithm:<5} {s.system:<11} "
            f"{f'{s.rollout_size}x{s.max_new_tokens}':>10} {r.median:>9.3f} "
            f"{min(r.seconds):>7.3f} {max(r.seconds):>7.3f} {r.tokens_per_second:>7.0f} | "
            f"{split} | {r.peak_rss_mb:>7.0f} {mlx_mb:>7} {rss_ratio:>7} "
            f"{_fmt_load(r.other_load):>5}"
        )
    return lines


def phase_memory_table(results: Sequence[RunResult]) -> list[str]:
    """One row per MLX result that measured them (``RunResult.phase_peaks``): each phase's peak
    resident memory and MLX's peak array memory; no lines when none did."""
    rows = [r for r in results if r.phase_peaks]
    if not rows:
        return []
    head = f"{'config':<12} {'algo':<5} | " + " | ".join(
        f"{phase + ' RSS / MLX':>24}" for phase in PHASE_NAMES
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = []
        for phase in PHASE_NAMES:
            peak = (r.phase_peaks or {}).get(phase, {})
            rss, arrays = peak.get("rss_mb"), peak.get("mlx_mb")
            text = f"{'-' if rss is None else f'{rss:.0f}'} / {'-' if arrays is None else f'{arrays:.0f}'}"
            cells.append(f"{text:>24}")
        lines.append(f"{r.spec.label:<12} {r.spec.algorithm:<5} | " + " | ".join(cells))
    return lines


def compare_table(pairs: Sequence[tuple[RunResult, RunResult]], other: str = "TRL") -> list[str]:
    """Our result against another system's (``other``: its name in the header), per config:
    time per iteration, the ratio overall and per part, and the ratio of peak RSS (and, where both
    have one, of peak GPU memory: MLX's peak against PyTorch's peak allocated)."""
    name, ratio = f"{other} s", f"MLX/{other}"
    w_name, w_ratio = max(8, len(name)), max(8, len(ratio))
    parts_head = f"{'gen':>5} {'score':>6} {'update':>6} (per part)"
    gpu = any(theirs.torch_peak_mb for _, theirs in pairs)
    head = (
        f"{'config':<12} {'algo':<5} {'MLX s':>8} {name:>{w_name}} {ratio:>{w_ratio}} | "
        f"{parts_head} | RSS {ratio}" + (f" | GPU {ratio}" if gpu else "")
    )
    lines = [head, "-" * len(head)]
    for ours, theirs in pairs:
        parts = []
        for key in ("generation", "scoring", "update"):
            mine = ours.split_median(key) + (ours.split_median("other") if key == "update" else 0)
            their_part = theirs.split_median(key)
            parts.append(f"{mine / their_part:.2f}" if their_part > 0 else "-")
        split = f"{parts[0]:>5} {parts[1]:>6} {parts[2]:>6}"
        lines.append(
            f"{ours.spec.label:<12} {ours.spec.algorithm:<5} {ours.median:>8.3f} "
            f"{theirs.median:>{w_name}.3f} {ours.median / theirs.median:>{w_ratio}.2f} | "
            f"{split:<{len(parts_head)}} | "
            f"{ours.peak_rss_mb / theirs.peak_rss_mb:>{len(ratio) + 4}.2f}"
            + (f" | {_gpu_memory_ratio(ours, theirs):>{len(ratio) + 4}}" if gpu else "")
        )
    return lines


def _gpu_memory_ratio(ours: RunResult, theirs: RunResult) -> str:
    """MLX's peak GPU memory over PyTorch's, as printed ("-" where either is missing)."""
    if not ours.mlx_peak_mb or not theirs.torch_peak_mb or ours.spec.device != "gpu":
        return "-"
    return f"{ours.mlx_peak_mb / theirs.torch_peak_mb:.2f}"


def floor_table(results: Sequence[RunResult]) -> list[str]:
    head = (
        f"{'config':<12} {'algo':<5} "
        + " ".join(f"{k:>15}" for k in FLOOR_KEYS)
        + f" | {'iter s':>7} {'iter/basic':>10} {'iter/design':>11}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        if r.floor is None:
            continue
        basic, design = design_floor(r)
        lines.append(
            f"{r.spec.label:<12} {r.spec.algorithm:<5} "
            + " ".join(f"{r.floor[k]:>15.3f}" for k in FLOOR_KEYS)
            + f" | {r.median:>7.3f} {r.median / basic:>10.2f} {r.median / design:>11.2f}"
        )
    return lines


def scaling_table(results: Sequence[RunResult], kind: SweepKind, compare: bool) -> list[str]:
    name = "new tokens" if kind == "tokens" else "batch"
    head = f"{name:>10} {'MLX s':>8} {'MLX tok/s':>9}"
    if compare:
        head += f" {'TRL s':>8} {'TRL tok/s':>9} {'MLX/TRL':>8}"
    lines = [head, "-" * len(head)]
    for x, ours, theirs in scaling_points(results, kind):
        line = f"{x:>10} {ours.median:>8.3f} {ours.tokens_per_second:>9.0f}"
        if compare and theirs is not None:
            line += (
                f" {theirs.median:>8.3f} {theirs.tokens_per_second:>9.0f} "
                f"{ours.median / theirs.median:>8.2f}"
            )
        lines.append(line)
    return lines


def scaling_points(
    results: Sequence[RunResult], kind: SweepKind
) -> list[tuple[int, RunResult, RunResult | None]]:
    """``(x, mlx result, trl result or None)`` of the sweep along ``kind``, sorted by x; the
    main PPO configuration of the sweep's model is the shared point."""
    sweep = [r for r in results if r.spec.label.startswith(("tokens=", "batch="))]
    if not sweep:
        return []
    model = sweep[0].spec.model
    base = [
        r
        for r in results
        if r.spec.label == model and r.spec.algorithm == "ppo" and r.spec.model == model
    ]
    points: dict[tuple[int, str], RunResult] = {}
    for r in [*sweep, *base]:
        s = r.spec
        if r in base:
            xs = [s.max_new_tokens] if kind == "tokens" else [s.batch_size]
        elif s.label.startswith(f"{kind}="):
            xs = [int(s.label.split("=")[1])]
        else:
            xs = []
        for x in xs:
            points[(x, s.system)] = r
    return [
        (x, points[(x, "mlx")], points.get((x, "trl")))
        for x in sorted({x for x, _ in points})
        if (x, "mlx") in points
    ]


def chart_device(results: Sequence[RunResult]) -> str:
    """Where the results were measured, for the chart's title: "CPU, float32", or the GPU's name
    (as the MLX worker recorded it) and the float32 matmul mode."""
    gpu = [r for r in results if r.spec.device == "gpu"]
    if not gpu:
        return "CPU, float32"
    names = {r.versions["device"].split(": ", 1)[-1] for r in gpu if r.versions.get("device")} or {
        "GPU"
    }
    mode = "TF32 matmuls" if any(r.spec.tf32 for r in gpu) else "float32"
    return f"{', '.join(sorted(names))}, {mode}"


def write_chart(results: Sequence[RunResult], path: Path) -> Path:
    """A 2x2 PNG: seconds per iteration (MLX vs TRL), the time split, and the two sweeps."""
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError(
            "the chart needs matplotlib: pip install matplotlib (it is in requirements.txt)"
        ) from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    main = [r for r in results if not r.spec.label.startswith(("tokens=", "batch="))]
    colors = {"mlx": "#1f77b4", "trl": "#ff7f0e", "mlx-lm-lora": "#8c564b", "textpolicy": "#e377c2"}
    sweeps = [kind for kind in SWEEP_KINDS if scaling_points(results, kind)]
    # Without a sweep (--no-sweep) the chart is the top row alone, not two empty panels.
    rows = 2 if sweeps else 1
    fig, axes_grid = plt.subplots(rows, 2, figsize=(13, 4.5 * rows), squeeze=False)
    axes = list(axes_grid)

    ax = axes[0][0]
    configs = sorted({(r.spec.label, r.spec.algorithm) for r in main}, key=_config_order)
    order = ["mlx", "trl", *PEER_SYSTEMS]
    systems = sorted({r.spec.system for r in main}, key=order.index)
    width = 0.8 / max(len(systems), 1)
    for j, system in enumerate(systems):
        xs, ys, lo, hi = [], [], [], []
        for i, (label, algo) in enumerate(configs):
            r = find_result(main, label, algo, system)
            if r is not None:
                xs.append(i + j * width)
                ys.append(r.median)
                lo.append(r.median - min(r.seconds))
                hi.append(max(r.seconds) - r.median)
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=system, color=colors[system])
    floor_labelled = False
    for i, (label, algo) in enumerate(configs):
        ours = find_result(main, label, algo, "mlx")
        theirs = find_result(main, label, algo, "trl")
        if ours is not None and ours.floor is not None:
            ax.hlines(
                design_floor(ours)[1],
                i - width / 2,
                i + width / 2,
                colors="black",
                label=None if floor_labelled else "mlx design floor",
            )
            floor_labelled = True
        if ours is not None and theirs is not None:
            top = max(max(ours.seconds), max(theirs.seconds)) * 1.15
            ax.text(i + width / 2, top, f"mlx/trl {ours.median / theirs.median:.2f}", ha="center")
    ax.set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(configs))])
    ax.set_xticklabels([f"{_narrow(label)}\n{algo.upper()}" for label, algo in configs])
    ax.set_yscale("log")
    ax.set_ylim(top=2.5 * max(max(r.seconds) for r in main))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.set_ylabel("seconds per iteration (median, min-max)")
    ax.set_title("Seconds per iteration (lower is better)")
    ax.legend(fontsize=8)

    ax = axes[0][1]
    short = {"mlx-lm-lora": "mlx-lm-\nlora", "textpolicy": "text-\npolicy"}  # narrow labels
    bars = [
        (
            r,
            f"{_narrow(r.spec.label)}\n{r.spec.algorithm.upper()}\n"
            f"{short.get(r.spec.system, r.spec.system)}",
        )
        for r in main
    ]
    bars.sort(key=lambda b: (_config_order((b[0].spec.label, b[0].spec.algorithm)), b[1]))
    part_colors = {
        "generation": "#2ca02c",
        "scoring": "#9467bd",
        "update": "#d62728",
        "other": "#7f7f7f",
    }
    for i, (r, _) in enumerate(bars):
        total = sum(r.split_median(k) for k in SPLIT_KEYS)
        bottom = 0.0
        for key in SPLIT_KEYS:
            share = 100 * r.split_median(key) / total
            ax.bar(i, share, bottom=bottom, color=part_colors[key], label=key if i == 0 else None)
            bottom += share
    ax.set_xticks(range(len(bars)))
    ax.set_xticklabels([name for _, name in bars], fontsize=6)
    ax.set_ylabel("% of the iteration")
    ax.set_title("Where the time goes")
    # Beside the bars, not over them: every bar reaches 100%.
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)

    for ax, kind in zip(axes[1] if sweeps else [], SWEEP_KINDS):
        points = scaling_points(results, kind)
        if points:
            xs = [x for x, _, _ in points]
            ax.plot(xs, [o.median for _, o, _ in points], "o-", color=colors["mlx"], label="mlx")
            trl = [(x, t.median) for x, _, t in points if t is not None]
            if trl:
                ax.plot(*zip(*trl), "s-", color=colors["trl"], label="trl")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log", base=2)
            ax.set_xticks(xs)
            ax.set_xticklabels([str(x) for x in xs])
            ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
            ax.legend()
            fixed = points[0][1].spec
            if kind == "tokens":
                ax.set_xlabel(f"new tokens per response ({fixed.rollout_size} sequences)")
            else:
                ax.set_xlabel(f"prompts per iteration ({fixed.max_new_tokens} new tokens)")
        ax.set_ylabel("seconds per iteration (median)")
        ax.set_title(f"PPO cost vs {'response length' if kind == 'tokens' else 'batch size'}")
        ax.grid(True, which="both", alpha=0.3)

    fig.suptitle(f"PPO / GRPO iteration throughput ({chart_device(results)})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


#: What :func:`load_results` puts where results.json has no prompt texts.
PROMPTS_NOT_SAVED = "(prompt text not saved in results.json)"


def load_results(path: Path) -> list[RunResult]:
    """The results of an earlier run, from the ``results.json`` it wrote, for its chart and
    tables. That file leaves out the prompt texts; each spec gets ``batch_size`` copies of
    ``PROMPTS_NOT_SAVED`` in their place."""
    try:
        items = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise SystemExit(f"cannot read the results of {path}: {err}") from err
    results = []
    for item in items:
        spec = item["spec"]
        spec.setdefault("prompts", [PROMPTS_NOT_SAVED] * spec["batch_size"])
        results.append(RunResult.from_json(json.dumps(item)))
    return results


def _narrow(label: str) -> str:
    """A configuration's label on two lines where it is long (``smollm2-\\n135m``), so that
    the split chart's bar labels do not run into each other."""
    head, sep, tail = label.partition("-")
    return f"{head}{sep}\n{tail}" if len(label) > 8 and sep else label


def _config_order(key: tuple[str, str]) -> tuple[int, str, int]:
    """Sort key of a (label, algorithm) pair: the real shapes, toy-llama, toy, tiny, medium, then
    the rest; PPO first."""
    names = (*REAL_MODELS, "toy-llama", "toy", "tiny", "medium")
    order = {name: i for i, name in enumerate(names)}
    return order.get(key[0], len(names)), key[0], 0 if key[1] == "ppo" else 1


def _label_order(label: str) -> tuple[int, str, int]:
    return _config_order((label, "ppo"))


# ---------------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--compare",
        choices=["trl", "peers", "all"],
        action="append",
        default=[],
        help="also run TRL's PPOTrainer and GRPOTrainer (trl; pip install -r "
        "requirements-bench.txt), the MLX peers' GRPO (peers: mlx-lm-lora, textpolicy), or both "
        "(all); may be repeated",
    )
    parser.add_argument(
        "--textpolicy-python",
        type=Path,
        default=None,
        help=f"the Python >= 3.12 interpreter with textpolicy installed (default: "
        f"${TEXTPOLICY_PYTHON_ENV}, else .venv-textpolicy/bin/python)",
    )
    parser.add_argument("--smoke", action="store_true", help="toy sizes, in seconds (tests)")
    parser.add_argument("--out", type=Path, default=Path("runs/benchmarks"))
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations (tiny)")
    parser.add_argument("--iterations", type=int, default=5, help="timed iterations (tiny)")
    parser.add_argument("--medium-warmup", type=int, default=1)
    parser.add_argument("--medium-iterations", type=int, default=3)
    parser.add_argument("--floor-repeats", type=int, default=5)
    parser.add_argument("--no-medium", action="store_true", help="skip the ~100M model")
    parser.add_argument(
        "--real",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the real shapes (SmolLM2-135M, Qwen3-0.6B architectures, random weights, LoRA; "
        "minutes per iteration on a CPU); with --smoke, their code path at toy sizes",
    )
    parser.add_argument(
        "--real-models",
        nargs="+",
        choices=REAL_MODELS,
        default=list(REAL_MODELS),
        help="which real shapes to run (default: all)",
    )
    parser.add_argument("--real-warmup", type=int, default=1, help="untimed iterations (real)")
    parser.add_argument("--real-iterations", type=int, default=2, help="timed iterations (real)")
    parser.add_argument(
        "--real-full",
        action="store_true",
        help="train the real shapes' policies in full (every weight, as TRL's scripts do without "
        "peft) instead of with LoRA r16",
    )
    parser.add_argument(
        "--algorithms",
        nargs="+",
        choices=["ppo", "grpo"],
        default=["ppo", "grpo"],
        help="which algorithms to run at the real shapes (default: both)",
    )
    parser.add_argument(
        "--offload-frozen-models",
        action="store_true",
        help="our rows with offload_frozen_models: true (the reward model, and with --real-full "
        "the reference, on disk outside the scoring phase)",
    )
    parser.add_argument(
        "--real-floor",
        action="store_true",
        help="also time the floor on the real shapes (each piece 1 + --floor-repeats times: "
        "several iterations' time per configuration)",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "gpu"],
        default="cpu",
        help="where both systems compute: the CPU (MLX's CPU device, PyTorch on the CPU), or the "
        "GPU (MLX's GPU device, CUDA (pip install \"mlx[cuda13]\") or Metal; PyTorch's CUDA device)",
    )
    parser.add_argument(
        "--tf32",
        action="store_true",
        help="with --device gpu: float32 matrix products through TF32 on both systems (MLX's "
        "CUDA default); without it, full float32 on both (PyTorch's default)",
    )
    parser.add_argument("--no-sweep", action="store_true", help="skip the scaling sweep")
    parser.add_argument(
        "--baseline",
        type=Path,
        metavar="RESULTS_JSON",
        help="the run to compare with: every phase that grew by more than 10%% is reported "
        "(default: --out's results.json from the last run, when there is one)",
    )
    parser.add_argument(
        "--floors-doc",
        type=Path,
        metavar="MARKDOWN",
        help="rewrite the table of phases beside their floors in this file (between its "
        "phase-floors markers), e.g. docs/performance.md",
    )
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=60.0,
        help="seconds to wait, before each configuration, for other processes to go idle",
    )
    parser.add_argument(
        "--chart-from",
        type=Path,
        metavar="RESULTS_JSON",
        help="no run: print the tables and draw the chart of an earlier run's results.json (a "
        "run rewrites it after every configuration) into --out",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=1,
        help="measure a configuration again when other processes were busy meanwhile",
    )
    args = parser.parse_args(argv)
    if args.tf32 and args.device != "gpu":
        parser.error("--tf32 is a GPU setting: it needs --device gpu")
    if args.baseline is not None and not args.baseline.is_file():
        parser.error(f"--baseline {args.baseline}: no such results.json")
    if args.floors_doc is not None:  # checked now, not after an hour of runs
        if not args.floors_doc.is_file():
            parser.error(
                f"--floors-doc {args.floors_doc}: no such file (give a Markdown file with the "
                f"lines {DOC_BEGIN!r} and {DOC_END!r} where the table goes)"
            )
        problem = markers_problem(args.floors_doc, args.floors_doc.read_text(encoding="utf-8"))
        if problem is not None:
            parser.error(f"--floors-doc: {problem}")
    if (
        min(args.warmup, args.medium_warmup, args.real_warmup, args.retries) < 0
        or min(args.iterations, args.medium_iterations, args.real_iterations) < 1
    ):
        parser.error(
            "--warmup, --medium-warmup, --real-warmup and --retries must be >= 0 and "
            "--iterations, --medium-iterations, --real-iterations >= 1"
        )
    return args


def main(argv: Sequence[str] | None = None) -> list[RunResult]:
    """Run the benchmark, print its tables, write the chart; returns every result."""
    args = parse_args(argv)
    if args.chart_from is not None:
        saved = load_results(args.chart_from)
        args.out.mkdir(parents=True, exist_ok=True)
        print("\n".join(report_lines(saved, any(r.spec.system == "trl" for r in saved))))
        print(f"chart: {write_chart(saved, args.out / 'ppo_throughput.png')}")
        write_floors_doc(args.floors_doc, saved)
        return saved
    plan = build_plan(args)
    compare = bool({"trl", "all"} & set(args.compare))
    notes: list[str] = []
    if compare:
        missing = missing_compare_requirements()
        if missing is not None:
            notes.append(
                f"--compare trl skipped: {missing}. Install the comparison's requirements with "
                "`pip install -r requirements-bench.txt` (PyTorch 2.13.0 CPU, TRL 1.12.0, PEFT "
                "0.21.2)."
            )
            compare = False
    if args.device == "gpu":
        problem = gpu_problem(compare)
        if problem is not None:
            raise SystemExit(f"--device gpu: {problem}")
    peers: dict[str, str] = {}
    tp_python = textpolicy_python(args.textpolicy_python)
    if {"peers", "all"} & set(args.compare):
        for name, version in peer_versions(tp_python).items():
            if version is not None:
                peers[name] = version
            elif name == "textpolicy":
                notes.append(
                    f"--compare peers: textpolicy skipped: no working interpreter at {tp_python}. "
                    "Make one with `python3.12 -m venv .venv-textpolicy && .venv-textpolicy/bin/pip "
                    "install -r requirements-bench-textpolicy.txt` (textpolicy needs Python >= "
                    "3.12) or pass --textpolicy-python."
                )
            else:
                notes.append(
                    f"--compare peers: {name} skipped: it is not installed. Install it with "
                    "`pip install -r requirements-bench.txt`."
                )
    machine = ["== Machine ==", *machine_lines(compare, peers, args.device, args.tf32)]
    print("\n".join([*machine, *notes]))
    baseline_path = args.baseline or args.out / "results.json"
    baseline = load_results(baseline_path) if baseline_path.exists() else None

    results: list[RunResult] = []
    unmeasured: list[str] = []
    with tempfile.TemporaryDirectory(prefix="ppo_throughput_") as tmp:
        work = Path(tmp)
        dirs = _prepare_models(plan, work)
        for config in (*plan.main, *plan.sweep):
            systems: list[System] = ["mlx", "trl"] if compare else ["mlx"]
            # The peers train full weights: they run the tiny sizes, not the real shapes (LoRA).
            if config.algorithm == "grpo" and config in plan.main and not is_real(config.model):
                systems += [cast(System, name) for name in PEER_SYSTEMS if name in peers]
            for system in systems:
                spec = _spec(config, system, plan, dirs, measure_floor=config in plan.main)
                python = str(tp_python) if system == "textpolicy" else None
                try:
                    results.append(_measure(spec, plan, work, args, python))
                    save_results(results, args.out / "results.json")  # kept if a later one fails
                except WorkerKilled as err:
                    print(f"  not measured: {err}", flush=True)
                    unmeasured.append(str(err))

    report = report_lines(results, compare)
    if unmeasured:
        report += ["\n== Not measured ==", *unmeasured]
    if baseline is not None:
        grew = growth_lines(results, baseline)
        report += [
            f"\n== Against the baseline ({baseline_path}; a phase that grew by more than 10%) ==",
            *(grew or ["nothing grew by more than 10%"]),
        ]
    print("\n".join(report))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.txt").write_text("\n".join([*machine, *report]) + "\n", encoding="utf-8")
    chart = write_chart(results, args.out / "ppo_throughput.png")
    save_results(results, args.out / "results.json")
    print(f"\nchart: {chart}\nresults: {args.out / 'results.json'}")
    write_floors_doc(args.floors_doc, results)
    return results


def write_floors_doc(path: Path | None, results: Sequence[RunResult]) -> None:
    """With ``--floors-doc``, rewrite its table of the phases beside their floors.

    Raises:
        SystemExit: no result at a real shape measured the machine's limits.
    """
    if path is None:
        return
    rows = floor_rows(results, MODEL_SHAPES)
    if not rows:
        raise SystemExit(
            f"--floors-doc: no MLX result at a real shape measured the machine's limits; run "
            f"the real shapes ({', '.join(REAL_MODELS)}) first"
        )
    write_doc(path, markdown_table(rows, _cpu_name()))
    print(f"the phases beside their floors: {path}")


def save_results(results: Sequence[RunResult], path: Path) -> None:
    """Write ``results`` as :func:`load_results` reads them (prompt texts left out), through a
    temporary file renamed into place: the run rewrites it after every configuration, so that
    what was measured survives a later failure, and a kill never leaves half a file."""
    data = [json.loads(r.to_json()) for r in results]
    for item in data:
        item["spec"].pop("prompts")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(partial, path)


def _measure(
    spec: RunSpec, plan: Plan, work: Path, args: argparse.Namespace, python: str | None = None
) -> RunResult:
    """Measure ``spec`` after waiting for a quiet machine; measure again (up to ``--retries``
    times) when other processes kept more than ``QUIET_CORES`` busy meanwhile, and keep the
    quietest measurement."""
    best: RunResult | None = None
    retries = 0 if args.smoke else args.retries
    for attempt in range(1 + retries):
        busy = None if args.smoke else wait_for_quiet(args.quiet_wait)
        start = time.perf_counter()
        result = run_spec(spec, plan.isolate or spec.system != "mlx", work, python)
        print(
            f"  measured {spec.system} {spec.algorithm} {spec.label}: median "
            f"{result.median:.3f} s/iteration ({time.perf_counter() - start:.0f} s, "
            f"other load before {_fmt_load(busy)}, during {_fmt_load(result.other_load)})",
            flush=True,
        )
        if best is None or (result.other_load or 0.0) < (best.other_load or 0.0):
            best = result
        if result.other_load is None or result.other_load < QUIET_CORES:
            break
        if attempt < retries:
            print("    the machine was busy: measuring again", flush=True)
    assert best is not None
    return best


def _prepare_models(plan: Plan, work: Path) -> dict[str, tuple[Path, Path, list[str]]]:
    """Checkpoints and prompts of every model size the plan uses (built once, shared by both
    systems): ``{model: (policy_dir, reward_dir, prompts)}``."""
    from benchmarks.throughput_models import benchmark_prompts, build_benchmark_checkpoints

    dirs: dict[str, tuple[Path, Path, list[str]]] = {}
    needed = {c.model for c in (*plan.main, *plan.sweep)}
    most_prompts = max(c.batch_size for c in (*plan.main, *plan.sweep))
    for model in sorted(needed, key=lambda m: _config_order((m, ""))):
        start = time.perf_counter()
        policy_dir, reward_dir = build_benchmark_checkpoints(work / model, MODEL_SHAPES[model])
        prompts = benchmark_prompts(policy_dir, most_prompts)
        dirs[model] = (policy_dir, reward_dir, prompts)
        print(f"  built the {model} checkpoints in {time.perf_counter() - start:.1f} s")
    return dirs


_SYSTEM_TITLES = {
    "mlx": "MLX",
    "trl": "TRL",
    "mlx-lm-lora": "mlx-lm-lora",
    "textpolicy": "textpolicy",
}


def report_lines(results: list[RunResult], compare: bool) -> list[str]:
    """The printed report: iterations, MLX / TRL and MLX / each peer, the floor, the sweeps
    (with TRL's column when ``compare``)."""
    out: list[str] = []
    main = [r for r in results if not r.spec.label.startswith(("tokens=", "batch="))]
    params = {r.spec.model: r.params_millions for r in results if r.spec.system == "mlx"}
    out.append("\n== Iterations ==")
    out.append(
        "seconds per iteration over the timed iterations; tok/s = generated tokens / median "
        "iteration; gen/score/update/other = median seconds of each part (TRL's update includes "
        "its advantage code); RSS = the worker's peak resident memory (loading included); "
        "peak MB = MLX's peak array memory (on a GPU, TRL's row: PyTorch's peak CUDA memory "
        "allocated); RSS/MLX = RSS / MLX's peak; other = cores busy with "
        "other processes meanwhile"
    )
    out.append(
        "models: "
        + ", ".join(f"{m} {p:.1f}M parameters" for m, p in params.items())
        + (" (without LoRA adapters)" if any(r.spec.uses_lora for r in results) else "")
    )
    lora = next((r.spec for r in results if r.spec.uses_lora), None)
    if lora is not None:
        real = sorted({r.spec.label for r in results if r.spec.uses_lora}, key=_label_order)
        modules = "/".join(m.split(".")[-1] for m in lora.lora_modules)
        adapters = {
            r.spec.label: r.trainable_millions
            for r in results
            if r.spec.uses_lora and r.spec.system == "mlx" and r.trainable_millions is not None
        }
        if adapters:
            real = [f"{m} {adapters[m]:.2f}M" if m in adapters else m for m in real]
        out.append(
            f"LoRA ({', '.join(real)}): the policy trains adapters of rank {lora.lora_rank}, alpha "
            f"{lora.lora_alpha:g}, no dropout, on {modules} of every block, on both systems (TRL: "
            "PEFT); reference = the policy with its adapters off; the value model trains all "
            "its weights"
        )
    checkpointed = sorted(
        {r.spec.label for r in results if r.spec.gradient_checkpointing}, key=_label_order
    )
    if checkpointed:
        out.append(
            f"gradient checkpointing ({', '.join(checkpointed)}): on both systems, on the policy "
            "and the value model (TRL: transformers' gradient_checkpointing_enable), so that it "
            "fits a 24 GiB machine's memory"
        )
    if any(r.spec.offload_frozen_models for r in results):
        out.append(
            "offload_frozen_models (ours): the reward model (and a fully fine-tuned policy's "
            "reference) on disk outside the scoring phase, read again for each"
        )
    out.extend(iteration_table(results))
    phases = phase_memory_table(results)
    if phases:
        out.append("\n== Peak memory by phase (MLX) ==")
        out.append(
            "the largest over the timed iterations of each phase's peak: resident memory (RSS, "
            "reset between phases; '-' where it cannot be) / MLX's array memory, MB"
        )
        out.extend(phases)
    others = [name for name in ("trl", *PEER_SYSTEMS) if any(r.spec.system == name for r in main)]
    for other in others:
        pairs = []
        for ours in main:
            theirs = find_result(results, ours.spec.label, ours.spec.algorithm, other)
            if ours.spec.system == "mlx" and theirs is not None:
                pairs.append((ours, theirs))
        title = _SYSTEM_TITLES[other]
        out.append(f"\n== MLX / {title} (time per iteration; below 1: MLX is faster) ==")
        out.extend(compare_table(pairs, title))
    out.append("\n== Floor (MLX, measured in the same process as the iterations) ==")
    out.append(
        "median seconds of each piece; basic = sample + lm_forward + lm_train_step; design = "
        "what this design cannot avoid (sampling, reference LM forward, reward [and value] head "
        "forward, one training step per model)"
    )
    out.extend(floor_table(results))
    rows = floor_rows(results, MODEL_SHAPES)
    if rows:
        out.append("\n== Phases beside the machine's floor (MLX; benchmarks/phase_floors.py) ==")
        out.append(
            "floor = what the phase must do (FLOPs, bytes) at this machine's matmul peak and "
            "memory bandwidth (the best the run's workers measured after their iterations); "
            "ratio = measured / floor"
        )
        out.append(limits_line(rows))
        out.extend(floor_lines(rows))
    for kind in SWEEP_KINDS:
        if scaling_points(results, kind):
            title = "response length" if kind == "tokens" else "batch size"
            out.append(f"\n== Scaling with {title} (PPO) ==")
            out.extend(scaling_table(results, kind, compare))
    return out


if __name__ == "__main__":
    main()
