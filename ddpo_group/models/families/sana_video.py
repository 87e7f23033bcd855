"""SANA-Video (SanaVideoPipeline: SANA-Video 2B at 480p and 720p): SANA's linear-attention DiT over a video latent
(3D patches, Wan's rotary positions), a Gemma-2 text encoder; the 480p model decodes with Wan2.1's VAE, the 720p one
with LTX-2's.

    condition   as sana.py's: Gemma-2's last hidden states after the call's complex human instruction (SANA-Video's
                own, a video one), the first token and the last L - 1 (L = ``pretrained.max_sequence_length``, 0: the
                call's 300), with the mask; the negative prompt ("" by default, the call's) without the instruction
    latents     [B, C, F', H/s, W/s]: F' = (F - 1) / t + 1 latent frames of F = ``sample.num_frames`` (0: the call's 81)
                with the VAE's temporal factor t (Wan's 4, LTX-2's 8) and spatial factor s (8, 32); x_0 = N(0, I)
                drawn in float32, and the state kept in float32 across steps, as the pipeline's call keeps it
    schedule    the released checkpoints ship DPMSolverMultistepScheduler (DPM-Solver++, flow prediction, a flow shift):
                a multistep solver, no one-step policy; ``load_pipeline`` swaps it for the flow Euler scheduler of the
                checkpoint's own ``flow_shift`` with a warning, as sana.py does (flow_matching.py's
                ``flow_euler_scheduler``; a scheduler without a shift is refused), so the pipeline's own ``__call__``
                and our sampler at noise level 0 take the same Euler steps, bitwise; the pipeline as released samples
                DPM-Solver++'s trajectory (docs/model_families.md states the difference)
    output      v = transformer(x, t, prompt_embeds, mask) (t as the scheduler's timestep, no scale), CFG as one
                forward of [negative; conditional], v = v_n + w (v_c - v_n) (w <= 1: no guidance; the call's 6)
    size        the pipeline maps the size it is asked for to its aspect-ratio table (sample_size 30: 480p, 22: 720p)
                and resizes the decoded frames back: the family samples the size it asks for and passes
                ``use_resolution_binning=False``; ``sample.resolution=0`` is what the call samples given no size, its
                480 x 832 mapped by that table (480 x 832 at 480p, 704 x 1280 at 720p); a multiple of 32 px (the
                pipeline's rule) and of the VAE's factor times the patch, within the transformer's rotary table
                (``rope_max_seq_len`` patches a side)
    step        flow matching (models/families/flow_matching.py, sampling/flow_steps.py)
    decode      z * latents_std + latents_mean (Wan's VAE config, LTX-2's VAE buffers), the VAE, frames [B, F, 3, H, W]
                in [0, 1] (the video processor's), exactly as the pipeline decodes

LongLive's causal transformer (SanaVideoCausalTransformer3DModel, generating in chunks with a KV cache) and a
guidance-distilled transformer (``guidance_embeds``) are refused by name; image-to-video (SanaImageToVideoPipeline) is
not this family's. Supervised fine-tuning on a folder of images takes image families only.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLLTX2Video, AutoencoderKLWan, SanaVideoPipeline, SanaVideoTransformer3DModel
from diffusers.pipelines.sana_video import pipeline_sana_video

from ddpo_group.models.families import register_family
from ddpo_group.models.families.base import ModelFamily
from ddpo_group.models.families.sana import SanaFamily, call_default
from ddpo_group.sampling.family import Capabilities


@register_family("sana_video", SanaVideoPipeline)
class SanaVideoFamily(SanaFamily):
    capabilities = Capabilities(video=True)
    # the pipeline's aspect-ratio tables by the transformer's sample_size (SanaVideoPipeline.__call__'s choice)
    resolution_bins = {30: pipeline_sana_video.ASPECT_RATIO_480_BIN, 22: pipeline_sana_video.ASPECT_RATIO_720_BIN}
    clean_latents = ModelFamily.clean_latents  # a video family: no supervised epochs on a folder of images

    def __init__(self, pipe, config):
        if type(pipe.transformer) is not SanaVideoTransformer3DModel:
            raise ValueError(f"this SanaVideoPipeline's transformer is a {type(pipe.transformer).__name__} (LongLive's "
                             "causal transformer generates in chunks with a KV cache); the sana_video family trains "
                             "SanaVideoTransformer3DModel (SANA-Video 2B 480p, 720p)")
        if not isinstance(pipe.vae, (AutoencoderKLWan, AutoencoderKLLTX2Video)):
            raise ValueError(f"this SanaVideoPipeline's VAE is a {type(pipe.vae).__name__}; the sana_video family "
                             "decodes as the pipeline does with AutoencoderKLWan (480p) or AutoencoderKLLTX2Video (720p)")
        super().__init__(pipe, config)

    # ------------------------------------------------------------------ size, frames
    @property
    def frames(self) -> int:
        """Video frames: ``sample.num_frames``, or the call's 81."""
        return int(self.config.sample.num_frames) or call_default(SanaVideoPipeline, "frames")

    def size_errors(self) -> list[str]:
        """base.py's rule on the height and width (the rotary table: ``position_limit``), the pipeline's own
        (``check_inputs``: multiples of 32 px), and the frames: 1 more than a multiple of the VAE's temporal factor,
        their latent frames within the rotary table."""
        errors = super().size_errors()
        if not errors and any(side % 32 for side in self.height_width):
            errors.append(f"sample.resolution={self.config.sample.resolution} is not a multiple of 32 px (the "
                          "pipeline's check_inputs): set sample.resolution to a multiple of 32")
        pipe, temporal = self.pipe, self.pipe.vae_scale_factor_temporal
        errors += self.frame_errors(temporal, f"the VAE's temporal factor, {type(pipe.vae).__name__}'s")
        limit, what = self.position_limit()
        patches = ((self.frames - 1) // temporal + 1) // pipe.transformer.config.patch_size[0]
        if not errors and patches > limit:
            errors.append(f"sample.num_frames={self.frames} is {patches} latent frames, beyond this model's position "
                          f"table ({what}): set sample.num_frames to at most {(limit - 1) * temporal + 1}")
        return errors

    def position_limit(self) -> tuple[int, str]:
        """The transformer's rotary table: ``rope_max_seq_len`` positions on each axis (frames, rows, columns)."""
        size = self.pipe.transformer.config.rope_max_seq_len
        return size, f"{type(self.pipe.transformer).__name__}'s rope_max_seq_len={size}"

    def latent_shape(self) -> tuple:
        return self.video_latent_shape()

    def draw_noise(self, batch, generator, device, dtype):
        return self.video_noise(batch, generator, device, dtype)

    # ------------------------------------------------------------------ model, decode
    def timestep_input(self, t: torch.Tensor) -> torch.Tensor:
        """The scheduler's timestep as it is: SanaVideoPipeline passes no scale."""
        return t

    @torch.no_grad()
    def decode(self, latents):
        """Final latents -> frames [B, F, 3, H, W] in [0, 1] (float32), the pipeline's decode: its VAE's statistics."""
        vae = self.pipe.vae
        latents = latents.to(vae.dtype)
        if isinstance(vae, AutoencoderKLLTX2Video):
            mean, std, channels = vae.latents_mean, vae.latents_std, vae.config.latent_channels
        else:
            mean, std = torch.tensor(vae.config.latents_mean), torch.tensor(vae.config.latents_std)
            channels = vae.config.z_dim
        mean = mean.view(1, channels, 1, 1, 1).to(latents.device, latents.dtype)
        inverse_std = 1.0 / std.view(1, channels, 1, 1, 1).to(latents.device, latents.dtype)
        video = vae.decode(latents / inverse_std + mean, return_dict=False)[0]
        return self.pipe.video_processor.postprocess_video(video, output_type="pt").float()

    # ------------------------------------------------------------------ config
    @classmethod
    def config_errors(cls, config) -> list[str]:
        frames, errors = config.sample.num_frames, super().config_errors(config)
        if frames < 0:
            errors.append(f"sample.num_frames={frames} must be >= 0 (0: the call's 81)")
        return errors

    def pipeline_kwargs(self, sample_config, pretrained) -> dict:
        """sana.py's (the size with its binning off, the token count, the negative prompt) and the frames."""
        return {**super().pipeline_kwargs(sample_config, pretrained), "frames": self.frames}
