"""LTX-2 (LTX2Pipeline: LTX-2, LTX-2.3): one transformer denoising a video and its audio together, a Gemma-3 text
encoder read through the pipeline's text connectors.

    state       one latent a sample, the video's and the audio's tokens: [B, Lv + La, C], the packed video latent
                [B, Lv, C] (the video VAE's 32x / 8x grid of ``sample.num_frames`` frames, 0: the call's 121) then the
                packed audio latent [B, La, C] (as long as the video: frames / frame_rate seconds of the audio VAE's
                latent frames; its channels times its latent mel bins, 128 as the video's on LTX-2: a model whose two
                widths differ is refused). Both are stepped with the same sigmas (the
                pipeline steps its audio latents with a copy of its scheduler: the same schedule), so the stochastic
                step draws the video's and the audio's noise in one Gaussian and its log-probability is the density of
                the joint next state, reduced over both (``sample.log_prob_reduce``); x_0 = the pipeline's draws, the
                video's then the audio's, from the same generators
    condition   the pipeline's Gemma-3 hidden states of every layer (``max_sequence_length`` tokens, left padded: 0 is
                the call's 1024) through its text connectors: the video stream's and the audio stream's text embeddings
                and their mask (prompt_embeds, audio_prompt_embeds, prompt_attention_mask), each row encoded alone
    schedule    sigmas linspace(1, 1/T, T) shifted by mu of the video's token count (the pipeline's dynamic shift)
    output      (v_video, v_audio) = transformer(video, audio, both texts, t, the coordinates of the video's frames at
                the call's frame rate and of the audio's), guided as the pipeline guides, every pass of its call:
                each velocity taken to the clean latent it predicts, clean_hat = x - s v; CFG (one forward of
                [negative; conditional]) adds (w - 1)(clean_hat_c - clean_hat_n), the audio at its own scale
                (``audio_guidance_scale``: 7 at the call's defaults); spatio-temporal guidance (a conditional forward
                with the self-attention of ``spatio_temporal_guidance_blocks`` skipped, [28]) adds
                stg_scale (clean_hat_c - clean_hat_stg); modality isolation (a conditional forward without the
                audio-to-video and video-to-audio attention) adds (modality_scale - 1)(clean_hat_c - clean_hat_iso);
                the sum rescaled toward clean_hat_c's std by ``guidance_rescale`` (0.7); back to v = (x - clean_hat) /
                s. Each value is ``sample.pipeline_guidance``'s or the call's default (the audio's None / 0: the
                video's), in sampling and in the training forward alike: 4 forwards' rows a sample at the defaults
                (2 with CFG alone). Flow-Factory's recipe turns the extra passes off
    decode      the video: unpacked, denormalized, the video VAE (its decode timestep 0), frames [B, F, 3, H, W]; the
                audio (``decode_audio``): unpacked, denormalized, the audio VAE's mel spectrogram, the vocoder's waveform
                [B, channels, samples] at ``audio_sample_rate`` Hz
"""

from __future__ import annotations

import inspect

import numpy as np
import torch
from diffusers import LTX2Pipeline
from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, rescale_noise_cfg
from diffusers.pipelines.ltx2.utils import conditioning_frame_rate

from ddpo_group.errors import ConfigError
from ddpo_group.models.families import register_family
from ddpo_group.sampling.family import Capabilities
from ddpo_group.models.families.flow_matching import FlowMatchingFamily

# the call's guidance keywords beyond guidance_scale, which sample.pipeline_guidance sets (module docstring)
GUIDANCE_PASSES = ("audio_guidance_scale", "stg_scale", "audio_stg_scale", "modality_scale", "audio_modality_scale",
                   "guidance_rescale", "audio_guidance_rescale", "spatio_temporal_guidance_blocks")


@register_family("ltx2", LTX2Pipeline)
class LTX2Family(FlowMatchingFamily):
    capabilities = Capabilities(video=True, audio=True)
    guidance_passes = GUIDANCE_PASSES
    cond_keys = ("prompt_embeds", "audio_prompt_embeds", "prompt_attention_mask")
    patch_size = 1  # set from the transformer in __init__
    # LTX2Pipeline's call keeps the video's and the audio's latents in float32 (the transformer reads copies in the
    # prompt embeddings' dtype)
    latents_dtype = torch.float32
    # every Linear of a block: the video's and the audio's self- and text attention, the audio-to-video and
    # video-to-audio attention, both feed-forwards (Flow-Factory's LTX-2 default: 28 a block)
    lora_target_modules = tuple(f"{attn}.{proj}" for attn in ("attn1", "attn2", "audio_attn1", "audio_attn2",
                                                                 "audio_to_video_attn", "video_to_audio_attn")
                                for proj in ("to_q", "to_k", "to_v", "to_out.0")) + (
        "ff.net.0.proj", "ff.net.2", "audio_ff.net.0.proj", "audio_ff.net.2")

    def __init__(self, pipe, config):
        self.patch_size = pipe.transformer.config.patch_size
        video_width = pipe.transformer.config.in_channels
        audio_width = pipe.audio_vae.config.latent_channels * (pipe.audio_vae.config.mel_bins
                                                               // pipe.audio_vae_mel_compression_ratio)
        if video_width != audio_width:
            raise ValueError(f"this LTX-2 model's video tokens are {video_width} wide and its audio tokens "
                             f"{audio_width}: the ltx2 family holds both as one token sequence of one width")
        if not int(config.sample.num_frames) and getattr(pipe, "duration_head", None) is not None:
            raise ConfigError("this LTX-2 pipeline has a duration head, which predicts each video's length when its "
                              "call is given no frame count: set sample.num_frames (8 k + 1)")
        super().__init__(pipe, config)

    # ------------------------------------------------------------------ sizes
    def call_default(self, name: str):
        return inspect.signature(type(self.pipe).__call__).parameters[name].default

    @property
    def frames(self) -> int:
        """Video frames: ``sample.num_frames``, or the call's 121 (a checkpoint without a duration head)."""
        return int(self.config.sample.num_frames) or 121

    @property
    def frame_rate(self) -> float:
        return float(self.call_default("frame_rate"))

    def default_size(self) -> tuple[int, int]:
        return self.call_default("height"), self.call_default("width")

    def size_multiple(self) -> int:
        return self.pipe.vae_spatial_compression_ratio * self.patch_size

    def size_errors(self) -> list[str]:
        return super().size_errors() + self.frame_errors(self.pipe.vae_temporal_compression_ratio,
                                                         "the video VAE's temporal factor")

    @property
    def video_grid(self) -> tuple[int, int, int]:
        """(latent frames, height, width) of the video latent."""
        pipe, (height, width) = self.pipe, self.height_width
        return ((self.frames - 1) // pipe.vae_temporal_compression_ratio + 1, height // pipe.vae_spatial_compression_ratio,
                width // pipe.vae_spatial_compression_ratio)

    @property
    def audio_frames(self) -> int:
        """The audio latent's frames: the video's duration in the audio VAE's latent frames (the pipeline's count)."""
        pipe = self.pipe
        per_second = pipe.audio_sampling_rate / pipe.audio_hop_length / float(pipe.audio_vae_temporal_compression_ratio)
        return round(self.frames / self.frame_rate * per_second)

    @property
    def mel_bins(self) -> int:
        return self.pipe.audio_vae.config.mel_bins

    def parts(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """((Lv, Cv), (La, Ca)): the packed video's and audio's token counts and widths."""
        pipe, (frames, rows, columns) = self.pipe, self.video_grid
        p, pt = self.patch_size, pipe.transformer.config.patch_size_t
        video = (frames // pt) * (rows // p) * (columns // p), pipe.transformer.config.in_channels
        audio = self.audio_frames, pipe.audio_vae.config.latent_channels * (self.mel_bins
                                                                           // pipe.audio_vae_mel_compression_ratio)
        return video, audio

    def latent_shape(self) -> tuple:
        (lv, width), (la, _) = self.parts()
        return lv + la, width

    def split(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The joint state [B, Lv + La, C] -> packed video [B, Lv, C] and audio [B, La, C]."""
        lv = self.parts()[0][0]
        return state[:, :lv], state[:, lv:]

    @staticmethod
    def joined(video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        return torch.cat([video, audio], dim=1)

    def draw_noise(self, batch, generator, device, dtype):
        pipe, (height, width) = self.pipe, self.height_width
        video = pipe.prepare_latents(batch, pipe.transformer.config.in_channels, height, width, self.frames, 0.0,
                                     torch.float32, device, generator)
        audio = pipe.prepare_audio_latents(batch, num_channels_latents=pipe.audio_vae.config.latent_channels,
                                           audio_latent_length=self.audio_frames, num_mel_bins=self.mel_bins,
                                           noise_scale=0.0, dtype=torch.float32, device=device, generator=generator)
        return self.joined(video, audio).to(dtype)

    # ------------------------------------------------------------------ condition
    @property
    def text_length(self) -> int:
        return self.max_sequence_length or self.call_default("max_sequence_length")

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict:
        """Each prompt alone through Gemma-3 and the pipeline's connectors."""
        pipe, rows = self.pipe, []
        for prompt in prompts:
            embeds, mask, _, _ = pipe.encode_prompt(prompt=[prompt], do_classifier_free_guidance=False,
                                                    max_sequence_length=self.text_length,
                                                    device=self.text_encoder_device())
            device = next(pipe.connectors.parameters()).device  # the denoiser's (pretrained.text_encoder_device: Gemma's)
            rows.append(pipe.connectors(embeds.to(device), mask.to(device), padding_side=pipe.tokenizer.padding_side))
        return {key: torch.cat([row[i] for row in rows]).to(self.device) for i, key in enumerate(self.cond_keys)}

    # ------------------------------------------------------------------ schedule, model
    def schedule_kwargs(self, num_steps: int) -> dict:
        config = self.pipe.scheduler.config
        mu = calculate_shift(self.parts()[0][0], config.get("base_image_seq_len", 1024),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.95),
                             config.get("max_shift", 2.05))
        return {"sigmas": np.linspace(1.0, 1 / num_steps, num_steps), "mu": mu}

    @property
    def guidance(self) -> dict:
        return self.guidance_values(self.config.sample, type(self.pipe))

    @staticmethod
    def guidance_values(sample, pipeline_class=LTX2Pipeline) -> dict:
        """Every keyword of ``GUIDANCE_PASSES``: ``sample.pipeline_guidance``'s, else the call's default; an audio
        value None / 0 the video's (as the call reads them; the audio's CFG scale falls back in ``model_output``)."""
        chosen, defaults = dict(sample.pipeline_guidance), inspect.signature(pipeline_class.__call__).parameters
        values = {name: chosen.get(name, defaults[name].default) for name in GUIDANCE_PASSES}
        for name in ("stg_scale", "modality_scale", "guidance_rescale"):
            values[f"audio_{name}"] = values[f"audio_{name}"] or values[name]
        values["spatio_temporal_guidance_blocks"] = list(values["spatio_temporal_guidance_blocks"] or [])
        return values

    def model_output(self, model, state, times, cond, negative, guidance_scale):
        """The guided velocity of every pass of the pipeline's call (module docstring), the video's and the audio's
        joined; the pipeline's arithmetic in its order."""
        passes, batch_rows = self.guidance, state.shape[0]
        scales = (float(guidance_scale), float(passes["audio_guidance_scale"] or guidance_scale))  # video, audio
        video, audio = self.split(state.float())
        s = torch.as_tensor(times["sigmas"], device=state.device).float()
        sigma = (s.expand(batch_rows) if s.ndim == 0 else s).view(-1, 1, 1)
        t = torch.as_tensor(times["timesteps"], device=state.device)
        t = t.expand(batch_rows) if t.ndim == 0 else t
        texts = {key: cond[key] for key in self.cond_keys}
        guided = negative is not None and max(scales) > self.no_guidance

        def clean_hat(pass_texts, rows, **perturbation):  # (video, audio) clean latents one forward predicts
            v_video, v_audio = self.forward(model, video, audio, pass_texts, t, rows, **perturbation)
            return (torch.cat([video] * rows) - v_video.float() * sigma.repeat(rows, 1, 1),
                    torch.cat([audio] * rows) - v_audio.float() * sigma.repeat(rows, 1, 1))

        if guided:  # one forward of [negative; conditional], as the pipeline
            both = {key: torch.cat([negative[key].expand(batch_rows, *negative[key].shape[1:]), cond[key]])
                    for key in self.cond_keys}
            uncond, clean = zip(*(part.chunk(2) for part in clean_hat(both, 2)))
            total = [c + (w - 1) * (c - u) for c, u, w in zip(clean, uncond, scales)]
        else:
            clean = clean_hat(texts, 1)
            total = list(clean)
        stg = passes["stg_scale"], passes["audio_stg_scale"]
        if max(stg) > 0:  # spatio-temporal guidance: the listed blocks' self-attention skipped
            skipped = clean_hat(texts, 1, spatio_temporal_guidance_blocks=passes["spatio_temporal_guidance_blocks"])
            total = [g + k * (c - p) for g, c, p, k in zip(total, clean, skipped, stg)]
        modality = passes["modality_scale"], passes["audio_modality_scale"]
        if max(modality) > 1:  # modality isolation: no audio-to-video or video-to-audio attention
            isolated = clean_hat(texts, 1, isolate_modalities=True)
            total = [g + (k - 1) * (c - p) for g, c, p, k in zip(total, clean, isolated, modality)]
        rescales = passes["guidance_rescale"], passes["audio_guidance_rescale"]
        total = [rescale_noise_cfg(g, c, guidance_rescale=r) if r > 0 else g for g, c, r in zip(total, clean, rescales)]
        return self.joined((video - total[0]) / sigma, (audio - total[1]) / sigma)

    def forward(self, model, video, audio, texts, t, rows: int, isolate_modalities: bool = False,
                spatio_temporal_guidance_blocks=None):
        """One transformer forward of ``rows`` copies of the batch (each copy's texts in ``texts``), as the
        pipeline's call makes it: (v_video, v_audio)."""
        pipe, n = self.pipe, video.shape[0]
        frames, height, width = self.video_grid
        fps = conditioning_frame_rate(self.frame_rate, self.call_default("motion_speed"))
        video_coords = pipe.transformer.rope.prepare_video_coords(n, frames, height, width, video.device, fps=fps)
        audio_coords = pipe.transformer.audio_rope.prepare_audio_coords(n, self.audio_frames, video.device)
        repeat = lambda x: x.repeat((rows,) + (1,) * (x.ndim - 1)) if rows > 1 else x  # noqa: E731
        dtype = texts["prompt_embeds"].dtype
        # one copy: the layout of the pipeline's state (_pack_latents' view of [B, C, F, H, W], channels outermost),
        # which a bf16 matmul's rounding depends on; [negative; conditional]: the contiguous copy its torch.cat makes
        hidden = torch.cat([video] * rows) if rows > 1 else video.transpose(1, 2).contiguous().transpose(1, 2)
        return model(
            hidden_states=hidden.to(dtype), audio_hidden_states=torch.cat([audio] * rows).to(dtype),
            encoder_hidden_states=texts["prompt_embeds"], audio_encoder_hidden_states=texts["audio_prompt_embeds"],
            timestep=torch.cat([t] * rows), sigma=torch.cat([t] * rows),
            encoder_attention_mask=texts["prompt_attention_mask"],
            audio_encoder_attention_mask=texts["prompt_attention_mask"], num_frames=frames, height=height,
            width=width, fps=fps, audio_num_frames=self.audio_frames, video_coords=repeat(video_coords),
            audio_coords=repeat(audio_coords), isolate_modalities=isolate_modalities,
            spatio_temporal_guidance_blocks=spatio_temporal_guidance_blocks, perturbation_mask=None,
            use_cross_timestep=self.call_default("use_cross_timestep"), return_dict=False)

    # ------------------------------------------------------------------ decode
    @torch.no_grad()
    def decode(self, state):
        """The video's frames [B, F, 3, H, W] in [0, 1], as the pipeline decodes them (its decode timestep 0)."""
        pipe, (frames, height, width) = self.pipe, self.video_grid
        video, _ = self.split(state.float())
        latents = pipe._unpack_latents(video, frames, height, width, self.patch_size,
                                       pipe.transformer.config.patch_size_t)
        latents = latents.to(pipe.text_encoder.dtype)  # the pipeline's prompt embeddings' dtype
        timestep = None
        if pipe.vae.config.timestep_conditioning:  # the call's decode_timestep 0: no decode noise
            timestep = torch.zeros(latents.shape[0], device=latents.device, dtype=latents.dtype)
        latents = pipe._denormalize_latents(latents, pipe.vae.latents_mean, pipe.vae.latents_std,
                                            pipe.vae.config.scaling_factor).to(pipe.vae.dtype)
        out = pipe.vae.decode(latents, timestep, return_dict=False)[0]
        return pipe.video_processor.postprocess_video(out, output_type="pt").float()

    @property
    def audio_sample_rate(self) -> int:
        return int(self.pipe.vocoder.config.output_sampling_rate)

    @torch.no_grad()
    def decode_audio(self, state) -> torch.Tensor:
        """The audio's waveform [B, channels, samples] at ``audio_sample_rate`` Hz, as the pipeline decodes it."""
        pipe = self.pipe
        _, audio = self.split(state.float())
        audio = pipe._denormalize_audio_latents(audio, pipe.audio_vae.latents_mean, pipe.audio_vae.latents_std)
        audio = pipe._unpack_audio_latents(audio, self.audio_frames,
                                           num_mel_bins=self.mel_bins // pipe.audio_vae_mel_compression_ratio)
        mel = pipe.audio_vae.decode(audio.to(pipe.audio_vae.dtype), return_dict=False)[0]
        return pipe.vocoder(mel).float()

    # ------------------------------------------------------------------ config
    @classmethod
    def config_errors(cls, config) -> list[str]:
        sample, errors = config.sample, super().config_errors(config)
        if sample.num_frames < 0 or (sample.num_frames and (sample.num_frames - 1) % 8):
            errors.append(f"sample.num_frames={sample.num_frames} must be 8 k + 1 frames (LTX-2's VAE compresses time "
                          "by 8), e.g. 9, 25, 121; 0: the pipeline's 121")
        passes = cls.guidance_values(sample)
        if (passes["stg_scale"] > 0 or passes["audio_stg_scale"] > 0) and not passes["spatio_temporal_guidance_blocks"]:
            errors.append(f"sample.pipeline_guidance: stg_scale={passes['stg_scale']} / audio_stg_scale="
                          f"{passes['audio_stg_scale']} guide by skipping blocks, and spatio_temporal_guidance_blocks "
                          "is empty (list the blocks, e.g. [28], or set both scales 0)")
        return errors + cls.guidance_errors(config)

    @classmethod
    def guidance_errors(cls, config) -> list[str]:
        """The training forward guides with CFG exactly when sampling did: when the video's or the audio's scale is
        above 1 (the call's rule)."""
        sample, train = config.sample, config.train
        scales = sample.guidance_scale, cls.guidance_values(sample)["audio_guidance_scale"] or sample.guidance_scale
        if bool(train.cfg) == (max(scales) > cls.no_guidance):
            return []
        return [f"train.cfg={train.cfg} contradicts sample.guidance_scale={sample.guidance_scale} with the audio's "
                f"scale {scales[1]} (sample.pipeline_guidance.audio_guidance_scale, the call's 7 when unset): LTX-2 "
                "guides when either is above 1, and the training forward must guide exactly when sampling did, or "
                "the recomputed log-probs are off-policy"]

    def pipeline_kwargs(self, sample_config, pretrained) -> dict:
        """The size, the frames, the token count and every guidance keyword of the call (``guidance``)."""
        return {**self.size_kwargs(), "num_frames": self.frames, "max_sequence_length": self.text_length,
                **self.guidance}

    def pipeline_images(self, output) -> torch.Tensor:
        return output.frames
