"""Ideogram 4 (Ideogram4Pipeline): a DiT on one packed sequence of text and 2x2-packed FLUX.2-VAE latent tokens,
text features from 13 tapped layers of a Qwen3-VL, and asymmetric CFG through a second, unconditional transformer.

    condition   prompt_embeds [B, L, 13 D] and prompt_lengths [B] (int64): the pipeline's ``encode_prompt``, the hidden
                states of its ``QWEN3_VL_ACTIVATION_LAYERS`` concatenated per token of the chat-templated prompt,
                left-padded (zeros) to L = ``pretrained.max_sequence_length`` (0: the call's 2048), in the transformer's
                dtype as the call casts them; the lengths rebuild the call's position, segment and role ids for the
                image grid at each forward (``_prepare_ids``). A prompt longer than L is refused by name (the call
                raises). At the call's 2048 tokens a row is 2048 x 13 x 4096 features (218 MB in bfloat16): set
                pretrained.max_sequence_length to your prompts' length and keep sample.text_embedding_cache small.
                The unconditional branch reads no text (zeroed features over the image tokens): there is no negative
                prompt (``sample.negative_prompt`` refused, a row's ignored with a warning); the negative condition is
                one zero row of the features' width
    latents     packed [B, (H/2f)(W/2f), 4 C]: 2x2 patches of the C-channel FLUX.2 VAE latent (f its factor, 16), x_0 =
                N(0, I) drawn in float32 and kept in float32 across steps, as the call keeps it
    schedule    the call's resolution-aware logit-normal sigmas (its mu 0 + log(H W / 512^2) / 2, std 1.5, clamped to
                log-SNR [-15, 18]) through the flow Euler scheduler, then 0
    output      the model's time runs the other way, t_model = 1 - t / 1000 (0 at noise); the transformer reads
                [zeros over the text; the latents] with the text features and gives the image tokens' velocity u_c;
                the frozen ``unconditional_transformer`` reads the latents alone with zero features, u_u; the call
                blends them with the step's weight w in float32:
                    u = w u_c + (1 - w) u_u,   v = -u   (the scheduler's velocity: the call steps with -u)
                w = ``sample.guidance_scale`` on every step, or the step's value of
                ``sample.pipeline_guidance.guidance_schedule`` (the call's keyword, e.g. its default 7 x 45 + 3 x 3 at
                48 steps), recorded per step (``guidance_weights``) for the training forward. w = 1 is u_c alone (the
                unconditional transformer is not run: its term is 0); a weight below 1 is refused
    step        flow matching (models/families/flow_matching.py, sampling/flow_steps.py). The schedule's first sigma is
                the clamp's 1 - 1.2e-4, not 1, where Flow-GRPO's flow_sde, sigma_t = a sqrt(s / (1 - s')), takes s' = s
                (its rule s' = s_next holds at s = 1 only): sigma_t is 91 a there, a std of 12 at a = 0.7 and 10 steps
                of 2048 px (0.64 on the next step). Under flow_sde the first step is therefore deterministic, never trained
                (``deterministic_steps``, as cps's last); cps and dance_sde train it
    decode      z * sqrt(bn.running_var + eps) + bn.running_mean (the VAE's batch norm on packed channels), unpatched,
                the VAE, the image processor's [0, 1]

The trained module is ``transformer`` (its LoRA saved and loaded as the pipeline's ``Ideogram4LoraLoaderMixin``
does); ``unconditional_transformer`` stays frozen. The call's prompt upsampling (``prompt_upsampling``, a generative
head grafted on the text encoder) is not run: the run's prompts are the captions.
"""

from __future__ import annotations

import warnings

import torch
from diffusers import Ideogram4Pipeline
from diffusers.models.transformers.transformer_ideogram4 import LLM_TOKEN_INDICATOR
from diffusers.pipelines.ideogram4.pipeline_ideogram4 import _logit_normal_sigmas, _resolution_aware_mu

from ddpo_group.models.families import register_family
from ddpo_group.models.families.flow_matching import FlowMatchingFamily
from ddpo_group.models.families.sana import call_default
from ddpo_group.models.source_images import NEGATIVE_PROMPT_KEY


@register_family("ideogram4", Ideogram4Pipeline)
class Ideogram4Family(FlowMatchingFamily):
    cond_keys = ("prompt_embeds", "prompt_lengths")  # embeds first: the sampler reads the batch and dtype from it
    time_keys = ("timesteps", "sigmas", "next_sigmas", "guidance_weights")
    guidance_passes = ("guidance_schedule",)  # sample.pipeline_guidance: the call's per-step weights
    latents_dtype = torch.float32  # the call keeps its latents in float32 (the transformers read a cast copy)
    # the attention projections of every block
    lora_target_modules = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0")

    def __init__(self, pipe, config):
        self.patch_size = pipe.patch_size  # the pipeline's packing (2)
        super().__init__(pipe, config)
        self._negative_warned = False

    def denoisers(self) -> list[torch.nn.Module]:
        """The trained ``transformer`` and the frozen ``unconditional_transformer`` of the guidance."""
        return [self.pipe.transformer, self.pipe.unconditional_transformer]

    # ------------------------------------------------------------------ size, condition
    def default_size(self) -> tuple[int, int]:
        """The call's own 2048 x 2048."""
        return call_default(Ideogram4Pipeline, "height"), call_default(Ideogram4Pipeline, "width")

    @property
    def text_length(self) -> int:
        """L: ``pretrained.max_sequence_length``, else the call's 2048."""
        return self.max_sequence_length or call_default(Ideogram4Pipeline, "max_sequence_length")

    def token_count(self, prompt: str) -> int:
        """The tokens of ``prompt`` in the chat template, as ``encode_prompt`` counts them."""
        messages = [{"role": "user", "content": [{"type": "text", "text": prompt}]}]
        text = self.pipe.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return len(self.pipe.tokenizer(text, add_special_tokens=False)["input_ids"])

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict:
        length = self.text_length
        for prompt in prompts:
            count = self.token_count(prompt)
            if count > length:
                raise ValueError(f"prompt {prompt!r} is {count} tokens in Ideogram 4's chat template, more than "
                                 f"pretrained.max_sequence_length={length} (the pipeline keeps every token and refuses a "
                                 "longer prompt): raise it or shorten the prompt")
        rows, columns = self.grid()
        embeds, _, _, indicator = self.pipe.encode_prompt(list(prompts), rows, columns, length, self.device)
        return {"prompt_embeds": embeds[:, :length].to(self.pipe.transformer.dtype),
                "prompt_lengths": (indicator[:, :length] == LLM_TOKEN_INDICATOR).sum(dim=1)}

    def default_negative_condition(self) -> dict:
        """The unconditional transformer reads no text: one zero row of the features' width (module docstring)."""
        width = self.pipe.transformer.config.llm_features_dim
        return {"prompt_embeds": torch.zeros(1, 1, width, dtype=self.pipe.transformer.dtype, device=self.device),
                "prompt_lengths": torch.zeros(1, dtype=torch.long, device=self.device)}

    def negative_rows(self, metadata: list[dict] | None) -> None:
        """None: no row has a negative condition (a row's negative prompt is ignored, with a warning once)."""
        if any((m or {}).get(NEGATIVE_PROMPT_KEY) is not None for m in metadata or []) and not self._negative_warned:
            self._negative_warned = True
            warnings.warn("Ideogram 4 has no negative prompt (its unconditional transformer reads no text): the prompt "
                          "rows' negative_prompt is ignored; this warning is shown once", UserWarning, stacklevel=3)
        return None

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
        latents = self.pipe.prepare_latents(batch, *self.latent_shape(), torch.float32, device, generator)
        return latents.to(dtype)

    def schedule_kwargs(self, num_steps: int) -> dict:
        """The call's logit-normal sigmas at its mu and std for this size."""
        mu = _resolution_aware_mu(*self.height_width, base_mu=call_default(Ideogram4Pipeline, "mu"))
        return {"sigmas": _logit_normal_sigmas(num_steps, mu, std=call_default(Ideogram4Pipeline, "std")).tolist()}

    @property
    def guidance_schedule(self) -> list[float] | None:
        schedule = self.config.sample.pipeline_guidance.get("guidance_schedule")
        return None if schedule is None else [float(w) for w in schedule]

    def schedule(self, num_steps: int, device) -> dict:
        """flow_matching.py's schedule and each step's guidance weight (the schedule's, or sample.guidance_scale)."""
        times = super().schedule(num_steps, device)
        weights = self.guidance_schedule or [float(self.config.sample.guidance_scale)] * num_steps
        return {**times, "guidance_weights": torch.tensor(weights, dtype=torch.float32, device=device)}

    def deterministic_steps(self, sample_config) -> torch.Tensor:
        """flow_matching.py's (cps's last step) and, under flow_sde, the first (module docstring: its std there)."""
        steps = super().deterministic_steps(sample_config)
        if sample_config.sde_type == "flow_sde":
            steps[0] = True
        return steps

    # ------------------------------------------------------------------ model, decode
    def model_output(self, model, latents, times, cond, negative, guidance_scale):
        """u = w u_c + (1 - w) u_u in float32, as the call computes it; v = -u (module docstring)."""
        n, text = latents.shape[0], cond["prompt_embeds"]
        length, rows_columns = text.shape[1], self.grid()
        t = torch.as_tensor(times["timesteps"], device=latents.device)
        t = t.expand(n) if t.ndim == 0 else t
        num_train = self.pipe.scheduler.config.num_train_timesteps
        t_model = 1.0 - t.float() / num_train
        dtype = self.pipe.transformer.dtype
        positions, segments, roles = self.pipe._prepare_ids(cond["prompt_lengths"].tolist(), *rows_columns, length,
                                                            latents.device)
        state = latents.float()
        image_features = torch.zeros(n, state.shape[1], text.shape[2], dtype=dtype, device=latents.device)
        hidden = torch.cat([torch.zeros(n, length, state.shape[2], device=latents.device), state], dim=1)
        conditional = model(hidden_states=hidden.to(dtype), timestep=t_model.to(dtype),
                            encoder_hidden_states=torch.cat([text.to(dtype), image_features], dim=1),
                            position_ids=positions, segment_ids=segments, indicator=roles,
                            return_dict=False)[0][:, length:].float()
        if guidance_scale <= self.no_guidance:
            return -conditional
        weight = (torch.as_tensor(times["guidance_weights"], device=latents.device) if self.guidance_schedule
                  else torch.tensor(float(guidance_scale), device=latents.device)).float()
        weight = weight.view(-1, 1, 1) if weight.ndim else weight
        unconditional_model = self.pipe.unconditional_transformer
        other = unconditional_model.dtype
        unconditional = unconditional_model(
            hidden_states=state.to(other), timestep=t_model.to(other), encoder_hidden_states=image_features.to(other),
            position_ids=positions[:, length:], segment_ids=segments[:, length:], indicator=roles[:, length:],
            return_dict=False)[0].float()
        return -(weight * conditional + (1.0 - weight) * unconditional)

    def bn_statistics(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) of the VAE's batch norm over the packed channels, [1, 1, 4 C] in ``latents``' dtype."""
        bn, eps = self.pipe.vae.bn, self.pipe.vae.config.batch_norm_eps
        mean = bn.running_mean.view(1, 1, -1).to(latents.device, latents.dtype)
        std = torch.sqrt(bn.running_var + eps).view(1, 1, -1).to(latents.device, latents.dtype)
        return mean, std

    @torch.no_grad()
    def decode(self, latents):
        """The call's decode: the batch norm undone, 2 x 2 patches unpacked, the VAE, [0, 1]."""
        mean, std = self.bn_statistics(latents)
        z = latents * std + mean
        (rows, columns), patch = self.grid(), self.pipe.patch_size
        channels = z.shape[-1] // (patch * patch)
        z = z.view(z.shape[0], rows, columns, patch, patch, channels).permute(0, 5, 1, 3, 2, 4).contiguous()
        z = z.view(z.shape[0], channels, rows * patch, columns * patch)
        image = self.pipe.vae.decode(z.to(self.pipe.vae.dtype), return_dict=False)[0]
        return self.pipe.image_processor.postprocess(image.float(), output_type="pt").float()

    @torch.no_grad()
    def clean_latents(self, images):
        """``decode``'s inverse on the VAE encoder's mean: packed 2 x 2 and normalised by the batch norm."""
        z = self.vae_latents(images)
        (rows, columns), patch = self.grid(), self.pipe.patch_size
        batch, channels = z.shape[:2]
        z = z.view(batch, channels, rows, patch, columns, patch).permute(0, 2, 4, 3, 5, 1)
        z = z.reshape(batch, rows * columns, patch * patch * channels)
        mean, std = self.bn_statistics(z)
        return (z - mean) / std

    # ------------------------------------------------------------------ config
    @classmethod
    def config_errors(cls, config) -> list[str]:
        sample, errors = config.sample, super().config_errors(config) + cls.guidance_errors(config)
        if sample.guidance_scale < 1:
            errors.append(f"sample.guidance_scale={sample.guidance_scale} must be >= 1 (1: the conditional "
                          "transformer alone; a weight below 1 blends toward the unconditional transformer, which the "
                          "family does not sample)")
        if sample.negative_prompt:
            errors.append(f"sample.negative_prompt={sample.negative_prompt!r}: Ideogram 4 has no negative prompt (its "
                          "unconditional transformer reads no text); leave it ''")
        schedule = sample.pipeline_guidance.get("guidance_schedule")
        if schedule is not None:
            if len(schedule) != sample.num_steps or (schedule and min(schedule) < 1):
                errors.append(f"sample.pipeline_guidance.guidance_schedule has {len(schedule)} weights, min "
                              f"{min(schedule, default=None)}: it needs one weight >= 1 a step (sample.num_steps="
                              f"{sample.num_steps}; the call's default is 7.0 x 45 + 3.0 x 3 for its 48 steps)")
            if sample.eval_num_steps and sample.eval_num_steps != sample.num_steps:
                errors.append(f"sample.eval_num_steps={sample.eval_num_steps}: a guidance_schedule has a weight a "
                              f"step of sample.num_steps={sample.num_steps}; evaluate at those steps (eval_num_steps 0)")
            if sample.guidance_scale <= cls.no_guidance:
                errors.append(f"sample.pipeline_guidance.guidance_schedule guides every step with its weights, and "
                              f"sample.guidance_scale={sample.guidance_scale} says the run does not guide: set "
                              "sample.guidance_scale > 1 (and train.cfg=True) with a schedule")
        return errors

    def guidance_kwargs(self, guidance_scale: float) -> dict:
        """The call takes one of ``guidance_scale`` and ``guidance_schedule``: the run's schedule when set, else the
        constant scale (the call computes 1 u_c + 0 u_u at 1, which is u_c)."""
        schedule = self.guidance_schedule if guidance_scale > self.no_guidance else None
        if schedule is not None:
            return {"guidance_scale": None, "guidance_schedule": schedule}
        return {"guidance_scale": max(float(guidance_scale), 1.0), "guidance_schedule": None}

    def pipeline_kwargs(self, sample_config, pretrained) -> dict:
        """The size and the token count (the call's 2048 when unset)."""
        return {**self.size_kwargs(), "max_sequence_length": self.text_length}
