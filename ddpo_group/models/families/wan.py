"""Wan2.1 / Wan2.2 text-to-video: a 3D DiT predicting the flow velocity of a video latent, a UMT5 text encoder.

    condition   prompt_embeds [B, L, D]: UMT5 last hidden states of the prompt's tokens, zeros after its length (the
                pipeline's own ``encode_prompt``, L = ``pretrained.max_sequence_length`` or the pipeline's call default
                512, not ``encode_prompt``'s 226); the unconditional condition is base.py's negative prompt: a row's
                own, else ``sample.negative_prompt`` ("" by default, the pipeline's default)
    latents     [B, C, F', H/s, W/s] with a time axis: F' = (F - 1) / 4 + 1 latent frames of F = ``sample.num_frames``
                video frames (the VAE's temporal factor 4), s the VAE's spatial factor (8; 16 on Wan2.2-TI2V-5B);
                x_0 = N(0, I) (``prepare_latents``: the pipeline's draw, float32)
    schedule    FlowMatchEulerDiscreteScheduler with the model's flow shift: T sigmas evenly from 1 down to the
                shifted 1/1000, each shifted, s' = shift s / (1 + (shift - 1) s), then 0; timesteps 1000 s'. The
                released models ship a UniPC multistep scheduler (flow_shift 3.0 for 480p): ``load_pipeline`` replaces
                it by the flow Euler one with the same shift and says so in a warning (flow_matching.py's
                ``flow_euler_scheduler``: a scheduler without a shift is refused; Flow-Factory's Wan recipes sample
                their flow SDE with ``flow_shift: 3.0``), so the pipeline's own ``__call__`` (evaluation) and our
                sampler at noise level 0 take the same Euler steps, bitwise
    output      v = transformer(x, t, prompt_embeds) (t per sample; per latent token on Wan2.2-TI2V-5B,
                ``expand_timesteps``); classifier-free guidance as the pipeline does it, two forwards (conditional,
                then unconditional): v = v_uncond + w (v_cond - v_uncond)                    (w <= 1: no guidance)
    step        flow matching (models/families/flow_matching.py, sampling/flow_steps.py)
    decode      z / (1 / latents_std) + latents_mean (per channel, the VAE's config), AutoencoderKLWan.decode, then
                frames [B, F, 3, H, W] in [0, 1] (the video processor's): rewards score them (rewards/base.py)

Wan2.2-T2V-A14B has two experts: ``transformer`` takes the high-noise steps (t >= boundary_ratio * 1000) and
``transformer_2`` the low-noise ones, each with the same guidance (the pipeline's ``guidance_scale_2`` default). The
trained model (and its LoRA, loaded by ``load_lora_weights`` into ``transformer``) is the high-noise expert, which
lays out the video, as the early SDE windows of Flow-GRPO-Fast do; the low-noise expert stays frozen and its steps
are deterministic Euler steps (``deterministic_steps``), so every stochastic, trained step is the trained expert's.
A pipeline with ``transformer_2`` only is refused with what is supported.
"""

from __future__ import annotations

import inspect
from dataclasses import replace

import torch
from diffusers import WanPipeline

from ddpo_group.models.families import register_family
from ddpo_group.models.families.flow_matching import FlowMatchingFamily, flow_euler_scheduler
from ddpo_group.sampling.family import Capabilities
from ddpo_group.sampling.trajectories import rows_of

SUPPORTED = ("Wan2.1-T2V-1.3B, Wan2.1-T2V-14B, Wan2.2-TI2V-5B (one transformer) and Wan2.2-T2V-A14B (transformer "
             "trained, transformer_2 frozen)")


@register_family("wan", WanPipeline)
class WanFamily(FlowMatchingFamily):
    capabilities = Capabilities(video=True)
    cond_keys = ("prompt_embeds",)
    # self- and cross-attention projections of every block (Flow-Factory's default Wan targets: the attention)
    lora_target_modules = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                           "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0")

    def __init__(self, pipe, config):
        if pipe.transformer is None:
            raise ValueError(f"this WanPipeline has no transformer (only transformer_2); the wan family trains the "
                             f"transformer of {SUPPORTED}")
        if (pipe.transformer_2 is None) != (pipe.config.boundary_ratio is None):
            raise ValueError(f"this WanPipeline has transformer_2={type(pipe.transformer_2).__name__} and boundary_ratio="
                             f"{pipe.config.boundary_ratio}: two experts need both (Wan2.2-T2V-A14B); supported: "
                             f"{SUPPORTED}")
        super().__init__(pipe, config)
        # Wan2.2-A14B: its low-noise steps run the frozen transformer_2, a second transformer
        self.capabilities = replace(type(self).capabilities, second_transformer=self.boundary is not None)


    @property
    def boundary(self) -> float | None:
        """The timestep from which down the low-noise expert ``transformer_2`` denoises (None: one transformer)."""
        ratio = self.pipe.config.boundary_ratio
        return None if ratio is None else ratio * self.pipe.scheduler.config.num_train_timesteps

    @classmethod
    def load_pipeline(cls, path, local, revision, dtype_kwargs):
        pipe = super().load_pipeline(path, local, revision, dtype_kwargs)
        pipe.scheduler = flow_euler_scheduler(pipe.scheduler, "wan")
        return pipe

    # ------------------------------------------------------------------ sizes
    def call_default(self, name: str) -> int:
        """A keyword's default in the pipeline's own ``__call__`` (height 480, width 832, num_frames 81,
        max_sequence_length 512)."""
        return inspect.signature(type(self.pipe).__call__).parameters[name].default

    @property
    def frames(self) -> int:
        """Video frames: ``sample.num_frames``, or the pipeline's default (81)."""
        return int(self.config.sample.num_frames) or self.call_default("num_frames")

    def default_size(self) -> tuple[int, int]:
        """The pipeline's call defaults, 480 x 832 (the pipeline has no default_sample_size)."""
        return self.call_default("height"), self.call_default("width")

    def size_multiple(self) -> int:
        """The VAE's spatial factor times the transformer's patch (the pipeline rounds other sizes down)."""
        return self.pipe.vae_scale_factor_spatial * self.pipe.transformer.config.patch_size[1]

    def position_limit(self) -> tuple[int, str]:
        """The transformer's RoPE table: ``rope_max_seq_len`` positions on each axis (frames, rows, columns)."""
        size = self.pipe.transformer.config.rope_max_seq_len
        return size, f"{type(self.pipe.transformer).__name__}'s rope_max_seq_len={size}"

    def size_errors(self) -> list[str]:
        """base.py's rule on the height and width, and the frames: 1 more than a multiple of the VAE's temporal
        factor, their latent frames within the position table."""
        errors = super().size_errors()
        pipe, chosen = self.pipe, int(self.config.sample.num_frames)
        field = (f"sample.num_frames={chosen}" if chosen else
                 f"sample.num_frames=0 (the pipeline's default, {self.frames})")
        temporal = pipe.vae_scale_factor_temporal
        if (self.frames - 1) % temporal:
            return errors + [f"{field} must be 1 more than a multiple of {temporal} (the VAE's temporal factor)"]
        per_patch = pipe.transformer.config.patch_size[0]
        patches = ((self.frames - 1) // temporal + 1) // per_patch
        limit, what = self.position_limit()
        if patches > limit:
            errors.append(f"{field} is {patches} latent frames, beyond this model's position table ({what}): set "
                          f"sample.num_frames to at most {(limit * per_patch - 1) * temporal + 1}")
        return errors

    @property
    def latent_channels(self) -> int:
        """The latent's channels: the transformer's input channels (the pipeline's ``num_channels_latents``)."""
        return self.pipe.transformer.config.in_channels

    def latent_shape(self) -> tuple:
        return self.video_latent_shape()

    def draw_noise(self, batch, generator, device, dtype):
        return self.video_noise(batch, generator, device, dtype)

    # ------------------------------------------------------------------ condition, model, decode
    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict:
        tokens = self.max_sequence_length or self.call_default("max_sequence_length")  # __call__'s, not encode_prompt's
        embeds, _ = self.encode_quietly(prompts, do_classifier_free_guidance=False, max_sequence_length=tokens)
        return {"prompt_embeds": embeds.to(self.device)}

    def timestep(self, t: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """The transformer's timestep input: t per sample [B], or per latent token [B, F' h w / 4] with
        ``expand_timesteps`` (Wan2.2-TI2V-5B; text-to-video: every token at t)."""
        n = latents.shape[0]
        t = t.expand(n) if t.ndim == 0 else t
        if not self.pipe.config.expand_timesteps:
            return t
        p = self.pipe.transformer.config.patch_size
        tokens = latents.shape[2] // p[0] * (latents.shape[3] // p[1]) * (latents.shape[4] // p[2])
        return t[:, None].expand(n, tokens)

    def model_output(self, model, latents, times, cond, negative, guidance_scale):
        t = torch.as_tensor(times["timesteps"], device=latents.device)
        if self.boundary is not None:  # two experts: the low-noise steps' rows go to the frozen transformer_2
            low = t.expand(latents.shape[0]) < self.boundary
            if bool(low.all()):
                model = self.pipe.transformer_2
            elif bool(low.any()):
                out = torch.empty_like(latents, dtype=torch.float32)
                for rows, expert in ((low, self.pipe.transformer_2), (~low, model)):
                    rows_negative = negative  # the run's one row, or one per row (per-row negative prompts)
                    if negative is not None and len(next(iter(negative.values()))) == len(low) > 1:
                        rows_negative = rows_of(negative, rows)
                    out[rows] = self.guided(expert, latents[rows], t.expand(len(low))[rows], rows_of(cond, rows),
                                            rows_negative, guidance_scale).float()
                return out
        return self.guided(model, latents, t, cond, negative, guidance_scale)

    def guided(self, model, latents, t, cond, negative, guidance_scale):
        """One expert's velocity with guidance, as the pipeline computes it."""
        n = latents.shape[0]
        t = self.timestep(t, latents)
        inputs = self.transformer_inputs(latents, cond)
        conditional = model(**inputs, timestep=t, encoder_hidden_states=cond["prompt_embeds"], return_dict=False)[0]
        if guidance_scale > 1.0 and negative is not None:
            uncond = model(**inputs, timestep=t, encoder_hidden_states=negative["prompt_embeds"].expand(n, -1, -1),
                           return_dict=False)[0]
            return uncond + guidance_scale * (conditional - uncond)
        return conditional

    def transformer_inputs(self, latents, cond) -> dict:
        """The transformer's inputs besides the timestep and the text, the same in both guidance branches: the latents
        in its dtype (image-to-video adds the image's)."""
        return {"hidden_states": latents.to(self.pipe.transformer.dtype)}

    @torch.no_grad()
    def decode(self, latents):
        """Final latents -> frames [B, F, 3, H, W] in [0, 1] (float32), exactly as the pipeline decodes."""
        vae = self.pipe.vae
        latents = latents.to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(
            latents.device, latents.dtype)
        video = vae.decode(latents / inverse_std + mean, return_dict=False)[0]
        return self.pipe.video_processor.postprocess_video(video, output_type="pt").float()

    # ------------------------------------------------------------------ which steps are trained
    def deterministic_steps(self, sample_config) -> torch.Tensor:
        """The flow families' (cps's last step), and with two experts the low-noise expert's steps (t < boundary)."""
        steps = super().deterministic_steps(sample_config)
        if self.boundary is not None:
            steps |= self.schedule(sample_config.num_steps, "cpu")["timesteps"].cpu() < self.boundary
        return steps

    def check_trainable(self, sample_config) -> None:
        if self.boundary is not None and not self.stochastic_steps(sample_config).any():
            high = int((self.schedule(sample_config.num_steps, "cpu")["timesteps"] >= self.boundary).sum())
            raise ValueError(
                f"no stochastic step is the trained (high-noise) expert's: of sample.num_steps={sample_config.num_steps} "
                f"steps, the first {high} have t >= {self.boundary:g} (boundary_ratio "
                f"{self.pipe.config.boundary_ratio}); put the SDE window (sample.sde_window_start="
                f"{sample_config.sde_window_start}, sde_window_size={sample_config.sde_window_size}) on them")
        super().check_trainable(sample_config)

    # ------------------------------------------------------------------ config
    @classmethod
    def config_errors(cls, config) -> list[str]:
        sample, errors = config.sample, super().config_errors(config)
        if sample.num_frames < 0 or (sample.num_frames and (sample.num_frames - 1) % 4):
            errors.append(f"sample.num_frames={sample.num_frames} must be 4 k + 1 frames (Wan's VAE compresses time by 4), "
                          "e.g. 5, 33, 81; 0: the pipeline's 81")
        return errors + cls.guidance_errors(config)

    def pipeline_kwargs(self, sample_config, pretrained) -> dict:
        """The size and tokens (flow_matching.py's), the frame count and the negative prompt."""
        kwargs = {**super().pipeline_kwargs(sample_config, pretrained), "num_frames": self.frames}
        if sample_config.negative_prompt:
            kwargs["negative_prompt"] = sample_config.negative_prompt
        return kwargs

