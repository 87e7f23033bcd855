"""Krea 2 (Krea2Pipeline: Krea 2, and its few-step Turbo): a DiT on 2x2-packed latents of the Qwen-Image VAE, the text
fused from K tapped layers of a Qwen3-VL text model.

    condition   prompt_embeds [B, L, K, D] and prompt_embeds_mask [B, L] (bool): the pipeline's ``encode_prompt``, the
                hidden states of its ``text_encoder_select_layers`` stacked per token on its fixed layout (the
                template's prefix, the prompt padded to L = ``pretrained.max_sequence_length``, 0: the call's 512, then
                the template's suffix; the prefix's tokens dropped), so every row has the same L. Unconditional: the
                negative prompt "" (the call's own when it guides), encoded the same way. The whole stack is stored
                (the transformer's text fusion is trained too): at the call's 512 tokens, Krea 2's 12 layers of 2560
                are 31 MB a row in bfloat16, so keep sample.text_embedding_cache small
    latents     packed [B, (H/2f)(W/2f), 4 C]: 2x2 patches of the C-channel one-frame VAE latent (f = 8), x_0 = N(0, I)
                drawn as ``prepare_latents`` draws it
    schedule    sigmas linspace(1, 1/T, T) shifted by mu = ``calculate_shift`` of the image's token count (the
                scheduler's dynamic shifting); a distilled checkpoint (``is_distilled``, Krea 2 Turbo) mu = 1.15
    output      v(c) = transformer(x, t / 1000, prompt_embeds, mask, position_ids) with the pipeline's position ids
                (text at the origin, image tokens at their grid cell); guided when w = ``sample.guidance_scale`` > 0
                (the call's 4.5; Turbo samples at 0), two forwards as the pipeline's:
                    v = v(c) + w (v(c) - v(n))
    step        flow matching (models/families/flow_matching.py, sampling/flow_steps.py)
    decode      unpack to [B, C, 1, H/f, W/f], z * latents_std + latents_mean, the VAE, its one frame
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from diffusers import Krea2Pipeline
from diffusers.pipelines.krea2.pipeline_krea2 import calculate_shift

from ddpo_group.models.families import register_family
from ddpo_group.models.families.flow_matching import FlowMatchingFamily
from ddpo_group.models.families.qwenimage import decode_vae_latents, normalized_vae_latents
from ddpo_group.models.families.sana import call_default

DISTILLED_MU = 1.15  # the pipeline's fixed shift of a distilled checkpoint (its __call__)
SUFFIX_TOKENS = 5  # the pipeline's prompt_template_encode_num_suffix_tokens: the layout's last tokens


@register_family("krea2", Krea2Pipeline)
class Krea2Family(FlowMatchingFamily):
    cond_keys = ("prompt_embeds", "prompt_embeds_mask")
    no_guidance = 0.0  # v(c) + w (v(c) - v(n)): the call guides when guidance_scale > 0 (Turbo samples at 0)
    # the attention projections of every block (the image blocks' and the text fusion's: they share the names)
    lora_target_modules = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0")

    def __init__(self, pipe, config):
        self.patch_size = pipe.patch_size  # the pipeline's packing (2): the size rule's and the grid's
        super().__init__(pipe, config)

    # ------------------------------------------------------------------ size, condition
    def default_size(self) -> tuple[int, int]:
        """The call's own 1024 x 1024."""
        return call_default(Krea2Pipeline, "height"), call_default(Krea2Pipeline, "width")

    @property
    def text_length(self) -> int:
        """L: ``pretrained.max_sequence_length``, else the call's 512."""
        return self.max_sequence_length or call_default(Krea2Pipeline, "max_sequence_length")

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict:
        self.warn_truncated(prompts)
        embeds, mask = self.encode_quietly(list(prompts), max_sequence_length=self.text_length)
        return {"prompt_embeds": embeds.to(self.device), "prompt_embeds_mask": mask.to(self.device)}

    def warn_truncated(self, prompts: list[str]) -> None:
        """Warn once when a prompt has more tokens than its room in the fixed layout (L less the suffix's): the pipeline
        keeps its first ones silently."""
        pipe = self.pipe
        room = self.text_length - pipe.prompt_template_encode_num_suffix_tokens
        counts = [len(pipe.tokenizer(prompt).input_ids) for prompt in prompts]
        long = [i for i, count in enumerate(counts) if count > room]
        if long and not getattr(self, "_truncation_warned", False):
            self._truncation_warned = True
            warnings.warn(f"prompt {prompts[long[0]]!r} has {counts[long[0]]} text tokens, more than the {room} the "
                          f"layout keeps (pretrained.max_sequence_length={self.text_length} less the template's "
                          f"{pipe.prompt_template_encode_num_suffix_tokens} last tokens): it and any longer prompt are "
                          "truncated; this warning is shown once", UserWarning, stacklevel=3)

    # ------------------------------------------------------------------ latents, schedule
    def grid(self) -> tuple[int, int]:
        """The packed latent's rows and columns: the size over the VAE's factor times the 2 x 2 patch."""
        height, width = self.height_width
        factor = self.pipe.vae_scale_factor * self.pipe.patch_size
        return height // factor, width // factor

    def latent_shape(self) -> tuple:
        rows, columns = self.grid()
        return rows * columns, self.pipe.transformer.config.in_channels

    def draw_noise(self, batch, generator, device, dtype):
        height, width = self.height_width
        channels = self.pipe.transformer.config.in_channels // self.pipe.patch_size ** 2
        return self.pipe.prepare_latents(batch, channels, height, width, dtype, device, generator)

    def schedule_kwargs(self, num_steps: int) -> dict:
        config = self.pipe.scheduler.config
        mu = DISTILLED_MU if self.pipe.config.is_distilled else calculate_shift(
            self.latent_shape()[0], config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 6400),
            config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        return {"sigmas": np.linspace(1.0, 1 / num_steps, num_steps), "mu": mu}

    # ------------------------------------------------------------------ model, decode
    def transformer_output(self, model, latents, timestep, cond: dict) -> torch.Tensor:
        """One forward on a condition's rows (B rows, or the negative's one row broadcast)."""
        n = latents.shape[0]
        embeds, mask = cond["prompt_embeds"], cond["prompt_embeds_mask"]
        embeds = embeds.expand(n, *embeds.shape[1:]) if embeds.shape[0] == 1 and n > 1 else embeds
        mask = mask.expand(n, *mask.shape[1:]) if mask.shape[0] == 1 and n > 1 else mask
        positions = self.pipe.prepare_position_ids(embeds.shape[1], *self.grid(), latents.device)
        return model(hidden_states=latents, encoder_hidden_states=embeds, timestep=timestep, position_ids=positions,
                     encoder_attention_mask=mask, return_dict=False)[0]

    def model_output(self, model, latents, times, cond, negative, guidance_scale):
        n = latents.shape[0]
        t = torch.as_tensor(times["timesteps"], device=latents.device)
        t = (t.expand(n) if t.ndim == 0 else t) / self.pipe.scheduler.config.num_train_timesteps
        timestep = t.to(latents.dtype)
        conditional = self.transformer_output(model, latents, timestep, cond)
        if guidance_scale <= self.no_guidance or negative is None:
            return conditional
        unconditional = self.transformer_output(model, latents, timestep, negative)
        return conditional + guidance_scale * (conditional - unconditional)

    def unpack(self, latents: torch.Tensor) -> torch.Tensor:
        """Packed [B, tokens, 4 C] -> the VAE's [B, C, 1, H/f, W/f] (the pipeline's ``_unpack_latents``)."""
        height, width = self.height_width
        return self.pipe._unpack_latents(latents, height, width)

    @torch.no_grad()
    def clean_latents(self, images):
        latents = normalized_vae_latents(self.pipe.vae, self.vae_latents(images, frame_axis=True))
        batch, channels, _, height, width = latents.shape
        return self.pipe._pack_latents(latents.squeeze(2), batch, channels, height, width)

    @torch.no_grad()
    def decode(self, latents):
        return decode_vae_latents(self.pipe, self.unpack(latents))  # the Qwen-Image VAE's, as the pipeline decodes

    # ------------------------------------------------------------------ config
    @classmethod
    def config_errors(cls, config) -> list[str]:
        errors = super().config_errors(config) + cls.guidance_errors(config)  # guided when guidance_scale > 0
        tokens = config.pretrained.max_sequence_length
        if tokens != 0 and tokens <= SUFFIX_TOKENS:
            errors.append(f"pretrained.max_sequence_length={tokens} must be 0 (the call's 512) or more than the "
                          f"{SUFFIX_TOKENS} tokens of Krea 2's template suffix it holds")
        return errors

    def pipeline_kwargs(self, sample_config, pretrained) -> dict:
        """The size and the token count (the call's 512 when unset)."""
        return {**self.size_kwargs(), "max_sequence_length": self.text_length}
