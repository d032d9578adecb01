"""Tool calls in the policy's text, in the format its chat template taught it.

A parser takes one assistant turn's text (decoded with the call markers kept: ``<tool_call>`` is
a plain added token in Qwen's vocabulary, but ``[TOOL_CALLS]`` is a special token in Mistral's,
so decode with ``skip_special_tokens=False`` for that format) and returns the calls in order,
plus a model-facing message for each call it could not read. A parser never raises on the
model's text: a malformed call is the model's mistake, which it reads and can learn from.

Formats:

* ``"hermes"`` (Hermes, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>``, any number per turn, with text around them.
* ``"llama3_json"`` (Llama 3.1 / 3.2 / 3.3 JSON tool calling): the turn *is* the call,
  ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``, several separated
  by ``;``. A turn that does not start with ``{`` is a plain answer.
* ``"mistral"``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3 tokenizers) or
  ``[TOOL_CALLS]name[ARGS]{...}`` (v11+), after any text.

Any other format: pass a callable ``text -> ParsedTurn`` as ``tool_call_parser``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from config.agent_config import TOOL_CALL_PARSERS as PARSERS


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedTurn:
    """The tool calls of one assistant turn.

    Attributes:
        calls: the well-formed calls, in the order the model wrote them.
        errors: one message per call that could not be read (bad JSON, no name, arguments
            that are not an object), written for the model to read as a tool message.
    """

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def has_calls(self) -> bool:
        """Whether the turn attempted any call (well-formed or not): the episode goes on."""
        return bool(self.calls or self.errors)


ToolCallParser = Callable[[str], ParsedTurn]

_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_MARKER = "[TOOL_CALLS]"
_MISTRAL_ARGS = "[ARGS]"

#: The deepest nesting of ``[`` and ``{`` a call may have: Python's JSON decoder recurses per
#: level (about 1000 levels raise RecursionError), and no tool's arguments need more.
MAX_JSON_DEPTH = 100


def _short(text: str, limit: int = 200) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + "..."


def _nesting_depth(text: str, limit: int = MAX_JSON_DEPTH) -> int:
    """The deepest nesting of ``[`` / ``{`` in ``text`` outside JSON strings, counted up to
    ``limit + 1`` (enough to tell that it is too deep); unbalanced text counts what opens."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > limit:
                break
        elif char in "]}":
            depth = max(depth - 1, 0)
    return deepest


def _too_deep(text: str) -> str | None:
    """The model-facing error for JSON nested deeper than :data:`MAX_JSON_DEPTH`, else None
    (checked before decoding, which would recurse once per level)."""
    if _nesting_depth(text) <= MAX_JSON_DEPTH:
        return None
    return (
        f"Error: the tool call {_short(text, 60)} is nested more than {MAX_JSON_DEPTH} levels "
        "deep; write its arguments as a flat JSON object"
    )


def _call_from_object(obj: Any, argument_keys: tuple[str, ...], source: str) -> ToolCall | str:
    """A :class:`ToolCall` from a decoded JSON value, or the model-facing error."""
    if not isinstance(obj, dict):
        return f"Error: a tool call must be a JSON object with a name, got {_short(source)}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f'Error: the tool call {_short(source)} has no "name" (a string)'
    # No arguments (absent, null, or an empty string) is a call without any.
    arguments = next((obj[key] for key in argument_keys if key in obj), None)
    if isinstance(arguments, str):  # arguments written as a JSON string
        if not arguments.strip():
            return ToolCall(name=name, arguments={})
        deep = _too_deep(arguments)
        if deep is not None:
            return deep
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as err:
            return f"Error: the arguments of the call to {name!r} are not valid JSON ({err.msg})"
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return (
            f"Error: the arguments of the call to {name!r} must be a JSON object of "
            f"argument names to values, got {_short(json.dumps(arguments))}"
        )
    return ToolCall(name=name, arguments=arguments)


def _add(parsed: ParsedTurn, result: ToolCall | str) -> None:
    if isinstance(result, ToolCall):
        parsed.calls.append(result)
    else:
        parsed.errors.append(result)


def parse_hermes(text: str) -> ParsedTurn:
    """Calls written as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (an
    unterminated last block, a turn cut off at the token limit, is read to the end)."""
    parsed = ParsedTurn()
    for match in _HERMES.finditer(text):
        body = match.group(1).strip()
        deep = _too_deep(body)
        if deep is not None:
            parsed.errors.append(deep)
            continue
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as err:
            parsed.errors.append(
                f"Error: the tool call {_short(body)} is not valid JSON ({err.msg}); write "
                '<tool_call>{"name": <tool name>, "arguments": {<argument>: <value>}}</tool_call>'
            )
            continue
        _add(parsed, _call_from_object(obj, ("arguments", "parameters"), body))
    return parsed


def _json_objects(text: str, separators: str) -> tuple[list[tuple[Any, str]], str | None]:
    """Consecutive JSON values at the start of ``text``, separated by ``separators``; returns
    ``[(value, source)]`` and the decoding error of the first one that failed (or that is nested
    deeper than :data:`MAX_JSON_DEPTH`), if any."""
    decoder = json.JSONDecoder()
    values: list[tuple[Any, str]] = []
    at = 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] in separators):
            at += 1
        if at >= len(text) or text[at] not in "{[":
            return values, None
        if _nesting_depth(text[at:]) > MAX_JSON_DEPTH:
            return (
                values,
                f"nested more than {MAX_JSON_DEPTH} levels deep in {_short(text[at:], 60)}",
            )
        try:
            value, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError as err:
            return values, f"{err.msg} in {_short(text[at:])}"
        values.append((value, text[at:end]))
        at = end


def parse_llama3_json(text: str) -> ParsedTurn:
    """Llama 3.x JSON calls: the turn is ``{"name": ..., "parameters": {...}}`` (after an
    optional ``<|python_tag|>``), several separated by ``;``; other text is a plain answer."""
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG) :].lstrip()
    parsed = ParsedTurn()
    if not body.startswith("{"):
        return parsed
    values, error = _json_objects(body, ";")
    for value, source in values:
        _add(parsed, _call_from_object(value, ("parameters", "arguments"), source))
    if error is not None:
        parsed.errors.append(
            f"Error: a tool call is not valid JSON ({error}); write "
            '{"name": <tool name>, "parameters": {<argument>: <value>}}'
        )
    return parsed


def parse_mistral(text: str) -> ParsedTurn:
    """Mistral calls: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]`` or, in v11+
    tokenizers, ``[TOOL_CALLS]name[ARGS]{...}`` (repeated per call)."""
    parsed = ParsedTurn()
    start = text.find(_MISTRAL_MARKER)
    if start < 0:
        return parsed
    for chunk in text[start:].split(_MISTRAL_MARKER)[1:]:
        chunk = chunk.strip()
        if _MISTRAL_ARGS in chunk and not chunk.startswith("["):
            name, _, rest = chunk.partition(_MISTRAL_ARGS)
            values, error = _json_objects(rest, "")
            if not values:
                parsed.errors.append(
                    f"Error: the arguments of the call to {name.strip()!r} are not a JSON "
                    f"object ({error or _short(rest)})"
                )
                continue
            obj = {"name": name.strip(), "arguments": values[0][0]}
            _add(parsed, _call_from_object(obj, ("arguments",), chunk))
            continue
        values, error = _json_objects(chunk, "")
        if not values:
            parsed.errors.append(
                f"Error: the tool calls {_short(chunk)} are not a JSON list ({error or 'no JSON'}); "
                "write "
                '[TOOL_CALLS][{"name": <tool name>, "arguments": {<argument>: <value>}}]'
            )
            continue
        calls = values[0][0]
        for obj in calls if isinstance(calls, list) else [calls]:
            _add(parsed, _call_from_object(obj, ("arguments", "parameters"), json.dumps(obj)))
    return parsed


def resolve_parser(parser: str | ToolCallParser) -> ToolCallParser:
    """The parser named ``parser`` (one of :data:`PARSERS`), or ``parser`` itself if callable.

    Raises:
        ValueError: an unknown name.
    """
    if callable(parser):
        return parser
    named: dict[str, ToolCallParser] = {
        "hermes": parse_hermes,
        "llama3_json": parse_llama3_json,
        "mistral": parse_mistral,
    }
    if parser not in named:
        raise ValueError(
            f"tool_call_parser must be one of {list(PARSERS)} or a function text -> ParsedTurn, "
            f"got {parser!r}"
        )
    return named[parser]
