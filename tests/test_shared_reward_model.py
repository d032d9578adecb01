"""The reward model on the policy's base (``share_reward_base``): a LoRA reward model's adapter
checkpoint (the reward stage's ``use_lora``), loaded on its own or put on the PPO policy's base,
where one copy of the base weights serves the policy, the reference, the value and the reward
model, and no model sees another's adapters."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable, cast

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from base_setup.lora_setup import (
    LoraSettings,
    adapters_disabled,
    adapters_merged,
    apply_lora,
    is_quantized_layer,
)
from config.ppo_config import PPOConfig
from config.reward_config import RewardConfig
from fixtures.demo_data import preference_records
from fixtures.tiny_corpus import review_prompts
from models.backbone import ScalarHeadModel, is_adapter_checkpoint
from models.policy_model import PolicyModel
from models.reward_model import RewardModel
from models.value_model import ValueModel
from ppo_trainer.components import check_reward_adapters
from ppo_trainer.ppo_trainer import PPOTrainer
from training.fingerprints import model_fingerprint
from tests.resume_checks import assert_resume_equals_straight
from tests.test_shared_value_model import config as shared_value_config

LORA = LoraSettings(r=4, alpha=8.0, dropout=0.0)
PROBE = mx.array([[5, 6, 7, 8, 9], [3, 1, 4, 1, 5]])  # (2, 5)
LENGTHS = [5, 3]


def arrays(tree: Any) -> dict[str, mx.array]:
    return dict(cast(list[tuple[str, mx.array]], tree_flatten(tree)))


def numpy(tree: Any) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in arrays(tree).items()}


def nudged(model: Any, amount: float) -> None:
    """Move every trainable parameter by ``amount`` (LoRA's zero ``lora_b`` would hide them)."""
    model.update(tree_map(lambda a: a + amount, model.trainable_parameters()))


def assert_scores_like_standalone(reward: RewardModel, path: Path) -> None:
    """``reward`` scores :data:`PROBE` as the adapter checkpoint at ``path`` loaded on its own
    (float32) does."""
    standalone = RewardModel.from_pretrained(path, dtype="float32")
    np.testing.assert_allclose(
        np.array(reward.score(PROBE, LENGTHS)),
        np.array(standalone.score(PROBE, LENGTHS)),
        rtol=1e-6,
        atol=1e-6,
    )


@pytest.fixture(scope="module")
def reward_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A reward adapter checkpoint on the tiny model (non-zero adapters, a normal head), as the
    reward trainer with use_lora saves it."""
    model = RewardModel.from_causal_lm(str(tiny_model_dir), head_init="normal", seed=1)
    model.lora = LoraSettings(r=4, alpha=8.0, dropout=0.1)
    apply_lora(model, model.lora)
    model.head.unfreeze()
    nudged(model, 0.05)
    out = tmp_path_factory.mktemp("reward") / "adapters"
    return model.save_pretrained(out, base_fingerprint=model_fingerprint(tiny_model_dir))


@pytest.fixture()
def policy(tiny_model_dir: Path) -> PolicyModel:
    model = PolicyModel.from_pretrained(tiny_model_dir, dtype="float32", lora=LORA)
    nudged(model, 0.02)  # the policy differs from its base (the reference)
    return model


def ppo_config(model_dir: Path, reward_dir: Path | str, out: Path, **overrides: Any) -> PPOConfig:
    """The shared-value-model test run's config with the reward adapters on the policy's base."""
    shared = dict(reward_model_name=str(reward_dir), share_reward_base=True)
    return shared_value_config(model_dir, out, **{**shared, **overrides})


def lora_reward_stage(model_dir: Path, out: Path, **overrides: Any) -> RewardConfig:
    """Two steps of the reward stage with LoRA (rank 4) on ``model_dir``."""
    values: dict[str, Any] = dict(
        model_name=str(model_dir),
        output_dir=str(out),
        learning_rate=1e-2,
        batch_size=8,
        total_steps=2,
        lr_scheduler="constant",
        progress_bar=False,
        use_lora=True,
        lora_r=4,
    )
    return RewardConfig(**{**values, **overrides})


def test_the_adapter_checkpoint_records_its_base_and_loads_on_its_own(
    reward_dir: Path, tiny_model_dir: Path
) -> None:
    assert sorted(p.name for p in reward_dir.iterdir()) == [
        "adapter_config.json",
        "adapters.safetensors",
        "score.safetensors",
    ]
    saved = json.loads((reward_dir / "adapter_config.json").read_text())
    assert saved["model"] == str(tiny_model_dir.resolve())
    assert saved["base_model_fingerprint"] == model_fingerprint(tiny_model_dir)
    standalone = RewardModel.from_pretrained(reward_dir)
    assert standalone.lora is not None and not standalone.training  # no adapter dropout
    # The adapters count: without them (same base and head) the scores differ.
    with adapters_disabled(standalone):
        bare = np.array(standalone.score(PROBE, LENGTHS))
    scores = np.array(standalone.score(PROBE, LENGTHS))
    assert np.abs(scores - bare).min() > 1e-3
    # As a value model it starts from the reward's function, every weight trainable (merged).
    value = ValueModel.from_pretrained(reward_dir)
    assert value.lora is None and "lora" not in str(list(arrays(value.parameters())))
    assert set(arrays(value.trainable_parameters())) == set(arrays(value.parameters()))
    values = np.array(value(PROBE))[[0, 1], [4, 2]]
    np.testing.assert_allclose(values, scores, atol=1e-5)


def test_shared_scores_equal_the_standalone_model_and_no_model_sees_other_adapters(
    reward_dir: Path, policy: PolicyModel
) -> None:
    value = ValueModel.sharing_base(policy.model, LORA, head_init="normal")
    nudged(value, 0.03)
    logits, values = np.array(policy(PROBE)), np.array(value(PROBE))
    with adapters_disabled(policy.model):  # the reference
        reference = np.array(policy(PROBE))
    with adapters_merged(policy.model):  # sampling's merged weights
        merged = np.array(policy(PROBE))

    reward = RewardModel.sharing_base(policy.model, reward_dir, dtype="float32")
    assert_scores_like_standalone(reward, reward_dir)
    # One base: every base array of the reward model is the policy's own object, and nothing
    # of the reward model trains.
    policy_params = arrays(policy.model.parameters())
    base = {
        k: v
        for k, v in arrays(reward.parameters()).items()
        if "lora_" not in k and "score" not in k
    }
    assert base and all(v is policy_params[k] for k, v in base.items())
    assert arrays(reward.trainable_parameters()) == {}
    # The policy, its reference and the value model compute exactly what they did before.
    np.testing.assert_array_equal(np.array(policy(PROBE)), logits)
    np.testing.assert_array_equal(np.array(value(PROBE)), values)
    with adapters_disabled(policy.model):
        np.testing.assert_array_equal(np.array(policy(PROBE)), reference)
    with adapters_merged(policy.model):
        np.testing.assert_array_equal(np.array(policy(PROBE)), merged)


def test_a_merged_save_is_a_full_checkpoint_of_the_same_function(
    reward_dir: Path, tmp_path: Path
) -> None:
    standalone = RewardModel.from_pretrained(reward_dir)
    out = standalone.save_pretrained(tmp_path / "merged", merged=True)
    assert not is_adapter_checkpoint(out) and (out / "model.safetensors").is_file()
    full = RewardModel.from_pretrained(out)
    assert full.lora is None
    np.testing.assert_allclose(
        np.array(full.score(PROBE, LENGTHS)), np.array(standalone.score(PROBE, LENGTHS)), atol=1e-5
    )


def refusal(build: Callable[[], Any]) -> str:
    """The message of the ValueError that ``build()`` raises (it must raise one)."""
    with pytest.raises(ValueError) as err:
        build()
    return str(err.value)


def test_sharing_is_refused_with_an_actionable_message(
    reward_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    assert refusal(
        lambda: PPOConfig(
            model_name="m", reward_model_name="r", share_reward_base=True, use_lora=False
        )
    ) == (
        "share_reward_base must be false when use_lora is false, got True: set use_lora: true "
        "(the shared base must stay frozen) or share_reward_base: false"
    )
    assert refusal(lambda: PPOConfig(model_name="m", share_reward_base=True)) == (
        "share_reward_base must be false without reward_model_name, got True: set "
        "reward_model_name to a reward adapter checkpoint (main.py reward with use_lora: true), "
        "or share_reward_base: false"
    )
    full = tmp_path / "full"
    RewardModel.from_causal_lm(str(tiny_model_dir)).save_pretrained(full)
    assert refusal(lambda: check_reward_adapters(ppo_config(tiny_model_dir, full, tmp_path))) == (
        f"share_reward_base: {full} is not a reward adapter checkpoint (adapter_config.json, "
        "adapters.safetensors, score.safetensors): train the reward model with use_lora: true "
        "on model_name's base, or set share_reward_base: false to load it on its own"
    )
    # Another base: by the fingerprints (a retrained base at the same path), else by path.
    other = tmp_path / "other"
    shutil.copytree(reward_dir, other)
    config_file = other / "adapter_config.json"
    saved = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**saved, "base_model_fingerprint": "sha256 0"}))
    now = model_fingerprint(tiny_model_dir)
    assert refusal(lambda: check_reward_adapters(ppo_config(tiny_model_dir, other, tmp_path))) == (
        f"share_reward_base: the reward adapters in {other} were trained on "
        f"{tiny_model_dir.resolve()}, not on the policy's base model_name {tiny_model_dir} "
        f"(fingerprint sha256 0 vs {now}): train the reward model on model_name, or set "
        "share_reward_base: false to load it with its own base"
    )
    del saved["base_model_fingerprint"]
    config_file.write_text(json.dumps({**saved, "model": "org/another-base"}))
    assert refusal(lambda: check_reward_adapters(ppo_config(tiny_model_dir, other, tmp_path))) == (
        f"share_reward_base: the reward adapters in {other} were trained on org/another-base, "
        f"not on the policy's base model_name {tiny_model_dir} (org/another-base vs "
        f"{tiny_model_dir.resolve()}): train the reward model on model_name, or set "
        "share_reward_base: false to load it with its own base"
    )
    check_reward_adapters(ppo_config(tiny_model_dir, reward_dir, tmp_path))  # the right base
    # Loaded on its own, an adapter checkpoint whose base changed since it was trained.
    config_file.write_text(json.dumps({**saved, "base_model_fingerprint": "sha256 0"}))
    assert refusal(
        lambda: check_reward_adapters(
            ppo_config(tiny_model_dir, other, tmp_path, share_reward_base=False)
        )
    ) == (
        f"the reward adapters in {other} were trained on another model than the one now at "
        f"{tiny_model_dir.resolve()} (fingerprint sha256 0 then, {now} now): retrain the reward "
        "model on it, or restore the base it was trained on"
    )
    check_reward_adapters(ppo_config(tiny_model_dir, reward_dir, tmp_path, share_reward_base=False))
    with pytest.raises(ValueError, match="needs a LoRA policy"):
        RewardModel.sharing_base(PolicyModel.from_pretrained(tiny_model_dir).model, reward_dir)


def test_a_reward_passed_to_the_trainer_cannot_also_share(
    reward_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ValueError) as err:
        PPOTrainer(
            ppo_config(tiny_model_dir, reward_dir, tmp_path / "run"),
            reward_model=lambda prompts, completions: [0.0] * len(completions),
        )
    assert str(err.value) == (
        "share_reward_base puts reward_model_name on the policy's base, but a reward was "
        "passed to the trainer: pass none, or set share_reward_base: false"
    )


@pytest.mark.slow
def test_a_ppo_step_trains_policy_and_value_and_scores_as_the_standalone_reward(
    reward_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    trainer = PPOTrainer(ppo_config(tiny_model_dir, reward_dir, tmp_path / "run"))
    reward, value = trainer.reward_model, trainer.value_model
    assert isinstance(reward, RewardModel) and isinstance(value, ValueModel)
    reward_before = numpy(reward.parameters())
    policy_before = numpy(trainer.policy.trainable_parameters())
    value_before = numpy(value.trainable_parameters())
    trainer.step(review_prompts(4, seed=0))
    for before, model in ((policy_before, trainer.policy), (value_before, value)):
        after = numpy(model.trainable_parameters())
        assert before.keys() == after.keys()
        assert [k for k in before if np.array_equal(before[k], after[k])] == []
    for name, kept in numpy(reward.parameters()).items():  # the reward never trains
        np.testing.assert_array_equal(reward_before[name], kept, err_msg=name)
    # One base for the four models.
    policy_params = arrays(trainer.policy.model.parameters())
    for scalar_model in (reward, value):
        for name, array in arrays(scalar_model.parameters()).items():
            if "lora_" not in name and "score" not in name:
                assert array is policy_params[name], name
    assert_scores_like_standalone(reward, reward_dir)
    # The saved (exported) policy and value model hold nothing of the reward model.
    out = trainer.save_model(tmp_path / "saved")
    adapters = mx.load(str(out / "adapters.safetensors"))
    assert isinstance(adapters, dict)
    assert set(adapters) == set(arrays(trainer.policy.model.trainable_parameters()))
    assert sorted(p.name for p in (out / "value_model").iterdir()) == [
        "adapter_config.json",
        "adapters.safetensors",
        "value_head.safetensors",
    ]


@pytest.mark.slow
def test_stop_and_resume_equals_an_uninterrupted_run(
    reward_dir: Path, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reward adapters are constants loaded from reward_model_name again on resume (its
    fingerprint, recorded in the checkpoint, must not have changed); a checkpoint holds the
    policy's and value model's trained parameters only."""
    monkeypatch.setenv("PPO_MLX_ADAPTIVE_BLAS", "off")
    # The curves' plot (most of this test's time, three runs) is no part of what it checks.
    monkeypatch.setattr("training.metrics_logger.plot_metrics", lambda records, path: None)
    small = dict(save_every=100, max_new_tokens=4, num_ppo_epochs=1)
    assert_resume_equals_straight(
        lambda name: PPOTrainer(ppo_config(tiny_model_dir, reward_dir, tmp_path / name, **small)),
        review_prompts(4, seed=0),
    )


@pytest.mark.slow
def test_the_reward_stage_with_lora_trains_adapters_and_head_only(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from finetune.reward_trainer import RewardTrainer

    trainer = RewardTrainer(lora_reward_stage(tiny_model_dir, tmp_path / "run", lora_dropout=0.1))
    before = numpy(trainer.model.parameters())
    trainable = set(arrays(trainer.model.trainable_parameters()))
    assert trainable == {k for k in before if "lora_" in k} | {"score.weight"}
    trainer.train(preference_records(16, seed=1))
    after = numpy(trainer.model.parameters())
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    assert changed == trainable
    out = trainer.save_pretrained(tmp_path / "saved")
    assert is_adapter_checkpoint(out) and (out / "tokenizer_config.json").is_file()
    trainer.model.eval()
    loaded = RewardModel.from_pretrained(out)
    np.testing.assert_array_equal(np.array(loaded(PROBE)), np.array(trainer.model(PROBE)))
    # It shares a PPO policy's base as it is.
    policy = PolicyModel.from_pretrained(tiny_model_dir, dtype="float32", lora=LORA)
    check_reward_adapters(ppo_config(tiny_model_dir, out, tmp_path / "ppo"))
    shared = RewardModel.sharing_base(policy.model, out, dtype="float32")
    np.testing.assert_allclose(np.array(shared(PROBE)), np.array(loaded(PROBE)), atol=1e-6)


@pytest.mark.slow
def test_a_lora_reward_model_keeps_a_4bit_base_quantized(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """QLoRA reward training: the base of a LoRA reward model on a 4-bit checkpoint stays
    quantized in the reward stage, in its adapter checkpoint loaded alone and on a 4-bit PPO
    policy's base (no float copy of the base anywhere); a value model started from it (which
    trains every weight) and a merged save are float models of the same function."""
    from finetune.reward_trainer import RewardTrainer
    from fixtures.checkpoint_families import quantize_checkpoint

    def quantized(model: Any) -> list[str]:
        return [name for name, m in model.named_modules() if is_quantized_layer(m)]

    q4 = quantize_checkpoint(tiny_model_dir, tmp_path / "q4")
    trainer = RewardTrainer(lora_reward_stage(q4, tmp_path / "run"))
    assert quantized(trainer.model)
    before = numpy(trainer.model.parameters())
    trainer.train(preference_records(16, seed=1))
    after = numpy(trainer.model.parameters())
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    assert changed == set(arrays(trainer.model.trainable_parameters()))
    assert changed == {k for k in before if "lora_" in k} | {"score.weight"}
    out = trainer.save_pretrained(tmp_path / "saved")
    trainer.model.eval()
    expected = np.array(trainer.model(PROBE))

    loaded = RewardModel.from_pretrained(out)
    assert quantized(loaded) == quantized(trainer.model)
    np.testing.assert_array_equal(np.array(loaded(PROBE)), expected)
    policy = PolicyModel.from_pretrained(q4, dtype="float32", lora=LORA)
    check_reward_adapters(ppo_config(q4, out, tmp_path / "ppo"))
    shared = RewardModel.sharing_base(policy.model, out, dtype="float32")
    assert quantized(shared)
    np.testing.assert_allclose(np.array(shared(PROBE)), expected, atol=1e-5)

    # A value model started from it trains every weight: its base is dequantized.
    value = ValueModel.from_pretrained(out)
    assert quantized(value) == []
    assert arrays(value.trainable_parameters()).keys() == arrays(value.parameters()).keys()
    np.testing.assert_allclose(np.array(value(PROBE)), expected, atol=1e-5)

    merged = loaded.save_pretrained(tmp_path / "merged", merged=True)
    assert quantized(loaded) == quantized(trainer.model)  # the layers are put back
    config_json = json.loads((merged / "config.json").read_text(encoding="utf-8"))
    assert not {"quantization", "quantization_config"} & set(config_json)
    full = RewardModel.from_pretrained(merged)
    assert quantized(full) == []
    np.testing.assert_allclose(np.array(full(PROBE)), expected, atol=1e-5)
    with pytest.raises(ValueError, match="quantized"):
        ScalarHeadModel.save_pretrained(loaded, tmp_path / "refused")
