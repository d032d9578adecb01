"""Find and load the policy a training run produced, from any path a user may give for it.

``python main.py generate / chat / export`` take one path, RUN_OR_DIR, which may be:

* a **run directory** (``output_dir`` of a run): PPO / GRPO runs hold ``final/`` (the trained
  policy) and ``checkpoints/step_NNNNNN/``; SFT runs hold ``model/``. ``final/`` or ``model/`` is
  used, else the newest checkpoint;
* a **LoRA adapter directory** (``adapters.safetensors`` + ``adapter_config.json``, e.g. a LoRA
  run's ``final/``): the base model is the one adapter_config.json records under ``"model"``
  (:func:`base_setup.lora_setup.adapter_base_model`), else the run's ``model_name``;
* a **checkpoint** ``step_NNNNNN/`` (``trainer_state.json`` holds the run's config, so the base
  model and the LoRA settings are known);
* a **model directory** (config.json + weights), e.g. an SFT ``model/`` or an export; an
  export's ``adapters/`` folder (``export`` without ``--fuse``) is applied on top;
* a **Hub repo id** ("owner/name") that is no local path: the snapshot, fetched or read from the
  cache as ``train`` loads ``model_name`` (:func:`models.policy_model.resolve_model_path`).

:func:`resolve_trained_model` only reads small files and says what it found, or why the path is
none of these; :func:`load_trained_model` then loads the policy (a :class:`PolicyModel`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import mlx.core as mx
import yaml
from mlx.utils import tree_flatten

from base_setup.lora_setup import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    LoraSettings,
    adapter_base_model,
)
from models.backbone_loading import check_model_files
from models.policy_model import PolicyModel, looks_like_hub_id, resolve_model_path
from training.checkpoint import STATE_FILE, CheckpointManager
from training.metrics_logger import METRICS_FILE
from finetune.supervised_trainer import MODEL_DIR
from training.run_control import CONFIG_FILE

logger = logging.getLogger("ppo_mlx")

#: The trained policy's directory under a PPO / GRPO run's ``output_dir``.
FINAL_DIR = "final"
#: Where an unfused export keeps its LoRA adapters (see ``ppo_trainer.export``).
EXPORTED_ADAPTERS_DIR = "adapters"
#: What RUN_OR_DIR may be, for error messages.
EXPECTED = (
    "a run directory (a PPO/GRPO run's final/ or checkpoints/step_NNNNNN/, an SFT run's model/), "
    f"a LoRA adapter directory ({ADAPTER_WEIGHTS_FILE} + {ADAPTER_CONFIG_FILE}), a checkpoint "
    f"directory step_NNNNNN ({STATE_FILE}), or a model directory (config.json + *.safetensors)"
)


@dataclass(frozen=True)
class TrainedModel:
    """What a RUN_OR_DIR path holds (see the module docstring).

    Attributes:
        path: the directory the policy is read from (a model, adapter or checkpoint directory).
        kind: ``"model"`` (full weights), ``"adapters"`` (LoRA over ``base_model``) or
            ``"checkpoint"`` (a training checkpoint over ``base_model``).
        base_model: the model whose weights are loaded first: ``path`` itself for ``"model"``,
            else the Hub id or local path of the base.
        adapter_dir: LoRA adapters applied on top of ``base_model``; None for none.
        run_dir: the training run it came from; None when it is not part of a run.
        run_config: the run's configuration as a flat dict; None when unknown.
        final_metrics: the last metrics record of the run (or of the checkpoint's history).
        eval_results: ``eval_final.json`` of a PPO run, when present.
    """

    path: Path
    kind: str
    base_model: str
    adapter_dir: Path | None = None
    run_dir: Path | None = None
    run_config: dict[str, Any] | None = None
    final_metrics: dict[str, Any] | None = None
    eval_results: dict[str, Any] | None = None

    @property
    def algorithm(self) -> str | None:
        """The run's algorithm (``"ppo"``, ``"grpo"``, ``"rloo"``, ...), or ``"sft"`` or
        ``"reward"``, from the run's config; None if unknown."""
        return None if self.run_config is None else run_kind(self.run_config)

    @property
    def lora(self) -> LoraSettings | None:
        """The run's LoRA settings when it trained adapters (from its config)."""
        cfg = self.run_config
        if cfg is None or not cfg.get("use_lora"):
            return None
        return LoraSettings.from_model_config(SimpleNamespace(**cfg))

    def describe(self) -> str:
        """One line: what will be loaded."""
        if self.kind == "model":
            extra = f" + LoRA adapters {self.adapter_dir}" if self.adapter_dir else ""
            return f"model {self.path}{extra}"
        if self.kind == "adapters":
            return f"LoRA adapters {self.path} over {self.base_model}"
        return f"checkpoint {self.path} ({self.algorithm}) over {self.base_model}"


def run_kind(config: dict[str, Any]) -> str:
    """The trainer that wrote a run config: ``"ppo"`` / ``"grpo"`` (PPOConfig's ``algorithm``),
    ``"reward"`` (RewardConfig's ``head_init``) or ``"sft"``."""
    if "algorithm" in config:
        return str(config["algorithm"])
    return "reward" if "head_init" in config else "sft"


def read_run_config(run_dir: Path) -> dict[str, Any] | None:
    """The config of the run in ``run_dir`` as a flat dict: its ``config.yaml`` (sections
    merged), else the config in its newest checkpoint; None when neither exists."""
    config_file = run_dir / CONFIG_FILE
    if config_file.is_file():
        data = yaml.safe_load(config_file.read_text(encoding="utf-8")) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{config_file} is not a run config (expected a YAML mapping)")
        flat: dict[str, Any] = {}
        for key, value in data.items():
            flat.update(value if isinstance(value, dict) else {key: value})
        return flat
    latest = CheckpointManager(run_dir / "checkpoints").latest()
    if latest is not None:
        return dict(_read_state(latest)["config"])
    return None


def _read_state(checkpoint: Path) -> dict[str, Any]:
    state = json.loads((checkpoint / STATE_FILE).read_text(encoding="utf-8"))
    if not isinstance(state, dict) or not isinstance(state.get("config"), dict):
        raise ValueError(f"{checkpoint / STATE_FILE} holds no training config")
    return state


def _last_metrics(run_dir: Path) -> dict[str, Any] | None:
    from training.metrics_logger import read_metrics

    records = read_metrics(run_dir / METRICS_FILE) if (run_dir / METRICS_FILE).is_file() else []
    return records[-1] if records else None


def _is_run_dir(path: Path) -> bool:
    markers = (METRICS_FILE, CONFIG_FILE, "checkpoints")
    return path.is_dir() and any((path / marker).exists() for marker in markers)


def _run_of(path: Path) -> Path | None:
    """The run directory that ``path`` (a final/, model/ or checkpoint directory) belongs to."""
    parent = path.parent
    if path.name in (FINAL_DIR, MODEL_DIR) and _is_run_dir(parent):
        return parent
    if parent.name == "checkpoints" and _is_run_dir(parent.parent):
        return parent.parent
    return None


def _listing(path: Path) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    if not names:
        return "it is empty"
    more = f" and {len(names) - 12} more" if len(names) > 12 else ""
    return "found " + ", ".join(names[:12]) + more


def _refuse_non_generative(path: Path, config: dict[str, Any], what: str) -> None:
    kind = run_kind(config)
    if kind == "reward":
        raise ValueError(
            f"{path} is {what} of a reward-model run: a reward model scores text, it does not "
            "generate. Pass the policy instead: an SFT run's model/ or a PPO run's final/"
        )


def resolve_trained_model(path: str | Path) -> TrainedModel:
    """What ``path`` holds and where its pieces are (see the module docstring); reads only
    small files (configs, metrics), no weights.

    Raises:
        FileNotFoundError: ``path`` does not exist (nor names a Hub repo "owner/name" that
            can be fetched), or a run directory holds no model yet.
        ValueError: ``path`` is none of the accepted kinds (the message lists what it holds and
            what is expected), a reward or value model (they do not generate), or adapters whose
            base model cannot be found.
    """
    path = Path(path)
    if not path.exists() and looks_like_hub_id(str(path)):
        # A Hub repo id, fetched (or read from the cache) as train loads model_name.
        path = resolve_model_path(str(path))
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; expected {EXPECTED}")
    if not path.is_dir():
        raise ValueError(f"{path} is a file; expected {EXPECTED}")

    has_adapter_config = (path / ADAPTER_CONFIG_FILE).is_file()
    has_adapter_weights = (path / ADAPTER_WEIGHTS_FILE).is_file()
    if has_adapter_config or has_adapter_weights:
        if not (has_adapter_config and has_adapter_weights):
            missing = ADAPTER_WEIGHTS_FILE if has_adapter_config else ADAPTER_CONFIG_FILE
            raise ValueError(
                f"{path} looks like a LoRA adapter directory but has no {missing} "
                f"({_listing(path)}); an adapter directory needs both {ADAPTER_WEIGHTS_FILE} "
                f"and {ADAPTER_CONFIG_FILE}"
            )
        return _resolve_adapters(path)
    if (path / STATE_FILE).is_file():
        return _resolve_checkpoint(path)
    if (path / "config.json").is_file():
        return _resolve_model_dir(path)

    # A run directory: its final model, else its newest checkpoint.
    for name in (FINAL_DIR, MODEL_DIR):
        if (path / name).is_dir():
            return resolve_trained_model(path / name)
    latest = CheckpointManager(path / "checkpoints").latest()
    if latest is not None:
        logger.info("%s has no %s/ yet: using its newest checkpoint %s", path, FINAL_DIR, latest)
        return resolve_trained_model(latest)
    if _is_run_dir(path):
        raise FileNotFoundError(
            f"{path} is a run directory without a trained model ({_listing(path)}): the run "
            f"writes {FINAL_DIR}/ (PPO/GRPO) or {MODEL_DIR}/ (SFT) when it ends and "
            "checkpoints/step_NNNNNN/ while it trains"
        )
    raise ValueError(
        f"{path} is not a model, adapter, checkpoint or run directory "
        f"({_listing(path)}); expected {EXPECTED}"
    )


def _run_info(run_dir: Path | None) -> dict[str, Any]:
    if run_dir is None:
        return {}
    eval_file = run_dir / "eval_final.json"
    return {
        "run_dir": run_dir,
        "run_config": read_run_config(run_dir),
        "final_metrics": _last_metrics(run_dir),
        "eval_results": (
            json.loads(eval_file.read_text(encoding="utf-8")) if eval_file.is_file() else None
        ),
    }


def _resolve_adapters(path: Path) -> TrainedModel:
    info = _run_info(_run_of(path))
    base = adapter_base_model(path)
    if base is None and info.get("run_config"):
        base = str(info["run_config"]["model_name"])
    if base is None:
        raise ValueError(
            f"{path / ADAPTER_CONFIG_FILE} does not record its base model and {path} is not part "
            'of a run whose config names it: add "model": "<base model path or Hub id>" to '
            f"{ADAPTER_CONFIG_FILE} (as mlx_lm.lora and this project's save_adapters write it)"
        )
    return TrainedModel(path=path, kind="adapters", base_model=base, adapter_dir=path, **info)


def _resolve_checkpoint(path: Path) -> TrainedModel:
    state = _read_state(path)
    config = dict(state["config"])
    _refuse_non_generative(path, config, "a checkpoint")
    group = "policy" if "algorithm" in config else "model"
    if not (path / f"{group}.safetensors").is_file():
        raise ValueError(
            f"checkpoint {path} has no {group}.safetensors ({_listing(path)}); a "
            f"{run_kind(config)} checkpoint stores the trained weights there"
        )
    history = state.get("history") or []
    info = _run_info(_run_of(path))
    return TrainedModel(
        path=path,
        kind="checkpoint",
        base_model=str(config["model_name"]),
        run_dir=info.get("run_dir"),
        run_config=config,  # the checkpoint's own config, whatever the run did later
        final_metrics={"step": state.get("global_step"), **history[-1]} if history else None,
    )


def _resolve_model_dir(path: Path) -> TrainedModel:
    check_model_files(path)  # a config.json that is not JSON, a cut weights file: named
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    architectures = config.get("architectures") or []
    if any(str(a).endswith("ForSequenceClassification") for a in architectures):
        raise ValueError(
            f"{path} is a reward or value model ({architectures[0]}): it scores text, it does not "
            "generate. Pass a policy instead: an SFT run's model/, a PPO run's final/, or a "
            "causal LM directory"
        )
    if not any(path.glob("*.safetensors")):
        raise ValueError(
            f"{path} has a config.json but no *.safetensors weights ({_listing(path)}); "
            f"expected {EXPECTED}"
        )
    adapters = path / EXPORTED_ADAPTERS_DIR
    adapter_dir = adapters if (adapters / ADAPTER_CONFIG_FILE).is_file() else None
    info = _run_info(_run_of(path))
    if info.get("run_config"):
        _refuse_non_generative(path, info["run_config"], "the model")
    return TrainedModel(
        path=path, kind="model", base_model=str(path), adapter_dir=adapter_dir, **info
    )


def load_trained_model(found: TrainedModel) -> PolicyModel:
    """Load the policy ``found`` describes, in eval mode (see :func:`resolve_trained_model`).

    Base weights are loaded in the run's ``dtype`` when the run is known (as it trained), else
    as stored. A checkpoint's weights must match the model its config builds, name for name.

    Raises:
        FileNotFoundError: the base model is missing (e.g. a relative ``model_name`` read from
            another working directory).
        ValueError: the checkpoint's weights do not fit the model its config describes.
    """
    dtype = found.run_config.get("dtype") if found.run_config else None
    if found.kind != "checkpoint":
        try:
            policy = PolicyModel.from_pretrained(
                found.base_model, dtype=dtype, adapter_path=found.adapter_dir
            )
        except FileNotFoundError as err:
            raise FileNotFoundError(f"the base model of {found.describe()}: {err}") from err
        policy.eval()
        return policy

    try:
        policy = PolicyModel.from_pretrained(found.base_model, dtype=dtype, lora=found.lora)
    except FileNotFoundError as err:
        raise FileNotFoundError(
            f"checkpoint {found.path} was trained from model_name={found.base_model!r}, which "
            f"cannot be loaded from here ({err}); run from the directory the training ran in, "
            "or pass the run's final model instead"
        ) from err
    arrays, _ = CheckpointManager.load(found.path)
    # An RL run (its config names an algorithm) saves the policy; SFT and reward runs the model.
    rl_run = found.run_config is not None and "algorithm" in found.run_config
    weights = arrays["policy" if rl_run else "model"]
    trainable = cast(list[tuple[str, mx.array]], tree_flatten(policy.trainable_parameters()))
    expected = {k: v.shape for k, v in trainable}
    got = {k: v.shape for k, v in weights.items()}
    if got != expected:
        missing = sorted(expected.keys() - got.keys())[:4]
        extra = sorted(got.keys() - expected.keys())[:4]
        shapes = sorted(k for k in expected.keys() & got.keys() if expected[k] != got[k])[:4]
        raise ValueError(
            f"checkpoint {found.path} does not fit the model its config describes "
            f"({found.base_model}, LoRA {found.lora}): missing {missing}, unexpected {extra}, "
            f"other shapes {shapes}"
        )
    policy.load_weights(list(weights.items()), strict=False)  # the trainable subset, checked
    policy.eval()
    return policy
