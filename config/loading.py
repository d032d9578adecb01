"""Read a run config from YAML plus ``key=value`` overrides, and write it back.

The YAML is either flat::

    model_name: Qwen/Qwen2.5-0.5B-Instruct
    learning_rate: 1e-5

or grouped in the sections ``model:``, ``training:`` and ``ppo:`` (which are merged, so a key in
the "wrong" section is fine, but a key given twice is an error)::

    model:
      model_name: Qwen/Qwen2.5-0.5B-Instruct
    training:
      learning_rate: 1e-5

and the algorithm may carry its own settings, which must apply to it (``python main.py config
--kind grpo`` lists them)::

    algorithm:
      name: grpo
      group_size: 4
      beta: 0.04

Every key is checked against the dataclass fields (unknown keys get "did you mean" suggestions) and
every value against the field's type before the dataclass is built, so a malformed file fails with
one message that lists all its problems.
"""

import dataclasses
import inspect
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, overload

import yaml

from config._fields import close_keys, coerce_value, union_members
from config.model_config import ModelConfig
from config.ppo_config import PPOConfig
from config.training_config import TrainingConfig
from config.trl_names import TRL_ALIASES, from_trl_value
from algorithms.registry import algorithm_keys, get_algorithm

C = TypeVar("C")

SECTIONS: tuple[str, ...] = ("model", "training", "ppo")
"""Section names a config file may group its keys under."""

_SECTION_OWNERS: tuple[tuple[type, str], ...] = (
    (ModelConfig, "model"),
    (TrainingConfig, "training"),
    (PPOConfig, "ppo"),
)


@overload
def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    base: Mapping[str, Any] | None = None,
) -> PPOConfig: ...


@overload
def load_config(
    path: str | Path | None,
    overrides: Sequence[str],
    cls: type[C],
    *,
    base: Mapping[str, Any] | None = None,
) -> C: ...


@overload
def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    cls: type[C],
    base: Mapping[str, Any] | None = None,
) -> C: ...


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    cls: type[Any] = PPOConfig,
    *,
    base: Mapping[str, Any] | None = None,
) -> Any:
    """Build a config from a YAML file, then apply ``key=value`` overrides.

    Args:
        path: YAML file, flat or in ``model:`` / ``training:`` / ``ppo:`` sections; None = start
            from the dataclass defaults (then ``model_name`` must come from an override).
        overrides: strings ``"key=value"`` applied after the file, later ones winning. The value
            is parsed as YAML (``1e-5``, ``true``, ``[1, 2]``, ``null``); the key may use dashes
            (``max-new-tokens``) and a section prefix (``ppo.kl_coef``).
        cls: the config dataclass to build (:class:`PPOConfig`, or a subclass or part of it).
        base: a flat ``{field: value}`` mapping to start from instead of the defaults (a resumed
            run's own config, as its checkpoint recorded it); the file's keys and the overrides
            apply on top. Its keys that ``cls`` no longer has are left out.

    Returns:
        The validated ``cls`` instance.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not a mapping, a key is unknown or given twice, a value has the
            wrong type or range, or a required field (``model_name``) is missing. The message
            names the key, where it came from, and what to change.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"cls must be a config dataclass such as PPOConfig, got {cls!r}")
    types = _field_types(cls)
    # (key, value, where) in the order they apply: the file, then each override.
    entries: list[tuple[str, Any, str]] = []
    problems: list[str] = []
    source = "defaults"
    if base is not None:
        source = "saved config"
        entries += [(k, v, "the saved config") for k, v in base.items() if k in types]
    if path is not None:
        path = Path(path)
        source = str(path) if base is None else f"{source} + {path}"
        entries += [(k, v, f"config file {path}") for k, v in _read_yaml(path).items()]
    for override in overrides:
        try:
            key, raw = _split_override(override)
        except ValueError as err:
            problems.append(str(err))
            continue
        target = key if key in types else TRL_ALIASES.get(key, key)
        # A TRL name's value is read as YAML (scale_rewards=false), then converted.
        annotation = Any if target != key else types.get(key)
        value = _parse_override_value(raw, annotation) if target in types else raw
        entries.append((key, value, f"override {override!r}"))
    if overrides:
        source += " + overrides"

    values: dict[str, Any] = {}
    bad_values: dict[str, str] = {}  # a later valid value (an override) clears the problem
    named: dict[tuple[str, str], str] = {}  # (field, where) -> the name it was given by
    for key, value, where in entries:
        if key not in types and TRL_ALIASES.get(key) in types:
            alias, key, value = key, TRL_ALIASES[key], from_trl_value(key, value)
            if named.get((key, where), alias) != alias:
                problems.append(f"{key} is given twice in {where} (also as {alias!r}); keep one")
            named[(key, where)] = alias
        elif (key, where) in named and named[(key, where)] != key:
            problems.append(
                f"{key} is given twice in {where} (also as {named[(key, where)]!r}); keep one"
            )
        else:
            named[(key, where)] = key
        if key not in types:
            problems.append(_unknown_key(key, where, types, cls))
            continue
        try:
            values[key] = coerce_value(key, value, types[key], from_text=True)
            bad_values.pop(key, None)
        except ValueError as err:
            values.pop(key, None)
            bad_values[key] = f"{err} (in {where})"
    problems += bad_values.values()

    for field in dataclasses.fields(cls):
        required = (
            field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        )
        if required and field.name not in values and field.name not in bad_values:
            where = f"set it in {path}" if path is not None else "set it in a config file"
            problems.append(
                f"{field.name} is required: {where} (--config) or on the command line with "
                f"--set {field.name}=..."
            )

    if problems:
        raise ValueError(f"invalid config ({source}):\n  " + "\n  ".join(problems))
    try:
        return cls(**values)
    except ValueError as err:
        raise ValueError(f"invalid config ({source}): {err}") from err


def given_value(
    key: str, path: str | Path | None, overrides: Sequence[str], cls: type[Any] = PPOConfig
) -> Any:
    """What the file at ``path`` and the overrides give ``key`` (the last one wins), else its
    default; not validated (:func:`load_config` reports a bad value). For a setting needed before
    the config can be built: ``output_dir``, where a resumed run is found."""
    types = _field_types(cls)
    value = next(f.default for f in dataclasses.fields(cls) if f.name == key)
    if path is not None:
        value = _read_yaml(Path(path)).get(key, value)
    for override in overrides:
        try:
            name, raw = _split_override(override)
        except ValueError:
            continue
        if name == key:
            value = _parse_override_value(raw, types[key])
    return value


def config_to_dict(config: Any, *, sectioned: bool = False) -> dict[str, Any]:
    """The fields of a config dataclass as plain YAML-able values.

    Args:
        config: a config dataclass instance (:class:`PPOConfig`, :class:`ModelConfig`, ...).
        sectioned: group the fields under ``"model"``, ``"training"`` and ``"ppo"`` (fields of a
            subclass that none of those declare stay at the top level).

    Returns:
        ``{field: value}`` in the order model, training, ppo fields, or ``{section: {field:
        value}}`` when ``sectioned``. Lists are copies.
    """
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(f"config must be a config dataclass instance, got {config!r}")
    flat = dataclasses.asdict(config)
    grouped: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    top: dict[str, Any] = {}
    for name, value in flat.items():
        section = _section_of(type(config), name)
        (grouped[section] if section is not None else top)[name] = value
    if sectioned:
        return {**{s: grouped[s] for s in SECTIONS if grouped[s]}, **top}
    return {name: value for section in grouped.values() for name, value in section.items()} | top


def save_config(config: Any, path: str | Path) -> Path:
    """Write ``config`` as sectioned YAML that :func:`load_config` reads back to an equal object.

    Creates the parent directories. Returns the path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (
        f"# {type(config).__name__} written by config.save_config; "
        "read it back with config.load_config.\n"
    )
    body = yaml.safe_dump(
        config_to_dict(config, sectioned=True), sort_keys=False, default_flow_style=False
    )
    path.write_text(header + body, encoding="utf-8")
    return path


def field_docs(cls: type, *, inherited: bool = True) -> dict[str, str]:
    """Each field's description, from the "Attributes:" sections of the class docstrings.

    Each field is documented once, in the docstring of the class that declares it; this collects
    them (for ``--help`` output) in field order. With ``inherited=False`` only ``cls``'s own
    docstring is read.
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__) if inherited else (cls,):
        docs.update(_attributes_section(klass.__dict__.get("__doc__") or ""))
    names = [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []
    return {name: docs[name] for name in names if name in docs}


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _read_yaml(path: Path) -> dict[str, Any]:
    """The file's keys merged across the top level and the sections, duplicates rejected."""
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    with path.open(encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as err:
            raise ValueError(f"config file {path} is not valid YAML: {err}") from err
    if data is None:  # an empty file: all defaults
        return {}
    if not isinstance(data, dict):
        raise ValueError(
            f"config file {path} must be a mapping of field: value (or of sections "
            f"{', '.join(SECTIONS)}), got a {type(data).__name__}"
        )
    merged: dict[str, Any] = {}
    where: dict[str, str] = {}
    for key, value in data.items():
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise ValueError(
                    f"config file {path}: {key!r} is a section and must be a mapping of "
                    f"field: value, got {value!r}; indent the fields under '{key}:' "
                    f"(e.g. model_name under model:)"
                )
            entries = [(k, v, f"section '{key}'") for k, v in value.items()]
        elif key == "algorithm" and isinstance(value, dict):
            entries = _algorithm_section(path, value)
        else:
            entries = [(key, value, "the top level")]
        for name, item, place in entries:
            if not isinstance(name, str):
                raise ValueError(
                    f"config file {path}: key {name!r} in {place} is not a string; quote it"
                )
            if name in merged:
                raise ValueError(
                    f"config file {path}: {name!r} is given twice ({where[name]} and {place}); "
                    f"keep one"
                )
            merged[name] = item
            where[name] = place
    return merged


def _algorithm_section(path: Path, section: dict[Any, Any]) -> list[tuple[Any, Any, str]]:
    """``algorithm: {name: grpo, <key>: <value>, ...}`` as flat entries: ``algorithm`` = the
    name, then the keys, each of which must apply to that algorithm (a key of other algorithms
    only would do nothing)."""
    place = "section 'algorithm'"
    name = section.get("name")
    if not isinstance(name, str):
        raise ValueError(
            f"config file {path}: section 'algorithm' must name the algorithm, e.g. "
            f"algorithm: {{name: grpo, beta: 0.04}}, got {section!r}"
        )
    try:
        algorithm = get_algorithm(name)
    except ValueError as err:
        raise ValueError(f"config file {path}: {err}") from err
    others = algorithm_keys() - algorithm.keys
    entries: list[tuple[Any, Any, str]] = [("algorithm", name, place)]
    for key, value in section.items():
        if key == "name":
            continue
        if TRL_ALIASES.get(key, key) in others:
            raise ValueError(
                f"config file {path}: {key} in section 'algorithm' does not apply to algorithm "
                f"{name!r} (`python main.py config --kind {name}` lists what does); remove it, "
                "or name the algorithm it is for"
            )
        entries.append((key, value, place))
    return entries


def _split_override(override: str) -> tuple[str, str]:
    key, sep, raw = override.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key:
        raise ValueError(f"override {override!r} must look like key=value, e.g. learning_rate=1e-5")
    prefix, dot, rest = key.partition(".")
    if dot and prefix in SECTIONS:
        key = rest
    elif dot and prefix == "algorithm":  # algorithm.name=grpo, algorithm.beta=0.04
        key = "algorithm" if rest == "name" else rest
    return key, raw


def _parse_override_value(raw: str, annotation: Any) -> Any:
    """Parse a command-line value as YAML; keep the raw text where a string is wanted."""
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw.strip()  # not YAML, but may be a valid string value
    if str in union_members(annotation) and value is not None and not isinstance(value, str):
        # output_dir=2024 is the directory "2024", not the integer 2024 (same for "a: b").
        return raw.strip()
    return value


def _unknown_key(key: str, where: str, types: dict[str, Any], cls: type) -> str:
    """One line: the closest keys (ours or TRL's names of them), else where every key is
    listed (a list of 100 keys on one line helps nobody)."""
    names = list(types) + [alias for alias, ours in TRL_ALIASES.items() if ours in types]
    close = close_keys(key, names)
    if close:
        hint = "did you mean " + " or ".join(repr(c) for c in close) + "?"
    else:
        kind = _CONFIG_KINDS.get(cls.__name__)
        where = (
            f"`python main.py config --kind {kind}` lists every key"
            if kind is not None
            else "`python main.py config --kind ppo` (or grpo, rloo, ...: an algorithm) lists "
            "the keys of a run of it"
        )
        hint = (
            f"no key of this kind of run is close; {where} with its meaning (docs/configuration.md)"
        )
    return f"unknown config key {key!r} in {where}: {hint}"


#: ``python main.py config --kind`` of each config class.
_CONFIG_KINDS = {"SFTConfig": "sft", "RewardConfig": "reward", "DPOConfig": "dpo"}


def _section_of(cls: type, name: str) -> str | None:
    for owner, section in _SECTION_OWNERS:
        if issubclass(cls, owner) and name in {f.name for f in dataclasses.fields(owner)}:
            return section
    return None


def _attributes_section(doc: str) -> dict[str, str]:
    """Parse a Google-style "Attributes:" section (``name: text``, indented continuations)."""
    entries: dict[str, str] = {}
    lines = inspect.cleandoc(doc).splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "Attributes:"), None)
    if start is None:
        return entries
    header_indent = len(lines[start]) - len(lines[start].lstrip())
    entry_indent: int | None = None
    current = ""
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent <= header_indent:
            break
        if entry_indent is None:
            entry_indent = indent
        if indent == entry_indent:
            current, _, text = line.strip().partition(":")
            entries[current] = text.strip()
        elif current:
            entries[current] += " " + line.strip()
    return entries
