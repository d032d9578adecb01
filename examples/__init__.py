"""examples stage of the PPO data flow."""
