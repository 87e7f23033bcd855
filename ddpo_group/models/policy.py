"""The policy: load the pipeline, freeze what is not trained, add LoRA (peft) or train the full UNet."""

from __future__ import annotations

import torch
from diffusers import StableDiffusionPipeline
from peft import LoraConfig

from ddpo_group.models import load_pipeline
from ddpo_group.sampling.pipeline import ensure_ddim

LORA_TARGET_MODULES = ["to_k", "to_q", "to_v", "to_out.0"]
DTYPES = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def lora_config(config) -> LoraConfig:
    """The policy's LoRA configuration (also used for the reference adapter)."""
    return LoraConfig(
        r=config.lora_rank, lora_alpha=config.lora_rank, init_lora_weights="gaussian", target_modules=LORA_TARGET_MODULES
    )


def place(module: torch.nn.Module, device, dtype: torch.dtype) -> None:
    """Move to ``device`` and to ``dtype`` when it differs.

    The cast goes through ``torch.nn.Module.to``: diffusers' ``ModelMixin.to`` warns on every dtype cast
    (it would have us load with ``torch_dtype``, which build_policy does; this cast is only for the
    float32 UNet of full fine-tuning under mixed precision).
    """
    module.to(device)
    if module.dtype != dtype:
        torch.nn.Module.to(module, dtype=dtype)


def build_policy(config, device) -> tuple[StableDiffusionPipeline, list[torch.nn.Parameter]]:
    """Load the pipeline on ``device``; return it and the trainable parameters (LoRA or the whole UNet).

    The pipeline is loaded in the mixed-precision dtype (``torch_dtype``): frozen parts (VAE, text
    encoder, and the UNet's base weights under LoRA) stay in it to save memory; trainable parameters
    are float32 (as in ddpo-pytorch). Performance options (config/base.py): ``train.gradient_checkpointing``
    (recompute the UNet's activations in the backward: less memory, about a third more compute) and
    ``unet_channels_last`` (memory format); ``compile_unet`` is applied by the trainer, once the reference
    model (which may copy the UNet or add an adapter to it) is built.
    """
    inference_dtype = DTYPES[config.mixed_precision]
    pipe = ensure_ddim(load_pipeline(config.pretrained.model, revision=config.pretrained.revision or None,
                                     torch_dtype=inference_dtype))
    pipe.set_progress_bar_config(disable=True)
    pipe.vae.requires_grad_(False)
    pipe.text_encoder.requires_grad_(False)
    place(pipe.vae, device, inference_dtype)
    place(pipe.text_encoder, device, inference_dtype)
    unet = pipe.unet
    if config.use_lora:
        unet.requires_grad_(False)
        place(unet, device, inference_dtype)
        unet.add_adapter(lora_config(config))
        for param in unet.parameters():
            if param.requires_grad:
                param.data = param.data.float()
    else:
        unet.requires_grad_(True)
        place(unet, device, torch.float32)
    if config.train.get("gradient_checkpointing", False):
        unet.enable_gradient_checkpointing()
    if config.get("unet_channels_last", False):
        unet.to(memory_format=torch.channels_last)
    trainable = [p for p in unet.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("the policy has no trainable parameters (check use_lora and the UNet's attention modules)")
    return pipe, trainable


def make_optimizer(config, params) -> torch.optim.Optimizer:
    t = config.train
    if t.use_8bit_adam:
        try:
            import bitsandbytes as bnb
        except ImportError as error:
            raise ImportError("train.use_8bit_adam=True needs bitsandbytes: pip install bitsandbytes") from error
        optimizer_cls = bnb.optim.AdamW8bit
    else:
        optimizer_cls = torch.optim.AdamW
    return optimizer_cls(
        params, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2), weight_decay=t.adam_weight_decay, eps=t.adam_epsilon
    )
