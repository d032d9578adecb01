"""Field checks shared by the config dataclasses and the YAML loader (no mlx here).

* :func:`coerce_value` checks one value against a field annotation (``int``, ``float``, ``bool``,
  ``str``, ``Literal[...]``, ``list[X]``, ``X | None``) and returns it in canonical form (an ``int``
  given for a ``float`` becomes a ``float``, a tuple for a ``list`` becomes a ``list``). With
  ``from_text=True`` (values read from YAML or the command line) it also accepts numbers written as
  strings, because PyYAML reads ``1e-5`` (no dot) as the string ``"1e-5"``.
* :func:`require` raises the uniform range-check error,
  ``"<field> must be <rule>, got <value>: <fix>"``.
"""

import difflib
import inspect
import math
import types
import typing
from collections.abc import Iterable
from dataclasses import fields
from functools import cache
from typing import Any, Literal, Union


class _Mismatch(Exception):
    """Internal: the value does not fit the annotation (turned into a ValueError by the caller)."""


def require(ok: bool, name: str, value: object, rule: str, fix: str) -> None:
    """Raise ``ValueError("<name> must be <rule>, got <value>: <fix>")`` unless ``ok``.

    Callers write ``ok`` as a positive comparison (``x > 0``), so a NaN fails every rule.
    """
    if not ok:
        raise ValueError(f"{name} must be {rule}, got {value!r}: {fix}")


def require_model_name(model_name: str) -> None:
    """Raise ``ValueError`` unless ``model_name`` names a model (a non-empty path or repo id)."""
    require(
        bool(model_name.strip()),
        "model_name",
        model_name,
        "a non-empty path or repo id",
        "set model_name to a local model directory or a Hugging Face repo id",
    )


def close_keys(key: str, names: Iterable[str]) -> list[str]:
    """The (at most 3) names closest to a mistyped ``key`` (difflib, cutoff 0.6), best first;
    [] when none is close. Every "did you mean" of the configs comes from here."""
    return difflib.get_close_matches(key, list(names), n=3, cutoff=0.6)


def unknown_keys_message(
    owner: str,
    keys: Iterable[str],
    names: Iterable[str],
    listed: str = "docs/configuration.md lists them",
) -> str:
    """One line refusing ``keys`` that ``owner`` does not take, each with its "did you mean"
    among ``names`` (or, when none is close, ``listed``: where the keys are listed)."""
    names = list(names)
    parts = []
    for key in keys:
        close = close_keys(key, names)
        hint = (
            "did you mean " + " or ".join(repr(c) for c in close) + "?"
            if close
            else f"no key is close ({listed})"
        )
        parts.append(f"{key!r}: {hint}")
    return f"{owner} does not take " + "; ".join(parts)


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending (for messages that suggest valid values)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def is_positive(x: float) -> bool:
    """``0 < x < inf`` (False for NaN)."""
    return 0.0 < x < math.inf


def is_non_negative(x: float) -> bool:
    """``0 <= x < inf`` (False for NaN)."""
    return 0.0 <= x < math.inf


def describe(annotation: Any) -> str:
    """Plain-English name of what an annotation accepts, for error messages."""
    origin = typing.get_origin(annotation)
    if annotation is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (Union, types.UnionType):
        return " or ".join(describe(a) for a in typing.get_args(annotation))
    if origin is list:
        (item,) = typing.get_args(annotation)
        return f"a list of {_plural(item)}"
    if origin is dict:
        return "a mapping of names to plain values"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[
        annotation
    ]


def _plural(annotation: Any) -> str:
    if typing.get_origin(annotation) is dict:
        return "mappings"
    return {int: "integers", float: "numbers", str: "strings", bool: "booleans"}.get(
        annotation, describe(annotation)
    )


def _to_number(text: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise _Mismatch() from None


def _coerce(value: Any, annotation: Any, from_text: bool) -> Any:
    origin = typing.get_origin(annotation)
    if annotation is type(None):
        if value is None:
            return None
        raise _Mismatch()
    if origin in (Union, types.UnionType):
        for option in typing.get_args(annotation):
            try:
                return _coerce(value, option, from_text)
            except _Mismatch:
                continue
        raise _Mismatch()
    if origin is Literal:
        # isinstance guard: True == 1, so a bool must not match an int choice (and vice versa).
        for choice in typing.get_args(annotation):
            if type(value) is type(choice) and value == choice:
                return choice
        raise _Mismatch()
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise _Mismatch()
        (item,) = typing.get_args(annotation)
        return [_coerce(v, item, from_text) for v in value]
    if origin is dict:
        # dict[str, Any]: a mapping of plain values (a reward's parameters), kept as given.
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise _Mismatch()
        if not all(_is_plain(v) for v in value.values()):
            raise _Mismatch()
        return dict(value)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch()
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_text and isinstance(value, (float, str)) and not isinstance(value, bool):
            # "1e4" or 1e4 (YAML) -> 10000, but 2.5 is not an integer.
            if isinstance(value, str):
                try:
                    return int(value.strip())
                except ValueError:
                    pass
            number = _to_number(value) if isinstance(value, str) else value
            if math.isfinite(number) and number.is_integer():
                return int(number)
        raise _Mismatch()
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if from_text and isinstance(value, str):
            return _to_number(value)
        raise _Mismatch()
    if annotation is str:
        if isinstance(value, str):
            return value
        raise _Mismatch()
    raise TypeError(f"config fields of type {annotation!r} are not supported by coerce_value")


def _is_plain(value: Any) -> bool:
    """YAML's scalars and lists of them (no nested mappings)."""
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def coerce_value(name: str, value: Any, annotation: Any, *, from_text: bool = False) -> Any:
    """Check ``value`` against the field annotation and return it in canonical form.

    Args:
        name: the field name (for the error message).
        value: the value given.
        annotation: the field's resolved type (``typing.get_type_hints``).
        from_text: the value came from YAML or the command line, so numbers written as strings
            (``"1e-5"``, ``"1e4"`` for an int) are accepted.

    Raises:
        ValueError: naming the field, the value, the accepted values and what to change.
    """
    try:
        return _coerce(value, annotation, from_text)
    except _Mismatch:
        pass
    accepted = describe(annotation)
    message = f"{name} must be {accepted}, got {value!r} ({type(value).__name__})"
    raise ValueError(f"{message}: {_fix(name, value, annotation, accepted)}")


def _fix(name: str, value: Any, annotation: Any, accepted: str) -> str:
    """What to change, for a value of the wrong type."""
    members = union_members(annotation)
    choices = _literal_choices(annotation)
    if choices:
        close = difflib.get_close_matches(value, choices, n=1) if isinstance(value, str) else []
        return f"did you mean {close[0]!r}?" if close else "choose one of the values listed"
    if bool in members:
        return "write true or false"
    if str in members and value is not None:
        return f"quote it in YAML ({name}: '{value}')"
    if any(typing.get_origin(m) is list for m in members):
        if isinstance(value, (list, tuple)):
            (item,) = [typing.get_args(m)[0] for m in members if typing.get_origin(m) is list]
            return f"every element must be {describe(item)}"
        return f"write a list, e.g. {name}: [{value!r}]"
    if isinstance(value, str):
        return "write a number, without quotes"
    if int in members and isinstance(value, float):
        return f"use a whole number, e.g. {name}: {round(value)}"
    return f"set {name} to {accepted}"


def union_members(annotation: Any) -> tuple[Any, ...]:
    """The members of ``X | Y`` (or ``(annotation,)`` for a non-union)."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _literal_choices(annotation: Any) -> list[str]:
    return [
        choice
        for option in union_members(annotation)
        if typing.get_origin(option) is Literal
        for choice in typing.get_args(option)
        if isinstance(choice, str)
    ]


@cache
def own_field_types(cls: type) -> dict[str, Any]:
    """Resolved annotations of the fields declared in ``cls``'s own body (not inherited)."""
    hints = typing.get_type_hints(cls)
    own = inspect.get_annotations(cls)
    return {f.name: hints[f.name] for f in fields(cls) if f.name in own}


def check_field_types(obj: object, cls: type) -> None:
    """Type-check (and canonicalise in place) the fields that ``cls`` declares, on ``obj``.

    Called first thing in each config's ``__post_init__``, so the range checks that follow compare
    numbers with numbers. Python callers get no string-to-number conversion (``from_text=False``).
    """
    for name, annotation in own_field_types(cls).items():
        value = getattr(obj, name)
        checked = coerce_value(name, value, annotation)
        if checked is not value:
            setattr(obj, name, checked)
