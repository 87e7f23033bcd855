"""Stable Diffusion 3 / 3.5: an MM-DiT transformer predicting the flow velocity, three text encoders.

    condition   prompt_embeds [B, 77 + L_T5, D]: CLIP-L and CLIP-G hidden states (zero-padded to the T5 width) then T5
                tokens (zeros without T5); pooled_prompt_embeds [B, 2048]: CLIP-L and CLIP-G pooled (the pipeline's
                own ``encode_prompt``)
    latents     [B, 16, H/8, W/8], x_0 = N(0, I) (``prepare_latents``: the pipeline's draw)
    output      v = transformer(x, t in 0..1000, prompt_embeds, pooled), classifier-free guidance as one batched
                forward: v = v_uncond + w (v_cond - v_uncond)              (w <= 1: no guidance)
    step        flow matching (models/families/flow_matching.py, sampling/flow_steps.py)
    decode      VAE with latents / scaling_factor + shift_factor
"""

from __future__ import annotations

import torch
from diffusers import StableDiffusion3Pipeline
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

from ddpo_group.models.families import register_family
from ddpo_group.models.families.flow_matching import FlowMatchingFamily


@register_family("sd3", StableDiffusion3Pipeline)
class StableDiffusion3Family(FlowMatchingFamily):
    cond_keys = ("prompt_embeds", "pooled_prompt_embeds")

    @property
    def patch_size(self) -> int:
        return self.pipe.transformer.config.patch_size

    def position_limit(self) -> tuple[int, str] | None:
        """The transformer's positional embedding table: ``pos_embed_max_size`` patches a side."""
        size = self.pipe.transformer.config.pos_embed_max_size
        return (size, f"{type(self.pipe.transformer).__name__}'s pos_embed_max_size={size}") if size else None

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict:
        tokens = {"max_sequence_length": self.max_sequence_length} if self.max_sequence_length else {}
        embeds, _, pooled, _ = self.encode_quietly(prompts, prompt_2=None, prompt_3=None,
                                                   do_classifier_free_guidance=False, **tokens)
        return {"prompt_embeds": embeds.to(self.device), "pooled_prompt_embeds": pooled.to(self.device)}

    def latent_shape(self) -> tuple:
        size = self.resolution // self.pipe.vae_scale_factor
        return self.pipe.transformer.config.in_channels, size, size

    def draw_noise(self, batch, generator, device, dtype):
        return self.pipe.prepare_latents(batch, self.pipe.transformer.config.in_channels, self.resolution,
                                         self.resolution, dtype, device, generator)

    def schedule_kwargs(self, num_steps: int) -> dict:
        config = self.pipe.scheduler.config
        if not config.use_dynamic_shifting:  # the scheduler's config holds every field (with diffusers' defaults)
            return {}
        tokens = (self.latent_shape()[1] // self.pipe.transformer.config.patch_size) ** 2
        return {"mu": calculate_shift(tokens, config.base_image_seq_len, config.max_image_seq_len, config.base_shift,
                                      config.max_shift)}

    def model_output(self, model, latents, times, cond, negative, guidance_scale):
        batch_rows = latents.shape[0]
        t = torch.as_tensor(times["timesteps"], device=latents.device)
        t = t.expand(batch_rows) if t.ndim == 0 else t
        embeds, pooled = cond["prompt_embeds"], cond["pooled_prompt_embeds"]
        if guidance_scale > 1.0 and negative is not None:
            out = model(
                hidden_states=torch.cat([latents, latents]), timestep=torch.cat([t, t]),
                encoder_hidden_states=torch.cat([negative["prompt_embeds"].expand(batch_rows, -1, -1), embeds]),
                pooled_projections=torch.cat([negative["pooled_prompt_embeds"].expand(batch_rows, -1), pooled]),
                return_dict=False,
            )[0]
            uncond, conditional = out.chunk(2)
            return uncond + guidance_scale * (conditional - uncond)
        return model(hidden_states=latents, timestep=t, encoder_hidden_states=embeds, pooled_projections=pooled,
                     return_dict=False)[0]

    @torch.no_grad()
    def clean_latents(self, images):
        config = self.pipe.vae.config
        return (self.vae_latents(images) - config.shift_factor) * config.scaling_factor

    @torch.no_grad()
    def decode(self, latents):
        vae = self.pipe.vae
        latents = latents / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
        return self.pipe.image_processor.postprocess(image, output_type="pt").float()

    @classmethod
    def config_errors(cls, config) -> list[str]:
        return super().config_errors(config) + cls.guidance_errors(config)
