"""TRL's names for the same run: its GRPO / RLOO keys as aliases of ours.

A recipe copied from TRL's ``GRPOConfig`` loads as it is: ``num_generations: 8`` is our
``group_size: 8``, and so on (:data:`TRL_ALIASES`). A GRPO run's fields that a config does not
set take TRL's GRPO defaults however the config is built
(:data:`config.ppo_config.ALGORITHM_DEFAULTS`). ``beta`` is a field of ours with TRL's meaning
(GRPO's KL weight).
"""

from collections.abc import Mapping
from typing import Any

from config.ppo_config import PPOConfig

#: TRL's key -> ours.
TRL_ALIASES: dict[str, str] = {
    "num_generations": "group_size",
    "num_iterations": "num_ppo_epochs",
    "epsilon": "clip_epsilon",
    "epsilon_high": "clip_epsilon_high",
    "max_completion_length": "max_new_tokens",
    "max_steps": "total_steps",
    "scale_rewards": "grpo_advantage_scale",
    # Not TRL's: the name verl and textpolicy give the turn limit.
    "max_turns": "max_tool_calling_iterations",
}


def from_trl_value(key: str, value: Any) -> Any:
    """A TRL value in our form: ``scale_rewards`` true / false is ``"group"`` / ``"none"``
    (its strings ``"group"``, ``"batch"``, ``"none"`` are ours already)."""
    if key == "scale_rewards" and isinstance(value, bool):
        return "group" if value else "none"
    return value


def from_trl_names(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with TRL's keys renamed to ours (:data:`TRL_ALIASES`).

    Raises:
        ValueError: a key given under both names.
    """
    out: dict[str, Any] = {}
    for key, value in values.items():
        ours = TRL_ALIASES.get(key, key)
        if ours in out:
            raise ValueError(
                f"{ours} is given twice (as {key!r}, TRL's name, and as {ours!r}); keep one"
            )
        out[ours] = from_trl_value(key, value)
    return out


def GRPOConfig(**values: Any) -> PPOConfig:  # noqa: N802 (TRL's name)
    """A GRPO run's :class:`PPOConfig`, from our keys or TRL's (``num_generations``, ``beta``,
    ``epsilon``, ``max_completion_length``, ...), with TRL's GRPO defaults."""
    return PPOConfig(**{"algorithm": "grpo", **from_trl_names(values)})


def RLOOConfig(**values: Any) -> PPOConfig:  # noqa: N802 (TRL's name)
    """An RLOO run's :class:`PPOConfig`, from our keys or TRL's (``num_generations``, ...)."""
    return PPOConfig(**{"algorithm": "rloo", **from_trl_names(values)})
