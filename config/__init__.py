"""Run configuration: one dataclass per concern (models and LoRA, optimisation, PPO; SFT and
reward-model runs).

This package never imports mlx: it is imported before the backend is set up and by ``main.py``'s
argument parsing.
"""

from config.agent_config import TOOL_CALL_PARSERS, AgentConfig
from config.loading import SECTIONS, config_to_dict, field_docs, load_config, save_config
from config.model_config import Dtype, LoraConfig, ModelConfig, ValueInit, ValueSource
from config.ppo_config import (
    Algorithm,
    GRPOAdvantageScale,
    ImportanceSamplingLevel,
    KLEstimator,
    LossType,
    PPOConfig,
)
from config.reward_config import RewardConfig
from config.sft_config import FineTuneConfig, SFTConfig
from config.training_config import Logger, LRScheduler, OptimConfig, TrainingConfig

__all__ = [
    "SECTIONS",
    "TOOL_CALL_PARSERS",
    "AgentConfig",
    "Algorithm",
    "Dtype",
    "GRPOAdvantageScale",
    "ImportanceSamplingLevel",
    "KLEstimator",
    "FineTuneConfig",
    "LRScheduler",
    "Logger",
    "LoraConfig",
    "LossType",
    "ModelConfig",
    "OptimConfig",
    "PPOConfig",
    "RewardConfig",
    "SFTConfig",
    "TrainingConfig",
    "ValueInit",
    "ValueSource",
    "config_to_dict",
    "field_docs",
    "load_config",
    "save_config",
]
