"""Tool use, offline: the embedded tiny model learns to call a calculator for arithmetic it cannot
do in its head, then PPO and GRPO train it on whole episodes (call, result, answer).

1. The task (:mod:`examples.tool_use_task`): every ``a * b`` with a 2-digit ``a`` and a 1-digit
   ``b`` (2-9), shuffled by the seed, 40 held out; a ``calculator`` tool that echoes its
   expression (``"37 * 8 = 296"``); the reward ``answer_reward`` (1 when the final turn gives the
   right integer).
2. SFT warm-up (450 steps) on a demonstration of every training problem: 75% call the
   calculator and copy its line into the answer, 25% state the answer without it. Greedy, the
   warmed-up model calls in few held-out episodes (it cannot compute the products itself, and
   its direct answers are wrong), which leaves RL the decision to call to teach.
3. PPO (value model and GAE across the turns, ``lam`` 1; only the model's tokens are actions)
   and GRPO, each from the warmed-up model for 30 steps, with ``tools=[calculator]``
   (multi-turn episodes, KV cache kept across turns), on :func:`shaped_reward` (the task reward
   plus credit for a calculator result and for the answer's digits).
4. Before and after each (greedy, on the held-out problems): task reward, the tool-call success
   rate (the share of episodes that got the calculator's result), the share of calls that were
   well-formed, calls and turns per episode, and whether the task reward and the tool-call
   success rate clearly rose (by more than twice their standard error, paired per problem).

The model is the embedded tiny "demo" checkpoint (3.4M parameters, random weights) with a short
Qwen-style tool template (:data:`TOOL_TEMPLATE`: the tools' names instead of their JSON schemas,
which would cost the near-character-level tiny tokenizer hundreds of tokens per prompt).

Run ``python -m examples.tool_use --seed 1``; ``--smoke`` runs every stage at toy scale (tests).
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a script: MLX's fast BLAS before anything imports mlx
    from base_setup import setup_blas

    setup_blas()

import argparse
import json
import logging
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from config.ppo_config import PPOConfig
from examples.task_common import clearly_rose, epochs_for_steps, sft_stage
from examples.tool_use_task import (
    answer_reward,
    calculator,
    demonstrations,
    final_answer,
    problems,
)
from fixtures.tiny_model import build_tiny_checkpoint
from ppo_trainer.ppo_trainer import PPOTrainer

logger = logging.getLogger("ppo_mlx")

#: Qwen's tool format (``<tool_call>`` in the model's turn, ``<tool_response>`` blocks in a user
#: turn) with a one-line tools header.
TOOL_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools:' }}"
    "{%- for tool in tools %}{{- ' ' + tool.function.name }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message.role != 'system' or not tools %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
#: Training problems with a demonstration in the SFT warm-up (all of them).
DEMONSTRATIONS = 680
#: The share of demonstrations that call the calculator; the others state the answer without
#: it (as a model that does not rely on its tool yet): after the warm-up the model calls in
#: few held-out episodes, so RL has the calls to teach as well as the copying.
CALL_SHARE = 0.75

SFT_SETTINGS: dict[str, Any] = dict(
    learning_rate=3e-3,
    batch_size=8,
    # Copying (question -> call, result -> answer) appears after 300-450 steps, later on some
    # seeds: at 150 the calls copy 1 question in 35, at 300 seeds 2 and 3 do not copy yet, at 450
    # every seed copies (docs/examples.md).
    total_steps=450,
    warmup_steps=5,
    lr_scheduler="cosine",
    eval_fraction=0.0,
    max_length=256,
    use_lora=False,
    progress_bar=False,
)
RL_SETTINGS: dict[str, Any] = dict(
    batch_size=8,
    # An episode: the call (~60 tokens), the tool's result (~35), the answer (~15).
    max_new_tokens=160,
    max_prompt_length=64,
    max_tool_calling_iterations=2,
    temperature=0.7,
    use_lora=False,
    # 5e-4 destabilises 3 of 4 runs from the 450-step warm-up, 1e-3 breaks GRPO's final turns.
    learning_rate=2e-4,
    num_ppo_epochs=1,
    num_mini_batches=2,
    total_steps=30,
    eval_temperature=0.0,
    log_rollouts_every=0,
    progress_bar=False,
)
ALGORITHMS: dict[str, dict[str, Any]] = {
    # lam 1: the episode's reward reaches its first token (the decision to call) undiminished; at
    # 0.95 it arrives there times 0.95**75 = 0.02 while the value model is still untrained, and
    # PPO did not learn to call (docs/agents.md, "PPO's settings for episodes").
    # Raw scores (the shaped reward is already in [0, 1]): the 3-seed results in docs/examples.md
    # were measured so, before normalize_reward's default became "auto".
    "ppo": dict(algorithm="ppo", kl_coef=0.02, lam=1.0, normalize_reward=False),
    "grpo": dict(algorithm="grpo", group_size=4, batch_size=4, beta=0.0, loss_type="dapo"),
}
SMOKE: dict[str, Any] = dict(
    size="test",
    sft={"total_steps": 2, "warmup_steps": 0},
    rl={"total_steps": 1, "batch_size": 2, "max_new_tokens": 48},
    grpo={"batch_size": 2, "group_size": 2},
    held_out=2,
)


#: What the example prints before and after each algorithm: :func:`evaluate`'s keys and their
#: labels. The tool-call success rate is per episode (did the episode get the calculator's
#: result); the per-call rate (the trainer's ``agent/tool_call_success``) is 1.000 from the
#: warm-up on, since the warmed-up model's calls are well-formed: it measures the calls' form.
METRICS = {
    "reward": "task reward",
    "shaped_reward": "shaped reward",
    "episodes_with_successful_call": "tool-call success rate (episodes with a successful call)",
    "tool_call_success": "well-formed calls (successful calls / calls)",
    "tool_calls": "calls per episode",
    "turns": "turns per episode",
}
_RESULT = re.compile(r"<tool_response>\s*[^<]*= (-?\d+)\s*</tool_response>")


def shaped_reward(completions: Sequence[str], answer: Sequence[str], **kwargs: Any) -> list[float]:
    """What RL trains on: the task reward (1 for the right final answer), plus 0.5 when the
    episode holds a calculator result, plus 0.5 times the share of the answer's digits the final
    answer gets right in place. The exact answer alone is rare for the warmed-up tiny model (it
    seldom calls); the shaping rewards the call and copying its result."""
    task = answer_reward(completions, answer)
    rewards = []
    for text, target, exact in zip(completions, answer, task, strict=True):
        called = 0.5 if _RESULT.search(text) else 0.0
        given = final_answer(text)
        digits = 0.0
        if given is not None:
            right = sum(a == b for a, b in zip(str(given), target))
            digits = 0.5 * right / max(len(target), len(str(given)))
        rewards.append(exact + called + digits)
    return rewards


def tool_checkpoint(output_dir: Path, size: Literal["test", "demo"] = "demo") -> Path:
    """The tiny checkpoint (``size`` "demo" or "test") with :data:`TOOL_TEMPLATE` as its chat
    template."""
    path = build_tiny_checkpoint(output_dir / "base", size=size, seed=0)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if config.get("chat_template") != TOOL_TEMPLATE:
        config["chat_template"] = TOOL_TEMPLATE
        config_path.write_text(json.dumps(config, indent=2), encoding="utf-8")
    return path


def warm_up(
    output_dir: Path,
    base: Path,
    train: Sequence[dict[str, Any]],
    seed: int,
    scale: dict[str, Any],
    fresh: bool = False,
) -> Path:
    """The SFT warm-up on :data:`DEMONSTRATIONS` demonstrations, :data:`CALL_SHARE` of them
    calling the calculator, cached in ``output_dir/sft`` unless ``fresh``; returns the model's
    folder."""
    sft = {**SFT_SETTINGS, **scale.get("sft", {})}
    print(
        f"[SFT] {sft['total_steps']} steps on {DEMONSTRATIONS} demonstrations "
        f"({CALL_SHARE:.0%} of them call the calculator)"
    )
    return sft_stage(
        PPOConfig(model_name=str(base), output_dir=str(output_dir), seed=seed),
        demonstrations(train, DEMONSTRATIONS, CALL_SHARE),
        dict,  # the records are the demonstrations already
        sft,
        fresh=fresh,
    )


def evaluate(trainer: PPOTrainer, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Greedy episodes on ``records``: task reward (mean and per problem), the shaped reward
    RL trains on, the tool-call success rate (the share of episodes with a calculator result;
    mean and per problem), the share of well-formed calls (successful calls / calls, the
    trainer's ``agent/tool_call_success``), tool calls and turns per episode."""
    result = trainer.evaluate(list(records), num_samples=len(records), temperature=0.0)
    completions = [s["completion"] for s in result["samples"]]
    per_record = answer_reward(completions, [r["answer"] for r in records])  # the task's
    called = [1.0 if _RESULT.search(c) else 0.0 for c in completions]
    shaped = [float(s["reward"]) for s in result["samples"]]
    return {
        "reward": sum(per_record) / len(per_record),
        "per_record": per_record,
        "shaped_reward": sum(shaped) / len(shaped),
        "episodes_with_successful_call": sum(called) / len(called),
        "called_per_record": called,
        "tool_call_success": result["eval/agent/tool_call_success"],
        "tool_calls": result["eval/agent/tool_calls"],
        "turns": result["eval/agent/turns"],
        "sample": result["samples"][0],
    }


def run(
    output_dir: Path,
    seed: int,
    *,
    smoke: bool = False,
    algorithms: Sequence[str] = ("ppo", "grpo"),
    steps: int | None = None,
    sft_model: Path | None = None,
    fresh: bool = False,
) -> dict[str, Any]:
    """The four stages under ``output_dir``; returns the evaluations before and after each
    algorithm."""
    start = time.perf_counter()
    scale: dict[str, Any] = SMOKE if smoke else {}
    output_dir.mkdir(parents=True, exist_ok=True)
    train, held_out = problems(seed)
    held_out = held_out[: scale.get("held_out", len(held_out))]
    base = tool_checkpoint(output_dir, scale.get("size", "demo"))

    # 2. SFT warm-up on demonstrations (training problems only), cached, unless given.
    if sft_model is None:
        sft_model = warm_up(output_dir, base, train, seed, scale, fresh)

    # 3-4. PPO and GRPO from the warmed-up model, each evaluated before and after.
    results: dict[str, Any] = {}
    for name in algorithms:
        settings = {**RL_SETTINGS, **scale.get("rl", {}), **ALGORITHMS[name]}
        settings.update(scale.get(name, {}))
        if steps is not None:
            settings["total_steps"] = steps
        config = PPOConfig(
            **settings,
            model_name=str(sft_model),
            seed=seed,
            output_dir=str(output_dir / name),
            overwrite_output_dir=True,
        )
        trainer = PPOTrainer(config, tools=[calculator], reward_model=shaped_reward)
        # Every algorithm starts from the same weights: one greedy evaluation serves them all.
        before = results[algorithms[0]]["before"] if results else evaluate(trainer, held_out)
        print(
            f"[{name.upper()}] before: task reward {before['reward']:.3f}, tool-call success rate "
            f"{before['episodes_with_successful_call']:.3f}, turns {before['turns']:.2f}",
            flush=True,
        )
        print(
            f"[{name.upper()}] {config.total_steps} steps of {config.batch_size} problems"
            + (f" x {config.group_size} samples" if config.group_size > 1 else "")
        )
        epochs = epochs_for_steps(config, len(train))
        trainer.train(train, num_epochs=epochs)
        after = evaluate(trainer, held_out)
        for metric, label in METRICS.items():
            print(
                f"{name} {label} on held-out problems: {before[metric]:.3f} -> {after[metric]:.3f}"
            )
        rose = {}
        for label, key in (
            ("task reward", "per_record"),
            ("tool-call success rate", "called_per_record"),
        ):
            rose[label], change, error = clearly_rose(before[key], after[key])
            verdict = "clearly rose" if rose[label] else "did NOT clearly rise"
            print(f"{name} {label} {verdict}: change {change:+.3f} +- {error:.3f}")
        sample = after["sample"]
        print(f"  sample: {sample['completion'][-160:]!r} (reward {sample['reward']})")
        results[name] = {"before": before, "after": after, "rose": rose}
    print(f"total time {time.perf_counter() - start:.0f} s")
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seed", type=int, default=1, help="the task's problems and the run's seed"
    )
    parser.add_argument(
        "--steps", type=int, help=f"RL steps (default {RL_SETTINGS['total_steps']})"
    )
    parser.add_argument(
        "--algorithms", default="ppo,grpo", help="comma-separated: ppo, grpo (default both)"
    )
    parser.add_argument("--output-dir", default="runs/tool_use", help="where the stages go")
    parser.add_argument("--smoke", action="store_true", help="toy scale (tests)")
    parser.add_argument("--sft-model", type=Path, help="a warmed-up model to start from (no SFT)")
    parser.add_argument("--fresh", action="store_true", help="redo the cached SFT warm-up")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    unknown = [a for a in algorithms if a not in ALGORITHMS]
    if unknown:
        parser.error(f"unknown algorithms {unknown}: choose among {sorted(ALGORITHMS)}")
    run(
        Path(args.output_dir),
        args.seed,
        smoke=args.smoke,
        algorithms=algorithms,
        steps=args.steps,
        sft_model=args.sft_model,
        fresh=args.fresh,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
