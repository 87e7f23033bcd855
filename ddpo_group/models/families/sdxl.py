"""Stable Diffusion XL: a UNet with two CLIP text encoders, pooled text embeddings and size conditioning; DDIM.

    condition   prompt_embeds [B, L, D1 + D2]: the penultimate hidden states of CLIP-L and CLIP-G side by side;
                pooled_prompt_embeds [B, P]: CLIP-G's projected pooled output (the pipeline's own ``encode_prompt``).
                The unconditional condition is zeros when the pipeline's ``force_zeros_for_empty_prompt`` is set (SDXL
                base's, as the pipeline does with no negative prompt), else the encoded empty prompt
    latents     [B, 4, H/8, W/8], x_0 = N(0, I) * init_noise_sigma (the pipeline's draw); H = W = ``sample.resolution``
                (0: the pipeline's default, 1024 for SDXL base)
    output      eps = unet(x, t, prompt_embeds, added_cond_kwargs = {text_embeds: pooled, time_ids: (H, W, 0, 0, H, W)})
                (the pipeline's default original size, crop and target size), classifier-free guidance as one batched
                forward: out = out_uncond + w (out_cond - out_uncond)             (w <= 1: no guidance)
    schedule, step   as Stable Diffusion (sd.py): the DDIM timesteps, DDIM with eta = ``sample.noise_level``
                (sampling/ddim.py); any other scheduler of the checkpoint (SDXL base's Euler) is swapped for DDIM
    decode      the VAE with latents / scaling_factor (latents_mean / latents_std when the VAE has them), upcast to
                float32 under fp16 when the VAE's ``force_upcast`` asks for it; the watermark when the pipeline has one
"""

from __future__ import annotations

import torch
from diffusers import StableDiffusionXLPipeline

from ddpo_group.models.families import register_family
from ddpo_group.models.families.base import ModelFamily
from ddpo_group.models.families.flow_matching import FlowMatchingFamily
from ddpo_group.models.families.sd import StableDiffusionFamily, guided_model_output


@register_family("sdxl", StableDiffusionXLPipeline)
class StableDiffusionXLFamily(StableDiffusionFamily):
    """Stable Diffusion's DDIM schedule, step, LoRA targets and config checks; SDXL's condition, size and decoding."""

    cond_keys = ("prompt_embeds", "pooled_prompt_embeds")
    # the pipeline's encode_prompt on the text encoders' device, its truncation log replaced by one warning (as the
    # flow families do it)
    encode_quietly = FlowMatchingFamily.encode_quietly
    text_encoder_device = FlowMatchingFamily.text_encoder_device
    # SDXL samples sample.resolution (Stable Diffusion's UNet fixes its size)
    height_width, size_errors = ModelFamily.height_width, ModelFamily.size_errors

    @classmethod
    def load_pipeline(cls, path, local, revision, dtype_kwargs):
        # ModelFamily's loading (no safety checker to drop); __init__ swaps the scheduler for DDIM
        return super(StableDiffusionFamily, cls).load_pipeline(path, local, revision, dtype_kwargs)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict:
        embeds, _, pooled, _ = self.encode_quietly(prompts, do_classifier_free_guidance=False)
        return {"prompt_embeds": embeds.to(self.device), "pooled_prompt_embeds": pooled.to(self.device)}

    def default_negative_condition(self) -> dict:
        """The pipeline's with no negative prompt: zeros when ``force_zeros_for_empty_prompt``, else "" encoded (a
        given negative prompt is encoded: base.py's rule)."""
        negative = self.encode([self.negative_prompt])
        if self.pipe.config.force_zeros_for_empty_prompt:
            negative = {key: torch.zeros_like(value) for key, value in negative.items()}
        return negative

    def latent_shape(self) -> tuple:
        size = self.resolution // self.pipe.vae_scale_factor
        return self.pipe.unet.config.in_channels, size, size

    def time_ids(self, pooled: torch.Tensor) -> torch.Tensor:
        """[1, 6]: (original size, crop top-left, target size) as the pipeline's defaults, checked against the UNet's
        added embedding by the pipeline."""
        size = (self.resolution, self.resolution)
        encoder = self.pipe.text_encoder_2
        projection = encoder.config.projection_dim if encoder is not None else int(pooled.shape[-1])
        return self.pipe._get_add_time_ids(size, (0, 0), size, dtype=pooled.dtype,
                                           text_encoder_projection_dim=projection).to(pooled.device)

    def model_output(self, model, latents, times, cond, negative, guidance_scale):
        n = latents.shape[0]
        pooled = cond["pooled_prompt_embeds"]
        time_ids = self.time_ids(pooled).expand(n, -1)
        negative_embeds = negative_added = None
        if negative is not None:
            negative_embeds = negative["prompt_embeds"].expand(n, -1, -1)
            negative_added = {"text_embeds": negative["pooled_prompt_embeds"].expand(n, -1), "time_ids": time_ids}
        return guided_model_output(model, latents, times["timesteps"], cond["prompt_embeds"], negative_embeds,
                                   guidance_scale, {"text_embeds": pooled, "time_ids": time_ids}, negative_added)

    @torch.no_grad()
    def clean_latents(self, images):
        vae, latents = self.pipe.vae, self.vae_latents(images)
        mean, std = getattr(vae.config, "latents_mean", None), getattr(vae.config, "latents_std", None)
        if mean is not None and std is not None:  # decode's latents * std / scaling_factor + mean, inverted
            mean = torch.tensor(mean).view(1, -1, 1, 1).to(latents.device, latents.dtype)
            std = torch.tensor(std).view(1, -1, 1, 1).to(latents.device, latents.dtype)
            return (latents - mean) * vae.config.scaling_factor / std
        return latents * vae.config.scaling_factor

    @torch.no_grad()
    def decode(self, latents):
        vae = self.pipe.vae
        upcast = vae.dtype == torch.float16 and vae.config.force_upcast  # SDXL's VAE overflows in float16
        if upcast:  # the VAE and the latents in float32 before the scaling, as the pipeline does
            torch.nn.Module.to(vae, dtype=torch.float32)
            latents = latents.float()
        try:
            mean, std = getattr(vae.config, "latents_mean", None), getattr(vae.config, "latents_std", None)
            if mean is not None and std is not None:
                mean = torch.tensor(mean).view(1, -1, 1, 1).to(latents.device, latents.dtype)
                std = torch.tensor(std).view(1, -1, 1, 1).to(latents.device, latents.dtype)
                latents = latents * std / vae.config.scaling_factor + mean
            else:
                latents = latents / vae.config.scaling_factor
            image = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
        finally:
            if upcast:
                torch.nn.Module.to(vae, dtype=torch.float16)
        if getattr(self.pipe, "watermark", None) is not None:
            image = self.pipe.watermark.apply_watermark(image)
        return self.pipe.image_processor.postprocess(image, output_type="pt").float()

    @classmethod
    def config_errors(cls, config) -> list[str]:
        return super().config_errors(config) + cls.resolution_errors(config.sample)
