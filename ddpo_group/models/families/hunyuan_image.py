"""HunyuanImage 2.1 (HunyuanImagePipeline): a dual- and single-stream DiT on the 64-channel latent of a 32x VAE, a
Qwen2.5-VL text encoder and a ByT5 glyph encoder, guided by its guider components (CFG, then adaptive projected
guidance with momentum).

    condition   the pipeline's ``encode_prompt``: prompt_embeds [B, 1000, D] and prompt_embeds_mask (Qwen2.5-VL's
                hidden states two layers below the last of the prompt in its template, the template's first 34 tokens
                dropped, padded to the pipeline's 1000); prompt_embeds_2 [B, 128, D2] and prompt_embeds_mask_2 (ByT5's
                of the prompt's quoted text, ``Text "..."``; zeros without one); embeddings in the transformer's dtype
                as the call casts them. The unconditional condition is base.py's negative prompt ("" by default, the
                call's: it encodes no negative prompt as "")
    latents     [B, C, H/32, W/32], x_0 = N(0, I) drawn as ``prepare_latents`` in the transformer's dtype
    schedule    the call's: sigmas linspace(1, 0, T + 1)[:-1] through the checkpoint's flow Euler scheduler (its shift);
                each step's index and count recorded with its times (the guiders read them)
    output      v_c = transformer(x, t, both conditions); the guidance of the pipeline's guider components,
                AdaptiveProjectedMixGuidance, each step as the call runs it (diffusers' guider itself, at the step): no
                guidance outside its [start, stop) steps; CFG v_n + w (v_c - v_n) to its
                ``adaptive_projected_guidance_start_step`` (5); after it adaptive projected guidance (APG): the
                difference v_c - v_n added to a momentum buffer M_n = (v_c - v_n) + m M_{n-1} (m -0.5, kept through the
                CFG steps too), its norm capped (``adaptive_projected_guidance_rescale``), its component orthogonal to
                v_c (plus eta times the parallel one) scaled by the APG scale, added to v_n; the rescale toward v_c's
                std when ``guidance_rescale`` > 0. The momentum buffer is carried from each step into the next
                (``carried_keys``): the sampler records the buffer each step starts from, so the training forward
                adds its own v_c - v_n at the step to the recorded M_{n-1}, the sampler's trajectory scored as it
                was drawn (a matching objective, which trains at times off the rollout's steps, is refused when its
                training forward guides: it trains with train.cfg=False and guidance 1). A row
                whose prompt has quoted text is guided by the ``ocr_guider`` when the checkpoint has one (the call
                chooses it for a whole batch when any of its prompts has quoted text: the same for a batch of
                prompts that all have or all lack it; evaluation calls it one prompt at a time when the checkpoint has
                an OCR guider). The call takes no guidance scale: w = ``sample.guidance_scale``
                is given to both guiders (their CFG scale; their APG settings the checkpoint's), in the family's
                pipeline for evaluation too (``prepare_pipeline``); w = 1 is no guidance
    step        flow matching (models/families/flow_matching.py, sampling/flow_steps.py)
    decode      latents / scaling_factor, the VAE, the image processor's [0, 1]

The distilled checkpoint (HunyuanImage-2.1-Distilled: its guidance fed to the transformer, meanflow's second
timestep, 8 steps) and the refiner (HunyuanImageRefinerPipeline) are refused by name.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import HunyuanImagePipeline
from diffusers.guiders import AdaptiveProjectedMixGuidance
from diffusers.guiders.adaptive_projected_guidance_mix import MomentumBuffer

from ddpo_group.models.families import register_family
from ddpo_group.models.families.flow_matching import FlowMatchingFamily

MOMENTUM = "guidance_momentum"  # the carried key: APG's momentum buffer a step starts from


@register_family("hunyuan_image", HunyuanImagePipeline)
class HunyuanImageFamily(FlowMatchingFamily):
    cond_keys = ("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2")
    time_keys = ("timesteps", "sigmas", "next_sigmas", "step_index", "num_steps")
    carried_keys = (MOMENTUM,)
    patch_size = 1  # set from the transformer in __init__
    # the attention projections of the dual-stream blocks (image and text) and of the single-stream blocks
    lora_target_modules = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
                           "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")

    def __init__(self, pipe, config):
        transformer = pipe.transformer.config
        if transformer.guidance_embeds or transformer.use_meanflow:
            raise ValueError("this HunyuanImage transformer has guidance_embeds="
                             f"{transformer.guidance_embeds}, use_meanflow={transformer.use_meanflow} (the distilled "
                             "checkpoint, HunyuanImage-2.1-Distilled: its guidance fed to the model and meanflow's "
                             "second timestep); the hunyuan_image family trains HunyuanImage-2.1, guided by its guiders")
        for name in ("guider", "ocr_guider"):
            guider = getattr(pipe, name)
            if guider is not None and type(guider) is not AdaptiveProjectedMixGuidance:
                raise ValueError(f"this HunyuanImage pipeline's {name} is a {type(guider).__name__}; the family runs "
                                 "AdaptiveProjectedMixGuidance, the released checkpoints' guider")
        if pipe.guider is None:
            raise ValueError("this HunyuanImage pipeline has no guider (the distilled checkpoint's layout); the "
                             "hunyuan_image family trains HunyuanImage-2.1, guided by its guider")
        patch = transformer.patch_size
        self.patch_size = patch[-1] if isinstance(patch, (tuple, list)) else patch
        super().__init__(pipe, config)
        self.prepare_pipeline(pipe)

    def prepare_pipeline(self, pipe) -> None:
        """The pipeline's guiders at the run's scale (their other settings the checkpoint's): the call guides as the
        sampler."""
        guided_at(pipe, float(self.config.sample.guidance_scale))

    # ------------------------------------------------------------------ condition
    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict:
        embeds, mask, glyphs, glyph_mask = self.pipe.encode_prompt(prompt=list(prompts), device=self.text_encoder_device(),
                                                                   batch_size=len(prompts))
        dtype = self.pipe.transformer.dtype
        return {"prompt_embeds": embeds.to(self.device, dtype), "prompt_embeds_mask": mask.to(self.device),
                "prompt_embeds_2": glyphs.to(self.device, dtype), "prompt_embeds_mask_2": glyph_mask.to(self.device)}

    # ------------------------------------------------------------------ latents, schedule
    @property
    def latent_channels(self) -> int:
        return self.pipe.transformer.config.in_channels

    def latent_shape(self) -> tuple:
        height, width = self.height_width
        factor = self.pipe.vae_scale_factor
        return self.latent_channels, height // factor, width // factor

    def draw_noise(self, batch, generator, device, dtype):
        return self.pipe.prepare_latents(batch, self.latent_channels, *self.height_width, dtype, device, generator)

    def schedule_kwargs(self, num_steps: int) -> dict:
        return {"sigmas": np.linspace(1.0, 0.0, num_steps + 1)[:-1]}

    def schedule(self, num_steps: int, device) -> dict:
        """flow_matching.py's, and each step's index and the step count (what the guiders read)."""
        times = super().schedule(num_steps, device)
        return {**times, "step_index": torch.arange(num_steps, device=device, dtype=torch.float32),
                "num_steps": torch.full((num_steps,), float(num_steps), device=device)}

    # ------------------------------------------------------------------ model, guidance
    def initial_carried(self, latents: torch.Tensor) -> dict:
        """The momentum buffer before the first step: none (zeros; the call's starts at 0)."""
        return {MOMENTUM: torch.zeros_like(latents)}

    def model_output(self, model, latents, times, cond, negative, guidance_scale):
        return self.model_output_carrying(model, latents, times, cond, negative, guidance_scale)[0]

    def model_output_carrying(self, model, latents, times, cond, negative, guidance_scale):
        """The guided velocity and the momentum buffer after the step (module docstring), rows grouped by their
        guider and step."""
        n = latents.shape[0]
        t = torch.as_tensor(times["timesteps"], device=latents.device)
        t = t.expand(n) if t.ndim == 0 else t
        conditional = self.transformer_output(model, latents, t, cond)
        if guidance_scale <= self.no_guidance or negative is None:  # no guidance: the buffer as it came, if any
            return conditional, {key: times[key] for key in self.carried_keys if key in times}
        momentum = times[MOMENTUM]
        steps = torch.as_tensor(times["step_index"], device=latents.device).expand(n).long()
        counts = torch.as_tensor(times["num_steps"], device=latents.device).expand(n).long()
        has_glyphs = cond["prompt_embeds_2"].flatten(1).ne(0).any(dim=1)
        out, carried = conditional.clone(), momentum.clone()
        negative = {k: v.expand(n, *v.shape[1:]) if v.shape[0] == 1 and n > 1 else v for k, v in negative.items()}
        groups = torch.stack([steps, counts, has_glyphs.long()], dim=1)
        for step, count, glyph in torch.unique(groups, dim=0).tolist():
            rows = (groups == torch.tensor([step, count, glyph], device=groups.device)).all(dim=1)
            guider = self.guider(bool(glyph), step, count)
            if guider.num_conditions == 1:  # no guidance at this step: the conditional velocity, the buffer kept
                continue
            unconditional = self.transformer_output(model, latents[rows], t[rows],
                                                    {k: v[rows] for k, v in negative.items()})
            if guider.momentum_buffer is not None:
                guider.momentum_buffer.running_average = momentum[rows] if step > 0 else 0
            out[rows] = guider.forward(conditional[rows], unconditional).pred
            if guider.momentum_buffer is not None:
                carried[rows] = guider.momentum_buffer.running_average.to(carried.dtype)
        return out, {MOMENTUM: carried}

    def guider(self, glyphs: bool, step: int, num_steps: int) -> AdaptiveProjectedMixGuidance:
        """The pipeline's guider of a row (the OCR guider for a prompt with quoted text, when there is one) as the
        call sets it at ``step`` of ``num_steps``, with a fresh momentum buffer (the caller gives it the row's)."""
        pipe = self.pipe
        guider = pipe.ocr_guider if glyphs and pipe.ocr_guider is not None else pipe.guider
        guider = guider.new()  # a copy: its per-step state is the step's alone
        guider.set_state(step=step, num_inference_steps=num_steps, timestep=None)
        if guider.adaptive_projected_guidance_momentum is not None:
            guider.momentum_buffer = MomentumBuffer(guider.adaptive_projected_guidance_momentum)
        return guider

    def transformer_output(self, model, latents, t, cond: dict) -> torch.Tensor:
        return model(hidden_states=latents, timestep=t.to(latents.dtype), timestep_r=None, guidance=None,
                     encoder_hidden_states=cond["prompt_embeds"], encoder_attention_mask=cond["prompt_embeds_mask"],
                     encoder_hidden_states_2=cond["prompt_embeds_2"],
                     encoder_attention_mask_2=cond["prompt_embeds_mask_2"], return_dict=False)[0]

    # ------------------------------------------------------------------ decode
    @torch.no_grad()
    def decode(self, latents):
        vae = self.pipe.vae
        image = vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]
        return self.pipe.image_processor.postprocess(image, output_type="pt").float()

    @torch.no_grad()
    def clean_latents(self, images):
        return self.vae_latents(images) * self.pipe.vae.config.scaling_factor

    # ------------------------------------------------------------------ config
    @property
    def pipeline_max_batch(self) -> int:
        """One prompt a call with an OCR guider (the call guides a whole batch with it when any prompt has quoted text,
        the sampler each row by its own prompt), else any."""
        return 1 if self.pipe.ocr_guider is not None else 0

    @classmethod
    def config_errors(cls, config) -> list[str]:
        errors = super().config_errors(config) + cls.guidance_errors(config)
        if config.sample.guidance_scale < 1:
            errors.append(f"sample.guidance_scale={config.sample.guidance_scale} must be >= 1 (1: no guidance; the "
                          "guiders guide at any other scale, the family above 1)")
        return errors

    def guidance_kwargs(self, guidance_scale: float) -> dict:
        """None: the pipeline's guiders hold the scale, set to ``guidance_scale`` here (the run's when the family is
        built, evaluate.py's ``--guidance_scale`` when it gives one)."""
        guided_at(self.pipe, float(guidance_scale))
        return {}

    def pipeline_kwargs(self, sample_config, pretrained) -> dict:
        return self.size_kwargs()


def guided_at(pipe, scale: float) -> None:
    """The pipeline's guiders (its OCR guider too, when it has one) at ``scale``, their other settings the
    checkpoint's."""
    for name in ("guider", "ocr_guider"):
        if getattr(pipe, name) is not None:
            setattr(pipe, name, getattr(pipe, name).new(guidance_scale=scale))
