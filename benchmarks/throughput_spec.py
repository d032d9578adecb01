"""What one throughput measurement runs and what it returns (shared by both workers).

Standard library only: the TRL worker imports this without MLX (and so without ``base_setup``,
which would put OpenBLAS in the process's global symbol scope before PyTorch loads), and the MLX
worker without PyTorch. A :class:`RunSpec` travels to a worker subprocess as JSON and a
:class:`RunResult` comes back the same way.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence, cast

System = Literal["mlx", "trl", "mlx-lm-lora", "textpolicy"]

#: The MLX peers: other MLX trainers, GRPO only (``--compare peers``).
PEER_SYSTEMS: tuple[str, ...] = ("mlx-lm-lora", "textpolicy")
Algorithm = Literal["ppo", "grpo"]
#: Where both systems compute: MLX's CPU device and PyTorch's CPU, or MLX's GPU device (CUDA or
#: Metal) and PyTorch's CUDA device.
Device = Literal["cpu", "gpu"]

#: The parts of an iteration that :class:`RunResult.split` times, in print order.
SPLIT_KEYS: tuple[str, ...] = ("generation", "scoring", "update", "other")

#: The irreducible pieces the MLX worker times beside the iterations (see ``throughput_mlx``).
FLOOR_KEYS: tuple[str, ...] = (
    "sample",
    "lm_forward",
    "head_forward",
    "lm_train_step",
    "head_train_step",
)


@dataclass(frozen=True)
class RunSpec:
    """One configuration to time on one system.

    Attributes:
        system: "mlx" (this library's ``PPOTrainer``), "trl" (TRL's PPOTrainer / GRPOTrainer), or
            an MLX peer's GRPO trainer: "mlx-lm-lora" or "textpolicy".
        algorithm: "ppo" (policy, reference, value and reward models) or "grpo" (no value model).
        label: the configuration's name in the tables ("tiny", "medium", "tokens=64",
            "qwen3-0.6b", ...).
        model: the model size's name (a key of ``ppo_throughput.MODEL_SHAPES``).
        policy_dir: the policy checkpoint (Hugging Face layout, also the reference's weights).
        reward_dir: the reward checkpoint (``<Arch>ForSequenceClassification``, one label), also
            the value model's initial weights.
        prompts: the prompt texts; the first ``batch_size`` are used.
        batch_size: prompts per iteration.
        group_size: completions per prompt (1 for PPO).
        max_new_tokens: tokens generated per completion, exactly (stop tokens are ignored).
        warmup: iterations run first and not timed (compilation, allocator warm-up).
        iterations: timed iterations.
        seed: seed of both systems' random generators.
        threads: CPU threads of the math libraries (torch.set_num_threads; MLX's BLAS uses the
            same number of cores).
        measure_floor: also time the irreducible pieces (MLX worker only).
        floor_repeats: timed repeats of each irreducible piece (their median is reported).
        lora_rank: rank of the policy's LoRA adapters, 0 for full-weight training. With LoRA
            the reference is the policy with its adapters off on both systems (no second copy),
            and the value model still trains all its weights on both.
        lora_alpha: LoRA alpha (the update is scaled by ``lora_alpha / lora_rank``).
        lora_modules: module paths inside a transformer block that get adapters, the same
            strings on both systems (our ``lora_keys``, PEFT's ``target_modules``, which matches
            them as name suffixes), e.g. ``("self_attn.q_proj", "mlp.down_proj")``.
        gradient_checkpointing: recompute the trained models' block activations in the
            backward pass, on both systems (ours: ``gradient_checkpointing``; TRL: the policy's
            and the value model's ``gradient_checkpointing_enable``).
        device: "cpu" (MLX's CPU device, PyTorch on the CPU) or "gpu" (MLX's GPU device, CUDA or
            Metal; PyTorch's CUDA device), the same for both systems.
        tf32: on a GPU, float32 matrix products through TF32 tensor cores on both systems
            (``MLX_ENABLE_TF32=1``, MLX's CUDA default; PyTorch's ``allow_tf32``); False: full
            float32 on both (PyTorch's default).
        value_init: the MLX worker's ``value_init``: "reward" (a full-weight value model from
            the reward checkpoint) or "shared" (adapters and a head on the LoRA policy's base).
        reward_function: the MLX worker's reward as a ``reward_funcs`` entry (a built-in
            reward's name, e.g. "repetition_penalty") instead of the reward model of
            ``reward_dir``, which is then not loaded; None = the reward model.
        share_reward_base: the MLX worker's ``share_reward_base``: ``reward_dir`` is then a
            reward adapter checkpoint on ``policy_dir``'s base, put on the LoRA policy's base.
        offload_frozen_models: the MLX worker's ``offload_frozen_models``: its frozen models
            with weights of their own (the reward model; a fully fine-tuned policy's reference)
            on disk outside the scoring phase.
        measure_limits: the MLX worker also measures the machine's memory bandwidth and matmul
            peak after its iterations (``benchmarks.phase_floors.measure_limits``).
        quick_limits: that measurement on small arrays, once (``phase_floors.QUICK_LIMITS``:
            ``--smoke``'s, its code path in milliseconds).
    """

    system: System
    algorithm: Algorithm
    label: str
    model: str
    policy_dir: str
    reward_dir: str
    prompts: tuple[str, ...]
    batch_size: int
    group_size: int
    max_new_tokens: int
    warmup: int
    iterations: int
    seed: int = 0
    threads: int = 2
    measure_floor: bool = False
    floor_repeats: int = 5
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_modules: tuple[str, ...] = ()
    gradient_checkpointing: bool = False
    device: Device = "cpu"
    tf32: bool = False
    value_init: str = "reward"
    reward_function: str | None = None
    share_reward_base: bool = False
    offload_frozen_models: bool = False
    measure_limits: bool = False
    quick_limits: bool = False

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "gpu"):
            raise ValueError(f"device must be 'cpu' or 'gpu', got {self.device!r}")
        if self.tf32 and self.device != "gpu":
            raise ValueError("tf32 is a GPU setting: it needs device='gpu'")
        if self.batch_size > len(self.prompts):
            raise ValueError(
                f"batch_size={self.batch_size} needs at least that many prompts, got "
                f"{len(self.prompts)}"
            )
        if self.iterations < 1 or self.warmup < 0:
            raise ValueError(
                f"need iterations >= 1 and warmup >= 0, got {self.iterations} and {self.warmup}"
            )
        if self.system in PEER_SYSTEMS and self.algorithm != "grpo":
            raise ValueError(f"{self.system} has no PPO with a value model; it runs only 'grpo'")
        if self.algorithm == "grpo" and self.group_size < 2:
            raise ValueError(f"GRPO needs group_size >= 2, got {self.group_size}")
        if self.value_init not in ("reward", "shared"):
            raise ValueError(f"value_init must be 'reward' or 'shared', got {self.value_init!r}")
        if self.value_init == "shared" and (self.system != "mlx" or self.lora_rank == 0):
            raise ValueError("value_init='shared' is the MLX worker's, with a LoRA policy")
        if self.reward_function is not None and (
            self.system != "mlx" or self.value_init == "reward"
        ):
            raise ValueError(
                "reward_function is the MLX worker's, with a value model that does not start "
                "from the reward checkpoint (value_init='shared')"
            )
        if self.share_reward_base and (
            self.system != "mlx" or self.lora_rank == 0 or self.reward_function is not None
        ):
            raise ValueError(
                "share_reward_base is the MLX worker's, with a LoRA policy and a reward model"
            )
        if self.offload_frozen_models and (self.system != "mlx" or self.share_reward_base):
            raise ValueError(
                "offload_frozen_models is the MLX worker's, with a reward model of its own"
            )
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0 (0: full weights), got {self.lora_rank}")
        if self.system in PEER_SYSTEMS and self.lora_rank > 0:
            raise ValueError(f"the {self.system} worker trains full weights; use lora_rank=0")
        if self.lora_rank > 0 and (self.lora_alpha <= 0 or not self.lora_modules):
            raise ValueError(
                f"LoRA (lora_rank={self.lora_rank}) needs lora_alpha > 0 and lora_modules, got "
                f"{self.lora_alpha} and {self.lora_modules}"
            )

    @property
    def uses_lora(self) -> bool:
        """The policy trains LoRA adapters (else all its weights)."""
        return self.lora_rank > 0

    @property
    def rollout_size(self) -> int:
        """Sequences generated per iteration: ``batch_size * group_size``."""
        return self.batch_size * self.group_size

    @property
    def tokens_per_iteration(self) -> int:
        """Generated tokens per iteration: every sequence gets exactly ``max_new_tokens``."""
        return self.rollout_size * self.max_new_tokens

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        data = json.loads(text)
        data["prompts"] = tuple(data["prompts"])
        data["lora_modules"] = tuple(data.get("lora_modules", ()))
        return cls(**data)


@dataclass
class RunResult:
    """What a worker measured for one :class:`RunSpec`.

    Attributes:
        spec: the configuration.
        seconds: wall-clock seconds of each timed iteration.
        split: per timed iteration, seconds of ``generation`` (sampling with a KV cache),
            ``scoring`` (the no-gradient forward passes: log-probs, reference, value, reward, and
            the host work around them), ``update`` (PPO epochs: forward, backward, optimiser) and
            ``other`` (advantages, metrics, bookkeeping: the rest of the iteration).
        peak_rss_mb: the worker process's peak resident memory (:func:`peak_rss_mb`), loading
            included.
        mlx_peak_mb: MLX's peak memory of arrays over the timed iterations (MLX worker only; on a
            GPU, the GPU's memory).
        params_millions: parameters of the policy (its base weights, LoRA adapters not counted).
        trainable_millions: parameters the policy's optimiser updates (all of them, or the LoRA
            adapters'); None where the worker does not count them.
        floor: median seconds of each irreducible piece (``FLOOR_KEYS``), when measured.
        other_load: CPU cores busy with other work (other processes, hypervisor steal) on
            average during the timed iterations (and the floor); None where /proc/stat is
            missing.
        versions: library versions of the worker.
        torch_peak_mb: PyTorch's peak CUDA memory allocated over the timed iterations (the TRL
            worker on a GPU), the counterpart of ``mlx_peak_mb``.
        limits: the machine's memory bandwidth and matmul peak measured in the worker
            (``benchmarks.phase_floors.measure_limits``), when the spec asked for them.
        prompt_tokens: the rollout's prompt lengths in tokens, one per sequence (MLX worker).
        phase_peaks: per phase (``generation``, ``scoring``, ``update``), the largest over the
            timed iterations of the phase's peak resident memory (``rss_mb``; None where it
            cannot be reset between phases) and of MLX's peak array memory (``mlx_mb``), in MiB
            (MLX worker; ``benchmarks.throughput_mlx.PhasePeaks``).
    """

    spec: RunSpec
    seconds: list[float]
    split: dict[str, list[float]]
    peak_rss_mb: float
    mlx_peak_mb: float | None
    params_millions: float
    floor: dict[str, float] | None = None
    trainable_millions: float | None = None
    other_load: float | None = None
    versions: dict[str, str] = field(default_factory=dict)
    torch_peak_mb: float | None = None
    limits: dict[str, float] | None = None
    prompt_tokens: list[int] | None = None
    phase_peaks: dict[str, dict[str, float | None]] | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of a median iteration."""
        return self.spec.tokens_per_iteration / self.median

    def split_median(self, key: str) -> float:
        return statistics.median(self.split[key])

    def to_json(self) -> str:
        data = asdict(self)
        data["spec"] = json.loads(self.spec.to_json())
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> RunResult:
        data = json.loads(text)
        data["spec"] = RunSpec.from_json(json.dumps(data["spec"]))
        return cls(**data)

    def save(self, path: Path) -> None:
        path.write_text(self.to_json() + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: Path) -> RunResult:
        return cls.from_json(path.read_text(encoding="utf-8"))


#: The phases of an iteration whose peak memory an MLX worker reads
#: (``RunResult.phase_peaks``), in their order.
PHASE_NAMES = ("generation", "scoring", "update")


def find_result(
    results: Sequence[RunResult], label: str, algorithm: str, system: str
) -> RunResult | None:
    """The result of ``results`` for configuration ``label`` / ``algorithm`` on ``system``."""
    key = (label, algorithm, system)
    return next(
        (r for r in results if (r.spec.label, r.spec.algorithm, r.spec.system) == key), None
    )


def package_version(name: str) -> str | None:
    """The installed version of distribution ``name``, or None."""
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_versions(*names: str) -> dict[str, str]:
    """``RunResult.versions`` of these distributions: ``{"mlx_lm": "0.32.2", ...}`` (``-`` in a
    name becomes ``_``; "not installed" for a missing one)."""
    return {name.replace("-", "_"): package_version(name) or "not installed" for name in names}


def peak_rss_mb() -> float:
    """This process's peak resident set size in MiB.

    Linux: ``VmHWM`` of /proc/self/status, the high-water mark of this program's own memory.
    (``ru_maxrss`` is no good for a subprocess: Linux carries it over from the parent across
    fork and exec, so a worker would report at least its parent's peak.) Elsewhere ru_maxrss.
    """
    import resource
    import sys

    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**10  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def reset_peak_rss() -> bool:
    """Reset this process's ``VmHWM`` to its current resident memory (Linux: writing 5 to
    /proc/self/clear_refs); False where that is not possible (the peak then includes what came
    before, such as loading)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return True


#: The environment variable naming the file a worker of :func:`run_module_worker` writes.
#: GRPO's KL weight (k3, to the reference) on every side: TRL's GRPOConfig and the MLX peers are
#: given it, and so is ours (``PPOConfig.beta``; GRPO's own default is TRL's 0.0, no reference).
GRPO_BETA = 0.04
WORKER_RESULT_ENV = "PPO_MLX_WORKER_RESULT"


def run_module_worker(module: str, spec: dict[str, Any], work: Path) -> dict[str, Any]:
    """Run ``python -m <module> --worker <spec file>`` in a fresh process (its peaks its own):
    ``spec`` goes to the worker as a JSON file in ``work``, and the worker writes its result as
    JSON to the file named by ``$PPO_MLX_WORKER_RESULT`` (:func:`write_worker_result`)."""
    import os
    import subprocess
    import sys

    spec_path = work / "spec.json"
    result_path = work / "result.json"
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    subprocess.run(
        [sys.executable, "-m", module, "--worker", str(spec_path)],
        check=True,
        env={**os.environ, WORKER_RESULT_ENV: str(result_path)},
    )
    return cast(dict[str, Any], json.loads(result_path.read_text(encoding="utf-8")))


def write_worker_result(result: dict[str, Any]) -> None:
    """The worker's side of :func:`run_module_worker`: write ``result`` where it is awaited."""
    import os

    Path(os.environ[WORKER_RESULT_ENV]).write_text(json.dumps(result), encoding="utf-8")


def parameters_mb(tree: Any) -> float:
    """MiB of the arrays in an MLX parameter tree (``model.parameters()``)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in cast(list[tuple[str, Any]], tree_flatten(tree))) / 2**20


def load_average() -> str:
    """The machine's 1/5/15-minute load averages, ``"1.2/1.6/2.0"``."""
    import os

    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def _busy_seconds() -> float | None:
    """Seconds of CPU time the whole machine has spent busy since boot (all cores), from
    /proc/stat (user, nice, system, irq, softirq, steal); None where it does not exist."""
    import os

    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class CpuMonitor:
    """How many cores other work kept busy while this process ran a measurement.

    ``other cores = (machine busy CPU seconds - this process's CPU seconds) / wall seconds``.
    Steal time (the hypervisor running other guests on our cores) counts as other work.
    """

    def __init__(self) -> None:
        self._start: tuple[float | None, float, float] | None = None

    @staticmethod
    def _now() -> tuple[float | None, float, float]:
        import os
        import time

        times = os.times()
        return _busy_seconds(), times.user + times.system, time.perf_counter()

    def start(self) -> None:
        self._start = self._now()

    def other_cores(self) -> float | None:
        """Average cores used by others since :meth:`start`; None without /proc/stat."""
        if self._start is None:
            raise ValueError("call CpuMonitor.start() before other_cores()")
        busy0, own0, wall0 = self._start
        busy1, own1, wall1 = self._now()
        if busy0 is None or busy1 is None or wall1 <= wall0:
            return None
        return max(0.0, ((busy1 - busy0) - (own1 - own0)) / (wall1 - wall0))
