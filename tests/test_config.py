"""Tests for config/: the three dataclasses, their validation, and YAML loading / saving."""

import dataclasses
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from config.dpo_config import DPOConfig
from config.trl_names import GRPOConfig
from config import (
    AgentConfig,
    FineTuneConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    PPOConfig,
    RewardConfig,
    SFTConfig,
    TrainingConfig,
    config_to_dict,
    field_docs,
    load_config,
    save_config,
)

ROOT = Path(__file__).resolve().parents[1]


def names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------- construction


def test_seed_api_construction() -> None:
    config = PPOConfig(
        model_name="Qwen/Qwen2.5-0.5B-Instruct",
        max_new_tokens=32,
        batch_size=4,
        learning_rate=3e-6,
        kl_coef=0.1,
        gamma=0.99,
        lam=0.9,
        clip_epsilon=0.1,
        lora_r=16,
        lora_alpha=32,
        lora_dropout=0.05,
    )
    assert config.model_name == "Qwen/Qwen2.5-0.5B-Instruct"
    assert (config.max_new_tokens, config.batch_size) == (32, 4)
    assert (config.learning_rate, config.kl_coef, config.gamma, config.lam) == (
        3e-6,
        0.1,
        0.99,
        0.9,
    )
    assert config.clip_epsilon == 0.1 and config.cliprange == 0.1
    assert (config.lora_r, config.lora_alpha, config.lora_dropout) == (16, 32.0, 0.05)
    # An int given for a float field is stored as a float (so saved YAML is stable).
    assert type(config.lora_alpha) is float
    assert config.lora_scale == 2.0


def test_fields_are_keyword_only_and_model_name_required() -> None:
    with pytest.raises(TypeError):
        PPOConfig("gpt2")  # type: ignore[call-arg, arg-type]
    with pytest.raises(TypeError):
        PPOConfig()  # type: ignore[call-arg]


def test_defaults_follow_n_plus_implementation_details() -> None:
    c = PPOConfig(model_name="m")
    # Huang et al. 2024: gamma 1, lam 0.95, 4 PPO epochs, kl 0.05, T 0.7, eps 1e-5, whitening.
    assert (c.gamma, c.lam, c.num_ppo_epochs, c.kl_coef) == (1.0, 0.95, 4, 0.05)
    assert (c.temperature, c.adam_eps) == (0.7, 1e-5)
    assert (c.whiten_advantages, c.whiten_rewards) == (True, False)
    assert (c.clip_epsilon, c.cliprange_value, c.vf_coef) == (0.2, 0.2, 0.1)
    assert (c.algorithm, c.kl_estimator, c.adaptive_kl, c.group_size) == ("ppo", "k1", False, 1)
    assert (c.max_new_tokens, c.max_prompt_length, c.top_p, c.top_k) == (64, 512, 1.0, 0)
    assert (c.kl_target, c.kl_horizon, c.beta, c.grpo_advantage_scale) == (
        6.0,
        10000,
        0.04,
        "group",
    )
    assert c.stop_token_ids is None and c.missing_eos_penalty is None
    assert (c.eval_temperature, c.eval_max_new_tokens, c.eval_tokens) == (0.0, None, 64)
    # model
    assert (c.sft_model_name, c.reward_model_name, c.value_model_name) == (None, None, None)
    assert (c.value_init, c.dtype, c.use_lora, c.fast_math) == (
        "reward",
        "float32",
        True,
        True,
    )
    assert (c.lora_r, c.lora_alpha, c.lora_dropout, c.lora_layers, c.lora_keys) == (
        8,
        16.0,
        0.0,
        -1,
        None,
    )
    # training
    assert (c.learning_rate, c.value_learning_rate, c.value_lr) == (1e-5, None, 1e-5)
    assert (c.batch_size, c.num_mini_batches, c.gradient_accumulation_steps) == (8, 1, 1)
    assert (c.max_grad_norm, c.lr_scheduler, c.warmup_steps, c.weight_decay) == (
        1.0,
        "linear",
        0,
        0.0,
    )
    assert (c.num_epochs, c.total_steps, c.seed, c.output_dir) == (1, None, 0, "runs/ppo")
    assert (c.save_every, c.keep_last_checkpoints, c.eval_every) == (0, 3, 0)
    assert (c.log_with, c.wandb_project, c.progress_bar) == ("none", None, True)
    assert c.clips_gradients


def test_normalize_reward_auto_is_on_where_the_value_head_starts_fresh(tmp_path: Path) -> None:
    """PPO with a value model that starts at 0 normalises the scores (a reward far from 0 would
    push it the wrong way: docs/algorithms.md); one started from the reward model keeps the raw
    scale (TRL's arrangement); other algorithms and an explicit setting are left alone."""
    reward_dir = tmp_path / "rm"
    reward_dir.mkdir()
    assert PPOConfig(model_name="m").normalize_reward == "auto"
    assert PPOConfig(model_name="m").normalizes_reward  # a reward function: a fresh head
    assert PPOConfig(model_name="m", value_init="policy", reward_model_name=str(reward_dir))
    assert PPOConfig(
        model_name="m", value_init="policy", reward_model_name=str(reward_dir)
    ).normalizes_reward
    assert not PPOConfig(model_name="m", reward_model_name=str(reward_dir)).normalizes_reward
    # value adapters and a fresh head on the policy's base, even beside a reward model
    shared = PPOConfig(model_name="m", value_init="shared", reward_model_name=str(reward_dir))
    assert shared.normalizes_reward
    assert not PPOConfig(model_name="m", value_model_name=str(reward_dir)).normalizes_reward
    assert not PPOConfig(model_name="m", algorithm="grpo", group_size=2).normalizes_reward
    assert not PPOConfig(model_name="m", normalize_reward=False).normalizes_reward
    assert PPOConfig(
        model_name="m", algorithm="rloo", group_size=2, normalize_reward=True
    ).normalizes_reward


def test_tool_chat_template_is_a_builtin_name_or_a_file(tmp_path: Path) -> None:
    template = tmp_path / "tools.jinja"
    template.write_text("{{ messages }}")
    assert PPOConfig(model_name="m", tool_chat_template="chatml_tools").tool_chat_template
    assert PPOConfig(model_name="m", tool_chat_template=str(template)).tool_chat_template
    with pytest.raises(ValueError, match="tool_chat_template.*use chatml_tools"):
        PPOConfig(model_name="m", tool_chat_template="chatml")


def test_cliprange_is_a_read_only_alias() -> None:
    c = PPOConfig(model_name="m", clip_epsilon=0.3)
    assert c.cliprange == 0.3
    with pytest.raises(AttributeError):
        c.cliprange = 0.1  # type: ignore[misc]


def test_derived_batch_sizes() -> None:
    c = PPOConfig(model_name="m", batch_size=4, group_size=3, num_mini_batches=2)
    assert (c.rollout_batch_size, c.mini_batch_size, c.micro_batch_size) == (12, 6, 6)
    c = PPOConfig(
        model_name="m",
        batch_size=4,
        group_size=2,
        num_mini_batches=2,
        gradient_accumulation_steps=2,
    )
    assert (c.rollout_batch_size, c.mini_batch_size, c.micro_batch_size) == (8, 4, 2)


def test_model_name_resolution() -> None:
    c = ModelConfig(model_name="pol")
    assert c.ref_model_name == "pol"
    assert c.value_source == ("policy", "pol")  # value_init="reward" but no reward model
    c = ModelConfig(model_name="pol", sft_model_name="sft", reward_model_name="rm")
    assert c.ref_model_name == "sft"
    assert c.value_source == ("reward", "rm")
    c = ModelConfig(model_name="pol", reward_model_name="rm", value_init="policy")
    assert c.value_source == ("policy", "pol")
    c = ModelConfig(model_name="pol", reward_model_name="rm", value_model_name="vm")
    assert c.value_source == ("value_model", "vm")


def test_max_grad_norm_inf_disables_clipping() -> None:
    c = TrainingConfig(max_grad_norm=math.inf)
    assert not c.clips_gradients


# --------------------------------------------------------------------------- validation

INVALID: list[tuple[str, Any, dict[str, Any]]] = [
    # model
    ("model_name", "", {}),
    ("model_name", "   ", {}),
    ("sft_model_name", "", {}),
    ("reward_model_name", " ", {}),
    ("value_model_name", "", {}),
    ("value_init", "critic", {}),
    ("dtype", "fp16", {}),
    ("lora_r", 0, {}),
    ("lora_alpha", 0.0, {}),
    ("lora_alpha", -16.0, {}),
    ("lora_dropout", 1.0, {}),
    ("lora_dropout", -0.1, {}),
    ("lora_layers", 0, {}),
    ("lora_layers", -2, {}),
    ("lora_keys", [], {}),
    ("lora_keys", ["self_attn.q_proj", ""], {}),
    # training
    ("learning_rate", 0.0, {}),
    ("learning_rate", -0.1, {}),
    ("learning_rate", math.nan, {}),
    ("learning_rate", math.inf, {}),
    ("value_learning_rate", 0.0, {}),
    ("batch_size", 0, {}),
    ("num_mini_batches", 0, {}),
    ("gradient_accumulation_steps", 0, {}),
    ("max_grad_norm", 0.0, {}),
    ("max_grad_norm", -1.0, {}),
    ("max_grad_norm", math.nan, {}),
    ("lr_scheduler", "step", {}),
    ("warmup_steps", -1, {}),
    ("warmup_steps", 11, {"total_steps": 10}),
    ("weight_decay", -0.01, {}),
    ("adam_eps", 0.0, {}),
    ("num_epochs", 0, {}),
    ("total_steps", 0, {}),
    ("seed", -1, {}),
    ("output_dir", "", {}),
    ("save_every", -1, {}),
    ("keep_last_checkpoints", -1, {}),
    ("eval_every", -1, {}),
    ("log_with", "mlflow", {}),
    ("wandb_project", "", {}),
    # ppo
    ("algorithm", "gpro", {}),
    ("max_new_tokens", 0, {}),
    ("max_prompt_length", 0, {}),
    ("temperature", 0.0, {}),
    ("temperature", -0.7, {}),
    ("top_p", 0.0, {}),
    ("top_p", 1.5, {}),
    ("top_k", -1, {}),
    ("stop_token_ids", [2, -1], {}),
    ("kl_coef", -0.05, {}),
    ("kl_estimator", "k4", {}),
    ("kl_target", 0.0, {}),
    ("kl_horizon", 0, {}),
    ("gamma", -0.1, {}),
    ("gamma", 1.01, {}),
    ("lam", -0.1, {}),
    ("lam", 1.5, {}),
    ("clip_epsilon", 0.0, {}),
    ("clip_epsilon", -0.2, {}),
    ("cliprange_value", 0.0, {}),
    ("vf_coef", 0.0, {}),
    ("vf_coef", -0.1, {"algorithm": "grpo", "group_size": 2}),
    ("num_ppo_epochs", 0, {}),
    ("missing_eos_penalty", -1.0, {}),
    ("group_size", 0, {}),
    ("group_size", 1, {"algorithm": "grpo"}),
    ("beta", -0.04, {}),
    ("grpo_advantage_scale", "global", {}),
    ("clip_epsilon_high", 0.0, {}),
    ("clip_epsilon_high", math.inf, {}),
    ("loss_type", "token_mean", {}),
    ("loss_type", "dapo", {}),  # a GRPO option with algorithm "ppo"
    ("importance_sampling_level", "sequence", {"algorithm": "rloo", "group_size": 2}),
    ("mask_truncated_completions", True, {}),  # with algorithm "ppo"
    ("group_size", 1, {"algorithm": "rloo"}),
    ("group_size", 1, {"algorithm": "reinforce_pp_baseline"}),
    ("gamma", 0.99, {"algorithm": "reinforce_pp_baseline", "group_size": 2}),
    ("reward_funcs", [], {}),
    ("reward_funcs", ["rewards:fmt", " "], {}),
    ("reward_funcs", ["a.rewards:fmt", "b.rewards:fmt"], {}),  # two metrics named "fmt"
    ("reward_model_name", "rm", {"reward_funcs": ["rewards:fmt"]}),
    ("reward_weights", [1.0], {}),
    ("reward_weights", [1.0], {"reward_funcs": ["rewards:fmt", "rewards:acc"]}),
    ("reward_weights", [math.nan], {"reward_funcs": ["rewards:fmt"]}),
    ("reward_weights", [0.0, 0.0], {"reward_funcs": ["rewards:fmt", "rewards:acc"]}),
    ("adam_bias_correction", 1, {}),
    ("eval_temperature", -0.1, {}),
    ("eval_max_new_tokens", 0, {}),
    ("log_rollouts_every", -1, {}),
    ("rollout_records_per_step", 0, {}),
    # wrong types given from Python
    ("batch_size", "8", {}),
    ("batch_size", 2.5, {}),
    ("use_lora", 1, {}),
    ("learning_rate", "1e-5", {}),
    ("lora_keys", "self_attn.q_proj", {}),
    ("stop_token_ids", [True], {}),
]


@pytest.mark.parametrize("field,value,extra", INVALID, ids=[f"{f}={v!r}" for f, v, _ in INVALID])
def test_invalid_value_names_the_field(field: str, value: Any, extra: dict[str, Any]) -> None:
    kwargs = {"model_name": "m", **extra, field: value}
    with pytest.raises(ValueError) as info:
        PPOConfig(**kwargs)
    message = str(info.value)
    # The message starts with the offending field, then says what to change after a colon.
    assert message.startswith(f"{field} must be"), message
    assert ": " in message


def test_algorithm_options_defaults_and_combinations() -> None:
    """The defaults are the behaviour before the options existed; each option is accepted with
    the algorithms it applies to, and the errors say what to change."""
    c = PPOConfig(model_name="m")
    assert (c.loss_type, c.importance_sampling_level, c.mask_truncated_completions) == (
        "bnpo",
        "token",
        False,
    )
    assert (c.clip_epsilon_high, c.reward_funcs, c.reward_weights) == (None, None, None)
    assert c.adam_bias_correction is True and c.reward_func_names == []
    grpo = PPOConfig(
        model_name="m",
        algorithm="grpo",
        group_size=4,
        batch_size=2,
        loss_type="dr_grpo",
        importance_sampling_level="sequence",
        clip_epsilon_high=0.28,
        mask_truncated_completions=True,
    )
    assert grpo.clip_epsilon_high == 0.28
    for algorithm in ("rloo", "reinforce_pp", "reinforce_pp_baseline"):
        PPOConfig(
            model_name="m", algorithm=algorithm, group_size=2, mask_truncated_completions=True
        )
    PPOConfig(model_name="m", algorithm="reinforce_pp", gamma=0.99)  # no group needed
    several = PPOConfig(
        model_name="m",
        reward_funcs=["my_rewards.checks:format_reward", "org/reward-model", "/models/rm/"],
        reward_weights=[1, 0.5, -0.25],
    )
    assert several.reward_func_names == ["format_reward", "reward-model", "rm"]
    assert several.reward_weights == [1.0, 0.5, -0.25]
    with pytest.raises(ValueError, match=r"set algorithm: grpo or online_dpo, or remove loss_type"):
        PPOConfig(model_name="m", algorithm="rloo", group_size=2, loss_type="dapo")
    with pytest.raises(ValueError, match=r"list the reward model in reward_funcs instead"):
        PPOConfig(model_name="m", reward_model_name="rm", reward_funcs=["org/rm2"])
    with pytest.raises(ValueError, match=r"\['fmt'\] repeat"):
        PPOConfig(model_name="m", reward_funcs=["a:fmt", "b:fmt"])


def test_invalid_message_says_what_to_change() -> None:
    with pytest.raises(ValueError) as info:
        TrainingConfig(learning_rate=-0.1)
    assert str(info.value) == (
        "learning_rate must be > 0, got -0.1: set a positive learning rate such as 1e-5"
    )
    with pytest.raises(
        ValueError, match=r"algorithm must be one of 'ppo', 'grpo', 'rloo', .*, got 'gpro'"
    ):
        PPOConfig(model_name="m", algorithm="gpro")
    with pytest.raises(ValueError, match="did you mean 'grpo'"):
        PPOConfig(model_name="m", algorithm="gpro")


def test_each_part_validates_alone() -> None:
    with pytest.raises(ValueError, match="^lora_r must be"):
        ModelConfig(model_name="m", lora_r=0)
    with pytest.raises(ValueError, match="^batch_size must be"):
        TrainingConfig(batch_size=0)
    # TrainingConfig does not know group_size, so it leaves the minibatch split to PPOConfig.
    assert TrainingConfig(batch_size=2, num_mini_batches=4).num_mini_batches == 4


def test_lora_fields_checked_only_with_lora() -> None:
    c = PPOConfig(model_name="m", use_lora=False, lora_r=0, lora_alpha=-1.0, lora_dropout=2.0)
    assert c.lora_r == 0 and not c.use_lora


def test_valid_edge_values_are_accepted() -> None:
    c = PPOConfig(
        model_name="m",
        gamma=0.0,
        lam=1.0,
        top_p=1.0,
        kl_coef=0.0,
        lora_dropout=0.0,
        lora_layers=2,
        stop_token_ids=[],
        eval_temperature=0.0,
        warmup_steps=5,
        total_steps=5,
        keep_last_checkpoints=0,
        algorithm="grpo",
        group_size=2,
        vf_coef=0.0,
        lora_keys=("self_attn.q_proj",),  # type: ignore[arg-type]
    )
    assert c.lora_keys == ["self_attn.q_proj"]  # a tuple becomes a list
    assert c.stop_token_ids == []


@pytest.mark.parametrize(
    "batch_size,group_size,num_mini_batches,divisors",
    [(6, 1, 4, "[1, 2, 3, 6]"), (9, 4, 5, "[1, 2, 3, 4, 6, 9, 12, 18, 36]"), (7, 1, 2, "[1, 7]")],
)
def test_minibatch_divisibility(
    batch_size: int, group_size: int, num_mini_batches: int, divisors: str
) -> None:
    rollout = batch_size * group_size
    with pytest.raises(ValueError) as info:
        PPOConfig(
            model_name="m",
            batch_size=batch_size,
            group_size=group_size,
            num_mini_batches=num_mini_batches,
        )
    message = str(info.value)
    assert f"{batch_size} * {group_size} = {rollout}" in message
    assert f"num_mini_batches={num_mini_batches}" in message
    # The suggested values are exactly the divisors of the rollout size (naive reference).
    assert divisors == str([d for d in range(1, rollout + 1) if rollout % d == 0])
    assert f"one of {divisors}" in message


def test_gradient_accumulation_divisibility() -> None:
    with pytest.raises(ValueError) as info:
        PPOConfig(model_name="m", batch_size=6, num_mini_batches=2, gradient_accumulation_steps=2)
    message = str(info.value)
    assert "gradient_accumulation_steps=2" in message and "= 3 sequences" in message
    assert "one of [1, 3]" in message
    # Fine once the minibatch (12 / 2 = 6 sequences) splits evenly.
    c = PPOConfig(
        model_name="m",
        batch_size=6,
        group_size=2,
        num_mini_batches=2,
        gradient_accumulation_steps=3,
    )
    assert c.micro_batch_size == 2


def test_grpo_group_size() -> None:
    with pytest.raises(
        ValueError, match=r'^group_size must be >= 2 when algorithm is "grpo", got 1'
    ):
        PPOConfig(model_name="m", algorithm="grpo")
    c = PPOConfig(model_name="m", algorithm="grpo", group_size=4, batch_size=2)
    assert c.rollout_batch_size == 8
    # PPO may sample several responses per prompt too.
    assert PPOConfig(model_name="m", group_size=2).rollout_batch_size == 16


def test_replace_revalidates() -> None:
    c = PPOConfig(model_name="m")
    with pytest.raises(ValueError, match="^gamma must be"):
        dataclasses.replace(c, gamma=2.0)


# --------------------------------------------------------------------------- parts and docs


def test_model_and_training_parts() -> None:
    c = PPOConfig(
        model_name="pol",
        reward_model_name="rm",
        lora_keys=["self_attn.q_proj"],
        learning_rate=2e-5,
        batch_size=4,
        kl_coef=0.2,
    )
    model, training = c.model_config(), c.training_config()
    assert type(model) is ModelConfig and type(training) is TrainingConfig
    assert {n: getattr(model, n) for n in names(ModelConfig)} == {
        n: getattr(c, n) for n in names(ModelConfig)
    }
    assert {n: getattr(training, n) for n in names(TrainingConfig)} == {
        n: getattr(c, n) for n in names(TrainingConfig)
    }
    assert model.model_name == "pol" and training.learning_rate == 2e-5
    # The parts are independent copies.
    assert model.lora_keys is not None
    model.lora_keys.append("self_attn.v_proj")
    assert c.lora_keys == ["self_attn.q_proj"]
    # Model, training and PPO fields partition PPOConfig's fields.
    ppo_own = set(names(PPOConfig)) - set(names(ModelConfig)) - set(names(TrainingConfig))
    assert not set(names(ModelConfig)) & set(names(TrainingConfig))
    assert {"algorithm", "kl_coef", "gamma", "lam", "clip_epsilon", "group_size"} <= ppo_own


@pytest.mark.parametrize(
    "config_cls, parts",
    [
        (
            PPOConfig,
            (LoraConfig, ModelConfig, OptimConfig, TrainingConfig, AgentConfig, PPOConfig),
        ),
        (SFTConfig, (LoraConfig, OptimConfig, FineTuneConfig, SFTConfig)),
        (RewardConfig, (LoraConfig, OptimConfig, FineTuneConfig, RewardConfig)),
    ],
)
def test_every_field_documented_exactly_once(config_cls: type, parts: tuple[type, ...]) -> None:
    own = {cls: field_docs(cls, inherited=False) for cls in parts}
    seen: list[str] = [name for docs in own.values() for name in docs]
    assert len(seen) == len(set(seen)), "a field is documented in two docstrings"
    assert sorted(seen) == sorted(names(config_cls))
    for cls in parts:  # each part documents its own fields (a redeclared default excepted)
        assert set(own[cls]) <= set(names(cls))
    docs = field_docs(config_cls)
    assert list(docs) == names(config_cls)
    assert all(text for text in docs.values())
    # Continuation lines are joined.
    if "lora_keys" in docs:
        assert docs["lora_keys"].endswith("(mlx-lm's default set).")


def test_config_package_does_not_import_mlx() -> None:
    code = "import sys, config; assert 'mlx' not in sys.modules and 'mlx.core' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


# --------------------------------------------------------------------------- loading


def test_pyyaml_reads_exponent_without_dot_as_string() -> None:
    # Why load_config converts numeric strings for float fields (YAML 1.1 needs "1.0e-5").
    assert yaml.safe_load("x: 1e-5")["x"] == "1e-5"


def test_load_flat_yaml(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "model_name: gpt2\nlearning_rate: 1e-5\nkl_horizon: 1e4\nkl_coef: 1\nuse_lora: false\n"
        "lora_keys: [self_attn.q_proj, self_attn.v_proj]\nmax_grad_norm: .inf\n"
        "stop_token_ids: [0, 2]\nreward_model_name: null\n",
    )
    c = load_config(path)
    expected = PPOConfig(
        model_name="gpt2",
        learning_rate=1e-5,
        kl_horizon=10000,
        kl_coef=1.0,
        use_lora=False,
        lora_keys=["self_attn.q_proj", "self_attn.v_proj"],
        max_grad_norm=math.inf,
        stop_token_ids=[0, 2],
    )
    assert c == expected
    assert type(c.learning_rate) is float and type(c.kl_horizon) is int
    assert type(c.kl_coef) is float


def test_load_sectioned_yaml(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "model:\n  model_name: gpt2\n  lora_r: 4\n  learning_rate: 3e-6  # wrong section: fine\n"
        "training:\n  batch_size: 2\n  output_dir: out\n"
        "ppo:\n  algorithm: grpo\n  group_size: 4\n"
        "seed: 7  # top-level keys may sit beside sections\n",
    )
    c = load_config(path)
    # A GRPO run loaded from a file takes TRL's GRPO defaults (config.trl_names).
    assert c == GRPOConfig(
        model_name="gpt2",
        lora_r=4,
        learning_rate=3e-6,
        batch_size=2,
        output_dir="out",
        group_size=4,
        seed=7,
    )


def test_same_grpo_run_from_python_yaml_set_and_grpoconfig_saves_the_same_config_yaml(
    tmp_path: Path,
) -> None:
    """An algorithm's defaults belong to it: however a GRPO run is built, the fields it is not
    given take TRL's GRPO defaults, and the run directory's config.yaml is the same (output
    folder aside); a field given explicitly keeps its value every way."""
    from training.run_control import CONFIG_FILE

    def saved(config: PPOConfig) -> str:
        path = save_config(config, Path(config.output_dir) / CONFIG_FILE)
        lines = path.read_text(encoding="utf-8").splitlines()
        return "\n".join(line for line in lines if not line.strip().startswith("output_dir:"))

    def runs(extra: dict[str, Any]) -> dict[str, PPOConfig]:
        keys = {"model_name": "m", "algorithm": "grpo", "group_size": 4, **extra}
        as_text = [f"{k}={v}" for k, v in keys.items()]
        yaml_file = write(tmp_path, "".join(f"{k}: {v}\n" for k, v in keys.items()), "grpo.yaml")
        trl = {k: v for k, v in keys.items() if k not in ("algorithm", "group_size")}
        out = {name: str(tmp_path / f"{name}_{len(extra)}") for name in ("py", "yaml", "set")}
        return {
            "python": PPOConfig(**keys, output_dir=out["py"]),
            "yaml": load_config(yaml_file, [f"output_dir={out['yaml']}"]),
            "set": load_config(None, [*as_text, f"output_dir={out['set']}"]),
            "trl names": load_config(
                None,
                ["model_name=m", "algorithm=grpo", "num_generations=4"]
                + [f"{k}={v}" for k, v in extra.items()]
                + [f"output_dir={tmp_path / f'trl_{len(extra)}'}"],
            ),
            "GRPOConfig": GRPOConfig(
                **trl, num_generations=4, output_dir=str(tmp_path / f"grpo_{len(extra)}")
            ),
        }

    defaults = runs({})
    texts = {name: saved(config) for name, config in defaults.items()}
    assert len(set(texts.values())) == 1, texts
    python = defaults["python"]
    assert (python.temperature, python.beta, python.num_ppo_epochs, python.loss_type) == (
        1.0,
        0.0,
        1,
        "dapo",
    )
    assert not python.uses_reference_model

    given = {"temperature": 0.7, "beta": 0.04, "num_ppo_epochs": 4, "loss_type": "bnpo"}
    explicit = runs(given)
    texts = {name: saved(config) for name, config in explicit.items()}
    assert len(set(texts.values())) == 1, texts
    for config in explicit.values():
        assert {k: getattr(config, k) for k in given} == given
    # PPO keeps the fields' own defaults, and replace() keeps what a config holds.
    ppo = PPOConfig(model_name="m")
    assert (ppo.temperature, ppo.beta, ppo.num_ppo_epochs, ppo.loss_type) == (0.7, 0.04, 4, "bnpo")
    assert dataclasses.replace(python, seed=3).temperature == 1.0


def test_duplicate_key_across_sections_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, "model:\n  model_name: a\n  seed: 1\ntraining:\n  seed: 2\n")
    with pytest.raises(ValueError) as info:
        load_config(path)
    message = str(info.value)
    assert "'seed' is given twice" in message and str(path) in message
    assert "section 'model'" in message and "section 'training'" in message


def test_section_must_be_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'model' is a section and must be a mapping"):
        load_config(write(tmp_path, "model: gpt2\n"))


def test_overrides_win_over_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "model_name: gpt2\nlearning_rate: 1e-5\nbatch_size: 4\n")
    c = load_config(
        path,
        [
            "learning_rate=2e-5",
            "batch_size=2",
            "batch_size=16",  # the later override wins
            "max-new-tokens=8",  # dashes are fine
            "ppo.kl_coef=0.1",  # so is a section prefix
            "stop_token_ids=[1, 2]",
            "use_lora=false",
            "sft_model_name=null",
            "output_dir=2024",  # a str field keeps the text, not the int
            "wandb_project=a: b",
        ],
    )
    assert (c.model_name, c.learning_rate, c.batch_size) == ("gpt2", 2e-5, 16)
    assert (c.max_new_tokens, c.kl_coef, c.stop_token_ids) == (8, 0.1, [1, 2])
    assert (c.use_lora, c.sft_model_name, c.output_dir) == (False, None, "2024")
    assert c.wandb_project == "a: b"


def test_override_fixes_a_bad_file_value(tmp_path: Path) -> None:
    path = write(tmp_path, "model_name: gpt2\noutput_dir: 2024\n")
    with pytest.raises(ValueError, match="output_dir must be a string"):
        load_config(path)
    assert load_config(path, ["output_dir=runs/x"]).output_dir == "runs/x"


def test_overrides_without_file() -> None:
    c = load_config(None, ["model_name=gpt2", "gamma=0.99"])
    assert c == PPOConfig(model_name="gpt2", gamma=0.99)
    with pytest.raises(ValueError, match="model_name is required"):
        load_config(None, ["gamma=0.99"])
    with pytest.raises(ValueError, match="must look like key=value"):
        load_config(None, ["model_name=gpt2", "gamma"])


def test_unknown_key_in_yaml_suggests(tmp_path: Path) -> None:
    path = write(tmp_path, "model_name: gpt2\nlearing_rate: 1e-5\n")
    with pytest.raises(ValueError) as info:
        load_config(path)
    message = str(info.value)
    assert "unknown config key 'learing_rate'" in message
    assert str(path) in message
    assert "did you mean 'learning_rate'" in message


def test_unknown_key_in_override_suggests() -> None:
    with pytest.raises(ValueError) as info:
        load_config(None, ["model_name=gpt2", "kl_cof=0.1"])
    message = str(info.value)
    assert "unknown config key 'kl_cof' in override 'kl_cof=0.1'" in message
    assert "'kl_coef'" in message
    with pytest.raises(ValueError) as far:  # one line that says where every key is listed
        load_config(None, ["model_name=gpt2", "zzz=1"])
    assert "`python main.py config --kind ppo` (or grpo, rloo, ...: an algorithm)" in str(far.value)
    assert "learning_rate" not in str(far.value)
    with pytest.raises(ValueError, match="did you mean 'num_generations'"):  # TRL's names too
        load_config(None, ["model_name=gpt2", "num_generationz=4"])
    with pytest.raises(ValueError, match="--kind dpo"):
        load_config(None, ["model_name=gpt2", "zzz=1"], DPOConfig)


def test_all_problems_reported_at_once(tmp_path: Path) -> None:
    path = write(tmp_path, "model_name: gpt2\nbatch_size: abc\nlearing_rate: 1\n")
    with pytest.raises(ValueError) as info:
        load_config(path, ["kl_cof=1"])
    message = str(info.value)
    assert "batch_size" in message and "learing_rate" in message and "kl_cof" in message


@pytest.mark.parametrize(
    "line,expected",
    [
        ("batch_size: abc", "batch_size must be an integer, got 'abc'"),
        ("batch_size: 2.5", "batch_size must be an integer, got 2.5"),
        ("use_lora: 3", "use_lora must be true or false, got 3"),
        (
            "algorithm: gpro",
            "algorithm must be one of 'ppo', 'grpo', 'rloo', 'reinforce_pp', "
            "'reinforce_pp_baseline', 'distill', 'gkd', 'online_dpo', got 'gpro'",
        ),
        ("kl_estimator: K3", "kl_estimator must be one of 'k1', 'k2', 'k3'"),
        ("dtype: bf16", "dtype must be one of 'float32', 'bfloat16', 'float16'"),
        ("learning_rate: fast", "learning_rate must be a number, got 'fast'"),
        ("lora_keys: self_attn.q_proj", "lora_keys must be a list of strings or null"),
        ("stop_token_ids: [1, x]", "stop_token_ids must be a list of integers or null"),
        ("output_dir: 2024", "output_dir must be a string, got 2024"),
        ("model_name: null", "model_name must be a string, got None"),
        ("gamma: true", "gamma must be a number, got True"),
    ],
)
def test_type_errors(tmp_path: Path, line: str, expected: str) -> None:
    text = line + "\n" if line.startswith("model_name") else f"model_name: gpt2\n{line}\n"
    with pytest.raises(ValueError) as info:
        load_config(write(tmp_path, text))
    assert expected in str(info.value)


def test_range_errors_from_a_file_name_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "model_name: gpt2\nlam: 1.5\n")
    with pytest.raises(ValueError) as info:
        load_config(path)
    assert str(path) in str(info.value) and "lam must be in [0, 1], got 1.5" in str(info.value)


def test_missing_file_and_non_mapping(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(missing)
    with pytest.raises(ValueError, match="must be a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(write(tmp_path, "a: [1, 2\n"))
    # An empty file means "all defaults".
    assert load_config(write(tmp_path, ""), ["model_name=m"]) == PPOConfig(model_name="m")


# --------------------------------------------------------------------------- saving


def test_round_trip(tmp_path: Path) -> None:
    config = PPOConfig(
        model_name="org/model",
        sft_model_name="123",  # looks like a number: must come back as a string
        reward_model_name="org/rm",
        dtype="bfloat16",
        lora_keys=["self_attn.q_proj", "mlp.down_proj"],
        learning_rate=3e-6,
        value_learning_rate=1e-5,
        max_grad_norm=math.inf,
        total_steps=100,
        warmup_steps=10,
        log_with="wandb",
        wandb_project="rlhf",
        algorithm="grpo",
        group_size=4,
        stop_token_ids=[0, 151645],
        missing_eos_penalty=1.0,
        kl_estimator="k3",
    )
    path = save_config(config, tmp_path / "ckpt" / "config.yaml")
    assert path.is_file()
    loaded = load_config(path)
    assert loaded == config
    assert type(loaded.sft_model_name) is str
    # The file is grouped in sections, model first.
    data = yaml.safe_load(path.read_text())
    assert list(data) == ["model", "training", "ppo"]
    assert set(data["model"]) == set(names(ModelConfig))
    assert set(data["training"]) == set(names(TrainingConfig))


def test_round_trip_of_a_part(tmp_path: Path) -> None:
    model = ModelConfig(model_name="m", lora_r=4)
    path = save_config(model, tmp_path / "model.yaml")
    assert load_config(path, cls=ModelConfig) == model
    assert list(yaml.safe_load(path.read_text())) == ["model"]


def test_config_to_dict() -> None:
    c = PPOConfig(model_name="m", lora_keys=["a"])
    flat = config_to_dict(c)
    assert list(flat) == names(ModelConfig) + names(TrainingConfig) + [
        n for n in names(PPOConfig) if n not in names(ModelConfig) + names(TrainingConfig)
    ]
    assert flat == {n: getattr(c, n) for n in names(PPOConfig)}
    flat["lora_keys"].append("b")  # a copy
    assert c.lora_keys == ["a"]
    grouped = config_to_dict(c, sectioned=True)
    assert {k: v for section in grouped.values() for k, v in section.items()} == config_to_dict(c)
    assert PPOConfig(**config_to_dict(c)) == c


def test_the_configuration_page_is_generated_from_the_dataclasses() -> None:
    """docs/configuration.md is what `python main.py config --markdown` prints today."""
    from config.reference import config_keys, configuration_markdown

    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert (
        page == configuration_markdown()
    ), "docs/configuration.md is stale: python main.py config --markdown > docs/configuration.md"
    for kind, cls in (("ppo", PPOConfig), ("sft", SFTConfig), ("reward", RewardConfig)):
        listed = [key.name for _, keys in config_keys(kind) for key in keys]
        assert sorted(listed) == sorted(names(cls)) and len(listed) == len(set(listed))


def test_a_saved_config_is_the_base_that_a_file_and_overrides_change(tmp_path: Path) -> None:
    """What a resumed run's command line builds: the run's own config (as its checkpoint recorded
    it, lists from JSON), then only the keys the file gives and the overrides."""
    from config.loading import given_value, load_config

    saved = config_to_dict(PPOConfig(model_name="m", kl_coef=0.1, lora_keys=["a"], seed=3))
    saved["a_setting_since_removed"] = 1
    path = tmp_path / "run.yaml"
    path.write_text("model_name: m\nseed: 4\noutput_dir: runs/x\n")
    config = load_config(path, ["learning_rate=2e-5"], base=saved)
    assert (config.kl_coef, config.lora_keys, config.seed) == (0.1, ["a"], 4)
    assert config.learning_rate == 2e-5 and config.output_dir == "runs/x"
    assert given_value("output_dir", path, ["output_dir=runs/y"]) == "runs/y"
    assert given_value("output_dir", None, []) == PPOConfig.output_dir
