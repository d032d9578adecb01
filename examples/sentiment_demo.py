"""The demo: the whole RLHF pipeline (SFT -> reward model -> PPO) on the embedded tiny model.

1. Build the tiny Qwen3 checkpoint (tokenizer trained on the project's review corpus, random weights).
2. SFT it on reviews of mixed sentiment: it learns to write short product reviews.
3. Train a reward model (from the SFT weights) on pairs that prefer the more positive review.
4. PPO (LoRA policy, the SFT model as reference, the reward model as reward and value init) makes the
   reviews more positive, within a KL budget.

The reward is a learned number; to make it checkable the demo also prints each sample's sentiment
words (positive minus negative words of the corpus lexicon), which the reader can verify by eye.
Stage outputs are cached under the output directory and reused on the next run (``--fresh`` rebuilds).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from config.dpo_config import DPOConfig
from config.ppo_config import PPOConfig
from config.reward_config import RewardConfig
from config.sft_config import SFTConfig
from fixtures.demo_data import write_preference_data, write_sft_data
from fixtures.tiny_corpus import lexicon_score, review_prompts
from fixtures.tiny_model import build_tiny_checkpoint
from ppo_trainer.inspector import write_inspector
from ppo_trainer.ppo_trainer import PPOTrainer
from training.metrics_logger import read_metrics
from finetune.dpo_trainer import DPOTrainer, answer_token_logps
from finetune.records import load_preference_data
from finetune.reward_trainer import run_reward_training
from finetune.sft_trainer import run_sft
from finetune.stage_cache import cached_stage
from finetune.supervised_trainer import MODEL_DIR, load_run_data
from finetune.tokenize import collate_dpo, tokenize_dpo_pairs
from training.preference_loss import answer_logps

logger = logging.getLogger("ppo_mlx")

# Stage settings, chosen so that the three stages finish in a few minutes on 2 CPU cores.
SFT_SETTINGS: dict[str, Any] = dict(
    learning_rate=3e-3,
    batch_size=32,
    num_epochs=2,
    warmup_steps=10,
    lr_scheduler="cosine",
    eval_fraction=0.05,
    progress_bar=True,
)
REWARD_SETTINGS: dict[str, Any] = dict(
    learning_rate=1e-3,
    batch_size=32,
    num_epochs=1,
    warmup_steps=5,
    eval_fraction=0.1,
    progress_bar=True,
)
PPO_SETTINGS: dict[str, Any] = dict(
    max_new_tokens=24,
    batch_size=16,
    learning_rate=3e-4,
    kl_coef=0.1,
    temperature=0.7,
    num_ppo_epochs=2,
    num_mini_batches=2,
    use_lora=True,
    lora_r=16,
    lora_alpha=32.0,
    value_learning_rate=3e-4,
    save_every=10,
    use_chat_template=False,  # the SFT stage taught plain "Review of ...:" prompts
)
DPO_SETTINGS: dict[str, Any] = dict(
    learning_rate=5e-4,
    batch_size=32,
    num_epochs=1,
    warmup_steps=5,
    use_lora=True,
    lora_r=16,
    lora_alpha=32.0,
    beta=0.1,
    eval_fraction=0.1,
    eval_every=10,
    progress_bar=True,
)
NUM_SFT_EXAMPLES = 3000
NUM_PREFERENCE_PAIRS = 1500
PPO_STEPS = 40

# A seconds-long pass through every stage on the test-size model (``--smoke``; used by the tests).
SMOKE: dict[str, Any] = dict(
    size="test",
    sft_examples=96,
    preference_pairs=96,
    sft={"batch_size": 16, "num_epochs": 1, "warmup_steps": 0},
    reward={"batch_size": 16, "num_epochs": 1, "warmup_steps": 0},
    ppo={"batch_size": 4, "max_new_tokens": 8, "save_every": 0},
    ppo_steps=2,
    eval_prompts=4,
    dpo={"batch_size": 16, "num_epochs": 1, "warmup_steps": 0, "eval_fraction": 0.2},
)


def _show(title: str, result: dict[str, Any], *, kl: bool = True) -> None:
    # round(...) + 0.0: float noise around 0 (the SFT policy is its own reference) prints 0.000,
    # not -0.000.
    kl_text = f", KL to reference {round(result['eval/kl'], 3) + 0.0:.3f}" if kl else ""
    print(
        f"\n{title}: mean reward {result['eval/mean_reward']:+.3f}{kl_text}, sentiment words "
        f"{result['sentiment']:+.2f}"
    )
    for sample in result["samples"]:
        words = lexicon_score(sample["completion"])
        print(
            f"  [{sample['reward']:+.2f} | words {words:+d}] {sample['prompt']}{sample['completion']}"
        )


def _evaluate(trainer: PPOTrainer, prompts: list[str]) -> dict[str, Any]:
    """Evaluate at the sampling temperature; add the mean lexicon sentiment of every completion."""
    result = trainer.evaluate(
        prompts, temperature=trainer.config.temperature, num_samples=len(prompts)
    )
    samples = result["samples"]
    result["sentiment"] = sum(lexicon_score(s["completion"]) for s in samples) / len(samples)
    result["samples"] = samples[:6]
    return result


def _sft_and_reward_stages(
    output_dir: Path, scale: dict[str, Any], fresh: bool
) -> tuple[Path, Path, Path]:
    """Build the base checkpoint and the data, then run (or reuse) SFT and the reward model;
    returns ``(sft model, reward model, preference data)``."""
    output_dir.mkdir(parents=True, exist_ok=True)
    base = build_tiny_checkpoint(output_dir / "base", size=scale.get("size", "demo"), seed=0)
    print(f"[base] tiny Qwen3 checkpoint: {base}")
    data_dir = output_dir / "data"
    sft_data = write_sft_data(
        data_dir / "sft.jsonl", scale.get("sft_examples", NUM_SFT_EXAMPLES), seed=0
    )
    pref_data = write_preference_data(
        data_dir / "preferences.jsonl", scale.get("preference_pairs", NUM_PREFERENCE_PAIRS), seed=1
    )

    sft_dir = output_dir / "sft"
    sft_settings = {
        **SFT_SETTINGS,
        **scale.get("sft", {}),
        "model_name": str(base),
        "dataset": str(sft_data),
    }
    sft_model = cached_stage(
        "SFT",
        sft_dir,
        sft_settings,
        # The demo owns its stage folders: a stage it reruns replaces the earlier run.
        lambda: run_sft(
            SFTConfig(**sft_settings, output_dir=str(sft_dir), overwrite_output_dir=True)
        ),
        fresh=fresh,
    )
    reward_dir = output_dir / "reward"
    reward_settings = {
        **REWARD_SETTINGS,
        **scale.get("reward", {}),
        "model_name": str(sft_model),
        "dataset": str(pref_data),
    }
    reward_model = cached_stage(
        "reward model",
        reward_dir,
        reward_settings,
        lambda: run_reward_training(
            RewardConfig(**reward_settings, output_dir=str(reward_dir), overwrite_output_dir=True)
        ),
        fresh=fresh,
    )
    evals = [r for r in read_metrics(reward_dir / "metrics.jsonl") if "eval/accuracy" in r]
    if evals:
        print(f"[reward model] held-out accuracy {evals[-1]['eval/accuracy']:.3f} (chance 0.5)")
    return sft_model, reward_model, pref_data


def run_demo(
    output_dir: Path, *, fresh: bool = False, ppo_steps: int | None = None, smoke: bool = False
) -> dict[str, Any]:
    """Run the three stages under ``output_dir``; returns the before/after evaluation.

    ``smoke`` runs every stage at toy scale on the test-size model (seconds, for tests): the
    code path is the same, the results are not meaningful.
    """
    start = time.perf_counter()
    scale: dict[str, Any] = SMOKE if smoke else {}
    sft_model, reward_model, _ = _sft_and_reward_stages(output_dir, scale, fresh)

    steps = ppo_steps or scale.get("ppo_steps", PPO_STEPS)
    ppo_dir = output_dir / "ppo"
    config = PPOConfig(
        **{
            **PPO_SETTINGS,
            **scale.get("ppo", {}),
            "model_name": str(sft_model),
            "reward_model_name": str(reward_model),
            "output_dir": str(ppo_dir),
            "overwrite_output_dir": True,  # the demo reruns PPO in its own folder
            "total_steps": steps,
        }
    )
    trainer = PPOTrainer(config)
    prompts = review_prompts(steps * config.batch_size, seed=2)
    eval_prompts = review_prompts(scale.get("eval_prompts", 48), seed=3)
    before = _evaluate(trainer, eval_prompts)
    _show("Before PPO", before)
    print(f"\n[PPO] {steps} iterations of {config.batch_size} prompts ...")
    trainer.train(prompts, num_epochs=1)
    after = _evaluate(trainer, eval_prompts)
    _show("After PPO", after)
    model_dir = trainer.save_model(ppo_dir / "final")
    print(
        f"\nmean reward {before['eval/mean_reward']:+.3f} -> {after['eval/mean_reward']:+.3f}; "
        f"sentiment words per review {before['sentiment']:+.2f} -> {after['sentiment']:+.2f}; "
        f"KL to the SFT model {after['eval/kl']:.3f}"
    )
    print(f"metrics: {ppo_dir / 'metrics.jsonl'}\nplot:    {ppo_dir / 'training_curves.png'}")
    print(f"policy:  {model_dir} (LoRA adapters over {sft_model})")
    print(f"inspector (open in a browser): {write_inspector(ppo_dir)}")
    print(f"total time {time.perf_counter() - start:.0f} s")
    return {"before": before, "after": after}


def policy_preference_accuracy(trainer: DPOTrainer, records: list[dict[str, Any]]) -> float:
    """Fraction of ``records`` (preference pairs) whose chosen answer the trainer's policy finds
    more likely than the rejected one: ``log pi(chosen | prompt) > log pi(rejected | prompt)``."""
    examples = tokenize_dpo_pairs(records, trainer.tokenizer, trainer.config.max_length)
    wins = 0
    for chunk in trainer.eval_chunks(examples):
        batch = collate_dpo(chunk, trainer.pad_token_id)
        logps = answer_logps(*answer_token_logps(trainer.policy, batch))  # (2B,)
        n = batch.num_pairs
        wins += int(np.sum(np.array(logps[:n] > logps[n:])))
    return wins / len(examples)


def _sample_rewards(
    model: Path, reward_model: Path, prompts: list[str], out: Path, seed: int
) -> dict[str, Any]:
    """Samples of ``model`` on ``prompts``, scored by the demo's reward model (PPO's evaluation
    of a policy: the same sampling settings as the PPO demo)."""
    scorer = PPOTrainer(
        PPOConfig(
            **{**PPO_SETTINGS, "save_every": 0},
            model_name=str(model),
            reward_model_name=str(reward_model),
            output_dir=str(out),
            overwrite_output_dir=True,
            seed=seed,
        )
    )
    return _evaluate(scorer, prompts)


def run_dpo_demo(
    output_dir: Path, *, fresh: bool = False, smoke: bool = False, seed: int = 0
) -> dict[str, Any]:
    """The offline branch: the SFT model trained with DPO on the demo's preference pairs (no
    reward model, no rollouts). Prints the held-out preference accuracy (the policy's own
    likelihoods) and the mean reward of samples (scored by the demo's reward model, which DPO
    never sees) before and after; returns them.
    """
    start = time.perf_counter()
    scale: dict[str, Any] = SMOKE if smoke else {}
    sft_model, reward_model, pref_data = _sft_and_reward_stages(output_dir, scale, fresh)
    dpo_dir = output_dir / "dpo"
    config = DPOConfig(
        **{
            **DPO_SETTINGS,
            **scale.get("dpo", {}),
            "model_name": str(sft_model),
            "dataset": str(pref_data),
            "output_dir": str(dpo_dir),
            "overwrite_output_dir": True,  # the demo reruns DPO in its own folder
            "seed": seed,
        }
    )
    train_pairs, held_out = load_run_data(config, load_preference_data)
    if held_out is None:
        raise ValueError("the DPO demo needs held-out pairs: set eval_fraction > 0")
    prompts = review_prompts(scale.get("eval_prompts", 48), seed=3)
    trainer = DPOTrainer(config)
    acc_before = policy_preference_accuracy(trainer, held_out)
    before = _sample_rewards(sft_model, reward_model, prompts, output_dir / "dpo_scoring", seed)
    _show("Before DPO (the SFT model)", before, kl=False)
    print(f"\n[DPO] {len(train_pairs)} pairs, {len(held_out)} held out ...")
    trainer.train(train_pairs, held_out)
    model_dir = trainer.save_pretrained(dpo_dir / MODEL_DIR)
    acc_after = policy_preference_accuracy(trainer, held_out)
    after = _sample_rewards(model_dir, reward_model, prompts, output_dir / "dpo_scoring", seed)
    _show("After DPO", after, kl=False)
    rose = {
        "accuracy": acc_after > acc_before,
        "reward": after["eval/mean_reward"] > before["eval/mean_reward"],
    }
    print(
        f"\nheld-out preference accuracy (policy prefers the chosen answer) {acc_before:.3f} -> "
        f"{acc_after:.3f} ({'rose' if rose['accuracy'] else 'did not rise'})"
    )
    print(
        f"mean reward of samples (demo reward model) {before['eval/mean_reward']:+.3f} -> "
        f"{after['eval/mean_reward']:+.3f} ({'rose' if rose['reward'] else 'did not rise'}); "
        f"sentiment words per review {before['sentiment']:+.2f} -> {after['sentiment']:+.2f}"
    )
    implicit = trainer.history[-1].get("eval/rewards/accuracies", float("nan"))
    print(
        f"implicit-reward accuracy on the held-out pairs (TRL's rewards/accuracies) {implicit:.3f}"
    )
    print(f"metrics: {dpo_dir / 'metrics.jsonl'}\nplot:    {dpo_dir / 'training_curves.png'}")
    print(f"policy:  {model_dir} (python main.py chat --model {dpo_dir})")
    print(f"total time {time.perf_counter() - start:.0f} s")
    return {
        "accuracy_before": acc_before,
        "accuracy_after": acc_after,
        "before": before,
        "after": after,
        "rose": rose,
    }
