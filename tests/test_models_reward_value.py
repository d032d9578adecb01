"""Reward and value models (models/backbone.py, models/reward_model.py, models/value_model.py).

Tiny checkpoints are written here (nothing is downloaded): with mlx-lm's qwen3 ``Model`` and, where
torch is installed, with transformers' ``*ForSequenceClassification`` / ``*ForCausalLM``; scores
are compared with transformers' own logits and with a naive per-row loop over the backbone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import qwen3
from mlx_lm.utils import save_config, save_model

from models.backbone import HF_HEAD_WEIGHT, last_token_values
from models.reward_model import RewardModel
from models.value_model import ValueModel

VOCAB = 97
PAD = 0  # no real token equals it, so transformers' pooling finds lengths - 1
HIDDEN = 64
QWEN3_ARGS: dict[str, Any] = dict(
    model_type="qwen3",
    hidden_size=HIDDEN,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    rope_theta=10000.0,
)
LENGTHS = [7, 3, 1, 5]  # mixed lengths, right-padded to L = 7


def _batch(seed: int = 0) -> tuple[np.ndarray, list[int]]:
    """(B, L) right-padded ids with tokens in [1, VOCAB) and PAD after each row's length."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, size=(len(LENGTHS), max(LENGTHS)))
    for row, length in enumerate(LENGTHS):
        ids[row, length:] = PAD
    return ids, list(LENGTHS)


def _naive_scores(hidden: mx.array, head_weight: mx.array, lengths: list[int]) -> np.ndarray:
    """score[b] = sum_d hidden[b, lengths[b] - 1, d] * w[d], one row at a time."""
    h = np.array(hidden, dtype=np.float64)
    w = np.array(head_weight, dtype=np.float64)[0]
    return np.array([float(h[b, n - 1] @ w) for b, n in enumerate(lengths)])


def _flat(tree: Any) -> dict[str, mx.array]:
    """``{dotted name: array}`` of a parameter (or gradient) tree."""
    return dict(cast(list[tuple[str, mx.array]], tree_flatten(tree)))


def _load_file_weights(path: Path) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    for file in sorted(path.glob("model*.safetensors")):
        weights.update(mx.load(str(file)))  # type: ignore[arg-type]
    return weights


@pytest.fixture(scope="module")
def causal_lm() -> qwen3.Model:
    mx.random.seed(1)
    model = qwen3.Model(qwen3.ModelArgs(**QWEN3_ARGS))
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def causal_dir(tmp_path_factory: pytest.TempPathFactory, causal_lm: qwen3.Model) -> Path:
    """A causal-LM checkpoint as mlx-lm writes one (model.* + lm_head.weight)."""
    path = tmp_path_factory.mktemp("causal_lm")
    save_model(path, causal_lm)
    config = {**QWEN3_ARGS, "architectures": ["Qwen3ForCausalLM"], "pad_token_id": PAD}
    save_config(config, path / "config.json")
    return path


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory: pytest.TempPathFactory, causal_dir: Path) -> Path:
    """A reward-model checkpoint written by RewardModel.save_pretrained (random normal head)."""
    path = tmp_path_factory.mktemp("reward_model")
    RewardModel.from_causal_lm(causal_dir, head_init="normal", seed=3).save_pretrained(path)
    return path


# ---------------------------------------------------------------- torch-free: mlx-lm checkpoints


def test_from_causal_lm_is_backbone_plus_head(causal_dir: Path, causal_lm: qwen3.Model) -> None:
    rm = RewardModel.from_causal_lm(causal_dir, head_init="normal", seed=3)
    ids, lengths = _batch()
    hidden = causal_lm.model(mx.array(ids))  # (B, L, D): the source backbone
    expected_values = np.array(hidden) @ np.array(rm.head.weight)[0]  # (B, L)
    np.testing.assert_allclose(np.array(rm(mx.array(ids))), expected_values, atol=1e-5)
    np.testing.assert_allclose(
        np.array(rm.score(mx.array(ids), lengths)),
        _naive_scores(hidden, rm.head.weight, lengths),
        atol=1e-5,
    )
    # The "normal" head is N(0, 1/(D+1)) drawn from the seed.
    expected_head = mx.random.normal((1, HIDDEN), key=mx.random.key(3)) / np.sqrt(HIDDEN + 1)
    np.testing.assert_allclose(np.array(rm.head.weight), np.array(expected_head), rtol=1e-6)
    other = RewardModel.from_causal_lm(causal_dir, head_init="normal", seed=4)
    assert not np.allclose(np.array(other.head.weight), np.array(rm.head.weight))
    names = _flat(rm.parameters()).keys()
    # Parameter names are the Hugging Face ones; the causal LM's lm_head is gone.
    assert all(k.startswith("model.") for k in names - {HF_HEAD_WEIGHT}) and HF_HEAD_WEIGHT in names
    assert rm["score"] is rm.head and len(rm.layers) == QWEN3_ARGS["num_hidden_layers"]


def test_zero_head_and_bad_head_init(causal_dir: Path) -> None:
    rm = RewardModel.from_causal_lm(causal_dir)  # head_init="zeros"
    ids, lengths = _batch()
    np.testing.assert_array_equal(np.array(rm.score(mx.array(ids), lengths)), 0.0)
    with pytest.raises(ValueError, match="head_init"):
        RewardModel.from_causal_lm(causal_dir, head_init="xavier")  # type: ignore[arg-type]


def test_save_pretrained_layout_and_round_trip(causal_dir: Path, reward_dir: Path) -> None:
    config = json.loads((reward_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForSequenceClassification"]
    assert config["id2label"] == {"0": "LABEL_0"} and config["label2id"] == {"LABEL_0": 0}
    assert "num_labels" not in config and config["dtype"] == "float32"
    assert config["pad_token_id"] == PAD and config["model_type"] == "qwen3"
    assert sorted(p.name for p in reward_dir.glob("model*")) == ["model.safetensors"]

    file_weights = _load_file_weights(reward_dir)
    backbone_names = {
        "model." + k for k in _flat(qwen3.Model(qwen3.ModelArgs(**QWEN3_ARGS)).model.parameters())
    }
    assert set(file_weights) == backbone_names | {HF_HEAD_WEIGHT}
    assert file_weights[HF_HEAD_WEIGHT].shape == (1, HIDDEN)

    original = RewardModel.from_causal_lm(causal_dir, head_init="normal", seed=3)
    loaded = RewardModel.from_pretrained(reward_dir)
    ids, lengths = _batch()
    np.testing.assert_array_equal(
        np.array(loaded(mx.array(ids))), np.array(original(mx.array(ids)))
    )
    np.testing.assert_array_equal(
        np.array(loaded.score(mx.array(ids), lengths)),
        np.array(original.score(mx.array(ids), lengths)),
    )


def test_sharded_save_round_trip(reward_dir: Path, tmp_path: Path) -> None:
    rm = RewardModel.from_pretrained(reward_dir)
    rm.save_pretrained(tmp_path)  # a single file first: the sharded save must replace it
    rm.save_pretrained(tmp_path, max_shard_bytes=40_000)
    shards = sorted(p.name for p in tmp_path.glob("model*.safetensors"))
    assert len(shards) > 1 and "model.safetensors" not in shards
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert HF_HEAD_WEIGHT in index["weight_map"]
    loaded = RewardModel.from_pretrained(tmp_path)
    ids, lengths = _batch(1)
    np.testing.assert_array_equal(
        np.array(loaded.score(mx.array(ids), lengths)), np.array(rm.score(mx.array(ids), lengths))
    )


def test_value_model_from_reward_checkpoint(reward_dir: Path, tmp_path: Path) -> None:
    rm = RewardModel.from_pretrained(reward_dir)
    vm = ValueModel.from_pretrained(reward_dir)
    ids, lengths = _batch()
    values = vm(mx.array(ids))
    assert values.shape == ids.shape
    at_last = [float(values[b, n - 1]) for b, n in enumerate(lengths)]
    np.testing.assert_array_equal(np.array(at_last), np.array(rm.score(mx.array(ids), lengths)))
    np.testing.assert_array_equal(
        np.array(last_token_values(values, mx.array(lengths))), np.array(at_last)
    )
    vm.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForSequenceClassification"]
    np.testing.assert_array_equal(
        np.array(ValueModel.from_pretrained(tmp_path)(mx.array(ids))), np.array(values)
    )


def test_value_model_from_policy_backbone(causal_dir: Path, causal_lm: qwen3.Model) -> None:
    ids, _ = _batch()
    from_path = ValueModel.from_policy_backbone(causal_dir, head_init="normal", seed=5)
    in_memory = ValueModel.from_policy_backbone(causal_lm, head_init="normal", seed=5)
    np.testing.assert_allclose(
        np.array(in_memory(mx.array(ids))), np.array(from_path(mx.array(ids))), atol=1e-6
    )
    expected = np.array(causal_lm.model(mx.array(ids))) @ np.array(in_memory.head.weight)[0]
    np.testing.assert_allclose(np.array(in_memory(mx.array(ids))), expected, atol=1e-5)
    np.testing.assert_array_equal(
        np.array(ValueModel.from_policy_backbone(causal_lm)(mx.array(ids))), 0.0
    )
    # Training the value model (new arrays) leaves the policy it was copied from unchanged.
    logits_before = np.array(causal_lm(mx.array(ids)))
    in_memory.update(tree_map(lambda p: p + 0.5, in_memory.parameters()))
    mx.eval(in_memory.parameters())
    np.testing.assert_array_equal(np.array(causal_lm(mx.array(ids))), logits_before)
    assert in_memory.model is not causal_lm.model


def test_load_pretrained_weights_in_place(reward_dir: Path, causal_dir: Path) -> None:
    """Resuming a value model in place (the trainer keeps the instance and its optimiser)."""
    vm = ValueModel.from_policy_backbone(causal_dir)  # zero head, so it differs from reward_dir
    vm.load_pretrained_weights(reward_dir)
    expected = ValueModel.from_pretrained(reward_dir)
    ids, _ = _batch()
    np.testing.assert_array_equal(np.array(vm(mx.array(ids))), np.array(expected(mx.array(ids))))
    with pytest.raises(ValueError):  # strict: a causal LM checkpoint has lm_head, no score
        vm.load_pretrained_weights(causal_dir)


def test_lora_on_the_value_backbone(reward_dir: Path) -> None:
    """mlx-lm's LoRA tools find the blocks through ``layers``; fresh adapters change nothing."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    vm = ValueModel.from_pretrained(reward_dir)
    ids, _ = _batch()
    before = np.array(vm(mx.array(ids)))
    vm.freeze()
    linear_to_lora_layers(vm, 1, {"rank": 2, "scale": 1.0, "dropout": 0.0})
    vm.head.unfreeze()
    trainable = _flat(vm.trainable_parameters())
    assert HF_HEAD_WEIGHT in trainable and any("lora_a" in k for k in trainable)
    assert all(k.startswith("model.layers.1.") for k in trainable.keys() - {HF_HEAD_WEIGHT})
    np.testing.assert_allclose(np.array(vm(mx.array(ids))), before, atol=1e-6)


def test_value_model_in_memory_with_adapters_is_refused() -> None:
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model = qwen3.Model(qwen3.ModelArgs(**QWEN3_ARGS))
    linear_to_lora_layers(model, 1, {"rank": 2, "scale": 1.0, "dropout": 0.0})
    with pytest.raises(ValueError, match="LoRA"):
        ValueModel.from_policy_backbone(model)
    with pytest.raises(ValueError, match="mlx-lm causal LM"):
        ValueModel.from_policy_backbone(nn.Linear(2, 2))


def _loss(model: ValueModel, ids: mx.array, mask: mx.array) -> mx.array:
    values = model(ids)  # (B, L)
    targets = mx.arange(ids.shape[1], dtype=mx.float32)[None, :] / 4.0  # (1, L) constants
    return ((values - targets) ** 2 * mask).sum() / mask.sum()


def test_gradient_reaches_every_parameter(reward_dir: Path, causal_dir: Path) -> None:
    ids, lengths = _batch()
    mask = mx.array((np.arange(ids.shape[1])[None, :] < np.array(lengths)[:, None]) * 1.0)
    vm = ValueModel.from_pretrained(reward_dir)
    _, grads = nn.value_and_grad(vm, _loss)(vm, mx.array(ids), mask)
    flat = _flat(grads)
    assert flat.keys() == _flat(vm.trainable_parameters()).keys()
    zero = [name for name, g in flat.items() if not bool(mx.any(g != 0))]
    assert zero == [], f"parameters without gradient: {zero}"
    # A zero head passes no gradient back at the first step: only the head moves first.
    fresh = ValueModel.from_policy_backbone(causal_dir)
    _, grads = nn.value_and_grad(fresh, _loss)(fresh, mx.array(ids), mask)
    flat = _flat(grads)
    assert bool(mx.any(flat[HF_HEAD_WEIGHT] != 0))
    assert all(not bool(mx.any(g != 0)) for k, g in flat.items() if k != HF_HEAD_WEIGHT)


@pytest.mark.slow
def test_dtypes(reward_dir: Path, tmp_path: Path) -> None:
    ids, lengths = _batch()
    fp32 = RewardModel.from_pretrained(reward_dir)
    for dtype in ("bfloat16", mx.float16):
        rm = RewardModel.from_pretrained(reward_dir, dtype=dtype)
        dtypes = {p.dtype for p in _flat(rm.parameters()).values()}
        assert dtypes == {mx.bfloat16 if dtype == "bfloat16" else mx.float16}
        np.testing.assert_allclose(
            np.array(rm.score(mx.array(ids), lengths).astype(mx.float32)),
            np.array(fp32.score(mx.array(ids), lengths)),
            atol=0.05,
        )
    bf16 = RewardModel.from_pretrained(reward_dir, dtype=mx.bfloat16)
    bf16.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    assert _load_file_weights(tmp_path)[HF_HEAD_WEIGHT].dtype == mx.bfloat16
    reloaded = RewardModel.from_pretrained(tmp_path)  # default: cast up to float32
    assert reloaded.head.weight.dtype == mx.float32
    np.testing.assert_array_equal(
        np.array(reloaded.head.weight), np.array(bf16.head.weight.astype(mx.float32))
    )
    with pytest.raises(ValueError, match="dtype"):
        RewardModel.from_pretrained(reward_dir, dtype="float64")


# ---------------------------------------------------------------------------------- bad input


def test_missing_paths(tmp_path: Path) -> None:
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match="no_such_model"):
        RewardModel.from_pretrained(missing)
    with pytest.raises(FileNotFoundError, match="no_such_model"):
        ValueModel.from_policy_backbone(str(missing))
    with pytest.raises(FileNotFoundError, match="config.json"):
        RewardModel.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_ARGS))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        RewardModel.from_pretrained(tmp_path)


def test_hub_id_that_cannot_be_fetched(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(*args: object, **kwargs: object) -> str:
        raise LocalEntryNotFoundError("cannot reach the Hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(FileNotFoundError, match="some-org/some-reward-model.*Hugging Face Hub"):
        RewardModel.from_pretrained("some-org/some-reward-model")


def test_causal_lm_checkpoint_has_no_scalar_head(causal_dir: Path) -> None:
    for cls in (RewardModel, ValueModel):
        with pytest.raises(ValueError, match="no scalar head") as info:
            cls.from_pretrained(causal_dir)
        assert "score.weight" in str(info.value) and "from_policy_backbone" in str(info.value)


def test_num_labels_two_is_refused(reward_dir: Path, tmp_path: Path) -> None:
    config = json.loads((reward_dir / "config.json").read_text())
    config["id2label"] = {"0": "LABEL_0", "1": "LABEL_1"}
    config["label2id"] = {"LABEL_0": 0, "LABEL_1": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = _load_file_weights(reward_dir)
    weights[HF_HEAD_WEIGHT] = mx.concatenate([weights[HF_HEAD_WEIGHT]] * 2)  # (2, D)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    with pytest.raises(ValueError, match="num_labels=2"):
        RewardModel.from_pretrained(tmp_path)


def test_bad_lengths_and_ids(reward_dir: Path) -> None:
    rm = RewardModel.from_pretrained(reward_dir)
    ids, lengths = _batch()
    L = ids.shape[1]
    for bad in ([0, 3, 1, 5], [7, 3, L + 1, 5], [7, 3, 1], [7.0, 3.0, 1.0, 5.0]):
        with pytest.raises(ValueError, match="lengths"):
            rm.score(mx.array(ids), bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\(B, L\)"):
        rm(mx.array(ids[0]))


# ------------------------------------------------------------ transformers checkpoints (torch)


def _hf_classifier(torch: Any, arch: str, tie: bool, num_labels: int = 1) -> Any:
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        num_labels=num_labels,
        pad_token_id=PAD,
        tie_word_embeddings=tie,
        initializer_range=0.1,  # larger than the default, so scores are O(1)
    )
    torch.manual_seed(0)
    if arch == "qwen3":
        return transformers.Qwen3ForSequenceClassification(transformers.Qwen3Config(**common))
    return transformers.LlamaForSequenceClassification(transformers.LlamaConfig(**common))


@pytest.mark.parametrize("arch,tie", [("qwen3", False), ("qwen3", True), ("llama", False)])
def test_matches_transformers_classifier(arch: str, tie: bool, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    hf = _hf_classifier(torch, arch, tie).eval()
    hf.save_pretrained(tmp_path)
    rm = RewardModel.from_pretrained(tmp_path)
    ids, lengths = _batch(2)
    with torch.no_grad():
        hf_scores = hf(torch.tensor(ids)).logits[:, 0].numpy()  # pools at the last non-pad token
        hf_values = hf.score(hf.model(torch.tensor(ids)).last_hidden_state)[..., 0].numpy()
    np.testing.assert_allclose(np.array(rm.score(mx.array(ids), lengths)), hf_scores, atol=1e-4)
    mask = np.arange(ids.shape[1])[None, :] < np.array(lengths)[:, None]
    np.testing.assert_allclose(np.array(rm(mx.array(ids)))[mask], hf_values[mask], atol=1e-4)
    vm = ValueModel.from_pretrained(tmp_path)
    values = np.array(vm(mx.array(ids)))
    np.testing.assert_allclose(
        [values[b, n - 1] for b, n in enumerate(lengths)], hf_scores, atol=1e-4
    )


def test_save_pretrained_loads_in_transformers(causal_lm: qwen3.Model, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForSequenceClassification

    hf = _hf_classifier(torch, "qwen3", False).eval()
    hf.save_pretrained(tmp_path / "hf")
    ids, lengths = _batch(3)
    from_hf = RewardModel.from_pretrained(tmp_path / "hf")
    # An in-memory mlx-lm model's config (its ModelArgs) must also give a transformers config.
    from_mlx = RewardModel.from_causal_lm(causal_lm, head_init="normal", seed=7)
    for name, rm, shard_bytes in (("a", from_hf, 40_000), ("b", from_mlx, 5 << 30)):
        out = rm.save_pretrained(tmp_path / name, max_shard_bytes=shard_bytes)
        config = json.loads((out / "config.json").read_text())
        if config.get("pad_token_id") is None:  # the in-memory args carry no pad id
            config["pad_token_id"] = PAD
            (out / "config.json").write_text(json.dumps(config))
        reloaded = AutoModelForSequenceClassification.from_pretrained(out).eval()
        assert type(reloaded).__name__ == "Qwen3ForSequenceClassification"
        with torch.no_grad():
            hf_scores = reloaded(torch.tensor(ids)).logits[:, 0].numpy()
        np.testing.assert_allclose(np.array(rm.score(mx.array(ids), lengths)), hf_scores, atol=1e-4)


def test_transformers_causal_lm_checkpoint(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        pad_token_id=PAD,
        tie_word_embeddings=False,
        initializer_range=0.1,
    )
    hf = transformers.Qwen3ForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no scalar head"):
        RewardModel.from_pretrained(tmp_path)
    rm = RewardModel.from_causal_lm(tmp_path, head_init="normal", seed=1)
    ids, lengths = _batch(4)
    with torch.no_grad():
        hidden = hf.model(torch.tensor(ids)).last_hidden_state.numpy()  # (B, L, D)
    np.testing.assert_allclose(
        np.array(rm.score(mx.array(ids), lengths)),
        _naive_scores(mx.array(hidden), rm.head.weight, lengths),
        atol=1e-4,
    )


def test_transformers_two_label_classifier_is_refused(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    _hf_classifier(torch, "qwen3", False, num_labels=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="num_labels=2"):
        RewardModel.from_pretrained(tmp_path)
