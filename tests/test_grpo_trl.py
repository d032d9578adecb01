"""GRPO as TRL users run it: no reference model without a KL term, TRL's names and defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from config.ppo_config import PPOConfig
from fixtures.tiny_corpus import review_prompts
from models.sft_model import ReferenceModel
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
        metrics = trainer.step(review_prompts(cfg.batch_size, seed=0))
        assert_all_changed(before, trainable(trainer.policy.model))
        # The rollout policy is the reference: a KL of 0 at the rollout.
        assert float(metrics["objective/kl"]) == 0.0
        rollout = trainer.last_rollout[0]
        np.testing.assert_array_equal(np.array(rollout.ref_logprobs), np.array(rollout.logprobs))


def test_a_kl_term_needs_the_reference() -> None:
    assert PPOConfig(model_name="m", algorithm="grpo", group_size=2, beta=0.04).uses_reference_model
    assert PPOConfig(model_name="m", kl_coef=0.0, adaptive_kl=True).uses_reference_model
    assert PPOConfig(model_name="m").uses_reference_model  # PPO's default kl_coef 0.05
