"""Stable Diffusion trajectories and step outputs from text embeddings, through the package's own path: the family's
``model_output`` and ``step`` (what TransitionScorer computes) and ``sample_trajectories`` (what the rollouts call)."""

from __future__ import annotations

from config.base import base
from ddpo_group.models.families.sd import StableDiffusionFamily
from ddpo_group.sampling.trajectories import Trajectories, sample_trajectories


def sd_trajectories(pipe, prompt_embeds, negative_prompt_embeds, num_steps: int, guidance_scale: float, eta: float,
                    unet=None, **kwargs) -> Trajectories:
    """Trajectories of ``unet`` (default ``pipe.unet``) with noise level ``eta`` on every step; ``kwargs`` go to
    sample_trajectories (generator, decode, compute_log_prob, initial_noise, log_prob_reduce, ...)."""
    negative = None if negative_prompt_embeds is None else {"prompt_embeds": negative_prompt_embeds}
    return sample_trajectories(StableDiffusionFamily(pipe, base()), unet if unet is not None else pipe.unet,
                               {"prompt_embeds": prompt_embeds}, negative, num_steps, guidance_scale,
                               [float(eta)] * num_steps, **kwargs)


def sd_step_output(pipe, unet, latents, next_latents, timesteps, prompt_embeds, negative_prompt_embeds,
                   guidance_scale: float, eta: float, reduce: str = "mean"):
    """The step output (log-prob, mean, std) of recorded transitions x_n -> x_{n+1} under ``unet``, for N flattened
    (sample, step) pairs (inputs [N, ...], one timestep per row), with gradients through ``unet``."""
    family = StableDiffusionFamily(pipe, base())
    step = {"timesteps": timesteps}
    output = family.model_output(unet, latents, step, {"prompt_embeds": prompt_embeds},
                                 {"prompt_embeds": negative_prompt_embeds}, guidance_scale)
    return family.step(output, latents, step, eta, next_latents=next_latents, reduce=reduce)
