"""Frozen models kept on disk outside their passes (``offload_frozen_models``,
:mod:`models.offload`): the same scores and training bit for bit, the weights out of MLX's memory
between phases, the file's lifetime, and the runs that have nothing to keep on disk."""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from config.ppo_config import PPOConfig
from fixtures.tiny_corpus import review_prompts
from models import offload
from models.backbone_loading import flat_parameters
from models.offload import drop_read_weights, offload_to_disk, offloaded_bytes
from models.policy_model import PolicyModel
from models.reward_model import RewardModel
from ppo_trainer.ppo_trainer import PPOTrainer
from tests.test_shared_value_model import config as shared_value_config
from training.callbacks import TrainerCallback

PROBE = mx.array([[5, 6, 7, 8, 9], [3, 1, 4, 1, 5]])  # (2, 5)
LENGTHS = [5, 3]


def flat(tree: Any) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in cast(list[tuple[str, mx.array]], tree_flatten(tree))}


def nbytes(module: Any) -> int:
    return sum(a.nbytes for a in flat_parameters(module).values())


@pytest.fixture(scope="module")
def reward_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A full-weight reward checkpoint on the tiny model (a normal head: scores that differ)."""
    model = RewardModel.from_causal_lm(str(tiny_model_dir), head_init="normal", seed=3)
    return model.save_pretrained(tmp_path_factory.mktemp("reward") / "rm")


def frozen_reward(reward_dir: Path) -> RewardModel:
    model = RewardModel.from_pretrained(reward_dir)
    model.freeze()
    return model


def test_scores_are_equal_and_the_weights_leave_memory_at_each_phase_end(
    reward_dir: Path, tmp_path: Path
) -> None:
    model = frozen_reward(reward_dir)
    before = np.array(model.score(PROBE, LENGTHS))
    size = nbytes(model)
    slack = size // 8  # the pass's own small arrays; the weights are eight times that
    gc.collect()
    resident = mx.get_active_memory()
    weights = offload_to_disk(model, tmp_path, "reward", "the reward model")
    assert model.disk_weights is weights and weights.nbytes == size
    assert weights.path.parent.name == f".offloaded-{offload._host()}-{os.getpid()}"
    assert offloaded_bytes() >= size
    gc.collect()
    # The arrays it held are gone; the file's are not read yet.
    assert mx.get_active_memory() <= resident - size + slack
    np.testing.assert_array_equal(np.array(model.score(PROBE, LENGTHS)), before)
    assert mx.get_active_memory() >= resident - slack  # read for the pass, held by the model
    drop_read_weights()  # a phase ends
    gc.collect()
    assert mx.get_active_memory() <= resident - size + slack
    # Read again for the next pass: the same scores, every phase.
    for _ in range(2):
        np.testing.assert_array_equal(np.array(model.score(PROBE, LENGTHS)), before)
        drop_read_weights()


def test_the_file_goes_with_the_model(reward_dir: Path, tmp_path: Path) -> None:
    model = frozen_reward(reward_dir)
    path = offload_to_disk(model, tmp_path, "reward", "the reward model").path
    assert path.is_file()
    del model
    gc.collect()
    assert not path.exists() and not path.parent.exists()
    drop_read_weights()  # nothing left to drop: no error


def test_a_model_whose_folder_was_removed_still_scores(reward_dir: Path, tmp_path: Path) -> None:
    model = frozen_reward(reward_dir)
    before = np.array(model.score(PROBE, LENGTHS))
    path = offload_to_disk(model, tmp_path, "reward", "the reward model").path
    path.unlink()  # its run folder deleted while the model lives on
    drop_read_weights()  # keeps the arrays it has: they still read the open file
    np.testing.assert_array_equal(np.array(model.score(PROBE, LENGTHS)), before)
    drop_read_weights()
    np.testing.assert_array_equal(np.array(model.score(PROBE, LENGTHS)), before)


def test_a_killed_process_folder_is_removed_on_this_host_only(
    reward_dir: Path, tmp_path: Path
) -> None:
    host = offload._host()
    dead = tmp_path / f".offloaded-{host}-{2**22 + 12345}"  # above any pid_max: never running
    alive = tmp_path / f".offloaded-{host}-{os.getppid()}"
    elsewhere = tmp_path / f".offloaded-{host}x-{2**22 + 12345}"  # another host's
    for folder in (dead, alive, elsewhere):
        folder.mkdir()
        (folder / "reward.safetensors").write_bytes(b"x")
    model = frozen_reward(reward_dir)
    offload_to_disk(model, tmp_path, "reward", "the reward model")
    assert not dead.exists() and alive.exists() and elsewhere.exists()


def test_a_trainable_model_or_an_unwritable_folder_is_refused(
    reward_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="has trainable parameters"):
        offload_to_disk(RewardModel.from_pretrained(reward_dir), tmp_path, "r", "the reward model")
    blocked = tmp_path / "a file"
    blocked.write_text("not a folder")
    with pytest.raises(ValueError, match="could not write the reward model's weights"):
        offload_to_disk(frozen_reward(reward_dir), blocked, "r", "the reward model")


def config(model_dir: Path, out: Path, **overrides: Any) -> PPOConfig:
    """The shared-value-model tests' run, two steps of one epoch, the value model its own."""
    values: dict[str, Any] = dict(value_init="policy", num_ppo_epochs=1, total_steps=2)
    return shared_value_config(model_dir, out, **{**values, **overrides})


class ActiveMemory(TrainerCallback):
    """MLX's array memory at the end of each step (after the update's phase end), and its
    buffer cache after each scoring phase."""

    def __init__(self) -> None:
        self.bytes: list[int] = []
        self.cached: list[int] = []
        self.offloaded = 0

    def on_train_begin(self, trainer: Any) -> None:
        self.offloaded = offloaded_bytes()

    def on_rollout_scored(self, trainer: Any, step: int, rollout: Any) -> None:
        self.cached.append(mx.get_cache_memory())

    def on_step_end(self, trainer: Any, step: int, metrics: Any) -> None:
        gc.collect()
        self.bytes.append(mx.get_active_memory())


def run(cfg: PPOConfig) -> tuple[dict[str, np.ndarray], list[dict[str, Any]], ActiveMemory]:
    trainer = PPOTrainer(cfg)
    before = flat(trainer.policy.trainable_parameters())
    memory = ActiveMemory()
    history = trainer.train(review_prompts(8), callbacks=[memory])
    after = flat(trainer.policy.trainable_parameters())
    assert all(not np.array_equal(before[k], after[k]) for k in before)  # it trained
    del trainer
    gc.collect()
    return after, history, memory


@pytest.mark.parametrize(
    "overrides",
    [
        # GRPO with LoRA: the reward model is the only model of its own.
        dict(algorithm="grpo", group_size=2, beta=0.04),
        # PPO fully fine-tuned: the reference is a copy, and the reward model too.
        dict(use_lora=False),
    ],
    ids=["grpo-lora", "ppo-full"],
)
def test_a_run_trains_the_same_bit_for_bit_without_the_frozen_weights_between_phases(
    tiny_model_dir: Path,
    reward_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    overrides: dict[str, Any],
) -> None:
    monkeypatch.setenv("PPO_MLX_ADAPTIVE_BLAS", "off")  # the same BLAS threads both runs
    common = dict(reward_model_name=str(reward_dir), **overrides)
    kept, kept_history, kept_memory = run(config(tiny_model_dir, tmp_path / "kept", **common))
    out = tmp_path / "offloaded"
    offloaded, history, memory = run(
        config(tiny_model_dir, out, offload_frozen_models=True, **common)
    )
    for key in kept:
        np.testing.assert_array_equal(offloaded[key], kept[key], err_msg=key)
    for a, b in zip(history, kept_history):
        assert {k: v for k, v in a.items() if "time" not in k and "per_s" not in k} == {
            k: v for k, v in b.items() if "time" not in k and "per_s" not in k
        }
    frozen = nbytes(RewardModel.from_pretrained(reward_dir))
    if overrides.get("use_lora") is False:
        frozen += nbytes(PolicyModel.from_pretrained(tiny_model_dir).model)  # the reference
    assert memory.offloaded == frozen and kept_memory.offloaded == 0
    saved = [k - o for k, o in zip(kept_memory.bytes, memory.bytes)]
    assert all(s > 0.9 * frozen for s in saved), (saved, frozen)
    # What a scoring phase read leaves the process with the phase: not kept in MLX's buffer
    # cache into the next phase.
    assert all(c < frozen / 2 for c in memory.cached), (memory.cached, frozen)
    assert not list(out.glob(".offloaded-*"))  # removed with the trainer's models


def test_a_run_with_nothing_of_its_own_to_offload_is_refused(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = config(tiny_model_dir, tmp_path, algorithm="grpo", group_size=2, beta=0.04)
    cfg.offload_frozen_models = True
    with pytest.raises(ValueError, match="no frozen model with weights of its own"):
        PPOTrainer(cfg, reward_model=lambda prompts, completions: [1.0] * len(completions))
    assert not list(tmp_path.glob(".offloaded-*"))
