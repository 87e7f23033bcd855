"""What the flow-matching families (all but sd and sdxl) share: the sigma schedule, the stochastic step, their config.

    schedule    the pipeline's own: FlowMatchEulerDiscreteScheduler.set_timesteps with the pipeline's sigmas and
                shift (``schedule_kwargs``); recorded per step: timesteps (0..1000, what the transformer reads),
                sigmas s and next_sigmas s_next (what the step reads; never reconstructed from the timesteps)
    step        sampling/flow_steps.py: ``sample.sde_type`` (flow_sde, cps, dance_sde) at ``sample.noise_level``; at noise
                level 0 the pipeline's Euler step x + v (s_next - s)
    images      ``sample.resolution`` pixels square (0: the pipeline's default; models/families/base.py's size rule)
"""

from __future__ import annotations

import logging
import warnings

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from ddpo_group.models.families.base import ModelFamily
from ddpo_group.models.families.sd import warn_long_prompts
from ddpo_group.sampling.flow_steps import SDE_REGISTRY, flow_step_with_logprob


def sequence_length(pretrained) -> int | None:
    """``pretrained.max_sequence_length`` (the config section), or the model's default T5
    token count, or None for the pipeline's default."""
    from ddpo_group.models import default_max_sequence_length

    chosen = int(pretrained.max_sequence_length)
    return chosen or default_max_sequence_length(pretrained.model) or None


_SWAPS_STATED: set[tuple] = set()  # the (family, scheduler, shift) swaps already stated in this process


def flow_euler_scheduler(scheduler, family: str):
    """The flow Euler scheduler in place of a checkpoint's multistep flow solver (Wan's UniPC, SANA's DPM-Solver++),
    whose step reads the previous steps' outputs and so is no one-step policy: ``FlowMatchEulerDiscreteScheduler`` of
    the checkpoint's own ``flow_shift`` and number of training timesteps, stated once as a warning (the checkpoint's
    pipeline as released samples with its own solver). ``scheduler`` itself when it is already one. A scheduler that is
    no flow solver (``use_flow_sigmas`` off or a prediction type other than ``flow_prediction``), or without a
    positive ``flow_shift``, is refused by name: no shift is assumed."""
    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        return scheduler
    config, name = scheduler.config, type(scheduler).__name__
    shift = config.get("flow_shift")
    if not config.get("use_flow_sigmas") or config.get("prediction_type") != "flow_prediction":
        raise ValueError(f"the {family} family samples on flow sigmas, and this checkpoint's {name} has "
                         f"use_flow_sigmas={config.get('use_flow_sigmas')!r}, "
                         f"prediction_type={config.get('prediction_type')!r}; supported: FlowMatchEulerDiscreteScheduler, "
                         "or a multistep solver with use_flow_sigmas=True and prediction_type='flow_prediction'")
    if not isinstance(shift, (int, float)) or shift <= 0:
        raise ValueError(f"this checkpoint's {name} has flow_shift={shift!r}; the {family} family swaps it for the flow "
                         "Euler scheduler of the same shift and assumes none: set flow_shift (> 0) in its "
                         "scheduler_config.json")
    if (family, name, shift) not in _SWAPS_STATED:
        _SWAPS_STATED.add((family, name, shift))
        warnings.warn(f"the {family} family samples (training and evaluation alike) with FlowMatchEulerDiscreteScheduler"
                      f"(shift={shift:g}) in place of this checkpoint's {name} (flow_shift={shift:g}), a multistep "
                      "solver whose step is no one-step policy: the pipeline as released samples another trajectory "
                      "for the same noise", UserWarning, stacklevel=3)
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=config.num_train_timesteps, shift=shift)


class FlowMatchingFamily(ModelFamily):
    model_attribute = "transformer"
    lora_layers_argument = "transformer_lora_layers"
    lora_key_conversion = False  # diffusers' SD3 / FLUX LoRA scripts save peft's state dict as it is
    patch_size = 2  # the packing pipelines' 2 x 2 latent pixels a token (SD3: its transformer's patch)
    time_keys = ("timesteps", "sigmas", "next_sigmas")
    standard_noise_level = 0.7  # Flow-GRPO's on SD3.5
    # the attention projections of the joint (image + text) blocks: Flow-GRPO's and DanceGRPO's LoRA targets
    lora_target_modules = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                           "attn.add_v_proj", "attn.to_add_out")

    @property
    def max_sequence_length(self) -> int | None:
        """T5 tokens per prompt: ``pretrained.max_sequence_length``, else the model's default (the embedded flow
        model's), else None (the pipeline's default)."""
        return sequence_length(self.config.pretrained)

    @property
    def sde_type(self) -> str:
        return self.config.sample.sde_type

    def schedule_kwargs(self, num_steps: int) -> dict:
        """Keywords of ``scheduler.set_timesteps`` exactly as the pipeline passes them (sigmas, mu)."""
        return {}

    def schedule(self, num_steps: int, device) -> dict:
        scheduler = self.pipe.scheduler
        scheduler.set_timesteps(num_steps, device=device, **self.schedule_kwargs(num_steps))
        sigmas = scheduler.sigmas.to(device)
        return {"timesteps": scheduler.timesteps, "sigmas": sigmas[:-1], "next_sigmas": sigmas[1:]}

    def step(self, model_output, latents, times, noise_level, next_latents=None, generator=None, compute_log_prob=True,
             reduce="mean", log_prob_dtype="float32"):
        return flow_step_with_logprob(self.sde_type, model_output, latents, times["sigmas"], times["next_sigmas"],
                                      noise_level, next_latents=next_latents, generator=generator,
                                      compute_log_prob=compute_log_prob, reduce=reduce, log_prob_dtype=log_prob_dtype)

    def deterministic_steps(self, sample_config) -> torch.Tensor:
        """CPS has std = s_next sin(a pi / 2) = 0 on the last step (s_next = 0): that step is never stochastic."""
        steps = torch.zeros(sample_config.num_steps, dtype=torch.bool)
        if sample_config.sde_type == "cps":
            steps[-1] = True
        return steps

    def check_trainable(self, sample_config) -> None:
        if not self.stochastic_steps(sample_config).any():
            raise ValueError(f"sample.sde_type={sample_config.sde_type!r} with this SDE window leaves no stochastic step "
                             "(cps's last step is deterministic): widen sample.sde_window_size")

    @classmethod
    def config_errors(cls, config) -> list[str]:
        sample, errors = config.sample, []
        if sample.sde_type not in SDE_REGISTRY:
            errors.append(f"sample.sde_type={sample.sde_type!r} must be one of {SDE_REGISTRY.names()}")
        if not cls.noise_level(sample) > 0:
            errors.append(f"sample.noise_level={sample.noise_level} must be > 0: with 0 every step is the "
                          "deterministic Euler step and has no log-probability")
        return errors + cls.resolution_errors(sample)

    def pipeline_kwargs(self, sample_config, pretrained) -> dict:
        """The pipeline's own sampler is the deterministic Euler one (noise level 0): only the size and the tokens."""
        kwargs = self.size_kwargs()
        tokens = sequence_length(pretrained)
        if tokens:
            kwargs["max_sequence_length"] = tokens
        return kwargs

    def text_encoder_device(self) -> torch.device:
        return self.pipe.text_encoder.device

    def encode_quietly(self, prompts: list[str], **kwargs):
        """The pipeline's ``encode_prompt``, its per-call truncation log silenced: long prompts warn once, here."""
        for tokenizer in (self.pipe.tokenizer, getattr(self.pipe, "tokenizer_2", None)):
            if tokenizer is not None and tokenizer.__class__.__name__.startswith("CLIP"):
                warn_long_prompts(tokenizer, prompts)
        logger = logging.getLogger(type(self.pipe).__module__)
        level = logger.level
        logger.setLevel(logging.ERROR)
        try:
            return self.pipe.encode_prompt(prompt=prompts, device=self.text_encoder_device(), **kwargs)
        finally:
            logger.setLevel(level)
