"""Talk to a trained policy: one completion (``generate``) or a multi-turn chat (``chat``).

Decoding is mlx-lm's (``mlx_lm.stream_generate`` with a sampler from
``mlx_lm.sample_utils.make_sampler``), as ``mlx_lm.generate`` does it, so what you see here is what
an exported model gives under mlx-lm. Generation stops at every id of the tokenizer's
``eos_token_ids`` (the EOS token and the end-of-turn token of a chat template).

Chat-template rule (``chat=None``, the default): the prompt goes through the tokenizer's chat
template when the tokenizer has one, the rule of ``mlx_lm.generate``; ``chat=False`` sends the text
as it is (models trained on plain-text prompts, like the demo's, want this), ``chat=True``
requires a template.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterator, TextIO

import mlx.core as mx
import mlx.nn as nn

from base_setup.tokenizer_setup import apply_chat_template, chat_template_text, encode_text


@dataclass(frozen=True)
class SamplingSettings:
    """How to sample a reply.

    Attributes:
        max_tokens: most new tokens per reply.
        temperature: softmax temperature; 0 = greedy (argmax).
        top_p: nucleus sampling: sample among the most likely tokens whose probabilities sum
            to top_p; 1 = no cut.
        seed: seed of MLX's random state, set once before the first reply; None = unseeded.
    """

    max_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 1.0
    seed: int | None = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = no cut), got {self.top_p}")


#: Lone surrogates: how Python's ``surrogateescape`` (argv, C.UTF-8 stdin) holds bytes that are
#: not UTF-8 (U+DC80..U+DCFF for bytes 0x80..0xFF). A tokenizer refuses them (TypeError).
_UNDECODABLE = re.compile("[\ud800-\udfff]")


def check_utf8(text: str, what: str = "the prompt") -> None:
    """Raise ``ValueError`` naming the first byte of ``text`` that was not UTF-8 (read with
    ``surrogateescape``), if any."""
    match = _UNDECODABLE.search(text)
    if match is None:
        return
    offset = len(text[: match.start()].encode("utf-8"))
    code = ord(match.group())
    byte = f" (0x{code - 0xDC00:02x})" if 0xDC80 <= code <= 0xDCFF else ""
    raise ValueError(
        f"{what} is not UTF-8 text: byte {offset}{byte} is not; convert it first, e.g. "
        "iconv -f latin1 -t utf-8"
    )


def replace_undecodable(text: str) -> tuple[str, int]:
    """``text`` with each byte that was not UTF-8 (a lone surrogate) replaced by U+FFFD, and
    how many were."""
    return _UNDECODABLE.subn("\ufffd", text)


def has_chat_template(tokenizer: Any) -> bool:
    """Whether the tokenizer carries a chat template."""
    flag = getattr(tokenizer, "has_chat_template", None)
    if flag is None:
        flag = getattr(tokenizer, "chat_template", None) is not None
    return bool(flag)


def use_chat_template(tokenizer: Any, chat: bool | None) -> bool:
    """The chat-template rule of the module docstring.

    Raises:
        ValueError: ``chat=True`` and the tokenizer has no chat template.
    """
    if chat is None:
        return has_chat_template(tokenizer)
    if chat and not has_chat_template(tokenizer):
        raise ValueError(
            "the tokenizer has no chat template (a base model?): send the prompt as plain text "
            "(--no-chat), or use a model whose tokenizer_config.json has a chat_template"
        )
    return chat


def encode_prompt(tokenizer: Any, prompt: str, *, chat: bool) -> list[int]:
    """Token ids of one user prompt: a one-message conversation through the chat template
    (ending with the assistant header), or the text itself with the tokenizer's BOS when it adds
    one, as the trainers encode prompts (:func:`base_setup.tokenizer_setup.encode_text`)."""
    if chat:
        return apply_chat_template(tokenizer, [{"role": "user", "content": prompt}])
    return encode_text(tokenizer, prompt)


def stream_reply(
    model: nn.Module, tokenizer: Any, prompt_ids: list[int], settings: SamplingSettings
) -> Iterator[str]:
    """The reply to ``prompt_ids`` as text pieces, yielded as the tokens are sampled; ends at a
    stop token (not included) or after ``settings.max_tokens`` tokens."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token of text")
    sampler = make_sampler(temp=settings.temperature, top_p=settings.top_p)
    for response in stream_generate(
        model, tokenizer, mx.array(prompt_ids), max_tokens=settings.max_tokens, sampler=sampler
    ):
        if response.text:
            yield response.text


def generate_text(
    model: nn.Module,
    tokenizer: Any,
    prompt: str,
    settings: SamplingSettings,
    *,
    chat: bool | None = None,
    out: TextIO | None = None,
    context: int | None = None,
) -> str:
    """The completion of ``prompt`` (the chat rule of the module docstring); with ``out``, each
    piece is also written there as it comes. A prompt beyond :func:`prompt_budget` of the
    model's ``context`` raises ``ValueError``, as does one that is not UTF-8 text
    (:func:`check_utf8`)."""
    check_utf8(prompt)
    ids = encode_prompt(tokenizer, prompt, chat=use_chat_template(tokenizer, chat))
    budget = prompt_budget(context, settings.max_tokens)
    if budget is not None and len(ids) > budget:
        raise ValueError(
            f"the prompt is {len(ids)} tokens; the model's context of {context} tokens leaves "
            f"{budget} for it beside a reply of up to {settings.max_tokens}: shorten it, or "
            "lower --max-tokens"
        )
    if settings.seed is not None:
        mx.random.seed(settings.seed)
    pieces = []
    for piece in stream_reply(model, tokenizer, ids, settings):
        pieces.append(piece)
        if out is not None:
            out.write(piece)
            out.flush()
    return "".join(pieces)


def prompt_budget(context: int | None, max_tokens: int) -> int | None:
    """Most prompt tokens beside a reply of ``max_tokens`` in a ``context``-token window:
    ``context - max_tokens``, at least half the context (a reply longer than that is cut by
    the window, not the prompt); None when the context is unknown."""
    if context is None:
        return None
    return max(context - max_tokens, context // 2)


CHAT_HELP = (
    "Type a message and press Enter. /reset forgets the conversation; /exit or Ctrl-D quits."
)


def chat_session(
    model: nn.Module,
    tokenizer: Any,
    settings: SamplingSettings,
    *,
    stdin: TextIO,
    stdout: TextIO,
    system: str | None = None,
    show_prompt: bool = False,
    context: int | None = None,
) -> list[dict[str, str]]:
    """An interactive chat on ``stdin`` / ``stdout``: every line is a user turn, answered with
    the whole conversation so far through the chat template, the reply streamed token by token.

    ``/reset`` starts a new conversation (the system message stays), ``/exit`` or end of input
    (Ctrl-D) ends the session. With ``show_prompt`` the full prompt text (template applied) is
    written before each reply. Returns the conversation at the end.

    ``context``: the model's context length in tokens. The prompt is kept within
    :func:`prompt_budget` by dropping the oldest turns (said each time); a message that does not
    fit even alone is refused, with its length, and the session goes on. Bytes of a line that
    are not UTF-8 are replaced by U+FFFD (said each time): a strict text stream is switched to
    ``errors="surrogateescape"`` so that reading it never raises.

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    use_chat_template(tokenizer, True)
    reconfigure = getattr(stdin, "reconfigure", None)
    if callable(reconfigure) and getattr(stdin, "errors", None) == "strict":
        reconfigure(errors="surrogateescape")  # read such a line, then replace its bytes
    start: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    if settings.seed is not None:
        mx.random.seed(settings.seed)
    stdout.write(CHAT_HELP + "\n")
    while True:
        stdout.write("\n> ")
        stdout.flush()
        line = stdin.readline()
        if not line:  # end of input (Ctrl-D)
            stdout.write("\n")
            break
        text, replaced = replace_undecodable(line.strip())
        if replaced:
            stdout.write(f"(this message is not UTF-8: {replaced} byte(s) replaced by U+FFFD)\n")
        if text == "/exit":
            break
        if text == "/reset":
            messages = list(start)
            stdout.write("(new conversation)\n")
            continue
        if not text:
            continue
        messages.append({"role": "user", "content": text})
        ids = apply_chat_template(tokenizer, messages)
        budget = prompt_budget(context, settings.max_tokens)
        dropped = 0
        while budget is not None and len(ids) > budget and len(messages) > len(start) + 1:
            # The oldest exchange goes: a user turn and the reply that followed it.
            del messages[len(start) : len(start) + 2]
            dropped += 1
            ids = apply_chat_template(tokenizer, messages)
        if budget is not None and len(ids) > budget:
            messages.pop()
            stdout.write(
                f"(this message is {len(ids)} tokens with the template; the model's context of "
                f"{context} tokens leaves {budget} for the prompt beside a reply of up to "
                f"{settings.max_tokens}: shorten it, or lower --max-tokens)\n"
            )
            continue
        if dropped:
            stdout.write(
                f"(the conversation outgrew the model's context of {context} tokens: dropped "
                f"the {dropped} oldest exchange(s))\n"
            )
        if show_prompt:
            stdout.write(f"[prompt]\n{chat_template_text(tokenizer, messages)}[/prompt]\n")
        pieces = []
        for piece in stream_reply(model, tokenizer, ids, settings):
            pieces.append(piece)
            stdout.write(piece)
            stdout.flush()
        stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(pieces)})
    stdout.flush()
    return messages
