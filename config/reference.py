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


@dataclasses.dataclass(frozen=True)
class KeyInfo:
    """One config key: its name, what values it takes, its default (as YAML writes it), the YAML
    section it may sit under (PPO configs), and its description."""

    name: str
    accepts: str
    default: str
    section: str | None
    doc: str


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


def config_keys(kind: str) -> list[tuple[str, list[KeyInfo]]]:
    """``[(part title, [KeyInfo, ...]), ...]`` for a run kind ("ppo", "sft" or "reward"): every
    field of its config once, grouped by the class that documents it.

    Raises:
        ValueError: an unknown kind.
    """
    if kind not in RUN_CONFIGS:
        raise ValueError(f"kind must be one of {sorted(RUN_CONFIGS)}, got {kind!r}")
    cls = RUN_CONFIGS[kind]
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
            keys.append(
                KeyInfo(
                    name=name,
                    accepts=describe(hints[name]),
                    default=_default(fields[name]),
                    section=_section_of(cls, name),
                    doc=docs[name],
                )
            )
        groups.append((title, keys))
    missing = sorted(set(fields) - seen)
    if missing:
        raise ValueError(f"{cls.__name__} fields without a documented place: {missing}")
    return groups


def keys_text(kind: str) -> str:
    """The keys of a run kind as plain text (``python main.py config --kind KIND``)."""
    lines = []
    for title, keys in config_keys(kind):
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
        "docstrings are the source): `python main.py config --kind ppo` prints the same. A YAML",
        "file sets keys flat or (PPO) under the sections `model:`, `training:` and `ppo:`; `--set",
        "key=value` overrides one on the command line. This page is regenerated by",
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
                accepts = key.accepts.replace("|", "\\|")
                out.append(f"| `{key.name}` | `{key.default}` | {accepts} | {doc} |")
            out.append("")
    return "\n".join(out)
