"""Every config key of every run kind, from the dataclasses themselves: what
``python main.py config`` prints and what ``docs/configuration.md`` holds (a test regenerates the
file and compares, so the page cannot drift from the code).
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
import typing
from typing import Any

from algorithms.registry import ALGORITHMS, algorithm_keys, get_algorithm
from config._fields import describe
from config.agent_config import AgentConfig
from config.loading import _section_of, field_docs
from config.model_config import LoraConfig, ModelConfig
from config.ppo_config import PPOConfig
from config.dpo_config import DPOConfig
from config.reward_config import RewardConfig
from config.sft_config import FineTuneConfig, SFTConfig
from config.training_config import OptimConfig, TrainingConfig

#: The run kinds and their configs, as the commands name them.
RUN_CONFIGS: dict[str, type] = {
    "ppo": PPOConfig,
    "sft": SFTConfig,
    "reward": RewardConfig,
    "dpo": DPOConfig,
}
#: The classes a kind's fields come from, in the order their tables are printed.
_PARTS: dict[str, tuple[tuple[str, type], ...]] = {
    "ppo": (
        ("models", ModelConfig),
        ("LoRA", LoraConfig),
        ("optimisation and bookkeeping", OptimConfig),
        ("PPO optimisation", TrainingConfig),
        ("the algorithm", PPOConfig),
        ("agents: tools and environments", AgentConfig),
    ),
    "sft": (
        ("model and data", FineTuneConfig),
        ("LoRA", LoraConfig),
        ("optimisation and bookkeeping", OptimConfig),
        ("SFT", SFTConfig),
    ),
    "reward": (
        ("model and data", FineTuneConfig),
        ("LoRA", LoraConfig),
        ("optimisation and bookkeeping", OptimConfig),
        ("reward model", RewardConfig),
    ),
    "dpo": (
        ("model and data", FineTuneConfig),
        ("LoRA", LoraConfig),
        ("optimisation and bookkeeping", OptimConfig),
        ("preference optimisation", DPOConfig),
    ),
}


#: What ``python main.py config --kind`` takes: each algorithm's name (the keys of a run of it),
#: then the other run kinds.
KINDS: tuple[str, ...] = (*ALGORITHMS, *(kind for kind in RUN_CONFIGS if kind not in ALGORITHMS))


@dataclasses.dataclass(frozen=True)
class KeyInfo:
    """One config key: its name, what values it takes, its default (as YAML writes it), the YAML
    section it may sit under (PPO configs), its description, the algorithms it applies to (None:
    every one, or a kind without algorithms) and the algorithms' own defaults of it."""

    name: str
    accepts: str
    default: str
    section: str | None
    doc: str
    algorithms: tuple[str, ...] | None = None
    algorithm_defaults: tuple[tuple[str, str], ...] = ()


def _yaml_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isinf(value):
        return ".inf"
    if isinstance(value, str):
        return value if value else '""'
    return repr(value) if not isinstance(value, list) else str(value)


def _default(field: dataclasses.Field[Any]) -> str:
    if field.default is not dataclasses.MISSING:
        return _yaml_value(field.default)
    if field.default_factory is not dataclasses.MISSING:
        return _yaml_value(field.default_factory())
    return "(required)"


def config_keys(kind: str, algorithm: str | None = None) -> list[tuple[str, list[KeyInfo]]]:
    """``[(part title, [KeyInfo, ...]), ...]`` for a run kind ("ppo", "sft", "reward" or
    "dpo"): every field of its config once, grouped by the class that documents it. With
    ``algorithm`` (kind "ppo"), only the keys that apply to that algorithm, with its defaults.

    Raises:
        ValueError: an unknown kind or algorithm.
    """
    if kind not in RUN_CONFIGS:
        raise ValueError(f"kind must be one of {sorted(RUN_CONFIGS)}, got {kind!r}")
    cls = RUN_CONFIGS[kind]
    chosen = get_algorithm(algorithm) if algorithm is not None else None
    # Keys that only some algorithms use, and who uses them (PPO runs).
    some = algorithm_keys() if kind == "ppo" else frozenset()
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    seen: set[str] = set()
    groups: list[tuple[str, list[KeyInfo]]] = []
    for title, part in _PARTS[kind]:
        own = field_docs(part, inherited=False)
        keys = []
        for name in own:
            if name in seen or name not in fields:
                continue
            seen.add(name)
            if chosen is not None and name in some and name not in chosen.keys:
                continue  # a key of other algorithms only
            default = _default(fields[name])
            if chosen is not None and name in chosen.defaults:
                default = _yaml_value(chosen.defaults[name])
            accepts = describe(hints[name])
            if kind == "ppo" and name == "algorithm":  # a name of the registry
                accepts = "one of " + ", ".join(repr(n) for n in ALGORITHMS)
                default = chosen.name if chosen is not None else default
            keys.append(
                KeyInfo(
                    name=name,
                    accepts=accepts,
                    default=default,
                    section=_section_of(cls, name),
                    doc=docs[name],
                    algorithms=_users(name) if name in some else None,
                    algorithm_defaults=_algorithm_defaults(name) if kind == "ppo" else (),
                )
            )
        groups.append((title, keys))
    missing = sorted(set(fields) - seen)
    if chosen is not None:
        missing = [name for name in missing if name not in some]
    if missing:
        raise ValueError(f"{cls.__name__} fields without a documented place: {missing}")
    return groups


def _users(name: str) -> tuple[str, ...]:
    return tuple(n for n, algorithm in ALGORITHMS.items() if name in algorithm.keys)


def _algorithm_defaults(name: str) -> tuple[tuple[str, str], ...]:
    return tuple(
        (n, _yaml_value(algorithm.defaults[name]))
        for n, algorithm in ALGORITHMS.items()
        if name in algorithm.defaults
    )


def keys_text(kind: str) -> str:
    """The keys of a run kind as plain text (``python main.py config --kind KIND``); for an
    algorithm's name (:data:`KINDS`), only the keys that apply to a run of it, with its defaults.

    Raises:
        ValueError: a kind that is neither a run kind nor an algorithm.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    algorithm = kind if kind in ALGORITHMS else None
    lines = []
    if algorithm is not None:
        title = ALGORITHMS[algorithm].title
        lines += [
            f"# The keys of a {title} run (algorithm: {algorithm}; python main.py train), with "
            f"{title}'s defaults;",
            "# the keys of the other algorithms only are left out.",
            "",
        ]
    for title, keys in config_keys("ppo" if algorithm is not None else kind, algorithm):
        lines.append(f"# {title}")
        for key in keys:
            lines.append(f"{key.name} = {key.default}    ({key.accepts})")
            lines += textwrap.wrap(key.doc, 96, initial_indent="    ", subsequent_indent="    ")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def configuration_markdown() -> str:
    """``docs/configuration.md``: every key of every run kind, its default and meaning."""
    out = [
        "# Configuration",
        "",
        "Every key of the four run configs, generated from the dataclasses in `config/` (their",
        "docstrings are the source) and the algorithms in `algorithms/`. `python main.py config",
        "--kind sft` (or `reward`, `dpo`) prints a kind's keys; `--kind grpo` (or `ppo`, `rloo`,",
        "`reinforce_pp`, `reinforce_pp_baseline`) those of a run of that algorithm, with its",
        "defaults. A key marked *Only* applies to those algorithms; a default marked *grpo:* is",
        "that algorithm's. A YAML file sets keys flat or (PPO) under the sections `model:`,",
        "`training:` and `ppo:`, and an algorithm's under `algorithm: {name: grpo, beta: 0.04}`;",
        "`--set key=value` overrides one on the command line. This page is regenerated by",
        "`python main.py config --markdown > docs/configuration.md`; a test checks it is current.",
        "",
    ]
    titles = {
        "ppo": "PPO, GRPO, RLOO, REINFORCE++ (`python main.py train`)",
        "sft": "Supervised fine-tuning (`python main.py sft`)",
        "reward": "Reward model (`python main.py reward`)",
        "dpo": "DPO and its family (`python main.py dpo`)",
    }
    for kind in RUN_CONFIGS:
        out += [f"## {titles[kind]}", ""]
        for title, keys in config_keys(kind):
            if not keys:
                continue
            out += [f"### {title}", "", "| key | default | values | meaning |", "|---|---|---|---|"]
            for key in keys:
                doc = key.doc.replace("|", "\\|")
                if key.algorithms is not None:
                    doc = f"*Only {', '.join(key.algorithms)}.* {doc}"
                accepts = key.accepts.replace("|", "\\|")
                default = f"`{key.default}`" + "".join(
                    f" (*{name}:* `{value}`)" for name, value in key.algorithm_defaults
                )
                out.append(f"| `{key.name}` | {default} | {accepts} | {doc} |")
            out.append("")
    return "\n".join(out)
