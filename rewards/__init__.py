"""Rewards by name: the built-in verifiable rewards of reasoning RL (think format, math and
multiple-choice accuracy, code tests, length and repetition shaping), local LLM judges, and a
registry a user's rewards join.

::

    from rewards import resolve_reward, list_rewards
    accuracy = resolve_reward("math_accuracy")
    mine = resolve_reward("my_package.rewards:brevity")
    overlong = resolve_reward({"name": "soft_overlong", "max_length": 512, "cache": 64})
"""

from rewards import builtin as builtin  # registers the built-ins
from rewards import judge as judge  # registers judge and group_judge
from rewards.registry import (
    RewardFn,
    RewardInfo,
    bind_reward,
    check_reward_columns,
    list_rewards,
    register_reward,
    required_columns,
    resolve_reward,
    reward_spec_name,
    rewards_text,
)

__all__ = [
    "RewardFn",
    "RewardInfo",
    "bind_reward",
    "check_reward_columns",
    "list_rewards",
    "register_reward",
    "required_columns",
    "resolve_reward",
    "reward_spec_name",
    "rewards_text",
]
