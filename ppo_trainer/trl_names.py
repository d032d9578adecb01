"""TRL's trainer names over :class:`PPOTrainer`: ``GRPOTrainer(model, reward_funcs, args,
train_dataset).train()`` and ``RLOOTrainer`` run the same trainer with the same config, so a
script written for TRL needs only its imports changed (``args`` from
:func:`config.trl_names.GRPOConfig`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Union

from config.ppo_config import PPOConfig
from config.trl_names import GRPOConfig, RLOOConfig
from models.reward_model import RewardFunction, RewardModel
from ppo_trainer.callbacks import CallbackLike
from ppo_trainer.ppo_trainer import PPOTrainer
from ppo_trainer.prompt_records import PromptInput
from rewards import list_rewards, register_reward

#: What ``reward_funcs`` may be: a name, path or entry with parameters, a function, or a list of
#: those (functions in a list join the reward registry under their ``__name__``).
RewardFuncs = Union[str, Mapping[str, Any], Callable[..., Any], Sequence[Any]]


class GRPOTrainer(PPOTrainer):
    """TRL's ``GRPOTrainer`` signature over :class:`PPOTrainer` (``args.algorithm`` "grpo").

    Args:
        model: the policy's path or repo id (``args.model_name`` when not given).
        reward_funcs: a reward name (``"math_accuracy"``), ``"module:function"``, an entry with
            parameters, a reward function or :class:`RewardModel`, or a list of names, entries
            and functions (weighted by ``args.reward_weights``).
        args: the config (default: :func:`GRPOConfig` with TRL's defaults).
        train_dataset: the prompts (or prompt records) :meth:`train` runs on by default.
        **components: ``policy``, ``ref_model``, ``value_model``, ``tokenizer``, as for
            :class:`PPOTrainer`.
    """

    algorithm: ClassVar[str] = "grpo"

    def __init__(
        self,
        model: str | None = None,
        reward_funcs: RewardFuncs | None = None,
        args: PPOConfig | None = None,
        train_dataset: Sequence[PromptInput] | None = None,
        **components: Any,
    ) -> None:
        if args is None:
            if model is None:
                raise ValueError(f"{type(self).__name__} needs model= or args= (a config)")
            make = GRPOConfig if self.algorithm == "grpo" else RLOOConfig
            args = make(model_name=model)
        elif model is not None and model != args.model_name:
            args = dataclasses.replace(args, model_name=model)
        if args.algorithm != self.algorithm:
            raise ValueError(
                f"{type(self).__name__} runs algorithm {self.algorithm!r}, but args.algorithm is "
                f"{args.algorithm!r}: build args with the matching config, or use PPOTrainer"
            )
        reward: RewardModel | RewardFunction | None = None
        if reward_funcs is not None:
            specs, reward = reward_specs(reward_funcs)
            if specs:
                args = dataclasses.replace(args, reward_funcs=specs)
        self.train_dataset = list(train_dataset) if train_dataset is not None else None
        super().__init__(args, reward_model=reward, **components)

    def train(
        self,
        prompts: Sequence[PromptInput] | None = None,
        num_epochs: int | None = None,
        callbacks: Sequence[CallbackLike] | None = None,
        eval_prompts: Sequence[PromptInput] | None = None,
        resume_from: str | Path | None = None,
    ) -> list[dict[str, float]]:
        """:meth:`PPOTrainer.train` on ``prompts``, by default the ``train_dataset``."""
        if prompts is None:
            if self.train_dataset is None:
                raise ValueError("no prompts: pass train_dataset= to the trainer or prompts=")
            prompts = self.train_dataset
        return super().train(prompts, num_epochs, callbacks, eval_prompts, resume_from)


class RLOOTrainer(GRPOTrainer):
    """TRL's ``RLOOTrainer`` signature over :class:`PPOTrainer` (``args.algorithm`` "rloo")."""

    algorithm: ClassVar[str] = "rloo"


def reward_specs(
    reward_funcs: RewardFuncs,
) -> tuple[list[str | dict[str, Any]], RewardModel | RewardFunction | None]:
    """``(reward_funcs entries, single reward)``: a single function or reward model is passed to
    the trainer as it is; names, entries and lists become the config's ``reward_funcs`` (a
    function in a list is registered under its ``__name__``, as TRL logs it).

    Raises:
        ValueError: a function in a list without a usable name, or a name that another reward
            holds, or a reward model in a list.
    """
    if isinstance(reward_funcs, RewardModel) or (
        callable(reward_funcs) and not isinstance(reward_funcs, (str, Mapping))
    ):
        return [], reward_funcs
    items = [reward_funcs] if isinstance(reward_funcs, (str, Mapping)) else list(reward_funcs)
    specs: list[str | dict[str, Any]] = []
    for item in items:
        if isinstance(item, str):
            specs.append(item)
        elif isinstance(item, Mapping):
            specs.append(dict(item))
        elif isinstance(item, RewardModel):
            raise ValueError(
                "a reward model in a list of reward_funcs: give its path in the list instead"
            )
        elif callable(item):
            name = getattr(item, "__name__", "")
            if not name.isidentifier():
                raise ValueError(
                    f"the reward function {item!r} has no name to log it under: define it "
                    "with def, or register it with rewards.register_reward('name')"
                )
            known = {info.name: info.fn for info in list_rewards()}
            if known.get(name) is not item:
                register_reward(name)(item)
            specs.append(name)
        else:
            raise ValueError(f"reward_funcs entries are names, entries or functions, got {item!r}")
    return specs, None
