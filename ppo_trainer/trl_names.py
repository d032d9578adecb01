"""TRL's trainer names over :class:`PPOTrainer`: ``GRPOTrainer(model, reward_funcs, args,
train_dataset).train()`` and ``RLOOTrainer`` run the same trainer with the same config, so a
script written for TRL needs only its imports changed (``args`` from
:func:`config.trl_names.GRPOConfig`)."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Union

from config.ppo_config import PPOConfig
from config.trl_names import (
    MODEL_FROM_TRAINER,
    REWARDS_FROM_TRAINER,
    GRPOConfig,
    RLOOConfig,
    from_peft_config,
)
from models.reward_model import RewardFunction, RewardModel
from ppo_trainer.callbacks import CallbackLike
from ppo_trainer.ppo_trainer import PPOTrainer
from ppo_trainer.prompt_records import PromptInput
from ppo_trainer.trl_data import TrainerState, dataset_records, trl_reward
from rewards import list_rewards, register_reward

#: What ``reward_funcs`` may be: a name, path or entry with parameters, a function, or a list of
#: those (functions in a list join the reward registry under their ``__name__``).
RewardFuncs = Union[str, Mapping[str, Any], Callable[..., Any], Sequence[Any]]


class GRPOTrainer(PPOTrainer):
    """TRL's ``GRPOTrainer`` signature over :class:`PPOTrainer` (``args.algorithm`` "grpo").

    A TRL script runs with only its imports changed (docs/algorithms.md, "GRPO as TRL users run
    it"): ``args`` from :func:`GRPOConfig` with TRL's keys, the model from ``model=``, a
    ``datasets.Dataset`` or a list of records as ``train_dataset``, and reward functions
    called as TRL calls them (:func:`ppo_trainer.trl_data.trl_reward`: completions as
    assistant messages for a conversational dataset).

    Args:
        model: the policy's path or repo id (``args.model_name`` when not given).
        reward_funcs: a reward function or :class:`RewardModel`, a reward name of this package
            (``"math_accuracy"``), ``"module:function"``, an entry with parameters, or a list of
            those (weighted by ``args.reward_weights``). Functions are called as TRL calls
            them; names of this package's rewards read the formatted prompts and texts.
        args: the config (default: :func:`GRPOConfig` with TRL's defaults).
        train_dataset: the prompts :meth:`train` runs on by default: a ``datasets.Dataset``
            or a list of records with ``prompt`` (text or chat messages) or ``messages``, their
            other columns passed to the rewards (:func:`ppo_trainer.trl_data.dataset_records`),
            or of bare prompts.
        eval_dataset: the prompts :meth:`train` evaluates on (every ``args.eval_every`` steps
            and at the end), in the same forms.
        peft_config: LoRA settings as PEFT's ``LoraConfig`` (duck-typed, PEFT not needed;
            :func:`config.trl_names.from_peft_config`); None = ``args``' own LoRA settings.
        callbacks: :class:`~ppo_trainer.callbacks.TrainerCallback` objects for :meth:`train`.
        **components: ``policy``, ``ref_model``, ``value_model``, ``tokenizer``, as for
            :class:`PPOTrainer`.
    """

    algorithm: ClassVar[str] = "grpo"

    def __init__(
        self,
        model: str | None = None,
        reward_funcs: RewardFuncs | None = None,
        args: PPOConfig | None = None,
        train_dataset: Iterable[Any] | None = None,
        eval_dataset: Iterable[Any] | None = None,
        peft_config: Any = None,
        callbacks: Sequence[CallbackLike] | None = None,
        **components: Any,
    ) -> None:
        name = type(self).__name__
        if model is not None and not isinstance(model, (str, Path)):
            raise ValueError(
                f"{name}(model=...) takes a path or repo id here, got {type(model).__name__}: "
                "pass the checkpoint's name (a loaded MLX policy goes in policy=)"
            )
        if args is None:
            args = (GRPOConfig if self.algorithm == "grpo" else RLOOConfig)()
        if model is not None and str(model) != args.model_name:
            args = dataclasses.replace(args, model_name=str(model))
        if args.model_name == MODEL_FROM_TRAINER:
            raise ValueError(
                f"{name} needs the model: pass model= (a path or repo id), or model_name= in "
                "its config"
            )
        if args.algorithm != self.algorithm:
            raise ValueError(
                f"{name} runs algorithm {self.algorithm!r}, but args.algorithm is "
                f"{args.algorithm!r}: build args with the matching config, or use PPOTrainer"
            )
        if peft_config is not None:
            args = dataclasses.replace(args, **from_peft_config(peft_config))
        reward: RewardModel | RewardFunction | None = None
        # reward_weights in a TRL config without reward_funcs: these are the trainer's.
        weighted = any(str(s).startswith(REWARDS_FROM_TRAINER) for s in args.reward_funcs or [])
        if weighted and reward_funcs is None:
            raise ValueError(
                f"{name}: the config has reward_weights {args.reward_weights} but no reward "
                "functions: pass reward_funcs= to the trainer, one per weight"
            )
        if reward_funcs is not None:
            if weighted and (isinstance(reward_funcs, (str, Mapping)) or callable(reward_funcs)):
                reward_funcs = [reward_funcs]  # one weighted reward: a list of one
            specs, reward = reward_specs(_as_trl_rewards(reward_funcs, self._trainer_state))
            if specs:
                args = dataclasses.replace(args, reward_funcs=specs)
        self.train_dataset = None if train_dataset is None else dataset_records(train_dataset)
        self.eval_dataset = (
            None if eval_dataset is None else dataset_records(eval_dataset, "eval_dataset")
        )
        self.callbacks = list(callbacks or [])
        super().__init__(args, reward_model=reward, **components)

    def _trainer_state(self) -> TrainerState:
        """TRL's ``trainer_state`` for the rewards: the run's counters."""
        run = getattr(self, "run", None)  # not there before __init__ has built it
        if run is None:
            return TrainerState(global_step=0, max_steps=0, epoch=0.0)
        return TrainerState(run.global_step, run.last_step or 0, float(run.epoch))

    def train(
        self,
        prompts: Sequence[PromptInput] | None = None,
        num_epochs: int | None = None,
        callbacks: Sequence[CallbackLike] | None = None,
        eval_prompts: Sequence[PromptInput] | None = None,
        resume_from: str | Path | None = None,
        resume_from_checkpoint: str | Path | bool | None = None,
    ) -> list[dict[str, float]]:
        """:meth:`PPOTrainer.train` on ``prompts``, by default the ``train_dataset``, evaluating
        on ``eval_dataset`` when given. ``resume_from_checkpoint`` is TRL's name of
        ``resume_from`` (``True`` = the newest checkpoint, ``"latest"``)."""
        if prompts is None:
            if self.train_dataset is None:
                raise ValueError("no prompts: pass train_dataset= to the trainer or prompts=")
            prompts = self.train_dataset
        if resume_from_checkpoint is not None and resume_from_checkpoint is not False:
            if resume_from is not None:
                raise ValueError("give resume_from or resume_from_checkpoint (TRL's), not both")
            resume_from = "latest" if resume_from_checkpoint is True else resume_from_checkpoint
        if eval_prompts is None:
            eval_prompts = self.eval_dataset
        every = [*self.callbacks, *(callbacks or [])]
        return super().train(prompts, num_epochs, every or None, eval_prompts, resume_from)

    def save_model(self, path: str | Path | None = None, overwrite: bool = False) -> Path:
        """:meth:`PPOTrainer.save_model`, with TRL's default: no path, or the run's own
        ``output_dir`` (which holds its checkpoints and metrics too), saves into
        ``<output_dir>/final``, the run's own model folder. Returns where it saved."""
        if path is None or Path(path).resolve() == self.run_dir.resolve():
            path = self.run_dir / "final"
        return super().save_model(path, overwrite)


class RLOOTrainer(GRPOTrainer):
    """TRL's ``RLOOTrainer`` signature over :class:`PPOTrainer` (``args.algorithm`` "rloo")."""

    algorithm: ClassVar[str] = "rloo"


#: Each reward function a TRL trainer was given -> its wrapper (:func:`_as_trl_rewards`).
_TRL_WRAPPERS: weakref.WeakKeyDictionary[Callable[..., Any], Callable[..., Any]] = (
    weakref.WeakKeyDictionary()
)


def _as_trl_rewards(reward_funcs: RewardFuncs, state: Callable[[], TrainerState]) -> RewardFuncs:
    """``reward_funcs`` with each Python function wrapped to be called as TRL calls it
    (:func:`ppo_trainer.trl_data.trl_reward`); names, entries, reward models and the functions
    of the reward registry (``rewards/``, which read the formatted prompts and texts) as given."""

    registered = [info.fn for info in list_rewards()]

    def wrap(item: Any) -> Any:
        if not callable(item) or isinstance(item, (str, Mapping, RewardModel)):
            return item
        if any(
            item is fn for fn in registered
        ):  # this package's rewards (and @register_reward's) read text
            return item
        # One wrapper per function, so that it keeps its one registration under its name (a
        # list's functions join the registry); the newest trainer's counters are its state.
        try:
            wrapper = _TRL_WRAPPERS.get(item)
        except TypeError:  # not weakly referable (a builtin): a wrapper of its own each time
            return trl_reward(item, state)
        if wrapper is None:
            wrapper = _TRL_WRAPPERS[item] = trl_reward(item, state)
        wrapper.trainer_state = state  # type: ignore[union-attr]
        return wrapper

    if isinstance(reward_funcs, (str, Mapping)) or not isinstance(reward_funcs, Sequence):
        return wrap(reward_funcs)
    return [wrap(item) for item in reward_funcs]


def _is_trl_wrapper(fn: Any) -> bool:
    """Whether ``fn`` is a reward function a TRL trainer wrapped (:func:`_as_trl_rewards`)."""
    return any(fn is wrapper for wrapper in _TRL_WRAPPERS.values())


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
                # A TRL script's function defined again (a notebook cell run twice) takes its
                # name back from the earlier one; any other reward keeps its name.
                again = _is_trl_wrapper(item) and _is_trl_wrapper(known.get(name))
                register_reward(name, replace=again)(item)
            specs.append(name)
        else:
            raise ValueError(f"reward_funcs entries are names, entries or functions, got {item!r}")
    return specs, None
