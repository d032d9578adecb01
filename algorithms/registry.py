"""Every algorithm by its config name. Adding one is a file in ``algorithms/`` and a line here
(docs/algorithms.md, "Adding an algorithm")."""

from __future__ import annotations

import difflib

from algorithms.base import Algorithm
from algorithms.distill import Distill
from algorithms.gkd import GKD
from algorithms.grpo import GRPO
from algorithms.online_dpo import OnlineDPO
from algorithms.ppo import PPO
from algorithms.reinforce_pp import ReinforcePP
from algorithms.reinforce_pp_baseline import ReinforcePPBaseline
from algorithms.rloo import RLOO

#: ``{name: algorithm}``; ``PPOConfig.algorithm`` is one of these names.
ALGORITHMS: dict[str, Algorithm] = {
    algorithm.name: algorithm
    for algorithm in (
        PPO(),
        GRPO(),
        RLOO(),
        ReinforcePP(),
        ReinforcePPBaseline(),
        Distill(),
        GKD(),
        OnlineDPO(),
    )
}


def get_algorithm(name: object) -> Algorithm:
    """The algorithm called ``name``.

    Raises:
        ValueError: no algorithm has that name; the message names the closest ones.
    """
    if isinstance(name, str) and name in ALGORITHMS:
        return ALGORITHMS[name]
    close = difflib.get_close_matches(name, list(ALGORITHMS), n=2) if isinstance(name, str) else []
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    raise ValueError(
        f"algorithm must be one of {', '.join(repr(n) for n in ALGORITHMS)}, got {name!r}: "
        f"{hint}A new algorithm is a file in algorithms/ and a line in algorithms/registry.py "
        "(docs/algorithms.md)"
    )


def algorithm_keys() -> frozenset[str]:
    """The config keys that apply to only some algorithms: those any algorithm lists in its
    ``keys``. Every other key applies to every algorithm."""
    return frozenset().union(*(algorithm.keys for algorithm in ALGORITHMS.values()))
