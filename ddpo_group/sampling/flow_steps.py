"""Flow-matching steps as Gaussian policies: next latent, its log-probability, the step's mean and std.

Conventions (SD3, FLUX): x_s = (1 - s) x_data + s eps, the model predicts the velocity v ~ eps - x_data, sampling
runs the sigmas s from 1 down to 0; step n goes from x = x_n at s = s_n to x' = x_{n+1} at s_next = s_{n+1}
(the trajectory's index convention, sampling/__init__.py):

    dt     = s_next - s  (< 0)
    clean_hat = x - s v                   (the clean latent the velocity points to)
    noise_hat = x + (1 - s) v             (the noise it points to)

Each ``sample.sde_type`` gives the step's mean and std (a = ``sample.noise_level``):

    flow_sde   (Flow-GRPO)   sigma_t = a sqrt(s / (1 - s')),  s' = s, except s' = s_next where s = 1
                             mean = x (1 + sigma_t^2 dt / (2 s)) + v (1 + sigma_t^2 (1 - s) / (2 s)) dt
                             std  = sigma_t sqrt(-dt)
    cps        (coefficients-preserving)
                             std  = s_next sin(a pi / 2)
                             mean = (1 - s_next) clean_hat + sqrt(s_next^2 - std^2) noise_hat
    dance_sde  (DanceGRPO)   mean = x + [v + a^2 (x - (1 - s) clean_hat) / (2 s^2)] dt,   std = a sqrt(-dt)
                             (flow_sde with sigma_t fixed to a)

Every kind reports the step's length s - s_next (= -dt > 0) as ``step_length``.

With a = 0 every kind is the pipeline's deterministic Euler step x + v dt, and that step is computed exactly as
``FlowMatchEulerDiscreteScheduler.step`` does (a deterministic step has no log-probability). The log-probability
is the Gaussian density of the recorded next latent, reduced over the latent dimensions like DDIM's:

    l = reduce( -(x' - mean)^2 / (2 std^2) - log std - log sqrt(2 pi) )

CPS: Flow-GRPO scores CPS steps with the surrogate -mean((x' - mean)^2) (no std, no normaliser); here it is the
true Gaussian log-density with CPS's std, so ratios, clip ranges and the analytic KL mean what they mean for the
other kinds. Its std is 0 where s_next = 0 (the last step): that step is deterministic and never trained.
All step math runs in float32 whatever the model's dtype.
"""

from __future__ import annotations

import math

import torch
from diffusers.utils.torch_utils import randn_tensor

from ddpo_group.registry import Registry
from ddpo_group.sampling.gaussian import StepOutput, gaussian_log_prob, per_row as _per_row

SDE_REGISTRY = Registry("flow SDE (sample.sde_type)")


def register_sde(name: str):
    """Decorator registering ``fn(x, v, s, s_next, a) -> (mean, std [N])`` (s, s_next: [N] per-row sigmas)."""
    return SDE_REGISTRY.register(name)


@register_sde("flow_sde")
def flow_sde(x, v, s, s_next, a):
    """Flow-GRPO's SDE: the marginal-preserving SDE of the flow ODE with sigma_t = a sqrt(s / (1 - s'))."""
    dt = _per_row(s_next - s, x)
    s_prime = torch.where(s == 1, s_next, s)  # s = 1 would divide by zero: Flow-GRPO takes the next sigma there
    sigma_t = a * torch.sqrt(s / (1 - s_prime))
    sig2, s_b = _per_row(sigma_t**2, x), _per_row(s, x)
    mean = x * (1 + sig2 * dt / (2 * s_b)) + v * (1 + sig2 * (1 - s_b) / (2 * s_b)) * dt
    return mean, sigma_t * torch.sqrt(s - s_next)


@register_sde("cps")
def cps(x, v, s, s_next, a):
    """Coefficients-preserving sampling: the next latent keeps the schedule's signal and noise coefficients."""
    std = s_next * math.sin(a * math.pi / 2)
    s_b, s_next_b = _per_row(s, x), _per_row(s_next, x)
    clean_hat, noise_hat = x - s_b * v, x + (1 - s_b) * v
    mean = (1 - s_next_b) * clean_hat + torch.sqrt((s_next_b**2 - _per_row(std, x) ** 2).clamp(min=0)) * noise_hat
    return mean, std


@register_sde("dance_sde")
def dance_sde(x, v, s, s_next, a):
    """DanceGRPO's FLUX step: the flow SDE with a constant diffusion coefficient a."""
    s_b, dt = _per_row(s, x), _per_row(s_next - s, x)
    clean_hat = x - s_b * v
    mean = x + (v + a**2 * (x - (1 - s_b) * clean_hat) / (2 * s_b**2)) * dt
    return mean, a * torch.sqrt(s - s_next)


def flow_step_with_logprob(
    sde_type: str,
    model_output: torch.Tensor,
    sample: torch.Tensor,
    sigma: torch.Tensor | float,
    next_sigma: torch.Tensor | float,
    noise_level: float,
    next_latents: torch.Tensor | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    compute_log_prob: bool = True,
    reduce: str = "mean",
    log_prob_dtype: str = "float32",
) -> StepOutput:
    """One flow-matching step x_s -> x_{s_next} as a Gaussian (module docstring).

    ``sigma`` / ``next_sigma`` are one value for the batch or [N] (flattened (sample, step) pairs). With
    ``next_latents`` given, no noise is drawn and its log-probability is returned (the training-time recomputation).
    """
    x, v = sample.float(), model_output.float()
    s, s_next = _rows(sigma, x), _rows(next_sigma, x)
    if noise_level > 0:
        mean, std = SDE_REGISTRY.get(sde_type)(x, v, s, s_next, float(noise_level))
        std = torch.as_tensor(std, dtype=torch.float32, device=x.device).expand(x.shape[0])
    else:  # the pipeline's Euler step, as FlowMatchEulerDiscreteScheduler.step computes it
        mean, std = x + _per_row(s_next - s, x) * v, torch.zeros(x.shape[0], device=x.device)
    if next_latents is None:
        if noise_level > 0:
            noise = randn_tensor(x.shape, generator=generator, device=x.device, dtype=x.dtype)
            next_latents = mean + _per_row(std, x) * noise
        else:
            next_latents = mean
    next_latents = next_latents.float()
    log_prob = None
    if compute_log_prob:
        if not bool((std > 0).all()):
            raise ValueError(f"{sde_type} step with noise_level={noise_level} has std 0 (a deterministic step): it has "
                             "no log-probability")
        log_prob = gaussian_log_prob(next_latents, mean, std, reduce, log_prob_dtype)
    return StepOutput(next_latents=next_latents, log_prob=log_prob, mean=mean, std=std, step_length=s - s_next,
                      clean_hat=x - _per_row(s, x) * v)  # x_s = (1 - s) x_clean + s eps and v = eps - x_clean


def _rows(value, like: torch.Tensor) -> torch.Tensor:
    """One float32 value per row of ``like``: a scalar broadcast, or a [N] tensor."""
    value = torch.as_tensor(value, device=like.device).float()
    return value.expand(like.shape[0]) if value.ndim == 0 else value
