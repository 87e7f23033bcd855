"""The model-family seam: what the RL loop needs from one kind of text-to-image model.

Everything outside ``models/families/`` is model-agnostic: the sampler (sampling/trajectories.py), the policy
update, the KL, the rollout, the critic and the evaluation call only these methods. A family wraps a diffusers
pipeline and says:

* what it is: the pipeline class (``model_index.json``'s ``_class_name``), the trained module
  (``model_attribute``: the UNet or the transformer) and its LoRA target modules;
* the condition: ``encode(prompts)`` -> a dict of row-indexed tensors (``cond_keys``: text embeddings, pooled
  embeddings), stored per sample in the batch record; ``condition(prompts,
  metadata)`` is what the loop calls: ``encode`` for text-only families, the prompts with their source images
  (``metadata["image"]``) for an editing family (``capabilities.image_conditioning``), whose ``condition_key`` then names both;
* the negative (unconditional) condition of classifier-free guidance, one rule for every family: a sample's negative
  prompt is its prompt row's ``negative_prompt`` (``metadata["negative_prompt"]``, e.g. from a .jsonl prompt file),
  else the run's ``sample.negative_prompt`` when it is not empty, else the family's own default: its class attribute
  ``negative_prompt`` ("" here, Qwen-Image's " "), encoded, or what the pipeline uses with no negative prompt
  (``default_negative_condition``: SDXL's zeros when ``force_zeros_for_empty_prompt``). A given negative prompt is
  always encoded, as the pipelines do when given ``negative_prompt=``. Without per-row negative prompts the negative
  condition is one row (``negative_condition``, encoded once); when any row of a batch has one, it is one row per
  sample (``negative_rows``: each distinct negative prompt encoded once, alone, and kept), stored in the batch record
  as ``negative_<cond key>`` (sampling/trajectories.py ``NEGATIVE_PREFIX``), which the training forward reads;
* the image size, one rule for every family: ``sample.resolution`` square, or at 0 what the pipeline's own ``__call__``
  samples given none (``default_size``: its ``default_sample_size`` times its VAE factor, or a pipeline's call default
  where it has none); a size the model cannot take (not a multiple of its VAE factor times its patch, beyond its
  position table) refused by name when the family is built, at the run's start (``size_errors``);
* latents and the schedule: ``latent_shape``, ``initial_latents`` (the pipeline's own noise draw),
  ``schedule(num_steps)`` -> row-broadcastable per-step tensors (``time_keys``: timesteps, sigmas), stored per
  sample and step in the batch record (the rollout's values are the ones training reads, never reconstructed);
* the model: ``model_output`` (with guidance as the pipeline does it; a guidance that carries values from a step into
  the next, HunyuanImage 2.1's APG momentum, names them in ``carried_keys``: the sampler calls
  ``model_output_carrying`` and records the values each step starts from with its times), ``step`` (the stochastic
  step with its log-probability, sampling/ddim.py or sampling/flow_steps.py), ``decode``, and its inverse on images,
  ``clean_latents`` (supervised fine-tuning on a folder of images: rollout/image_folder.py), where the family has one;
* the config it reads (``sample.noise_level``, its ``standard_noise_level`` when unset; the guidance of the
  training forward; its own contradictions), and the LoRA export in diffusers format.
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path

import torch

from ddpo_group.errors import ConfigError
from ddpo_group.models.lora_export import unwrap
from ddpo_group.models.source_images import NEGATIVE_PROMPT_KEY, SOURCE_IMAGE_KEY
from ddpo_group.sampling.family import Capabilities
from ddpo_group.sampling.window import stochastic_steps


_IGNORED_IMAGES_WARNED: set[str] = set()  # the families that warned about ignored source images


def warn_ignored_images(family: str) -> None:
    """Warn once per family that it does not read the prompts' source images (``metadata["image"]``)."""
    if family not in _IGNORED_IMAGES_WARNED:
        _IGNORED_IMAGES_WARNED.add(family)
        warnings.warn(f"model family {family!r} generates from the text only: the prompts' source images "
                      "(metadata['image']) are ignored by the model (reward functions still get them); an editing "
                      "family such as flux_kontext reads them. This warning is shown once", UserWarning, stacklevel=3)


def encoder_latents(output) -> torch.Tensor:
    """The latents of a VAE's ``encode`` output: its distribution's mode (AutoencoderKL and the video VAEs), or the
    deterministic ``latent`` of a DC-AE (SANA's), or ``latents``."""
    distribution = getattr(output, "latent_dist", None)
    if distribution is not None:
        return distribution.mode()
    latent = getattr(output, "latent", None)
    return latent if latent is not None else output.latents


MODELS_EXTRA = 'pip install -e ".[models]"'  # setup.py's extra of the families' own needs (torchvision)


def needs_torchvision(what: str, error: ImportError) -> ImportError:
    """The error of a pipeline whose processor (``what``) needs torchvision for its video processor, naming the extra."""
    return ImportError(f"{what} needs torchvision, which is not installed: {MODELS_EXTRA} (torchvision built for your "
                       f"torch); {error}")


def join_flat(*parts: torch.Tensor) -> torch.Tensor:
    """Latents of several shapes (a video's and its audio's, [B, ...] each) as one state [B, N, 1]: their elements, one
    a token (Kandinsky 6's and Cosmos 3's, whose two latents differ in width)."""
    return torch.cat([part.flatten(1) for part in parts], dim=1).unsqueeze(-1)


def split_flat(state: torch.Tensor, *shapes: tuple) -> tuple[torch.Tensor, ...]:
    """``join_flat``'s inverse: the parts [B, *shape] of a state [B, N, 1], in order."""
    n, start, parts = state.shape[0], 0, []
    for shape in shapes:
        size = math.prod(shape)
        parts.append(state[:, start:start + size, 0].reshape(n, *shape))
        start += size
    return tuple(parts)


class ModelFamily:
    name = ""
    pipeline_class = None  # the diffusers pipeline class (set by register_family)
    model_attribute = "unet"  # the pipeline attribute holding the trained module
    lora_target_modules: tuple = ()
    lora_layers_argument = "unet_lora_layers"  # the pipeline's save_lora_weights keyword for the trained module
    lora_key_conversion = True  # convert peft's LoRA key names to diffusers' (as diffusers' own training scripts do)
    # whose save_lora_weights writes the export: the pipeline class, or a loader of its layout (a pipeline without one:
    # diffusers' "transformer." layout, HunyuanVideo's)
    lora_saver = None
    cond_keys: tuple = ("prompt_embeds",)  # the condition's row-indexed tensors (batch record keys)
    time_keys: tuple = ("timesteps",)  # the per-step tensors of the batch record, [B, T]
    # per-row values the guidance carries from a step into the next (HunyuanImage 2.1's APG momentum), recorded per step
    # with the times ([B, T, ...]) so that the training forward reads what the sampler had (``model_output_carrying``)
    carried_keys: tuple = ()
    standard_noise_level: float  # the stochastic steps' noise level when sample.noise_level is None
    no_guidance = 1.0  # the sample.guidance_scale that samples without classifier-free guidance (guided above it)
    guidance_embedded = False  # the guidance scale is an input of every forward (FLUX.1-dev's embedding): no CFG
    guidance_passes: tuple = ()  # the call's guidance keywords beyond the scale that sample.pipeline_guidance may set
    capabilities = Capabilities()  # what its samples have, what its condition reads (sampling/family.py)
    audio_sample_rate = 0  # a family with audio (capabilities.audio): its soundtrack's samples per second
    optional_audio = False  # its soundtrack is sampled when sample.audio is set (Cosmos 3's enable_sound)
    negative_prompt = ""  # the family's default negative prompt (module docstring: the rule of the negative prompt)
    pipeline_max_batch = 0  # the most prompts one call of the pipeline's own __call__ takes (0: any)
    # the dtype the pipeline's call keeps its denoising state in across steps (SANA's, Z-Image's and LTX-2's float32:
    # the model reads a cast copy); None: the model's dtype, every step's x_{n+1} rounded to it (sampling/trajectories.py)
    latents_dtype: torch.dtype | None = None

    def __init__(self, pipe, config):
        """``pipe``: the diffusers pipeline; ``config``: the run's config (config/base.py's fields, whose defaults live
        there only: a caller without a run config passes ``config.base.base()`` or a preset)."""
        if config is None:
            raise TypeError(f"{type(self).__name__} needs the run's config (e.g. config.base.base()), not None")
        self.pipe = pipe
        self.config = config
        self._negative = None
        self._negatives: dict[str, dict] = {}  # the condition of each given negative prompt, on the CPU
        self.check_size()

    # ------------------------------------------------------------------ loading
    @classmethod
    def load_pipeline(cls, path: str, local: bool, revision: str | None, dtype_kwargs: dict):
        """The pipeline from a local directory or a hub id (components the index marks absent stay None)."""
        return cls.pipeline_class.from_pretrained(path, revision=revision or None, local_files_only=local,
                                                  **cls.absent_components(path, local), **dtype_kwargs)

    @classmethod
    def absent_components(cls, path: str, local: bool) -> dict:
        """{name: None} for the components ``model_index.json`` lists as [null, null] (e.g. SD3 without its T5)."""
        index = cls.pipeline_class.load_config(path, local_files_only=local)
        return {name: None for name, value in index.items() if isinstance(value, (list, tuple)) and value[0] is None}

    @property
    def model(self) -> torch.nn.Module:
        """The trained module (the pipeline's UNet or transformer)."""
        return getattr(self.pipe, self.model_attribute)

    def denoisers(self) -> list[torch.nn.Module]:
        """Every denoiser of the pipeline: the trained one and a frozen second expert (Wan 2.2's ``transformer_2``)."""
        return [m for m in (getattr(self.pipe, name, None) for name in ("unet", "transformer", "transformer_2"))
                if isinstance(m, torch.nn.Module)]

    @property
    def device(self) -> torch.device:
        return self.model.device

    # ------------------------------------------------------------------ text
    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    # ------------------------------------------------------------------ the condition of prompts with their metadata
    def condition(self, prompts: list[str], metadata: list[dict] | None = None) -> dict[str, torch.Tensor]:
        """The condition of ``prompts`` with their metadata (one dict per prompt, or None): ``encode(prompts)``; a
        family that takes source images overrides this. A text-only family ignores ``metadata["image"]``, with a
        warning the first time it meets one."""
        if not self.capabilities.image_conditioning and metadata and any(m.get(SOURCE_IMAGE_KEY) for m in metadata):
            warn_ignored_images(self.name)
        return self.encode(prompts)

    def condition_key(self, prompt: str, metadata: dict | None = None):
        """What the condition of one prompt depends on (the text-embedding cache's key): the prompt, and its source
        image paths for a family that takes images."""
        if not self.capabilities.image_conditioning:
            return prompt
        images = (metadata or {}).get(SOURCE_IMAGE_KEY)
        return prompt, tuple(images) if isinstance(images, (list, tuple)) else images

    @property
    def run_negative_prompt(self) -> str:
        """The negative prompt of the rows that give none: ``sample.negative_prompt``, or the family's own default."""
        chosen = self.config.sample.negative_prompt
        return chosen or self.negative_prompt

    def encode_negative(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Negative prompts encoded as the pipeline encodes a negative prompt: ``encode`` (SANA encodes its prompts after
        an instruction and its negative prompts without one)."""
        return self.encode(prompts)

    def default_negative_condition(self) -> dict[str, torch.Tensor]:
        """The family's own unconditional condition, one row: its ``negative_prompt`` encoded (SDXL: zeros when the
        pipeline forces them for the empty prompt)."""
        return self.encode_negative([self.negative_prompt])

    def negative_condition(self) -> dict[str, torch.Tensor]:
        """The run's unconditional condition, one row, encoded once: ``sample.negative_prompt`` encoded when it is
        set, else ``default_negative_condition()`` (module docstring)."""
        if self._negative is None:
            chosen = self.config.sample.negative_prompt
            self._negative = self.encode_negative([chosen]) if chosen else self.default_negative_condition()
        return self._negative

    def negative_rows(self, metadata: list[dict] | None) -> dict[str, torch.Tensor] | None:
        """The negative condition of each row (``metadata[i]["negative_prompt"]``, or the run's
        ``negative_condition()`` for a row without one), or None when no row has one (the one-row
        ``negative_condition()`` then serves them all). Each distinct negative prompt is encoded once, alone (its
        rows do not depend on the batch), and kept on the CPU."""
        texts = [(m or {}).get(NEGATIVE_PROMPT_KEY) for m in (metadata or [])]
        if all(text is None for text in texts):
            return None
        default = self.negative_condition()
        rows = []
        for text in texts:
            if text is None:
                rows.append(default)
                continue
            if text not in self._negatives:
                self._negatives[text] = {k: v.cpu() for k, v in self.encode_negative([text]).items()}
            rows.append(self._negatives[text])
        return {key: torch.cat([row[key].to(default[key].device) for row in rows]) for key in default}

    def negative_for(self, metadata: list[dict] | None) -> dict[str, torch.Tensor]:
        """The negative condition of a batch of rows: per row (``negative_rows``) when any has a negative prompt, else
        the run's one row."""
        rows = self.negative_rows(metadata)
        return rows if rows is not None else self.negative_condition()

    def text_embeds(self, cond: dict) -> torch.Tensor:
        """The critic's text input of a condition's rows, [B, L, D] (or [B, L, K, D]): its ``prompt_embeds``."""
        return cond["prompt_embeds"]

    @property
    def text_dim(self) -> int:
        """The width of ``text_embeds`` (the critic's text input)."""
        return int(self.text_embeds(self.negative_condition()).shape[-1])

    # ------------------------------------------------------------------ latents, schedule, model, step
    def latent_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def state_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the sampler's state x_n: ``latents_dtype``, else the model's ``model_dtype``."""
        return self.latents_dtype or model_dtype

    def initial_latents(self, batch: int, generator, device, dtype, initial_noise=None) -> torch.Tensor:
        """The initial noise x_0 of ``batch`` samples: ``initial_noise`` (checked against latent_shape) or noise drawn as
        the pipeline draws it, times the scheduler's init_noise_sigma (DDIM's; flow-matching schedulers have none: 1)."""
        shape = (batch, *self.latent_shape())
        if initial_noise is None:
            latents = self.draw_noise(batch, generator, device, dtype)
        elif tuple(initial_noise.shape) != shape:
            raise ValueError(f"initial_noise has shape {tuple(initial_noise.shape)}; the sampler needs {shape}")
        else:
            latents = initial_noise.to(device, dtype)
        scale = getattr(self.pipe.scheduler, "init_noise_sigma", 1.0)
        return latents * scale if scale != 1.0 else latents

    def draw_noise(self, batch: int, generator, device, dtype) -> torch.Tensor:
        """Fresh initial noise [batch, *latent_shape()], drawn as the family's pipeline draws it."""
        raise NotImplementedError

    def schedule(self, num_steps: int, device) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def model_output(self, model, latents, times: dict, cond: dict, negative: dict, guidance_scale: float):
        raise NotImplementedError

    def initial_carried(self, latents: torch.Tensor) -> dict[str, torch.Tensor]:
        """The ``carried_keys``' values before the first step ({} for a family whose guidance carries nothing)."""
        return {}

    def model_output_carrying(self, model, latents, times: dict, cond: dict, negative: dict, guidance_scale: float):
        """(``model_output``, the ``carried_keys``' values after this step): the sampler's call, ``times`` holding the
        values carried into the step. A family whose guidance carries nothing carries {}."""
        return self.model_output(model, latents, times, cond, negative, guidance_scale), {}

    def step(self, model_output, latents, times: dict, noise_level: float, next_latents=None, generator=None,
             compute_log_prob: bool = True, reduce: str = "mean", log_prob_dtype: str = "float32"):
        raise NotImplementedError

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Final latents -> images [B, 3, H, W] in [0, 1] (float32); a video family's frames [B, F, 3, H, W] (the rewards
        score them: rewards/base.py's ``scores_frames``; the grids show frame strips)."""
        raise NotImplementedError

    def clean_latents(self, images: torch.Tensor) -> torch.Tensor:
        """Images [B, 3, H, W] in [0, 1] at ``height_width`` -> the clean state x_clean whose ``decode`` they are: the
        VAE encoder's mean (``vae_latents``) scaled and packed as ``decode`` unpacks and unscales it, float32. The
        target of supervised fine-tuning on a folder of images (rollout/image_folder.py). Not every family has one
        (``encodes_images``)."""
        raise NotImplementedError(f"model family {self.name!r} does not encode images into its state")

    @classmethod
    def encodes_images(cls) -> bool:
        """Whether the family has ``clean_latents``."""
        return cls.clean_latents is not ModelFamily.clean_latents

    def vae_latents(self, images: torch.Tensor, frame_axis: bool = False) -> torch.Tensor:
        """The VAE encoder's mean (its distribution's mode, as the pipelines encode source images) of images in [0, 1],
        float32; ``frame_axis``: a video VAE's input [B, 3, 1, H, W] (Qwen-Image's)."""
        vae = self.pipe.vae
        # a VAE that overflows in float16 (force_upcast: SD's, SDXL's) encodes in float32, as the img2img pipelines do
        upcast = vae.dtype == torch.float16 and getattr(vae.config, "force_upcast", False)
        dtype = torch.float32 if upcast else vae.dtype
        pixels = (images * 2 - 1).to(vae.device, dtype)
        if getattr(vae.config, "in_channels", 3) == 4:  # an RGBA VAE (Qwen-Image 2.1): opaque images
            pixels = torch.cat([pixels, torch.ones_like(pixels[:, :1])], dim=1)
        if frame_axis:
            pixels = pixels.unsqueeze(2)
        try:
            if upcast:
                torch.nn.Module.to(vae, dtype=torch.float32)
            with torch.no_grad():
                return encoder_latents(vae.encode(pixels)).float()
        finally:
            if upcast:
                torch.nn.Module.to(vae, dtype=torch.float16)

    def decode_audio(self, latents: torch.Tensor) -> torch.Tensor:
        """Final latents -> their soundtrack [B, channels, samples] float32 at ``audio_sample_rate`` Hz: a family whose
        ``capabilities.audio`` says it has one."""
        raise NotImplementedError(f"model family {self.name!r} makes no audio (its capabilities.audio is False)")

    # ------------------------------------------------------------------ what it reads from the config
    @classmethod
    def noise_level(cls, sample_config) -> float:
        """The stochastic steps' noise level: ``sample.noise_level``, or the family's standard one when it is None."""
        level = sample_config.noise_level
        return cls.standard_noise_level if level is None else float(level)

    # ------------------------------------------------------------------ image size: one rule for every family
    # A family samples sample.resolution square pixels, or at 0 the size the pipeline's own __call__ samples when given
    # none (``default_size``); a size the model cannot take is refused when the family is built (``check_size``).
    patch_size = 1  # the denoiser's patch side in latent pixels (the packing families: 2 x 2 latent pixels a token)

    def default_size(self) -> tuple[int, int]:
        """(height, width) in pixels of the pipeline's own ``__call__`` given no size: its ``default_sample_size``
        times its VAE factor. A family whose pipeline has no ``default_sample_size`` (Z-Image, Wan) says its call's
        default."""
        side = self.pipe.default_sample_size * self.pipe.vae_scale_factor
        return side, side

    @property
    def height_width(self) -> tuple[int, int]:
        """(height, width) in pixels: ``sample.resolution`` square, or ``default_size()`` at 0."""
        chosen = int(self.config.sample.resolution)
        return (chosen, chosen) if chosen else self.default_size()

    @property
    def resolution(self) -> int:
        """Image height = width in pixels, for the families that sample squares: ``height_width``'s side."""
        return self.height_width[0]

    def size_multiple(self) -> int:
        """What the height and width must be multiples of: the VAE's factor times ``patch_size``."""
        return self.pipe.vae_scale_factor * self.patch_size

    def position_limit(self) -> tuple[int, str] | None:
        """(the most patches a side the denoiser's position table holds, what sets it), or None when positions are
        computed for any size (FLUX's RoPE from the ids)."""
        return None

    def size_errors(self) -> list[str]:
        """The height and width against the model: a multiple of ``size_multiple()``, within ``position_limit()``;
        each message names ``sample.resolution`` (its pipeline default when 0) and what the model takes."""
        height, width = self.height_width
        chosen = int(self.config.sample.resolution)
        field = (f"sample.resolution={chosen}" if chosen else
                 f"sample.resolution=0 (the pipeline's default, {height} x {width} px)")
        multiple, errors = self.size_multiple(), []
        if height % multiple or width % multiple:
            errors.append(f"{field} is not a multiple of {multiple} px (this model's VAE factor times its patch): set "
                          f"sample.resolution to a multiple of {multiple}")
            return errors
        limit = self.position_limit()
        if limit is not None and max(height, width) // multiple > limit[0]:
            most = limit[0] * multiple
            errors.append(f"{field} is {max(height, width) // multiple} patches of {multiple} px a side, beyond this "
                          f"model's position table ({limit[1]}: {limit[0]} patches a side, {most} px): set "
                          f"sample.resolution to a multiple of {multiple} up to {most}")
        return errors

    def check_size(self) -> None:
        """Raise ConfigError (a usage error at start, before the first batch) when the model cannot take the size."""
        errors = self.size_errors()
        if errors:
            raise ConfigError(f"the {self.name} model cannot sample this size:\n  - " + "\n  - ".join(errors))

    @staticmethod
    def resolution_errors(sample_config) -> list[str]:
        resolution = sample_config.resolution
        return [f"sample.resolution={resolution} must be >= 0 (0: the pipeline's default)"] if resolution < 0 else []

    def frame_errors(self, temporal: int, factor: str) -> list[str]:
        """A video family's frames (``frames``: ``sample.num_frames`` or the call's) must be 1 more than a multiple
        of ``temporal``, the ``factor`` its VAE compresses time by."""
        if not (self.frames - 1) % temporal:
            return []
        chosen = int(self.config.sample.num_frames)
        field = f"sample.num_frames={chosen}" if chosen else f"sample.num_frames=0 (the call's {self.frames})"
        return [f"{field} must be 1 more than a multiple of {temporal} ({factor})"]

    def video_latent_shape(self) -> tuple:
        """[C, F', H', W'] of a video VAE's latent (``latent_channels``; its pipeline's ``vae_scale_factor_temporal``
        and ``_spatial``): Wan's and HunyuanVideo 1.5's."""
        pipe, (height, width) = self.pipe, self.height_width
        return (self.latent_channels, (self.frames - 1) // pipe.vae_scale_factor_temporal + 1,
                height // pipe.vae_scale_factor_spatial, width // pipe.vae_scale_factor_spatial)

    def video_noise(self, batch: int, generator, device, dtype) -> torch.Tensor:
        """x_0 of a video family whose pipeline draws it with ``prepare_latents(batch, channels, height, width, frames,
        float32, ...)`` (Wan's, SANA-Video's), in ``dtype``."""
        height, width = self.height_width
        latents = self.pipe.prepare_latents(batch, self.latent_channels, height, width, self.frames, torch.float32,
                                            device, generator)
        return latents.to(dtype)

    def size_kwargs(self) -> dict:
        """The pipeline's ``height`` and ``width``: the family's (its default named, so that the pipeline's own
        ``__call__`` samples what the sampler samples whatever its own default depends on)."""
        height, width = self.height_width
        return {"height": height, "width": width}

    def training_guidance(self, config) -> float:
        """The guidance scale of the training forward: the sampling one when guidance is in the forward (train.cfg, or
        an embedded guidance scale), else the family's ``no_guidance``."""
        if self.guidance_embedded or config.train.cfg:
            return config.sample.guidance_scale
        return self.no_guidance

    @classmethod
    def guidance_errors(cls, config) -> list[str]:
        """``train.cfg`` against ``sample.guidance_scale``: the training forward must guide exactly when sampling did
        (guidance_scale > ``no_guidance``), or the recomputed log-probs are off-policy; an embedded guidance scale is
        in every forward, so train.cfg has no effect there."""
        sample, train = config.sample, config.train
        if cls.guidance_embedded or bool(train.cfg) == (sample.guidance_scale > cls.no_guidance):
            return []
        return [f"train.cfg={train.cfg} contradicts sample.guidance_scale={sample.guidance_scale}: the {cls.name} family guides "
                f"exactly when guidance_scale > {cls.no_guidance:g}, and the training forward must guide exactly when "
                "sampling did, or the recomputed log-probs are off-policy"]

    def deterministic_steps(self, sample_config) -> torch.Tensor:
        """[T] bool: steps without noise at this noise level whatever the window (none by default)."""
        return torch.zeros(sample_config.num_steps, dtype=torch.bool)

    def stochastic_steps(self, sample_config) -> torch.Tensor:
        """[T] bool: the steps that draw noise and are trained (the SDE window, without deterministic steps)."""
        return stochastic_steps(sample_config) & ~self.deterministic_steps(sample_config)

    def noise_levels(self, sample_config) -> list[float]:
        """The noise level of each sampling step: the configured one on stochastic steps, 0 elsewhere."""
        level = self.noise_level(sample_config)
        return [level if inside else 0.0 for inside in self.stochastic_steps(sample_config).tolist()]

    def check_trainable(self, sample_config) -> None:
        """Raise ValueError when a stochastic step has no log-probability (a zero std)."""

    @classmethod
    def config_errors(cls, config) -> list[str]:
        """Contradictions of the sampling fields this family reads."""
        return []

    # ------------------------------------------------------------------ LoRA
    @classmethod
    def save_lora(cls, model, directory: str | os.PathLike, adapter_name: str = "default") -> Path:
        """Write ``model``'s LoRA adapter in diffusers format (``Pipeline.load_lora_weights`` loads it)."""
        from diffusers.utils import convert_state_dict_to_diffusers
        from peft.utils import get_peft_model_state_dict

        model = unwrap(model)
        if adapter_name not in getattr(model, "peft_config", {}):
            raise ValueError(f"the {cls.model_attribute} has no LoRA adapter {adapter_name!r} to export (use_lora=False?)")
        state = get_peft_model_state_dict(model, adapter_name=adapter_name)
        state = {k: v.detach().float().cpu().contiguous() for k, v in state.items()}
        if cls.lora_key_conversion:  # the UNet loader reads diffusers' own key names; the transformers' read peft's
            state = convert_state_dict_to_diffusers(state)
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        prefix = cls.lora_layers_argument.removesuffix("_lora_layers")
        saver = cls.lora_saver or cls.pipeline_class
        if not hasattr(saver, "save_lora_weights"):  # a pipeline without a LoRA loader: "transformer." keys, which its
            from diffusers.loaders import HunyuanVideoLoraLoaderMixin as saver  # transformer loads (``load_lora``)
        saver.save_lora_weights(
            save_directory=str(directory), safe_serialization=True, **{cls.lora_layers_argument: state},
            **{f"{prefix}_lora_adapter_metadata": model.peft_config[adapter_name].to_dict()},
        )
        return directory

    def prepare_pipeline(self, pipe) -> None:
        """Give a pipeline of this family what the run sets that the pipeline holds itself instead of taking it in its
        call (HunyuanVideo 1.5's guider scale); nothing by default. The family's own pipeline is prepared already."""

    @staticmethod
    def load_lora(pipe, directory, adapter_name: str | None = None) -> None:
        """An exported adapter (``save_lora``) into ``pipe``: its own ``load_lora_weights`` (``adapter_name``: the
        adapter's name in the denoiser; None: diffusers' own); a pipeline without a LoRA loader (HunyuanVideo 1.5's,
        Kandinsky 6's) has the export's "transformer." keys loaded by its transformer's ``load_lora_adapter``."""
        if hasattr(pipe, "load_lora_weights"):
            pipe.load_lora_weights(str(directory), adapter_name=adapter_name)
            return
        pipe.transformer.load_lora_adapter(str(directory), prefix="transformer", adapter_name=adapter_name,
                                           weight_name="pytorch_lora_weights.safetensors")

    def pipeline_kwargs(self, sample_config, pretrained) -> dict:
        """Extra keywords of the pipeline's own ``__call__`` (evaluation) for images like the sampler's, from the run's
        ``sample`` and ``pretrained`` config sections."""
        return {}

    def guidance_kwargs(self, guidance_scale: float) -> dict:
        """The keywords giving the pipeline's own ``__call__`` a guidance scale: ``guidance_scale=`` (Qwen-Image 2.1's
        call names it ``true_cfg_scale``; HunyuanVideo 1.5's has none: its guider component holds the scale)."""
        return {"guidance_scale": guidance_scale}

    def pipeline_images(self, output) -> torch.Tensor:
        """The images of the pipeline's own ``__call__`` (``output_type="pt"``) as ``decode`` gives them: a video's
        frames, else its images."""
        return output.frames if self.capabilities.video else output.images

    def pipeline_audio(self, output) -> torch.Tensor | None:
        """The soundtrack of the pipeline's own ``__call__`` as ``decode_audio`` gives it, [B, channels, samples] (its
        ``output.audio``), or None for a pipeline without audio."""
        return output.audio if hasattr(output, "audio") else None

    def pipeline_row_kwargs(self, metadata: list[dict]) -> dict:
        """Keywords of the pipeline's own ``__call__`` for a call's rows (their metadata) beyond the prompts: the
        rows' negative prompts (``negative_prompt=``, a list: each row's, ``run_negative_prompt`` for the others) when
        any row has one and the pipeline takes them; an editing family's source images."""
        return self.negative_prompt_kwargs(metadata)

    def negative_prompt_kwargs(self, metadata: list[dict]) -> dict:
        """``{"negative_prompt": [one per row]}`` when a row of ``metadata`` has a negative prompt or
        ``sample.negative_prompt`` is set, and the pipeline's ``__call__`` takes one, else {}. (SDXL's rows without one then get the encoded empty prompt, not the zeros
        of ``force_zeros_for_empty_prompt``: the pipeline zeroes only when given no negative prompt at all.)"""
        texts = [(m or {}).get(NEGATIVE_PROMPT_KEY) for m in metadata]
        chosen = self.config.sample.negative_prompt
        if (all(text is None for text in texts) and not chosen) or not self.pipeline_takes_negative_prompt():
            return {}
        return {"negative_prompt": [self.run_negative_prompt if text is None else text for text in texts]}

    @classmethod
    def pipeline_takes_negative_prompt(cls) -> bool:
        import inspect

        return "negative_prompt" in inspect.signature(cls.pipeline_class.__call__).parameters
