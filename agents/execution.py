"""Running one tool call: arguments checked against the tool's schema, a per-call timeout, the
output truncated; whatever goes wrong becomes the tool message the model reads.

Why a thread: an environment's tools are methods that change the environment's state (a memory
store the episode writes and reads), so they must run in the trainer's process. A call runs in
a daemon thread and the trainer waits at most ``timeout_s`` for it. The limit, stated honestly:
Python cannot stop a thread, so a tool that never returns keeps its thread (and whatever it
holds) until the process ends; the episode goes on with a timeout message, and every abandoned
call is logged with its tool's name. Code, the usual source of hangs, runs in the sandbox
instead (:mod:`agents.code_tool`), whose process is killed at its deadline.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agents.tool_calls import ToolCall
from agents.tools import Tool

logger = logging.getLogger("ppo_mlx")

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


class ToolError(Exception):
    """Raised by a tool to report a failure in its own words: the model reads the message as
    it is (``ok=False``), without the exception's type."""


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one call.

    Attributes:
        name: the tool called (as the model wrote it).
        content: the tool's output, or the error / timeout text the model reads; at most
            ``max_output_chars`` characters plus a truncation note.
        ok: False for an unknown tool, bad arguments, an exception or a timeout.
    """

    name: str
    content: str
    ok: bool


def truncate(text: str, max_chars: int) -> str:
    """``text`` cut to ``max_chars`` characters, with a note saying how many were cut."""
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f"\n[... {len(text) - max_chars} more characters truncated]"


def _type_ok(value: Any, schema: Mapping[str, Any]) -> bool:
    kinds = schema.get("type")
    if kinds is None:
        return True
    for kind in kinds if isinstance(kinds, list) else [kinds]:
        allowed = _JSON_TYPES.get(str(kind))
        if allowed is None:
            return True  # a type this check does not know: let the function judge
        if isinstance(value, bool) and kind in ("integer", "number"):
            continue  # JSON true is not a number
        if isinstance(value, allowed):
            return True
    return False


def argument_errors(call: ToolCall, tool: Tool) -> list[str]:
    """What is wrong with ``call.arguments`` for ``tool``: unknown or missing arguments and
    values of the wrong JSON type (by the tool's schema); empty when they are fine."""
    params = tool.parameters
    properties: Mapping[str, Any] = params.get("properties") or {}
    required = list(params.get("required") or [])
    errors = [f"unknown argument {k!r}" for k in call.arguments if k not in properties]
    errors += [f"missing required argument {k!r}" for k in required if k not in call.arguments]
    for key, value in call.arguments.items():
        spec = properties.get(key)
        if isinstance(spec, Mapping) and not _type_ok(value, spec):
            errors.append(
                f"argument {key!r} must be of type {spec.get('type')}, got {json.dumps(value)}"
            )
    return errors


def _usage(tool: Tool) -> str:
    props = tool.parameters.get("properties") or {}
    args = ", ".join(f"{k}: {v.get('type', 'any')}" for k, v in props.items())
    return f"{tool.name}({args})"


def _has_own_text(value: Any) -> bool:
    """Whether ``value``'s type writes its own text (not ``object``'s, which holds the
    object's memory address and so differs from run to run)."""
    cls = type(value)
    return cls.__str__ is not object.__str__ or cls.__repr__ is not object.__repr__


def json_form(value: Any) -> Any:
    """A JSON value standing for ``value``, which JSON cannot encode (``json.dumps``'s
    ``default``), the same in every run: a dataclass as its fields, a set sorted, an array
    (numpy, MLX) as its ``tolist()``, anything with a text form of its own as that text.

    Raises:
        TypeError: ``value`` has none of these (its text would be its memory address).
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (set, frozenset)):
        try:
            return sorted(value)
        except TypeError:  # mixed types: by their text
            return sorted(value, key=repr)
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    if _has_own_text(value):
        return str(value)
    raise TypeError(f"a {type(value).__name__}, which is not JSON and has no text form of its own")


def format_output(value: Any) -> tuple[str, bool]:
    """The text the model reads for a tool's return value, and whether it had to be converted:
    a string as is, JSON as JSON; else :func:`json_form` (a text form unquoted at the top).

    Raises:
        TypeError, ValueError: something in ``value`` has no deterministic form, or it refers
            to itself.
    """
    if isinstance(value, str):
        return value, False
    try:
        return json.dumps(value), False
    except (TypeError, ValueError):
        pass
    converted = value if isinstance(value, (list, tuple, dict)) else json_form(value)
    if isinstance(converted, str):
        return converted, True
    return json.dumps(converted, default=json_form), True


#: (tool, type) pairs already warned about: one warning each, not one per call.
_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def _warn_once(tool: str, value: Any, what: str) -> None:
    key = (tool, type(value).__qualname__)
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.warning("tool %r returned a %s, which JSON cannot encode: %s", tool, key[1], what)


def execute_call(
    call: ToolCall, tools: Mapping[str, Tool], *, timeout_s: float, max_output_chars: int
) -> ToolResult:
    """Run ``call`` with the tool of its name, waiting at most ``timeout_s`` seconds.

    Never raises because of the call or the tool: an unknown name, bad arguments, an exception
    in the tool or a timeout give ``ok=False`` and a message the model can act on. The content
    is truncated to ``max_output_chars`` (:func:`truncate`).
    """
    tool = tools.get(call.name)
    if tool is None:
        known = ", ".join(sorted(tools)) or "none"
        return ToolResult(
            call.name,
            truncate(
                f"Error: unknown tool {call.name!r}; the tools are: {known}", max_output_chars
            ),
            False,
        )
    errors = argument_errors(call, tool)
    if errors:
        text = f"Error: bad arguments for {call.name}: " + "; ".join(errors)
        return ToolResult(
            call.name, truncate(f"{text}. Usage: {_usage(tool)}", max_output_chars), False
        )
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = tool.function(**call.arguments)
        # The tool is user code run on the model's arguments: whatever it raises is the
        # message the model reads (the contract), never a crash of the trainer.
        except Exception as err:  # noqa: BLE001
            outcome["error"] = err

    worker = threading.Thread(target=run, name=f"tool-{call.name}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        logger.warning(
            "tool %r did not return within tool_timeout_s=%s; its thread is left running",
            call.name,
            timeout_s,
        )
        text = f"Error: {call.name} timed out after {timeout_s:g} s"
        return ToolResult(call.name, truncate(text, max_output_chars), False)
    if "error" in outcome:
        err = outcome["error"]
        text = f"Error: {call.name} raised {type(err).__name__}: {err}"
        if isinstance(err, ToolError):
            text = str(err)
        return ToolResult(call.name, truncate(text, max_output_chars), False)
    if "value" not in outcome:  # the thread ended by BaseException (SystemExit)
        text = f"Error: {call.name} exited without returning a value"
        return ToolResult(call.name, truncate(text, max_output_chars), False)
    value = outcome["value"]
    try:
        text, converted = format_output(value)
    except (TypeError, ValueError) as err:
        _warn_once(call.name, value, "refused (the model reads an error): return a str or JSON")
        detail = str(err) if isinstance(err, TypeError) else "a value that refers to itself"
        return ToolResult(
            call.name, truncate(f"Error: {call.name} returned {detail}", max_output_chars), False
        )
    if converted:
        _warn_once(call.name, value, f"sent as {text[:60]!r} (the same in every run)")
    return ToolResult(call.name, truncate(text, max_output_chars), True)
