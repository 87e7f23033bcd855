"""Qwen-Image (Qwen/Qwen-Image, Qwen/Qwen-Image-2512): an MMDiT on packed latents, a Qwen2.5-VL text encoder, true CFG.

    condition   prompt_embeds [B, L, D]: Qwen2.5-VL's last hidden states of the prompt in the pipeline's chat template,
                the template's first tokens dropped, at most ``max_sequence_length`` tokens (the pipeline's own
                ``encode_prompt``); their count varies by prompt, so the record holds them zero-padded to
                L = ``pretrained.max_sequence_length`` (0: the pipeline's default, 512) with prompt_embeds_mask [B, L]
                (1: a token, 0: padding). A forward sees what the pipeline passes for the same rows: the tokens up to
                the rows' longest, the mask None when every one is a token. Unconditional: the negative prompt " "
                (Flow-GRPO's, and diffusers' documented empty negative prompt)
    latents     packed [B, (H/2f)(W/2f), 4 C]: 2x2 patches of the C-channel, one-frame VAE latent [B, C, 1, H/f, W/f]
                (f = vae_scale_factor: 8 and C = 16 for Qwen-Image), x_0 = N(0, I) drawn as ``prepare_latents``
    schedule    sigmas linspace(1, 1/T, T), shifted by mu = ``calculate_shift`` of the image's token count (the
                scheduler's dynamic shifting: Qwen-Image's is exponential, with shift_terminal)
    output      v(c) = transformer(x, t / 1000, prompt_embeds, mask, img_shapes); with w = ``sample.guidance_scale`` > 1
                the pipeline's true CFG (``true_cfg_scale`` = w, ``negative_prompt`` = " "), two forwards, then the
                combination rescaled per token to the conditional's norm (over each packed token's features):
                    v' = v(n) + w (v(c) - v(n)),    v = v' ||v(c)|| / ||v'||                  (w <= 1: v = v(c))
                The pipeline's ``guidance_scale`` is only for guidance-distilled checkpoints, which diffusers'
                QwenImageTransformer2DModel cannot run (it has no guidance embedding): such a checkpoint is refused
    step        flow matching (models/families/flow_matching.py, sampling/flow_steps.py)
    decode      unpack to [B, C, 1, H/f, W/f], z * latents_std + latents_mean, the VAE, its one frame
"""

from __future__ import annotations

import inspect
import warnings

import numpy as np
import torch
from diffusers import QwenImagePipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

from ddpo_group.models.families import register_family
from ddpo_group.models.families.flow_matching import FlowMatchingFamily

MAX_SEQUENCE_LENGTH = 1024  # the pipeline's limit (check_inputs)


def vae_statistics(vae, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Qwen-Image VAE's (latents_mean, 1 / latents_std) as [1, C, 1, 1, 1] on ``like``'s device and dtype."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(like.device, like.dtype)
    inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(like.device, like.dtype)
    return mean, inverse_std


def normalized_vae_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """The VAE encoder's latents [B, C, 1, H/f, W/f] in the state's scale: (z - mean) / std (``decode``'s inverse)."""
    mean, inverse_std = vae_statistics(vae, latents)
    return (latents - mean) * inverse_std


def decode_vae_latents(pipe, latents: torch.Tensor) -> torch.Tensor:
    """Unpacked state [B, C, 1, H/f, W/f] -> images in [0, 1], as the Qwen-Image pipelines compute it: z / (1 / std) +
    mean, the VAE, its one frame (Krea 2's pipeline too)."""
    vae = pipe.vae
    latents = latents.to(vae.dtype)
    mean, inverse_std = vae_statistics(vae, latents)
    image = vae.decode(latents / inverse_std + mean, return_dict=False)[0][:, :, 0]
    return pipe.image_processor.postprocess(image, output_type="pt").float()


@register_family("qwenimage", QwenImagePipeline)
class QwenImageFamily(FlowMatchingFamily):
    cond_keys = ("prompt_embeds", "prompt_embeds_mask")
    negative_prompt = " "  # the unconditional prompt of true CFG (Flow-GRPO's negative_prompt=[" "] * B)
    # the joint blocks' attention projections and both streams' MLPs: Flow-GRPO's (scripts/train_qwenimage_edit_plus.py)
    lora_target_modules = FlowMatchingFamily.lora_target_modules + (
        "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")

    def __init__(self, pipe, config):
        super().__init__(pipe, config)
        self._truncation_warned = False
        if pipe.transformer.config.guidance_embeds:
            raise ValueError("this Qwen-Image transformer has guidance_embeds=True (a guidance-distilled checkpoint): "
                             "diffusers' QwenImageTransformer2DModel has no guidance embedding to run it; the qwenimage "
                             "family takes the checkpoints with true CFG (guidance_embeds=False)")

    # ------------------------------------------------------------------ text (reused by the Qwen-Image-Edit families)
    @property
    def text_length(self) -> int:
        """L, the tokens of a stored condition: ``pretrained.max_sequence_length``, else the pipeline's default."""
        chosen = self.max_sequence_length
        if chosen:
            return chosen
        return inspect.signature(type(self.pipe).__call__).parameters["max_sequence_length"].default

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict:
        self.warn_truncated(prompts)
        embeds, mask = self.encode_quietly(prompts, max_sequence_length=self.text_length)
        return self.padded_condition(embeds, mask)

    def warn_truncated(self, prompts: list[str]) -> None:
        """Warn once when a prompt has more tokens than ``text_length`` (the pipeline keeps its first ones silently)."""
        if self._truncation_warned:
            return
        pipe = self.pipe
        texts = [pipe.prompt_template_encode.format(prompt) for prompt in prompts]
        counts = [len(ids) - pipe.prompt_template_encode_start_idx for ids in pipe.tokenizer(texts).input_ids]
        long = [i for i, count in enumerate(counts) if count > self.text_length]
        if long:
            self._truncation_warned = True
            warnings.warn(f"prompt {prompts[long[0]]!r} has {counts[long[0]]} text tokens (with the template's last "
                          f"ones), more than the {self.text_length} kept (pretrained.max_sequence_length): it and any "
                          "longer prompt are truncated; this warning is shown once", UserWarning, stacklevel=3)

    def padded_condition(self, embeds: torch.Tensor, mask: torch.Tensor | None) -> dict:
        """The pipeline's (prompt_embeds [B, l, D], mask [B, l] or None: all tokens) -> the record's condition, zero
        padded to ``text_length`` with its mask, on the denoiser's device."""
        n, length, width = embeds.shape
        if mask is None:
            mask = torch.ones(n, length, dtype=torch.long, device=embeds.device)
        padded = embeds.new_zeros(n, self.text_length, width)
        padded[:, :length] = embeds
        full = mask.new_zeros(n, self.text_length)
        full[:, :length] = mask
        return {"prompt_embeds": padded.to(self.device), "prompt_embeds_mask": full.to(self.device)}

    @staticmethod
    def text_inputs(embeds: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What the pipeline passes the transformer for these rows: the tokens up to the longest row's count, and the
        mask, None when every one is a token (``encode_prompt`` drops an all-ones mask)."""
        length = int(mask.sum(dim=1).max())
        embeds, mask = embeds[:, :length], mask[:, :length]
        return embeds, (None if bool(mask.all()) else mask)

    # ------------------------------------------------------------------ latents (packing reused by the Edit families)
    def _grid(self) -> int:
        """Height (= width) of the latent before packing: the pipeline's 2 * (H // (vae_scale_factor * 2))."""
        return 2 * (self.resolution // (self.pipe.vae_scale_factor * 2))

    def latent_shape(self) -> tuple:
        return (self._grid() // 2) ** 2, self.pipe.transformer.config.in_channels

    def img_shapes(self, batch: int) -> list:
        """The transformer's ``img_shapes`` (RoPE positions): one frame of the packed grid per sample."""
        side = self.resolution // self.pipe.vae_scale_factor // 2
        return [[(1, side, side)]] * batch

    def draw_noise(self, batch, generator, device, dtype):
        return self.pipe.prepare_latents(batch, self.pipe.transformer.config.in_channels // 4, self.resolution,
                                         self.resolution, dtype, device, generator)

    def unpack(self, latents: torch.Tensor) -> torch.Tensor:
        """Packed [B, tokens, 4 C] -> the VAE's [B, C, 1, H/f, W/f]."""
        return self.pipe._unpack_latents(latents, self.resolution, self.resolution, self.pipe.vae_scale_factor)

    # ------------------------------------------------------------------ schedule, model
    def schedule_kwargs(self, num_steps: int) -> dict:
        config = self.pipe.scheduler.config  # every field registered (diffusers' defaults included)
        mu = calculate_shift(self.latent_shape()[0], config.base_image_seq_len, config.max_image_seq_len,
                             config.base_shift, config.max_shift)
        return {"sigmas": np.linspace(1.0, 1 / num_steps, num_steps), "mu": mu}

    def schedule(self, num_steps: int, device) -> dict:
        scheduler = self.pipe.scheduler
        scheduler.set_timesteps(device=device, **self.schedule_kwargs(num_steps))  # as retrieve_timesteps(sigmas=...)
        sigmas = scheduler.sigmas.to(device)
        return {"timesteps": scheduler.timesteps, "sigmas": sigmas[:-1], "next_sigmas": sigmas[1:]}

    def transformer_output(self, model, latents, timestep, cond: dict) -> torch.Tensor:
        """One forward of the transformer on a condition's rows (B rows, or one row broadcast as the pipeline's)."""
        embeds, mask = self.text_inputs(cond["prompt_embeds"], cond["prompt_embeds_mask"])
        return model(hidden_states=latents, timestep=timestep, guidance=None, encoder_hidden_states_mask=mask,
                     encoder_hidden_states=embeds, img_shapes=self.img_shapes(latents.shape[0]), return_dict=False)[0]

    @staticmethod
    def true_cfg(conditional: torch.Tensor, unconditional: torch.Tensor, scale: float) -> torch.Tensor:
        """The pipeline's true CFG: the combination rescaled per token to the conditional output's norm."""
        combined = unconditional + scale * (conditional - unconditional)
        cond_norm = torch.norm(conditional, dim=-1, keepdim=True)
        combined_norm = torch.norm(combined, dim=-1, keepdim=True)
        return combined * (cond_norm / combined_norm)

    def model_output(self, model, latents, times, cond, negative, guidance_scale):
        n = latents.shape[0]
        t = torch.as_tensor(times["timesteps"], device=latents.device)
        t = (t.expand(n) if t.ndim == 0 else t).to(latents.dtype) / 1000
        conditional = self.transformer_output(model, latents, t, cond)
        if guidance_scale <= 1.0 or negative is None:
            return conditional
        return self.true_cfg(conditional, self.transformer_output(model, latents, t, negative), guidance_scale)

    @torch.no_grad()
    def clean_latents(self, images):
        latents = normalized_vae_latents(self.pipe.vae, self.vae_latents(images, frame_axis=True))
        batch, channels, _, height, width = latents.shape
        return self.pipe._pack_latents(latents, batch, channels, height, width)

    @torch.no_grad()
    def decode(self, latents):
        return decode_vae_latents(self.pipe, self.unpack(latents))

    # ------------------------------------------------------------------ config
    @classmethod
    def config_errors(cls, config) -> list[str]:
        errors = super().config_errors(config)
        errors += cls.guidance_errors(config)  # true CFG when guidance_scale > 1
        tokens = config.pretrained.max_sequence_length
        if not 0 <= tokens <= MAX_SEQUENCE_LENGTH:
            errors.append(f"pretrained.max_sequence_length={tokens} must be in [0, {MAX_SEQUENCE_LENGTH}] for "
                          "Qwen-Image (0: the pipeline's default, 512)")
        return errors

    def pipeline_kwargs(self, sample_config, pretrained) -> dict:
        """The size and token count, and true CFG: ``true_cfg_scale`` = sample.guidance_scale with the negative prompt
        when it is > 1 (the pipeline's own guidance_scale keyword is for guidance-distilled checkpoints only)."""
        kwargs = {**super().pipeline_kwargs(sample_config, pretrained),
                  "true_cfg_scale": float(sample_config.guidance_scale)}
        if sample_config.guidance_scale > 1.0:
            kwargs["negative_prompt"] = self.run_negative_prompt
        return kwargs
