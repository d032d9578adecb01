"""models stage of the PPO data flow."""
