"""The model seam as the layers above the models use it: ``Family``, the members of a model family that sampling,
the rollouts and the update call (models/families/base.py's ModelFamily implements them, one subclass a family), and
``Capabilities``: what a family's samples have and what its condition reads, declared by the family's class (never
probed): code that handles a capability reads ``family.capabilities``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class Capabilities:
    """What a family's samples and condition hold beyond a text-conditioned image."""

    video: bool = False  # the samples are videos: images [B, F, 3, H, W] (sample.num_frames)
    audio: bool = False  # the samples have a soundtrack: decode_audio(final latents), audio_sample_rate
    image_conditioning: bool = False  # the condition reads each prompt's source images (metadata["image"]: editing)
    second_transformer: bool = False  # some steps run a second denoiser that is not trained (Wan2.2-A14B's expert)


@runtime_checkable
class Family(Protocol):
    """A model family as sampling/, rollout/ and update/ use it (models/families/base.py: the rules behind each)."""

    name: str
    capabilities: Capabilities
    cond_keys: tuple  # the condition's row-indexed tensors (the batch record's cond)
    time_keys: tuple  # the per-step tensors of the batch record, [B, T] each
    carried_keys: tuple  # per-row values the guidance carries from a step into the next, recorded per step
    no_guidance: float  # the guidance scale that samples without classifier-free guidance
    guidance_embedded: bool  # the guidance scale is an input of every forward (no CFG)
    audio_sample_rate: int  # a family with audio: the soundtrack's samples per second

    @property
    def model(self) -> torch.nn.Module: ...  # the trained denoiser

    @property
    def device(self) -> torch.device: ...

    def latent_shape(self) -> tuple: ...

    def condition(self, prompts: list[str], metadata: list[dict] | None = None) -> dict: ...

    def condition_key(self, prompt: str, metadata: dict | None = None): ...

    def negative_condition(self) -> dict: ...

    def negative_rows(self, metadata: list[dict] | None) -> dict | None: ...

    def schedule(self, num_steps: int, device) -> dict: ...

    def state_dtype(self, model_dtype: torch.dtype) -> torch.dtype: ...  # the sampler's state: the pipeline's

    def initial_latents(self, batch: int, generator, device, dtype, initial_noise=None) -> torch.Tensor: ...

    def model_output(self, model, latents, times: dict, cond: dict, negative: dict, guidance_scale: float): ...

    def initial_carried(self, latents: torch.Tensor) -> dict: ...  # the guidance's carried values before step 0

    def model_output_carrying(self, model, latents, times: dict, cond: dict, negative: dict,
                              guidance_scale: float): ...  # (model_output, the carried values after the step)

    def step(self, model_output, latents, times: dict, noise_level: float, next_latents=None, generator=None,
             compute_log_prob: bool = True, reduce: str = "mean", log_prob_dtype: str = "float32"): ...

    def decode(self, latents: torch.Tensor) -> torch.Tensor: ...

    def decode_audio(self, latents: torch.Tensor) -> torch.Tensor: ...  # capabilities.audio only

    def noise_level(self, sample_config) -> float: ...

    def noise_levels(self, sample_config) -> list[float]: ...

    def stochastic_steps(self, sample_config) -> torch.Tensor: ...

    def training_guidance(self, config) -> float: ...
