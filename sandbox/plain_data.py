"""Plain data, the only thing that crosses from the sandbox to the trusted process: decoding the
wire format strictly (:func:`from_wire`, the inverse of :func:`sandbox.runner.make_encoder`) and
comparing values by type and value (:func:`strict_equal`).

Comparison rules: integers and floats compare as numbers (``1 == 1.0``), a bool is not a number
(``True != 1``), a list is not a tuple, a set equals a frozenset with the same elements, dicts
compare by their items under the same rules, and NaN equals NaN (``x == float("nan")`` could
otherwise never hold; a test of a NaN result is written that way).
"""

from __future__ import annotations

import json
from typing import Any

from sandbox.runner import MAX_DEPTH


def is_number(x: Any) -> bool:
    return type(x) is int or type(x) is float


def canonical(x: Any) -> Any:
    """A hashable form of plain data in which two values are equal exactly when
    :func:`strict_equal` says so (numbers by value, every other type kept apart, NaN == NaN)."""
    kind = type(x)
    if x is None:
        return ("none",)
    if kind is bool:
        return ("bool", x)
    if kind is int or kind is float:
        return ("nan",) if x != x else ("number", x)
    if kind is str:
        return ("str", x)
    if kind is list or kind is tuple:
        return (kind.__name__, tuple(canonical(item) for item in x))
    if kind is set or kind is frozenset:
        return ("set", frozenset(canonical(item) for item in x))
    if kind is dict:
        return ("dict", frozenset((canonical(k), canonical(v)) for k, v in x.items()))
    raise TypeError(f"a {kind.__name__} is not plain data")


def strict_equal(a: Any, b: Any) -> bool:
    """Equality of plain data by type and value (see the module docstring)."""
    return bool(canonical(a) == canonical(b))


class WireError(ValueError):
    """A value from the sandbox that is not in the wire format."""


def from_wire(text: str) -> Any:
    """The plain value a runner record carries (the inverse of :func:`sandbox.runner.make_encoder`).

    Builds only None, bool, int, float, str, list, tuple, dict, set: whatever the sandbox wrote,
    nothing else can come out. Raises WireError for anything outside the format.
    """

    def reject(token: str) -> Any:
        raise WireError(f"{token} is not in the wire format")

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        if len(items) != 1:
            raise WireError("a tagged value has exactly one key")
        return dict(items)

    try:
        raw = json.loads(text, parse_constant=reject, object_pairs_hook=pairs)
        return _build(raw, 0)
    except (RecursionError, TypeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise WireError(str(exc)[:200]) from None


def _build(raw: Any, depth: int) -> Any:
    if depth > 2 * MAX_DEPTH + 2:  # a dict adds two levels: its pair list and each pair
        raise WireError("nested too deep")
    if raw is None or type(raw) in (bool, int, float, str):
        return raw
    if type(raw) is list:
        return [_build(item, depth + 1) for item in raw]
    ((tag, body),) = raw.items()
    if tag == "float" and body in ("nan", "inf", "-inf"):
        return float(body)
    if type(body) is not list:
        raise WireError(f"{tag!r} needs a list")
    items = [_build(item, depth + 1) for item in body]
    if tag == "tuple":
        return tuple(items)
    if tag in ("set", "frozenset"):
        built = (set if tag == "set" else frozenset)(items)  # TypeError for a list element
        if len(built) != len(items):
            raise WireError("a set with repeated elements")
        return built
    if tag == "dict":
        if not all(type(item) is list and len(item) == 2 for item in items):
            raise WireError("a dict is a list of [key, value] pairs")
        mapping = dict((key, value) for key, value in items)
        if len(mapping) != len(items):
            raise WireError("a dict with repeated keys")
        return mapping
    raise WireError(f"unknown tag {tag!r}")
