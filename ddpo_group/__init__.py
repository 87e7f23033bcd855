"""ddpo_group: RL fine-tuning of diffusion models (DDPO, GRPO family, PPO/GAE, GROUP_PPO)."""

__version__ = "0.1.0"
