"""ppo trainer stage of the PPO data flow."""
