"""Environments (TRL's ``environment_factory`` contract): one environment per rollout, whose
public methods are its tools.

``factory()`` returns a fresh environment; ``env.reset(**record)`` gets the prompt's record (its
``prompt`` and every other field of the dataset row) and returns text appended to the prompt's
last user message, or None; each public method other than ``reset`` and ``get_reward`` (a name
not starting with ``_``) is a tool, described like a function tool (type hints and a Google
docstring); ``env.get_reward()``, optional, scores the finished episode: one float, or a list
with one float per assistant turn (a reward per action).

Seeded environments: a factory that takes a ``seed`` keyword (a class whose ``__init__`` has a
``seed`` parameter) is called as ``factory(seed=...)`` with a seed per rollout that the trainer
derives from the run's seed, the step and the rollout's place in the global batch; one that does
not is called as ``factory()``, as TRL calls it.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable
from typing import Any

from agents.tools import Tool, make_tools

#: Methods of an environment that are not tools.
RESERVED_METHODS = ("reset", "get_reward")


def environment_tools(env: Any) -> list[Tool]:
    """The tools of ``env``: the public methods its class defines (also static and class
    methods) except :data:`RESERVED_METHODS`, bound to it, in name order. Properties and other
    attributes are not read (looking for tools runs none of the environment's code).

    Raises:
        ValueError: a method cannot be described (no type hints or docstring), naming it.
    """
    methods = []
    for name in sorted(dir(type(env))):
        if name.startswith("_") or name in RESERVED_METHODS:
            continue
        static = inspect.getattr_static(env, name)
        if inspect.isfunction(static) or isinstance(static, (staticmethod, classmethod)):
            methods.append(getattr(env, name))
    return make_tools(methods)


def takes_seed(factory: Callable[..., Any]) -> bool:
    """Whether ``factory`` accepts a ``seed`` keyword argument (a parameter of that name;
    ``**kwargs`` alone does not count: a factory says it is seeded by naming it)."""
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature: not seeded
        return False
    seed = parameters.get("seed")
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return seed is not None and seed.kind in kinds


def build_environment(factory: Callable[..., Any], seed: int) -> Any:
    """A fresh environment: ``factory(seed=seed)`` when the factory takes a seed
    (:func:`takes_seed`), else ``factory()`` (TRL's zero-argument contract)."""
    return factory(seed=seed) if takes_seed(factory) else factory()


def factory_name(factory: Callable[..., Any]) -> str:
    """``module:qualname`` of ``factory`` (a class or function), as a checkpoint records it; an
    instance with ``__call__`` is named by its class."""
    named = factory if hasattr(factory, "__qualname__") else type(factory)
    module = getattr(named, "__module__", None) or "?"
    return f"{module}:{getattr(named, '__qualname__', repr(named))}"


def check_environment_factory(factory: Callable[..., Any]) -> None:
    """Build one environment and check it against the contract, before any rollout.

    A factory that takes a ``seed`` is called with ``seed=0``.

    Raises:
        ValueError: ``factory`` is not callable, its environment has no ``reset`` method, has
            no tools, or a tool cannot be described; each message says what to add.
    """
    if not callable(factory):
        raise ValueError(
            "environment_factory must be a callable returning a fresh environment (e.g. the "
            f"class itself), got {type(factory).__name__}"
        )
    env = build_environment(factory, 0)
    name = type(env).__name__
    if not callable(getattr(env, "reset", None)):
        raise ValueError(
            f"environment {name} has no reset method: define reset(self, **kwargs) -> str | None "
            "(it gets the prompt's record and returns text to add to the prompt, or None)"
        )
    reward = getattr(env, "get_reward", None)
    if reward is not None and not callable(reward):
        raise ValueError(f"environment {name}: get_reward must be a method, got {reward!r}")
    if not environment_tools(env):
        raise ValueError(
            f"environment {name} has no tools: its public methods (other than reset and "
            "get_reward, names not starting with '_') are the tools the model calls; define at "
            "least one, with type hints and a Google-style docstring"
        )


def check_reward(value: Any, turns: int, env_name: str) -> float | list[float]:
    """``env.get_reward()``'s value checked: a finite float, or a list of ``turns`` finite floats
    (one per assistant turn).

    Raises:
        ValueError: another type, a list of another length, or a non-finite value.
    """

    def finite(x: Any) -> float:
        if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x):
            raise ValueError(
                f"environment {env_name}: get_reward() must return finite numbers, got {x!r}"
            )
        return float(x)

    if isinstance(value, (list, tuple)):
        if len(value) != turns:
            raise ValueError(
                f"environment {env_name}: get_reward() returned {len(value)} rewards for an "
                f"episode of {turns} assistant turns; return one per turn, or one float"
            )
        return [finite(x) for x in value]
    return finite(value)
