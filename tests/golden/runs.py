"""The golden runs: one tiny, seeded run per kind of training, and what each one records.

Each run trains the embedded tiny model (or the tool-template family's, for agents) for two or
three steps from fixed seeds. What a run records (:func:`outcome`): its per-step metrics without
timings, its config (paths made relative; information only, never compared), and for each trained
model a SHA-256 digest of the final trainable weights, bit for bit, and summary numbers of the
update (final - initial weights: sum, sum of absolute values, sum of squares, in float64).

Two comparisons (:func:`compare`):

* exact: every metric equal as a float and every weight digest equal. ``python -m tests.golden
  check`` reports this; it holds on the machine that recorded the files (same BLAS, same thread
  count), and is the bar a refactoring must meet there.
* close: metrics and update summaries within ``rtol`` (1e-5) of the recording. The pytest test
  (``tests/test_golden.py``) asserts this, because another machine's BLAS kernels or thread count
  change the order of a matmul's sums, so its weights differ in the last bits even when the code
  is the same.

To record again (after a change of behaviour made on purpose, e.g. a changed default; say which
runs changed and why in the commit message)::

    python -m tests.golden record            # every run
    python -m tests.golden record ppo grpo_dapo
    python -m tests.golden check             # which runs differ, exactly or beyond rtol
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, cast

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from config.dpo_config import DPOConfig
from config.ppo_config import PPOConfig
from config.reward_config import RewardConfig
from config.sft_config import SFTConfig
from fixtures.checkpoint_families import build_family_checkpoint
from fixtures.demo_data import preference_records, sft_records
from fixtures.tiny_corpus import review_prompts
from fixtures.tiny_model import build_tiny_checkpoint

# The agent runs' tool, parsers, environment and template are the agent trainer tests' own.
from tests.test_agent_trainer import (  # noqa: F401 (parsers named by "tests.golden.runs:...")
    SHORT_TOOLS_TEMPLATE,
    Counter,
    every_turn_calls,
    every_turn_increments,
    lookup,
    most_frequent_tokens,
)
from tests.test_ppo_trainer import e_rate

#: Where the recordings live, one ``<run>.json`` each.
GOLDEN_DIR = Path(__file__).resolve().parents[1] / "data" / "golden"
#: The tolerance of the close comparison (metrics and update summaries).
RTOL = 1e-5
#: Metric keys that measure time (tests/resume_checks.py's), left out of the recordings.
TIMING_KEYS = ("time/", "tokens_per_second")


# --------------------------------------------------------------------------- what runs use


def flat_or_alternating(completions: list[str], flat: list[bool], **_: Any) -> list[float]:
    """Equal scores in a group of a ``flat`` prompt, 0 and 1 alternating in the others: dynamic
    sampling drops the flat groups."""
    return [1.0 if f else float(i % 2) for i, f in enumerate(flat)]


class EpisodeScore:
    """An environment that scores the episode with one float: its number of calls."""

    def reset(self, **record: Any) -> None:
        self.calls = 0

    def increment(self, by: int) -> str:
        """Add to the counter.

        Args:
            by: How much to add.
        """
        self.calls += by
        return "ok"

    def get_reward(self) -> float:
        return float(self.calls)


AGENT_PROMPTS = [
    {"prompt": "What is stored under apple?", "target": 2},
    {"prompt": "Look up the pear.", "target": 1},
]


@dataclass
class Models:
    """The checkpoints the runs train, built once in ``root``: the tiny model, and the tool
    family's with :data:`SHORT_TOOLS_TEMPLATE` and its most frequent tokens (stop tokens that
    end the random model's turns early)."""

    root: Path
    _tiny: Path | None = None
    _tools: tuple[Path, list[int]] | None = None

    @property
    def tiny(self) -> Path:
        if self._tiny is None:
            self._tiny = build_tiny_checkpoint(self.root / "tiny", size="test", seed=0)
        return self._tiny

    @property
    def tools(self) -> tuple[Path, list[int]]:
        if self._tools is None:
            self._tools = _tools_model(self.root / "qwen3_tools")
        return self._tools


def _tools_model(path: Path) -> tuple[Path, list[int]]:
    build_family_checkpoint(path, "qwen3_tools")
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = SHORT_TOOLS_TEMPLATE
    config_path.write_text(json.dumps(config), encoding="utf-8")
    return path, most_frequent_tokens(path)


# --------------------------------------------------------------------------- the runs


@dataclass
class Trained:
    """What a run leaves: its metrics history, its config, and each trained model's trainable
    weights before and after."""

    history: list[dict[str, Any]]
    config: Any
    before: dict[str, dict[str, np.ndarray]]
    after: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)


def _trainables(model: Any) -> dict[str, np.ndarray]:
    flat = cast(list[tuple[str, Any]], tree_flatten(model.trainable_parameters()))
    return {k: np.array(v) for k, v in flat}


def _rl_settings(models: Models, out: Path, **overrides: Any) -> dict[str, Any]:
    """tests/test_ppo_trainer.py's tiny PPO run: 4 prompts a step, 2 steps."""
    settings: dict[str, Any] = dict(
        model_name=str(models.tiny),
        max_new_tokens=8,
        batch_size=4,
        learning_rate=1e-3,
        num_ppo_epochs=2,
        num_mini_batches=2,
        output_dir=str(out),
        progress_bar=False,
        seed=0,
        total_steps=2,
        keep_last_checkpoints=0,
    )
    settings.update(overrides)
    return settings


def _agent_settings(models: Models, out: Path, **overrides: Any) -> dict[str, Any]:
    """tests/test_agent_trainer.py's run: 2 prompt records a step, turns ended on frequent
    tokens, every turn calling a tool."""
    path, stops = models.tools
    settings: dict[str, Any] = dict(
        model_name=str(path),
        max_new_tokens=96,
        max_prompt_length=128,
        batch_size=2,
        learning_rate=1e-3,
        num_ppo_epochs=1,
        use_lora=False,
        num_mini_batches=1,
        output_dir=str(out),
        progress_bar=False,
        seed=0,
        total_steps=2,
        keep_last_checkpoints=0,
        stop_token_ids=stops,
        max_tool_calling_iterations=2,
        tool_call_parser="tests.golden.runs:every_turn_calls",
    )
    settings.update(overrides)
    return settings


def _train_rl(config: PPOConfig, prompts: list[Any], **trainer_args: Any) -> Trained:
    from ppo_trainer.ppo_trainer import PPOTrainer

    trainer = PPOTrainer(config, **trainer_args)
    named: dict[str, Any] = {"policy": trainer.policy}
    if trainer.value_model is not None:
        named["value"] = trainer.value_model
    trained = Trained([], config, {name: _trainables(m) for name, m in named.items()})
    trained.history = trainer.train(prompts, num_epochs=100)  # total_steps ends it
    trained.after = {name: _trainables(m) for name, m in named.items()}
    return trained


def rl_run(**overrides: Any) -> Callable[[Models, Path], Trained]:
    """A single-turn RL run on the tiny model with the reward :func:`e_rate`."""

    def run(models: Models, out: Path) -> Trained:
        config = PPOConfig(**_rl_settings(models, out, **overrides))
        return _train_rl(config, review_prompts(8, seed=0), reward_model=e_rate)

    return run


def dynamic_sampling_run(models: Models, out: Path) -> Trained:
    """GRPO with dynamic sampling: a third of the prompts informative, so steps draw extra
    generation rounds."""
    config = PPOConfig(
        **_rl_settings(
            models,
            out,
            algorithm="grpo",
            group_size=2,
            dynamic_sampling=True,
            max_num_gen_batches=3,
            num_ppo_epochs=1,
            max_new_tokens=4,
            use_lora=False,
        )
    )
    records = [{"prompt": f"Say {i}", "flat": i % 3 != 0} for i in range(24)]
    return _train_rl(config, records, reward_model=flat_or_alternating)


def agent_run(environment: Any = None, **overrides: Any) -> Callable[[Models, Path], Trained]:
    """A multi-turn run on the tool family's model: the function tool :func:`lookup` scored by
    :func:`e_rate`, or an ``environment`` (a class) scored by its own rewards."""

    def run(models: Models, out: Path) -> Trained:
        if environment is None:
            config = PPOConfig(**_agent_settings(models, out, **overrides))
            return _train_rl(
                config, AGENT_PROMPTS, tools=[lookup], reward_model=lambda p, c, **_: e_rate(p, c)
            )
        parser = "tests.golden.runs:every_turn_increments"
        config = PPOConfig(**_agent_settings(models, out, tool_call_parser=parser, **overrides))
        return _train_rl(config, AGENT_PROMPTS, environment_factory=environment)

    return run


def _supervised(trainer: Any, config: Any, data: list[dict[str, str]]) -> Trained:
    trained = Trained([], config, {"model": _trainables(trainer.model)})
    trained.history = trainer.train(data)
    trained.after = {"model": _trainables(trainer.model)}
    return trained


def sft_run(models: Models, out: Path) -> Trained:
    from finetune.sft_trainer import SFTTrainer

    config = SFTConfig(
        model_name=str(models.tiny),
        output_dir=str(out),
        learning_rate=3e-3,
        batch_size=8,
        total_steps=3,
        lr_scheduler="constant",
        progress_bar=False,
        keep_last_checkpoints=0,
    )
    return _supervised(SFTTrainer(config), config, sft_records(24, seed=1))


def reward_model_run(models: Models, out: Path) -> Trained:
    from finetune.reward_trainer import RewardTrainer

    config = RewardConfig(
        model_name=str(models.tiny),
        output_dir=str(out),
        learning_rate=1e-3,
        batch_size=8,
        total_steps=3,
        lr_scheduler="constant",
        progress_bar=False,
        keep_last_checkpoints=0,
    )
    return _supervised(RewardTrainer(config), config, preference_records(24, seed=1))


def dpo_run(models: Models, out: Path) -> Trained:
    from finetune.dpo_trainer import DPOTrainer

    config = DPOConfig(
        model_name=str(models.tiny),
        output_dir=str(out),
        learning_rate=1e-3,
        batch_size=8,
        total_steps=3,
        lr_scheduler="constant",
        progress_bar=False,
        keep_last_checkpoints=0,
        eval_fraction=0.0,
    )
    return _supervised(DPOTrainer(config), config, preference_records(24, seed=0))


#: Every golden run by name. GRPO runs leave temperature, beta, num_ppo_epochs as the Python
#: constructor's defaults (what a user writing ``PPOConfig(algorithm="grpo")`` gets).
RUNS: dict[str, Callable[[Models, Path], Trained]] = {
    "ppo": rl_run(),
    "grpo_bnpo": rl_run(algorithm="grpo", group_size=2, loss_type="bnpo"),
    "grpo_dapo": rl_run(algorithm="grpo", group_size=2, loss_type="dapo"),
    "grpo_grpo": rl_run(algorithm="grpo", group_size=2, loss_type="grpo", beta=0.04),
    "grpo_dr_grpo": rl_run(
        algorithm="grpo", group_size=2, loss_type="dr_grpo", grpo_advantage_scale="none"
    ),
    "rloo": rl_run(algorithm="rloo", group_size=2),
    "reinforce_pp": rl_run(algorithm="reinforce_pp"),
    "reinforce_pp_baseline": rl_run(algorithm="reinforce_pp_baseline", group_size=2),
    "ppo_tools": agent_run(),
    "grpo_tools": agent_run(algorithm="grpo", group_size=2),
    # Room for every turn: Counter's per-turn rewards count on all of them.
    "ppo_environment": agent_run(Counter, max_new_tokens=160, num_ppo_epochs=2),
    "grpo_environment": agent_run(EpisodeScore, algorithm="grpo", group_size=2),
    "grpo_dynamic_sampling": dynamic_sampling_run,
    "ppo_async": rl_run(async_rollout=True, total_steps=3),
    "sft": sft_run,
    "reward_model": reward_model_run,
    "dpo": dpo_run,
}


# --------------------------------------------------------------------------- record and compare


def _plain(value: Any, root: str) -> Any:
    """A config value as JSON, with the temporary folder of the run written ``<tmp>``."""
    if isinstance(value, str):
        return value.replace(root, "<tmp>")
    if isinstance(value, dict):
        return {k: _plain(v, root) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, root) for v in value]
    return value


def weight_summary(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> dict[str, Any]:
    """``digest``: SHA-256 over the final arrays (sorted by name: name, dtype, shape, bytes);
    ``update_sum``, ``update_abs_sum``, ``update_sq_sum``: of final - initial, in float64."""
    digest = hashlib.sha256()
    total = abs_total = sq_total = 0.0
    for name in sorted(after):
        array = after[name]
        digest.update(f"{name}|{array.dtype}|{array.shape}|".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
        delta = array.astype(np.float64) - before[name].astype(np.float64)
        total += float(delta.sum())
        abs_total += float(np.abs(delta).sum())
        sq_total += float((delta * delta).sum())
    return {
        "digest": digest.hexdigest(),
        "arrays": len(after),
        "update_sum": total,
        "update_abs_sum": abs_total,
        "update_sq_sum": sq_total,
    }


def outcome(trained: Trained, root: Path) -> dict[str, Any]:
    """What a golden file holds (see the module docstring)."""
    history = [
        {k: v for k, v in sorted(h.items()) if not k.startswith(TIMING_KEYS)}
        for h in trained.history
    ]
    return {
        "metrics": json.loads(json.dumps(history)),
        "weights": {
            name: weight_summary(trained.before[name], trained.after[name])
            for name in sorted(trained.after)
        },
        "config": _plain(asdict(trained.config), str(root)),
    }


def run_golden(name: str, models: Models) -> dict[str, Any]:
    """Run ``name`` of :data:`RUNS` in a fresh folder under ``models.root``; its outcome.

    OpenBLAS keeps one thread count for the run (``PPO_MLX_ADAPTIVE_BLAS=off``: not the machine's
    load at the time), so that two runs of the same code on one machine agree bit for bit."""
    saved = os.environ.get("PPO_MLX_ADAPTIVE_BLAS")
    os.environ["PPO_MLX_ADAPTIVE_BLAS"] = "off"
    try:
        out = models.root / "runs" / name
        if out.exists():
            shutil.rmtree(out)
        return outcome(RUNS[name](models, out), models.root)
    finally:
        if saved is None:
            os.environ.pop("PPO_MLX_ADAPTIVE_BLAS", None)
        else:
            os.environ["PPO_MLX_ADAPTIVE_BLAS"] = saved


def golden_path(name: str) -> Path:
    return GOLDEN_DIR / f"{name}.json"


def read_golden(name: str) -> dict[str, Any]:
    return dict(json.loads(golden_path(name).read_text(encoding="utf-8")))


def write_golden(name: str, result: dict[str, Any]) -> Path:
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    path = golden_path(name)
    path.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return path


def _relative(a: float, b: float) -> float:
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    return abs(a - b) / max(abs(a), abs(b))


@dataclass
class Comparison:
    """How a run's outcome compares with its recording: ``exact`` (metrics equal as floats,
    digests equal), ``problems`` (what is beyond ``rtol``: missing keys or steps, or values),
    ``max_relative``: the largest relative difference of any metric or update summary."""

    exact: bool
    problems: list[str]
    max_relative: float


def compare(got: dict[str, Any], want: dict[str, Any], rtol: float = RTOL) -> Comparison:
    """Compare an outcome with a recording (see the module docstring)."""
    problems: list[str] = []
    worst = 0.0
    if len(got["metrics"]) != len(want["metrics"]):
        problems.append(f"{len(got['metrics'])} steps, recorded {len(want['metrics'])}")
    for step, (g, w) in enumerate(zip(got["metrics"], want["metrics"]), start=1):
        if g.keys() != w.keys():
            problems.append(f"step {step}: keys {sorted(g.keys() ^ w.keys())} differ")
        for key in sorted(g.keys() & w.keys()):
            rel = _relative(float(g[key]), float(w[key]))
            worst = max(worst, rel)
            # abs floor: metrics that are 0 up to rounding (a mean advantage) have no scale.
            if rel > rtol and abs(g[key] - w[key]) > 1e-7:
                problems.append(f"step {step} {key}: {g[key]!r}, recorded {w[key]!r}")
    exact = got["metrics"] == want["metrics"]
    if got["weights"].keys() != want["weights"].keys():
        problems.append(f"models {sorted(got['weights'])}, recorded {sorted(want['weights'])}")
    for model in sorted(got["weights"].keys() & want["weights"].keys()):
        g, w = got["weights"][model], want["weights"][model]
        exact = exact and g["digest"] == w["digest"]
        for key in ("update_abs_sum", "update_sq_sum", "update_sum"):
            rel = _relative(g[key], w[key])
            # A sum of signed updates cancels: measure its difference on the absolute sum's scale.
            scale = rel if key != "update_sum" else abs(g[key] - w[key]) / w["update_abs_sum"]
            worst = max(worst, scale)
            if scale > rtol:
                problems.append(f"{model} {key}: {g[key]!r}, recorded {w[key]!r}")
    return Comparison(exact and not problems, problems, worst)


def main(argv: list[str] | None = None) -> int:
    """``record [names]`` or ``check [names]`` (every run when none is named)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tests.golden", description=__doc__)
    parser.add_argument("command", choices=["record", "check"])
    parser.add_argument("names", nargs="*", help=f"runs (default: all): {', '.join(RUNS)}")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in RUNS]
    if unknown:
        parser.error(f"unknown runs {unknown}; the runs are {', '.join(RUNS)}")
    failed = 0
    with tempfile.TemporaryDirectory(prefix="golden_") as tmp:
        models = Models(Path(tmp))
        for name in args.names or list(RUNS):
            start = time.perf_counter()
            result = run_golden(name, models)
            seconds = time.perf_counter() - start
            if args.command == "record":
                print(f"{name}: recorded {golden_path(name)} ({seconds:.1f} s)")
                write_golden(name, result)
                continue
            if not golden_path(name).is_file():
                print(f"{name}: no recording ({golden_path(name)})")
                failed += 1
                continue
            want = read_golden(name)
            c = compare(result, want)
            if c.exact:
                verdict = "equal bit for bit"
            elif not c.problems:
                verdict = f"within rtol {RTOL} (max relative difference {c.max_relative:.2e})"
            else:
                verdict = f"DIFFERS (max relative difference {c.max_relative:.2e})"
                failed += 1
            config_note = "" if result["config"] == want["config"] else "; the config differs"
            print(f"{name}: {verdict}{config_note} ({seconds:.1f} s)")
            for problem in c.problems[:10]:
                print(f"    {problem}")
    return 1 if failed else 0
