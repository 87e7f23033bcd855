"""FLUX.1 (dev, schnell): an MM-DiT transformer on packed latents, guidance as an embedding (no doubled batch).

    condition   prompt_embeds [B, L_T5, 4096]: T5 tokens; pooled_prompt_embeds [B, 768]: CLIP-L pooled (the
                pipeline's own ``encode_prompt``); text ids are zeros, image ids the latent grid (not per sample)
    latents     packed [B, (H/16)(W/16), 64]: 2x2 patches of the 16-channel VAE latent (``prepare_latents``)
    schedule    sigmas linspace(1, 1/T, T) shifted by mu from the image's token count (``calculate_shift``)
    output      v = transformer(x, t / 1000, guidance = w (FLUX.1-dev's guidance embedding), pooled, prompt_embeds,
                txt_ids, img_ids): the guidance scale enters sampling and training alike, so ``train.cfg`` has no
                effect (there is no unconditional forward)
    step        flow matching (models/families/flow_matching.py, sampling/flow_steps.py)
    decode      unpack, then the VAE with latents / scaling_factor + shift_factor
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import FluxPipeline
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

from ddpo_group.models.families import register_family
from ddpo_group.models.families.flow_matching import FlowMatchingFamily


@register_family("flux", FluxPipeline)
class FluxFamily(FlowMatchingFamily):
    cond_keys = ("prompt_embeds", "pooled_prompt_embeds")
    guidance_embedded = True  # FLUX.1-dev's guidance embedding (schnell has none and samples unguided)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict:
        tokens = {"max_sequence_length": self.max_sequence_length} if self.max_sequence_length else {}
        embeds, pooled, _ = self.encode_quietly(prompts, prompt_2=None, **tokens)
        return {"prompt_embeds": embeds.to(self.device), "pooled_prompt_embeds": pooled.to(self.device)}

    def _grid(self) -> int:
        """Height (= width) of the latent before packing: the pipeline's 2 * (H // (vae_scale_factor * 2))."""
        return 2 * (self.resolution // (self.pipe.vae_scale_factor * 2))

    def latent_shape(self) -> tuple:
        return (self._grid() // 2) ** 2, self.pipe.transformer.config.in_channels

    def image_ids(self, device, dtype) -> torch.Tensor:
        return self.pipe._prepare_latent_image_ids(1, self._grid() // 2, self._grid() // 2, device, dtype)

    def draw_noise(self, batch, generator, device, dtype):
        latents, _ = self.pipe.prepare_latents(batch, self.pipe.transformer.config.in_channels // 4, self.resolution,
                                               self.resolution, dtype, device, generator)
        return latents

    def schedule_kwargs(self, num_steps: int) -> dict:
        config = self.pipe.scheduler.config
        # the scheduler's config holds every field (diffusers registers each with its default)
        sigmas = None if config.get("use_flow_sigmas") else np.linspace(1.0, 1 / num_steps, num_steps)
        mu = calculate_shift(self.latent_shape()[0], config.base_image_seq_len, config.max_image_seq_len,
                             config.base_shift, config.max_shift)
        return {"sigmas": sigmas, "mu": mu}

    def schedule(self, num_steps: int, device) -> dict:
        scheduler = self.pipe.scheduler
        kwargs = self.schedule_kwargs(num_steps)
        if kwargs["sigmas"] is None:
            scheduler.set_timesteps(num_steps, device=device, mu=kwargs["mu"])
        else:  # the pipeline passes its sigmas (retrieve_timesteps(sigmas=...)): their count is the step count
            scheduler.set_timesteps(sigmas=kwargs["sigmas"], device=device, mu=kwargs["mu"])
        sigmas = scheduler.sigmas.to(device)
        return {"timesteps": scheduler.timesteps, "sigmas": sigmas[:-1], "next_sigmas": sigmas[1:]}

    def model_output(self, model, latents, times, cond, negative, guidance_scale):
        batch_rows = latents.shape[0]
        t = torch.as_tensor(times["timesteps"], device=latents.device)
        t = (t.expand(batch_rows) if t.ndim == 0 else t).to(latents.dtype)
        guidance = None
        if self.pipe.transformer.config.guidance_embeds:  # the model may be a DDP wrapper or a reference copy
            guidance = torch.full([1], guidance_scale, device=latents.device, dtype=torch.float32).expand(batch_rows)
        embeds = cond["prompt_embeds"]
        return model(
            hidden_states=latents, timestep=t / 1000, guidance=guidance, pooled_projections=cond["pooled_prompt_embeds"],
            encoder_hidden_states=embeds, txt_ids=torch.zeros(embeds.shape[1], 3, device=embeds.device, dtype=embeds.dtype),
            img_ids=self.image_ids(latents.device, latents.dtype), return_dict=False,
        )[0]

    @torch.no_grad()
    def clean_latents(self, images):
        config = self.pipe.vae.config
        latents = (self.vae_latents(images) - config.shift_factor) * config.scaling_factor
        return self.pipe._pack_latents(latents, *latents.shape)

    @torch.no_grad()
    def decode(self, latents):
        vae = self.pipe.vae
        latents = self.pipe._unpack_latents(latents, self.resolution, self.resolution, self.pipe.vae_scale_factor)
        latents = latents / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
        return self.pipe.image_processor.postprocess(image, output_type="pt").float()
