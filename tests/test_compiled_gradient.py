"""The compiled training gradient (training/compiled_gradient.py): when it is chosen, and that it
is the eager gradient within float32 rounding on a LoRA policy, for several batch shapes, with
dropout drawing new masks each call, and that a trainer using it trains."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from base_setup import fast_math
from config.dpo_config import DPOConfig
from config.reward_config import RewardConfig
from config.sft_config import SFTConfig
from experience_buffer.buffer import RolloutBatch
from finetune.dpo_trainer import DPOTrainer
from finetune.reward_trainer import RewardTrainer
from finetune.sft_trainer import SFTTrainer
from finetune.supervised_trainer import SupervisedTrainer
from finetune.tokenize import padded_width
from fixtures.demo_data import preference_records, sft_records
from fixtures.tiny_corpus import review_prompts
from models.policy_model import PolicyModel
from ppo_trainer.ppo_trainer import PPOTrainer
from ppo_trainer.update import Updater
from tests.test_ppo_trainer import make_config
from token_attribution.head_logprobs import default_block_rows, fixed_block_rows
from training.compiled_gradient import (
    WIDTH_MULTIPLE,
    CompiledGradient,
    EagerGradient,
    compiled_gradient_mode,
    is_array_batch,
    use_compiled_gradient,
)


def _e_rate(prompts: list[str], completions: list[str]) -> list[float]:
    return [c.count("e") / max(len(c), 1) for c in completions]


def test_the_mode_and_who_gets_a_compiled_gradient(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy = PolicyModel.from_pretrained(tiny_model_dir)
    monkeypatch.delenv("PPO_MLX_COMPILED_GRADIENT", raising=False)
    assert compiled_gradient_mode() == "auto"
    assert not use_compiled_gradient(policy.model)  # a few million parameters: eager
    monkeypatch.setenv("PPO_MLX_COMPILED_GRADIENT", "1")
    assert use_compiled_gradient(policy.model) == fast_math.fast_math_enabled()
    monkeypatch.setenv("PPO_MLX_FAST_MATH", "0")  # no fast math: nothing to fuse
    assert not use_compiled_gradient(policy.model)
    monkeypatch.setenv("PPO_MLX_COMPILED_GRADIENT", "0")
    assert not use_compiled_gradient(policy.model)
    monkeypatch.setenv("PPO_MLX_COMPILED_GRADIENT", "sometimes")
    with pytest.raises(ValueError, match="PPO_MLX_COMPILED_GRADIENT='sometimes'"):
        compiled_gradient_mode()


def test_fixed_block_rows_and_array_batches() -> None:
    assert default_block_rows(49152, 2048) == 1024 and default_block_rows(49152, 512) == 4096
    with fixed_block_rows(1024):
        assert default_block_rows(49152, 512) == 1024 and default_block_rows(300, 512) == 300
    assert default_block_rows(49152, 512) == 4096
    with pytest.raises(ValueError, match="rows must be >= 1"):
        with fixed_block_rows(0):
            pass
    rows = mx.zeros((2, 3))
    batch = RolloutBatch(
        mx.zeros((2, 5), dtype=mx.int32), mx.array([2, 2]), rows, rows, rows, rows, rows[:, 0], rows
    )
    assert is_array_batch(batch) and not is_array_batch(RolloutBatch)
    assert not is_array_batch({"mask": rows})


def _flat(tree: Any) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in cast(list[tuple[str, mx.array]], tree_flatten(tree))}


@pytest.mark.slow
def test_compiled_gradient_is_the_eager_one_and_trains(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forced on for the tiny model (its kernels are built the first time: tens of seconds)."""
    if not fast_math.fast_math_enabled():
        pytest.skip("the compiled gradient needs the fast CPU math (a C++ compiler, the CPU)")
    monkeypatch.setenv("PPO_MLX_COMPILED_GRADIENT", "1")
    captured: list[RolloutBatch] = []
    update = Updater.update

    def capture(self: Updater, batch: RolloutBatch, *args: Any, **kwargs: Any) -> Any:
        captured.append(batch)
        return update(self, batch, *args, **kwargs)

    monkeypatch.setattr(Updater, "update", capture)
    config = make_config(
        tiny_model_dir,
        tmp_path,
        algorithm="grpo",
        group_size=4,
        batch_size=2,
        max_new_tokens=12,
        beta=0.04,
        lora_dropout=0.2,
    )
    trainer = PPOTrainer(config, reward_model=_e_rate)
    before = _flat(trainer.policy.trainable_parameters())
    trainer.step(review_prompts(2, seed=1))
    after = _flat(trainer.policy.trainable_parameters())
    assert any(not np.array_equal(before[k], after[k]) for k in before)  # it trained

    updater = trainer.updater
    compiled = updater.policy_grad
    assert isinstance(compiled, CompiledGradient) and updater.compiled
    eager = EagerGradient(compiled.value_and_grad)
    policy = trainer.policy
    batch = captured[0]
    rows: dict[str, Any] = {k: None if v is None else v[:3] for k, v in vars(batch).items()}
    half = RolloutBatch(**rows)
    for mb in (batch, half):  # two batch shapes: two traces of one compiled function
        for train_mode in (False, True):  # without dropout, then with it
            policy.train(train_mode)
            state = cast(list[mx.array], mx.random.state)[0]
            (loss_c, metrics_c), grads_c = compiled(policy, mb)
            mx.eval(loss_c, metrics_c, grads_c)
            if train_mode:  # the random state is the compiled function's input and output
                now = cast(list[mx.array], mx.random.state)[0]
                assert not np.array_equal(np.array(state), np.array(now))
                continue
            (loss_e, metrics_e), grads_e = eager(policy, mb)
            assert np.allclose(loss_c.item(), loss_e.item(), rtol=1e-4, atol=1e-6)
            assert set(metrics_c) == set(metrics_e)
            flat_c, flat_e = _flat(grads_c), _flat(grads_e)
            assert set(flat_c) == set(flat_e)
            for key, value in flat_e.items():
                scale = max(float(np.abs(value).max()), 1e-8)
                assert np.abs(flat_c[key] - value).max() <= 1e-3 * scale, key
    policy.train(False)
    # Dropout draws: two calls in train mode give two gradients.
    policy.train(True)
    first = _flat(compiled(policy, batch)[1])
    second = _flat(compiled(policy, batch)[1])
    assert any(not np.array_equal(first[k], second[k]) for k in first)
    policy.train(False)
    # A fully fine-tuned policy: its trained LM head's blockwise gradient compiled too, the
    # head's (the tied embedding's) weight included.
    full = PPOTrainer(
        replace(config, use_lora=False, output_dir=str(tmp_path / "full")), reward_model=_e_rate
    )
    compiled = full.updater.policy_grad
    assert isinstance(compiled, CompiledGradient) and full.updater.compiled
    eager = EagerGradient(compiled.value_and_grad)
    (loss_c, _), grads_c = compiled(full.policy, batch)
    (loss_e, _), grads_e = eager(full.policy, batch)
    assert np.allclose(loss_c.item(), loss_e.item(), rtol=1e-4, atol=1e-6)
    flat_c, flat_e = _flat(grads_c), _flat(grads_e)
    assert set(flat_c) == set(flat_e) and "model.model.embed_tokens.weight" in flat_e
    for key, value in flat_e.items():
        scale = max(float(np.abs(value).max()), 1e-8)
        assert np.abs(flat_c[key] - value).max() <= 1e-3 * scale, key


def _supervised_trainers(
    model_dir: Path, out: Path
) -> list[tuple[SupervisedTrainer[Any, Any], Any]]:
    """An SFT (full fine-tuning), a reward-model and a LoRA DPO trainer on ``model_dir``, each
    with records for it."""
    common: dict[str, Any] = dict(
        model_name=str(model_dir),
        learning_rate=1e-3,
        batch_size=4,
        lr_scheduler="constant",
        progress_bar=False,
        keep_last_checkpoints=0,
        total_steps=1,
    )
    sft = SFTTrainer(SFTConfig(**common, output_dir=str(out / "sft"), use_lora=False))
    reward = RewardTrainer(RewardConfig(**common, output_dir=str(out / "rm")))
    dpo = DPOTrainer(DPOConfig(**common, output_dir=str(out / "dpo"), use_lora=True))
    return [
        (sft, sft_records(4, seed=2)),
        (reward, preference_records(4, seed=2)),
        (dpo, preference_records(4, seed=2)),
    ]


def test_padded_batches_give_the_supervised_losses_unchanged(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Rounding a batch's width up (pad_to_multiple_of, as a compiled gradient's batches are)
    adds right padding, which no loss reads: SFT's, the reward model's and DPO's are unchanged."""
    assert padded_width(33, None) == 33 and padded_width(33, 32) == 64
    assert padded_width(64, 32) == 64 and padded_width(1, 1) == 1
    with pytest.raises(ValueError, match="pad_to_multiple_of must be >= 1, got 0"):
        padded_width(3, 0)
    for trainer, records in _supervised_trainers(tiny_model_dir, tmp_path):
        assert trainer.pad_to_multiple_of is None  # eager: any width
        examples = trainer.prepare(records)
        if isinstance(trainer, DPOTrainer):
            examples = trainer._with_reference(examples)
        plain, n = trainer.collate(examples)
        trainer.pad_to_multiple_of = WIDTH_MULTIPLE
        padded, n_padded = trainer.collate(examples)
        assert n == n_padded and padded.input_ids.shape[1] % WIDTH_MULTIPLE == 0
        assert padded.input_ids.shape[1] > plain.input_ids.shape[1]
        loss, metrics = trainer.loss_fn(trainer.model, plain)
        loss_padded, metrics_padded = trainer.loss_fn(trainer.model, padded)
        # rel 1e-5: DPO's loss moves by beta times sums of log-probs of ~-100, whose float32
        # rounding changes with the width (a kernel's tail, a matmul's blocking): 1.6e-6
        # relative seen with one BLAS thread; padding that a loss read would move it by far more
        assert loss_padded.item() == pytest.approx(loss.item(), rel=1e-5, abs=1e-7), trainer.name
        for key, value in metrics.items():
            if key == "rewards/accuracies":
                continue  # the signs of DPO's first rewards, 0 up to rounding: a coin toss
            # abs: DPO's first rewards are 0 up to the rounding of log-probs of ~-100
            assert metrics_padded[key].item() == pytest.approx(value.item(), rel=1e-5, abs=1e-5)


@pytest.mark.slow
def test_the_supervised_stages_take_the_compiled_gradient(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forced on: SFT, the reward model and DPO take a compiled gradient equal to the eager one
    within float32 rounding, pad their batches to a multiple of WIDTH_MULTIPLE, and train; DPO's
    reference takes the compiled gradient's LM-head blocks (its first step's rewards are 0 up
    to rounding: its batches are not padded)."""
    if not fast_math.fast_math_enabled():
        pytest.skip("the compiled gradient needs the fast CPU math (a C++ compiler, the CPU)")
    monkeypatch.setenv("PPO_MLX_COMPILED_GRADIENT", "1")
    for trainer, records in _supervised_trainers(tiny_model_dir, tmp_path):
        compiled = trainer._value_and_grad
        assert isinstance(compiled, CompiledGradient), trainer.name
        assert trainer.pad_to_multiple_of == WIDTH_MULTIPLE
        examples = trainer.prepare(records)
        if isinstance(trainer, DPOTrainer):
            examples = trainer._with_reference(examples)
        batch, _ = trainer.collate(examples)
        assert batch.input_ids.shape[1] % WIDTH_MULTIPLE == 0 and is_array_batch(batch)
        trainer.model.train(False)
        (loss_c, _), grads_c = compiled(trainer.model, batch)
        (loss_e, _), grads_e = EagerGradient(compiled.value_and_grad)(trainer.model, batch)
        assert np.allclose(loss_c.item(), loss_e.item(), rtol=1e-4, atol=1e-6), trainer.name
        flat_c, flat_e = _flat(grads_c), _flat(grads_e)
        assert set(flat_c) == set(flat_e)
        for key, value in flat_e.items():
            scale = max(float(np.abs(value).max()), 1e-8)
            assert np.abs(flat_c[key] - value).max() <= 1e-3 * scale, (trainer.name, key)
        before = _flat(trainer.model.trainable_parameters())
        history = trainer.train(records)
        after = _flat(trainer.model.trainable_parameters())
        unchanged = [k for k in before if np.array_equal(before[k], after[k])]
        # LoRA's A matrices get no gradient at the first step (B starts at 0); every B moves.
        lora = isinstance(trainer, DPOTrainer)
        assert [k for k in unchanged if not (lora and k.endswith("lora_a"))] == [], trainer.name
        if isinstance(trainer, DPOTrainer):
            assert history[-1]["rewards/margins"] == pytest.approx(0.0, abs=1e-5)
