"""advantage stage of the PPO data flow."""
