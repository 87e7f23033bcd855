"""Sampling with log-probabilities: the DDIM step and the Stable Diffusion trajectory recorder."""
