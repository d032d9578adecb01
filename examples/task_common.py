"""What the task trainers (summarization, dialogue, code generation) share.

A task turns each dataset row into a prompt record (:data:`RecordConverter`): ``{"prompt": ...}``
plus the fields its reward reads (reference summaries, unit tests, ...), which
:class:`PPOTrainer` hands to the reward with the completions
(:mod:`ppo_trainer.prompt_records`). So a task trainer trains on the records themselves:
``trainer.train(records)``.

* :func:`load_task_records`: a local JSONL file (every line checked, errors name file and line)
  or a Hugging Face Hub dataset, through :func:`finetune.records.load_records`, as prompt records.
* :func:`train_on_records`: the run on prepared records (held-out evaluation, enough epochs for
  ``total_steps``).
* The command line every example shares (:func:`task_argument_parser`, :func:`run_task_cli`).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path
import sys
from typing import Any, Callable, Mapping, Sequence

from config.loading import load_config
from config.ppo_config import PPOConfig
from ppo_trainer.callbacks import CallbackLike
from ppo_trainer.ppo_trainer import PPOTrainer
from finetune.records import load_records, train_eval_split

logger = logging.getLogger("ppo_mlx")

DATA_DIR = Path(__file__).resolve().parent / "data"
"""The bundled datasets (written for this project; they make every example run offline)."""

RecordConverter = Callable[[Any, str], dict[str, Any]]
"""A task's dataset row -> prompt record; raises ``ValueError("<where>: ...")`` for a malformed
row."""


def load_task_records(
    name_or_path: str | Path, to_record: RecordConverter, *, split: str = "train"
) -> list[dict[str, Any]]:
    """The rows of a local JSONL file or a Hub dataset as prompt records (``to_record``).

    Raises:
        FileNotFoundError: no such file, and no Hub dataset of that name could be loaded.
        ValueError: a malformed row: ``<file>:<line>: ...`` (local) or
            ``<name>[<split>] row <i>: ...`` (Hub).
    """
    rows = load_records(name_or_path, to_record, split=split)
    return [to_record(row, f"record {i}") for i, row in enumerate(rows)]


def require_text(record: Mapping[str, Any], key: str, where: str) -> str:
    """``record[key]`` as a non-empty string, else ValueError naming ``where``."""
    value = record.get(key)
    if not isinstance(value, str) or not value.strip():
        found = "missing" if value is None else f"a {type(value).__name__}"
        raise ValueError(f"{where}: field {key!r} must be a non-empty string, got {found}")
    return value


def require_object(record: Any, where: str, fields: str) -> Mapping[str, Any]:
    """``record`` if it is a JSON object, else ValueError naming ``where`` and the fields."""
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: expected a JSON object with {fields}, got {record!r:.60}")
    return record


def epochs_for_steps(config: PPOConfig, num_prompts: int) -> int:
    """Passes over ``num_prompts`` needed to run ``config.total_steps`` iterations (at least
    ``config.num_epochs``), so that a step budget is never cut short by a small dataset."""
    if config.total_steps is None:
        return config.num_epochs
    steps_per_epoch = math.ceil(num_prompts / config.batch_size)
    return max(config.num_epochs, math.ceil(config.total_steps / steps_per_epoch))


def train_on_records(
    trainer: PPOTrainer,
    records: Sequence[Mapping[str, Any]],
    *,
    eval_fraction: float = 0.0,
    num_epochs: int | None = None,
    callbacks: Sequence[CallbackLike] | None = None,
    resume_from: str | Path | None = None,
) -> list[dict[str, float]]:
    """:meth:`PPOTrainer.train` on prompt records, ``eval_fraction`` of them (seeded by
    ``config.seed``) held out and evaluated every ``eval_every`` steps and at the end (written
    to ``<output_dir>/eval_final.json``). ``num_epochs`` defaults to enough passes for
    ``config.total_steps``."""
    train, held_out = train_eval_split(records, eval_fraction, trainer.config.seed)
    epochs = epochs_for_steps(trainer.config, len(train)) if num_epochs is None else num_epochs
    logger.info(
        "%s: %d training prompts, %d held out for evaluation",
        type(trainer).__name__,
        len(train),
        len(held_out),
    )
    return trainer.train(
        train,
        num_epochs=epochs,
        callbacks=callbacks,
        eval_prompts=held_out or None,
        resume_from=resume_from,
    )


# --------------------------------------------------------------------------- command line


def task_argument_parser(description: str, default_data: Path) -> argparse.ArgumentParser:
    """The flags every example takes (a task adds its own)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--model",
        help="policy model directory or Hugging Face repo id; default: build the embedded tiny "
        "model under <output-dir>/tiny_model",
    )
    parser.add_argument(
        "--tiny-size",
        choices=("test", "demo"),
        default="demo",
        help="size of the embedded tiny model built when --model is not given",
    )
    parser.add_argument(
        "--data",
        default=str(default_data),
        help="a JSONL file or a Hugging Face dataset name (default: the bundled dataset)",
    )
    parser.add_argument("--split", default="train", help="split of a Hub dataset")
    parser.add_argument("--steps", type=int, help="PPO iterations (config total_steps)")
    parser.add_argument("--batch-size", type=int, help="prompts per iteration")
    parser.add_argument("--max-new-tokens", type=int, help="most tokens per response")
    parser.add_argument("--output-dir", help="where checkpoints, metrics and the model go")
    parser.add_argument(
        "--eval-fraction",
        type=float,
        default=0.1,
        help="share of the records held out and evaluated at the end (0 = none)",
    )
    parser.add_argument("--resume", help="a checkpoint directory, or 'latest'")
    parser.add_argument("--config", help="YAML run configuration (replaces the task defaults)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set kl_coef=0.1 (repeatable)",
    )
    return parser


def config_from_args(
    args: argparse.Namespace, task_defaults: Mapping[str, Any], default_output_dir: str
) -> PPOConfig:
    """The run's config: the task defaults (or the ``--config`` file instead), then ``--set``
    overrides, then the explicit flags. Without ``--model`` the embedded tiny model is built."""
    overrides: list[str] = []
    if args.config is None:
        overrides += [f"output_dir={default_output_dir}"]
        overrides += [f"{k}={json.dumps(v)}" for k, v in task_defaults.items()]
    overrides += list(args.overrides)
    flags = {
        "total_steps": args.steps,
        "batch_size": args.batch_size,
        "max_new_tokens": args.max_new_tokens,
        "output_dir": args.output_dir,
    }
    overrides += [f"{k}={json.dumps(v)}" for k, v in flags.items() if v is not None]
    model = args.model
    if model is None and not _sets_model(args):
        from fixtures.tiny_model import build_tiny_checkpoint

        output_dir = load_config(args.config, overrides + ["model_name=tiny"]).output_dir
        model = str(build_tiny_checkpoint(Path(output_dir) / "tiny_model", size=args.tiny_size))
        logger.info("no --model given: using the embedded tiny model at %s", model)
    if model is not None:
        overrides.append(f"model_name={json.dumps(model)}")
    return load_config(args.config, overrides)


def _sets_model(args: argparse.Namespace) -> bool:
    """Whether ``--config`` or ``--set`` names the policy model."""
    if any(o.split("=", 1)[0].strip().replace("-", "_") == "model_name" for o in args.overrides):
        return True
    if args.config is None:
        return False
    import yaml

    data = yaml.safe_load(Path(args.config).read_text(encoding="utf-8")) or {}
    sections = [data] + [data.get(s) for s in ("model", "training", "ppo")]
    return any(isinstance(s, dict) and s.get("model_name") for s in sections)


def print_run_summary(trainer: PPOTrainer, history: Sequence[dict[str, float]]) -> None:
    """The last step's reward, the final evaluation with a few samples, and where files are."""
    if history:
        last = history[-1]
        print(
            f"trained {len(history)} steps; last mean score {last['objective/scores']:+.4f}, "
            f"KL {last['objective/kl']:.4f}"
        )
    final = trainer.run_dir / "eval_final.json"
    if final.is_file():
        result = json.loads(final.read_text())
        scalars = ", ".join(f"{k} {v:.4f}" for k, v in result.items() if isinstance(v, float))
        print(f"held-out evaluation: {scalars}")
    print(f"metrics: {trainer.run_dir / 'metrics.jsonl'}")


def run_task_cli(
    args: argparse.Namespace,
    *,
    to_record: RecordConverter,
    task_defaults: Mapping[str, Any],
    default_output_dir: str,
    build: Callable[[PPOConfig], PPOTrainer],
) -> int:
    """Load the data as prompt records, build the trainer (``build(config)``), train on them,
    save the policy under ``<output_dir>/final`` and print a summary. Returns the exit status: 0,
    or 2 after printing a bad input's error (the data is checked before any model is loaded)."""
    try:
        records = load_task_records(args.data, to_record, split=args.split)
        trainer = build(config_from_args(args, task_defaults, default_output_dir))
        history = train_on_records(
            trainer, records, eval_fraction=args.eval_fraction, resume_from=args.resume
        )
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    trainer.save_model(trainer.run_dir / "final")
    print_run_summary(trainer, history)
    return 0
