"""The first RLHF stages: supervised fine-tuning and reward-model training, and their data."""
