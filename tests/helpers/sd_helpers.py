"""Stable Diffusion trajectories and step outputs from text embeddings, through the package's own path: the family's
``model_output`` and ``step`` (what TransitionScorer computes) and ``sample_trajectories`` (what the rollouts call)."""

from __future__ import annotations

from config.base import base
from ddpo_group.models.families.sd import StableDiffusionFamily
from ddpo_group.sampling.trajectories import SamplingOptions, Trajectories, sample_trajectories


def sd_trajectories(pipe, prompt_embeds, negative_prompt_embeds, num_steps: int, guidance_scale: float, eta: float,
                    unet=None, generator=None, initial_noise=None, **options) -> Trajectories:
    """Trajectories of ``unet`` (default ``pipe.unet``) with noise level ``eta`` on every step; ``options`` are
    SamplingOptions fields (decode, compute_log_prob, log_prob_reduce, ...)."""
    negative = None if negative_prompt_embeds is None else {"prompt_embeds": negative_prompt_embeds}
    sampling = SamplingOptions(num_steps, guidance_scale, (float(eta),) * num_steps, **options)
    return sample_trajectories(StableDiffusionFamily(pipe, base()), unet if unet is not None else pipe.unet,
                               {"prompt_embeds": prompt_embeds}, negative, sampling, generator, initial_noise)


def sd_step_output(pipe, unet, latents, next_latents, timesteps, prompt_embeds, negative_prompt_embeds,
                   guidance_scale: float, eta: float, reduce: str = "mean"):
    """The step output (log-prob, mean, std) of recorded transitions x_n -> x_{n+1} under ``unet``, for N flattened
    (sample, step) pairs (inputs [N, ...], one timestep per row), with gradients through ``unet``."""
    family = StableDiffusionFamily(pipe, base())
    times = {"timesteps": timesteps}
    output = family.model_output(unet, latents, times, {"prompt_embeds": prompt_embeds},
                                 {"prompt_embeds": negative_prompt_embeds}, guidance_scale)
    return family.step(output, latents, times, eta, next_latents=next_latents, reduce=reduce)
