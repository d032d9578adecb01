"""The tokenizer that goes with a model: mlx-lm's ``TokenizerWrapper``, with a pad token.

Choice: the tokenizer is mlx-lm's :class:`~mlx_lm.tokenizer_utils.TokenizerWrapper` (what
``mlx_lm.load`` returns). It forwards every attribute to the Hugging Face tokenizer it wraps, so the
trainer has ``encode``, ``decode``, ``batch_decode``, ``pad_token_id`` and ``apply_chat_template``
as in transformers, and it adds ``eos_token_ids``: the *set* of end ids, including the ones only
``generation_config.json`` names (end-of-turn tokens of chat models), which a bare HF tokenizer
misses.

Pad token rule (:func:`ensure_pad_token`), in order:

1. the tokenizer's own pad token, if it has one and it is not an EOS id;
2. else an existing, dedicated pad or reserved special token of the vocabulary
   (:data:`PAD_TOKEN_CANDIDATES`, e.g. ``<|pad|>``, ``<|finetune_right_pad_id|>``);
3. else a new special token ``<|pad|>``, if the model's embedding has a free row for it
   (``vocab_size`` from config.json > ``len(tokenizer)``, as in most checkpoints, whose embedding
   is rounded up), so no embedding is resized;
4. else ``ValueError``, naming the ways out.

Pad is never silently made equal to EOS. This library builds every mask from lengths, never from
``ids != pad_token_id``, but pad == eos would still break any code that does: the real EOS at the
end of a response would be masked out (the policy would get no gradient for stopping, and the KL
and value terms would skip that token), a reward model that reads "the last non-pad token" would
score the token before EOS, and lengths recovered from padded ids would be off by one for every
sequence that stopped.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

logger = logging.getLogger("ppo_mlx")

#: Existing special tokens that may serve as pad (rule 2), in order of preference.
PAD_TOKEN_CANDIDATES: tuple[str, ...] = (
    "<|pad|>",
    "<pad>",
    "[PAD]",
    "<|padding|>",
    "<|finetune_right_pad_id|>",
    "<|reserved_special_token_0|>",
)
#: The token added by rule 3.
NEW_PAD_TOKEN = "<|pad|>"


def eos_token_ids(tokenizer: Any) -> list[int]:
    """All end-of-sequence ids, sorted: the wrapper's set, or the HF tokenizer's single id."""
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        single = getattr(tokenizer, "eos_token_id", None)
        ids = set() if single is None else {single}
    return sorted(int(i) for i in ids)


def ensure_pad_token(
    tokenizer: Any, *, vocab_size: int | None = None, pad_token: str | None = None
) -> int:
    """Make sure ``tokenizer`` has a pad token distinct from every EOS id; return its id.

    Args:
        tokenizer: a ``TokenizerWrapper`` (or a Hugging Face tokenizer); changed in place.
        vocab_size: rows of the model's embedding. Needed for rule 3 (adding a new token); with
            ``None`` rule 3 is skipped.
        pad_token: use this existing token as pad instead of the rule (it must be in the
            vocabulary and not an EOS token).

    Raises:
        ValueError: no pad token distinct from EOS can be found or added (see module docstring).
    """
    eos = set(eos_token_ids(tokenizer))
    vocab: dict[str, int] = tokenizer.get_vocab()

    if pad_token is not None:
        if pad_token not in vocab:
            raise ValueError(f"pad_token {pad_token!r} is not in the tokenizer's vocabulary")
        if vocab[pad_token] in eos:
            raise ValueError(f"pad_token {pad_token!r} is an EOS token; choose another token")
        tokenizer.pad_token = pad_token
        return int(vocab[pad_token])

    current = tokenizer.pad_token_id
    if current is not None and current not in eos:  # rule 1
        return int(current)

    for candidate in PAD_TOKEN_CANDIDATES:  # rule 2
        if candidate in vocab and vocab[candidate] not in eos:
            logger.info("pad token: reusing %s (id %d)", candidate, vocab[candidate])
            tokenizer.pad_token = candidate
            return int(vocab[candidate])

    n_tokens = len(tokenizer)
    if vocab_size is not None and n_tokens < vocab_size:  # rule 3
        tokenizer.add_special_tokens({"pad_token": NEW_PAD_TOKEN})
        pad_id = int(tokenizer.pad_token_id)
        if pad_id >= vocab_size:
            raise ValueError(f"added {NEW_PAD_TOKEN} got id {pad_id} >= vocab_size {vocab_size}")
        logger.info("pad token: added %s (id %d, a free embedding row)", NEW_PAD_TOKEN, pad_id)
        return pad_id

    why = "is the EOS token" if current is not None else "is missing"
    raise ValueError(
        f"the tokenizer's pad token {why}, the vocabulary has none of {list(PAD_TOKEN_CANDIDATES)}, "
        f"and the model's embedding has no free row (vocab_size={vocab_size}, "
        f"len(tokenizer)={n_tokens}). Pass pad_token=<an unused special token of this "
        "vocabulary> to ensure_pad_token, or resize the model's embedding and add a pad token. "
        "Pad must differ from EOS: code that masks with ids != pad would mask the real EOS."
    )


def load_tokenizer(path: str | Path, *, pad_token: str | None = None) -> Any:
    """Load the tokenizer of the model at ``path`` (a local directory) with a pad token.

    EOS ids come from config.json and generation_config.json as mlx-lm reads them; the pad token
    follows the rule of :func:`ensure_pad_token` with the model's ``vocab_size`` from config.json.
    Returns an mlx-lm ``TokenizerWrapper``.

    Raises:
        FileNotFoundError: ``path`` is not a directory with a config.json.
        ValueError: no pad token distinct from EOS (see :func:`ensure_pad_token`).
    """
    from mlx_lm.utils import load_config
    from mlx_lm.utils import load_tokenizer as _mlx_load_tokenizer

    model_path = Path(path)
    if not (model_path / "config.json").is_file():
        raise FileNotFoundError(
            f"no model directory with a config.json at {model_path}; pass the directory of a "
            "Hugging Face or mlx-lm checkpoint"
        )
    config = load_config(model_path)
    tokenizer = _mlx_load_tokenizer(model_path, eos_token_ids=config.get("eos_token_id"))
    vocab_size = config.get("vocab_size", config.get("text_config", {}).get("vocab_size"))
    ensure_pad_token(tokenizer, vocab_size=vocab_size, pad_token=pad_token)
    return tokenizer


def _check_chat(tokenizer: Any, messages: Sequence[dict[str, str]]) -> None:
    has_template = getattr(tokenizer, "has_chat_template", None)
    if has_template is None:
        has_template = getattr(tokenizer, "chat_template", None) is not None
    if not has_template:
        raise ValueError(
            "this tokenizer has no chat template (a base model?); encode a plain-text prompt "
            "instead, or load an instruct/chat checkpoint whose tokenizer_config.json has one"
        )
    if not messages:
        raise ValueError("messages is empty; pass at least one {'role': ..., 'content': ...}")


def apply_chat_template(
    tokenizer: Any, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of ``messages`` (``[{"role": ..., "content": ...}, ...]``) in the chat format.

    With ``add_generation_prompt`` the ids end with the header of an assistant turn, ready for
    generation. Raises ``ValueError`` if the tokenizer has no chat template (base models): build the
    prompt text yourself and ``encode`` it instead.
    """
    _check_chat(tokenizer, messages)
    ids = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=add_generation_prompt, tokenize=True
    )
    if isinstance(ids, dict):  # some tokenizers return a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def chat_template_text(
    tokenizer: Any, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True
) -> str:
    """The chat-formatted text of ``messages`` (what :func:`apply_chat_template` tokenises)."""
    _check_chat(tokenizer, messages)
    text = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=add_generation_prompt, tokenize=False
    )
    return str(text)
