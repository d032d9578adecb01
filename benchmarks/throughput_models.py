"""The benchmark's checkpoints and prompts: a random-weight policy, a reward model that shares its
backbone, both in Hugging Face layout, so that MLX and TRL load the same weights.

Two kinds of policy:

* the tiny sizes (:class:`fixtures.tiny_model.TinyModelSpec`): qwen3 checkpoints of
  :func:`fixtures.tiny_model.build_checkpoint`;
* the real shapes (:class:`RealShape`): the architecture of a published model (its config.json's
  sizes, vocabulary included), written by :func:`build_real_checkpoint` with transformers' own
  config class and random float32 weights.

The review corpus (:mod:`fixtures.tiny_corpus`) only supports a byte-level BPE of about 900 tokens,
so :func:`pad_tokenizer` fills the vocabulary up to the model's size with plain added tokens
``<|extra_k|>``. They decode to text and re-encode to the same single ids, so a system that
re-tokenises completions (TRL's GRPO reward path does) sees sequences of the generated length.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np

from fixtures.tiny_corpus import review_corpus
from fixtures.tiny_model import (
    EOS_TOKEN,
    IM_END_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    TinyModelSpec,
    build_checkpoint,
    train_tokenizer,
    write_tokenizer_files,
)

POLICY_DIR = "policy"
REWARD_DIR = "reward"


@dataclass(frozen=True)
class RealShape:
    """The architecture of a published checkpoint, as its config.json gives it, to build with
    random weights (:func:`build_real_checkpoint`).

    Attributes:
        source: the Hugging Face repository whose config.json the sizes copy (nothing is
            downloaded; the name is for the reader).
        model_type: "llama" or "qwen3" (transformers' config class that writes config.json).
        vocab_size, hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
        head_dim, intermediate_size, max_position_embeddings, rope_theta, rms_norm_eps,
        tie_word_embeddings: as in that config.json.
    """

    source: str
    model_type: Literal["llama", "qwen3"]
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool = True


#: The BPE size asked of the review corpus before padding (it reaches about 900 ids).
REAL_BPE_VOCAB = 2048


def pad_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """Grow the tokenizer.json of ``model_dir`` to ``vocab_size`` ids with added (non-special)
    tokens ``<|extra_k|>``, in place; one already of that size is left alone.

    Raises:
        ValueError: the tokenizer already has more than ``vocab_size`` ids.
    """
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    have = tokenizer.get_vocab_size(with_added_tokens=True)
    if have > vocab_size:
        raise ValueError(f"the tokenizer in {model_dir} has {have} ids, more than {vocab_size}")
    if have < vocab_size:
        extra = [AddedToken(f"<|extra_{i}|>", special=False) for i in range(vocab_size - have)]
        tokenizer.add_tokens(extra)
        if tokenizer.get_vocab_size(with_added_tokens=True) != vocab_size:
            raise ValueError(f"could not pad the tokenizer in {model_dir} to {vocab_size} ids")
        tokenizer.save(str(model_dir / "tokenizer.json"), pretty=True)


def pad_vocabulary(model_dir: Path, vocab_size: int, *, seed: int) -> None:
    """Grow a checkpoint's tokenizer and embedding to ``vocab_size`` ids, in place.

    The tokenizer gets added tokens (:func:`pad_tokenizer`), the embedding (tied, so also the LM
    head) gets rows drawn like the others, N(0, (2.5/sqrt(D))^2), and config.json's
    ``vocab_size`` is set. A checkpoint already of that size is left alone.

    Raises:
        ValueError: the tokenizer already has more than ``vocab_size`` ids.
    """
    from safetensors.numpy import load_file, save_file

    pad_tokenizer(model_dir, vocab_size)
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    weights = load_file(str(model_dir / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]  # (V_have, D)
    if embed.shape[0] < vocab_size:
        rng = np.random.default_rng(seed)
        hidden = embed.shape[1]
        rows = rng.normal(0.0, 2.5 / np.sqrt(hidden), size=(vocab_size - embed.shape[0], hidden))
        weights["model.embed_tokens.weight"] = np.concatenate(
            [embed, rows.astype(np.float32)], axis=0
        )  # (V, D)
        save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    config["vocab_size"] = vocab_size
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def real_config(shape: RealShape) -> Any:
    """transformers' ``LlamaConfig`` / ``Qwen3Config`` of ``shape``, float32, with the special
    token ids of :mod:`fixtures.tiny_model`'s tokenizer (EOS 0, pad 1)."""
    import transformers

    classes = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}
    architectures = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    eos_id = SPECIAL_TOKENS.index(EOS_TOKEN)
    config = classes[shape.model_type](
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=shape.rms_norm_eps,
        rope_theta=shape.rope_theta,
        tie_word_embeddings=shape.tie_word_embeddings,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=SPECIAL_TOKENS.index(PAD_TOKEN),
        dtype="float32",
    )
    config.architectures = [architectures[shape.model_type]]
    return config


def _random_weights(config: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Random float32 weights of every parameter of the mlx-lm model of ``config`` (Hugging
    Face names), scaled as :mod:`fixtures.tiny_model`'s: norms 1, embedding N(0, (2.5/sqrt(D))^2),
    linear weights N(0, 4/fan_in)."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from models.checkpoint_config import config_updates

    mlx_config = {**config, **config_updates(config)}
    model_class, args_class = _get_classes(mlx_config)
    model = model_class(args_class.from_dict(mlx_config))  # lazy: only the shapes are read
    flat = cast(list[tuple[str, Any]], tree_flatten(model.parameters()))
    shapes = {name: tuple(p.shape) for name, p in flat}
    del model, flat
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if len(shape) == 1:  # a norm's scale
            weights[name] = np.ones(shape, dtype=np.float32)
            continue
        if name.endswith("embed_tokens.weight"):
            std = 2.5 / np.sqrt(config["hidden_size"])
        else:  # a Linear weight (out, in)
            std = 2.0 / np.sqrt(shape[-1])
        value = rng.standard_normal(size=shape, dtype=np.float32)
        value *= np.float32(std)
        weights[name] = value
    return weights


def build_real_checkpoint(out_dir: Path, shape: RealShape, *, seed: int = 0) -> Path:
    """Write a random-weight checkpoint of a published architecture to ``out_dir``.

    config.json is written by transformers' config class of ``shape.model_type``
    (``save_pretrained``: what current transformers writes, ``rope_parameters`` included),
    float32; the tokenizer is :mod:`fixtures.tiny_model`'s byte-level BPE (ChatML specials at
    ids 0-3) padded to ``shape.vocab_size`` (:func:`pad_tokenizer`); the weights are float32
    (:func:`_random_weights`), tied embeddings as the shape says. Loads with our loader, mlx-lm
    and transformers' ``AutoModelForCausalLM``.
    """
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(REAL_BPE_VOCAB, seed=seed)
    write_tokenizer_files(out, tokenizer, model_max_length=shape.max_position_embeddings)
    pad_tokenizer(out, shape.vocab_size)
    config = real_config(shape)
    config.save_pretrained(str(out))
    eos_ids = [SPECIAL_TOKENS.index(EOS_TOKEN), SPECIAL_TOKENS.index(IM_END_TOKEN)]
    generation = {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos_ids,
        "pad_token_id": config.pad_token_id,
    }
    (out / "generation_config.json").write_text(
        json.dumps(generation, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
    weights = _random_weights(config.to_dict(), seed)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def build_benchmark_checkpoints(
    out_dir: Path, spec: TinyModelSpec | RealShape, *, seed: int = 0
) -> tuple[Path, Path]:
    """Write the policy and the reward checkpoint for one model size; returns their directories.

    The policy is :func:`fixtures.tiny_model.build_checkpoint` of a tiny ``spec`` with the
    vocabulary padded to ``spec.vocab_size``, or :func:`build_real_checkpoint` of a real shape.
    The reward checkpoint is its backbone with a random ``N(0, 1/(D+1))`` scalar head, written by
    ``RewardModel.save_pretrained`` as a one-label ``<Arch>ForSequenceClassification``
    (``Qwen3ForSequenceClassification``, ``LlamaForSequenceClassification``; transformers'
    AutoModelForSequenceClassification loads it); both systems also start their value model
    from it.
    """
    from models.reward_model import RewardModel

    if isinstance(spec, RealShape):
        policy_dir = build_real_checkpoint(out_dir / POLICY_DIR, spec, seed=seed)
    else:
        policy_dir = build_checkpoint(out_dir / POLICY_DIR, replace(spec), seed=seed)
        pad_vocabulary(policy_dir, spec.vocab_size, seed=seed + 1)
    reward = RewardModel.from_causal_lm(policy_dir, head_init="normal", seed=seed + 2)
    reward_dir = reward.save_pretrained(out_dir / REWARD_DIR)
    del reward
    import mlx.core as mx

    mx.clear_cache()  # this process goes on while the workers run: keep no freed buffers
    return policy_dir, reward_dir


def benchmark_prompts(policy_dir: Path, n: int, *, seed: int = 0) -> list[str]:
    """``n`` prompt texts of about 14 tokens (12 to 16, 14 on average), cut from reviews.

    Prompt ``i`` is the decoded first ``12 + i % 5`` tokens of the next review of the corpus that
    is long enough, so prompt lengths differ (both systems then left-pad) and the texts
    round-trip through the tokenizer.
    """
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(policy_dir / "tokenizer.json"))
    prompts: list[str] = []
    for review in review_corpus(20 * n + 100, seed=seed):
        ids = tokenizer.encode(review.text, add_special_tokens=False).ids
        length = 12 + len(prompts) % 5
        if len(ids) >= length:
            prompts.append(tokenizer.decode(ids[:length]))
        if len(prompts) == n:
            return prompts
    raise ValueError(f"the review corpus has fewer than {n} reviews of 16 tokens or more")
