"""training/loop.py: the one loop of every stage, driven here by a stage small enough to follow by
hand (its "weights" are one number that each step adds its batch to), so that the order of the
hooks, the evaluation cadence, epochs, checkpoints, stops and resume are checked without a
model."""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import mlx.core as mx
import pytest

from base_setup import distributed as dist
from training.callbacks import TrainerCallback
from training.checkpoint import CheckpointManager
from training.loop import LoopState, TrainingLoop
from training.metrics_logger import METRICS_FILE, plot_series, read_metrics


@dataclass
class Settings:
    """What the loop reads of a run's config."""

    output_dir: str
    total_steps: int
    save_every: int = 0
    eval_every: int = 0
    overwrite_output_dir: bool = False
    log_with: str = "none"
    progress_bar: bool = False
    wandb_project: str | None = None


class Counting:
    """A stage over ``data`` in batches of ``size`` (in order), whose weight ``w`` is the sum of
    the batches seen; it logs ``w`` as ``loss/sft`` and evaluates it as ``eval/loss`` (keys the curves draw).
    """

    def __init__(self, config: Settings, data: list[int], size: int, rl: bool = False) -> None:
        self.trainer = self
        self.config = config
        self.group = dist.world()
        self.is_main_process = True
        self.run_dir = Path(config.output_dir)
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", keep_last=0)
        self.inputs: dict[str, str | None] = {}
        self.label = "count"
        # A supervised stage's policies, or (rl) the RL stage's.
        self.evaluate_first = not rl
        self.final_eval_file: str | None = "eval_final.json" if rl else None
        self.epoch_ends_at_last_step = rl
        self.run = LoopState()
        self.data, self.size = data, size
        self.w = mx.array(0.0)

    @property
    def state(self) -> LoopState:
        return self.run

    @property
    def has_eval(self) -> bool:
        return True

    def check_data(self) -> None:
        self.inputs["data"] = json.dumps(self.data)

    def prepare(self) -> tuple[int, int]:
        per_epoch = -(-len(self.data) // self.size)
        return self.config.total_steps, per_epoch

    def build_optimizers(self, total: int) -> None:
        pass

    def restore(self, path: Path, total: int, steps_per_epoch: int) -> None:
        arrays, saved = CheckpointManager.load(path)
        self.w = arrays["w"]["w"]
        self.run.global_step, self.run.epoch = saved["global_step"], saved["epoch"]
        self.run.step_in_epoch, self.run.history = saved["step_in_epoch"], saved["history"]

    def open(self, resumed: bool) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def step(self, total: int, steps_per_epoch: int) -> dict[str, Any]:
        start = self.run.step_in_epoch * self.size
        self.w = self.w + sum(self.data[start : start + self.size])
        self.run.global_step += 1
        return {"step": self.run.global_step, "epoch": self.run.epoch, "loss/sft": float(self.w)}

    def evaluate(self) -> dict[str, float]:
        return {"eval/loss": float(self.w)}

    def postfix(self, record: Mapping[str, Any]) -> dict[str, str]:
        return {"w": str(record["loss/sft"])}

    def save_checkpoint(self) -> Path:
        state = {
            "global_step": self.run.global_step,
            "epoch": self.run.epoch,
            "step_in_epoch": self.run.step_in_epoch,
            "history": self.run.history,
            "inputs": self.inputs,
        }
        path = self.checkpoints.save(self.run.global_step, {"w": {"w": self.w}}, state)
        for cb in self.run.callbacks:
            cb.on_save(self, self.run.global_step, path)
        return path

    def trained_state(self) -> dict[str, Any]:
        return {"w": self.w}


class Events(TrainerCallback):
    """The hooks' calls, in order; stops the run at ``stop_at``."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.stop_at = stop_at

    def on_train_begin(self, trainer: Any) -> None:
        self.events.append(("begin", trainer.run.global_step))

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        self.events.append(("step", step, trainer.run.epoch))
        if step == self.stop_at:
            trainer.run.stop.request("enough")

    def on_epoch_end(self, trainer: Any, epoch: int, metrics: dict[str, float]) -> None:
        self.events.append(("epoch", epoch, metrics["steps"], metrics["loss/sft"]))

    def on_evaluate(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        self.events.append(("eval", step, metrics["eval/loss"]))

    def on_save(self, trainer: Any, step: int, path: Path) -> None:
        self.events.append(("save", step))

    def on_train_end(self, trainer: Any, history: list[dict[str, float]]) -> None:
        self.events.append(("end", trainer.run.global_step))


DATA = [1, 2, 3, 4, 5]  # batches of 2: [1, 2], [3, 4], [5]; w after each step: 3, 10, 15, 18, ...


def test_a_supervised_stage_runs_its_steps_evaluations_epochs_and_saves_in_order(
    tmp_path: Path,
) -> None:
    config = Settings(str(tmp_path / "run"), total_steps=5, save_every=4, eval_every=2)
    stage = Counting(config, DATA, size=2)
    events = Events()
    history = TrainingLoop(stage, [events]).run(None)
    assert events.events == [
        ("begin", 0),
        ("eval", 0, 0.0),  # before the first step
        ("step", 1, 0),
        ("eval", 2, 10.0),
        ("step", 2, 0),
        ("step", 3, 0),
        ("epoch", 0, 3.0, (3 + 10 + 15) / 3),
        ("eval", 4, 18.0),
        ("step", 4, 1),
        ("save", 4),
        ("eval", 5, 25.0),  # the last step evaluates, in its record
        ("step", 5, 1),
        ("save", 5),  # mid-epoch: the epoch goes on (a longer run resumed would continue it)
        ("end", 5),
    ]
    assert [r["step"] for r in history] == [0, 1, 2, 3, 4, 5]
    assert history[-1] == {"step": 5, "epoch": 1, "loss/sft": 25.0, "eval/loss": 25.0}
    assert [r["step"] for r in read_metrics(tmp_path / "run" / METRICS_FILE)] == list(range(6))
    assert (stage.run.epoch, stage.run.step_in_epoch, stage.run.stop_reason) == (1, 2, None)
    with pytest.raises(ValueError, match="already trained 5 steps.*build a new Counting"):
        TrainingLoop(stage, []).run(None)


def test_an_rl_stage_ends_the_epoch_at_the_last_step_and_writes_eval_final(
    tmp_path: Path,
) -> None:
    config = Settings(str(tmp_path / "run"), total_steps=2, eval_every=3)
    stage = Counting(config, DATA, size=2, rl=True)
    events = Events()
    TrainingLoop(stage, [events]).run(None)
    assert events.events == [
        ("begin", 0),
        ("step", 1, 0),
        ("step", 2, 0),
        ("epoch", 0, 2.0, 6.5),  # the run's last step ends a partial epoch
        ("save", 2),
        ("eval", 2, 10.0),  # after the run, to eval_final.json
        ("end", 2),
    ]
    assert json.loads((tmp_path / "run" / "eval_final.json").read_text()) == {"eval/loss": 10.0}
    assert (stage.run.epoch, stage.run.step_in_epoch) == (1, 0)


def test_a_stop_saves_and_the_resumed_run_ends_as_the_uninterrupted_one(tmp_path: Path) -> None:
    full = Counting(Settings(str(tmp_path / "full"), total_steps=6, eval_every=2), DATA, 2)
    full_history = TrainingLoop(full, []).run(None)

    config = Settings(str(tmp_path / "run"), total_steps=6, eval_every=2)
    stopped = Counting(config, DATA, 2)
    events = Events(stop_at=4)
    TrainingLoop(stopped, [events]).run(None)
    assert events.events[-3:] == [("step", 4, 1), ("save", 4), ("end", 4)]
    assert stopped.run.stop_reason == "enough"

    resumed = Counting(config, DATA, 2)
    history = TrainingLoop(resumed, []).run("latest")
    assert history == full_history and float(resumed.w) == float(full.w) == 30.0
    assert [r["step"] for r in read_metrics(tmp_path / "run" / METRICS_FILE)] == list(range(7))

    # Other data than the checkpoint recorded is refused before any step.
    other = Counting(Settings(str(tmp_path / "run"), total_steps=8), DATA + [6], 2)
    with pytest.raises(ValueError, match="trained on other inputs than this run"):
        TrainingLoop(other, []).run("latest")


def test_the_plot_draws_the_logged_panels_with_nulls_as_gaps() -> None:
    records: list[dict[str, Any]] = [
        {"step": 0, "eval/loss": 2.0},
        {"step": 1, "loss/sft": 1.5, "eval/loss": None, "epoch": 0},
        {"step": 2, "loss/sft": 1.0, "sft/token_accuracy": 0.5},
    ]
    panels = plot_series(records)
    assert [title for title, _ in panels] == ["loss", "next-token accuracy"]  # PLOT_PANELS' order
    loss = {key: (steps, values) for key, steps, values in panels[0][1]}
    assert loss["loss/sft"] == ([1.0, 2.0], [1.5, 1.0])
    steps, values = loss["eval/loss"]
    assert steps == [0.0, 1.0] and values[0] == 2.0 and math.isnan(values[1])
    with pytest.raises(ValueError, match=r"cannot plot loss/sft = 'high' at step 3: not a number"):
        plot_series([*records, {"step": 3, "loss/sft": "high"}])
    with pytest.raises(ValueError, match="no known metrics to plot"):
        plot_series([{"step": 1, "custom/score": 1.0}])


@pytest.mark.plots
def test_a_run_draws_its_curves_and_one_it_cannot_draw_is_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from PIL import Image

    from training.metrics_logger import PLOT_FILE
    from training.run_control import RunLog

    def run(name: str, record: dict[str, Any]) -> Path:
        run_dir = tmp_path / name
        run_dir.mkdir()
        with RunLog(run_dir, Settings(str(run_dir), 2), total=2, initial=0, desc=name) as log:
            for step in (1, 2):
                log.log(step, record, {})
        return run_dir / PLOT_FILE

    plot = run("drawn", {"loss/sft": 1.0, "sft/token_accuracy": 0.5})
    with Image.open(plot) as image:  # two panels: one row of three, at 110 dpi
        assert image.size == (round(3 * 4.2 * 110), round(3.0 * 110))
    with caplog.at_level("WARNING", logger="ppo_mlx"):
        plot = run("undrawable", {"custom/score": 1.0})  # no error at the end of a good run
    assert not plot.exists() and "could not draw" in caplog.text
    assert "no known metrics to plot" in caplog.text
