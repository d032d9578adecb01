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
* :func:`sft_stage`: without ``--model``, the embedded tiny model (random weights) first learns
  the task from the data's demonstrations (reference summaries, replies, solutions), a stage
  cached in ``<output_dir>/sft`` like the demo's.
* :func:`clearly_rose`: whether a per-problem score rose by more than twice its standard error.
* The command line every example shares (:func:`task_argument_parser`, :func:`run_task_cli`):
  samples and mean rewards before and after PPO; ``--resume`` continues a run with the config
  it recorded, as ``main.py train --resume`` does.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
from pathlib import Path
import sys
from typing import Any, Callable, Mapping, Sequence, cast

import numpy as np
import yaml

from config.loading import load_config
from config.ppo_config import PPOConfig
from config.sft_config import SFTConfig
from ppo_trainer.callbacks import CallbackLike
from ppo_trainer.ppo_trainer import PPOTrainer
from finetune.records import load_records, train_eval_split
from finetune.sft_trainer import run_sft
from finetune.stage_cache import cached_stage

logger = logging.getLogger("ppo_mlx")

DATA_DIR = Path(__file__).resolve().parent / "data"
"""The bundled datasets (written for this project; they make every example run offline)."""

RecordConverter = Callable[[Any, str], dict[str, Any]]
"""A task's dataset row -> prompt record; raises ``ValueError("<where>: ...")`` for a malformed
row."""

SFTRecordConverter = Callable[[Mapping[str, Any]], "dict[str, Any] | None"]
"""A task's prompt record -> an SFT record (:mod:`finetune.records`: prompt/completion or
messages) that demonstrates a good completion, or None when the record holds none."""

#: Samples printed by each evaluation before and after PPO.
SHOWN_SAMPLES = 3
#: Training prompts evaluated before and after PPO (the first ones).
EVAL_TRAINING = 32
#: Samples per prompt of those evaluations when they sample (eval_temperature > 0), unless the
#: task asks for more (``run_task_cli``'s ``eval_samples_per_prompt``).
EVAL_SAMPLES_PER_PROMPT = 2


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


# --------------------------------------------------------------------------- the SFT stage


def sft_stage(
    config: PPOConfig,
    records: Sequence[Mapping[str, Any]],
    to_sft: SFTRecordConverter,
    settings: Mapping[str, Any],
    *,
    fresh: bool = False,
) -> Path:
    """Supervised fine-tuning of ``config.model_name`` on the demonstrations of ``records``
    (``to_sft``), with ``settings`` (:class:`SFTConfig` fields, ``total_steps`` and ``batch_size``
    among them); returns the model directory.

    The stage lives in ``<output_dir>/sft`` (its data in ``data.jsonl``, the model in ``model/``)
    and is cached: a later run with the same model, data and settings reuses it and says so
    (``fresh`` rebuilds it). The examples run it on the embedded tiny model, whose random weights
    score nothing on any task, so that PPO starts from a policy that can do the task a little.

    Raises:
        ValueError: no record holds a demonstration.
    """
    demonstrations = [d for d in map(to_sft, records) if d is not None]
    if not demonstrations:
        raise ValueError(
            "the training records hold no demonstrations (reference answers) to fine-tune the "
            "embedded tiny model on before PPO: give --model, or --sft-steps 0 to skip the SFT"
        )
    stage_dir = Path(config.output_dir) / "sft"
    stage_dir.mkdir(parents=True, exist_ok=True)
    data = stage_dir / "data.jsonl"
    text = "".join(json.dumps(d) + "\n" for d in demonstrations)
    data.write_text(text, encoding="utf-8")
    sft_settings = {
        **settings,
        # as many passes as the step budget needs (a few demonstrations make short epochs)
        "num_epochs": math.ceil(
            settings["total_steps"] / math.ceil(len(demonstrations) / settings["batch_size"])
        ),
        "model_name": config.model_name,
        "dataset": str(data),
        "seed": config.seed,
        "eval_fraction": 0.0,  # the task's held-out prompts are kept out of the data instead
    }
    digest = hashlib.sha256(text.encode()).hexdigest()
    logger.info("SFT of %s on %d demonstrations", config.model_name, len(demonstrations))
    return cached_stage(
        "SFT",
        stage_dir,
        {**sft_settings, "data_sha256": digest},
        # The example owns its stage folder: a stage it reruns replaces the earlier run.
        lambda: run_sft(
            SFTConfig(**sft_settings, output_dir=str(stage_dir), overwrite_output_dir=True)
        ),
        fresh=fresh,
    )


# --------------------------------------------------------------------------- before and after


def evaluate_records(
    trainer: PPOTrainer, records: Sequence[Mapping[str, Any]], samples_per_prompt: int = 1
) -> dict[str, Any]:
    """:meth:`PPOTrainer.evaluate` (the task's override, at the evaluation settings) on
    ``records``, each sampled ``samples_per_prompt`` times, keeping every sample; each sample
    gains ``"label"``: a short form of its record's prompt (a text's first line, a conversation's
    last message) for printing."""
    prompts = list(records) * samples_per_prompt
    result = trainer.evaluate(prompts, num_samples=len(prompts))
    for sample, record in zip(result["samples"], prompts):
        sample["label"] = _prompt_label(record["prompt"])
    result["prompts"] = len(records)
    return result


def _prompt_label(prompt: Any, width: int = 60) -> str:
    text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= width else line[: width - 3] + "..."


def print_evaluation(title: str, result: Mapping[str, Any], shown: int = SHOWN_SAMPLES) -> None:
    """The mean reward (and the task's other metrics) and the first ``shown`` samples of
    :func:`evaluate_records`."""
    samples = result["samples"]
    others = [
        f"{key.split('/', 1)[1]} {value:.3f}"
        for key, value in result.items()
        if key.startswith("eval/") and key != "eval/mean_reward" and isinstance(value, float)
    ]
    print(
        f"{title}: mean reward {result['eval/mean_reward']:+.3f} over {len(samples)} samples of "
        f"{result['prompts']} prompts ({', '.join(others)})"
    )
    for sample in samples[:shown]:
        completion = sample["completion"]
        completion = completion if len(completion) <= 160 else completion[:157] + "..."
        print(f"  [{sample['reward']:+.3f}] {sample['label']}\n          -> {completion!r}")


def clearly_rose(before: Sequence[float], after: Sequence[float]) -> tuple[bool, float, float]:
    """Whether the mean of ``after - before`` (paired per problem) exceeds twice its standard
    error: ``(rose, mean change, standard error)``."""
    changes = [a - b for a, b in zip(after, before, strict=True)]
    n = len(changes)
    mean = sum(changes) / n
    var = sum((c - mean) ** 2 for c in changes) / (n - 1) if n > 1 else 0.0
    error = math.sqrt(var / n)
    return mean > 0 and mean > 2 * error, mean, error


def reward_change(before: Mapping[str, Any], after: Mapping[str, Any]) -> tuple[float, float]:
    """The change of the mean reward between two :func:`evaluate_records` results on the same
    prompts, and its standard error over the prompts: ``(mean_p d_p, std_p(d_p) / sqrt(P))``
    with ``d_p`` the change of prompt ``p``'s mean reward (its samples are every ``P``-th);
    the error is 0 for one prompt."""
    num_prompts = before["prompts"]

    def per_prompt(result: Mapping[str, Any]) -> np.ndarray:
        rewards = np.array([s["reward"] for s in result["samples"]], dtype=np.float64)
        return rewards.reshape(-1, num_prompts).mean(axis=0)  # (P,)

    changes = per_prompt(after) - per_prompt(before)  # (P,)
    error = float(changes.std(ddof=1) / np.sqrt(num_prompts)) if num_prompts > 1 else 0.0
    return float(changes.mean()), error


def _verdict(name: str, before: Mapping[str, Any], after: Mapping[str, Any]) -> str:
    """Whether the mean reward on ``name`` rose (or fell) by more than twice its standard error
    (:func:`reward_change`), in words."""
    change, error = reward_change(before, after)
    means = f"{before['eval/mean_reward']:+.3f} -> {after['eval/mean_reward']:+.3f}"
    detail = (
        f"change {change:+.3f} +- {error:.3f} (standard error over {before['prompts']} prompts)"
    )
    if change > 2 * error and change > 0:
        return f"mean reward on {name} rose {means}: {detail}"
    if change < -2 * error and change < 0:
        return f"mean reward on {name} did NOT rise, it fell {means}: {detail}"
    return f"mean reward on {name} did NOT clearly rise {means}: {detail}, within the noise"


# --------------------------------------------------------------------------- command line


def task_argument_parser(description: str, default_data: Path) -> argparse.ArgumentParser:
    """The flags every example takes (a task adds its own)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--model",
        help="policy model directory or Hugging Face repo id; default: build the embedded tiny "
        "model under <output-dir>/tiny_model and fine-tune it on the data first (SFT)",
    )
    parser.add_argument(
        "--tiny-size",
        choices=("test", "demo"),
        default="demo",
        help="size of the embedded tiny model built when --model is not given",
    )
    parser.add_argument(
        "--sft-steps",
        type=int,
        help="steps of the embedded tiny model's SFT (0 = none; default: the task's)",
    )
    parser.add_argument(
        "--fresh", action="store_true", help="rebuild the cached SFT stage of the tiny model"
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
        help="share of the records held out and evaluated before and after PPO (0 = none)",
    )
    parser.add_argument(
        "--resume",
        help="a checkpoint directory, or 'latest' (of the output folder): continue that run with "
        "its own settings, changing only the options given again",
    )
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


def set_values(parser: argparse.ArgumentParser, items: Sequence[str]) -> dict[str, Any]:
    """An example's ``--set KEY=VALUE`` items as ``{key: value}``, each value read as YAML (a
    number YAML leaves a string, such as ``3e-3``, as a float); a malformed item ends the
    program with ``parser``'s usage."""
    values: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set takes KEY=VALUE, got {item!r}")
        parsed = yaml.safe_load(value)
        if isinstance(parsed, str):  # YAML reads 3e-3 (no dot) as a string
            try:
                parsed = float(parsed)
            except ValueError:
                pass
        values[key.strip()] = parsed
    return values


def uses_embedded_model(args: argparse.Namespace) -> bool:
    """Whether the run builds the embedded tiny model: no ``--model``, and no model in
    ``--config`` or ``--set``."""
    return args.model is None and not _sets_model(args)


def config_from_args(
    args: argparse.Namespace,
    task_defaults: Mapping[str, Any],
    default_output_dir: str,
    tiny_defaults: Mapping[str, Any] | None = None,
) -> PPOConfig:
    """The run's config: the task defaults (or the ``--config`` file instead), then ``--set``
    overrides, then the explicit flags. Without ``--model`` the embedded tiny model is built,
    ``tiny_defaults`` go over the task defaults, and a rerun replaces the PPO run in the output
    folder (as the demo's does).

    With ``--resume`` the base is the resumed run's own config, as its checkpoint recorded it
    (:func:`_resumed_config`): the task defaults were for its start.
    """
    given = list(args.overrides)
    flags = {
        "total_steps": args.steps,
        "batch_size": args.batch_size,
        "max_new_tokens": args.max_new_tokens,
        "output_dir": args.output_dir,
    }
    given += [f"{k}={json.dumps(v)}" for k, v in flags.items() if v is not None]
    if args.model is not None:
        given.append(f"model_name={json.dumps(args.model)}")
    if args.resume is not None:
        return _resumed_config(args, given, default_output_dir)
    embedded = uses_embedded_model(args)
    overrides: list[str] = []
    if args.config is None:
        defaults = {**task_defaults, **(tiny_defaults or {})} if embedded else task_defaults
        overrides += [f"output_dir={default_output_dir}"]
        overrides += [f"{k}={json.dumps(v)}" for k, v in defaults.items()]
        if embedded:
            overrides += ["overwrite_output_dir=true"]
    overrides += given
    if embedded:
        from fixtures.tiny_model import build_tiny_checkpoint

        output_dir = load_config(args.config, overrides + ["model_name=tiny"]).output_dir
        model = build_tiny_checkpoint(Path(output_dir) / "tiny_model", size=args.tiny_size)
        logger.info("no --model given: using the embedded tiny model at %s", model)
        overrides.append(f"model_name={json.dumps(str(model))}")
    return load_config(args.config, overrides)


def _resumed_config(
    args: argparse.Namespace, given: Sequence[str], default_output_dir: str
) -> PPOConfig:
    """The config of a ``--resume``: the resumed run's recorded config (its model, the SFT model
    of an offline run, included), with only what ``--config``, ``--set`` and the flags give
    (``given``) on top, as ``main.py train --resume`` builds it. The run is looked for in the
    output folder a fresh run would use.

    Raises:
        ValueError: no checkpoint with a recorded config where ``--resume`` points.
    """
    from config.loading import given_value
    from training.run_control import load_resumed_config

    where = [] if args.config is not None else [f"output_dir={default_output_dir}"]
    run_dir = given_value("output_dir", args.config, [*where, *given])
    config = load_resumed_config(args.config, given, args.resume, PPOConfig, run_dir=run_dir)
    if config is None:
        place = Path(run_dir) / "checkpoints" if args.resume == "latest" else args.resume
        raise ValueError(
            f"--resume {args.resume}: no checkpoint with a recorded config at {place}; start "
            "without --resume, or give --output-dir of the run to continue"
        )
    return cast(PPOConfig, config)


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


def algorithm_header(config: PPOConfig) -> str:
    """The line that says which algorithm trains the policy, and how many samples per prompt."""
    name = config.algorithm_object.title
    group = f", {config.group_size} samples per prompt" if config.group_size > 1 else ""
    steps = "" if config.total_steps is None else f", {config.total_steps} steps"
    return (
        f"algorithm: {name} ({config.algorithm}){group}, {config.batch_size} prompts a step{steps}"
    )


def print_run_summary(
    trainer: PPOTrainer,
    history: Sequence[dict[str, float]],
    before: Mapping[str, Mapping[str, Any]],
    after: Mapping[str, Mapping[str, Any]],
) -> None:
    """The last step's reward, the evaluations after RL (PPO or another ``algorithm``) with a few
    samples, whether the mean reward rose since before it (``before``/``after``:
    :func:`evaluate_records` results by the name of the prompts evaluated), and where the files
    are."""
    if history:
        last = history[-1]
        print(
            f"trained {len(history)} steps; last mean score {last['objective/scores']:+.4f}, "
            f"KL {last['objective/kl']:.4f}"
        )
    for name, result in after.items():
        print_evaluation(f"After {trainer.config.algorithm_object.title}, {name}", result)
    for name in after:
        print(_verdict(name, before[name], after[name]))
    print(f"metrics: {trainer.run_dir / 'metrics.jsonl'}")


def run_task_cli(
    args: argparse.Namespace,
    *,
    to_record: RecordConverter,
    task_defaults: Mapping[str, Any],
    default_output_dir: str,
    build: Callable[[PPOConfig], PPOTrainer],
    to_sft: SFTRecordConverter,
    sft_settings: Mapping[str, Any],
    tiny_defaults: Mapping[str, Any],
    eval_samples_per_prompt: int = EVAL_SAMPLES_PER_PROMPT,
) -> int:
    """Load the data as prompt records and build the trainer (``build(config)``); evaluate it on
    held-out and training prompts, train, evaluate again; save the policy under
    ``<output_dir>/final`` and print the samples, the mean rewards and whether they rose.

    Without ``--model`` the embedded tiny model is first fine-tuned on the training records'
    demonstrations (``to_sft``, ``sft_settings``: :func:`sft_stage`), and PPO runs with
    ``tiny_defaults`` over ``task_defaults``; a line names the algorithm. Sampled evaluations draw
    ``eval_samples_per_prompt`` samples of each prompt (more: a smaller standard error of the
    change). With ``--resume`` the run continues with its recorded config and model
    (:func:`config_from_args`), without an SFT stage. Returns the exit status: 0, or 2 after
    printing a bad input's error (the data is checked before any model is loaded)."""
    try:
        sft_flags = args.sft_steps is not None or args.fresh
        if sft_flags and args.resume is not None:
            raise ValueError(
                "--sft-steps and --fresh are about the SFT before PPO, which a resumed run did "
                "when it began (it continues from its checkpoint): drop them, or --resume"
            )
        if sft_flags and not uses_embedded_model(args):
            raise ValueError(
                "--sft-steps and --fresh are about the SFT of the embedded tiny model, which a run "
                "with a given model does not do: drop them, or drop the model"
            )
        records = load_task_records(args.data, to_record, split=args.split)
        config = config_from_args(args, task_defaults, default_output_dir, tiny_defaults)
        # The split train_on_records makes (the same seed): SFT never sees the held-out records.
        train, held_out = train_eval_split(records, args.eval_fraction, config.seed)
        if args.resume is None and uses_embedded_model(args) and args.sft_steps != 0:
            settings = dict(sft_settings)
            if args.sft_steps is not None:
                settings["total_steps"] = args.sft_steps
            model = sft_stage(config, train, to_sft, settings, fresh=args.fresh)
            config = dataclasses.replace(config, model_name=str(model))
        trainer = build(config)
        print(algorithm_header(config))
        # Sampled evaluations (eval_temperature > 0) draw several samples per prompt: a steadier
        # mean. The training prompts are what PPO raises the reward on; the held-out ones show
        # whether that carries over.
        repeats = 1 if config.eval_temperature == 0 else eval_samples_per_prompt
        evaluated = {"held-out prompts": held_out, "training prompts": train[:EVAL_TRAINING]}
        evaluated = {name: prompts for name, prompts in evaluated.items() if prompts}
        before = {name: evaluate_records(trainer, p, repeats) for name, p in evaluated.items()}
        for name, result in before.items():
            print_evaluation(f"Before {config.algorithm_object.title}, {name}", result)
        history = train_on_records(
            trainer, records, eval_fraction=args.eval_fraction, resume_from=args.resume
        )
        after = {name: evaluate_records(trainer, p, repeats) for name, p in evaluated.items()}
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    trainer.save_model(trainer.run_dir / "final")
    print_run_summary(trainer, history, before, after)
    return 0
