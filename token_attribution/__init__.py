"""token attribution stage of the PPO data flow."""
