"""training stage of the PPO data flow."""
