"""reward kl stage of the PPO data flow."""
