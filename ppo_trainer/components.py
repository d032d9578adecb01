"""The models of a PPO/GRPO run, built from the config (or given ready), and the start-up checks
of a data-parallel run."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import logging
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, cast

import mlx.nn as nn

from base_setup import distributed as dist
from base_setup.grad_checkpoint import checkpoint_blocks
from base_setup.lora_setup import LoraSettings
from base_setup.tokenizer_setup import eos_token_ids
from config._fields import divisors
from config.loading import config_to_dict
from config.model_config import ModelConfig
from config.ppo_config import PPOConfig, RewardSpec, is_reward_function_spec
from models.backbone import adapter_checkpoint_base, is_adapter_checkpoint
from models.backbone_loading import flat_parameters
from models.offload import offload_to_disk
from models.policy_model import PolicyModel
from models.reward_model import RewardFunction, RewardModel
from models.sft_model import ReferenceModel
from models.value_model import ValueModel
from reward_kl.kl_divergence import AdaptiveKLController, FixedKLController
from rewards import bind_reward, resolve_reward, reward_spec_name
from training.fingerprints import model_fingerprint

#: One of several rewards: its name (for ``rewards/<name>/...``) and the model or function.
NamedReward = tuple[str, "RewardModel | RewardFunction"]

logger = logging.getLogger("ppo_mlx")


@dataclass
class RunModels:
    """Everything an iteration runs: the trained policy (and value model), the frozen reference,
    the reward (a model, a function, or several of them with weights), the tokenizer."""

    policy: PolicyModel
    ref_model: ReferenceModel | None  # None: no KL to a reference in this run
    reward_model: RewardModel | None
    reward_fn: RewardFunction | None
    value_model: ValueModel | None
    tokenizer: Any
    reward_funcs: list[NamedReward] = field(default_factory=list)


def load_function(spec: str) -> Callable[..., Any]:
    """``"package.module:function"`` or ``"path/to/file.py:function"`` -> the function
    (``--reward-fn``, ``reward_funcs``).

    A user's own file comes first: ``rewards:brevity`` loads ``./rewards.py`` of the working
    directory by its path when importing ``rewards`` would find another module (this package has
    top-level packages with generic names, ``config``, ``models``, ...) or none (the installed
    ``ppo-mlx`` command does not put the working directory on ``sys.path``); a spec without such
    a file is imported as usual. The file loaded is logged.

    Raises:
        ValueError: a malformed spec, a file or module that cannot be loaded, or no such function.
    """
    target, _, attr = spec.strip().rpartition(":")
    if not target or not attr.isidentifier():
        raise ValueError(
            "a reward function must look like 'module:function' or 'path/to/file.py:function', "
            f"got {spec!r}"
        )
    path = _user_file(target, spec)
    if path is None:
        try:
            module = importlib.import_module(target)
        except ImportError as err:
            raise ValueError(
                f"{spec}: cannot import {target} ({err}); a file of yours can be given by its "
                f"path, e.g. --reward-fn path/to/{target.rpartition('.')[2]}.py:{attr}"
            ) from err
    else:
        module = _load_file(path, spec)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(
            f"{spec}: {attr} is not a function in {module.__file__}; {_functions_hint(module, attr)}"
        )
    logger.info("reward function %s from %s", attr, module.__file__)
    return cast(Callable[..., Any], fn)


def _functions_hint(module: ModuleType, attr: str) -> str:
    """What a misspelt function name could have been: the closest of the module's own public
    functions, and the list of them (not those it imported)."""
    own = sorted(
        name
        for name, value in vars(module).items()
        if inspect.isfunction(value)
        and not name.startswith("_")
        and value.__module__ == module.__name__
    )
    if not own:
        return "it defines no public function"
    close = difflib.get_close_matches(attr, own, n=1)
    guess = f"did you mean {close[0]!r}? " if close else ""
    return f"{guess}its functions: {', '.join(own)}"


def _user_file(target: str, spec: str) -> Path | None:
    """The file ``target`` names that must be loaded by its path: ``x.py`` itself, or the
    ``a/b.py`` of module ``a.b`` in the working directory when importing ``a.b`` would not load
    that file. None: import ``target`` as usual."""
    if target.endswith(".py"):
        path = Path(target).expanduser()
        if not path.is_file():
            raise ValueError(f"{spec}: there is no file {path.resolve()}")
        return path
    if not all(part.isidentifier() for part in target.split(".")):
        raise ValueError(
            f"{spec}: {target!r} is neither a module path (package.module) nor a .py file"
        )
    path = Path.cwd().joinpath(*target.split(".")).with_name(target.rpartition(".")[2] + ".py")
    if not path.is_file():
        return None
    try:
        found = importlib.util.find_spec(target)
    except ImportError:  # a parent package that is not there or not importable
        found = None
    origin = None if found is None or found.origin is None else Path(found.origin).resolve()
    return None if origin == path.resolve() else path


def _load_file(path: Path, spec: str) -> ModuleType:
    """The module of the Python file ``path``, under a name of its own (so that a user's
    ``rewards.py`` neither shadows nor is shadowed by a package of the same name); its folder
    goes at the end of ``sys.path`` for the modules beside it that it imports."""
    path = path.resolve()
    name = "_user_module_" + re.sub(r"\W", "_", str(path.with_suffix("")))
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"{spec}: cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    try:
        module_spec.loader.exec_module(module)
    except ImportError as err:
        del sys.modules[name]
        raise ValueError(f"{spec}: {path} cannot import what it needs ({err})") from err
    except BaseException:
        del sys.modules[name]
        raise
    return module


def reward_function(spec: RewardSpec) -> RewardFunction:
    """The function a ``reward_funcs`` entry names, its parameters bound: a reward of the
    registry by name (:func:`rewards.resolve_reward`), or a user's function by
    ``"module:function"`` / ``"path/to/file.py:function"`` (:func:`load_function`).

    Raises:
        ValueError: an unknown name (with the close matches), a function that cannot be loaded,
            or parameters it does not take.
    """
    name = reward_spec_name(spec)
    if ":" not in name:
        return cast(RewardFunction, resolve_reward(spec))
    params = {k: v for k, v in spec.items() if k != "name"} if isinstance(spec, dict) else {}
    return cast(RewardFunction, bind_reward(load_function(name), params, name.rpartition(":")[2]))


def load_policy(config: ModelConfig, *, plain: bool = False) -> PolicyModel:
    """The policy as a run builds it from its config: ``config.model_name`` in ``config.dtype``,
    with fresh LoRA adapters when ``use_lora`` (the trainer, and the asynchronous rollout worker
    that then receives the trainer's trainable weights); mlx-lm's own layers when ``plain``
    (the run's ``plain_mlx``) or ``fast_math`` is off."""
    lora = LoraSettings.from_model_config(config) if config.use_lora else None
    return PolicyModel.from_pretrained(
        config.model_name, dtype=config.dtype, lora=lora, fast_math=config.fast_math and not plain
    )


def check_reward_adapters(config: ModelConfig) -> None:
    """Refuse a reward adapter checkpoint (``reward_model_name``) whose base is no longer the
    weights its adapters were trained on (the fingerprint it recorded against its base's now),
    and ``share_reward_base`` unless ``reward_model_name`` is a reward adapter checkpoint
    trained on the policy's base: the same weights, by the fingerprint the checkpoint recorded
    when it was trained and that of ``model_name`` now (:mod:`training.fingerprints`: the config
    and tokenizer files whole, each weights file's header and sampled blocks), or, where either
    has none (a Hub repo id), the same resolved path or repo id. Reads no weights.

    Raises:
        ValueError: a reward checkpoint that is not an adapter checkpoint, or one on another
            base (or a changed one); the message says what to change.
    """
    path = config.reward_model_name
    if path is None:
        return
    if not config.share_reward_base:
        if is_adapter_checkpoint(path):  # loaded on its own: its base must be the one it had
            base, recorded = adapter_checkpoint_base(path)
            now = model_fingerprint(base)
            if recorded is not None and now is not None and recorded != now:
                raise ValueError(
                    f"the reward adapters in {path} were trained on another model than the one "
                    f"now at {base} (fingerprint {recorded} then, {now} now): retrain the reward "
                    "model on it, or restore the base it was trained on"
                )
        return
    if not is_adapter_checkpoint(path):
        raise ValueError(
            f"share_reward_base: {path} is not a reward adapter checkpoint (adapter_config.json, "
            "adapters.safetensors, score.safetensors): train the reward model with use_lora: "
            "true on model_name's base, or set share_reward_base: false to load it on its own"
        )
    base, recorded = adapter_checkpoint_base(path)
    policy = model_fingerprint(config.model_name)
    if recorded is not None and policy is not None:
        same, found = recorded == policy, f"fingerprint {recorded} vs {policy}"
    else:
        here = [
            str(Path(p).resolve()) if Path(p).exists() else p for p in (base, config.model_name)
        ]
        same, found = here[0] == here[1], f"{here[0]} vs {here[1]}"
    if not same:
        raise ValueError(
            f"share_reward_base: the reward adapters in {path} were trained on {base}, not on "
            f"the policy's base model_name {config.model_name} ({found}): train the reward "
            "model on model_name, or set share_reward_base: false to load it with its own base"
        )


def no_score(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    """Score 0 for every completion: the reward of a distillation run without one (the
    teacher's per-token term is its whole signal)."""
    return [0.0] * len(completions)


def check_teacher_tokenizer(student_tokenizer: Any, student: str, teacher: str) -> None:
    """Raise ``ValueError`` before the teacher's weights load unless its tokenizer maps every
    string to the student's ids: distillation compares both models' log-probs of the student's
    token ids, which another vocabulary would silently misalign."""
    from base_setup.tokenizer_setup import load_tokenizer, vocabulary_difference
    from models.policy_model import resolve_model_path

    teacher_tokenizer = load_tokenizer(resolve_model_path(teacher))
    difference = vocabulary_difference(student_tokenizer, teacher_tokenizer)
    if difference is not None:
        raise ValueError(
            f"the teacher {teacher} has another vocabulary than the student {student} "
            f"(the student first: {difference}): distillation compares the two models' "
            "log-probs of the same token ids, so the teacher must use the student's tokenizer "
            "(a model of the same family)"
        )


def build_models(
    config: PPOConfig,
    *,
    policy: PolicyModel | None = None,
    ref_model: ReferenceModel | None = None,
    reward: RewardModel | RewardFunction | None = None,
    value_model: ValueModel | None = None,
    tokenizer: Any = None,
    custom_scores: bool = False,
) -> RunModels:
    """The run's models: those given, the others loaded as the config says.

    * policy: ``config.model_name`` (LoRA adapters if ``use_lora``; a quantized model only so);
    * reference: the policy's base weights with the adapters off (LoRA on the same model), else
      a frozen copy of ``sft_model_name or model_name``; none when the run has no KL term
      (``config.uses_reference_model``: GRPO's ``beta: 0``, the others' ``kl_coef: 0``);
    * reward: a :class:`RewardModel`, a function ``(prompts, completions, **columns)``,
      ``reward_model_name``, or ``reward_funcs`` (functions and models, weighted); none is
      needed when ``custom_scores`` (a trainer that overrides ``compute_scores``);
    * value model (PPO only): ``value_model_name``, else the reward model's checkpoint, else the
      policy's backbone with a fresh head, or adapters and a head on the policy's own base
      weights (``config.value_source``).

    With ``share_reward_base`` the reward model's adapters and head go on the policy's base
    (:meth:`RewardModel.sharing_base`), after :func:`check_reward_adapters`, before any model loads.
    With ``gradient_checkpointing`` the trained models' blocks are checkpointed (a given one, in
    place).

    Raises:
        ValueError: no reward, a reward that is not callable, a quantized policy without LoRA,
            or a reward model that cannot share the policy's base.
    """
    check_reward_adapters(config)
    if config.share_reward_base and reward is not None:
        raise ValueError(
            "share_reward_base puts reward_model_name on the policy's base, but a reward was "
            "passed to the trainer: pass none, or set share_reward_base: false"
        )
    if config.reward_funcs and reward is not None:
        raise ValueError(
            "reward_funcs is set in the config and a reward was passed to the trainer: "
            "use one of them"
        )
    if config.use_lora and config.lora_dropout > 0:
        # As TRL's PPO / GRPO trainers (which disable dropout): with dropout the policy's
        # log-probs in the loss would differ from the rollout's on the same weights.
        logger.warning(
            "lora_dropout %g is not used by PPO / GRPO (no dropout in the policy: its ratio "
            "to the rollout's log-probs must start at 1); it acts in SFT and reward training",
            config.lora_dropout,
        )
    fast = config.fast_math and not config.plain_mlx
    policy = policy or load_policy(config, plain=config.plain_mlx)
    policy.check_trainable()  # a quantized model trains through adapters only (QLoRA)
    if ref_model is None:
        ref_model = _load_reference(config, policy, fast)
    reward_model, reward_fn = _single_reward(config, policy, reward, custom_scores, fast)
    if not config.algorithm_object.value_model:
        value_model = None
    elif value_model is None:
        value_model = _load_value_model(config, policy, fast)
    models = RunModels(
        policy=policy,
        ref_model=ref_model,
        reward_model=reward_model,
        reward_fn=reward_fn,
        value_model=value_model,
        tokenizer=tokenizer if tokenizer is not None else policy.tokenizer,
        reward_funcs=_reward_funcs(config, fast),
    )
    if config.gradient_checkpointing:  # the two models trained
        for trained in (models.policy, models.value_model):
            if trained is not None:
                checkpoint_blocks(trained)
    if config.offload_frozen_models:
        offload_frozen_models(config, models)
    return models


def offload_frozen_models(config: PPOConfig, models: RunModels) -> None:
    """Keep the run's frozen models that hold weights of their own on disk outside their
    passes (``offload_frozen_models``, :func:`models.offload.offload_to_disk`): the reward
    model, the reward models of ``reward_funcs``, and a reference (or teacher) that is a copy.
    A model whose arrays are partly the policy's (a reference with the adapters off, a reward
    model on the policy's base) is left as it is: its weights are resident for the policy.

    Raises:
        ValueError: the run has no such model (nothing would be kept on disk).
    """
    policy_arrays = {id(a) for a in flat_parameters(models.policy.model).values()}
    frozen: list[tuple[str, str, nn.Module]] = []
    if models.reward_model is not None:
        frozen.append(("reward", "the reward model", models.reward_model))
    for name, reward in models.reward_funcs:
        if isinstance(reward, RewardModel):
            frozen.append((f"reward_{name}", f"the reward model {name}", reward))
    if models.ref_model is not None:
        what = "the teacher" if config.teacher_model_name is not None else "the reference"
        frozen.append(("reference", what, models.ref_model.model))
    own = [
        (name, what, module)
        for name, what, module in frozen
        if not any(id(a) in policy_arrays for a in flat_parameters(module).values())
    ]
    if not own:
        raise ValueError(
            "offload_frozen_models: this run has no frozen model with weights of its own to "
            "keep on disk (its reference is the policy with the adapters off, and its reward "
            f"is {'on the policy' if frozen else 'no model'}): set offload_frozen_models: false"
        )
    for name, what, module in own:
        module.freeze()  # never trained in a run; an update would be undone at a phase's end
        offload_to_disk(module, config.output_dir, name, what)


def _load_reference(config: PPOConfig, policy: PolicyModel, fast: bool) -> ReferenceModel | None:
    """The reference of a run with a KL term: the policy's base with the adapters off (LoRA on
    the same model: no second copy), else a frozen copy of ``ref_model_name`` (a teacher's
    tokenizer checked before its weights load); None without a KL term."""
    if config.teacher_model_name is not None:
        check_teacher_tokenizer(policy.tokenizer, config.model_name, config.teacher_model_name)
    if not config.uses_reference_model:
        return None
    if config.use_lora and config.ref_model_name == config.model_name:
        return ReferenceModel.from_policy(policy)
    return ReferenceModel.from_pretrained(config.ref_model_name, dtype=config.dtype, fast_math=fast)


def _single_reward(
    config: PPOConfig,
    policy: PolicyModel,
    reward: RewardModel | RewardFunction | None,
    custom_scores: bool,
    fast: bool,
) -> tuple[RewardModel | None, RewardFunction | None]:
    """``(reward_model, reward_fn)`` of a run with one reward: the one passed, else
    ``reward_model_name`` (on the policy's base with ``share_reward_base``), else none for
    ``reward_funcs`` (:func:`_reward_funcs`), a distillation run (:func:`no_score`) or an
    overridden ``compute_scores``.

    Raises:
        ValueError: a reward that is neither a model nor callable, or no reward at all.
    """
    if isinstance(reward, RewardModel):
        return reward, None
    if reward is not None:
        if not callable(reward):
            raise ValueError(
                "reward_model must be a RewardModel or a function "
                f"(prompts, completions) -> list[float], got {type(reward).__name__}"
            )
        return None, reward
    if config.reward_funcs:
        return None, None
    if config.reward_model_name and config.share_reward_base:
        # Adapters and a head on the policy's base, held once; frozen, adapters off for the rest.
        shared = RewardModel.sharing_base(
            policy.model, config.reward_model_name, dtype=config.dtype, fast_math=fast
        )
        return shared, None
    if config.reward_model_name:
        loaded = RewardModel.from_pretrained(
            config.reward_model_name, dtype=config.dtype, fast_math=fast
        )
        return loaded, None
    if config.teacher_model_name is not None:
        return None, no_score  # distillation alone: the teacher's log-probs are the signal
    if not custom_scores:
        raise ValueError(
            "no reward: pass reward_model=<RewardModel or function (prompts, completions, "
            "**columns) -> list[float]>, set reward_model_name in the config, or override "
            "compute_scores"
        )
    return None, None


def _load_value_model(config: PPOConfig, policy: PolicyModel, fast: bool) -> ValueModel:
    """The value model where ``config.value_source`` says: adapters and a head on the policy's
    base (``shared``), the policy's backbone with a fresh head, or a checkpoint."""
    kind, path = config.value_source
    if kind == "shared":  # adapters and a head on the policy's base, held once
        lora = replace(policy.lora or LoraSettings.from_model_config(config), dropout=0.0)
        return ValueModel.sharing_base(policy.model, lora, fast_math=fast)
    if kind == "policy":
        return ValueModel.from_policy_backbone(path, dtype=config.dtype, fast_math=fast)
    return ValueModel.from_pretrained(path, dtype=config.dtype, fast_math=fast)


def _reward_funcs(config: PPOConfig, fast: bool) -> list[NamedReward]:
    """``config.reward_funcs`` by name: functions resolved, reward-model folders loaded."""
    reward_funcs: list[NamedReward] = []
    for name, spec in zip(config.reward_func_names, config.reward_funcs or []):
        if is_reward_function_spec(spec):
            reward_funcs.append((name, reward_function(spec)))
        else:
            assert isinstance(spec, str)  # an entry with parameters is a function
            model = RewardModel.from_pretrained(spec, dtype=config.dtype, fast_math=fast)
            reward_funcs.append((name, model))
    return reward_funcs


def stop_token_ids(config: PPOConfig, tokenizer: Any, vocab: int | None = None) -> list[int]:
    """The ids that end a response: ``config.stop_token_ids``, else the tokenizer's end ids (its
    EOS ids and the chat template's end-of-turn token). Ids the policy cannot produce (``>=
    vocab``, its output size) are refused: the run would never stop early."""
    if config.stop_token_ids is not None:  # [] = never stop early
        outside = [t for t in config.stop_token_ids if vocab is not None and t >= vocab]
        if outside:
            raise ValueError(
                f"stop_token_ids {outside} are outside the policy's vocabulary (ids 0 to "
                f"{vocab - 1 if vocab else 0}): give ids the tokenizer has (e.g. its EOS id)"
            )
        return list(config.stop_token_ids)
    ids = eos_token_ids(tokenizer)
    if not ids:
        raise ValueError(
            "the tokenizer has no EOS token: set stop_token_ids in the config so that "
            "responses can end"
        )
    return ids


def kl_controller(config: PPOConfig) -> FixedKLController | AdaptiveKLController:
    """The KL coefficient's controller: fixed at ``kl_coef``, or adaptive towards ``kl_target``
    (Ziegler et al., 2019) with ``adaptive_kl``."""
    if config.adaptive_kl:
        return AdaptiveKLController(config.kl_coef, config.kl_target, config.kl_horizon)
    return FixedKLController(config.kl_coef)


def vocab_size(policy: PolicyModel) -> int | None:
    """The number of ids the policy's head scores (its config's ``vocab_size``), or None."""
    args = getattr(policy.model, "args", None)
    value = getattr(args, "vocab_size", None)
    return int(value) if isinstance(value, int) else None


def context_length(policy: PolicyModel) -> int | None:
    """The policy's context length from its config, or None if it names none."""
    args = getattr(policy.model, "args", None)
    for name in ("max_position_embeddings", "n_positions"):  # n_positions: GPT-2
        value = getattr(args, name, None)
        if value:
            return int(value)
    return None


def check_data_parallel_config(config: PPOConfig, group: dist.Group) -> None:
    """Start-up checks of a data-parallel run; every rank raises the same ``ValueError``.

    First the configs must agree (hash compared across ranks), so that the checks after it see the
    same numbers everywhere; then the global batch must split evenly over the ranks, and each
    rank's rollout into ``num_mini_batches`` minibatches of ``gradient_accumulation_steps``
    micro-batches.
    """
    n = group.size()
    if n == 1:
        return
    dist.check_same_settings_on_all_ranks(config_to_dict(config), group)
    rollout = config.batch_size // n * config.group_size
    mini = rollout // config.num_mini_batches
    problem = None
    if config.batch_size % n:
        multiple = n * max(1, round(config.batch_size / n))
        problem = (
            f"batch_size={config.batch_size} (the prompts of one iteration, over all ranks) does "
            f"not split evenly over {n} processes: set batch_size to a multiple of {n} (e.g. "
            f"{multiple}) or launch a number of processes that divides it "
            f"({divisors(config.batch_size)})"
        )
    elif rollout % config.num_mini_batches:
        problem = (
            f"each of the {n} processes generates batch_size / {n} * group_size = {rollout} "
            f"sequences, which cannot be split into num_mini_batches={config.num_mini_batches} "
            f"equal minibatches: set num_mini_batches to one of {divisors(rollout)} or raise "
            "batch_size"
        )
    elif mini % config.gradient_accumulation_steps:
        problem = (
            f"each process's minibatch has {rollout} / num_mini_batches="
            f"{config.num_mini_batches} = {mini} sequences, which cannot be split into "
            f"gradient_accumulation_steps={config.gradient_accumulation_steps} equal "
            f"micro-batches: set gradient_accumulation_steps to one of {divisors(mini)}"
        )
    if problem is not None:
        # Same config on every rank, so every rank gets here: all report before any exits.
        dist.fail_together(ValueError(problem), group)
