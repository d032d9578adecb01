"""Where metrics go: a JSONL file in the run directory, a PNG plot, optional TensorBoard / W&B."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Literal, Sequence

logger = logging.getLogger("ppo_mlx")

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "training_curves.png"

#: A panel's size in the plot, inches (width, height).
_PANEL_INCHES = (4.2, 3.0)
#: The plot's margins, inches: left (tick labels), right, top (a title), bottom (tick labels and
#: "step"), between columns (the next panel's tick labels), between rows (a title and "step").
_MARGIN_INCHES = (0.75, 0.15, 0.35, 0.55, 0.75, 0.85)

# (title, metric keys) of the plot's panels, in order.
PLOT_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("objective/scores", "objective/rlhf_reward", "eval/mean_reward")),
    ("KL to reference", ("objective/kl",)),
    ("policy loss", ("loss/policy",)),
    ("value loss", ("loss/value",)),
    ("entropy", ("objective/entropy",)),
    ("clip fraction", ("policy/clipfrac", "val/clipfrac")),
    # SFT and reward-model training (finetune/sft_trainer.py, finetune/reward_trainer.py).
    # DPO (finetune/dpo_trainer.py) uses TRL's names.
    ("loss", ("loss/sft", "loss/reward", "loss/dpo", "eval/loss")),
    ("next-token accuracy", ("sft/token_accuracy", "eval/token_accuracy")),
    (
        "preference accuracy",
        ("reward/accuracy", "eval/accuracy", "rewards/accuracies", "eval/rewards/accuracies"),
    ),
    (
        "reward margin (chosen - rejected)",
        ("reward/margin", "eval/margin", "rewards/margins", "eval/rewards/margins"),
    ),
    ("implicit rewards", ("rewards/chosen", "rewards/rejected")),
)


class MetricsLogger:
    """Appends one JSON line per step to ``<run_dir>/metrics.jsonl`` and forwards to a tracker.

    Args:
        run_dir: the run's output directory.
        log_with: ``"none"``, ``"tensorboard"`` (needs ``tensorboardX``) or ``"wandb"``.
        config: the run's configuration as a dict (sent to W&B).
        resume_step: when resuming, lines of steps after this one (written by the interrupted run
            after its last checkpoint) are dropped so the file matches the restored state.
        project: the W&B project name.
    """

    def __init__(
        self,
        run_dir: str | Path,
        log_with: Literal["none", "tensorboard", "wandb"] = "none",
        config: dict[str, Any] | None = None,
        resume_step: int | None = None,
        project: str | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        kept = []
        if resume_step is not None:
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
        # Replaced in one rename: a kill here leaves the old file or the new one, whole.
        tmp = self.path.with_name(f".{METRICS_FILE}.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)
        self._tb: Any = None
        self._wandb: Any = None
        check_tracker(log_with)
        if log_with == "tensorboard":
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        elif log_with == "wandb":
            import wandb

            self._wandb = wandb.init(project=project or "ppo-mlx", config=config or {})

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record one step's scalar metrics (non-scalars such as sample lists go to JSONL only)."""
        record = {"step": step, **metrics}
        line = json.dumps(record) + "\n"
        try:
            _append_line(self.path, line)
        except OSError as err:
            from training.checkpoint import write_failure

            raise write_failure(self.path, err, len(line)) from None
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        """Flush and close the trackers."""
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


#: The package each tracker of ``log_with`` needs.
_TRACKERS = {"tensorboard": "tensorboardX", "wandb": "wandb"}


def check_tracker(log_with: str) -> None:
    """Raise ``ValueError`` (with the install command) if the tracker ``log_with`` names is not
    installed: what a run checks before it touches its folder."""
    package = _TRACKERS.get(log_with)
    if package is not None and importlib.util.find_spec(package) is None:
        raise ValueError(
            f"log_with={log_with!r} needs {package}, which is not installed: pip install "
            f"{package} (or set log_with: none)"
        )


def _append_line(path: Path, line: str) -> None:
    with open(path, "a") as f:
        f.write(line)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics JSONL file (empty if it does not exist).

    A last line cut short (a kill while it was written) is dropped with a warning; a damaged
    line before the last raises ``ValueError`` naming it.
    """
    path = Path(path)
    if not path.is_file():
        return []
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    records: list[dict[str, Any]] = []
    for index, (lineno, line) in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if index == len(lines) - 1:
                logger.warning(
                    "%s:%d: dropped a partly written last line (%s)", path, lineno, err.msg
                )
                break
            raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from err
    return records


#: One curve of the plot: (metric key, steps, values).
Curve = tuple[str, list[float], list[float]]


def plot_series(records: Sequence[dict[str, Any]]) -> list[tuple[str, list[Curve]]]:
    """What :func:`plot_metrics` draws: ``(title, curves)`` for each panel of
    :data:`PLOT_PANELS` that has data, each curve a metric's steps and values.

    A null value is a gap in its curve (NaN, as matplotlib draws it).

    Raises:
        ValueError: no record holds a metric of the plot, or a plotted value or step is neither
            a number nor null (it would fail inside matplotlib as the run ends).
    """
    panels: list[tuple[str, list[Curve]]] = []
    for title, keys in PLOT_PANELS:
        curves = []
        for key in keys:
            steps: list[float] = []
            values: list[float] = []
            for record in records:
                if key not in record:
                    continue
                step, value = _as_number(record.get("step")), record[key]
                number = math.nan if value is None else _as_number(value)
                if step is None or number is None:
                    raise ValueError(
                        f"cannot plot {key} = {value!r} at step {record.get('step')!r}: "
                        "not a number"
                    )
                steps.append(step)
                values.append(number)
            if steps:
                curves.append((key, steps, values))
        if curves:
            panels.append((title, curves))
    if not panels:
        raise ValueError("no known metrics to plot: no record holds a key of PLOT_PANELS")
    return panels


def _as_number(x: Any) -> float | None:
    """``x`` as a float if it is a real number (an int or a float, NaN and infinities
    included; not a bool), else None."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    return None


def plot_metrics(records: Sequence[dict[str, Any]], out_path: str | Path) -> Path:
    """Draw the panels of :data:`PLOT_PANELS` that have data (PPO: reward, KL, losses, entropy,
    clip fractions; SFT and reward-model runs: losses and accuracies) over steps into a PNG
    (:func:`plot_series` says what, and raises on records it cannot draw).

    Drawn on a bare ``Figure`` (no pyplot: nothing global, no GUI backend) with margins fixed in
    inches rather than ``tight_layout``, which measured every text twice and took half the time
    of a plot every run draws when it ends."""
    from matplotlib.figure import Figure

    panels = plot_series(records)
    cols = 3
    rows = math.ceil(len(panels) / cols)
    width, height = _PANEL_INCHES[0] * cols, _PANEL_INCHES[1] * rows
    fig = Figure(figsize=(width, height))
    left, right, top, bottom, between_cols, between_rows = _MARGIN_INCHES
    axes_width = (width - left - right - between_cols * (cols - 1)) / cols
    axes_height = (height - top - bottom - between_rows * (rows - 1)) / rows
    fig.subplots_adjust(
        left=left / width,
        right=1 - right / width,
        top=1 - top / height,
        bottom=bottom / height,
        wspace=between_cols / axes_width,
        hspace=between_rows / axes_height,
    )
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, (title, curves) in zip(axes.flat, panels):
        for key, steps, values in curves:
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, ms=3, label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    out = Path(out_path)
    fig.savefig(out, dpi=110)
    return out
