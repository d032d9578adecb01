"""Command line: ``python main.py {demo,train,evaluate,sft,reward} ...``.

The only place that parses files and flags; everything else receives a config object or plain values.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from base_setup import setup_blas

logger = logging.getLogger("ppo_mlx")


def read_prompts(path: str | Path) -> list[Any]:
    """Prompts from a ``.txt`` file (one per line) or ``.jsonl`` (``prompt`` text or chat
    ``messages`` per line). Errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    prompts: list[Any] = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            prompts.append(line)
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from err
        if isinstance(record, dict) and isinstance(record.get("prompt"), str):
            prompts.append(record["prompt"])
        elif isinstance(record, dict) and isinstance(record.get("messages"), list):
            prompts.append(record["messages"])
        else:
            raise ValueError(f"{path}:{lineno}: expected an object with 'prompt' or 'messages'")
    if not prompts:
        raise ValueError(f"prompt file {path} holds no prompts")
    return prompts


def load_function(spec: str) -> Callable[..., Any]:
    """``module.path:function`` -> the function (for ``--reward-fn``)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--reward-fn must look like 'package.module:function', got {spec!r}")
    fn = getattr(importlib.import_module(module_name), attr, None)
    if not callable(fn):
        raise ValueError(f"{spec}: {attr} is not a function in {module_name}")
    return fn


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML run configuration (flat or model/training/ppo)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set kl_coef=0.1 (repeatable)",
    )


def _add_reward_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--reward-fn",
        help="a reward function 'module:function' (prompts, completions) -> list[float], "
        "used instead of the config's reward_model_name",
    )


def _build_trainer(args: argparse.Namespace) -> tuple[Any, list[Any]]:
    """The trainer and the prompts; the config and the prompt file are checked before any model
    is loaded."""
    from config.loading import load_config

    config = load_config(args.config, args.overrides)
    reward = load_function(args.reward_fn) if args.reward_fn else None
    prompts = read_prompts(args.prompts)
    from ppo_trainer.ppo_trainer import PPOTrainer

    return PPOTrainer(config, reward_model=reward), prompts


def cmd_train(args: argparse.Namespace) -> None:
    eval_prompts = read_prompts(args.eval_prompts) if args.eval_prompts else None
    trainer, prompts = _build_trainer(args)
    history = trainer.train(prompts, eval_prompts=eval_prompts, resume_from=args.resume)
    out = trainer.save_model(Path(trainer.config.output_dir) / "final")
    if not trainer.is_main_process:
        return
    last = history[-1] if history else {}
    print(
        f"trained {len(history)} steps; last mean reward {last.get('avg_reward', float('nan')):.4f}"
    )
    print(f"model: {out}\nmetrics: {trainer.run_dir / 'metrics.jsonl'}")


def cmd_evaluate(args: argparse.Namespace) -> None:
    trainer, prompts = _build_trainer(args)
    if args.checkpoint:
        trainer.load_checkpoint(args.checkpoint)
    elif args.model:
        trainer.load_model(args.model)
    result = trainer.evaluate(prompts, num_samples=args.samples)
    print(json.dumps(result, indent=1))


def cmd_demo(args: argparse.Namespace) -> None:
    from examples.sentiment_demo import run_demo

    run_demo(Path(args.output_dir), fresh=args.fresh, ppo_steps=args.ppo_steps, smoke=args.smoke)


def cmd_sft(args: argparse.Namespace) -> None:
    from config.loading import load_config
    from config.sft_config import SFTConfig
    from training.sft_trainer import run_sft

    overrides = list(args.overrides) + ([f"dataset={args.data}"] if args.data else [])
    out = run_sft(load_config(args.config, overrides, cls=SFTConfig), resume_from=args.resume)
    print(f"SFT model: {out}")


def cmd_reward(args: argparse.Namespace) -> None:
    from config.loading import load_config
    from config.reward_config import RewardConfig
    from training.reward_trainer import run_reward_training

    overrides = list(args.overrides) + ([f"dataset={args.data}"] if args.data else [])
    out = run_reward_training(
        load_config(args.config, overrides, cls=RewardConfig), resume_from=args.resume
    )
    print(f"reward model: {out}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="main.py", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="SFT -> reward model -> PPO on the embedded tiny model")
    demo.add_argument("--output-dir", default="runs/demo")
    demo.add_argument("--fresh", action="store_true", help="rebuild every stage, ignore caches")
    demo.add_argument(
        "--ppo-steps", type=int, default=None, help="PPO iterations (default: demo's)"
    )
    demo.add_argument(
        "--smoke", action="store_true", help="every stage at toy scale in seconds (for tests)"
    )
    demo.set_defaults(func=cmd_demo)

    train = sub.add_parser("train", help="PPO/GRPO from a YAML config")
    _add_config_args(train)
    _add_reward_arg(train)
    train.add_argument("--prompts", required=True, help=".txt (one per line) or .jsonl")
    train.add_argument("--eval-prompts", help="evaluated every eval_every steps and at the end")
    train.add_argument("--resume", help="a checkpoint directory, or 'latest'")
    train.set_defaults(func=cmd_train)

    evaluate = sub.add_parser("evaluate", help="mean reward, KL and samples of a saved policy")
    _add_config_args(evaluate)
    _add_reward_arg(evaluate)
    evaluate.add_argument("--prompts", required=True)
    group = evaluate.add_mutually_exclusive_group()
    group.add_argument("--checkpoint", help="a training checkpoint directory (step_NNNNNN)")
    group.add_argument("--model", help="a directory written by save_model")
    evaluate.add_argument("--samples", type=int, default=4, help="sample completions to print")
    evaluate.set_defaults(func=cmd_evaluate)

    for name, func, help_text in (
        ("sft", cmd_sft, "supervised fine-tuning on prompt/completion or chat JSONL"),
        ("reward", cmd_reward, "reward-model training on prompt/chosen/rejected JSONL"),
    ):
        stage = sub.add_parser(name, help=help_text)
        _add_config_args(stage)
        stage.add_argument("--data", help="the training JSONL (or a dataset name)")
        stage.add_argument("--resume", help="a checkpoint directory, or 'latest'")
        stage.set_defaults(func=func)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    blas = setup_blas()  # first, before anything imports mlx (commands import it lazily)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logger.info(blas.describe())  # the backend line, now that logging is set up
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
