"""Stable Diffusion 1.x / 2.x (and the embedded tiny-shapes model): a UNet, epsilon / v prediction, DDIM.

    condition   prompt_embeds [B, L, D]: the CLIP text encoder's last hidden state
    latents     [B, C, h, w], x_0 = N(0, I) * init_noise_sigma (the pipeline's draw)
    schedule    the DDIM timesteps (the step reads the previous timestep from the scheduler)
    output      eps (or v) with classifier-free guidance as one batched forward:
                out = out_uncond + w (out_cond - out_uncond)          (w <= 1: no guidance)
    step        DDIM with eta = ``sample.noise_level`` as a Gaussian policy (sampling/ddim.py)
"""

from __future__ import annotations

import warnings

import torch
from diffusers import DDIMScheduler, StableDiffusionPipeline
from diffusers.utils.torch_utils import randn_tensor

from ddpo_group.models.families import register_family
from ddpo_group.models.families.base import ModelFamily
from ddpo_group.sampling.ddim import check_trainable_schedule, ddim_step_with_logprob


def ensure_ddim(pipe: StableDiffusionPipeline) -> StableDiffusionPipeline:
    """The log-prob sampler is DDIM's: swap any other scheduler for DDIM with the same config."""
    if not isinstance(pipe.scheduler, DDIMScheduler):
        pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    return pipe


def latent_shape(unet) -> tuple[int, int, int]:
    """(C, h, w) of one latent of ``unet`` (the shape of its initial noise x_0)."""
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


def guided_model_output(unet, latents, timesteps, prompt_embeds, negative_prompt_embeds, guidance_scale: float,
                        added_cond: dict | None = None, negative_added_cond: dict | None = None):
    """UNet output with classifier-free guidance done as one batched forward.

        out = out_uncond + w * (out_cond - out_uncond)     (no guidance when w <= 1 or no negatives)

    ``timesteps`` is a scalar or one per row, so flattened (sample, step) pairs share one call. ``added_cond`` /
    ``negative_added_cond``: the UNet's ``added_cond_kwargs`` of the rows and of their negatives (SDXL's pooled text
    embedding and size ids), row-indexed tensors.
    """
    timesteps = torch.as_tensor(timesteps, device=latents.device)
    if timesteps.ndim == 0:
        timesteps = timesteps.expand(latents.shape[0])
    if guidance_scale > 1.0 and negative_prompt_embeds is not None:
        extra = {}
        if added_cond is not None:
            extra["added_cond_kwargs"] = {key: torch.cat([negative_added_cond[key], value])
                                          for key, value in added_cond.items()}
        out = unet(
            torch.cat([latents, latents]),
            torch.cat([timesteps, timesteps]),
            encoder_hidden_states=torch.cat([negative_prompt_embeds, prompt_embeds]),
            return_dict=False,
            **extra,
        )[0]
        uncond, cond = out.chunk(2)
        return uncond + guidance_scale * (cond - uncond)
    extra = {} if added_cond is None else {"added_cond_kwargs": added_cond}
    return unet(latents, timesteps, encoder_hidden_states=prompt_embeds, return_dict=False, **extra)[0]


@torch.no_grad()
def decode_latents(pipe: StableDiffusionPipeline, latents: torch.Tensor) -> torch.Tensor:
    """Final latents to images [B, 3, H, W] in [0, 1] (the pipeline's own post-processing)."""
    image = pipe.vae.decode(latents.to(pipe.vae.dtype) / pipe.vae.config.scaling_factor, return_dict=False)[0]
    return pipe.image_processor.postprocess(image, output_type="pt", do_denormalize=[True] * image.shape[0]).float()


@register_family("sd", StableDiffusionPipeline)
class StableDiffusionFamily(ModelFamily):
    model_attribute = "unet"
    lora_target_modules = ("to_k", "to_q", "to_v", "to_out.0")
    lora_layers_argument = "unet_lora_layers"
    cond_keys = ("prompt_embeds",)
    time_keys = ("timesteps",)
    standard_noise_level = 1.0  # DDIM's eta = 1 (DDPM-like), ddpo-pytorch's

    def __init__(self, pipe, config):
        super().__init__(ensure_ddim(pipe), config)

    @classmethod
    def load_pipeline(cls, path, local, revision, dtype_kwargs):
        return ensure_ddim(StableDiffusionPipeline.from_pretrained(
            path, revision=revision or None, safety_checker=None, requires_safety_checker=False, local_files_only=local,
            **dtype_kwargs,
        ))

    def encode(self, prompts: list[str]) -> dict:
        return {"prompt_embeds": encode_prompts(self.pipe, prompts).to(self.device)}

    def latent_shape(self) -> tuple:
        return latent_shape(self.pipe.unet)

    def default_size(self) -> tuple[int, int]:
        """The UNet's sample size times the VAE factor: the pipeline's default, and the only size this family samples."""
        side = self.pipe.unet.config.sample_size * self.pipe.vae_scale_factor
        return side, side

    @property
    def height_width(self) -> tuple[int, int]:
        """``default_size()`` whatever ``sample.resolution`` says: the UNet's sample size fixes the image."""
        return self.default_size()

    def size_errors(self) -> list[str]:
        """None: the UNet's sample size fixes the image (``sample.resolution`` is not read)."""
        return []

    def draw_noise(self, batch, generator, device, dtype):
        return randn_tensor((batch, *self.latent_shape()), generator=generator, device=device, dtype=dtype)

    def schedule(self, num_steps: int, device) -> dict:
        self.pipe.scheduler.set_timesteps(num_steps, device=device)
        return {"timesteps": self.pipe.scheduler.timesteps}

    def model_output(self, model, latents, times, cond, negative, guidance_scale):
        negative_embeds = None
        if negative is not None:
            negative_embeds = negative["prompt_embeds"].expand(latents.shape[0], -1, -1)
        return guided_model_output(model, latents, times["timesteps"], cond["prompt_embeds"], negative_embeds,
                                   guidance_scale)

    def step(self, model_output, latents, times, noise_level, next_latents=None, generator=None, compute_log_prob=True,
             reduce="mean", log_prob_dtype="float32"):
        return ddim_step_with_logprob(self.pipe.scheduler, model_output, times["timesteps"], latents, noise_level,
                                      next_latents=next_latents, generator=generator, compute_log_prob=compute_log_prob,
                                      reduce=reduce, log_prob_dtype=log_prob_dtype)

    def decode(self, latents):
        return decode_latents(self.pipe, latents)

    def clean_latents(self, images):
        return self.vae_latents(images) * self.pipe.vae.config.scaling_factor

    def check_trainable(self, sample_config) -> None:
        check_trainable_schedule(self.pipe.scheduler, sample_config.num_steps, self.noise_level(sample_config),
                                 self.stochastic_steps(sample_config))

    @classmethod
    def config_errors(cls, config) -> list[str]:
        sample, errors = config.sample, []
        if not cls.noise_level(sample) > 0:
            errors.append(f"sample.noise_level={sample.noise_level} must be > 0: with 0 (DDIM's eta) the DDIM step is "
                          "deterministic and has no log-probability")
        return errors + cls.guidance_errors(config)

    def pipeline_kwargs(self, sample_config, pretrained) -> dict:
        return {"eta": self.noise_level(sample_config), **self.size_kwargs()}  # DDIM's eta is the noise level
