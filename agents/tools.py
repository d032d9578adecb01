"""Tools as Python functions (TRL's contract): a function with type hints and a Google-style
docstring is a tool; its JSON schema, which the chat template renders for the model, comes from
``transformers.utils.get_json_schema``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Tool:
    """One tool the policy may call.

    Attributes:
        name: the name the model calls it by (the function's ``__name__``).
        function: called with the call's arguments as keyword arguments; returns the text (or a
            JSON-serialisable value) the model reads.
        schema: ``{"type": "function", "function": {"name", "description", "parameters"}}``,
            as ``apply_chat_template(..., tools=[schema])`` takes it.
    """

    name: str
    function: Callable[..., Any]
    schema: dict[str, Any]

    @property
    def parameters(self) -> dict[str, Any]:
        """The JSON schema of the arguments (``{"type": "object", "properties", "required"}``)."""
        params = self.schema["function"].get("parameters", {})
        return params if isinstance(params, dict) else {}


def tool_schema(function: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema of ``function`` by ``transformers.utils.get_json_schema``.

    Raises:
        ValueError: the function has no docstring, an argument without a type hint or without a
            description under ``Args:``; the message names the function and what is missing.
    """
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import (
        DocstringParsingException,
        TypeHintParsingException,
    )

    name = getattr(function, "__qualname__", None) or getattr(function, "__name__", repr(function))
    try:
        return dict(get_json_schema(function))
    except (DocstringParsingException, TypeHintParsingException) as err:
        raise ValueError(
            f"tool {name!r} cannot be described to the model: {err}. A tool needs a type hint "
            "on every argument and a Google-style docstring (a summary line, then 'Args:' with "
            "one 'name: description' line per argument)"
        ) from None


def make_tools(functions: Sequence[Callable[..., Any] | Tool]) -> list[Tool]:
    """:class:`Tool` s from functions (or ready tools), checked before any rollout.

    Raises:
        ValueError: a function cannot be described (see :func:`tool_schema`), an entry is not
            callable, or two tools share a name (the model could not tell them apart).
    """
    if isinstance(functions, (str, bytes)) or callable(functions):
        raise ValueError(
            "tools must be a list of functions, e.g. tools=[calculator], got "
            f"{type(functions).__name__}"
        )
    tools: list[Tool] = []
    for entry in functions:
        if isinstance(entry, Tool):
            tools.append(entry)
            continue
        if not callable(entry):
            raise ValueError(f"a tool must be a function, got {entry!r} ({type(entry).__name__})")
        schema = tool_schema(entry)
        tools.append(Tool(name=str(schema["function"]["name"]), function=entry, schema=schema))
    seen: set[str] = set()
    for tool in tools:
        if tool.name in seen:
            raise ValueError(
                f"two tools are named {tool.name!r}: the model calls tools by name, so give "
                "each a distinct function name"
            )
        seen.add(tool.name)
    return tools
