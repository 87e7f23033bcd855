"""Wan image-to-video (Wan2.1-I2V-14B 480P / 720P, Wan2.2-I2V-A14B): Wan's video model animating a source image, its
first frame.

    condition   Wan's prompt_embeds (models/families/wan.py; 512 UMT5 tokens where the transformer reads CLIP tokens:
                diffusers' attention splits them off the text by that count), and the source image of each prompt
                (``metadata["image"]``, a .jsonl prompt file's ``image``, as the editing families take it), one a
                prompt, resized to the video's height and width by the pipeline's video processor, encoded once a
                sample:
                  image_condition [B, T + C, F', H/s, W/s]: the first-frame mask (ones on the image's latent frame, in
                      the VAE's temporal factor T = 4 channels, zeros after) and the VAE latent (its mode, less
                      latents_mean, times 1 / latents_std) of the video [the image, then F - 1 zero frames]: the
                      pipeline's own ``prepare_latents``
                  image_embeds [B, L_img, D]: the CLIP vision encoder's second-to-last hidden states of the image
                      (the pipeline's ``encode_image``: Wan2.1-I2V); [B, 0, 1] for a transformer without ``image_dim``
                      (Wan2.2-I2V-A14B, which has no image encoder)
                the negative condition is the negative prompt's text (base.py's rule of the negative prompt), its image
                entries empty: both guidance branches read the row's own image inputs, as the pipeline's do
    latents     [B, C, F', H/s, W/s], C the VAE's z_dim (16); x_0 = N(0, I) in float32, the pipeline's draw
    output      v = transformer([x; image_condition], t, prompt_embeds, image_embeds); classifier-free guidance as the
                pipeline, two forwards of the same image inputs, the second with the negative prompt's embeddings:
                v = v_uncond + w (v_cond - v_uncond)                                          (w <= 1: no guidance)
    schedule, step, decode, sizes, the two experts of A14B: Wan's (the UniPC scheduler swapped for the flow Euler
                one of its shift, frames [B, F, 3, H, W], ``sample.resolution`` square or the pipeline's 480 x 832)

The pipeline's own ``__call__`` takes one image a call (``pipeline_max_batch``, ``pipeline_row_kwargs``: the row's
source image as loaded; the pipeline resizes it as ``condition`` does). Wan2.2-TI2V-5B's image-to-video
(``expand_timesteps``: the image replaces the first latent frame, whose timestep is 0) is refused with what is
supported.
"""

from __future__ import annotations

import torch
from diffusers import WanImageToVideoPipeline

from ddpo_group.errors import ConfigError
from ddpo_group.models.families import register_family
from ddpo_group.models.families.wan import WanFamily
from ddpo_group.sampling.family import Capabilities
from ddpo_group.models.source_images import SOURCE_IMAGE_KEY, source_images
from ddpo_group.sampling.trajectories import concatenate_rows

# diffusers' WanAttnProcessor takes the cross-attention context's last 512 tokens as the text's and the others as the
# image's (a literal there) when the transformer reads CLIP image tokens through added key / value projections
TEXT_TOKENS = 512
SUPPORTED = ("Wan2.1-I2V-14B-480P, Wan2.1-I2V-14B-720P (one transformer, a CLIP image encoder) and Wan2.2-I2V-A14B "
             "(transformer trained, transformer_2 frozen, no image encoder)")
IMAGE_KEYS = ("image_condition", "image_embeds")


@register_family("wan_i2v", WanImageToVideoPipeline)
class WanImageToVideoFamily(WanFamily):
    cond_keys = ("prompt_embeds", *IMAGE_KEYS)
    capabilities = Capabilities(video=True, image_conditioning=True)  # a prompt's source image: the first frame
    pipeline_max_batch = 1  # the pipeline's __call__ conditions every prompt of a call on one image
    # Wan's attention projections and the feed-forward: Flow-Factory's default Wan image-to-video targets
    # (src/flow_factory/models/wan/wan2_i2v.py)
    lora_target_modules = WanFamily.lora_target_modules + ("ffn.net.0.proj", "ffn.net.2")

    def __init__(self, pipe, config):
        if pipe.config.expand_timesteps:
            raise ValueError(f"this WanImageToVideoPipeline has expand_timesteps=True (Wan2.2-TI2V-5B's "
                             f"image-to-video: the image replaces the first latent frame): not supported; the wan_i2v "
                             f"family trains {SUPPORTED}")
        transformer = pipe.transformer
        if transformer is not None and transformer.config.image_dim is not None and pipe.image_encoder is None:
            raise ValueError(f"this WanImageToVideoPipeline's transformer reads CLIP image embeddings (image_dim="
                             f"{transformer.config.image_dim}) but the pipeline has no image_encoder; supported: "
                             f"{SUPPORTED}")
        tokens = int(config.pretrained.max_sequence_length)
        reads_clip_tokens = transformer is not None and transformer.config.added_kv_proj_dim is not None
        if reads_clip_tokens and tokens not in (0, TEXT_TOKENS):
            raise ConfigError(f"pretrained.max_sequence_length={tokens}: this Wan image-to-video transformer reads the "
                              f"image's CLIP tokens beside the text and takes the last {TEXT_TOKENS} tokens of its "
                              f"context as the text's (diffusers' WanAttnProcessor): set it to 0 (the pipeline's "
                              f"{TEXT_TOKENS}) or {TEXT_TOKENS}")
        super().__init__(pipe, config)

    @property
    def latent_channels(self) -> int:
        """The VAE's latent channels (the transformer reads them with the image's: 36)."""
        return self.pipe.vae.config.z_dim

    def draw_noise(self, batch, generator, device, dtype):
        """The pipeline's draw (its ``prepare_latents``' ``randn_tensor``, without the image it also encodes)."""
        from diffusers.utils.torch_utils import randn_tensor

        latents = randn_tensor((batch, *self.latent_shape()), generator=generator, device=device, dtype=torch.float32)
        return latents.to(dtype)

    @property
    def image_dim(self) -> int | None:
        """The width of the transformer's image embeddings (None: it reads none, Wan2.2-I2V-A14B)."""
        return self.pipe.transformer.config.image_dim

    # ------------------------------------------------------------------ the condition: prompts with their images
    def encode(self, prompts: list[str]) -> dict:
        """The text condition, its image entries empty (the negative condition: the rows' own image inputs serve both
        guidance branches)."""
        text = super().encode(prompts)
        empty = torch.zeros(len(prompts), 0, device=self.device)
        return {**text, "image_condition": empty, "image_embeds": empty}

    @torch.no_grad()
    def condition(self, prompts: list[str], metadata: list[dict] | None = None) -> dict:
        text = super().encode(prompts)
        metadata = metadata if metadata is not None else [{}] * len(prompts)
        rows = [{**{k: v[i : i + 1] for k, v in text.items()}, **self.image_condition(self.source(prompt, meta))}
                for i, (prompt, meta) in enumerate(zip(prompts, metadata))]
        return concatenate_rows(rows, prompts, self.device)

    def source(self, prompt: str, metadata: dict):
        """The source image of a prompt (PIL, as loaded); an error when it has none or several."""
        images = source_images(metadata)
        if len(images) != 1:
            raise ValueError(f"{self.name} animates one source image a prompt: prompt {prompt!r} has {len(images)} "
                             f"(metadata[{SOURCE_IMAGE_KEY!r}], a .jsonl prompt file's 'image')")
        return images[0]

    @torch.no_grad()
    def image_condition(self, image) -> dict:
        """{image_condition [1, T + C, F', H/s, W/s], image_embeds [1, L_img, D]} of one source image (PIL), as the
        pipeline's ``__call__`` makes them: ``encode_image`` of the image as loaded, ``prepare_latents`` of it resized
        by the video processor (given zeros as its noise, so that it draws none)."""
        pipe, device = self.pipe, self.device
        height, width = self.height_width
        if self.image_dim is None:
            embeds = torch.zeros(1, 0, 1, device=device)
        else:
            embeds = pipe.encode_image(image, device)
        pixels = pipe.video_processor.preprocess(image, height=height, width=width).to(device, dtype=torch.float32)
        _, condition = pipe.prepare_latents(pixels, 1, self.latent_channels, height, width, self.frames, torch.float32,
                                            device, None, torch.zeros(1, *self.latent_shape(), device=device))
        return {"image_condition": condition, "image_embeds": embeds}

    def transformer_inputs(self, latents, cond) -> dict:
        """The latents with the image's latent and mask (channels), and the image embeddings, in the transformer's
        dtype."""
        dtype = self.pipe.transformer.dtype
        hidden = torch.cat([latents, cond["image_condition"].to(latents.dtype)], dim=1).to(dtype)
        embeds = cond["image_embeds"].to(dtype) if self.image_dim is not None else None
        return {"hidden_states": hidden, "encoder_hidden_states_image": embeds}

    def pipeline_row_kwargs(self, metadata: list[dict]) -> dict:
        """The source image of a call's row (one a call), as loaded: the pipeline resizes it; the row's negative
        prompt when it has one."""
        if len(metadata) != 1:
            raise ValueError(f"{type(self.pipe).__name__} conditions a call on one image; got {len(metadata)} rows")
        return {**self.negative_prompt_kwargs(metadata), "image": self.source("", metadata[0])}
