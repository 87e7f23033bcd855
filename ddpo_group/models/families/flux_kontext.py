"""FLUX.1 Kontext (dev): FLUX.1 editing an input image, whose packed VAE latent is appended to the noisy tokens.

    condition   FLUX.1's (models/families/flux.py): prompt_embeds [B, L_T5, 4096], pooled_prompt_embeds [B, 768];
                and the source image of each prompt (``metadata["image"]``, a .jsonl prompt file's ``image``),
                resized to the sampled image's size (``sample.resolution`` square) and preprocessed by the pipeline's
                image processor, then encoded once per sample: image_latents [B, L_img, 64] = pack((mode of
                VAE.encode(image) - shift_factor) * scaling_factor) and image_ids [B, L_img, 3] (the latent grid with
                its first coordinate 1; the noisy tokens' have 0). A prompt without an image has L_img = 0: FLUX.1
                text-to-image (a batch cannot mix the two)
    latents     packed [B, (H/16)(W/16), 64], x_0 = N(0, I) (``prepare_latents``: the pipeline's draw)
    schedule    FLUX.1's: sigmas linspace(1, 1/T, T) shifted by mu from the noisy tokens' count
    output      v = transformer([x; image_latents], t / 1000, guidance = w (the guidance embedding), pooled,
                prompt_embeds, txt_ids = 0, img_ids = [latent ids; image_ids])[:, :L_x]: the transformer sees the
                noisy and the image tokens, only the noisy tokens' output is the velocity. The guidance scale enters
                sampling and training alike (no unconditional forward; the pipeline's true_cfg_scale with a
                negative prompt is not used)
    step        flow matching (models/families/flow_matching.py, sampling/flow_steps.py)
    decode      FLUX.1's: unpack, then the VAE with latents / scaling_factor + shift_factor

The pipeline's own ``__call__`` gives the same images at noise level 0 with ``pipeline_kwargs`` (height = width =
the resolution, ``max_area`` = its square, ``_auto_resize=False``, which keeps the source at its size; Kontext's
default snaps it to one of its preferred ~1 MP sizes) and ``pipeline_row_kwargs`` (the rows' sources, resized to
the resolution as ``condition`` resizes them).
"""

from __future__ import annotations

import torch
from diffusers import FluxKontextPipeline
from diffusers.pipelines.flux.pipeline_flux_kontext import retrieve_latents

from ddpo_group.models.families import register_family
from ddpo_group.sampling.family import Capabilities
from ddpo_group.models.families.flux import FluxFamily
from ddpo_group.sampling.trajectories import concatenate_rows
from ddpo_group.models.source_images import SOURCE_IMAGE_KEY, source_images


@register_family("flux_kontext", FluxKontextPipeline)
class FluxKontextFamily(FluxFamily):
    cond_keys = ("prompt_embeds", "pooled_prompt_embeds", "image_latents", "image_ids")
    capabilities = Capabilities(image_conditioning=True)

    @torch.no_grad()
    def condition(self, prompts: list[str], metadata: list[dict] | None = None) -> dict:
        text = self.encode(prompts)
        metadata = metadata if metadata is not None else [{}] * len(prompts)
        rows = []
        for i, (prompt, meta) in enumerate(zip(prompts, metadata)):
            rows.append({**{k: v[i : i + 1] for k, v in text.items()}, **self.encode_image(self.source(prompt, meta))})
        return concatenate_rows(rows, prompts, self.device)

    def source(self, prompt: str, metadata: dict):
        """The source image of a prompt (PIL) resized to the sampled size as the pipeline resizes it, or None."""
        images = source_images(metadata)
        if len(images) > 1:
            raise ValueError(f"flux_kontext edits one source image per prompt; prompt {prompt!r} has {len(images)} "
                             f"({metadata[SOURCE_IMAGE_KEY]})")
        if not images:
            return None
        size = self.source_size()
        return self.pipe.image_processor.resize(images[0], size, size)

    def source_size(self) -> int:
        """The source images' height = width: the resolution, down to the pipeline's multiple (vae_scale_factor * 2)."""
        multiple = self.pipe.vae_scale_factor * 2
        return self.resolution // multiple * multiple

    def pipeline_row_kwargs(self, metadata: list[dict]) -> dict:
        """The rows' source images, at the sampled size (``_auto_resize=False`` keeps them so): the pipeline encodes
        them as ``condition`` does; none for text-only rows (a call cannot mix the two)."""
        images = [self.source("", meta) for meta in metadata]
        if all(image is None for image in images):
            return {}
        if any(image is None for image in images):
            raise ValueError("flux_kontext: a pipeline call cannot mix rows with and without a source image")
        return {"image": images}

    def encode(self, prompts: list[str]) -> dict:
        """The text condition with no image tokens (the negative condition; text-to-image rows)."""
        text = super().encode(prompts)
        return {**text, **self.encode_image(None, len(prompts))}

    @torch.no_grad()
    def encode_image(self, image, rows: int = 1) -> dict:
        """image_latents [rows, L_img, C] and image_ids [rows, L_img, 3] of one source image (a PIL image at the sampled
        size, ``source``), as the pipeline's ``__call__`` (its image processor) and ``prepare_latents`` make them;
        L_img = 0 without an image."""
        pipe, device = self.pipe, self.device
        dtype = pipe.transformer.dtype
        channels = pipe.transformer.config.in_channels
        if image is None:
            return {"image_latents": torch.zeros(rows, 0, channels, device=device, dtype=dtype),
                    "image_ids": torch.zeros(rows, 0, 3, device=device, dtype=dtype)}
        pixels = pipe.image_processor.preprocess(image, self.source_size(), self.source_size())
        pixels = pixels.to(device=pipe.vae.device, dtype=dtype)
        latents = retrieve_latents(pipe.vae.encode(pixels.to(pipe.vae.dtype)), sample_mode="argmax").to(device)
        latents = (latents - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
        height, width = latents.shape[2:]
        packed = pipe._pack_latents(latents, 1, latents.shape[1], height, width)
        ids = pipe._prepare_latent_image_ids(1, height // 2, width // 2, device, dtype)
        ids[..., 0] = 1
        return {"image_latents": packed.expand(rows, -1, -1).to(dtype), "image_ids": ids.unsqueeze(0).expand(rows, -1, -1)}

    def draw_noise(self, batch, generator, device, dtype):
        latents, _, _, _ = self.pipe.prepare_latents(None, batch, self.pipe.transformer.config.in_channels // 4,
                                                     self.resolution, self.resolution, dtype, device, generator)
        return latents

    def model_output(self, model, latents, times, cond, negative, guidance_scale):
        n, tokens = latents.shape[0], latents.shape[1]
        t = torch.as_tensor(times["timesteps"], device=latents.device)
        t = (t.expand(n) if t.ndim == 0 else t).to(latents.dtype)
        guidance = None
        if self.pipe.transformer.config.guidance_embeds:  # the model may be a DDP wrapper or a reference copy
            guidance = torch.full([1], guidance_scale, device=latents.device, dtype=torch.float32).expand(n)
        embeds = cond["prompt_embeds"]
        image_latents = cond["image_latents"].to(latents.dtype)
        # every row's image ids are the same grid (sources are resized to the sampled size)
        ids = torch.cat([self.image_ids(latents.device, latents.dtype), cond["image_ids"][0].to(latents.dtype)])
        return model(
            hidden_states=torch.cat([latents, image_latents], dim=1), timestep=t / 1000, guidance=guidance,
            pooled_projections=cond["pooled_prompt_embeds"], encoder_hidden_states=embeds,
            txt_ids=torch.zeros(embeds.shape[1], 3, device=embeds.device, dtype=embeds.dtype), img_ids=ids,
            return_dict=False,
        )[0][:, :tokens]

    def pipeline_kwargs(self, sample_config, pretrained) -> dict:
        """FLUX.1's, with the size fixed (the pipeline rescales height and width to ``max_area``) and the source image
        kept at its size (``_auto_resize=False``)."""
        kwargs = super().pipeline_kwargs(sample_config, pretrained)
        return {**kwargs, "max_area": self.resolution ** 2, "_auto_resize": False}
