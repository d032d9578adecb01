"""experience buffer stage of the PPO data flow."""
