"""Kandinsky 6 (Kandinsky6TI2VAPipeline: Kandinsky 6.0 Pro, text to video with audio): one transformer of fused
video / audio blocks, a Qwen2.5-VL text encoder beside CLIP's pooled embedding, HunyuanVideo's VAE and MMAudio's.

    state       one latent a sample holding the video's and the audio's: their latents flattened and joined,
                [B, Nv + Na, 1] with Nv = F' h w C (the video latent in the transformer's [B, F', h, w, C] layout: F' =
                (F - 1) / 4 + 1 latent frames of F = ``sample.num_frames``, 0: the call's 121; h, w the size over the
                VAE's factor) and Na = La Ca (the audio latent [B, La, Ca], as long as the video: La = ceil(((F' - 1) 4
                + 1) / frame_rate * sample_rate / hop) at the call's 24 frames a second). The two widths differ (16 and
                20 on the released model), so the state is their elements, one a token. The pipeline steps both with
                the same sigmas (its audio with a copy of its scheduler), so one Gaussian step draws the video's and
                the audio's noise and its log-probability is the joint next state's, reduced over both
                (``sample.log_prob_reduce``). x_0 = the pipeline's draws, the video's then the audio's, from the same
                generators, in the transformer's dtype as the call draws and keeps them
    condition   the call's ``encode_prompt``: Qwen2.5-VL's last hidden states of the prompt in its video template, the
                template's first 129 tokens cropped, padded to L = ``pretrained.max_sequence_length`` (0: the call's
                1024) with the mask, and CLIP's pooled embedding; a forward passes no mask when none of its rows is
                padded, as the call does. The unconditional condition is the call's own negative prompt (its built-in
                "Static, 2D cartoon, ..."), ``sample.negative_prompt`` or a row's, encoded the same way
    schedule    the flow Euler scheduler's own (its shift; a distilled checkpoint's PiflowScheduler is refused)
    output      (v_video, v_audio) = transformer([x_video; zero condition latent; zero mask], x_audio, text, pooled,
                t); CFG as the call, two forwards: v = v_n + w (v_c - v_n) for each (w = ``sample.guidance_scale``,
                <= 1: none; the call's 5)
    step        flow matching (models/families/flow_matching.py, sampling/flow_steps.py)
    decode      the video: [B, C, F', h, w] / scaling_factor, the VAE, frames [B, F, 3, H, W]; the audio
                (``decode_audio``): [B, Ca, La] / scaling_factor, the MMAudio VAE's mel spectrogram, the vocoder's mono
                waveform [B, 1, samples] at its ``sample_rate``

The call's prompt expansion (``expand_prompts``: Qwen2.5-VL rewriting the prompt) is not run: the run's prompts are
the captions. Image-to-video (a reference first frame) is not taken: a prompt's source image is ignored, as by every
text-only family. Its tokenizer, transformers' Qwen2_5_VLProcessor, needs torchvision: without it the pipeline does
not load, and the error names the extra that installs it (``pip install -e ".[models]"``). The pipeline has no LoRA
loader: the adapter is exported with "transformer." keys, which the pipeline's transformer loads
(``load_lora_adapter``, base.py's ``load_lora``). A distilled checkpoint (Kandinsky 6.0 Pro distill: PiflowScheduler,
guidance 1) and one without an audio VAE and vocoder are refused by name.
"""

from __future__ import annotations

import inspect
import math

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky6TI2VAPipeline

from ddpo_group.models.families import register_family
from ddpo_group.models.families.base import join_flat, needs_torchvision, split_flat
from ddpo_group.models.families.flow_matching import FlowMatchingFamily
from ddpo_group.sampling.family import Capabilities


@register_family("kandinsky6", Kandinsky6TI2VAPipeline)
class Kandinsky6Family(FlowMatchingFamily):
    capabilities = Capabilities(video=True, audio=True)
    cond_keys = ("prompt_embeds", "pooled_prompt_embeds", "prompt_attention_mask")
    negative_prompt = Kandinsky6TI2VAPipeline._DEFAULT_NEGATIVE_PROMPT  # the call's own when given none
    # the attention projections of the fused blocks: the video's and the audio's self- and text attention and the
    # audio-to-video and video-to-audio attention (not the modulations' "out_layer")
    lora_target_modules = tuple(f"{attention}.{projection}"
                                for attention in ("self_attention", "cross_attention", "av_cross_attention",
                                                  "va_cross_attention")
                                for projection in ("to_query", "to_key", "to_value", "out_layer"))

    def __init__(self, pipe, config):
        if not isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler):
            raise ValueError(f"this Kandinsky 6 checkpoint samples with {type(pipe.scheduler).__name__} (a distilled "
                             "model: Kandinsky 6.0 Pro distill's PiflowScheduler at guidance 1); the kandinsky6 family "
                             "trains the checkpoints sampled by FlowMatchEulerDiscreteScheduler")
        if pipe.audio_vae is None or pipe.vocoder is None:
            raise ValueError("this Kandinsky 6 pipeline has no audio_vae or vocoder: the kandinsky6 family samples the "
                             "video and its audio together, as the call does by default (sample_audio=True)")
        self.patch_size = pipe.transformer.config.patch_size[1]
        super().__init__(pipe, config)

    @classmethod
    def load_pipeline(cls, path, local, revision, dtype_kwargs):
        try:
            return super().load_pipeline(path, local, revision, dtype_kwargs)
        except ImportError as error:  # the released tokenizer is transformers' Qwen2_5_VLProcessor
            raise needs_torchvision("Kandinsky 6's tokenizer (transformers' Qwen2_5_VLProcessor)", error) from error

    # ------------------------------------------------------------------ sizes
    def call_default(self, name: str):
        return inspect.signature(Kandinsky6TI2VAPipeline.__call__).parameters[name].default

    @property
    def frames(self) -> int:
        """Video frames: ``sample.num_frames``, or the call's 121."""
        return int(self.config.sample.num_frames) or self.call_default("num_frames")

    def default_size(self) -> tuple[int, int]:
        """The call's 512 x 768."""
        return self.call_default("height"), self.call_default("width")

    def size_multiple(self) -> int:
        return self.pipe.vae_scale_factor_spatial * max(self.pipe.transformer_patch_size[1:])

    def position_limit(self) -> tuple[int, str]:
        """The transformer's rotary tables: 128 positions an axis (Kandinsky6RoPE3D's max_pos)."""
        size = min(self.pipe.transformer.visual_rope_embeddings.max_pos)
        return size, f"Kandinsky6RoPE3D's max_pos {size}"

    def size_errors(self) -> list[str]:
        return super().size_errors() + self.frame_errors(self.pipe.vae_scale_factor_temporal,
                                                         "the video VAE's temporal factor")

    @property
    def video_shape(self) -> tuple[int, int, int, int]:
        """(F', h, w, C): the video latent in the transformer's layout."""
        pipe, (height, width) = self.pipe, self.height_width
        return ((self.frames - 1) // pipe.vae_scale_factor_temporal + 1, height // pipe.vae_scale_factor_spatial,
                width // pipe.vae_scale_factor_spatial, pipe.transformer.config.in_visual_dim)

    @property
    def audio_shape(self) -> tuple[int, int]:
        """(La, Ca): the audio latent as long as the video, as the call computes it."""
        pipe, latent_frames = self.pipe, self.video_shape[0]
        seconds = ((latent_frames - 1) * pipe.vae_scale_factor_temporal + 1) / float(self.call_default("frame_rate"))
        return (math.ceil(seconds * pipe.audio_sample_rate / pipe.audio_latent_hop_length),
                pipe.transformer.config.in_audio_dim)

    def latent_shape(self) -> tuple:
        return math.prod(self.video_shape) + math.prod(self.audio_shape), 1

    def split(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The state [B, Nv + Na, 1] -> the video [B, F', h, w, C] and the audio [B, La, Ca]."""
        return split_flat(state, self.video_shape, self.audio_shape)

    def draw_noise(self, batch, generator, device, dtype):
        """The call's draws: the video's, then the audio's, from the same generators."""
        frames, height, width, channels = self.video_shape
        pixels = self.height_width
        video = self.pipe.prepare_latents(batch, channels, *pixels, self.frames, dtype, device, generator)
        assert video.shape[1:] == (frames, height, width, channels)
        audio = self.pipe.prepare_audio_latents(batch, self.audio_shape[1], self.audio_shape[0], dtype, device,
                                                generator)
        return join_flat(video, audio)

    # ------------------------------------------------------------------ condition
    @property
    def text_length(self) -> int:
        return self.max_sequence_length or self.call_default("max_sequence_length")

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict:
        embeds, pooled, mask, *_ = self.pipe.encode_prompt(
            list(prompts), do_classifier_free_guidance=False, max_sequence_length=self.text_length,
            device=self.text_encoder_device(), dtype=self.pipe.transformer.dtype)
        if mask is None:  # the call's "no prompt padded": every token kept
            mask = torch.ones(embeds.shape[:2], dtype=torch.bool)
        return {"prompt_embeds": embeds.to(self.device), "pooled_prompt_embeds": pooled.to(self.device),
                "prompt_attention_mask": mask.to(self.device)}

    # ------------------------------------------------------------------ model, decode
    def transformer_output(self, model, video, audio, timestep, cond: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward on a condition's rows (B rows, or one row broadcast)."""
        n = video.shape[0]
        rows = {k: v.expand(n, *v.shape[1:]) if v.shape[0] == 1 and n > 1 else v for k, v in cond.items()}
        mask = rows["prompt_attention_mask"]
        inputs = video
        if self.pipe.transformer.config.visual_cond:  # [latent | condition latent (zero) | mask (zero)]
            inputs = torch.cat([video, torch.zeros_like(video), torch.zeros((*video.shape[:-1], 1), dtype=video.dtype,
                                                                              device=video.device)], dim=-1)
        return model(hidden_states=inputs, audio_hidden_states=audio, encoder_hidden_states=rows["prompt_embeds"],
                     pooled_projections=rows["pooled_prompt_embeds"], timestep=timestep,
                     encoder_attention_mask=None if bool(mask.all()) else mask, return_dict=False)

    def model_output(self, model, latents, times, cond, negative, guidance_scale):
        n = latents.shape[0]
        t = torch.as_tensor(times["timesteps"], device=latents.device)
        t = t.expand(n) if t.ndim == 0 else t
        video, audio = self.split(latents)
        conditional = self.transformer_output(model, video, audio, t, cond)
        if guidance_scale > self.no_guidance and negative is not None:
            unconditional = self.transformer_output(model, video, audio, t, negative)
            conditional = tuple(u + guidance_scale * (c - u) for c, u in zip(conditional, unconditional))
        return join_flat(*conditional[:2])

    @torch.no_grad()
    def decode(self, latents):
        """Frames [B, F, 3, H, W] in [0, 1], the call's decode of the video."""
        vae = self.pipe.vae
        video = self.split(latents)[0].permute(0, 4, 1, 2, 3)
        frames = vae.decode(video.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]
        return self.pipe.video_processor.postprocess_video(frames, output_type="pt").float()

    @property
    def audio_sample_rate(self) -> int:
        return int(self.pipe.audio_sample_rate)

    @torch.no_grad()
    def decode_audio(self, latents) -> torch.Tensor:
        """The mono waveform [B, 1, samples] at ``audio_sample_rate`` Hz, the call's decode of the audio."""
        audio_vae = self.pipe.audio_vae
        audio = self.split(latents)[1].permute(0, 2, 1).to(audio_vae.dtype) / audio_vae.config.scaling_factor
        mel = audio_vae.decode(audio, return_dict=False)[0]
        return self.pipe.vocoder(mel.to(self.pipe.vocoder.dtype), return_dict=False)[0][:, :1].float()

    def pipeline_audio(self, output) -> torch.Tensor:
        """The call's audio [B, samples] (its vocoder's first channel) as ``decode_audio`` gives it: [B, 1, samples]."""
        return output.audio[:, None]

    # ------------------------------------------------------------------ config
    @classmethod
    def config_errors(cls, config) -> list[str]:
        sample, errors = config.sample, super().config_errors(config)
        if sample.num_frames < 0:
            errors.append(f"sample.num_frames={sample.num_frames} must be >= 0 (0: the call's 121)")
        return errors + cls.guidance_errors(config)

    def pipeline_kwargs(self, sample_config, pretrained) -> dict:
        """The size, the frames and the token count; the call samples its audio by default."""
        return {**self.size_kwargs(), "num_frames": self.frames, "max_sequence_length": self.text_length}
