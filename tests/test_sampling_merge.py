"""merge_adapters_for_sampling: the rule, the config key, and that both ways sample alike."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import pytest

from base_setup.lora_setup import (
    LoraSettings,
    lora_modules,
    merge_adapters_for_sampling,
    mergeable_weight_bytes,
)
from config.ppo_config import PPOConfig
from models.policy_model import PolicyModel
from ppo_trainer import rollout
from ppo_trainer.rollout import SamplingSettings, sample_responses, sampling_adapters

MIB = 2**20
#: MLX's memory limit on the CPU of a 24 GiB and of a 64 GiB machine (0.8 of its memory).
LIMIT_24 = int(0.8 * 24 * 2**30)
LIMIT_64 = int(0.8 * 64 * 2**30)


def _all_linear(hidden: int, attention: int, kv: int, mlp: int, blocks: int) -> list[int]:
    """Bytes of the float32 q, k, v, o, gate, up and down weights of ``blocks`` blocks."""
    block = [hidden * attention, hidden * kv, hidden * kv, attention * hidden] + [hidden * mlp] * 3
    return [4 * n for n in block] * blocks


SMOLLM2_135M = _all_linear(576, 576, 192, 1536, 30)  # 405 MiB, 1.9 MiB a matrix
QWEN3_0_6B = _all_linear(1024, 2048, 1024, 3072, 28)  # 1.64 GiB, 8.6 MiB a matrix
QWEN3_1_7B = _all_linear(2048, 2048, 1024, 6144, 28)  # 5.25 GiB, 27 MiB a matrix


def test_the_shapes_sizes() -> None:
    assert sum(SMOLLM2_135M) // MIB == 405  # as benchmarks/sampling_memory printed
    assert round(sum(QWEN3_1_7B) / 10**9, 1) == 5.6  # the 5.6 GB


@pytest.mark.parametrize(
    ("setting", "matrices", "memory", "expected"),
    [
        (True, QWEN3_1_7B, 2**30, True),  # asked for: merged whatever the size
        (False, [1], 2**40, False),  # refused: never merged
        (True, [], 2**40, False),  # nothing to merge (no LoRA, or a 4-bit / bfloat16 base)
        ("auto", [0, 0], 2**40, False),
        ("auto", [4 * MIB] * 2, 64 * MIB, True),  # 4 MiB a matrix, an eighth: merged
        ("auto", [4 * MIB + 1, 4 * MIB], 2**40, False),  # larger matrices: not merged
        ("auto", [4 * MIB] * 2, 64 * MIB - 1, False),  # over an eighth of the memory
        ("auto", SMOLLM2_135M, LIMIT_24, True),  # small layers, small copy
        ("auto", SMOLLM2_135M, 3 * 2**30, False),  # ... but not on a 3 GiB memory limit
        ("auto", QWEN3_0_6B, LIMIT_64, False),  # larger layers: merging did not pay
        ("auto", QWEN3_1_7B, LIMIT_64, False),
    ],
)
def test_the_merge_rule(setting: Any, matrices: list[int], memory: int, expected: bool) -> None:
    assert merge_adapters_for_sampling(setting, matrices, memory) is expected


@pytest.mark.parametrize(
    ("setting", "matrices", "memory"),
    [("yes", [1], 8), (1, [1], 8), (None, [1], 8), ("auto", [-1], 8), ("auto", [1], -8)],
)
def test_the_merge_rule_rejects_bad_input(setting: Any, matrices: list[int], memory: int) -> None:
    with pytest.raises(ValueError, match="merge_adapters_for_sampling|sizes"):
        merge_adapters_for_sampling(setting, matrices, memory)


def test_the_config_key_is_validated_and_reaches_the_sampler() -> None:
    assert PPOConfig(model_name="m").merge_adapters_for_sampling == "auto"
    config = PPOConfig(model_name="m", merge_adapters_for_sampling=False)
    assert SamplingSettings.from_config(config, [2], 0).merge_adapters is False
    with pytest.raises(ValueError, match="merge_adapters_for_sampling must be true or false"):
        PPOConfig(model_name="m", merge_adapters_for_sampling=cast(Any, "yes"))


@pytest.fixture(scope="module")
def lora_policy(tiny_model_dir: Path) -> PolicyModel:
    """The tiny float32 policy with LoRA on every linear layer, adapters off zero."""
    policy = PolicyModel.from_pretrained(
        tiny_model_dir, dtype="float32", lora=LoraSettings(r=4, alpha=8.0, dropout=0.0)
    )
    key = mx.random.key(3)
    for _, module in lora_modules(policy.model):
        key, sub = mx.random.split(key)
        module.lora_b = 0.1 * mx.random.normal(module.lora_b.shape, key=sub)
    return policy


def test_merged_bytes_are_the_adapted_base_weights(lora_policy: PolicyModel) -> None:
    layers = lora_modules(lora_policy.model)
    assert len(layers) == 14
    assert mergeable_weight_bytes(lora_policy.model) == [m.linear.weight.nbytes for _, m in layers]


def test_sampling_merged_and_unmerged_gives_the_same_tokens(
    lora_policy: PolicyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy: the merged weights and the plain LoRA forward pick the same tokens, with
    log-probs equal to float32 rounding; only the merged way swaps the LoRA layers out."""
    monkeypatch.delenv("PPO_MLX_PLAIN", raising=False)
    lora_layers_seen = []
    original = rollout.generate

    def spy(policy: Any, *args: Any, **kwargs: Any) -> Any:
        lora_layers_seen.append(len(lora_modules(policy.model)))
        return original(policy, *args, **kwargs)

    monkeypatch.setattr(rollout, "generate", spy)
    ids = [[5, 17, 42, 99, 7], [3, 8, 250], [11, 64, 9, 30]]
    outputs = {}
    for merge in (True, False):
        sampling = SamplingSettings(
            max_new_tokens=6,
            temperature=0.0,
            top_p=1.0,
            top_k=0,
            stop_token_ids=[],
            pad_token_id=0,
            merge_adapters=merge,
        )
        outputs[merge] = sample_responses(lora_policy, ids, sampling)
    assert lora_layers_seen == [0, 14]
    merged, plain = outputs[True], outputs[False]
    assert mx.array_equal(merged.responses, plain.responses).item()
    assert merged.logprobs is not None and plain.logprobs is not None
    assert mx.allclose(merged.logprobs, plain.logprobs, atol=1e-4).item()
    assert len(lora_modules(lora_policy.model)) == 14  # put back


def test_plain_mlx_never_merges(lora_policy: PolicyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PPO_MLX_PLAIN", "1")
    assert isinstance(sampling_adapters(lora_policy, True), nullcontext)
    monkeypatch.setenv("PPO_MLX_PLAIN", "0")
    assert not isinstance(sampling_adapters(lora_policy, True), nullcontext)
