"""Qwen-Image 2.1 (QwenImage21Pipeline): a single-stream, block-causal DiT on unpatched latents of a 16x VAE, a
Qwen3-VL text encoder, true CFG without a rescale.

    condition   prompt_embeds [B, L, D]: Qwen3-VL's last decoder layer's hidden states (before its final norm, as the
                pipeline hooks it) of the prompt in the pipeline's text-to-image template, the system turn's tokens
                dropped (the pipeline's own ``encode_prompt``); their count varies by prompt and the pipeline keeps
                them all, so the record holds them zero-padded to L = ``pretrained.max_sequence_length`` (0: 512), with
                prompt_embeds_mask [B, L], and a prompt with more tokens than L is refused by name (truncating it would
                sample another image than the pipeline's). The transformer places the target image after the text's
                padded length (its RoPE positions), so the pipeline called with prompts of different lengths gives a
                prompt another image than called with it alone: the family's policy is each prompt alone (a forward
                of the rows of each token count, their text unpadded, the image-slot mask ``img_mask``: no slot in the
                text, then one a 2 x 2 group of target tokens), in sampling and training alike, and evaluation calls
                the pipeline one prompt at a time (``pipeline_max_batch``). The unconditional prompt is base.py's
                negative prompt ("" by default, which the pipeline reads as " ")
    latents     [B, (H/16)(W/16), C]: the C-channel VAE latent (64 for the released model), one token a latent pixel,
                x_0 = N(0, I) drawn as ``prepare_latents`` (in the condition's dtype, as the pipeline)
    schedule    the pipeline's: the checkpoint's ``sample_sigmas`` when it configures them (then the step count is
                theirs: another sample.num_steps is refused at start), else linspace(1, 1/T, T); shifted by mu =
                ``calculate_shift`` of the image's token count (the scheduler's dynamic shifting)
    output      v(c) = transformer(x, t / 1000, prompt_embeds, mask, img_shapes, img_mask)[target tokens]; with
                w = ``sample.guidance_scale`` > 1 the pipeline's true CFG (``true_cfg_scale`` = w with the rows' negative
                prompts): a second forward on the negative condition, v = v(n) + w (v(c) - v(n)), no norm rescale
                (w <= 1: v(c); the pipeline's own default is 1, no guidance)
    kv cache    the pipeline caches the text's keys and values after the first step (``use_kv_cache``, on by default;
                exact in real arithmetic under ``causal_condition``, another rounding): the sampler and the training
                forward compute every step in full, the same computation for both, and the family's keywords of the
                pipeline's call turn the cache off so that evaluation computes it too
    step        flow matching (models/families/flow_matching.py, sampling/flow_steps.py)
    decode      unpack to [B, C, 1, H/16, W/16], z * latents_std + latents_mean, the VAE, its one frame; a VAE with an
                alpha channel (out_channels 4) is composited over white (the pipeline returns RGBA; the rewards score
                RGB)

The processor is transformers' Qwen3VLProcessor, whose video processor needs torchvision: without it the pipeline does
not load, and the error names the extra that installs it (``pip install -e ".[models]"``).
"""

from __future__ import annotations

import inspect

import numpy as np
import torch
from diffusers import QwenImage21Pipeline
from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift

from ddpo_group.errors import ConfigError
from ddpo_group.models.families import register_family
from ddpo_group.models.families.base import needs_torchvision
from ddpo_group.models.families.flow_matching import FlowMatchingFamily
from ddpo_group.models.families.qwenimage import QwenImageFamily

DEFAULT_TEXT_TOKENS = 512  # pretrained.max_sequence_length=0 (the pipeline keeps every token: it has no budget)


@register_family("qwenimage21", QwenImage21Pipeline)
class QwenImage21Family(FlowMatchingFamily):
    cond_keys = ("prompt_embeds", "prompt_embeds_mask")
    patch_size = 2  # the target's 2 x 2 latent tokens a slot of the joint sequence (the pipeline's multiple of 32 px)
    pipeline_max_batch = 1  # the pipeline's image of a prompt depends on the other prompts' lengths: one a call
    # the attention projections and the SwiGLU MLP of every single-stream block
    lora_target_modules = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "img_mlp.proj",
                           "img_mlp.gate_layer", "img_mlp.out")

    def __init__(self, pipe, config):
        super().__init__(pipe, config)
        sigmas = pipe.config.sample_sigmas
        if sigmas:
            sample = config.sample
            steps = {"sample.num_steps": sample.num_steps,
                     "sample.eval_num_steps": sample.eval_num_steps or sample.num_steps}
            wrong = {field: value for field, value in steps.items() if value != len(sigmas)}
            if wrong:
                raise ConfigError(f"this Qwen-Image 2.1 pipeline samples the {len(sigmas)} sigmas its checkpoint "
                                  f"configures (sample_sigmas), whatever the step count it is given: "
                                  f"{', '.join(f'{k}={v}' for k, v in wrong.items())} must be {len(sigmas)}")

    @classmethod
    def load_pipeline(cls, path, local, revision, dtype_kwargs):
        try:
            return super().load_pipeline(path, local, revision, dtype_kwargs)
        except ImportError as error:
            raise needs_torchvision("Qwen-Image 2.1's processor (transformers' Qwen3VLProcessor)", error) from error

    def call_default(self, name: str):
        return inspect.signature(type(self.pipe).__call__).parameters[name].default

    def default_size(self) -> tuple[int, int]:
        """The call's ``output_resolution`` (1024) square: its height and width given none and no condition image."""
        side = self.call_default("output_resolution")
        return side, side

    # ------------------------------------------------------------------ condition
    @property
    def text_length(self) -> int:
        """L, the tokens of a stored condition: ``pretrained.max_sequence_length``, else 512."""
        return self.max_sequence_length or DEFAULT_TEXT_TOKENS

    padded_condition = QwenImageFamily.padded_condition

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict:
        """Each prompt encoded alone, as the pipeline encodes a prompt called alone (the family's policy: module
        docstring; in a batch the encoder would read it left-padded), zero-padded to ``text_length``."""
        rows = []
        for prompt in prompts:
            embeds, _, _ = self.pipe.encode_prompt(prompt=[prompt], device=self.text_encoder_device())
            if embeds.shape[1] > self.text_length:
                raise ValueError(f"prompt {prompt!r} has {embeds.shape[1]} text tokens, more than "
                                 f"pretrained.max_sequence_length={self.text_length} (0: {DEFAULT_TEXT_TOKENS}); the "
                                 f"Qwen-Image 2.1 pipeline keeps every token, so set it to at least {embeds.shape[1]}")
            rows.append(self.padded_condition(embeds, None))
        return {key: torch.cat([row[key] for row in rows]) for key in self.cond_keys}

    # ------------------------------------------------------------------ latents
    @property
    def grid(self) -> tuple[int, int]:
        """The latent's (height, width) in tokens: the pipeline's 2 * (side // 32)."""
        height, width = self.height_width
        factor = self.pipe.vae_scale_factor
        return 2 * (height // (factor * 2)), 2 * (width // (factor * 2))

    def latent_shape(self) -> tuple:
        rows, columns = self.grid
        return rows * columns, self.pipe.transformer.config.in_channels

    def draw_noise(self, batch, generator, device, dtype):
        height, width = self.height_width
        latents, _ = self.pipe.prepare_latents(None, batch, self.pipe.transformer.config.in_channels, height, width,
                                               dtype, device, generator)
        return latents

    # ------------------------------------------------------------------ schedule, model
    def schedule_kwargs(self, num_steps: int) -> dict:
        config = self.pipe.scheduler.config
        sigmas = self.pipe.config.sample_sigmas or np.linspace(1.0, 1 / num_steps, num_steps)
        mu = calculate_shift(self.latent_shape()[0], config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))
        return {"sigmas": sigmas, "mu": mu}

    def transformer_output(self, model, latents, timestep, cond: dict) -> torch.Tensor:
        """The target tokens' velocity of a condition's rows (B rows, or one row broadcast), each row as the pipeline
        computes it for its prompt alone: the rows of each token count in one forward, their text unpadded (module
        docstring: the target's positions follow the text's padded length)."""
        batch_rows = latents.shape[0]
        embeds, mask = cond["prompt_embeds"], cond["prompt_embeds_mask"]
        if embeds.shape[0] != batch_rows:
            embeds, mask = embeds.expand(batch_rows, -1, -1), mask.expand(batch_rows, -1)
        counts = mask.sum(dim=1)
        out = None
        for count in counts.unique().tolist():
            rows = (counts == count).nonzero().flatten()
            part = self.forward_rows(model, latents[rows], timestep[rows], embeds[rows, :count])
            if len(rows) == batch_rows:
                return part
            if out is None:
                out = part.new_empty(batch_rows, *part.shape[1:])
            out[rows] = part
        return out

    def forward_rows(self, model, latents, timestep, embeds) -> torch.Tensor:
        """One forward of rows whose text has the same token count (no padding: the pipeline's mask None)."""
        batch_rows = latents.shape[0]
        slots = torch.ones(batch_rows, embeds.shape[1] + latents.shape[1] // 4, dtype=torch.bool, device=latents.device)
        slots[:, : embeds.shape[1]] = False  # text-to-image: no image slot among the text tokens
        rows, columns = self.grid
        out = model(hidden_states=latents, timestep=timestep, encoder_hidden_states=embeds,
                    encoder_hidden_states_mask=None, img_shapes=[[(1, rows, columns)]] * batch_rows, img_mask=slots,
                    return_dict=False)[0]
        return out[:, -latents.shape[1]:]

    def model_output(self, model, latents, times, cond, negative, guidance_scale):
        batch_rows = latents.shape[0]
        t = torch.as_tensor(times["timesteps"], device=latents.device)
        t = (t.expand(batch_rows) if t.ndim == 0 else t).to(latents.dtype) / 1000
        conditional = self.transformer_output(model, latents, t, cond)
        if guidance_scale <= 1.0 or negative is None:
            return conditional
        unconditional = self.transformer_output(model, latents, t, negative)
        return unconditional + guidance_scale * (conditional - unconditional)

    @torch.no_grad()
    def clean_latents(self, images):
        vae, latents = self.pipe.vae, self.vae_latents(images, frame_axis=True)  # [B, C, 1, rows, columns]
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        std = torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        latents = (latents - mean) / std
        return latents.flatten(2).transpose(1, 2)  # decode's transpose(1, 2).reshape inverted: [B, tokens, C]

    @torch.no_grad()
    def decode(self, latents):
        vae, (rows, columns) = self.pipe.vae, self.grid
        latents = latents.transpose(1, 2).reshape(latents.shape[0], latents.shape[2], 1, rows, columns).to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        std = torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        image = vae.decode(latents * std + mean, return_dict=False)[0][:, :, 0]  # as the pipeline computes it
        return self.rgb(self.pipe.image_processor.postprocess(image, output_type="pt").float())

    @staticmethod
    def rgb(images: torch.Tensor) -> torch.Tensor:
        """[B, 3 or 4, H, W] in [0, 1] -> RGB: an alpha channel composited over white."""
        if images.shape[1] == 3:
            return images
        alpha = images[:, 3:4]
        return images[:, :3] * alpha + (1 - alpha)

    # ------------------------------------------------------------------ config
    @classmethod
    def config_errors(cls, config) -> list[str]:
        errors = super().config_errors(config) + cls.guidance_errors(config)  # true CFG when guidance_scale > 1
        if config.pretrained.max_sequence_length < 0:
            errors.append(f"pretrained.max_sequence_length={config.pretrained.max_sequence_length} must be >= 0 "
                          f"(0: {DEFAULT_TEXT_TOKENS} text tokens for Qwen-Image 2.1)")
        return errors

    def guidance_kwargs(self, guidance_scale: float) -> dict:
        """The call's true CFG scale (it has no ``guidance_scale``); the rows' negative prompts: ``pipeline_row_kwargs``."""
        return {"true_cfg_scale": float(guidance_scale)}

    def pipeline_images(self, output) -> torch.Tensor:
        return self.rgb(output.images)

    def pipeline_kwargs(self, sample_config, pretrained) -> dict:
        """The size and the KV cache off (the sampler's computation: module docstring). The pipeline takes no token
        budget; the guidance: ``guidance_kwargs`` and ``pipeline_row_kwargs``."""
        return {**self.size_kwargs(), "use_kv_cache": False}

    def pipeline_row_kwargs(self, metadata: list[dict]) -> dict:
        """The rows' negative prompts, one per row, whenever the call guides: the pipeline encodes a single negative
        prompt as one row, which its forward cannot pair with several prompts."""
        if self.config.sample.guidance_scale <= self.no_guidance:
            return {}
        return self.negative_prompt_kwargs(metadata) or {"negative_prompt": [self.run_negative_prompt] * len(metadata)}
