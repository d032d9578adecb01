"""Sizes that cannot fit are refused before anything is built: ``batch_size=1e9`` was accepted
and grew to 22.6 GB until the kernel killed it; stop ids the policy cannot produce were taken."""

from __future__ import annotations

from pathlib import Path

import pytest

from config.ppo_config import PPOConfig
from ppo_trainer.memory_estimate import GB, check_memory, machine_memory, memory_lower_bound
from ppo_trainer.ppo_trainer import PPOTrainer


def length_reward(prompts: list[str], completions: list[str]) -> list[float]:
    return [float(len(c)) for c in completions]


@pytest.mark.parametrize("plain", [False, True], ids=["speed tricks", "plain"])
def test_the_bound_counts_weights_kv_cache_and_logits_by_hand(
    tiny_model_dir: Path, plain: bool
) -> None:
    """The tiny model: 2 layers, 2 KV heads of 16 dims, 512 ids, float32 weights. With the CPU's
    speed tricks the head's log-probs hold a vocabulary block (256 rows at the least), on plain
    MLX (and a GPU) the logits."""
    config = PPOConfig(
        plain_mlx=plain,
        model_name=str(tiny_model_dir),
        batch_size=4,
        group_size=2,
        num_mini_batches=2,
        max_new_tokens=10,
        dtype="float32",
        use_lora=False,
    )
    weights = (tiny_model_dir / "model.safetensors").stat().st_size
    parts = dict(memory_lower_bound(config))
    assert list(parts.values()) == [
        5 * 8 * 10 * 4,  # ids, mask, 3 log-probs of 4 x 2 sequences, 10 tokens, 4 bytes
        2 * weights,  # policy and a frozen reference copy
        2 * 2 * 8 * 10 * (2 * 16) * 4,  # K and V, layers, sequences, tokens, kv dims, bytes
        4 * 10 * (512 if plain else 256) * 4,  # 8 / 2 sequences, tokens, vocabulary rows, float32
    ]
    hub = PPOConfig(model_name="Qwen/Qwen3-0.6B", batch_size=10**9)  # not local: no model part
    assert [what for what, _ in memory_lower_bound(hub)] == [
        "rollout arrays (5 x 1000000000 sequences x 64 tokens)"
    ]
    with pytest.raises(ValueError, match="needs at least 1192.1 GB"):
        check_memory(hub, available=16 * GB)


def test_a_batch_that_cannot_fit_is_refused_with_the_estimate(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = PPOConfig(
        model_name=str(tiny_model_dir), batch_size=10**9, output_dir=str(tmp_path / "run")
    )
    memory = machine_memory()
    assert memory is not None
    with pytest.raises(
        ValueError, match=rf"needs at least .* GB .* machine has {memory / GB:.1f} GB"
    ):
        PPOTrainer(config, reward_model=length_reward)
    with pytest.raises(ValueError, match="lower batch_size"):
        check_memory(PPOConfig(model_name=str(tiny_model_dir), batch_size=64), available=2**20)
    check_memory(PPOConfig(model_name=str(tiny_model_dir), batch_size=64))


def test_stop_token_ids_outside_the_vocabulary_are_refused(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = PPOConfig(
        model_name=str(tiny_model_dir), stop_token_ids=[0, 512], output_dir=str(tmp_path / "r")
    )
    with pytest.raises(ValueError, match=r"stop_token_ids \[512\] are outside .* 0 to 511"):
        PPOTrainer(config, reward_model=length_reward)
