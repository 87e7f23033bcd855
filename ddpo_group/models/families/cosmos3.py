"""Cosmos 3 (Cosmos3OmniPipeline: Cosmos 3 text to video, one frame an image, with its sound when asked): one
mixture-of-transformers model reading the prompt's token ids and the video's (and sound's) latent tokens in one
packed sequence, Wan2.2's VAE.

    condition   input_ids [B, L] and input_lengths [B]: the pipeline's ``tokenize_prompt`` of each prompt with the
                call's sentences appended ("The video is 7.9 seconds long and is of 24 FPS. This video is of 720x1280
                resolution.", or the image's), in its system prompt's chat template, then its end-of-text and
                start-of-generation tokens; zero-padded to L = ``pretrained.max_sequence_length`` (0: 512; the call
                keeps every token, so a longer prompt is refused by name). The model embeds the ids itself (no text
                encoder runs). The unconditional condition: the negative prompt ("" by default, the call's) with the
                inverse sentences ("The video is not ..."), tokenized the same way
    latents     [B, C, T', H/16, W/16] float32 (T' = (F - 1) / 4 + 1 latent frames of F = ``sample.num_frames``, 0: the
                call's 189; 1: an image), x_0 = N(0, I) drawn row by row as the call draws its one sample, the state
                kept in float32 as the call keeps it. With ``sample.audio`` (the call's ``enable_sound``, a
                sound-capable checkpoint) the sound latent [Cs, N] (N at the transformer's 25 latent frames a second
                of the video's F / fps seconds) is drawn after the video's from the same generator and the state is
                both flattened and joined, [B, Nv + Ns, 1]: one Gaussian step and one log-probability over both
    schedule    the released checkpoints ship UniPCMultistepScheduler (order 2, flow prediction on Karras sigmas: 0.995
                down to 0.128, then 0), whose step reads the previous steps' outputs; ``load_pipeline`` swaps it for
                FlowMatchEulerDiscreteScheduler stepping on that scheduler's own sigmas and integer timesteps
                (``EulerOnTheSchedule``), with a warning, in training and evaluation alike: the pipeline's call and our
                sampler at noise level 0 take the same Euler steps, bitwise, on the released schedule; the released
                UniPC samples another trajectory from the same noise (docs/model_families.md measures the difference)
    output      one forward a row (the model packs one sample's text and tokens into one sequence: the call takes one
                prompt): (v_video, v_sound) = transformer(ids, the packed layout's indexes and 3D M-RoPE positions,
                the latent tokens, t), in float32; CFG as the call, two forwards: v = v_n + w (v_c - v_n)
                (w = ``sample.guidance_scale``, 1: none; the call's 6)
    step        flow matching (models/families/flow_matching.py, sampling/flow_steps.py)
    decode      z / (1 / latents_std) + latents_mean (the VAE's statistics), the VAE one video at a time, frames
                [B, F, 3, H, W]; the sound (``decode_audio``): the sound tokenizer's stereo waveform at its 48 kHz

Image and video conditioning (``image=``, ``video=``), actions and the safety checker are not run: a prompt's source
image is ignored, as by every text-only family; the pipeline is loaded with ``enable_safety_checker=False``.
"""

from __future__ import annotations

import copy
import inspect
import math
import warnings

import numpy as np
import torch
from diffusers import Cosmos3OmniPipeline, FlowMatchEulerDiscreteScheduler
from diffusers.utils.torch_utils import randn_tensor

from ddpo_group.models.families import register_family
from ddpo_group.models.families.base import join_flat, split_flat
from ddpo_group.models.families.flow_matching import FlowMatchingFamily
from ddpo_group.sampling.family import Capabilities

STORED_TOKENS = 512  # the stored tokens of a condition when pretrained.max_sequence_length is 0


class EulerOnTheSchedule(FlowMatchEulerDiscreteScheduler):
    """FlowMatchEulerDiscreteScheduler (shift 1) stepping on the sigmas and timesteps another scheduler sets
    (``source``: the released multistep solver, whose schedule the model was tuned on)."""

    source = None

    @classmethod
    def of(cls, source) -> "EulerOnTheSchedule":
        scheduler = cls(num_train_timesteps=source.config.num_train_timesteps, shift=1.0)
        scheduler.source = copy.deepcopy(source)
        return scheduler

    def set_timesteps(self, num_inference_steps=None, device=None, sigmas=None, mu=None, timesteps=None):
        self.source.set_timesteps(num_inference_steps, device="cpu", **({} if sigmas is None else {"sigmas": sigmas}))
        super().set_timesteps(sigmas=self.source.sigmas[:-1].tolist(), timesteps=self.source.timesteps.tolist(),
                              device=device)


def call_default(name: str):
    """A keyword's default in the call, or the value its body gives a None default (the size and frames)."""
    given = {"num_frames": 189, "height": 720, "width": 1280}  # the call's ``num_frames or 189`` and so on
    return given.get(name, inspect.signature(Cosmos3OmniPipeline.__call__).parameters[name].default)


@register_family("cosmos3", Cosmos3OmniPipeline)
class Cosmos3Family(FlowMatchingFamily):
    capabilities = Capabilities(video=True)  # with its audio when sample.audio (set per instance)
    cond_keys = ("input_ids", "input_lengths")
    latents_dtype = torch.float32  # the call keeps its latents in float32 (the model reads a cast copy)
    pipeline_max_batch = 1  # the call takes one prompt
    optional_audio = True  # sample.audio: the call's enable_sound
    # the attention projections of the generation tokens (the video's and the sound's; the text's are to_q ... to_out)
    lora_target_modules = ("self_attn.add_q_proj", "self_attn.add_k_proj", "self_attn.add_v_proj",
                           "self_attn.to_add_out")

    def __init__(self, pipe, config):
        self.sound = bool(config.sample.audio)
        if self.sound and (pipe.sound_tokenizer is None or not pipe.transformer.config.sound_gen):
            raise ValueError("sample.audio=True needs a sound-capable Cosmos 3 checkpoint (a sound_tokenizer and a "
                             "transformer with sound_gen=True); this one has none: set sample.audio=False")
        self.patch_size = pipe.transformer.config.latent_patch_size
        super().__init__(pipe, config)
        self.capabilities = Capabilities(video=True, audio=self.sound)

    @classmethod
    def load_pipeline(cls, path, local, revision, dtype_kwargs):
        pipe = cls.pipeline_class.from_pretrained(path, revision=revision or None, local_files_only=local,
                                                  enable_safety_checker=False,
                                                  **{**cls.absent_components(path, local), "safety_checker": None},
                                                  **dtype_kwargs)
        source = pipe.scheduler
        if not isinstance(source, FlowMatchEulerDiscreteScheduler):
            pipe.scheduler = EulerOnTheSchedule.of(source)
            warnings.warn(f"the cosmos3 family samples (training and evaluation alike) with Euler steps on this "
                          f"checkpoint's {type(source).__name__} schedule in place of the solver itself (its step reads "
                          "the previous steps' outputs: no one-step policy); the pipeline as released samples another "
                          "trajectory from the same noise", UserWarning, stacklevel=3)
        return pipe

    def schedule_kwargs(self, num_steps: int) -> dict:
        """The sigmas the call passes its scheduler: none, or with ``use_native_flow_schedule`` linspace(1 - 1 / 1000,
        0, T + 1)[:-1] (which the released Karras schedule ignores but their count)."""
        if not self.pipe.config.use_native_flow_schedule:
            return {}
        train = self.pipe.scheduler.config.num_train_timesteps
        return {"sigmas": np.linspace(1.0 - 1.0 / train, 0.0, num_steps + 1)[:-1]}

    def size_multiple(self) -> int:
        """The VAE's factor (the call's check; the model pads an odd patch grid itself)."""
        return self.pipe.vae_scale_factor_spatial

    # ------------------------------------------------------------------ sizes
    @property
    def frames(self) -> int:
        """Video frames: ``sample.num_frames``, or the call's 189 (1: an image)."""
        return int(self.config.sample.num_frames) or call_default("num_frames")

    @property
    def fps(self) -> float:
        return float(call_default("fps"))

    def default_size(self) -> tuple[int, int]:
        return call_default("height"), call_default("width")

    def size_errors(self) -> list[str]:
        return super().size_errors() + self.frame_errors(self.pipe.vae_scale_factor_temporal,
                                                         "the VAE's temporal factor")

    @property
    def video_shape(self) -> tuple[int, int, int, int]:
        pipe, (height, width) = self.pipe, self.height_width
        return (pipe.transformer.config.latent_channel, (self.frames - 1) // pipe.vae_scale_factor_temporal + 1,
                height // pipe.vae_scale_factor_spatial, width // pipe.vae_scale_factor_spatial)

    @property
    def sound_shape(self) -> tuple[int, int]:
        """(Cs, N): the sound latent of the video's F / fps seconds, as the call computes it."""
        samples = int(self.frames / self.fps * self.pipe.sound_tokenizer.config.sampling_rate)
        hop = self.pipe.sound_tokenizer._hop_size
        return self.pipe.transformer.config.sound_dim, (samples + hop - 1) // hop

    def latent_shape(self) -> tuple:
        if not self.sound:
            return self.video_shape
        return math.prod(self.video_shape) + math.prod(self.sound_shape), 1

    def split(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The state -> the video [B, C, T', h, w] and the sound [B, Cs, N] (None without sound)."""
        if not self.sound:
            return state, None
        return split_flat(state, self.video_shape, self.sound_shape)

    def draw_noise(self, batch, generator, device, dtype):
        """Row by row, as the call draws its one sample: the video's noise, then the sound's, from the row's
        generator."""
        rows = []
        for i in range(batch):
            row_generator = generator[i] if isinstance(generator, list) else generator
            video = randn_tensor((1, *self.video_shape), generator=row_generator, device=device, dtype=torch.float32)
            if not self.sound:
                rows.append(video)
                continue
            sound = randn_tensor(self.sound_shape, generator=row_generator, device=device, dtype=torch.float32)
            rows.append(join_flat(video, sound[None]))
        return torch.cat(rows).to(dtype)

    # ------------------------------------------------------------------ condition
    @property
    def text_length(self) -> int:
        """L, the stored tokens of a condition: ``pretrained.max_sequence_length``, else 512 (the call keeps every
        token: a longer prompt is refused)."""
        return self.max_sequence_length or STORED_TOKENS

    def token_ids(self, prompts: list[str], negative: bool) -> dict:
        """The call's token ids of each prompt (its own sentences appended; a negative prompt with the inverse ones),
        zero-padded to L (every row the same width, whatever the batch), with their lengths."""
        height, width = self.height_width
        rows, length = [], self.text_length
        for prompt in prompts:
            cond, uncond = self.pipe.tokenize_prompt("" if negative else prompt, prompt if negative else "",
                                                     num_frames=self.frames, height=height, width=width, fps=self.fps)
            row = uncond if negative else cond
            if len(row) > length:
                raise ValueError(f"prompt {prompt!r} is {len(row)} tokens with the call's sentences and template, more "
                                 f"than pretrained.max_sequence_length={length} (the call keeps every token): raise it")
            rows.append(row)
        ids = torch.tensor([row + [0] * (length - len(row)) for row in rows], dtype=torch.long)
        return {"input_ids": ids.to(self.device),
                "input_lengths": torch.tensor([len(row) for row in rows], device=self.device)}

    def encode(self, prompts: list[str]) -> dict:
        return self.token_ids(list(prompts), negative=False)

    def encode_negative(self, prompts: list[str]) -> dict:
        return self.token_ids(list(prompts), negative=True)

    @torch.no_grad()
    def text_embeds(self, cond: dict) -> torch.Tensor:
        """The critic's text input: the model's token embeddings of the ids [B, L, D], zero past each row's length."""
        ids, lengths = cond["input_ids"], cond["input_lengths"]
        kept = torch.arange(ids.shape[1], device=ids.device)[None] < lengths[:, None]
        return self.pipe.transformer.embed_tokens(ids).float() * kept[..., None]

    # ------------------------------------------------------------------ model
    def row_output(self, model, video, sound, t: float, ids: torch.Tensor):
        """One row's forward, the call's packing: (v_video [1, C, T', h, w], v_sound [Cs, N] or None), float32."""
        pipe, device, dtype = self.pipe, video.device, self.pipe.transformer.dtype
        text = pipe._prepare_text_segment(ids.tolist(), device=device)
        vision = pipe._prepare_vision_segment(input_vision_tokens=video, has_image_condition=False,
                                              mrope_offset=text["vision_start_temporal_offset"], vision_fps=self.fps,
                                              curr=text["und_len"], device=device, condition_frame_indexes=[])
        audio = {}
        if sound is not None:
            audio = pipe._prepare_sound_segment(input_sound_tokens=sound, mrope_offset=text["vision_start_temporal_offset"],
                                                sound_fps=float(pipe.transformer.config.sound_latent_fps),
                                                curr=text["und_len"] + vision["num_vision_tokens"], device=device)
        positions = [text["text_mrope_ids"], vision["vision_mrope_ids"]] + ([audio["sound_mrope_ids"]] if audio else [])
        sound_tokens = sound.to(dtype) if sound is not None else None
        preds_vision, preds_sound, _ = model(
            input_ids=text["input_ids"], text_indexes=text["text_indexes"], position_ids=torch.cat(positions, dim=1),
            und_len=text["und_len"], sequence_length=text["und_len"] + vision["num_vision_tokens"] + audio.get("sound_len", 0),
            vision_tokens=[video.to(dtype)], vision_token_shapes=vision["vision_token_shapes"],
            vision_sequence_indexes=vision["vision_sequence_indexes"],
            vision_mse_loss_indexes=vision["vision_mse_loss_indexes"],
            vision_timesteps=torch.full((vision["num_noisy_vision_tokens"],), t, device=device),
            vision_noisy_frame_indexes=vision["vision_noisy_frame_indexes"],
            sound_tokens=[sound_tokens] if sound_tokens is not None else None,
            sound_token_shapes=audio.get("sound_token_shapes"), sound_sequence_indexes=audio.get("sound_sequence_indexes"),
            sound_mse_loss_indexes=audio.get("sound_mse_loss_indexes"),
            sound_timesteps=torch.full((audio["sound_len"],), t, device=device) if audio else None,
            sound_noisy_frame_indexes=audio.get("sound_noisy_frame_indexes"), action_tokens=None,
            action_token_shapes=None, action_sequence_indexes=None, action_mse_loss_indexes=None,
            action_timesteps=None, action_noisy_frame_indexes=None, action_domain_ids=None, return_dict=False)
        return preds_vision[0].float(), preds_sound[0].float() if preds_sound is not None else None

    def model_output(self, model, latents, times, cond, negative, guidance_scale):
        n = latents.shape[0]
        t = torch.as_tensor(times["timesteps"], device=latents.device)
        t = t.expand(n) if t.ndim == 0 else t
        videos, sounds = self.split(latents)
        guided = guidance_scale != self.no_guidance and negative is not None
        outputs = []
        for i in range(n):
            video, sound = videos[i:i + 1], sounds[i] if sounds is not None else None
            ids = cond["input_ids"][i, :int(cond["input_lengths"][i])]
            v_video, v_sound = self.row_output(model, video, sound, t[i].item(), ids)
            if guided:
                row = i if negative["input_ids"].shape[0] > 1 else 0
                u_video, u_sound = self.row_output(model, video, sound, t[i].item(),
                                                   negative["input_ids"][row, :int(negative["input_lengths"][row])])
                v_video = u_video + guidance_scale * (v_video - u_video)
                v_sound = u_sound + guidance_scale * (v_sound - u_sound) if v_sound is not None else None
            outputs.append(v_video if v_sound is None else join_flat(v_video, v_sound[None]))
        return torch.cat(outputs)

    # ------------------------------------------------------------------ decode
    @torch.no_grad()
    def decode(self, latents):
        """Frames [B, F, 3, H, W] in [0, 1], the call's decode, one video at a time."""
        pipe, vae = self.pipe, self.pipe.vae
        videos, _ = self.split(latents)
        mean = pipe._vae_latents_mean.to(latents.device, vae.dtype).view(1, -1, 1, 1, 1)
        inverse_std = pipe._vae_latents_inv_std.to(latents.device, vae.dtype).view(1, -1, 1, 1, 1)
        frames = []
        for video in videos.split(1):
            decoded = vae.decode(video.float().to(vae.dtype) / inverse_std + mean).sample.float()
            frames.append(pipe.video_processor.postprocess_video(decoded, output_type="pt"))
        return torch.cat(frames).float()

    @property
    def audio_sample_rate(self) -> int:
        return int(self.pipe.sound_tokenizer.config.sampling_rate) if self.sound else 0

    @torch.no_grad()
    def decode_audio(self, latents) -> torch.Tensor:
        """The stereo waveform [B, 2, samples] of the sound latents, the call's ``decode_sound`` a row at a time."""
        _, sounds = self.split(latents)
        return torch.stack([self.pipe.decode_sound(sound.float()).float() for sound in sounds])

    def pipeline_images(self, output) -> torch.Tensor:
        """The call's frames [F, 3, H, W] (one sample, no batch axis) as ``decode`` gives them: [1, F, 3, H, W]."""
        return output.video[None]

    def pipeline_audio(self, output) -> torch.Tensor | None:
        return output.sound[None] if output.sound is not None else None

    # ------------------------------------------------------------------ config
    @classmethod
    def config_errors(cls, config) -> list[str]:
        sample, errors = config.sample, super().config_errors(config)
        if sample.num_frames < 0:
            errors.append(f"sample.num_frames={sample.num_frames} must be >= 0 (0: the call's 189; 1: an image)")
        if sample.guidance_scale < 1:
            errors.append(f"sample.guidance_scale={sample.guidance_scale} must be >= 1 (1: no guidance; the call "
                          "guides at any other value, the family above 1)")
        return errors + cls.guidance_errors(config)

    def pipeline_kwargs(self, sample_config, pretrained) -> dict:
        """The size, the frames and the sound."""
        return {**self.size_kwargs(), "num_frames": self.frames, "enable_sound": self.sound}
