"""HunyuanVideo 1.5 text-to-video (HunyuanVideo15Pipeline: the 480p and 720p text-to-video models): a dual-stream DiT
on the 32-channel latent of a 16x / 4x video VAE, a Qwen2.5-VL text encoder and a ByT5 glyph encoder.

    condition   prompt_embeds [B, 1000, D] and prompt_embeds_mask: Qwen2.5-VL's hidden states two layers below the
                last of the prompt in the pipeline's chat template (its system message describing a video), padded
                to the pipeline's 1000 tokens after the template's first 108 are cropped; prompt_embeds_2 [B, 256, D2]
                and prompt_embeds_mask_2: ByT5's of the prompt's quoted text (zeros without one) -- all the pipeline's
                own ``encode_prompt``, the masks in the transformer's dtype as it gives them. The unconditional
                condition is base.py's negative prompt ("" by default, the pipeline's: it encodes no negative prompt
                as "")
    latents     [B, C, F', H/16, W/16] with F' = (F - 1) / 4 + 1 latent frames of F = ``sample.num_frames`` (0: the
                call's 121), drawn as ``prepare_latents`` in the transformer's dtype; the transformer reads them beside
                the pipeline's zero condition latents and mask (2 C + 1 channels) and 729 zero image tokens
                (text-to-video)
    schedule    the pipeline's: sigmas linspace(1, 0, T + 1)[:-1] through the checkpoint's flow Euler scheduler (its
                static shift)
    guidance    the pipeline's ``guider`` component (ClassifierFreeGuidance): the conditional forward, then the
                unconditional one, v = v_n + w (v_c - v_n), and its ``guidance_rescale`` (diffusers'
                ``rescale_noise_cfg``) when > 0. The call takes no guidance scale: the guider holds it, so the family
                gives its pipeline a copy of the checkpoint's guider at w = ``sample.guidance_scale`` (evaluation
                then guides as training; the pipeline guides when w != 1). A guider the family does not reproduce
                (another guidance method, a step window, the original formulation) is refused at start, by name; so
                is guidance with a disabled guider (a distilled checkpoint: sample.guidance_scale=1)
    step        flow matching (models/families/flow_matching.py, sampling/flow_steps.py)
    decode      latents / scaling_factor, AutoencoderKLHunyuanVideo15.decode one video at a time (diffusers 0.42.1's
                VAE fails on a batch of two or more: its mid-block attention mask has the batch axis where the heads'
                is), frames [B, F, 3, H, W] in [0, 1]

The pipeline has no LoRA loader: the family exports the adapter in the layout of diffusers' HunyuanVideo LoRA files
("transformer." keys), which the pipeline's transformer loads with ``load_lora_adapter`` (base.py's ``load_lora``).
"""

from __future__ import annotations

import inspect
import math

import numpy as np
import torch
from diffusers import HunyuanVideo15Pipeline
from diffusers.guiders import ClassifierFreeGuidance
from diffusers.loaders import HunyuanVideoLoraLoaderMixin

from ddpo_group.errors import ConfigError
from ddpo_group.models.families import register_family
from ddpo_group.sampling.family import Capabilities
from ddpo_group.models.families.flow_matching import FlowMatchingFamily


@register_family("hunyuan_video15", HunyuanVideo15Pipeline)
class HunyuanVideo15Family(FlowMatchingFamily):
    capabilities = Capabilities(video=True)
    cond_keys = ("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2")
    patch_size = 1  # set from the transformer in __init__
    lora_saver = HunyuanVideoLoraLoaderMixin  # the pipeline has no save_lora_weights: diffusers' HunyuanVideo layout
    pipeline_max_batch = 1  # the pipeline's VAE cannot decode a batch of videos (module docstring): one a call
    # the joint blocks' attention projections (both streams) and feed-forwards: UniRL's HunyuanVideo 1.5 targets
    lora_target_modules = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
                           "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2",
                           "ff_context.net.0.proj", "ff_context.net.2")

    def __init__(self, pipe, config):
        self.patch_size = pipe.transformer.config.patch_size
        guider = pipe.guider
        scale = float(config.sample.guidance_scale)
        problems = []
        if type(guider) is not ClassifierFreeGuidance:
            problems.append(f"its guider is a {type(guider).__name__}; the family reproduces ClassifierFreeGuidance")
        else:
            if guider.config.start != 0.0 or guider.config.stop != 1.0:
                problems.append(f"its guider guides only the steps in [start, stop) = [{guider.config.start}, "
                                f"{guider.config.stop}) of each call, which the family does not reproduce")
            if guider.config.use_original_formulation:
                problems.append("its guider uses the original CFG formulation (use_original_formulation=True), which "
                                "the family does not reproduce")
            if not guider.config.enabled and scale > 1.0:
                problems.append(f"its guider is disabled (a guidance-distilled model), but sample.guidance_scale="
                                f"{scale:g} guides: set sample.guidance_scale=1 and train.cfg=False")
        if problems:
            raise ConfigError("this HunyuanVideo 1.5 pipeline's guidance cannot be sampled as the pipeline does:\n  - "
                              + "\n  - ".join(problems))
        super().__init__(pipe, config)
        self.prepare_pipeline(pipe)

    def prepare_pipeline(self, pipe) -> None:
        """The pipeline's guider at the run's scale (its other settings the checkpoint's): pipe() guides as the
        sampler."""
        pipe.guider = pipe.guider.new(guidance_scale=float(self.config.sample.guidance_scale))

    # ------------------------------------------------------------------ sizes
    def call_default(self, name: str):
        return inspect.signature(type(self.pipe).__call__).parameters[name].default

    @property
    def frames(self) -> int:
        """Video frames: ``sample.num_frames``, or the call's 121."""
        return int(self.config.sample.num_frames) or self.call_default("num_frames")

    def default_size(self) -> tuple[int, int]:
        """The call's size given none: the 16:9 size of its bucket list nearest the transformer's ``target_size``."""
        pipe = self.pipe
        return tuple(int(side) for side in pipe.video_processor.calculate_default_height_width(
            pipe.default_aspect_ratio[1], pipe.default_aspect_ratio[0], pipe.target_size))

    def size_multiple(self) -> int:
        return self.pipe.vae_scale_factor_spatial * self.patch_size

    def size_errors(self) -> list[str]:
        """base.py's rule on the height and width, and the frames."""
        return super().size_errors() + self.frame_errors(self.pipe.vae_scale_factor_temporal,
                                                         "the VAE's temporal factor")

    @property
    def latent_channels(self) -> int:
        return self.pipe.num_channels_latents

    def latent_shape(self) -> tuple:
        return self.video_latent_shape()

    def draw_noise(self, batch, generator, device, dtype):
        height, width = self.height_width
        latents = self.pipe.prepare_latents(batch, self.latent_channels, height, width, self.frames,
                                            self.pipe.transformer.dtype, device, generator)
        return latents.to(dtype)

    # ------------------------------------------------------------------ condition
    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict:
        embeds, mask, embeds_2, mask_2 = self.pipe.encode_prompt(
            prompt=list(prompts), device=self.text_encoder_device(), dtype=self.pipe.transformer.dtype,
            batch_size=len(prompts))
        values = (embeds, mask, embeds_2, mask_2)
        return {key: value.to(self.device) for key, value in zip(self.cond_keys, values)}

    # ------------------------------------------------------------------ schedule, model
    def schedule_kwargs(self, num_steps: int) -> dict:
        return {"sigmas": np.linspace(1.0, 0.0, num_steps + 1)[:-1]}

    @property
    def guided(self) -> bool:
        """Whether the pipeline's guider guides at the run's scale (enabled, w != 1)."""
        guider = self.pipe.guider
        return bool(guider.config.enabled) and not math.isclose(guider.guidance_scale, 1.0)

    def transformer_output(self, model, inputs: torch.Tensor, t, cond: dict) -> torch.Tensor:
        n, dtype = inputs.shape[0], self.pipe.transformer.dtype
        image_embeds = torch.zeros(n, self.pipe.vision_num_semantic_tokens, self.pipe.vision_states_dim, dtype=dtype,
                                   device=inputs.device)

        def rows(key):
            value = cond[key]
            return value.expand(n, *value.shape[1:]) if value.shape[0] != n else value

        return model(hidden_states=inputs, image_embeds=image_embeds, timestep=t,
                     encoder_hidden_states=rows("prompt_embeds"), encoder_attention_mask=rows("prompt_embeds_mask"),
                     encoder_hidden_states_2=rows("prompt_embeds_2"),
                     encoder_attention_mask_2=rows("prompt_embeds_mask_2"), return_dict=False)[0]

    def model_output(self, model, latents, times, cond, negative, guidance_scale):
        dtype = self.pipe.transformer.dtype
        latents = latents.to(dtype)
        zeros = torch.zeros_like(latents)
        inputs = torch.cat([latents, zeros, zeros[:, :1]], dim=1)  # the t2v condition latents and mask: zeros
        batch_rows = latents.shape[0]
        t = torch.as_tensor(times["timesteps"], device=latents.device)
        t = (t.expand(batch_rows) if t.ndim == 0 else t).to(inputs.dtype)
        conditional = self.transformer_output(model, inputs, t, cond)
        guided = guidance_scale > self.no_guidance and negative is not None
        out = conditional
        if guided:
            unconditional = self.transformer_output(model, inputs, t, negative)
            out = unconditional + guidance_scale * (conditional - unconditional)
        rescale = self.pipe.guider.guidance_rescale
        if rescale > 0.0:
            from diffusers.guiders.guider_utils import rescale_noise_cfg

            out = rescale_noise_cfg(out, conditional, rescale)
        return out

    @torch.no_grad()
    def decode(self, latents):
        """Final latents -> frames [B, F, 3, H, W] in [0, 1], one video at a time (module docstring)."""
        vae = self.pipe.vae
        videos = [vae.decode(one.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]
                  for one in latents.split(1)]
        return self.pipe.video_processor.postprocess_video(torch.cat(videos), output_type="pt").float()

    # ------------------------------------------------------------------ config, LoRA
    @classmethod
    def config_errors(cls, config) -> list[str]:
        sample, errors = config.sample, super().config_errors(config)
        if sample.num_frames < 0 or (sample.num_frames and (sample.num_frames - 1) % 4):
            errors.append(f"sample.num_frames={sample.num_frames} must be 4 k + 1 frames (HunyuanVideo 1.5's VAE "
                          "compresses time by 4), e.g. 5, 33, 121; 0: the pipeline's 121")
        if sample.guidance_scale < 1.0:
            errors.append(f"sample.guidance_scale={sample.guidance_scale} would make HunyuanVideo 1.5's guider move "
                          "the conditional output toward the unconditional one (it guides at every scale but 1): set 1 "
                          "(no guidance) or a scale above 1")
        return errors + cls.guidance_errors(config)

    def guidance_kwargs(self, guidance_scale: float) -> dict:
        """None: the pipeline's guider holds the scale, set to ``guidance_scale`` here (the run's when the family is
        built, evaluate.py's ``--guidance_scale`` when it gives one)."""
        self.pipe.guider = self.pipe.guider.new(guidance_scale=float(guidance_scale))
        return {}

    def pipeline_kwargs(self, sample_config, pretrained) -> dict:
        """The size and the frames (the guidance: the family's guider; the negative prompts, one a row, in
        ``pipeline_row_kwargs``: the pipeline encodes a single negative prompt as one row, which it cannot pair with
        several prompts)."""
        return {**self.size_kwargs(), "num_frames": self.frames}

