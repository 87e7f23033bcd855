"""The DDIM step as a Gaussian policy: next latent, its log-probability, the step's mean and std.

The paper's eta (η, the DDIM paper's eq. (16)) keeps its symbol here: it is the run's ``sample.noise_level`` on Stable
Diffusion (0: deterministic DDIM, 1: DDPM-like). All step math runs in float32 whatever the model's dtype
(ALGORITHMS.md, "Sampler step").
"""

from __future__ import annotations

import torch
from diffusers import DDIMScheduler
from diffusers.utils.torch_utils import randn_tensor

from ddpo_group.sampling.gaussian import REDUCTIONS, StepOutput, gaussian_log_prob, per_row as _per_row, reduce_latent_dims

DDIMStepOutput = StepOutput  # the record every sampler step returns (sampling/gaussian.py)
__all__ = ["DDIMStepOutput", "REDUCTIONS", "reduce_latent_dims", "ddim_step_with_logprob", "step_std", "step_alphas",
           "check_trainable_schedule", "predict_clean_eps", "flow_time"]


def step_alphas(scheduler: DDIMScheduler, timestep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """alpha-bar at t and at the previous DDIM timestep t - num_train_timesteps // num_inference_steps."""
    if scheduler.num_inference_steps is None:
        raise ValueError("call scheduler.set_timesteps(num_steps) before taking DDIM steps")
    timestep = timestep.long()
    prev_timestep = timestep - scheduler.config.num_train_timesteps // scheduler.num_inference_steps
    alphas_cumprod, final = _schedule_on(scheduler, timestep.device)
    alpha_prod_t = alphas_cumprod[timestep]
    alpha_prod_prev = torch.where(prev_timestep >= 0, alphas_cumprod[prev_timestep.clamp(min=0)], final)
    return alpha_prod_t, alpha_prod_prev


def _schedule_on(scheduler: DDIMScheduler, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(alphas_cumprod, final_alpha_cumprod) as float32 on ``device``, copied there once per scheduler and device
    (not at every step: on a GPU each copy is a host-to-device transfer in the sampling and training loops)."""
    cache = scheduler.__dict__.setdefault("_ddpo_schedule_cache", {})
    key = (str(device), id(scheduler.alphas_cumprod), id(scheduler.final_alpha_cumprod))
    if key not in cache:
        cache.clear()
        cache[key] = (
            scheduler.alphas_cumprod.to(device, torch.float32),
            torch.as_tensor(scheduler.final_alpha_cumprod, dtype=torch.float32).to(device),
        )
    return cache[key]


def step_std(scheduler: DDIMScheduler, timestep: torch.Tensor, eta: float) -> torch.Tensor:
    """sigma_n = eta * sqrt((1 - ab_prev) / (1 - ab_t) * (1 - ab_t / ab_prev)), per row (DDIM paper, eq. (16))."""
    alpha_prod_t, alpha_prod_prev = step_alphas(scheduler, timestep)
    variance = (1 - alpha_prod_prev) / (1 - alpha_prod_t) * (1 - alpha_prod_t / alpha_prod_prev)
    return eta * variance.clamp(min=0).sqrt()


def flow_time(alpha_prod: torch.Tensor) -> torch.Tensor:
    """The flow-matching time of a DDIM noise level: s = sqrt(1 - ab) / (sqrt(ab) + sqrt(1 - ab)).

    DDIM's x_t = sqrt(ab) x_clean + sqrt(1 - ab) eps divided by sqrt(ab) + sqrt(1 - ab) is exactly the flow
    interpolation (1 - s) x_clean + s eps, so a DDIM step t -> t_prev covers s(t) - s(t_prev) of flow time (s runs
    from about 1 at pure noise to 0 at the data, as the flow families' sigmas do).
    """
    a, b = alpha_prod.sqrt(), (1 - alpha_prod).clamp(min=0).sqrt()
    return b / (a + b)


def check_trainable_schedule(scheduler: DDIMScheduler, num_steps: int, eta: float, trainable: torch.Tensor | None = None
                             ) -> None:
    """Every trainable step (default: all) must have sigma > 0, or its log-probability does not exist."""
    if eta <= 0:
        raise ValueError(f"sample.noise_level={eta}: the DDIM step needs eta > 0 to have a log-probability for training")
    scheduler.set_timesteps(num_steps)
    stds = step_std(scheduler, scheduler.timesteps, eta)
    if trainable is not None:
        stds = torch.where(trainable.to(stds.device), stds, torch.ones_like(stds))
    if not bool((stds > 0).all()):
        bad = scheduler.timesteps[stds <= 0].tolist()
        raise ValueError(
            f"the DDIM step has sigma = 0 at timesteps {bad} (scheduler set_alpha_to_one="
            f"{scheduler.config.set_alpha_to_one}); use set_alpha_to_one=False so every step has a log-probability"
        )


def predict_clean_eps(scheduler: DDIMScheduler, model_output, sample,
                      alpha_prod_t) -> tuple[torch.Tensor, torch.Tensor]:
    """Convert an epsilon / v / sample prediction to (clean_hat, eps_hat) as DDIMScheduler.step does (DDIM paper,
    eq. (12)'s predicted clean latent for epsilon; v = sqrt(ab) eps - sqrt(1 - ab) x_clean for v-prediction, Salimans
    and Ho, 2022)."""
    a = _per_row(alpha_prod_t, sample)
    b = 1 - a
    kind = scheduler.config.prediction_type
    if kind == "epsilon":
        eps = model_output
        clean_hat = (sample - b.sqrt() * eps) / a.sqrt()
    elif kind == "sample":
        clean_hat = model_output
        eps = (sample - a.sqrt() * clean_hat) / b.sqrt()
    elif kind == "v_prediction":
        clean_hat = a.sqrt() * sample - b.sqrt() * model_output
        eps = a.sqrt() * model_output + b.sqrt() * sample
    else:
        raise ValueError(f"prediction_type={kind!r} is not supported; use epsilon, v_prediction or sample")
    if scheduler.config.thresholding:
        clean_hat = scheduler._threshold_sample(clean_hat)
    elif scheduler.config.clip_sample:
        r = scheduler.config.clip_sample_range
        clean_hat = clean_hat.clamp(-r, r)
    return clean_hat, eps


def ddim_step_with_logprob(
    scheduler: DDIMScheduler,
    model_output: torch.Tensor,
    timestep: torch.Tensor | int,
    sample: torch.Tensor,
    eta: float,
    next_latents: torch.Tensor | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    compute_log_prob: bool = True,
    reduce: str = "mean",
    log_prob_dtype: str = "float32",
) -> DDIMStepOutput:
    """One DDIM step x_n -> x_{n+1} as a Gaussian policy with its log-density (diffusers' ``DDIMScheduler.step``, the
    same math, plus the log-probability).

    Indices: n counts the denoising steps of a trajectory, x_0 the initial noise .. x_T the final latent
    (sampling/trajectories.py). The scheduler counts its timesteps t down, so step n goes from timestep t = t_n to
    t_prev = t - num_train_timesteps // num_inference_steps, and diffusers calls x_{n+1} the "previous sample" (of
    x_t): ``sample`` is x_n, ``next_latents`` x_{n+1} (diffusers' ``prev_sample``). Equation numbers are those of the DDIM paper (Song, Meng and
    Ermon, 2020, arXiv:2010.02502), whose alpha_t is diffusers' alphas_cumprod, written ab_t here:

        (1) ab_t, ab_prev                                    alphas_cumprod at t and t_prev (final_alpha_cumprod past 0)
        (2) clean_hat, eps_hat                                  from the model output, eq. (12)'s predicted clean latent
                                                             (epsilon, v or sample prediction; clipped as the scheduler)
        (3) sigma_n = eta sqrt((1 - ab_prev) / (1 - ab_t)) sqrt(1 - ab_t / ab_prev)                             eq. (16)
        (4) mu_n    = sqrt(ab_prev) clean_hat + sqrt(1 - ab_prev - sigma_n^2) eps_hat        eq. (12) without its noise
        (5) x_{n+1} = mu_n + sigma_n z,  z ~ N(0, I)         eq. (12); z drawn as DDIMScheduler.step draws it
        (6) l_n     = reduce( -(x_{n+1} - mu_n)^2 / (2 sigma_n^2) - log sigma_n - log sqrt(2 pi) )
                                                             (sampling/gaussian.py)
        (7) step_length = flow_time(ab_t) - flow_time(ab_prev) > 0              the step's length in flow time

    ``timestep`` is one timestep for the whole batch or a [N] tensor (one per row), so flattened (sample, step) pairs
    are evaluated in one call. With ``next_latents`` given, no noise is drawn and its log-probability is returned (the
    training-time recomputation). All of it runs in float32 whatever the model's dtype.
    """
    sample = sample.float()
    model_output = model_output.float()
    rows = sample.shape[0]
    timestep = torch.as_tensor(timestep, device=sample.device)
    if timestep.ndim == 0:
        timestep = timestep.expand(rows)
    # 1. ab_t and ab_prev
    alpha_prod_t, alpha_prod_prev = step_alphas(scheduler, timestep)
    # 2. the predicted clean latent and noise
    clean_hat, eps = predict_clean_eps(scheduler, model_output, sample, alpha_prod_t)
    # 3. sigma_n, eq. (16)
    std = step_std(scheduler, timestep, eta)
    std_b = _per_row(std, sample)
    # 4. the mean: eq. (12) without its random noise (its predicted clean latent and "direction pointing to x_t")
    mean = _per_row(alpha_prod_prev, sample).sqrt() * clean_hat + (
        1 - _per_row(alpha_prod_prev, sample) - std_b**2
    ).clamp(min=0).sqrt() * eps

    # 5. the next latent: the mean plus sigma_n z (or the given one, to re-score a recorded transition)
    if next_latents is None:
        if eta > 0:
            noise = randn_tensor(model_output.shape, generator=generator, device=model_output.device, dtype=model_output.dtype)
            next_latents = mean + std_b * noise
        else:
            next_latents = mean
    next_latents = next_latents.float()

    # 6. its log-probability under N(mu_n, sigma_n^2 I)
    log_prob = None
    if compute_log_prob:
        if eta <= 0:
            raise ValueError(f"eta={eta}: a DDIM step with eta = 0 is deterministic and has no log-probability")
        log_prob = gaussian_log_prob(next_latents, mean, std, reduce, log_prob_dtype)
    # 7. the step's length in flow time (GRPO-Guard's weight, algorithms/policy_losses.py)
    return DDIMStepOutput(next_latents=next_latents, log_prob=log_prob, mean=mean, std=std,
                          step_length=flow_time(alpha_prod_t) - flow_time(alpha_prod_prev), clean_hat=clean_hat)
