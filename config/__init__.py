"""Run configuration: one dataclass per concern (PPO, model, training).

This package never imports mlx: it is imported before the backend is set up and by ``main.py``'s
argument parsing.
"""

from config.loading import SECTIONS, config_to_dict, field_docs, load_config, save_config
from config.model_config import Dtype, ModelConfig, ValueInit, ValueSource
from config.ppo_config import Algorithm, GRPOAdvantageScale, KLEstimator, PPOConfig
from config.training_config import Logger, LRScheduler, TrainingConfig

__all__ = [
    "SECTIONS",
    "Algorithm",
    "Dtype",
    "GRPOAdvantageScale",
    "KLEstimator",
    "LRScheduler",
    "Logger",
    "ModelConfig",
    "PPOConfig",
    "TrainingConfig",
    "ValueInit",
    "ValueSource",
    "config_to_dict",
    "field_docs",
    "load_config",
    "save_config",
]
