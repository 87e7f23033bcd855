"""FLUX.2 [klein] (4B, 9B: step-distilled; base-4B, base-9B): an MM-DiT transformer on packed latents, 4-D positions.

    condition   prompt_embeds [B, L, 3 D]: the Qwen3 hidden states of layers 9, 18 and 27 (the pipeline's
                ``text_encoder_out_layers``), stacked per token, of the prompt in Qwen3's chat template (user turn, empty
                think block) padded to ``max_sequence_length`` (the pipeline's own ``encode_prompt``); text ids
                (t, h, w, l) = (0, 0, 0, 0..L-1), image ids (0, i, j, 0) over the latent grid: both from the shapes
    latents     packed [B, (H/2s)(W/2s), 4 C]: x_0 = N(0, I) drawn as [B, 4 C, H/2s, W/2s] (the VAE's 2x2-patchified,
                batch-normalised latent) and flattened (``prepare_latents``: the pipeline's draw); s the VAE's factor
    schedule    sigmas linspace(1, 1/T, T) shifted by mu = ``compute_empirical_mu``(image tokens, T) (FLUX.2's fit; not
                FLUX.1's ``calculate_shift``)
    output      v = transformer(x, t / 1000, prompt_embeds, txt_ids, img_ids), no guidance embedding. The distilled
                models (``is_distilled``): no guidance at all, whatever the scale. The base models: classifier-free
                guidance as two forwards, v = v_uncond + w (v_cond - v_uncond) for w > 1, the unconditional input the
                encoded empty prompt
    step        flow matching (models/families/flow_matching.py, sampling/flow_steps.py)
    decode      unpack (the image ids' row-major grid), undo the VAE's batch norm, x * sqrt(running_var + eps) +
                running_mean per patchified channel, unpatchify 2x2, the VAE decoder

FLUX.2 [dev] (``Flux2Pipeline``, family ``flux2_dev``) differs in two places only: the condition is the Mistral Small
3.1 (Mistral3) hidden states of layers 10, 20 and 30 of the prompt after BFL's system message (Mistral's chat template),
and the guidance scale is an embedding input of every forward, v = transformer(x, t / 1000, guidance = w, ...), as
FLUX.1-dev's (no CFG, so ``train.cfg`` has no effect).
"""

from __future__ import annotations

import inspect

import numpy as np
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline
from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

from ddpo_group.models.families import register_family
from ddpo_group.models.families.flow_matching import FlowMatchingFamily
from ddpo_group.models.families.flux import FluxFamily


@register_family("flux2", Flux2KleinPipeline)
class Flux2Family(FlowMatchingFamily):
    # the joint blocks' attention projections (FLUX.1's targets) and the single blocks' fused QKV + MLP input projection
    lora_target_modules = FlowMatchingFamily.lora_target_modules + ("attn.to_qkv_mlp_proj",)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict:
        tokens = {"max_sequence_length": self.max_sequence_length} if self.max_sequence_length else {}
        embeds, _ = self.encode_quietly(prompts, **tokens, **self.out_layers())
        return {"prompt_embeds": embeds.to(self.device)}

    def out_layers(self) -> dict:
        """The pipeline's ``text_encoder_out_layers`` keyword: ``pretrained.text_encoder_out_layers``, or none for the
        pipeline's default; ValueError naming the field when a layer is beyond the text encoder's."""
        chosen = tuple(int(n) for n in self.config.pretrained.text_encoder_out_layers)
        default = inspect.signature(self.pipe.encode_prompt).parameters["text_encoder_out_layers"].default
        config = self.pipe.text_encoder.config
        depth = getattr(config, "text_config", config).num_hidden_layers
        layers = chosen or tuple(default)
        if not layers or min(layers) < 0 or max(layers) > depth:
            source = f"pretrained.text_encoder_out_layers={chosen}" if chosen else (
                f"the pipeline's default text_encoder_out_layers {tuple(default)} (pretrained.text_encoder_out_layers=())")
            raise ValueError(f"{source}: every layer must be in 0..{depth}, the text encoder's hidden layers; set "
                             "pretrained.text_encoder_out_layers to layers it has, e.g. (1,) for a two-layer test model")
        return {"text_encoder_out_layers": chosen} if chosen else {}

    def pipeline_kwargs(self, sample_config, pretrained) -> dict:
        """The size and tokens (flow_matching.py's) and the text encoder's layers when they are chosen."""
        kwargs = super().pipeline_kwargs(sample_config, pretrained)
        if tuple(pretrained.text_encoder_out_layers):
            kwargs["text_encoder_out_layers"] = tuple(int(n) for n in pretrained.text_encoder_out_layers)
        return kwargs

    _grid = FluxFamily._grid  # the latent's height before packing, as FLUX.1's pipeline computes it
    schedule = FluxFamily.schedule  # set_timesteps with the pipeline's sigmas (or the scheduler's own) and mu

    def latent_shape(self) -> tuple:
        return (self._grid() // 2) ** 2, self.pipe.transformer.config.in_channels

    def draw_noise(self, batch, generator, device, dtype):
        latents, _ = self.pipe.prepare_latents(batch, self.pipe.transformer.config.in_channels // 4, self.resolution,
                                               self.resolution, dtype, device, generator)
        # the pipeline's packing is a permute (channel-major memory): made token-major like the batch record's
        # latents, since the log-prob's mean over latent dims sums in memory order (else the first ratio is not 1)
        return latents.contiguous()

    def image_ids(self, batch: int, device) -> torch.Tensor:
        """The pipeline's 4-D latent ids [batch, tokens, 4] (they read only the grid's shape)."""
        side = self._grid() // 2
        return self.pipe._prepare_latent_ids(torch.empty(batch, 1, side, side, device="meta")).to(device)

    def schedule_kwargs(self, num_steps: int) -> dict:
        config = self.pipe.scheduler.config
        sigmas = None if config.get("use_flow_sigmas") else np.linspace(1.0, 1 / num_steps, num_steps)
        return {"sigmas": sigmas, "mu": compute_empirical_mu(image_seq_len=self.latent_shape()[0], num_steps=num_steps)}

    @property
    def classifier_free(self) -> bool:
        """Whether a guidance scale > 1 means CFG: the base models; the distilled ones ignore the scale."""
        return not self.pipe.config.is_distilled

    def _forward(self, model, latents, t, embeds, guidance_scale):
        guidance = None
        if self.guidance_embedded:  # the pipeline's float32 guidance, whatever the latents' dtype
            guidance = torch.full([1], guidance_scale, device=latents.device, dtype=torch.float32).expand(len(latents))
        return model(hidden_states=latents, timestep=t / 1000, guidance=guidance, encoder_hidden_states=embeds,
                     txt_ids=self.pipe._prepare_text_ids(embeds).to(embeds.device),
                     img_ids=self.image_ids(latents.shape[0], latents.device), return_dict=False)[0]

    def model_output(self, model, latents, times, cond, negative, guidance_scale):
        n = latents.shape[0]
        t = torch.as_tensor(times["timesteps"], device=latents.device)
        t = (t.expand(n) if t.ndim == 0 else t).to(latents.dtype)
        out = self._forward(model, latents, t, cond["prompt_embeds"], guidance_scale)
        if guidance_scale > 1.0 and self.classifier_free and negative is not None:
            # two forwards, as the pipeline does (not one doubled batch: other float rounding)
            uncond = self._forward(model, latents, t, negative["prompt_embeds"].expand(n, -1, -1), guidance_scale)
            out = uncond + guidance_scale * (out - uncond)
        return out

    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Packed latents -> the VAE's latents [B, C, H/s, W/s] (unpacked, batch norm undone, unpatchified)."""
        pipe, vae = self.pipe, self.pipe.vae
        side = self._grid() // 2  # the image ids are the row-major grid: the pipeline's scatter by ids is this reshape
        latents = latents.reshape(latents.shape[0], side, side, -1).permute(0, 3, 1, 2).contiguous()
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(latents.device,
                                                                                               latents.dtype)
        return pipe._unpatchify_latents(latents * std + mean)

    def clean_latents(self, images):
        """``decode_latents`` inverted: patchify 2x2, the batch norm, the row-major token grid."""
        vae = self.pipe.vae
        latents = self.pipe._patchify_latents(self.vae_latents(images))
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(latents.device,
                                                                                               latents.dtype)
        latents = (latents - mean) / std
        return latents.permute(0, 2, 3, 1).reshape(latents.shape[0], -1, latents.shape[1])

    @torch.no_grad()
    def decode(self, latents):
        vae = self.pipe.vae
        image = vae.decode(self.decode_latents(latents).to(vae.device, vae.dtype), return_dict=False)[0]
        return self.pipe.image_processor.postprocess(image, output_type="pt").float()

    @classmethod
    def config_errors(cls, config) -> list[str]:
        return super().config_errors(config) + cls.guidance_errors(config)  # the distilled klein models ignore both


@register_family("flux2_dev", Flux2Pipeline)
class Flux2DevFamily(Flux2Family):
    """FLUX.2 [dev]: the klein family's latents, schedule, step and decode; Mistral3's condition (the pipeline's own
    ``encode_prompt``, the same call) and the guidance embedding (module docstring)."""

    guidance_embedded = True
    classifier_free = False
