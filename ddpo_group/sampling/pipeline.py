"""Stable Diffusion trajectories with log-probabilities, and their recomputation for training.

Sampling consumes the random generator exactly as ``StableDiffusionPipeline.__call__`` does
(initial latents, then one noise draw per step), so with the same generator and eta both
produce the same images.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from diffusers import DDIMScheduler, StableDiffusionPipeline
from diffusers.utils.torch_utils import randn_tensor
from tqdm.auto import tqdm

from ddpo_group.sampling.ddim import ddim_step_with_logprob


@dataclass
class Trajectories:
    images: torch.Tensor | None  # [B, 3, H, W] in [0, 1], float32
    latents: torch.Tensor  # [B, T+1, C, h, w]: x_0 (noise) .. x_T (final latent)
    log_probs: torch.Tensor  # [B, T]
    timesteps: torch.Tensor  # [B, T]
    values: torch.Tensor | None = None  # [B, T] critic values of the pre-step latents, set by the caller


def ensure_ddim(pipe: StableDiffusionPipeline) -> StableDiffusionPipeline:
    """The log-prob sampler is DDIM's: swap any other scheduler for DDIM with the same config."""
    if not isinstance(pipe.scheduler, DDIMScheduler):
        pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    return pipe


def latent_shape(unet) -> tuple[int, int, int]:
    """(C, h, w) of one latent of ``unet`` (the shape of its initial noise x_T)."""
    return unet.config.in_channels, unet.config.sample_size, unet.config.sample_size


_TRUNCATION_WARNED: set[int] = set()  # ids of the tokenizers that already warned


def warn_long_prompts(tokenizer, prompts: list[str]) -> list[int]:
    """Indices of the prompts longer than the tokenizer's limit; the first time a tokenizer meets any, a warning
    names the limit and an example (they are truncated, as the text encoder cannot read more)."""
    limit = tokenizer.model_max_length
    lengths = [len(ids) for ids in tokenizer(prompts, padding=False, truncation=True, max_length=limit + 1).input_ids]
    long = [i for i, n in enumerate(lengths) if n > limit]
    if long and id(tokenizer) not in _TRUNCATION_WARNED:
        _TRUNCATION_WARNED.add(id(tokenizer))
        warnings.warn(
            f"prompt {prompts[long[0]]!r} (and any other prompt over the limit) is longer than the tokenizer limit of "
            f"{limit} tokens and is truncated to its first {limit} tokens; this warning is shown once",
            UserWarning, stacklevel=3,
        )
    return long


@torch.no_grad()
def encode_prompts(pipe: StableDiffusionPipeline, prompts: list[str], device=None) -> torch.Tensor:
    """Text embeddings [B, L, D] of the prompts (pad/truncate to the tokenizer's max length; warn once if truncated)."""
    device = device or pipe.text_encoder.device
    warn_long_prompts(pipe.tokenizer, prompts)
    ids = pipe.tokenizer(
        prompts, padding="max_length", truncation=True, max_length=pipe.tokenizer.model_max_length, return_tensors="pt"
    ).input_ids.to(device)
    return pipe.text_encoder(ids)[0]


def guided_model_output(
    unet,
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    prompt_embeds: torch.Tensor,
    negative_prompt_embeds: torch.Tensor | None,
    guidance_scale: float,
) -> torch.Tensor:
    """UNet output with classifier-free guidance done as one batched forward.

        out = out_uncond + w * (out_cond - out_uncond)     (no guidance when w <= 1 or no negatives)

    ``timesteps`` is a scalar or one per row, so flattened (sample, step) pairs share one call.
    """
    timesteps = torch.as_tensor(timesteps, device=latents.device)
    if timesteps.ndim == 0:
        timesteps = timesteps.expand(latents.shape[0])
    if guidance_scale > 1.0 and negative_prompt_embeds is not None:
        out = unet(
            torch.cat([latents, latents]),
            torch.cat([timesteps, timesteps]),
            encoder_hidden_states=torch.cat([negative_prompt_embeds, prompt_embeds]),
            return_dict=False,
        )[0]
        uncond, cond = out.chunk(2)
        return uncond + guidance_scale * (cond - uncond)
    return unet(latents, timesteps, encoder_hidden_states=prompt_embeds, return_dict=False)[0]


@torch.no_grad()
def decode_latents(pipe: StableDiffusionPipeline, latents: torch.Tensor) -> torch.Tensor:
    """Final latents to images [B, 3, H, W] in [0, 1] (the pipeline's own post-processing)."""
    image = pipe.vae.decode(latents.to(pipe.vae.dtype) / pipe.vae.config.scaling_factor, return_dict=False)[0]
    return pipe.image_processor.postprocess(image, output_type="pt", do_denormalize=[True] * image.shape[0]).float()


@torch.no_grad()
def sample_with_logprob(
    pipe: StableDiffusionPipeline,
    prompt_embeds: torch.Tensor,
    negative_prompt_embeds: torch.Tensor | None,
    num_inference_steps: int,
    guidance_scale: float,
    eta: float | Sequence[float],
    generator: torch.Generator | list[torch.Generator] | None = None,
    unet=None,
    decode: bool = True,
    progress: bool = False,
    compute_log_prob: bool = True,
    initial_noise: torch.Tensor | None = None,
    log_prob_reduce: str = "mean",
) -> Trajectories:
    """Sample B images and record the trajectory: latents [B, T+1, ...], log_probs [B, T], timesteps [B, T].

    ``unet`` overrides ``pipe.unet`` (e.g. the accelerate-wrapped policy). ``eta`` is one value or one per step
    (``step_etas``: an SDE window); a step with eta = 0 is deterministic and records log-prob 0 (it has none and
    is never trained). All-zero eta (greedy, e.g. ReMax's baseline) needs ``compute_log_prob=False``.
    ``initial_noise`` [B, C, h, w] (standard normal) replaces the x_T drawn from ``generator``, which then
    draws the step noise only. ``log_prob_reduce`` ("mean" or "sum", ``sample.log_prob_reduce``) reduces each
    step's log-density over the latent dimensions.
    """
    unet = unet if unet is not None else pipe.unet
    scheduler = pipe.scheduler
    device = prompt_embeds.device
    batch = prompt_embeds.shape[0]
    scheduler.set_timesteps(num_inference_steps, device=device)
    timesteps = scheduler.timesteps
    shape = (batch, *latent_shape(pipe.unet))
    if initial_noise is None:
        latents = randn_tensor(shape, generator=generator, device=device, dtype=prompt_embeds.dtype)
    elif tuple(initial_noise.shape) != shape:
        raise ValueError(f"initial_noise has shape {tuple(initial_noise.shape)}; the sampler needs {shape}")
    else:
        latents = initial_noise.to(device, prompt_embeds.dtype)
    latents = latents * scheduler.init_noise_sigma

    etas = [float(eta)] * len(timesteps) if isinstance(eta, (int, float)) else [float(e) for e in eta]
    if len(etas) != len(timesteps):
        raise ValueError(f"eta has {len(etas)} values for {len(timesteps)} steps")
    if compute_log_prob and not any(e > 0 for e in etas):
        raise ValueError(f"eta={eta}: every step is deterministic, so no step has a log-probability")
    all_latents, log_probs = [latents.float()], []
    for t, step_eta in tqdm(zip(timesteps, etas), total=len(etas), desc="denoising", leave=False, disable=not progress):
        model_output = guided_model_output(unet, latents, t, prompt_embeds, negative_prompt_embeds, guidance_scale)
        stochastic = step_eta > 0
        step = ddim_step_with_logprob(
            scheduler, model_output, t, latents, step_eta, generator=generator,
            compute_log_prob=compute_log_prob and stochastic, reduce=log_prob_reduce,
        )
        latents = step.prev_sample.to(prompt_embeds.dtype)
        all_latents.append(step.prev_sample)
        if compute_log_prob:
            log_probs.append(step.log_prob if stochastic else torch.zeros(batch, device=device))

    images = decode_latents(pipe, latents) if decode else None
    return Trajectories(
        images=images,
        latents=torch.stack(all_latents, dim=1),
        log_probs=torch.stack(log_probs, dim=1) if compute_log_prob else torch.zeros(batch, len(timesteps), device=device),
        timesteps=timesteps.to(device).unsqueeze(0).expand(batch, -1).clone(),
    )


def step_log_prob(
    unet,
    scheduler: DDIMScheduler,
    latents: torch.Tensor,
    next_latents: torch.Tensor,
    timesteps: torch.Tensor,
    prompt_embeds: torch.Tensor,
    negative_prompt_embeds: torch.Tensor | None,
    guidance_scale: float,
    eta: float,
    reduce: str = "mean",
):
    """Log-prob of recorded transitions x_n -> x_{n+1} under ``unet``, for N flattened (sample, step) pairs.

    Inputs are [N, ...] with one timestep per row; one guided UNet forward covers all N pairs.
    Returns the DDIMStepOutput (log_prob [N], reduced over latent dims by ``reduce``, mean, std) with
    gradients through the UNet.
    """
    model_output = guided_model_output(unet, latents, timesteps, prompt_embeds, negative_prompt_embeds, guidance_scale)
    return ddim_step_with_logprob(scheduler, model_output, timesteps, latents, eta, prev_sample=next_latents,
                                  reduce=reduce)


@dataclass
class TransitionScorer:
    """The step output (log-prob, mean, std) of a batch record's recorded transitions under a model, for
    flattened (sample, step) pairs: the guidance, eta and log-prob reduction the samples were drawn with.

        scorer(model, batch, rows, steps) = step_log_prob(model, ..., batch["latents"][rows, steps], ...)

    The policy update, the KL to the reference and the KL in the reward all score transitions through it.
    """

    scheduler: DDIMScheduler
    negative_prompt_embeds: torch.Tensor  # [1, L, D]: the unconditional text embedding
    guidance_scale: float  # 1: no guidance in the forward
    eta: float
    reduce: str = "mean"

    @classmethod
    def from_config(cls, config, scheduler: DDIMScheduler, negative_prompt_embeds: torch.Tensor) -> "TransitionScorer":
        guidance = config.sample.guidance_scale if config.train.cfg else 1.0
        return cls(scheduler, negative_prompt_embeds, guidance, config.sample.eta, config.sample.log_prob_reduce)

    def __call__(self, model, batch: dict, rows: torch.Tensor, steps: torch.Tensor):
        return step_log_prob(
            model, self.scheduler, batch["latents"][rows, steps], batch["next_latents"][rows, steps],
            batch["timesteps"][rows, steps], batch["prompt_embeds"][rows],
            self.negative_prompt_embeds.expand(len(rows), -1, -1), self.guidance_scale, self.eta, self.reduce,
        )
