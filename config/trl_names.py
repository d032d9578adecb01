"""TRL's names for the same run: its GRPO / RLOO keys as aliases of ours, and the keys of a TRL
script translated or refused.

A recipe copied from TRL's ``GRPOConfig`` loads as it is: ``num_generations: 8`` is our
``group_size: 8``, and so on (:data:`TRL_ALIASES`, in config files and ``--set`` too). A GRPO
run's fields that a config does not set take TRL's GRPO defaults however the config is built
(the ``defaults`` of :mod:`algorithms.grpo`). ``beta`` is a field of ours with TRL's meaning
(GRPO's KL weight).

In Python, :func:`GRPOConfig` and :func:`RLOOConfig` take the rest of what a TRL script sets
(:func:`from_trl_config`): ``per_device_train_batch_size`` is translated from completions into
prompts (:data:`TRANSLATED`), keys without effect here are accepted and named
(:data:`IGNORED`), and any other key is refused in one line with "did you mean".
"""

import dataclasses
import logging
import math
from collections.abc import Mapping
from typing import Any

from config._fields import unknown_keys_message
from config.ppo_config import PPOConfig

logger = logging.getLogger("ppo_mlx")

#: TRL's key -> ours.
TRL_ALIASES: dict[str, str] = {
    "num_generations": "group_size",
    "num_iterations": "num_ppo_epochs",
    "epsilon": "clip_epsilon",
    "epsilon_high": "clip_epsilon_high",
    "max_completion_length": "max_new_tokens",
    "max_steps": "total_steps",
    "scale_rewards": "grpo_advantage_scale",
    "num_train_epochs": "num_epochs",
    "save_steps": "save_every",
    "save_total_limit": "keep_last_checkpoints",
    "adam_epsilon": "adam_eps",
    "lr_scheduler_type": "lr_scheduler",
    "report_to": "log_with",
    # Not TRL's: the name verl and textpolicy give the turn limit.
    "max_turns": "max_tool_calling_iterations",
}

#: TRL's keys that a TRL script sets and :func:`from_trl_config` translates into several of
#: ours (not a rename), with what they become.
TRANSLATED: dict[str, str] = {
    "per_device_train_batch_size": (
        "completions per micro-batch: batch_size = per_device_train_batch_size * "
        "gradient_accumulation_steps / num_generations prompts, one update per batch "
        "(num_mini_batches 1)"
    ),
    "disable_tqdm": "progress_bar = not disable_tqdm",
}

#: TRL's keys accepted with no effect here, with why (:func:`from_trl_config` names them in its
#: log line).
IGNORED: dict[str, str] = {
    "logging_steps": "every step's metrics are logged (metrics.jsonl, log_with)",
    "logging_first_step": "every step's metrics are logged",
    "logging_strategy": "every step's metrics are logged",
    "logging_dir": "metrics go to output_dir",
    "log_level": "the ppo_mlx logger's level is the script's to set",
    "log_completions": "completions are in the rollout records (log_rollouts_every)",
    "num_completions_to_print": "completions are in the rollout records (log_rollouts_every)",
    "bf16": "MLX has no mixed precision: the weights' dtype is dtype (default float32)",
    "fp16": "MLX has no mixed precision: the weights' dtype is dtype (default float32)",
    "tf32": "no CUDA here",
    "run_name": "the run is named by output_dir",
    "per_device_eval_batch_size": "evaluation runs the eval prompts in batch_size chunks",
    "save_strategy": "checkpoints every save_every steps (TRL's save_steps), and at the end",
    "remove_unused_columns": "every column reaches the reward functions",
    "dataloader_num_workers": "the prompts are held in memory",
    "ddp_find_unused_parameters": "no DDP here",
}

#: TRL's keys accepted only at the value that turns them off (what they enable is not here).
OFF_ONLY: dict[str, Any] = {
    "use_vllm": False,
    "push_to_hub": False,
    "use_liger_kernel": False,
    "use_liger_loss": False,
}


def from_trl_value(key: str, value: Any) -> Any:
    """A TRL value in our form: ``scale_rewards`` true / false is ``"group"`` / ``"none"`` (its
    strings ``"group"``, ``"batch"``, ``"none"`` are ours already); ``max_steps: -1`` (TRL's
    "no limit") is null; a whole ``num_train_epochs`` (TRL's 3.0) an int; ``save_total_limit:
    null`` (keep all) is 0; ``report_to`` "none", null, [] or a one-item list is one backend.
    Anything else is returned as given, for the field's own check to refuse."""
    if key == "scale_rewards" and isinstance(value, bool):
        return "group" if value else "none"
    if key == "max_steps" and value == -1:
        return None
    if key == "num_train_epochs" and isinstance(value, float) and value.is_integer():
        return int(value)
    if key == "save_total_limit" and value is None:
        return 0
    if key == "report_to":
        if value is None or value == []:
            return "none"
        if isinstance(value, (list, tuple)) and len(value) == 1:
            return value[0]
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


#: The value of ``model_name`` in a config built without one: the trainer's ``model=`` sets it
#: (:class:`ppo_trainer.trl_names.GRPOTrainer`), and a run that loads it fails naming the fix.
MODEL_FROM_TRAINER = "(none: pass GRPOTrainer(model=...) or model_name=)"

#: TRL's defaults for its keys that have no default of ours for a group algorithm (a GRPO run
#: without group_size is refused otherwise): TRL 1.x ``GRPOConfig`` / ``RLOOConfig``.
_TRL_GROUP_DEFAULTS = {"grpo": 8, "rloo": 2}


def from_trl_config(algorithm: str, values: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """``(PPOConfig keyword values, what was translated)`` of TRL's ``GRPOConfig`` /
    ``RLOOConfig`` keywords for ``algorithm``: our keys as they are, :data:`TRL_ALIASES`
    renamed, :data:`TRANSLATED` translated, :data:`IGNORED` and :data:`OFF_ONLY` left out,
    TRL's ``num_generations`` default where none is given, ``model_name`` left to the
    trainer's ``model=`` when not given, as ``reward_funcs`` when ``reward_weights`` is given
    without them (:func:`rewards_from_trainer`). The text says each translation and left-out key in
    one line ("" for none).

    ``per_device_train_batch_size`` counts completions, as TRL does: one update takes
    ``per_device_train_batch_size * gradient_accumulation_steps`` completions (TRL's generation
    batch on one process), which is ``batch_size`` prompts of ``group_size`` completions here.

    Raises:
        TypeError: a key neither ours nor TRL's accepted ones, in one line with "did you mean".
        ValueError: a key given twice (ours and TRL's name; ``batch_size`` with
            ``per_device_train_batch_size``), an :data:`OFF_ONLY` key turned on, or a batch that
            does not split into whole groups.
    """
    ours = {f.name for f in dataclasses.fields(PPOConfig) if f.init}
    accepted = ours | set(TRL_ALIASES) | set(TRANSLATED) | set(IGNORED) | set(OFF_ONLY)
    unknown = [key for key in values if key not in accepted]
    name = "GRPOConfig" if algorithm == "grpo" else f"{algorithm.upper()}Config"
    if unknown:
        listed = 'docs/algorithms.md, "GRPO as TRL users run it", lists them'
        raise TypeError(unknown_keys_message(name, unknown, sorted(accepted), listed))
    report_to = from_trl_value("report_to", values.get("report_to", "none"))
    if report_to not in ("none", "tensorboard", "wandb"):
        raise ValueError(
            f"{name}: report_to={values['report_to']!r}: name one backend, 'none', "
            "'tensorboard' or 'wandb' (metrics.jsonl in output_dir is always written)"
        )
    notes: list[str] = []
    kept: dict[str, Any] = {}
    for key, value in values.items():
        if key in IGNORED:
            notes.append(f"{key} ignored ({IGNORED[key]})")
        elif key in OFF_ONLY:
            if value != OFF_ONLY[key]:
                raise ValueError(
                    f"{name}: {key}={value!r} is not available here; remove it or set "
                    f"{key}={OFF_ONLY[key]!r}"
                )
        elif value is None and key in ("max_prompt_length", "top_k"):
            # TRL's None: no prompt truncation / no top-k; ours: the default, top_k 0 (off).
            notes.append(f"{key}=None is {key}'s default here")
        else:
            kept[key] = value
    if "disable_tqdm" in kept:
        if "progress_bar" in kept:
            raise ValueError(f"{name}: give progress_bar or disable_tqdm (TRL's), not both")
        kept["progress_bar"] = not kept.pop("disable_tqdm")
    out = from_trl_names(kept)
    out.setdefault("algorithm", algorithm)
    if out["algorithm"] == algorithm and "group_size" not in out:
        out["group_size"] = _TRL_GROUP_DEFAULTS[algorithm]
        notes.append(f"num_generations={out['group_size']} (TRL's default)")
    if "per_device_train_batch_size" in out:
        notes.append(_translate_batch(name, out))
    if "model_name" not in out:
        out["model_name"] = MODEL_FROM_TRAINER
    weights = out.get("reward_weights")
    if isinstance(weights, list) and out.get("reward_funcs") is None:
        # TRL sets the weights in the config and the functions in the trainer.
        out["reward_funcs"] = [rewards_from_trainer(i) for i in range(len(weights))]
    return out, "; ".join(notes)


def rewards_from_trainer(index: int) -> str:
    """The ``reward_funcs`` entry that stands for the trainer's ``index``-th reward in a config
    given ``reward_weights`` and no ``reward_funcs`` (TRL's split: the weights in the config,
    the functions in the trainer); ``GRPOTrainer(reward_funcs=...)`` replaces it."""
    return f"{REWARDS_FROM_TRAINER} {index + 1}"


#: The start of :func:`rewards_from_trainer`'s entries.
REWARDS_FROM_TRAINER = "(none: pass GRPOTrainer(reward_funcs=...)) reward"


def _translate_batch(name: str, out: dict[str, Any]) -> str:
    """Replace ``per_device_train_batch_size`` (completions) in ``out`` by ``batch_size``
    (prompts) and ``num_mini_batches`` 1; return the sentence that says so."""
    per_device = out.pop("per_device_train_batch_size")
    accumulation = out.get("gradient_accumulation_steps", 1)
    group = out["group_size"]
    if "batch_size" in out:
        raise ValueError(
            f"{name}: give batch_size (prompts per step) or per_device_train_batch_size (TRL's, "
            "completions per micro-batch), not both"
        )
    if not isinstance(per_device, int) or isinstance(per_device, bool) or per_device < 1:
        raise ValueError(f"{name}: per_device_train_batch_size must be >= 1, got {per_device!r}")
    completions = per_device * accumulation
    if completions % group != 0:
        multiple = math.lcm(group, accumulation) // accumulation
        raise ValueError(
            f"{name}: per_device_train_batch_size * gradient_accumulation_steps = {per_device} * "
            f"{accumulation} = {completions} completions per step must be a multiple of "
            f"num_generations={group} (whole groups, as TRL requires): set "
            f"per_device_train_batch_size to a multiple of {multiple}"
        )
    if out.get("num_mini_batches", 1) != 1:
        raise ValueError(
            f"{name}: per_device_train_batch_size makes one update per batch (TRL's); give "
            "batch_size instead to split it into num_mini_batches"
        )
    out["batch_size"] = completions // group
    out["num_mini_batches"] = 1
    return (
        f"per_device_train_batch_size={per_device} x gradient_accumulation_steps={accumulation}"
        f" = {completions} completions per step = batch_size {out['batch_size']} prompts x "
        f"group_size {group} (num_generations), one update of {accumulation} micro-batch(es) of "
        f"{per_device}"
    )


#: PEFT's ``target_modules`` names (the last part of a module's path, Llama / Qwen / Mistral
#: naming) -> our ``lora_keys`` (the path inside a transformer block).
PEFT_TARGETS: dict[str, str] = {
    **{name: f"self_attn.{name}" for name in ("q_proj", "k_proj", "v_proj", "o_proj")},
    **{name: f"mlp.{name}" for name in ("gate_proj", "up_proj", "down_proj")},
}

#: PEFT's default ``target_modules`` for those models (``target_modules=None``).
_PEFT_DEFAULT_TARGETS = ("q_proj", "v_proj")


def from_peft_config(peft_config: Any) -> dict[str, Any]:
    """Our LoRA fields from a PEFT-style ``LoraConfig`` (any object with its attribute names;
    PEFT is not needed): ``r`` -> ``lora_r``, ``lora_alpha``, ``lora_dropout``, and
    ``target_modules`` (names such as ``"q_proj"``, :data:`PEFT_TARGETS`; ``"all-linear"`` =
    every linear layer of a block; None = PEFT's default for Llama-style models, ``q_proj`` and
    ``v_proj``) -> ``lora_keys``; ``use_lora`` true.

    Raises:
        ValueError: an attribute asking for what these adapters do not do (DoRA, trained biases,
            ``modules_to_save``, a regex or unknown module name), with what to change.
    """
    if not hasattr(peft_config, "r"):
        raise ValueError(
            f"peft_config must be a LoRA config with r, lora_alpha and target_modules (PEFT's "
            f"LoraConfig or any object with those attributes), got {peft_config!r:.80}"
        )
    refused = {
        "use_dora": (False, None),
        "bias": ("none", None),
        "modules_to_save": (None,),
        "layers_to_transform": (None,),
        "use_rslora": (False, None),
    }
    for attr, fine in refused.items():
        value = getattr(peft_config, attr, None)
        if value not in fine and not (isinstance(value, (list, tuple)) and not value):
            raise ValueError(
                f"peft_config.{attr}={value!r} is not available here (plain LoRA on the "
                f"linear layers of every block): remove it; set lora_layers= in the config to "
                "adapt only the last blocks"
            )
    targets = getattr(peft_config, "target_modules", None)
    if targets is None:
        targets = _PEFT_DEFAULT_TARGETS
    if targets == "all-linear":
        keys = None
    elif isinstance(targets, str):
        raise ValueError(
            f"peft_config.target_modules={targets!r}: a regular expression is not read here; "
            f'list module names such as ["q_proj", "v_proj"], or "all-linear"'
        )
    else:
        unknown = [t for t in targets if t not in PEFT_TARGETS and t not in PEFT_TARGETS.values()]
        if unknown:
            raise ValueError(
                f"peft_config.target_modules has {unknown}: choose among "
                f'{sorted(PEFT_TARGETS)}, or "all-linear"'
            )
        keys = [PEFT_TARGETS.get(t, t) for t in targets]
    out: dict[str, Any] = {
        "use_lora": True,
        "lora_r": int(peft_config.r),
        "lora_keys": keys,
    }
    for attr in ("lora_alpha", "lora_dropout"):
        if getattr(peft_config, attr, None) is not None:
            out[attr] = float(getattr(peft_config, attr))
    return out


def _build(algorithm: str, values: Mapping[str, Any]) -> PPOConfig:
    out, notes = from_trl_config(algorithm, values)
    if notes:
        logger.info("%sConfig, from TRL's keys: %s", algorithm.upper(), notes)
    return PPOConfig(**out)


def GRPOConfig(**values: Any) -> PPOConfig:  # noqa: N802 (TRL's name)
    """A GRPO run's :class:`PPOConfig`, from our keys or TRL's (``num_generations``, ``beta``,
    ``epsilon``, ``per_device_train_batch_size``, ...; :func:`from_trl_config`), with TRL's
    GRPO defaults. ``model_name`` may be left to ``GRPOTrainer(model=...)``.

    Raises:
        TypeError: a key that is neither ours nor an accepted TRL key ("did you mean").
        ValueError: a value the config refuses, with what to change.
    """
    return _build("grpo", values)


def RLOOConfig(**values: Any) -> PPOConfig:  # noqa: N802 (TRL's name)
    """An RLOO run's :class:`PPOConfig`, from our keys or TRL's (``num_generations``, ...;
    :func:`from_trl_config`). ``model_name`` may be left to ``RLOOTrainer(model=...)``.

    Raises:
        TypeError: a key that is neither ours nor an accepted TRL key ("did you mean").
        ValueError: a value the config refuses, with what to change.
    """
    return _build("rloo", values)
