"""Policy side of the models: tiny checkpoint, PolicyModel, LoRA, ReferenceModel, tokenizer rules."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten as _tree_flatten
from mlx.utils import tree_unflatten

from base_setup.fast_layers import accelerate_model
from base_setup.lora_setup import (
    LoraSettings,
    adapters_disabled,
    adapters_merged,
    apply_lora,
    lora_modules,
    read_adapter_settings,
)
from base_setup.tokenizer_setup import apply_chat_template, ensure_pad_token, eos_token_ids
from models.policy_model import PolicyModel
from models.sft_model import ReferenceModel
from fixtures.tiny_corpus import (
    NEGATIVE_WORDS,
    POSITIVE_WORDS,
    lexicon_score,
    review_corpus,
)
from fixtures.tiny_model import CHECKPOINT_FILES, build_tiny_checkpoint

TEXTS = [
    "Review of the camera: The screen is superb.",
    "Review of the sushi bar:",
    "Review of the documentary: I hated the plot and the pacing. Avoid it.",
]


def _batch(tokenizer: Any, texts: list[str]) -> mx.array:
    """Right-padded ids (B, L) of ``texts`` (pad positions never influence earlier ones)."""
    ids = [tokenizer.encode(t) for t in texts]
    width = max(len(i) for i in ids)
    return mx.array([i + [tokenizer.pad_token_id] * (width - len(i)) for i in ids])


def _load(path: str, adapter_path: str | None = None) -> tuple[nn.Module, Any]:
    """``mlx_lm.load`` (model, tokenizer), the model running the fast layers PolicyModel runs
    (``base_setup.fast_math``; a model mlx-lm loads keeps mlx-lm's own), so that the two give
    the same logits bit for bit when their weights are the same."""
    import mlx_lm

    loaded = mlx_lm.load(path, adapter_path=adapter_path)
    accelerate_model(loaded[0])
    return loaded[0], loaded[1]


def _flat(tree: Any) -> list[tuple[str, Any]]:
    return cast(list[tuple[str, Any]], _tree_flatten(tree))


def _numpy_params(module: nn.Module) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in _flat(module.parameters())}


# --- tiny corpus and checkpoint ------------------------------------------------------------------


def test_corpus_is_deterministic_balanced_and_lexicon_readable() -> None:
    corpus = review_corpus(3000, seed=1)
    assert corpus == review_corpus(3000, seed=1)
    assert corpus != review_corpus(3000, seed=2)
    assert len({r.text for r in corpus}) == 3000
    counts = {s: sum(r.sentiment == s for r in corpus) for s in ("positive", "negative", "neutral")}
    assert counts == {"positive": 1000, "negative": 1000, "neutral": 1000}
    assert not POSITIVE_WORDS & NEGATIVE_WORDS
    for review in corpus:
        assert review.text == review.prompt + review.completion
        assert review.prompt.startswith("Review of ") and review.prompt.endswith(":")
        score = lexicon_score(review.text)
        expected = {"positive": score > 0, "negative": score < 0, "neutral": score == 0}
        assert expected[review.sentiment], review
    assert lexicon_score("Great food, awful service, great coffee.") == 1
    with pytest.raises(ValueError, match="positive"):
        review_corpus(0)


@pytest.mark.slow
def test_build_tiny_checkpoint_is_deterministic_and_reused(tmp_path: Path) -> None:
    a = build_tiny_checkpoint(tmp_path / "a", seed=0)
    b = build_tiny_checkpoint(tmp_path / "b", seed=0)
    c = build_tiny_checkpoint(tmp_path / "c", seed=1)
    for name in CHECKPOINT_FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()

    # A complete checkpoint with the same stamp is returned untouched ...
    mtimes = {name: (a / name).stat().st_mtime_ns for name in CHECKPOINT_FILES}
    assert build_tiny_checkpoint(a, seed=0) == a
    assert {name: (a / name).stat().st_mtime_ns for name in CHECKPOINT_FILES} == mtimes
    # ... an incomplete one is rebuilt, identically.
    (a / "tokenizer.json").unlink()
    build_tiny_checkpoint(a, seed=0)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    with pytest.raises(ValueError, match="size"):
        build_tiny_checkpoint(tmp_path / "d", size="huge")  # type: ignore[arg-type]


def test_checkpoint_layout_and_loading(tiny_model_dir: Path) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert config["eos_token_id"] == 0 and config["pad_token_id"] == 1

    model, tokenizer = _load(str(tiny_model_dir))
    policy = PolicyModel.from_pretrained(tiny_model_dir)
    assert policy.model_path == tiny_model_dir
    assert policy.lora is None
    assert policy.config["vocab_size"] == config["vocab_size"] == len(policy.tokenizer)
    ids = _batch(policy.tokenizer, TEXTS)
    logits = policy(ids)
    assert logits.shape == (3, ids.shape[1], config["vocab_size"])
    assert mx.array_equal(logits, model(ids)).item()
    # Tokenizer: pad distinct from both EOS ids; text round-trips.
    assert policy.tokenizer.pad_token_id == 1
    assert eos_token_ids(policy.tokenizer) == [0, 3]
    text = TEXTS[2]
    assert policy.tokenizer.decode(policy.tokenizer.encode(text)) == text
    # Full fine-tuning: everything trains.
    n_params = len(_flat(policy.parameters()))
    assert len(_flat(policy.trainable_parameters())) == n_params


def test_missing_model_path_and_bad_arguments(tmp_path: Path, tiny_model_dir: Path) -> None:
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match="no_such_model"):
        PolicyModel.from_pretrained(missing)
    with pytest.raises(FileNotFoundError, match="config.json"):
        PolicyModel.from_pretrained(tmp_path)  # exists, but is not a checkpoint
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ReferenceModel.from_pretrained("./not/a/model/dir")
    with pytest.raises(ValueError, match="dtype"):
        PolicyModel.from_pretrained(tiny_model_dir, dtype="float8")


def test_hub_id_that_cannot_be_fetched(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub id goes through the Hub's snapshot download of the files mlx-lm loads; its offline
    failure becomes a clear error."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    asked: list[str] = []

    def offline(repo: str, *args: Any, **kwargs: Any) -> Path:
        assert kwargs.get("allow_patterns") == DEFAULT_ALLOW_PATTERNS
        asked.append(repo)
        raise LocalEntryNotFoundError("Cannot reach the Hub: no network\nmore detail")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(FileNotFoundError, match="some-org/some-model.*Cannot reach the Hub"):
        PolicyModel.from_pretrained("some-org/some-model")
    assert asked == ["some-org/some-model"]


def test_dtype_cast(tiny_model_dir: Path) -> None:
    policy = PolicyModel.from_pretrained(tiny_model_dir, dtype="bfloat16")
    assert {v.dtype for _, v in _flat(policy.parameters())} == {mx.bfloat16}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_response_logprobs_match_transformers(tiny_model_dir: Path, temperature: float) -> None:
    """Per-token log-probs of responses on a right-padded batch of mixed prompt lengths equal
    PyTorch transformers' on the same weights (fp32, 1e-4)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    policy = PolicyModel.from_pretrained(tiny_model_dir)
    tok = policy.tokenizer
    prompts = [tok.encode(t) for t in ("Review of the camera:", "Review of the new phone: The")]
    prompts.append(tok.encode("Hi"))
    responses = [tok.encode(t) for t in (" The screen is superb.", " battery", " Review of it")]
    responses[0].append(tok.eos_token_id)
    rows = [p + r for p, r in zip(prompts, responses)]
    width = max(len(r) for r in rows)
    ids = np.array([r + [tok.pad_token_id] * (width - len(r)) for r in rows])  # (B, L)
    lengths = np.array([len(r) for r in rows])

    # MLX: logits at position t score token t + 1.
    logits = np.array(policy(mx.array(ids))).astype(np.float64) / temperature  # (B, L, V)
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    hf.eval()
    mask = torch.tensor(np.arange(width)[None, :] < lengths[:, None], dtype=torch.long)
    with torch.no_grad():
        hf_logits = hf(input_ids=torch.tensor(ids), attention_mask=mask).logits
    hf_logp = torch.log_softmax(hf_logits.double() / temperature, dim=-1).numpy()

    n_checked = 0
    for b, (prompt, response) in enumerate(zip(prompts, responses)):
        for j, token in enumerate(response):
            t = len(prompt) + j - 1  # position whose logits score response token j
            mine, theirs = logp[b, t, token], hf_logp[b, t, token]
            assert abs(mine - theirs) < 1e-4, (b, j, mine, theirs)
            n_checked += 1
    assert n_checked == sum(len(r) for r in responses)
    # The comparison is not vacuous: log-probs vary and are far from uniform.
    assert np.std([logp[0, len(prompts[0]) + j - 1, t] for j, t in enumerate(responses[0])]) > 0.1


def test_transformers_tokenizer_matches(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    policy_tok = PolicyModel.from_pretrained(tiny_model_dir).tokenizer
    for text in TEXTS:
        assert hf.encode(text) == policy_tok.encode(text)
    assert (hf.eos_token_id, hf.pad_token_id) == (0, 1)


# --- saving --------------------------------------------------------------------------------------


def test_save_pretrained_full_reloads_identically(tiny_model_dir: Path, tmp_path: Path) -> None:
    policy = PolicyModel.from_pretrained(tiny_model_dir)
    # Change the weights so the test sees what was saved, not the original checkpoint.
    policy.model.model.norm.weight = policy.model.model.norm.weight * 1.5
    ids = _batch(policy.tokenizer, TEXTS)
    out = policy.save_pretrained(tmp_path / "full")
    model, tokenizer = _load(str(out))
    assert mx.array_equal(model(ids), policy(ids)).item()
    again = PolicyModel.from_pretrained(out)
    assert mx.array_equal(again(ids), policy(ids)).item()
    assert again.tokenizer.pad_token_id == policy.tokenizer.pad_token_id
    assert tokenizer.encode(TEXTS[0]) == policy.tokenizer.encode(TEXTS[0])


def _train_lora_steps(policy: PolicyModel, ids: mx.array, steps: int = 3) -> list[float]:
    """A few Adam steps of next-token cross-entropy (LoRA dropout active: train mode)."""

    def loss_fn(model: PolicyModel, x: mx.array) -> mx.array:
        return nn.losses.cross_entropy(model(x[:, :-1]), x[:, 1:]).mean()

    optimizer = optim.Adam(learning_rate=1e-2)
    loss_and_grad = nn.value_and_grad(policy, loss_fn)
    policy.train()
    losses = []
    for _ in range(steps):
        loss, grads = loss_and_grad(policy, ids)
        optimizer.update(policy, grads)
        mx.eval(policy.parameters(), optimizer.state)
        losses.append(loss.item())
    return losses


def test_lora_trains_only_adapters_and_reference_is_the_base(tiny_model_dir: Path) -> None:
    mx.random.seed(0)
    base, _ = _load(str(tiny_model_dir))
    policy = PolicyModel.from_pretrained(
        tiny_model_dir, lora=LoraSettings(r=4, alpha=8.0, dropout=0.1)
    )
    assert not policy.training and not policy.model.training  # loaded in eval mode
    trainable = [k for k, _ in _flat(policy.trainable_parameters())]
    assert trainable and all(k.rsplit(".", 1)[-1] in ("lora_a", "lora_b") for k in trainable)
    # 2 blocks x 7 linear layers, each with lora_a and lora_b.
    assert len(trainable) == 2 * 7 * 2
    ids = _batch(policy.tokenizer, TEXTS)
    policy.eval()
    assert mx.array_equal(policy(ids), base(ids)).item()  # lora_b starts at zero

    before = _numpy_params(policy)
    losses = _train_lora_steps(policy, ids)
    after = _numpy_params(policy)
    assert losses[-1] < losses[0]
    for name in before:
        changed = not np.array_equal(before[name], after[name])
        is_adapter = name.rsplit(".", 1)[-1] in ("lora_a", "lora_b")
        assert changed == is_adapter, name
    assert all(np.abs(after[k]).max() > 0 for k in trainable if k.endswith("lora_b"))

    policy.eval()
    assert not np.allclose(np.array(policy(ids)), np.array(base(ids)), atol=1e-3)
    reference = ReferenceModel.from_policy(policy)
    assert reference.shares_policy_weights
    policy.train()  # dropout on: the reference must still be exactly the base model
    assert mx.array_equal(reference(ids), base(ids)).item()
    # The adapters are back afterwards, and the policy is still in train mode.
    assert policy.training and len(lora_modules(policy.model)) == 14
    policy.eval()
    assert not np.allclose(np.array(policy(ids)), np.array(base(ids)), atol=1e-3)


def test_reference_logits_carry_no_gradient(tiny_model_dir: Path) -> None:
    mx.random.seed(1)
    policy = PolicyModel.from_pretrained(tiny_model_dir, lora=LoraSettings(4, 8.0, 0.0))
    ids = _batch(policy.tokenizer, TEXTS)
    _train_lora_steps(policy, ids, steps=1)  # lora_b != 0, so the gradients are not trivial
    reference = ReferenceModel.from_policy(policy)

    def with_ref(model: PolicyModel, x: mx.array) -> mx.array:
        return (model(x) * reference(x)).sum()

    def with_const(model: PolicyModel, x: mx.array, ref_logits: mx.array) -> mx.array:
        return (model(x) * ref_logits).sum()

    _, grads = nn.value_and_grad(policy, with_ref)(policy, ids)
    ref_logits = reference(ids)
    _, expected = nn.value_and_grad(policy, with_const)(policy, ids, ref_logits)
    for (name, g), (_, e) in zip(_flat(grads), _flat(expected)):
        assert np.allclose(np.array(g), np.array(e), rtol=1e-5, atol=1e-6), name


def test_adapters_disabled_is_exact_and_skips_dropout(tiny_model_dir: Path) -> None:
    mx.random.seed(2)
    base, _ = _load(str(tiny_model_dir))
    model, _ = _load(str(tiny_model_dir))
    apply_lora(model, LoraSettings(r=2, alpha=4.0, dropout=0.5))
    for _, module in lora_modules(model):
        module.lora_b = mx.random.normal(module.lora_b.shape) * 0.1
    ids = mx.array([[5, 17, 42, 99, 7]])
    model.train()
    # With dropout on and adapters on, two calls differ (so dropout is really active) ...
    assert not mx.array_equal(model(ids), model(ids)).item()
    # ... while the disabled model is the base, bit for bit, every time.
    with adapters_disabled(model) as inner:
        assert not inner.training
        assert mx.array_equal(inner(ids), base(ids)).item()
        assert mx.array_equal(inner(ids), base(ids)).item()
    assert model.training


def test_adapters_merged_compute_the_adapted_function_and_are_put_back(
    tiny_model_dir: Path,
) -> None:
    """Sampling's merged weights: the LoRA model's logits within float32 rounding, no random
    state drawn, every LoRA layer (and so every trainable adapter) back afterwards."""
    mx.random.seed(5)
    model, _ = _load(str(tiny_model_dir))
    apply_lora(model, LoraSettings(r=4, alpha=8.0, dropout=0.0))
    for _, module in lora_modules(model):
        module.lora_b = mx.random.normal(module.lora_b.shape) * 0.1
    model.eval()
    ids = mx.array([[5, 17, 42, 99, 7], [3, 8, 250, 11, 64]])
    adapted = model(ids)
    before = dict(lora_modules(model))
    state = np.array(cast(Any, mx.random.state)[0])
    with adapters_merged(model) as inner:
        assert not lora_modules(inner)  # all 14 layers merged: one linear layer each
        merged = inner(ids)
    assert np.array_equal(np.array(cast(Any, mx.random.state)[0]), state)
    assert np.allclose(np.array(merged), np.array(adapted), rtol=1e-5, atol=1e-5)
    after = dict(lora_modules(model))
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert mx.array_equal(model(ids), adapted).item()


def test_adapters_merged_keep_low_precision_and_quantized_bases(tiny_model_dir: Path) -> None:
    """A bfloat16 or 4-bit base keeps its LoRA layers: merging would round the adapter's update
    into the base's precision."""
    for quantize in (False, True):
        model, _ = _load(str(tiny_model_dir))
        if quantize:
            nn.quantize(model, group_size=64, bits=4)
        else:
            model.set_dtype(mx.bfloat16)
        apply_lora(model, LoraSettings(r=4, alpha=8.0, dropout=0.0))
        with adapters_merged(model) as inner:
            assert len(lora_modules(inner)) == 14


def test_training_a_quantized_base_on_the_cpu_warns_once(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """MLX's quantized matrix products are far slower than float32 ones on the CPU: a model
    that trains on quantized layers there says so, once per process; a float one says nothing."""
    import base_setup.lora_setup as lora_setup

    monkeypatch.setattr(lora_setup, "_warned_quantized_on_cpu", False)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.cpu))
    model, _ = _load(str(tiny_model_dir))
    with caplog.at_level("WARNING", logger="ppo_mlx"):
        lora_setup.warn_quantized_on_cpu(model, "the float model")
        assert caplog.records == []
        nn.quantize(model, group_size=64, bits=4)
        lora_setup.warn_quantized_on_cpu(model, "the 4-bit model")
        lora_setup.warn_quantized_on_cpu(model, "the 4-bit model again")
    assert [r.getMessage()[:46] for r in caplog.records] == [
        "the 4-bit model has quantized (4-/8-bit) layer"
    ]
    assert "--dequantize" in caplog.records[0].getMessage()


def test_reference_from_pretrained_is_frozen(tiny_model_dir: Path) -> None:
    reference = ReferenceModel.from_pretrained(tiny_model_dir, dtype="float32")
    assert not reference.shares_policy_weights
    assert _flat(reference.model.trainable_parameters()) == []
    policy = PolicyModel.from_pretrained(tiny_model_dir)
    ids = _batch(policy.tokenizer, TEXTS)
    assert mx.array_equal(reference(ids), policy(ids)).item()
    with pytest.raises(ValueError, match="from_pretrained"):
        ReferenceModel.from_policy(policy)  # full fine-tuning: no shared base


def test_lora_adapter_dir_reloads_with_mlx_lm(tiny_model_dir: Path, tmp_path: Path) -> None:
    mx.random.seed(3)
    settings = LoraSettings(r=4, alpha=16.0, dropout=0.05, num_layers=1, keys=["self_attn.q_proj"])
    policy = PolicyModel.from_pretrained(tiny_model_dir, lora=settings)
    assert [name for name, _ in lora_modules(policy.model)] == ["model.layers.1.self_attn.q_proj"]
    ids = _batch(policy.tokenizer, TEXTS)
    _train_lora_steps(policy, ids)
    policy.eval()
    expected = policy(ids)

    adapter_dir = policy.save_pretrained(tmp_path / "adapters")
    assert sorted(p.name for p in adapter_dir.iterdir()) == [
        "adapter_config.json",
        "adapters.safetensors",
    ]
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["fine_tune_type"] == "lora" and config["num_layers"] == 1
    assert config["lora_parameters"] == {
        "rank": 4,
        "scale": 4.0,  # alpha / r
        "dropout": 0.05,
        "keys": ["self_attn.q_proj"],
    }
    assert read_adapter_settings(adapter_dir) == settings

    model, _ = _load(str(tiny_model_dir), adapter_path=str(adapter_dir))
    assert mx.array_equal(model(ids), expected).item()
    resumed = PolicyModel.from_pretrained(tiny_model_dir, adapter_path=adapter_dir)
    assert resumed.lora == settings
    assert mx.array_equal(resumed(ids), expected).item()
    assert sorted(k for k, _ in _flat(resumed.trainable_parameters())) == [
        "model.model.layers.1.self_attn.q_proj.lora_a",
        "model.model.layers.1.self_attn.q_proj.lora_b",
    ]

    merged_dir = policy.save_pretrained(tmp_path / "merged", merged=True)
    merged, _ = _load(str(merged_dir))
    assert not lora_modules(merged)
    assert np.allclose(np.array(merged(ids)), np.array(expected), atol=1e-4)
    assert lora_modules(policy.model)  # saving merged did not fuse the live policy


def test_lora_settings() -> None:
    settings = LoraSettings(r=8, alpha=16.0, dropout=0.0)
    assert settings.scale == 2.0 and settings.num_layers == -1 and settings.keys is None
    cfg = SimpleNamespace(lora_r=4, lora_alpha=32, lora_dropout=0.1, lora_layers=2, lora_keys=None)
    assert LoraSettings.from_model_config(cfg) == LoraSettings(4, 32.0, 0.1, 2, None)
    with pytest.raises(ValueError, match="lora_alpha"):
        LoraSettings.from_model_config(SimpleNamespace(lora_r=4, lora_dropout=0.0))
    for bad in (dict(r=0), dict(alpha=-1.0), dict(dropout=1.0), dict(num_layers=0)):
        with pytest.raises(ValueError):
            LoraSettings(**{**dict(r=4, alpha=8.0, dropout=0.0), **bad})  # type: ignore[arg-type]


def test_apply_lora_rejects_bad_settings(tiny_model_dir: Path) -> None:
    model, _ = _load(str(tiny_model_dir))
    with pytest.raises(ValueError, match="blocks"):
        apply_lora(model, LoraSettings(4, 8.0, 0.0, num_layers=5))
    with pytest.raises(ValueError, match="no module matched"):
        apply_lora(model, LoraSettings(4, 8.0, 0.0, keys=["attn.nope"]))
    model, _ = _load(str(tiny_model_dir))
    apply_lora(model, LoraSettings(4, 8.0, 0.0))
    with pytest.raises(ValueError, match="already"):
        apply_lora(model, LoraSettings(4, 8.0, 0.0))


# --- tokenizer rules -----------------------------------------------------------------------------


def _word_tokenizer(tokens: list[str], eos: str, pad: str | None = None) -> Any:
    """A TokenizerWrapper over a word-level tokenizer with exactly ``tokens``."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=tokens[0]))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=eos, pad_token=pad)
    return TokenizerWrapper(hf)


def test_pad_token_rule() -> None:
    # The tokenizer's own pad token is kept, also when it is the EOS token (SmolLM2, Qwen2.5).
    tok = _word_tokenizer(["a", "b", "<eos>", "<pad>"], eos="<eos>", pad="<pad>")
    assert ensure_pad_token(tok) == 3
    tok = _word_tokenizer(["a", "b", "<eos>", "<pad>"], eos="<eos>", pad="<eos>")
    assert ensure_pad_token(tok) == 2 and tok.pad_token_id == 2
    # No pad token: an existing pad-like special token, else the EOS token; never a new token.
    tok = _word_tokenizer(["a", "<pad>", "<eos>"], eos="<eos>")
    assert ensure_pad_token(tok) == 1 and tok.pad_token == "<pad>"
    tok = _word_tokenizer(["a", "b", "<eos>"], eos="<eos>")
    assert ensure_pad_token(tok, vocab_size=3) == 2 and tok.pad_token == "<eos>"
    assert len(tok) == 3
    # A pad id without an embedding row is not kept.
    tok = _word_tokenizer(["a", "b", "<eos>", "<pad>"], eos="<eos>", pad="<pad>")
    assert ensure_pad_token(tok, vocab_size=3) == 2
    # Neither pad nor EOS: an actionable error.
    tok = _word_tokenizer(["a", "b", "c"], eos="c")
    with pytest.raises(ValueError, match="no pad token and no EOS token"):
        ensure_pad_token(tok, vocab_size=2)


def test_apply_chat_template(tiny_model_dir: Path) -> None:
    tok = PolicyModel.from_pretrained(tiny_model_dir).tokenizer
    messages = [{"role": "user", "content": "Review the camera."}]
    ids = apply_chat_template(tok, messages)
    expected = "<|im_start|>user\nReview the camera.<|im_end|>\n<|im_start|>assistant\n"
    assert ids == tok.encode(expected)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    no_prompt = apply_chat_template(tok, messages, add_generation_prompt=False)
    assert no_prompt == tok.encode("<|im_start|>user\nReview the camera.<|im_end|>\n")
    with pytest.raises(ValueError, match="chat template"):
        apply_chat_template(_word_tokenizer(["a", "<eos>"], eos="<eos>"), messages)


def test_logits_at_positions_equal_the_full_forward(tiny_model_dir: Path) -> None:
    """PolicyModel/ReferenceModel.logits_at run the LM head on the gathered rows only, and give
    the full forward pass's logits there; a model whose logits are not head(backbone) (here:
    scaled) is detected and takes the full pass."""
    from models.policy_model import lm_logits_at

    policy = PolicyModel.from_pretrained(tiny_model_dir)
    tokens = mx.array(np.random.default_rng(0).integers(0, 500, (3, 9)))
    positions = mx.array([[0, 4, 8], [2, 2, 3], [7, 5, 1]])
    full = policy(tokens)  # (B, L, V)
    want = np.take_along_axis(np.array(full), np.array(positions)[..., None], axis=1)
    np.testing.assert_allclose(np.array(policy.logits_at(tokens, positions)), want, atol=1e-5)
    reference = ReferenceModel.from_pretrained(tiny_model_dir)
    np.testing.assert_allclose(np.array(reference.logits_at(tokens, positions)), want, atol=1e-5)

    class Scaled(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.model = inner.model
            self.inner = inner

        def __call__(self, x: mx.array) -> mx.array:
            return 2.0 * self.inner(x)

    scaled = Scaled(policy.model)
    np.testing.assert_allclose(
        np.array(lm_logits_at(scaled, tokens, positions)), 2.0 * want, rtol=1e-5, atol=1e-5
    )
    assert scaled.__dict__["_ppo_mlx_split_head_ok"] is False  # checked once, then kept


def test_a_model_folder_without_tokenizer_files_is_named(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    import shutil

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / name, bare / name)
    with pytest.raises(FileNotFoundError, match="has no tokenizer files"):
        PolicyModel.from_pretrained(bare)


def test_response_logprobs_from_hidden_states_equal_the_logits_path(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A LoRA policy's frozen head takes the blockwise path (no logits_at call) with the same
    log-probs and LoRA gradients as the logits path; the reference (adapters off) gives the
    base's; a fully trained policy's head is trainable and keeps the logits path, whose
    gradient reaches the head's weight."""
    from token_attribution.sequences import response_logprobs, token_logprobs

    tokens = mx.array(np.random.default_rng(0).integers(0, 500, (2, 9)))
    positions = mx.array([[3, 4, 5, 6], [4, 5, 6, 7]])
    responses = mx.array(np.random.default_rng(1).integers(0, 500, (2, 4)))
    policy = PolicyModel.from_pretrained(tiny_model_dir, lora=LoraSettings(4, 8.0, 0.0))
    nonzero_b = [  # non-zero adapters, so the policy differs from the base
        (name, mx.full(param.shape, 0.05))
        for name, param in _flat(policy.model.trainable_parameters())
        if name.endswith("lora_b")
    ]
    policy.model.update(tree_unflatten(nonzero_b))
    reference = ReferenceModel.from_policy(policy)

    def naive_loss(model: nn.Module) -> mx.array:
        return token_logprobs(policy.logits_at(tokens, positions), responses, 0.8)[0].sum()

    def fused_loss(model: nn.Module) -> mx.array:
        return response_logprobs(policy, tokens, positions, responses, 0.8)[0].sum()

    want, want_grads = nn.value_and_grad(policy.model, naive_loss)(policy.model)
    calls = []
    monkeypatch.setattr(policy, "logits_at", lambda *a: calls.append(a))
    got, got_grads = nn.value_and_grad(policy.model, fused_loss)(policy.model)
    assert not calls  # the blockwise path
    np.testing.assert_allclose(got.item(), want.item(), rtol=1e-5)
    for (name, g), (_, w) in zip(_flat(got_grads), _flat(want_grads)):
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-3, atol=1e-6, err_msg=name)
    monkeypatch.undo()

    base_lp, _ = response_logprobs(reference, tokens, positions, responses, differentiable=False)
    want_base = token_logprobs(reference.logits_at(tokens, positions), responses)[0]
    np.testing.assert_allclose(np.array(base_lp), np.array(want_base), atol=1e-5)
    policy_lp, _ = response_logprobs(policy, tokens, positions, responses, differentiable=False)
    assert policy_lp.shape == (2, 4)
    assert not np.allclose(np.array(base_lp), np.array(policy_lp), atol=1e-4)

    full = PolicyModel.from_pretrained(tiny_model_dir)
    grads = nn.value_and_grad(
        full.model,
        lambda m: response_logprobs(full, tokens, positions, responses)[0].sum(),
    )(full.model)[1]
    head_grads = [g for name, g in _flat(grads) if "embed_tokens" in name or "lm_head" in name]
    assert head_grads and all(float(mx.abs(g).max()) > 0 for g in head_grads)
