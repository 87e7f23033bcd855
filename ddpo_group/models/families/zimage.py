"""Z-Image (Z-Image, Z-Image-Turbo): a single-stream DiT on a list of per-sample inputs, a Qwen3 (LLM) text encoder.

    condition   prompt_embeds [B, L, D]: the second-to-last hidden state of Qwen3 on the chat-templated prompt
                ("<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n"), tokens padded to L =
                ``pretrained.max_sequence_length`` (0: the pipeline's 512), only the unpadded ones kept: the pipeline's
                ``encode_prompt`` gives a list of [l_i, D]; stored here left-aligned and zero-padded to L, with
                prompt_lengths [B] = l_i (int64), so the transformer gets exactly the pipeline's list [e_i[:l_i]]
    latents     [B, 16, H/8, W/8] (the transformer cuts 2x2 patches itself), x_0 = N(0, I) in float32
                (``prepare_latents``); H = W = ``sample.resolution``, or the pipeline's call default 1024 (it has no
                ``default_sample_size``)
    schedule    sigmas linspace(1, 1/T, T) shifted by the scheduler (Z-Image-Turbo: shift 3, no dynamic shifting; mu
                from the token count when the scheduler shifts dynamically), then 0
    output      u_c = transformer([x_i], (1000 - t) / 1000, [e_i[:l_i]]) (the transformer's time runs from 0 at noise
                to 1 at data), v = -u (the scheduler's velocity, eps - x_data). Guidance as the pipeline does it, in
                float32: u = u_c + w (u_c - u_uncond) with w = ``sample.guidance_scale`` (no guidance at w = 0, not 1:
                Z-Image-Turbo samples with w = 0), the conditional and unconditional inputs as one list of 2B;
                ``sample.cfg_truncation`` c: w = 0 on the steps where (1000 - t) / 1000 > c (c = 1: every step guided);
                ``sample.cfg_normalization`` r > 0: u scaled down to ||u|| = r ||u_c|| when above (norms per sample)
    step        flow matching (models/families/flow_matching.py, sampling/flow_steps.py)
    decode      VAE with latents / scaling_factor + shift_factor
"""

from __future__ import annotations

import inspect
import warnings

import torch
from diffusers import ZImagePipeline
from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift, get_default_z_image_sigmas

from ddpo_group.models.families import register_family
from ddpo_group.models.families.flow_matching import FlowMatchingFamily

# the pipeline's own token count when pretrained.max_sequence_length is 0
PIPELINE_MAX_SEQUENCE_LENGTH = inspect.signature(ZImagePipeline.encode_prompt).parameters["max_sequence_length"].default
# the pipeline's own image side when given no size: a literal of its __call__ (``height = height or 1024``); the
# pipeline has no default_sample_size
PIPELINE_SIZE = 1024


@register_family("zimage", ZImagePipeline)
class ZImageFamily(FlowMatchingFamily):
    cond_keys = ("prompt_embeds", "prompt_lengths")  # embeds first: the sampler reads the batch and dtype from it
    no_guidance = 0.0  # Z-Image-Turbo samples at guidance 0: u_c + 0 (u_c - u_uncond)
    # ZImagePipeline's call keeps its latents in float32 (the transformer reads a copy in its dtype)
    latents_dtype = torch.float32
    # the attention projections and the SwiGLU feed-forward of every block (refiners included; image and text tokens
    # share them): Flow-Factory's default Z-Image LoRA targets (src/flow_factory/models/z_image/z_image.py)
    lora_target_modules = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
                           "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")

    _truncation_warned = False

    @property
    def tokens(self) -> int:
        """L: the prompt_embeds width in tokens (``pretrained.max_sequence_length``, else the pipeline's 512)."""
        return self.max_sequence_length or PIPELINE_MAX_SEQUENCE_LENGTH

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict:
        embeds = self.encode_quietly(list(prompts), do_classifier_free_guidance=False,
                                     max_sequence_length=self.tokens)[0]
        lengths = torch.tensor([len(e) for e in embeds], dtype=torch.long)
        if bool((lengths == self.tokens).any()) and not self._truncation_warned:
            self._truncation_warned = True
            prompt = prompts[int((lengths == self.tokens).nonzero()[0])]
            warnings.warn(f"prompt {prompt!r} (and any other that long) fills all {self.tokens} tokens "
                          "(pretrained.max_sequence_length) with its chat template: it is truncated, as the pipeline "
                          "truncates it; this warning is shown once", UserWarning, stacklevel=2)
        padded = embeds[0].new_zeros(len(embeds), self.tokens, embeds[0].shape[-1])
        for i, e in enumerate(embeds):
            padded[i, : len(e)] = e
        return {"prompt_embeds": padded.to(self.device), "prompt_lengths": lengths.to(self.device)}

    @staticmethod
    def embeds_list(cond: dict, n: int) -> list[torch.Tensor]:
        """The pipeline's list of [l_i, D] (a one-row condition, the negative one, repeated n times)."""
        embeds, lengths = cond["prompt_embeds"], cond["prompt_lengths"].tolist()
        if len(lengths) == 1 and n > 1:
            return [embeds[0, : lengths[0]]] * n
        return [e[:length] for e, length in zip(embeds, lengths)]

    def default_size(self) -> tuple[int, int]:
        """The pipeline's call default, 1024 x 1024 px (``PIPELINE_SIZE``)."""
        return PIPELINE_SIZE, PIPELINE_SIZE

    def position_limit(self) -> tuple[int, str]:
        """The transformer's RoPE tables of the image's rows and columns (``axes_lens``' last two, in patches)."""
        lens = list(self.pipe.transformer.config.axes_lens)
        return min(lens[1:]), f"{type(self.pipe.transformer).__name__}'s axes_lens={lens}"

    def latent_shape(self) -> tuple:
        size = 2 * (self.resolution // (self.pipe.vae_scale_factor * 2))
        return self.pipe.transformer.config.in_channels, size, size

    def draw_noise(self, batch, generator, device, dtype):
        latents = self.pipe.prepare_latents(batch, self.pipe.transformer.config.in_channels, self.resolution,
                                            self.resolution, torch.float32, device, generator)
        return latents.to(dtype)

    def schedule_kwargs(self, num_steps: int) -> dict:
        """The pipeline's ``retrieve_timesteps`` keywords: its default sigmas and mu from the image token count (the
        scheduler reads mu only when it shifts dynamically)."""
        config = self.pipe.scheduler.config
        tokens = (self.latent_shape()[1] // 2) ** 2
        mu = calculate_shift(tokens, config.base_image_seq_len, config.max_image_seq_len, config.base_shift,
                             config.max_shift)
        return {"sigmas": get_default_z_image_sigmas(num_steps), "mu": mu}

    def schedule(self, num_steps: int, device) -> dict:
        scheduler = self.pipe.scheduler
        scheduler.set_timesteps(device=device, **self.schedule_kwargs(num_steps))
        sigmas = scheduler.sigmas.to(device)
        return {"timesteps": scheduler.timesteps, "sigmas": sigmas[:-1], "next_sigmas": sigmas[1:]}

    # ------------------------------------------------------------------ guidance (the pipeline's convention)
    @property
    def cfg_normalization(self) -> float:
        return float(self.config.sample.cfg_normalization)

    @property
    def cfg_truncation(self) -> float:
        return float(self.config.sample.cfg_truncation)

    def model_output(self, model, latents, times, cond, negative, guidance_scale):
        n = latents.shape[0]
        t = torch.as_tensor(times["timesteps"], device=latents.device)
        t = t.expand(n) if t.ndim == 0 else t
        timestep = (1000 - t) / 1000
        embeds = self.embeds_list(cond, n)
        # per row: the guidance scale of its step (cfg_truncation turns it off late in sampling)
        scales = torch.full((n,), float(guidance_scale), device=latents.device)
        if self.cfg_truncation <= 1:
            # compared in float64, as the pipeline compares its Python floats
            late = ((1000 - t.float()) / 1000).double() > self.cfg_truncation
            scales = torch.where(late, 0.0, scales)
        x = list(latents.to(self.pipe.transformer.dtype).unsqueeze(2).unbind(0))  # the pipeline's cast copy
        if negative is None or not bool((scales > 0).any()):
            out = model(x, timestep, embeds, return_dict=False)[0]
            return -torch.stack([o.float() for o in out]).squeeze(2)
        out = model(x + x, timestep.repeat(2), embeds + self.embeds_list(negative, n), return_dict=False)[0]
        positive, unconditional = torch.stack(out[:n]).float(), torch.stack(out[n:]).float()
        w = scales.view(n, *[1] * (positive.ndim - 1))
        guided = positive + w * (positive - unconditional)
        if self.cfg_normalization > 0:  # per sample, as the pipeline does
            rows = []
            for pos, pred in zip(positive, guided):
                limit = torch.linalg.vector_norm(pos) * self.cfg_normalization
                norm = torch.linalg.vector_norm(pred)
                rows.append(pred * (limit / norm) if norm > limit else pred)
            guided = torch.stack(rows)
        return -guided.squeeze(2)

    @torch.no_grad()
    def clean_latents(self, images):
        config = self.pipe.vae.config
        return (self.vae_latents(images) - config.shift_factor) * config.scaling_factor

    @torch.no_grad()
    def decode(self, latents):
        vae = self.pipe.vae
        latents = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(latents, return_dict=False)[0]
        return self.pipe.image_processor.postprocess(image, output_type="pt").float()

    # ------------------------------------------------------------------ config
    @classmethod
    def config_errors(cls, config) -> list[str]:
        sample, errors = config.sample, super().config_errors(config)
        if sample.guidance_scale < 0:
            errors.append(f"sample.guidance_scale={sample.guidance_scale} must be >= 0 (Z-Image: 0 is no guidance)")
        errors += cls.guidance_errors(config)  # guided when guidance_scale > 0: its u_c + w (u_c - u_uncond)
        if sample.cfg_normalization < 0:
            errors.append(f"sample.cfg_normalization={sample.cfg_normalization} must be >= 0 (0: off)")
        if not 0 <= sample.cfg_truncation <= 1:
            errors.append(f"sample.cfg_truncation={sample.cfg_truncation} must be in [0, 1] (1: guidance on every step)")
        return errors

    def pipeline_kwargs(self, sample_config, pretrained) -> dict:
        return {**super().pipeline_kwargs(sample_config, pretrained),
                "cfg_normalization": float(sample_config.cfg_normalization),
                "cfg_truncation": float(sample_config.cfg_truncation)}
