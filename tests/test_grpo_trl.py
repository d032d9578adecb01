"""GRPO as TRL users run it: no reference model without a KL term, TRL's names and defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from config.ppo_config import PPOConfig
from fixtures.tiny_corpus import review_prompts
from models.sft_model import ReferenceModel
from ppo_trainer.callbacks import TrainerCallback
from ppo_trainer.ppo_trainer import PPOTrainer
from tests.test_algorithms_learn import brevity, config
from tests.test_ppo_trainer import assert_all_changed, trainable


def test_no_kl_term_loads_and_runs_no_reference(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a reference model was built for a run without a KL term")

    monkeypatch.setattr(ReferenceModel, "from_pretrained", refuse)
    monkeypatch.setattr(ReferenceModel, "from_policy", refuse)
    for algorithm, settings in [
        ("grpo", dict(beta=0.0)),
        ("rloo", dict(kl_coef=0.0)),
        ("ppo", dict(kl_coef=0.0)),
    ]:
        group = 1 if algorithm == "ppo" else 2
        cfg = config(
            tiny_model_dir,
            tmp_path / algorithm,
            algorithm=algorithm,
            group_size=group,
            use_lora=False,
            **settings,
        )
        assert not cfg.uses_reference_model
        trainer = PPOTrainer(cfg, reward_model=brevity)
        assert trainer.ref_model is None
        before = trainable(trainer.policy.model)
        keep = _KeepRollout()
        trainer.run.callbacks.append(keep)
        metrics = trainer.step(review_prompts(cfg.batch_size, seed=0))
        assert_all_changed(before, trainable(trainer.policy.model))
        # The rollout policy is the reference: a KL of 0 at the rollout.
        assert float(metrics["objective/kl"]) == 0.0
        rollout = keep.rollouts[-1]
        np.testing.assert_array_equal(np.array(rollout.ref_logprobs), np.array(rollout.logprobs))


def test_a_kl_term_needs_the_reference() -> None:
    assert PPOConfig(model_name="m", algorithm="grpo", group_size=2, beta=0.04).uses_reference_model
    assert PPOConfig(model_name="m", kl_coef=0.0, adaptive_kl=True).uses_reference_model
    assert PPOConfig(model_name="m").uses_reference_model  # PPO's default kl_coef 0.05


def test_trl_names_are_aliases_in_files_and_overrides(tmp_path: Path) -> None:
    from config.loading import load_config

    path = tmp_path / "trl.yaml"
    path.write_text(
        "model_name: m\nalgorithm: grpo\nnum_generations: 4\nnum_iterations: 2\nepsilon: 0.1\n"
        "epsilon_high: 0.28\nmax_completion_length: 48\nscale_rewards: false\nbeta: 0.02\n"
        "max_steps: 7\nbatch_size: 2\n"
    )
    c = load_config(path)
    assert (c.group_size, c.num_ppo_epochs, c.clip_epsilon, c.clip_epsilon_high) == (
        4,
        2,
        0.1,
        0.28,
    )
    assert (c.max_new_tokens, c.grpo_advantage_scale, c.beta, c.total_steps) == (
        48,
        "none",
        0.02,
        7,
    )
    c = load_config(path, ["scale_rewards=batch", "num_generations=2"])
    assert (c.grpo_advantage_scale, c.group_size) == ("batch", 2)
    twice = tmp_path / "twice.yaml"
    twice.write_text("model_name: m\ngroup_size: 2\nnum_generations: 4\n")
    with pytest.raises(ValueError, match=r"group_size is given twice .*'num_generations'"):
        load_config(twice)


def test_grpo_takes_trls_defaults_and_ppo_keeps_its_own(tmp_path: Path) -> None:
    from config.loading import load_config
    from config.trl_names import GRPOConfig, RLOOConfig

    grpo = load_config(None, ["model_name=m", "algorithm=grpo", "group_size=2"])
    assert (grpo.beta, grpo.num_ppo_epochs, grpo.loss_type, grpo.temperature) == (
        0.0,
        1,
        "dapo",
        1.0,
    )
    assert not grpo.uses_reference_model
    set_here = load_config(None, ["model_name=m", "algorithm=grpo", "group_size=2", "beta=0.04"])
    assert set_here.beta == 0.04 and set_here.uses_reference_model
    ppo = load_config(None, ["model_name=m"])
    assert (ppo.kl_coef, ppo.num_ppo_epochs, ppo.loss_type, ppo.temperature) == (
        0.05,
        4,
        "bnpo",
        0.7,
    )
    trl = GRPOConfig(model_name="m", num_generations=4, batch_size=2, epsilon_high=0.28)
    assert (trl.algorithm, trl.group_size, trl.clip_epsilon_high, trl.beta) == ("grpo", 4, 0.28, 0)
    assert RLOOConfig(model_name="m", num_generations=2).algorithm == "rloo"


def test_trl_style_trainers(tiny_model_dir: Path, tmp_path: Path) -> None:
    from config.trl_names import GRPOConfig
    from ppo_trainer.trl_names import GRPOTrainer, RLOOTrainer

    def brief(completions: list[str], **kwargs: Any) -> list[float]:
        return [-len(c) / 50 for c in completions]

    args = GRPOConfig(
        model_name=str(tiny_model_dir),
        num_generations=2,
        batch_size=2,
        max_completion_length=8,
        use_lora=False,
        max_steps=1,
        output_dir=str(tmp_path / "grpo"),
        progress_bar=False,
        log_rollouts_every=0,
    )
    records = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(2)]
    trainer = GRPOTrainer(reward_funcs=["think_format", brief], args=args, train_dataset=records)
    assert trainer.ref_model is None  # TRL's beta 0
    before = trainable(trainer.policy.model)
    metrics = trainer.train()
    assert_all_changed(before, trainable(trainer.policy.model))
    assert "rewards/brief/mean" in metrics[-1] and "rewards/think_format/mean" in metrics[-1]
    assert 0.0 <= metrics[-1]["frac_reward_zero_std"] <= 1.0
    with pytest.raises(ValueError, match="RLOOTrainer runs algorithm 'rloo'"):
        RLOOTrainer(reward_funcs=brief, args=args)
    with pytest.raises(ValueError, match="no name to log it under"):
        GRPOTrainer(reward_funcs=[lambda completions, **k: [0.0]], args=args)


def test_frac_reward_zero_std_counts_the_groups_that_teach_nothing() -> None:
    import mlx.core as mx

    from ppo_trainer.metrics import frac_reward_zero_std

    scores = mx.array([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0, 0.0])
    # groups of 2: (1, 1) same, (0, 1) differ, (.5, .5) same, (0, 0) same -> 3 / 4
    assert float(frac_reward_zero_std(scores, 2)) == 0.75
    # groups of 4: (1, 1, 0, 1) differ, (.5, .5, 0, 0) differ -> 0
    assert float(frac_reward_zero_std(scores, 4)) == 0.0


def test_thinking_template_kwargs_and_system_prompt(tmp_path: Path) -> None:
    from fixtures.checkpoint_families import build_family_checkpoint

    model = build_family_checkpoint(tmp_path / "qwen3", "qwen3_chat")
    chat = [{"role": "user", "content": "What is 2 + 2?"}]

    def formatted(**settings: Any) -> str:
        cfg = config(model, tmp_path / "run", algorithm="grpo", group_size=2, **settings)
        return PPOTrainer(cfg, reward_model=brevity).format_prompt(chat)

    thinking = formatted()
    assert thinking.endswith("<|im_start|>assistant\n") and "<think>" not in thinking
    assert formatted(chat_template_kwargs={"enable_thinking": True}) == thinking
    off = formatted(chat_template_kwargs={"enable_thinking": False})
    assert off == thinking + "<think>\n\n</think>\n\n"
    system = formatted(system_prompt="Think step by step.")
    assert system == "<|im_start|>system\nThink step by step.<|im_end|>\n" + thinking
    # A prompt with its own system message keeps it.
    cfg = config(model, tmp_path / "own", algorithm="grpo", group_size=2, system_prompt="X")
    own = [{"role": "system", "content": "Mine."}, *chat]
    assert "Mine." in PPOTrainer(cfg, reward_model=brevity).format_prompt(own)
    assert "X<|im_end|>" not in PPOTrainer(cfg, reward_model=brevity).format_prompt(own)


def test_the_thinking_family_keeps_its_think_tags_when_decoding(tmp_path: Path) -> None:
    from base_setup.tokenizer_setup import load_tokenizer
    from fixtures.checkpoint_families import build_family_checkpoint

    tokenizer = load_tokenizer(build_family_checkpoint(tmp_path / "qwen3", "qwen3_chat"))
    ids = tokenizer.encode("<think>hm</think> 4", add_special_tokens=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<think>")  # one token, as Qwen3's
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>hm</think> 4"


@pytest.mark.parametrize("use_lora", [False, True])
def test_entropy_coef_trains_on_entropy_alone(
    tiny_model_dir: Path, tmp_path: Path, use_lora: bool
) -> None:
    """The entropy bonus alone moves the policy, fully fine-tuned or LoRA (whose frozen head's
    blockwise log-probs once returned the entropy as a constant: the bonus trained nothing)."""

    def constant(prompts: list[str], completions: list[str]) -> list[float]:
        return [1.0] * len(completions)  # every group the same: advantages 0

    moved = {}
    for coef in (0.0, 0.01):
        cfg = config(
            tiny_model_dir,
            tmp_path / f"run{coef}",
            algorithm="grpo",
            group_size=2,
            beta=0.0,
            use_lora=use_lora,
            entropy_coef=coef,
        )
        trainer = PPOTrainer(cfg, reward_model=constant)
        before = trainable(trainer.policy.model)
        metrics = trainer.step(review_prompts(cfg.batch_size, seed=0))
        after = trainable(trainer.policy.model)
        moved[coef] = [k for k in before if not np.array_equal(before[k], after[k])]
        assert ("policy/entropy" in metrics) == (coef > 0)
    assert moved[0.0] == []  # no advantage, no KL term: nothing to learn
    assert len(moved[0.01]) == len(before)  # the bonus alone moves every parameter


class _KeepRollout(TrainerCallback):
    """Keeps the rollouts of the steps it sees (``on_rollout_scored``)."""

    def __init__(self) -> None:
        self.rollouts: list[Any] = []

    def on_rollout_scored(self, trainer: PPOTrainer, step: int, rollout: Any) -> None:
        self.rollouts.append(rollout)


def test_stop_strings_end_the_rollouts_completions(tiny_model_dir: Path, tmp_path: Path) -> None:
    from ppo_trainer.generator import cut_after_stop_string

    stops = ["e", "a", "o", "t"]
    seen: list[str] = []

    def record(prompts: list[str], completions: list[str]) -> list[float]:
        seen.extend(completions)
        return [float(len(c)) for c in completions]

    cfg = config(
        tiny_model_dir,
        tmp_path,
        algorithm="grpo",
        group_size=2,
        beta=0.0,
        use_lora=False,
        num_ppo_epochs=1,
        stop_strings=stops,
    )
    trainer = PPOTrainer(cfg, reward_model=record)
    keep = _KeepRollout()
    trainer.run.callbacks.append(keep)
    trainer.step(review_prompts(cfg.batch_size, seed=0))
    rollout = keep.rollouts[-1]
    by_string = np.array(rollout.generation.stopped_by_string)
    assert by_string.any()  # the tiny model writes these letters within 16 tokens
    assert seen == rollout.completions
    for completion, cut in zip(rollout.completions, by_string):
        if cut:  # the completion ends with its first stop string, which it keeps
            assert any(completion.endswith(s) for s in stops)
            assert cut_after_stop_string(completion, stops) == completion
        else:
            assert not any(s in completion for s in stops)
    np.testing.assert_array_equal(
        np.array(rollout.mask).sum(axis=1), np.array(rollout.generation.lengths)
    )
