"""The benchmark's checkpoints and prompts: a random-weight qwen3 policy, a reward model that
shares its backbone, both in Hugging Face layout, so that MLX and TRL load the same weights.

The review corpus (:mod:`fixtures.tiny_corpus`) only supports a byte-level BPE of about 900 tokens,
so :func:`pad_vocabulary` fills the vocabulary up to the benchmark's size with plain added tokens
``<|extra_k|>``. They decode to text and re-encode to the same single ids, so a system that
re-tokenises completions (TRL's GRPO reward path does) sees sequences of the generated length.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from fixtures.tiny_corpus import review_corpus
from fixtures.tiny_model import TinyModelSpec, build_checkpoint

POLICY_DIR = "policy"
REWARD_DIR = "reward"


def pad_vocabulary(model_dir: Path, vocab_size: int, *, seed: int) -> None:
    """Grow a checkpoint's tokenizer and embedding to ``vocab_size`` ids, in place.

    The tokenizer gets added (non-special) tokens ``<|extra_k|>`` for the missing ids, the
    embedding (tied, so also the LM head) gets rows drawn like the others, N(0, (2.5/sqrt(D))^2),
    and config.json's ``vocab_size`` is set. A checkpoint already of that size is left alone.

    Raises:
        ValueError: the tokenizer already has more than ``vocab_size`` ids.
    """
    from safetensors.numpy import load_file, save_file
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


def build_benchmark_checkpoints(
    out_dir: Path, spec: TinyModelSpec, *, seed: int = 0
) -> tuple[Path, Path]:
    """Write the policy and the reward checkpoint for one model size; returns their directories.

    The policy is :func:`fixtures.tiny_model.build_checkpoint` of ``spec`` with the vocabulary
    padded to ``spec.vocab_size``. The reward checkpoint is its backbone with a random
    ``N(0, 1/(D+1))`` scalar head, written by ``RewardModel.save_pretrained`` as a one-label
    ``Qwen3ForSequenceClassification`` (transformers' AutoModelForSequenceClassification loads
    it); both systems also start their value model from it.
    """
    from models.reward_model import RewardModel

    policy_dir = build_checkpoint(out_dir / POLICY_DIR, replace(spec), seed=seed)
    pad_vocabulary(policy_dir, spec.vocab_size, seed=seed + 1)
    reward = RewardModel.from_causal_lm(policy_dir, head_init="normal", seed=seed + 2)
    reward_dir = reward.save_pretrained(out_dir / REWARD_DIR)
    del reward
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
