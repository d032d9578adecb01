"""Tool turns as tokens, written by the model's own chat template.

After the model ends a turn that calls tools, the trainer appends the tool results and lets the
model continue, keeping its KV cache: it needs only the tokens that come *after* the model's
last token, up to the next assistant generation prompt. :func:`continuation_tokens` gets them by
rendering the conversation twice, without and with the tool messages, and keeping the suffix,
so every template that renders ``tool`` messages works without knowing its format (Qwen's
``<|im_start|>user\\n<tool_response>...``, Llama 3's ``ipython`` role, Mistral's
``[TOOL_RESULTS]``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from base_setup.tokenizer_setup import encode_text, end_of_turn_token_id
from agents.tools import Tool

# Probe texts for check_template_supports_tools: unlikely to occur in a template.
_PROBE_USER = "Probe question 7"
_PROBE_RESULT = "Probe tool result 42"
# Characters of the end of the model's turn that must read the same in both renderings.
_TURN_END_CHARS = 32


def _schemas(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    return [tool.schema for tool in tools]


def render_text(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Tool],
    add_generation_prompt: bool,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The chat template's text of ``messages`` with the tools' schemas (``tools=``).

    Raises:
        ValueError: the tokenizer has no chat template, or the template raised on the messages.
    """
    from jinja2.exceptions import TemplateError

    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "tools need a chat template that renders them, and this tokenizer has none (a base "
            "model?): use an instruct checkpoint with a tool-capable template (Qwen2.5, Qwen3, "
            "Llama 3.1+, Mistral), or set chat_template in its tokenizer_config.json"
        )
    try:
        text = tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tools=_schemas(tools) or None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **dict(template_kwargs or {}),
        )
    except TemplateError as err:
        roles = [m.get("role") for m in messages]
        raise ValueError(
            f"the chat template cannot render a conversation with roles {roles} ({err}); tool "
            "calling needs a template that renders tools and 'tool' messages"
        ) from None
    return str(text)


def prompt_tokens(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Tool],
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids of a prompt with the tools described, ending with the assistant generation
    prompt (encoded as :func:`base_setup.tokenizer_setup.encode_text` encodes prompts)."""
    text = render_text(
        tokenizer,
        messages,
        tools=tools,
        add_generation_prompt=True,
        template_kwargs=template_kwargs,
    )
    return encode_text(tokenizer, text)


def _end_of_turn_text(tokenizer: Any) -> str:
    token_id = end_of_turn_token_id(tokenizer)
    if token_id is None:
        raise ValueError(
            "the chat template closes an assistant turn with no special token, so the model's "
            "last token of a turn cannot be found in the rendered conversation; multi-turn tool "
            "calling needs a template whose assistant turns end with an end-of-turn token "
            "(<|im_end|>, <|eot_id|>, </s>)"
        )
    return str(tokenizer.convert_ids_to_tokens(token_id))


def continuation_tokens(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tool_messages: list[dict[str, Any]],
    *,
    tools: Sequence[Tool],
    template_kwargs: Mapping[str, Any],
    ended_turn: bool = True,
) -> list[int]:
    """The token ids between the model's last generated token and its next turn: the tool
    messages as the chat template writes them, then the assistant generation prompt.

    ``messages`` is the conversation so far, ending with the assistant turn the model just
    wrote (its text as content). With ``ended_turn`` the model's tokens ended with the
    template's end-of-turn token (``<|im_end|>``), which is then not repeated; without it (a turn
    cut at the token limit), the continuation starts with that token.

    Computed from ``render(messages + tool_messages, generation prompt)``: what follows the
    end-of-turn token that closes the model's turn there (the one of the same rank as the last
    one of ``render(messages)``); the text before it may differ (Qwen3 rewrites a past turn's
    think block), the end of the model's turn may not.

    Raises:
        ValueError: the template has no end-of-turn token, cannot render the messages, or
            renders the end of the model's turn differently once tool messages follow.
    """
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("messages must end with the assistant turn the model just generated")
    if not tool_messages:
        raise ValueError("tool_messages is empty: there is nothing to continue with")
    kwargs = dict(template_kwargs)
    prefix = render_text(
        tokenizer, messages, tools=tools, add_generation_prompt=False, template_kwargs=kwargs
    )
    full = render_text(
        tokenizer,
        [*messages, *tool_messages],
        tools=tools,
        add_generation_prompt=True,
        template_kwargs=kwargs,
    )
    end_of_turn = _end_of_turn_text(tokenizer)
    closes = _positions(prefix, end_of_turn)
    if not closes:
        raise ValueError(
            f"the end-of-turn token {end_of_turn!r} does not close the rendered assistant turn"
        )
    # The model's turn closes with the prefix's last end-of-turn token, and with the same-numbered
    # one once the tool messages follow. Only what comes after it is used: a template may rewrite
    # earlier text once more turns follow (Qwen3 drops a past turn's empty think block), which
    # changes nothing after the model's last token; the end of the turn itself must agree.
    reopened = _positions(full, end_of_turn)
    turn_end = reopened[len(closes) - 1] if len(reopened) >= len(closes) else -1
    before = closes[-2] + len(end_of_turn) if len(closes) > 1 else 0
    tail = prefix[before : closes[-1]][-_TURN_END_CHARS:]
    if turn_end < 0 or not full[:turn_end].endswith(tail):
        raise ValueError(
            "the chat template renders the model's turn differently once tool messages follow "
            f"(it ends with {tail!r} alone, but not before the tool messages), so the tokens "
            "after it cannot be found; use a template that keeps each turn's end whatever "
            "follows it"
        )
    start = turn_end + len(end_of_turn) if ended_turn else turn_end
    return [int(i) for i in tokenizer.encode(full[start:], add_special_tokens=False)]


def _positions(text: str, token: str) -> list[int]:
    """Start of every occurrence of ``token`` in ``text``."""
    found, at = [], text.find(token)
    while at >= 0:
        found.append(at)
        at = text.find(token, at + len(token))
    return found


def check_template_supports_tools(tokenizer: Any, tools: Sequence[Tool]) -> None:
    """Stop a run whose chat template cannot show the model its tools or their results.

    Renders a probe conversation: a user turn with and without ``tools`` (the texts must
    differ: the model must see the tools' descriptions), then an assistant turn with a call and
    a tool message answering it, as :class:`agents.Episode` writes them (the result's text must
    appear), and finds the end-of-turn token.

    Raises:
        ValueError: no chat template, a template that ignores ``tools`` or drops ``tool``
            messages, or one with no end-of-turn token; the message says what to use instead.
    """
    user = [{"role": "user", "content": _PROBE_USER}]
    with_tools = render_text(tokenizer, user, tools=tools, add_generation_prompt=True)
    without = render_text(tokenizer, user, tools=[], add_generation_prompt=True)
    if with_tools == without:
        raise ValueError(
            "the chat template ignores tools= (it renders the same text with and without "
            "them), so the model would never see the tools' descriptions: for a ChatML "
            "checkpoint (<|im_start|>/<|im_end|>, e.g. SmolLM2-Instruct) set "
            "tool_chat_template: chatml_tools; else use a checkpoint whose template renders "
            "tools (Qwen2.5, Qwen3, Llama 3.1+, Mistral) or set tool_chat_template to a "
            "tool-capable Jinja file"
        )
    name = tools[0].name if tools else "probe"
    call = {"id": "call00000", "type": "function", "function": {"name": name, "arguments": {}}}
    turn: list[dict[str, Any]] = [
        *user,
        {"role": "assistant", "content": "Probe call", "tool_calls": [call]},
        {"role": "tool", "name": name, "content": _PROBE_RESULT, "tool_call_id": "call00000"},
    ]
    rendered = render_text(tokenizer, turn, tools=tools, add_generation_prompt=True)
    if _PROBE_RESULT not in rendered:
        raise ValueError(
            "the chat template drops messages of role 'tool', so the model would never read "
            "its tools' results: for a ChatML checkpoint set tool_chat_template: "
            "chatml_tools; else use a checkpoint whose template renders them (Qwen2.5, "
            "Qwen3, Llama 3.1+, Mistral) or set tool_chat_template to a tool-capable Jinja file"
        )
    _end_of_turn_text(tokenizer)
