"""Run configuration: one dataclass per concern (PPO, model, training)."""
