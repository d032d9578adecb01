"""An embedded tiny causal LM, written as a real Hugging Face checkpoint (nothing is downloaded).

:func:`build_tiny_checkpoint` trains a byte-level BPE tokenizer on :mod:`models.tiny_corpus` and
writes a random-weight model of mlx-lm's ``qwen3`` architecture in the on-disk layout of a Hugging
Face checkpoint::

    config.json                model_type "qwen3", architectures ["Qwen3ForCausalLM"], token ids
    generation_config.json     eos ids (end-of-text and end-of-turn)
    model.safetensors          float32 weights under Hugging Face names (tied embeddings)
    tokenizer.json             the trained tokenizer (tokenizers library format)
    tokenizer_config.json      special tokens and a ChatML chat template
    special_tokens_map.json
    .tiny_checkpoint.json      stamp: what was built (size, seed, format); written last

The directory loads with ``mlx_lm.load(dir)`` and with transformers' ``AutoTokenizer`` /
``AutoModelForCausalLM``. Tests, the demo and the benchmarks use it.

Special tokens (ids 0-3): ``<|endoftext|>`` (EOS, also the config's BOS id as in Qwen, but never
prepended), ``<|pad|>`` (PAD, distinct from EOS), ``<|im_start|>`` and ``<|im_end|>`` (chat turns;
``<|im_end|>`` is also an EOS id in generation_config.json).

The weights are random but scaled so the model is not trivial: linear weights are drawn from
N(0, 4/fan_in), so every block changes the residual stream a lot, and the tied embeddings from
N(0, (2.5/sqrt(hidden))^2), so the logits have a standard deviation near 2.5: peaked,
context-dependent next-token distributions, rather than near-uniform ones (HF's 0.02 init) or a
copy of the last token (what a tied embedding alone predicts), and greedy continuations that do not
collapse into one repeated token at once.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np

from models.tiny_corpus import review_corpus

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (EOS_TOKEN, PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN)

#: ChatML, as Qwen models use it (without the system-prompt default).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_STAMP_FILE = ".tiny_checkpoint.json"
_FORMAT_VERSION = 2
CHECKPOINT_FILES: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a tiny qwen3 checkpoint and of its tokenizer.

    Attributes:
        vocab_size: BPE vocabulary size asked of the trainer (the model's ``vocab_size`` is the
            size the tokenizer actually reaches, so every embedding row decodes to text).
        hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
        intermediate_size: as in transformers' ``Qwen3Config``.
        max_position_embeddings: the context length written to the config.
        corpus_size: how many reviews the tokenizer is trained on.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int = 2048
    corpus_size: int = 3000


TINY_SIZES: dict[str, TinyModelSpec] = {
    # about 0.14M parameters: fast enough for every unit test.
    "test": TinyModelSpec(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
    ),
    # about 3.4M parameters: the demo's policy, small enough to train on a laptop CPU.
    "demo": TinyModelSpec(
        vocab_size=1024,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        intermediate_size=768,
    ),
}


def _train_tokenizer(spec: TinyModelSpec, seed: int) -> Any:
    """A byte-level BPE tokenizer (``tokenizers.Tokenizer``) trained on the review corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [review.text for review in review_corpus(spec.corpus_size, seed=seed)]
    tokenizer.train_from_iterator(texts, trainer=trainer)
    for token_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != token_id:
            raise ValueError(f"special token {token} did not get id {token_id}")
    return tokenizer


def _hf_config(spec: TinyModelSpec, vocab_size: int) -> dict[str, Any]:
    """config.json as transformers writes it for ``Qwen3ForCausalLM`` (and mlx-lm reads it)."""
    eos_id = SPECIAL_TOKENS.index(EOS_TOKEN)
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": eos_id,
        "dtype": "float32",
        "eos_token_id": eos_id,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "layer_types": ["full_attention"] * spec.num_hidden_layers,
        "max_position_embeddings": spec.max_position_embeddings,
        "max_window_layers": spec.num_hidden_layers,
        "model_type": "qwen3",
        "num_attention_heads": spec.num_attention_heads,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_key_value_heads": spec.num_key_value_heads,
        "pad_token_id": SPECIAL_TOKENS.index(PAD_TOKEN),
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }


def _random_weights(config: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Random float32 weights for every parameter of mlx-lm's qwen3 ``Model`` (HF names)."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3

    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    flat = cast(list[tuple[str, Any]], tree_flatten(model.parameters()))
    shapes = {name: tuple(p.shape) for name, p in flat}
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            value = np.ones(shape)
        elif name == "model.embed_tokens.weight":
            value = rng.normal(0.0, 2.5 / np.sqrt(config["hidden_size"]), size=shape)
        else:  # a Linear weight of shape (out, in)
            value = rng.normal(0.0, 2.0 / np.sqrt(shape[-1]), size=shape)
        weights[name] = np.ascontiguousarray(value, dtype=np.float32)
    return weights


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _is_complete(out_dir: Path, stamp: dict[str, Any]) -> bool:
    stamp_path = out_dir / _STAMP_FILE
    if not stamp_path.is_file() or not all((out_dir / f).is_file() for f in CHECKPOINT_FILES):
        return False
    try:
        return bool(json.loads(stamp_path.read_text(encoding="utf-8")) == stamp)
    except json.JSONDecodeError:
        return False


def build_checkpoint(out_dir: str | Path, spec: TinyModelSpec, *, seed: int = 0) -> Path:
    """Write a random-weight qwen3 checkpoint of shape ``spec`` to ``out_dir`` and return its path.

    Deterministic: the same ``(spec, seed)`` writes byte-identical files. If ``out_dir`` already
    holds a complete checkpoint stamped with the same ``(spec, seed)`` it is returned untouched;
    any other content of those file names is overwritten.
    """
    if spec.hidden_size <= 0 or spec.num_hidden_layers <= 0 or spec.vocab_size < 300:
        raise ValueError(
            f"invalid TinyModelSpec {spec}: sizes must be positive and vocab_size >= 300 "
            "(256 byte tokens + special tokens + merges)"
        )
    if spec.num_attention_heads % spec.num_key_value_heads != 0:
        raise ValueError(
            f"num_attention_heads ({spec.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({spec.num_key_value_heads})"
        )
    out = Path(out_dir)
    stamp = {"format": _FORMAT_VERSION, "seed": seed, "spec": asdict(spec)}
    if _is_complete(out, stamp):
        return out
    out.mkdir(parents=True, exist_ok=True)
    (out / _STAMP_FILE).unlink(missing_ok=True)

    tokenizer = _train_tokenizer(spec, seed)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    config = _hf_config(spec, vocab_size)
    weights = _random_weights(config, seed)

    from safetensors.numpy import save_file

    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": config["bos_token_id"],
            "eos_token_id": [SPECIAL_TOKENS.index(EOS_TOKEN), SPECIAL_TOKENS.index(IM_END_TOKEN)],
            "pad_token_id": config["pad_token_id"],
        },
    )
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    added_tokens_decoder = {
        str(i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, token in enumerate(SPECIAL_TOKENS)
    }
    _write_json(
        out / "tokenizer_config.json",
        {
            "add_bos_token": False,
            "add_prefix_space": False,
            "added_tokens_decoder": added_tokens_decoder,
            "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
            "bos_token": None,
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "eos_token": EOS_TOKEN,
            "errors": "replace",
            "model_max_length": spec.max_position_embeddings,
            "pad_token": PAD_TOKEN,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "unk_token": None,
        },
    )
    _write_json(
        out / "special_tokens_map.json",
        {
            "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
        },
    )
    _write_json(out / _STAMP_FILE, stamp)  # last: its presence means the rest is complete
    return out


def build_tiny_checkpoint(
    out_dir: str | Path, *, size: Literal["test", "demo"] = "test", seed: int = 0
) -> Path:
    """Build (or reuse) the embedded tiny checkpoint of the given size in ``out_dir``.

    ``size="test"`` is a ~0.14M-parameter model with a 512-token vocabulary (builds in well under
    a second); ``size="demo"`` a ~3.4M-parameter model with a 1024-token vocabulary. See the
    module docstring for the layout; :func:`build_checkpoint` for reuse and determinism.
    """
    if size not in TINY_SIZES:
        raise ValueError(f"size must be one of {sorted(TINY_SIZES)}, got {size!r}")
    return build_checkpoint(out_dir, TINY_SIZES[size], seed=seed)
