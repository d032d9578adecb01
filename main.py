"""The command line (``python main.py ...``, or ``ppo-mlx ...`` after ``pip install -e .``).

The only place that parses files and flags; everything else receives a config object or plain values.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from base_setup import setup_blas
from training.run_control import TrainingStopped, raise_interrupted, stop_exit_code

logger = logging.getLogger("ppo_mlx")


def read_prompts(path: str | Path) -> list[Any]:
    """Prompts from a ``.txt`` file (one per line), a ``.jsonl`` file or a Hugging Face Hub
    dataset ("owner/name", its train split) (``prompt`` text or chat ``messages`` per line or
    row; the other fields come along as a prompt record's columns, which reach the reward
    function). Errors name the file and line, or the dataset and row."""
    path = Path(path)
    if not path.is_file():
        name = str(path)
        looks_local = path.suffix in (".txt", ".jsonl", ".json") or name.startswith((".", "/", "~"))
        if path.exists() or looks_local:
            raise FileNotFoundError(f"prompt file {path} does not exist")
        return _hub_prompts(name)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        bad_line = data[: err.start].count(b"\n") + 1
        raise ValueError(
            f"{path}:{bad_line}: not UTF-8 text (byte 0x{data[err.start]:02x}): save the file as "
            "UTF-8"
        ) from None
    prompts: list[Any] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            prompts.append(line)
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from err
        prompts.append(_prompt_of(record, f"{path}:{lineno}"))
    if not prompts:
        raise ValueError(f"prompt file {path} holds no prompts")
    return prompts


def _prompt_of(record: Any, where: str) -> Any:
    """A prompt record's prompt (text or chat messages), with its other fields as columns."""
    from ppo_trainer.prompt_records import prompt_record

    return prompt_record(record, where)


def _hub_prompts(name: str) -> list[Any]:
    """The prompts of the Hub dataset ``name`` (train split), loaded as SFT data is."""
    from finetune.records import load_records

    dataset = load_records(name, lambda record, where: None)
    return [_prompt_of(dict(row), f"{name}[train] row {i}") for i, row in enumerate(dataset)]


def load_function(spec: str) -> Callable[..., Any]:
    """``module.path:function`` -> the function (for ``--reward-fn``)."""
    from ppo_trainer.components import load_function as load

    return load(spec)


#: A --set example per command, with keys of that command's config.
_SET_EXAMPLES = {
    "ppo": "--set algorithm=grpo --set group_size=4",
    "sft": "--set learning_rate=2e-5 --set use_lora=true",
    "reward": "--set margin=0.5 --set max_length=512",
    "dpo": "--set beta=0.1 --set loss_type=ipo",
}


def _add_config_args(parser: argparse.ArgumentParser, kind: str = "ppo") -> None:
    parser.add_argument(
        "--config",
        help="YAML run configuration: keys flat"
        + (" or under model: / training: / ppo:" if kind == "ppo" else "")
        + f" (python main.py config --kind {kind} lists them)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a config key, e.g. {_SET_EXAMPLES[kind]} (repeatable)",
    )


def _add_overwrite_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier run in output_dir (its checkpoints, metrics and model); "
        "without it a fresh run refuses a folder that holds one",
    )


def _add_reward_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--reward-fn",
        help="a reward function 'module:function' or 'path/to/file.py:function' (a module "
        "file in the working directory is loaded from there), called by keyword as in TRL: "
        "f(completions, **kwargs) or f(prompts, completions, <column>...) -> list[float] "
        "(kwargs: prompts, completions, completion_ids and the other fields of the prompt "
        "file's JSONL lines), used instead of the config's reward_model_name",
    )


def _overrides(args: argparse.Namespace) -> list[str]:
    """The ``--set`` overrides, plus ``--overwrite`` and ``--data`` where the command has them."""
    overrides = list(args.overrides)
    if getattr(args, "overwrite", False):
        overrides.append("overwrite_output_dir=true")
    if getattr(args, "data", None):
        overrides.append(f"dataset={args.data}")
    return overrides


def _run_config(args: argparse.Namespace, cls: type[Any]) -> Any:
    """The command's ``cls`` config: ``--config`` and ``--set`` over the defaults; with
    ``--resume``, over the resumed run's own config instead (as its checkpoint recorded it), so
    that a setting not given again keeps the run's value rather than its default. ``output_dir``
    (where ``latest`` is looked for) comes from ``--config`` / ``--set`` as for a fresh run."""
    from config.loading import given_value, load_config
    from training.run_control import check_resume_target, load_resumed_config

    overrides = _overrides(args)
    resume = getattr(args, "resume", None)
    resumed = None if resume is None else load_resumed_config(args.config, overrides, resume, cls)
    if resume is not None and resumed is None:
        check_resume_target(resume, given_value("output_dir", args.config, overrides, cls))
    # Without a recorded config the resume itself fails, naming what is missing.
    return resumed if resumed is not None else load_config(args.config, overrides, cls=cls)


def _build_trainer(
    args: argparse.Namespace, *, resuming: bool, held: contextlib.ExitStack | None = None
) -> tuple[Any, list[Any]]:
    """The trainer and the prompts; the config, the prompt file and the run folder are checked
    before any model is loaded. ``held``: where the run folder's lock is kept (a run)."""
    from config.ppo_config import PPOConfig
    from training.run_control import check_run_dir, run_lock

    config = _run_config(args, PPOConfig)
    reward = load_function(args.reward_fn) if args.reward_fn else None
    prompts = read_prompts(args.prompts)
    if held is not None:  # one writer per run folder (rank 0 writes): up to the saved final/
        from base_setup import distributed as dist

        error = None
        if dist.is_main_process():
            try:
                held.enter_context(run_lock(config.output_dir))
            except ValueError as err:
                error = err
        dist.raise_if_any_rank_failed(error, f"locking output_dir {config.output_dir}")
    if reward is not None:  # a signature the call cannot satisfy fails before the model loads
        from ppo_trainer.prompt_records import check_reward_function, split_records

        check_reward_function(reward, list(split_records(prompts)[1]))
    check_run_dir(
        config.output_dir,
        resuming=resuming,
        overwrite=config.overwrite_output_dir,
        log_with=config.log_with,
    )
    from ppo_trainer.ppo_trainer import PPOTrainer

    return PPOTrainer(config, reward_model=reward), prompts


def cmd_train(args: argparse.Namespace) -> int:
    from training.run_control import stop_exit_code

    eval_prompts = read_prompts(args.eval_prompts) if args.eval_prompts else None
    with contextlib.ExitStack() as held:
        trainer, prompts = _build_trainer(args, resuming=args.resume is not None, held=held)
        history = trainer.train(prompts, eval_prompts=eval_prompts, resume_from=args.resume)
        if trainer.stop_reason is not None:
            # A signal (or a callback) stopped it: the state is saved, the run is not finished.
            if trainer.is_main_process:
                print(
                    f"stopped ({trainer.stop_reason}) after step {trainer.global_step}; the "
                    f"checkpoint is saved: continue with --resume latest",
                    file=sys.stderr,
                )
            return stop_exit_code(trainer.stop_reason)
        out = trainer.save_model(Path(trainer.config.output_dir) / "final")
    if not trainer.is_main_process:
        return 0
    last = history[-1] if history else {}
    print(
        f"trained {len(history)} steps; last mean reward {last.get('avg_reward', float('nan')):.4f}"
    )
    print(f"model: {out}\nmetrics: {trainer.run_dir / 'metrics.jsonl'}")
    return 0


#: ``python main.py distill --loss``: the algorithm of each form.
DISTILL_LOSSES = {"reverse_kl": "distill", "gkd": "gkd"}


def cmd_distill(args: argparse.Namespace) -> int:
    """``train`` with the algorithm of ``--loss`` (``distill``, or ``gkd``) and the teacher of
    ``--teacher`` (over what ``--config`` and ``--set`` say of both)."""
    for item in args.overrides:
        key = item.partition("=")[0].strip()
        if key in ("algorithm", "teacher_model_name", "algorithm.name"):
            raise SystemExit(
                f"distill sets {key} itself (--teacher for the teacher, --loss for the form): "
                f"drop --set {item}"
            )
    algorithm = DISTILL_LOSSES[args.loss]
    args.overrides = [
        *args.overrides,
        f"algorithm={algorithm}",
        f"teacher_model_name={args.teacher}",
    ]
    return cmd_train(args)


def cmd_evaluate(args: argparse.Namespace) -> None:
    from config.ppo_config import PPOConfig

    if args.checkpoint:
        # The checkpoint's own config is the base (as for --resume): its model, reward and
        # sampling settings, so that nothing need be given again and nothing reads as changed.
        args.resume = args.checkpoint
    run_dir = Path(_run_config(args, PPOConfig).output_dir)
    fresh = not run_dir.exists()
    try:
        trainer, prompts = _build_trainer(args, resuming=True)
        if args.checkpoint:
            trainer.load_checkpoint(args.checkpoint)
        elif args.model:
            trainer.load_model(args.model)
        result = trainer.evaluate(prompts, num_samples=args.samples)
    finally:
        if fresh:  # the trainer made output_dir; an evaluation leaves no empty run folder
            _remove_empty_folders(run_dir)
    print(json.dumps(result, indent=1))


def _remove_empty_folders(root: Path) -> None:
    """Remove ``root`` and the folders under it that hold no file (deepest first)."""
    if not root.is_dir():
        return
    for folder in sorted((p for p in root.rglob("*") if p.is_dir()), reverse=True) + [root]:
        if not any(folder.iterdir()):
            folder.rmdir()


def cmd_demo(args: argparse.Namespace) -> None:
    from examples.sentiment_demo import run_demo, run_dpo_demo

    if args.dpo:
        run_dpo_demo(Path(args.output_dir), fresh=args.fresh, smoke=args.smoke)
        return
    run_demo(Path(args.output_dir), fresh=args.fresh, ppo_steps=args.ppo_steps, smoke=args.smoke)


def _print_on_main_process(text: str) -> None:
    """Print ``text`` once: on rank 0 of a data-parallel run (``mlx.launch``)."""
    from base_setup import distributed as dist

    if dist.is_main_process():
        print(text)


def cmd_sft(args: argparse.Namespace) -> None:
    from config.sft_config import SFTConfig
    from finetune.sft_trainer import run_sft

    out = run_sft(_run_config(args, SFTConfig), resume_from=args.resume)
    _print_on_main_process(f"SFT model: {out}")


def cmd_reward(args: argparse.Namespace) -> None:
    from config.reward_config import RewardConfig
    from finetune.reward_trainer import run_reward_training

    out = run_reward_training(_run_config(args, RewardConfig), resume_from=args.resume)
    _print_on_main_process(f"reward model: {out}")


def cmd_dpo(args: argparse.Namespace) -> None:
    from config.dpo_config import DPOConfig
    from finetune.dpo_trainer import run_dpo

    out = run_dpo(_run_config(args, DPOConfig), resume_from=args.resume)
    _print_on_main_process(f"DPO model: {out}")


def cmd_inspect(args: argparse.Namespace) -> None:
    from ppo_trainer.inspector import write_inspector

    print(write_inspector(Path(args.run), step=args.step, out=args.out))


def cmd_audit(args: argparse.Namespace) -> int:
    """Print the reward-hacking audit of a run; 1 when an alert fires (a CI job gates on it)."""
    from ppo_trainer.audit import audit_report, audit_run
    from ppo_trainer.inspector import write_inspector

    run = Path(args.run)
    if not run.is_dir():
        raise FileNotFoundError(f"run folder {run} does not exist: pass a run's output_dir")
    alerts = audit_run(run, reward_weights=_reward_weights(run))
    if alerts and any((run / "rollouts").glob("step_*.jsonl")):
        write_inspector(run)  # the page the alerts' links open
    print(audit_report(alerts, run), end="")
    return 1 if alerts else 0


def _reward_weights(run: Path) -> dict[str, float] | None:
    """``{reward name: weight}`` from the run's ``config.yaml`` (None without reward_funcs)."""
    import yaml

    from config.ppo_config import reward_func_name

    path = run / "config.yaml"
    if not path.is_file():
        return None
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"{path} is not valid YAML ({err}): the run's config is damaged") from None
    funcs = config.get("reward_funcs") if isinstance(config, dict) else None
    if not funcs:
        return None
    weights = config.get("reward_weights") or [1.0] * len(funcs)
    return {reward_func_name(f): float(w) for f, w in zip(funcs, weights)}


def _sampling_settings(args: argparse.Namespace) -> Any:
    from ppo_trainer.chat import SamplingSettings

    return SamplingSettings(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )


def _load_policy(path: str) -> tuple[Any, dict[str, Any] | None]:
    """The policy at ``path`` (a run, adapters, checkpoint, model or Hub id) and the config of
    the run it came from (None if none)."""
    from ppo_trainer.trained_model import load_trained_model, resolve_trained_model

    found = resolve_trained_model(path)
    logger.info("loading %s", found.describe())
    return load_trained_model(found), found.run_config


def _chat_flag(flag: bool | None, run_config: dict[str, Any] | None) -> bool | None:
    """``--chat`` / ``--no-chat`` if given, else the choice the model's training run made
    (``use_chat_template`` true or false), so that generation sends prompts as training did;
    None (the tokenizer decides) for "auto" or a model that is no run's."""
    if flag is not None:
        return flag
    setting = (run_config or {}).get("use_chat_template")
    return setting if isinstance(setting, bool) else None


def cmd_generate(args: argparse.Namespace) -> None:
    from ppo_trainer.chat import check_utf8, generate_text
    from ppo_trainer.components import context_length

    settings = _sampling_settings(args)  # checked before the model is loaded
    if args.prompt == "-":  # bytes that are not UTF-8 are named below, not a traceback
        prompt = sys.stdin.buffer.read().decode("utf-8", "surrogateescape")
    else:
        prompt = args.prompt
    check_utf8(prompt)
    policy, run_config = _load_policy(args.model)
    generate_text(
        policy.model,
        policy.tokenizer,
        prompt,
        settings,
        chat=_chat_flag(args.chat, run_config),
        out=sys.stdout,
        context=context_length(policy),
    )
    print()


def cmd_chat(args: argparse.Namespace) -> None:
    from ppo_trainer.chat import chat_session
    from ppo_trainer.components import context_length

    settings = _sampling_settings(args)
    policy, _ = _load_policy(args.model)
    try:
        chat_session(
            policy.model,
            policy.tokenizer,
            settings,
            stdin=sys.stdin,
            stdout=sys.stdout,
            system=args.system,
            show_prompt=args.show_prompt,
            context=context_length(policy),
        )
    except KeyboardInterrupt as err:
        if getattr(err, "reason", "SIGINT") != "SIGINT":
            raise  # SIGTERM ends the command as it does any other: a message, exit 143
        print()  # Ctrl-C ends the session like /exit


def cmd_export(args: argparse.Namespace) -> None:
    from ppo_trainer.export import export_model

    out = export_model(
        args.run,
        args.out,
        fuse=args.fuse,
        dequantize=args.dequantize,
        overwrite=args.overwrite,
    )
    print(f"exported: {out} (model card: {out / 'README.md'})")


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        metavar="RUN_OR_DIR",
        help="a run directory (final/, model/ or the newest checkpoint), LoRA adapters, a "
        "checkpoint step_NNNNNN, a model directory, or a Hub repo id (owner/name) as train "
        "takes for model_name",
    )
    parser.add_argument("--max-tokens", type=int, default=256, help="most new tokens per reply")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature; 0 = greedy, the default (as mlx_lm.generate)",
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1 = off")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")


DESCRIPTION = """\
RLHF fine-tuning of language models on MLX: supervised fine-tuning, a reward model, then PPO
(value model and GAE), GRPO, RLOO or REINFORCE++ against it, with LoRA or full weights.

The pipeline:   sft  ->  reward  ->  train    then    generate | chat | export
Try it first:   demo (every stage on a tiny model, offline, a few minutes)
See a run:      inspect (what PPO rewarded, token by token, as an HTML page)
                audit (reward hacking: exits 1 when a check fires, docs/audit.md)
Every setting:  config (the keys of each run kind, their defaults and meaning)
"""

EPILOG = """\
examples:
  %(prog)s demo
  %(prog)s sft --data sft.jsonl --set model_name=Qwen/Qwen3-0.6B-Base --set use_lora=true
  %(prog)s reward --data preferences.jsonl --set model_name=runs/sft/model
  %(prog)s train --config run.yaml --prompts prompts.jsonl --set kl_coef=0.1
  %(prog)s train --config run.yaml --prompts prompts.jsonl --resume latest
  %(prog)s chat --model runs/ppo
  %(prog)s config --kind ppo

docs: README.md, docs/configuration.md, docs/models.md, docs/algorithms.md
"""


RESUME_HELP = (
    "a checkpoint directory, or 'latest' (the newest under output_dir); the run keeps its "
    "settings except those --config and --set give again"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ppo-mlx" if Path(sys.argv[0]).name == "ppo-mlx" else "main.py",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log debug lines too (e.g. which BLAS)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add_training_commands(sub)
    _add_model_commands(sub)
    _add_reference_commands(sub)
    return parser


def _add_run_args(parser: argparse.ArgumentParser) -> None:
    """The arguments of an RL run (train, distill): config, reward, prompts, resume."""
    _add_config_args(parser)
    _add_reward_arg(parser)
    parser.add_argument(
        "--prompts",
        required=True,
        help=".txt (one per line), .jsonl or a Hub dataset (owner/name)",
    )
    parser.add_argument("--eval-prompts", help="evaluated every eval_every steps and at the end")
    parser.add_argument("--resume", help=RESUME_HELP)
    _add_overwrite_arg(parser)


def _add_training_commands(sub: Any) -> None:
    """demo, train, distill, evaluate and the sft / reward / dpo stages."""
    demo = sub.add_parser("demo", help="SFT -> reward model -> PPO on the embedded tiny model")
    demo.add_argument(
        "--output-dir", default="runs/demo", help="where the stages write (default: runs/demo)"
    )
    demo.add_argument("--fresh", action="store_true", help="rebuild every stage, ignore caches")
    demo.add_argument(
        "--ppo-steps", type=int, default=None, help="PPO iterations (default: demo's)"
    )
    demo.add_argument(
        "--smoke", action="store_true", help="every stage at toy scale in seconds (for tests)"
    )
    demo.add_argument(
        "--dpo", action="store_true", help="the offline branch: SFT -> DPO instead of RM -> PPO"
    )
    demo.set_defaults(func=cmd_demo)

    train = sub.add_parser(
        "train", help="PPO, GRPO, RLOO, REINFORCE++ or online DPO on a prompt file (config, --set)"
    )
    _add_run_args(train)
    train.set_defaults(func=cmd_train)

    distill = sub.add_parser(
        "distill",
        help="on-policy distillation: the student samples, a teacher scores each token",
    )
    distill.add_argument(
        "--teacher", required=True, help="the teacher: a model folder or Hub id, same tokenizer"
    )
    distill.add_argument(
        "--loss",
        choices=sorted(DISTILL_LOSSES),
        default="reverse_kl",
        help="reverse_kl (default): the teacher's per-token log-ratio on the student's samples "
        "as the advantage (algorithm distill); gkd: TRL's GKD, the generalized JSD over the "
        "vocabulary (beta) on the student's samples or, a share 1 - lmbda of the steps, the "
        "data's completions (algorithm gkd; --set lmbda=..., beta=...)",
    )
    _add_run_args(distill)
    distill.set_defaults(func=cmd_distill)

    evaluate = sub.add_parser("evaluate", help="mean reward, KL and samples of a saved policy")
    _add_config_args(evaluate)
    _add_reward_arg(evaluate)
    evaluate.add_argument(
        "--prompts",
        required=True,
        help=".txt (one per line), .jsonl or a Hub dataset (owner/name)",
    )
    group = evaluate.add_mutually_exclusive_group()
    group.add_argument("--checkpoint", help="a training checkpoint directory (step_NNNNNN)")
    group.add_argument("--model", help="a directory written by save_model")
    evaluate.add_argument("--samples", type=int, default=4, help="sample completions to print")
    evaluate.set_defaults(func=cmd_evaluate)

    for name, func, help_text in (
        ("sft", cmd_sft, "supervised fine-tuning on prompt/completion or chat JSONL"),
        ("reward", cmd_reward, "reward-model training on prompt/chosen/rejected JSONL"),
        ("dpo", cmd_dpo, "DPO, IPO, SimPO, ORPO ... on prompt/chosen/rejected JSONL (no RM)"),
    ):
        stage = sub.add_parser(name, help=help_text)
        _add_config_args(stage, name)
        stage.add_argument("--data", help="the training JSONL (or a dataset name)")
        stage.add_argument("--resume", help=RESUME_HELP)
        _add_overwrite_arg(stage)
        stage.set_defaults(func=func)


def _add_model_commands(sub: Any) -> None:
    """What works on a trained model or run: generate, chat, export, inspect, audit."""
    generate = sub.add_parser("generate", help="complete one prompt with a trained model")
    _add_sampling_args(generate)
    generate.add_argument("--prompt", required=True, help="the prompt text ('-' reads stdin)")
    generate.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the tokenizer's chat template (default: as the model's training run did "
        "(use_chat_template), else when the tokenizer has one, as mlx_lm.generate does); "
        "--no-chat sends the text as it is (models trained on plain prompts, like the demo's)",
    )
    generate.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive multi-turn chat (chat template, streaming)")
    _add_sampling_args(chat)
    chat.add_argument("--system", help="a system message at the start of the conversation")
    chat.add_argument(
        "--show-prompt", action="store_true", help="print the templated prompt before each reply"
    )
    chat.set_defaults(func=cmd_chat)

    export = sub.add_parser(
        "export", help="a self-contained model directory (mlx-lm / transformers) with a card"
    )
    export.add_argument("run", metavar="RUN_OR_DIR", help="what to export (as for generate)")
    export.add_argument("--out", required=True, help="the directory to write")
    export.add_argument("--fuse", action="store_true", help="merge LoRA adapters into the weights")
    export.add_argument(
        "--dequantize", action="store_true", help="float weights from a quantized model"
    )
    export.add_argument(
        "--overwrite", action="store_true", help="replace a non-empty --out directory"
    )
    export.set_defaults(func=cmd_export)
    inspect = sub.add_parser(
        "inspect", help="an HTML page of a run's rollout records, token by token (prints its path)"
    )
    inspect.add_argument("run", help="the run folder (output_dir) holding rollouts/")
    inspect.add_argument("--step", type=int, help="the step the page opens on (default: latest)")
    inspect.add_argument(
        "--out", help="where to write the page (default: RUN/rollouts/inspect.html)"
    )
    inspect.set_defaults(func=cmd_inspect)
    audit = sub.add_parser(
        "audit",
        help="check a run for reward hacking (exits 1 when an alert fires, 2 for a bad RUN)",
    )
    audit.add_argument("run", help="the run folder (output_dir) holding metrics.jsonl, rollouts/")
    audit.set_defaults(func=cmd_audit)


def _add_reference_commands(sub: Any) -> None:
    """What lists the settings and rewards: config, rewards."""
    from config.reference import KINDS

    config = sub.add_parser("config", help="every config key of a run kind: default and meaning")
    config.add_argument(
        "--kind",
        choices=KINDS,
        default="ppo",
        help="the run kind: an algorithm of train (the keys that apply to it, with its "
        "defaults), or sft, reward, dpo",
    )
    config.add_argument(
        "--markdown",
        action="store_true",
        help="print docs/configuration.md (every kind) instead",
    )
    config.set_defaults(func=cmd_config)
    rewards = sub.add_parser(
        "rewards", help="the built-in rewards reward_funcs can name, and the columns they read"
    )
    rewards.set_defaults(func=cmd_rewards)


def cmd_config(args: argparse.Namespace) -> None:
    from config.reference import configuration_markdown, keys_text

    print(configuration_markdown() if args.markdown else keys_text(args.kind), end="")


def cmd_rewards(args: argparse.Namespace) -> None:
    from rewards import list_rewards, rewards_text

    print(rewards_text(list_rewards()), end="")


def main(argv: Sequence[str] | None = None) -> int:
    blas = setup_blas()  # first, before anything imports mlx (commands import it lazily)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.verbose:
        logger.setLevel(logging.DEBUG)
    # A problem with the BLAS was a warning already; a working one is said at debug level.
    logger.debug(blas.describe())
    # SIGTERM (a scheduler, docker stop) as Ctrl-C: within the training loop it finishes the
    # step and saves (StopSignals); outside it the command ends with a message, not silently.
    previous_sigterm = signal.signal(signal.SIGTERM, raise_interrupted)
    previous_sighup = signal.signal(signal.SIGHUP, raise_interrupted)  # the terminal closed
    try:
        code = args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a full disk, a folder that cannot be written: the message says
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:
        reason = getattr(err, "reason", "SIGINT")
        print("interrupted" + ("" if reason == "SIGINT" else f" ({reason})"), file=sys.stderr)
        return stop_exit_code(reason)
    except TrainingStopped as stopped:
        print(str(stopped), file=sys.stderr)
        return stop_exit_code(stopped.reason)
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
        signal.signal(signal.SIGHUP, previous_sighup)
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
