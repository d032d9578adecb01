"""The tokenizer that goes with a model: mlx-lm's ``TokenizerWrapper``, made ready for training.

Choice: the tokenizer is mlx-lm's :class:`~mlx_lm.tokenizer_utils.TokenizerWrapper` (what
``mlx_lm.load`` returns). It forwards every attribute to the Hugging Face tokenizer it wraps, so the
trainer has ``encode``, ``decode``, ``batch_decode``, ``pad_token_id`` and ``apply_chat_template``
as in transformers, and it adds ``eos_token_ids``: the *set* of end ids, including the ones only
``generation_config.json`` names, which a bare HF tokenizer misses.

:func:`load_tokenizer` takes checkpoints as they are shipped and changes nothing in the vocabulary:

* **End ids.** ``eos_token_ids`` holds the config's and generation config's EOS ids plus the chat
  template's end-of-turn token (:func:`end_of_turn_token_id`), e.g. ``<|im_end|>`` of a ChatML base
  model whose ``eos_token`` is ``<|endoftext|>``: a response to a chat prompt ends there, so
  nothing after the turn is scored or trained.
* **Pad** (:func:`ensure_pad_token`): the tokenizer's own pad token, even when it is an EOS token
  (SmolLM2, Qwen2.5 base); else an existing pad-like special token; else the EOS token (GPT-2,
  Llama-2 and Mistral ship none). Never a new token, so the embedding is never resized. This
  library builds every mask and every "last token" index from lengths, never from
  ``ids != pad_token_id``, so pad may equal EOS: the id written into padding is never read.
  (Exported reward models get a pad id of their own in their config, because transformers does
  look for the last non-pad token: see :mod:`models.backbone`.)
* **BOS.** :func:`encode_text` encodes as the tokenizer's own post-processor would for a single
  text, but adds only its BOS token (Llama-2/3, Mistral prepend one; GPT-2 and Qwen none), and
  not when the text already starts with it (chat templates write it themselves).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping, Sequence

logger = logging.getLogger("ppo_mlx")

#: Existing special tokens that may serve as pad when the tokenizer names none, in order.
PAD_TOKEN_CANDIDATES: tuple[str, ...] = (
    "<|pad|>",
    "<pad>",
    "[PAD]",
    "<|padding|>",
    "<|finetune_right_pad_id|>",
)
#: Files that hold a tokenizer (fast, SentencePiece, BPE or WordPiece formats).
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "tiktoken.model",
    "spiece.model",
    "qwen.tiktoken",
)
# Text of the probe assistant turn that end_of_turn_token_id renders; any text works that the
# template leaves alone and that cannot merge with the tokens after it.
_TURN_PROBE = "Probe of the end of a turn 7"


def eos_token_ids(tokenizer: Any) -> list[int]:
    """All end-of-sequence ids, sorted: the wrapper's set, or the HF tokenizer's single id."""
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        single = getattr(tokenizer, "eos_token_id", None)
        ids = set() if single is None else {single}
    return sorted(int(i) for i in ids)


def ensure_pad_token(tokenizer: Any, *, vocab_size: int | None = None) -> int:
    """Give ``tokenizer`` a pad token of its own vocabulary and return its id.

    In order: its own pad token (kept even when it is an EOS token); else the first of
    :data:`PAD_TOKEN_CANDIDATES` in the vocabulary; else its EOS token. A pad id outside the
    model's embedding (``>= vocab_size``, e.g. a pad token added to the tokenizer only) is not
    kept: padding is embedded like any token, so its id must have a row.

    Raises:
        ValueError: the tokenizer has neither a usable pad token nor an EOS token.
    """
    vocab: dict[str, int] = tokenizer.get_vocab()

    def fits(token_id: int | None) -> bool:
        return token_id is not None and (vocab_size is None or 0 <= token_id < vocab_size)

    current = tokenizer.pad_token_id
    if fits(current):
        return int(current)
    for candidate in PAD_TOKEN_CANDIDATES:
        if fits(vocab.get(candidate)):
            logger.info("pad token: %s (id %d)", candidate, vocab[candidate])
            tokenizer.pad_token = candidate
            return int(vocab[candidate])
    eos = getattr(tokenizer, "eos_token", None)
    if eos is not None and fits(vocab.get(eos)):
        # Masks come from lengths here, so the id in padded positions is never read.
        logger.info("pad token: the EOS token %s (the tokenizer has no pad token)", eos)
        tokenizer.pad_token = eos
        return int(vocab[eos])
    raise ValueError(
        f"the tokenizer has no pad token and no EOS token within the model's vocabulary "
        f"(pad_token_id={current}, eos_token={eos!r}, vocab_size={vocab_size}); set "
        "eos_token (and pad_token) in the checkpoint's tokenizer_config.json"
    )


def end_of_turn_token_id(tokenizer: Any) -> int | None:
    """The special token the chat template closes an assistant turn with, or None.

    Renders a user turn and an assistant turn and reads the first special token after the
    assistant's text (skipping whitespace), e.g. ``<|im_end|>`` (ChatML), ``<|eot_id|>``
    (Llama 3), ``<end_of_turn>`` (Gemma), ``</s>`` (Mistral). None when the tokenizer has no chat
    template, the template cannot render the probe, or no special token follows the text.
    """
    if not _has_chat_template(tokenizer):
        return None
    messages = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": _TURN_PROBE},
    ]
    from jinja2.exceptions import TemplateError

    try:
        text = str(
            tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
        )
    except TemplateError as err:  # templates may raise on purpose (e.g. role checks)
        logger.info("chat template cannot render a probe turn (%s); no end-of-turn token", err)
        return None
    at = text.find(_TURN_PROBE)
    if at < 0:
        return None
    special = {int(i) for i in getattr(tokenizer, "all_special_ids", [])}
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special |= {int(i) for i, tok in added.items() if getattr(tok, "special", False)}
    for token_id in tokenizer.encode(text[at + len(_TURN_PROBE) :], add_special_tokens=False):
        if int(token_id) in special:
            return int(token_id)
        if tokenizer.decode([token_id]).strip():
            return None  # text, not a special token, follows the turn
    return None


def adds_bos_token(tokenizer: Any) -> bool:
    """Whether the tokenizer's post-processor prepends a BOS token to a single text."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    plain = list(tokenizer.encode("a", add_special_tokens=False))
    full = list(tokenizer.encode("a", add_special_tokens=True))
    return full[:1] == [bos] and full[1 : 1 + len(plain)] == plain


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text``, with the BOS token first when the tokenizer adds one (and the text
    does not already start with it, as chat-template output does); no other special tokens
    (never an EOS at the end)."""
    ids = [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]
    if adds_bos_token(tokenizer):
        bos = int(tokenizer.bos_token_id)
        if ids[:1] != [bos]:
            ids.insert(0, bos)
    return ids


def vocabulary_difference(ours: Any, theirs: Any) -> str | None:
    """None when both tokenizers map every string to the same id; else how their vocabularies
    differ (sizes, a few strings only each has, a few strings with other ids), for an error
    message about two models that must score the same token ids."""
    mine, other = ours.get_vocab(), theirs.get_vocab()
    if mine == other:
        return None
    only_ours = sorted(set(mine) - set(other))[:3]
    only_theirs = sorted(set(other) - set(mine))[:3]
    moved = sorted(k for k in set(mine) & set(other) if mine[k] != other[k])[:3]
    return (
        f"{len(other)} tokens against {len(mine)}; only the first's: {only_ours}, only the "
        f"second's: {only_theirs}, other ids: {moved}"
    )


def load_tokenizer(path: str | Path) -> Any:
    """Load the tokenizer of the model at ``path`` (a local directory), ready for training.

    EOS ids come from config.json and generation_config.json as mlx-lm reads them, plus the chat
    template's end-of-turn token; the pad token follows :func:`ensure_pad_token` with the model's
    ``vocab_size`` from config.json. Returns an mlx-lm ``TokenizerWrapper``.

    Raises:
        FileNotFoundError: ``path`` is not a directory with a config.json, or it has no
            tokenizer files (transformers would otherwise build a one-token tokenizer).
        ValueError: no pad or EOS token (see :func:`ensure_pad_token`).
    """
    from mlx_lm.utils import load_config
    from mlx_lm.utils import load_tokenizer as _mlx_load_tokenizer

    model_path = Path(path)
    if not (model_path / "config.json").is_file():
        raise FileNotFoundError(
            f"no model directory with a config.json at {model_path}; pass the directory of a "
            "Hugging Face or mlx-lm checkpoint"
        )
    present = [name for name in TOKENIZER_FILES if (model_path / name).is_file()]
    if not present:
        raise FileNotFoundError(
            f"{model_path} has no tokenizer files (one of {list(TOKENIZER_FILES)}): copy the "
            "tokenizer of the model it came from into it (e.g. "
            "AutoTokenizer.from_pretrained(<base>).save_pretrained(<dir>))"
        )
    config = load_config(model_path)
    tokenizer = _mlx_load_tokenizer(model_path, eos_token_ids=config.get("eos_token_id"))
    add_end_of_turn_id(tokenizer)
    vocab_size = config.get("vocab_size", config.get("text_config", {}).get("vocab_size"))
    ensure_pad_token(tokenizer, vocab_size=vocab_size)
    return tokenizer


def add_end_of_turn_id(tokenizer: Any) -> None:
    """Add the chat template's end-of-turn token (:func:`end_of_turn_token_id`) to the
    tokenizer's EOS ids, so that a reply ends where the template ends a turn (run again after
    the template changes)."""
    end_of_turn = end_of_turn_token_id(tokenizer)
    if end_of_turn is not None and end_of_turn not in tokenizer.eos_token_ids:
        logger.info(
            "end ids: adding the chat template's end-of-turn token %s (id %d)",
            tokenizer.convert_ids_to_tokens(end_of_turn),
            end_of_turn,
        )
        tokenizer.eos_token_ids = set(tokenizer.eos_token_ids) | {end_of_turn}


def _has_chat_template(tokenizer: Any) -> bool:
    has_template = getattr(tokenizer, "has_chat_template", None)
    if has_template is None:
        has_template = getattr(tokenizer, "chat_template", None) is not None
    return bool(has_template)


def _check_chat(tokenizer: Any, messages: Sequence[dict[str, str]]) -> None:
    if not _has_chat_template(tokenizer):
        raise ValueError(
            "this tokenizer has no chat template (a base model?); encode a plain-text prompt "
            "instead, or load an instruct/chat checkpoint whose tokenizer_config.json has one"
        )
    if not messages:
        raise ValueError("messages is empty; pass at least one {'role': ..., 'content': ...}")


def apply_chat_template(
    tokenizer: Any,
    messages: Sequence[dict[str, str]],
    *,
    add_generation_prompt: bool = True,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids of ``messages`` (``[{"role": ..., "content": ...}, ...]``) in the chat format.

    With ``add_generation_prompt`` the ids end with the header of an assistant turn, ready for
    generation. The template's text is encoded with :func:`encode_text`, as PPO encodes a
    formatted prompt, so both give the same ids (templates that write the BOS token themselves
    get no second one). Raises ``ValueError`` if the tokenizer has no chat template (base models):
    build the prompt text yourself and ``encode`` it instead. ``template_kwargs`` reach the
    template as keyword arguments (``tools``: the tools' JSON schemas; ``enable_thinking``).
    """
    text = chat_template_text(
        tokenizer,
        messages,
        add_generation_prompt=add_generation_prompt,
        template_kwargs=template_kwargs,
    )
    return encode_text(tokenizer, text)


def chat_template_text(
    tokenizer: Any,
    messages: Sequence[dict[str, str]],
    *,
    add_generation_prompt: bool = True,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The chat-formatted text of ``messages`` (what :func:`apply_chat_template` tokenises);
    ``template_kwargs`` reach the template as variables (Qwen3's ``enable_thinking``)."""
    _check_chat(tokenizer, messages)
    text = tokenizer.apply_chat_template(
        list(messages),
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **dict(template_kwargs or {}),
    )
    return str(text)
