"""The reward registry: built-in rewards by name, a user's by ``"package.module:function"``.

Every reward is a plain function ``fn(prompts, completions, **columns) -> list[float | None]``
(None: the reward does not apply to that completion, as TRL's reward functions), where
``columns`` are the prompt records' fields (``answer``, ``tests``, ...) repeated per completion.
:func:`resolve_reward` turns a name (or a config entry with parameters) into that function.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, cast

RewardFn = Callable[..., list[float | None]]
"""``fn(prompts, completions, **columns) -> list[float | None]``."""

#: The parameters every reward receives from the trainer, never from the config.
CALL_ARGUMENTS = frozenset({"prompts", "completions", "completion_ids", "log_extra", "log_metric"})


@dataclass(frozen=True)
class RewardInfo:
    """One registered reward.

    Attributes:
        name: what a config calls it (``reward_funcs: [math_accuracy]``).
        fn: the function.
        columns: the prompt-record columns it reads; ``"a|b"`` means either ``a`` or ``b``.
        summary: the first line of its docstring.
    """

    name: str
    fn: RewardFn
    columns: tuple[str, ...]
    summary: str


_REGISTRY: dict[str, RewardInfo] = {}


def register_reward(
    name: str, *, columns: Collection[str] = (), replace: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: add ``fn`` to the registry under ``name`` (``reward_funcs: [name]``).

    Args:
        name: the registry name; must not be taken already, unless ``replace``.
        columns: the record columns the reward reads (``"answer|solution"``: either), checked
            against the prompt records before any rollout (:func:`check_reward_columns`).
        replace: let ``fn`` take the name from the reward that holds it (a function a script
            defined again under the same name, as a notebook does).

    Raises:
        ValueError: ``name`` is empty, contains ``:``, or is registered already.
    """
    if not name or ":" in name or name != name.strip():
        raise ValueError(f"a reward name must be a plain word such as 'my_reward', got {name!r}")

    def add(fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in _REGISTRY and _REGISTRY[name].fn is not fn and not replace:
            raise ValueError(
                f"a reward named {name!r} is registered already ({_REGISTRY[name].fn.__module__})"
                ": choose another name"
            )
        summary = first_sentence(inspect.getdoc(fn) or "")
        fn.reward_columns = tuple(columns)  # type: ignore[attr-defined]
        _REGISTRY[name] = RewardInfo(name, cast(RewardFn, fn), tuple(columns), summary)
        return fn

    return add


def first_sentence(doc: str) -> str:
    """The first sentence of a docstring's first paragraph, on one line."""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    paragraph = re.sub(r":\w+:`([^`]*)`", r"\1", paragraph).replace("``", "")
    end = paragraph.find(". ")
    return paragraph if end < 0 else paragraph[: end + 1]


def list_rewards() -> list[RewardInfo]:
    """Every registered reward, by name."""
    return [_REGISTRY[name] for name in sorted(_REGISTRY)]


def reward_spec_name(spec: str | Mapping[str, Any]) -> str:
    """The name of a ``reward_funcs`` entry: a string, or a mapping's ``name``."""
    if isinstance(spec, str):
        return spec.strip()
    name = spec.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(
            f"a reward_funcs entry with parameters needs a 'name', got {dict(spec)!r}: write e.g. "
            "{name: soft_overlong, max_length: 512}"
        )
    return name.strip()


def resolve_reward(spec: str | Mapping[str, Any], **params: Any) -> RewardFn:
    """The reward function a name, path or config entry stands for.

    ``"math_accuracy"`` is a registered reward; ``"package.module:function"`` is imported;
    ``{"name": "soft_overlong", "max_length": 512}`` is ``soft_overlong`` with those keyword
    parameters bound (as are ``params``).

    Raises:
        ValueError: an unknown name (with the close matches), a module or function that cannot
            be imported, a parameter the reward does not take, or a required one left unset.
    """
    name = reward_spec_name(spec)
    if not isinstance(spec, str):
        params = {**{k: v for k, v in spec.items() if k != "name"}, **params}
    if ":" in name:
        fn = _import_function(name)
        label = name.rpartition(":")[2]
    elif name in _REGISTRY:
        fn = _REGISTRY[name].fn
        label = name
    else:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ValueError(
            f"unknown reward {name!r}: {hint}the built-in rewards are {sorted(_REGISTRY)} "
            "(python main.py rewards lists them), or give a function as 'package.module:function'"
        )
    return bind_reward(fn, params, label)


def required_columns(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The record columns a reward reads (``register_reward(columns=...)``); () if it names none
    (a user's function: its signature says, see ``ppo_trainer.prompt_records``)."""
    return tuple(getattr(fn, "reward_columns", ()))


def check_reward_columns(fn: Callable[..., Any], column_names: Collection[str]) -> None:
    """Raise ``ValueError`` (before any rollout) if the prompt records lack a column ``fn``
    reads."""
    for needed in required_columns(fn):
        options = needed.split("|")
        if not any(option in column_names for option in options):
            label = getattr(fn, "__name__", repr(fn))
            wanted = " or ".join(repr(o) for o in options)
            raise ValueError(
                f"the reward {label} reads the column {wanted}, but the prompt records carry "
                f"{sorted(column_names) or 'no columns'}: give each record a {options[0]!r} "
                f'field, e.g. {{"prompt": ..., "{options[0]}": ...}}'
            )


def _import_function(spec: str) -> RewardFn:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(
            f"a reward function must look like 'package.module:function', got {spec!r}"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{spec}: cannot import {module_name} ({err})") from err
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{spec}: {attr} is not a function in {module_name}")
    return cast(RewardFn, fn)


def settable_parameters(fn: Callable[..., Any]) -> list[str]:
    """The parameters a config may set on ``fn`` (not the call's arguments, not its columns)."""
    columns = {c for needed in required_columns(fn) for c in needed.split("|")}
    return [
        p.name
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and p.name not in CALL_ARGUMENTS
        and p.name not in columns
    ]


def bind_reward(fn: RewardFn, params: Mapping[str, Any], label: str) -> RewardFn:
    """``fn`` with the config's ``params`` bound as keywords (``fn`` itself when there are none),
    named ``label``, after checking that it takes them and that no required keyword-only
    parameter is left unset.

    Raises:
        ValueError: a parameter ``fn`` does not take (or a column), or one it needs is missing.
    """
    takes = inspect.signature(fn).parameters
    settable = sorted(settable_parameters(fn))
    unknown = sorted(set(params) - set(settable))
    if unknown:
        raise ValueError(
            f"the reward {label} has no parameter {unknown}: its parameters are "
            f"{settable or 'none'}"
        )
    unset = [n for n in settable if takes[n].default is inspect.Parameter.empty and n not in params]
    if unset and any(takes[n].kind is inspect.Parameter.KEYWORD_ONLY for n in unset):
        raise ValueError(
            f"the reward {label} needs the parameter(s) {unset}: write e.g. "
            f"{{name: {label}, {unset[0]}: ...}} in reward_funcs"
        )
    if not params:
        return fn
    bound = functools.partial(fn, **params)
    bound.__name__ = label  # type: ignore[attr-defined]
    bound.__qualname__ = label  # type: ignore[attr-defined]
    bound.reward_columns = required_columns(fn)  # type: ignore[attr-defined]
    return cast(RewardFn, bound)


def rewards_text(infos: list[RewardInfo]) -> str:
    """One line per reward: its name, the record columns it reads (and ``completion_ids`` when
    it reads the token ids), its summary (``python main.py rewards``)."""
    lines = []
    width = max((len(info.name) for info in infos), default=0)
    for info in infos:
        reads = [c.replace("|", " or ") for c in info.columns]
        if "completion_ids" in inspect.signature(info.fn).parameters:
            reads.append("completion_ids (from the trainer)")
        columns = f" [reads {', '.join(reads)}]" if reads else ""
        params = settable_parameters(info.fn)
        settings = f" [parameters: {', '.join(params)}]" if params else ""
        lines.append(f"{info.name:<{width}}  {info.summary}{columns}{settings}")
    return "\n".join(lines) + "\n"
