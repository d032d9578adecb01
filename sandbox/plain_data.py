"""Plain data, the only thing that crosses from the sandbox to the trusted process: decoding the
wire format strictly (:func:`from_wire`, the inverse of :func:`sandbox.runner.make_encoder`) and
comparing values by type and value (:func:`strict_equal`).

Comparison rules: integers and floats compare as numbers (``1 == 1.0``), a bool is not a number
(``True != 1``), a list is not a tuple, a set equals a frozenset with the same elements, dicts
compare by their items under the same rules, and NaN equals NaN (``x == float("nan")`` could
otherwise never hold; a test of a NaN result is written that way).

Decoding and comparing are bounded (:class:`Budget`): the wire text is at most
``MAX_VALUE_BYTES`` (checked when the record is parsed), a set or dict whose elements share a hash
is rejected before it is built (a set of integers that all hash alike costs a quadratic number of
probes, seconds of the trainer's CPU), and each candidate's judging has a CPU-time allowance.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

from sandbox.runner import MAX_DEPTH

#: Most elements of one set or dict that may share a hash (honest values almost never share one).
MAX_SHARED_HASH = 8


class WireError(ValueError):
    """A value from the sandbox that is not in the wire format, or over the judging budget."""


class Budget:
    """CPU time this thread may spend decoding and judging one candidate's values.

    ``spend()`` is called once per node decoded or compared; every 256 calls it reads the thread's
    CPU clock and raises :class:`WireError` past ``seconds``.
    """

    def __init__(self, seconds: float = 1.0) -> None:
        self.seconds = seconds
        self.start = time.thread_time()
        self.calls = 0

    def spend(self) -> None:
        self.calls += 1
        if self.calls & 255 == 0 and time.thread_time() - self.start > self.seconds:
            raise WireError(f"judging took more than its budget of {self.seconds} s of CPU")


def _unlimited() -> Budget:
    return Budget(float("inf"))


def _distinct_hashes(items: Iterable[Any], what: str) -> None:
    """Raise WireError if more than ``MAX_SHARED_HASH`` of ``items`` share a hash (before they go
    into a set or dict, where that would cost a quadratic number of probes)."""
    counts = Counter(hash(item) for item in items)
    if counts and max(counts.values()) > MAX_SHARED_HASH:
        raise WireError(f"a {what} whose elements are built to share a hash")


def is_number(x: Any) -> bool:
    return type(x) is int or type(x) is float


def canonical(x: Any, budget: Budget | None = None) -> Any:
    """A hashable form of plain data in which two values are equal exactly when
    :func:`strict_equal` says so (numbers by value, every other type kept apart, NaN == NaN).

    Raises:
        WireError: over ``budget``, or a set or dict whose canonical elements share a hash.
    """
    budget = _unlimited() if budget is None else budget
    return _canonical(x, budget)


def _canonical(x: Any, budget: Budget) -> Any:
    budget.spend()
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
        return (kind.__name__, tuple(_canonical(item, budget) for item in x))
    if kind is set or kind is frozenset:
        items = [_canonical(item, budget) for item in x]
        _distinct_hashes(items, "set")
        return ("set", frozenset(items))
    if kind is dict:
        pairs = [(_canonical(k, budget), _canonical(v, budget)) for k, v in x.items()]
        _distinct_hashes(pairs, "dict")
        return ("dict", frozenset(pairs))
    raise TypeError(f"a {kind.__name__} is not plain data")


def strict_equal(a: Any, b: Any, budget: Budget | None = None) -> bool:
    """Equality of plain data by type and value (see the module docstring)."""
    return bool(canonical(a, budget) == canonical(b, budget))


def from_wire(text: str, budget: Budget | None = None) -> Any:
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
        return _build(raw, 0, _unlimited() if budget is None else budget)
    except WireError:
        raise
    except (RecursionError, TypeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise WireError(str(exc)[:200]) from None


def _build(raw: Any, depth: int, budget: Budget) -> Any:
    budget.spend()
    if depth > 2 * MAX_DEPTH + 2:  # a dict adds two levels: its pair list and each pair
        raise WireError("nested too deep")
    if raw is None or type(raw) in (bool, int, float, str):
        return raw
    if type(raw) is list:
        return [_build(item, depth + 1, budget) for item in raw]
    ((tag, body),) = raw.items()
    if tag == "float" and body in ("nan", "inf", "-inf"):
        return float(body)
    if type(body) is not list:
        raise WireError(f"{tag!r} needs a list")
    items = [_build(item, depth + 1, budget) for item in body]
    if tag == "tuple":
        return tuple(items)
    if tag in ("set", "frozenset"):
        _distinct_hashes(items, tag)  # TypeError for a list element
        built = (set if tag == "set" else frozenset)(items)  # TypeError for a list element
        if len(built) != len(items):
            raise WireError("a set with repeated elements")
        return built
    if tag == "dict":
        if not all(type(item) is list and len(item) == 2 for item in items):
            raise WireError("a dict is a list of [key, value] pairs")
        _distinct_hashes((key for key, _ in items), "dict")
        mapping = dict((key, value) for key, value in items)
        if len(mapping) != len(items):
            raise WireError("a dict with repeated keys")
        return mapping
    raise WireError(f"unknown tag {tag!r}")
