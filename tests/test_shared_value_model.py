"""The value model on the policy's base (``value_init: shared``): one copy of the base weights
for the policy, the reference and the value model; each trains only its own adapters."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from base_setup.lora_setup import LoraSettings, adapters_merged
from config.ppo_config import PPOConfig
from fixtures.tiny_corpus import review_prompts
from models.policy_model import PolicyModel
from models.value_model import ValueModel
from ppo_trainer.ppo_trainer import PPOTrainer
from tests.resume_checks import assert_resume_equals_straight

LORA = LoraSettings(r=4, alpha=8.0, dropout=0.0)
PROBE = mx.array([[5, 6, 7, 8, 9], [3, 1, 4, 1, 5]])  # (2, 5)


def arrays(tree: Any) -> dict[str, mx.array]:
    return dict(cast(list[tuple[str, mx.array]], tree_flatten(tree)))


def numpy(tree: Any) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in arrays(tree).items()}


def unique_bytes(*models: nn.Module) -> int:
    """Bytes of the distinct arrays the models hold (an array two models share counts once)."""
    seen: dict[int, int] = {}
    for model in models:
        for value in arrays(model.parameters()).values():
            seen[id(value)] = value.nbytes
    return sum(seen.values())


def config(model_dir: Path, out: Path, **overrides: Any) -> PPOConfig:
    values: dict[str, Any] = dict(
        model_name=str(model_dir),
        value_init="shared",
        max_new_tokens=8,
        batch_size=4,
        learning_rate=1e-3,
        num_ppo_epochs=2,
        num_mini_batches=2,
        output_dir=str(out),
        progress_bar=False,
        log_rollouts_every=0,
        seed=0,
    )
    values.update(overrides)
    return PPOConfig(**values)


def e_rate(prompts: list[str], completions: list[str]) -> list[float]:
    return [c.count("e") / max(len(c), 1) for c in completions]


@pytest.fixture()
def policy(tiny_model_dir: Path) -> PolicyModel:
    return PolicyModel.from_pretrained(tiny_model_dir, lora=LORA)


def test_the_base_is_held_once_and_only_the_value_adapters_and_head_train(
    policy: PolicyModel,
) -> None:
    value = ValueModel.sharing_base(policy.model, LORA, head_init="normal")
    policy_params = arrays(policy.model.parameters())
    value_params = arrays(value.parameters())
    # Every base array of the value model is the policy's own object (backbone names are the
    # policy's without "model." and with the value's "model." prefix: the same strings).
    base = {k: v for k, v in value_params.items() if "lora_" not in k and k != "score.weight"}
    assert base and all(v is policy_params[k] for k, v in base.items())
    separate = ValueModel.from_policy_backbone(str(policy.model_path))
    # Bytes held by policy + shared value: the base once, plus two adapter sets and a head.
    adapters = sum(v.nbytes for k, v in value_params.items() if "lora_" in k)
    assert unique_bytes(policy.model, value) == unique_bytes(policy.model) + adapters + (
        value.head.weight.nbytes
    )
    assert unique_bytes(policy.model, value) < unique_bytes(policy.model, separate)

    trainable = arrays(value.trainable_parameters())
    assert set(trainable) == {k for k in value_params if "lora_" in k} | {"score.weight"}
    assert not set(map(id, trainable.values())) & set(
        map(id, arrays(policy.trainable_parameters()).values())
    )
    # The gradient of a value loss reaches the value adapters and head only.
    loss_grad = nn.value_and_grad(value, lambda m, x: (m(x) ** 2).mean())
    _, grads = loss_grad(value, PROBE)
    assert set(arrays(grads)) == set(trainable)
    # With lora_b = 0 the shared model is the separate one on the same base and head.
    separate.head.weight = value.head.weight
    np.testing.assert_allclose(np.array(value(PROBE)), np.array(separate(PROBE)), atol=1e-5)


def test_the_value_adapters_leave_the_policy_and_its_merged_sampling_alone(
    policy: PolicyModel, tmp_path: Path
) -> None:
    value = ValueModel.sharing_base(policy.model, LORA, head_init="normal")
    logits = np.array(policy(PROBE))
    for name, v in arrays(value.trainable_parameters()).items():
        value.update(tree_unflatten([(name, v + 0.5)]))
    np.testing.assert_array_equal(np.array(policy(PROBE)), logits)
    with adapters_merged(policy.model):
        np.testing.assert_allclose(np.array(policy(PROBE)), logits, atol=1e-5)
    saved = policy.save_pretrained(tmp_path / "policy")
    policy_adapters = mx.load(str(saved / "adapters.safetensors"))
    assert isinstance(policy_adapters, dict)
    own = arrays(policy.model.trainable_parameters())
    assert set(policy_adapters) == set(own)
    for name, array in policy_adapters.items():  # the policy's, not the changed value's
        np.testing.assert_array_equal(np.array(array), np.array(own[name]))


def test_save_and_load_write_and_read_only_what_trains(
    policy: PolicyModel, tiny_model_dir: Path, tmp_path: Path
) -> None:
    value = ValueModel.sharing_base(policy.model, LORA, head_init="normal", seed=3)
    value.update(tree_map(lambda a: a + 0.25, value.trainable_parameters()))
    out = value.save_pretrained(tmp_path / "value")
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapters.safetensors",
        "value_head.safetensors",
    ]
    other = PolicyModel.from_pretrained(tiny_model_dir, lora=LORA)
    fresh = ValueModel.sharing_base(other.model, LORA)
    fresh.load_pretrained_weights(out)
    np.testing.assert_array_equal(np.array(fresh(PROBE)), np.array(value(PROBE)))
    wrong = ValueModel.sharing_base(
        PolicyModel.from_pretrained(tiny_model_dir, lora=LORA).model,
        LoraSettings(r=2, alpha=8.0, dropout=0.0),
    )
    with pytest.raises(ValueError, match="differ from this model's"):
        wrong.load_pretrained_weights(out)


def test_a_policy_without_adapters_cannot_share_its_base(tiny_model_dir: Path) -> None:
    full = PolicyModel.from_pretrained(tiny_model_dir)
    with pytest.raises(ValueError, match="needs a LoRA policy"):
        ValueModel.sharing_base(full.model, LORA)
    with pytest.raises(ValueError, match="use_lora"):
        PPOConfig(model_name=str(tiny_model_dir), value_init="shared", use_lora=False)
    with pytest.raises(ValueError, match="value_model_name"):
        PPOConfig(model_name=str(tiny_model_dir), value_init="shared", value_model_name="x")


def test_a_ppo_step_moves_every_trainable_parameter_and_keeps_one_base(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    trainer = PPOTrainer(config(tiny_model_dir, tmp_path / "run"), reward_model=e_rate)
    value = trainer.value_model
    assert isinstance(value, ValueModel) and value.lora is not None
    base_before = numpy(trainer.policy.model.parameters())
    policy_before = numpy(trainer.policy.trainable_parameters())
    value_before = numpy(value.trainable_parameters())
    assert all("lora_" in k for k in policy_before)
    trainer.step(review_prompts(4, seed=0))
    for before, model in ((policy_before, trainer.policy), (value_before, value)):
        after = numpy(model.trainable_parameters())
        assert before.keys() == after.keys()
        assert [k for k in before if np.array_equal(before[k], after[k])] == []
    # The optimiser holds moments of the value adapters and head only.
    state = arrays(trainer.value_optimizer.state if trainer.value_optimizer else {})
    moments = {k.rsplit(".", 1)[0] for k in state if k.endswith(".m")}
    assert moments == set(value_before)
    # The base is unchanged and still one set of arrays.
    policy_params = arrays(trainer.policy.model.parameters())
    for name, array in arrays(value.parameters()).items():
        if "lora_" not in name and name != "score.weight":
            assert array is policy_params[name], name
    for name, saved in base_before.items():
        if "lora_" not in name:
            np.testing.assert_array_equal(saved, np.array(policy_params[name]), err_msg=name)


@pytest.mark.slow
def test_stop_and_resume_equals_an_uninterrupted_run(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PPO_MLX_ADAPTIVE_BLAS", "off")
    assert_resume_equals_straight(
        lambda name: PPOTrainer(
            config(tiny_model_dir, tmp_path / name, save_every=100), reward_model=e_rate
        ),
        review_prompts(4, seed=0),
    )


def test_save_model_and_load_model_round_trip(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = PPOTrainer(config(tiny_model_dir, tmp_path / "run"), reward_model=e_rate)
    trainer.step(review_prompts(4, seed=0))
    out = trainer.save_model(tmp_path / "saved")
    assert not (out / "value_model" / "model.safetensors").exists()  # adapters and head only
    fresh = PPOTrainer(config(tiny_model_dir, tmp_path / "run2"), reward_model=e_rate)
    fresh.load_model(out)
    assert fresh.value_model is not None and trainer.value_model is not None
    np.testing.assert_array_equal(
        np.array(fresh.value_model(PROBE)), np.array(trainer.value_model(PROBE))
    )
    np.testing.assert_array_equal(np.array(fresh.policy(PROBE)), np.array(trainer.policy(PROBE)))


@pytest.mark.slow
def test_the_value_loss_falls_and_ppo_learns_as_with_a_separate_value_model(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The learning test of tests/test_ppo_trainer.py with the shared value model: one of two
    seeds must raise the reward by 0.2 (a trainer that does not learn fails both), and the value
    loss of the last iterations is below that of the first. Seed 2 first: it passed both checks
    (reward +0.60, value loss 0.008 -> 0.003), seed 1 raised the reward but not its value loss
    fall, so this order usually trains once."""

    def brevity(prompts: list[str], completions: list[str]) -> list[float]:
        return [-len(c) / 50 for c in completions]

    results = []
    for seed in (2, 1):
        cfg = config(
            tiny_model_dir,
            tmp_path / f"seed{seed}",
            batch_size=8,
            max_new_tokens=16,
            num_ppo_epochs=4,
            learning_rate=1e-2,
            kl_coef=0.01,
            seed=seed,
        )
        trainer = PPOTrainer(cfg, reward_model=brevity)
        eval_prompts = review_prompts(32, seed=7)
        before = trainer.evaluate(eval_prompts, temperature=cfg.temperature)["eval/mean_reward"]
        history = trainer.train(review_prompts(80, seed=1), num_epochs=2)
        after = trainer.evaluate(eval_prompts, temperature=cfg.temperature)["eval/mean_reward"]
        losses = [h["loss/value"] for h in history]
        first, last = np.mean(losses[:3]), np.mean(losses[-3:])
        results.append((seed, before, after, first, last))
        if after > before + 0.2 and last < first:
            return
    raise AssertionError(f"no seed learned: (seed, before, after, value loss) {results}")
