"""The policy: load the model family's pipeline, freeze what is not trained, add LoRA (peft) or train the full
denoiser (the UNet or the transformer)."""

from __future__ import annotations

import itertools

import torch
import torch.utils.checkpoint
from peft import LoraConfig

from ddpo_group.models import load_family

DTYPES = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")


def lora_config(config, target_modules, dropout: float = 0.0) -> LoraConfig:
    """The policy's LoRA configuration (also used for the reference adapter): rank ``lora_rank``, scale
    ``lora_alpha / lora_rank`` (``lora_alpha`` 0: equal to the rank), on the family's attention projections;
    ``dropout`` on the adapter's input in training mode (the policy's: ``lora_dropout``)."""
    alpha = config.lora_alpha or config.lora_rank
    return LoraConfig(r=config.lora_rank, lora_alpha=alpha, init_lora_weights="gaussian",
                      target_modules=list(target_modules), lora_dropout=dropout)


def place(module: torch.nn.Module, device, dtype: torch.dtype) -> None:
    """Move to ``device`` when a weight or buffer is elsewhere, and to ``dtype`` when it differs.

    The cast goes through ``torch.nn.Module.to``: diffusers' ``ModelMixin.to`` warns on every dtype cast
    (it would have us load with ``torch_dtype``, which build_policy does; this cast is only for the
    float32 UNet of full fine-tuning under mixed precision). A module already in place is left alone: the
    memory trace's fake weights (update/memory_trace.py) cannot be moved onto the device they are on.
    """
    target = torch.device(device)
    if any(t.device.type != target.type or (target.index is not None and t.device.index != target.index)
           for t in itertools.chain(module.parameters(), module.buffers())):
        module.to(target)
    if module.dtype != dtype:
        torch.nn.Module.to(module, dtype=dtype)


def checkpointed(module, *args, **kwargs):
    """One block's forward, its activations recomputed in the backward (torch's non-reentrant checkpoint), keyword
    arguments passed on: diffusers' own checkpointing function takes positional ones only, and HunyuanImage 2.1's
    transformer calls it with ``attention_mask=``."""
    return torch.utils.checkpoint.checkpoint(module, *args, use_reentrant=False, **kwargs)


def enable_checkpointing(model) -> None:
    """Gradient checkpointing of the denoiser's blocks (``train.gradient_checkpointing``, or the auto-fit's)."""
    model.enable_gradient_checkpointing(checkpointed)


def build_policy(config, device) -> tuple:
    """Load the model family (its pipeline) on ``device``; return it and the trainable parameters (LoRA or the whole
    denoiser).

    The pipeline is loaded in the mixed-precision dtype: frozen parts (VAE, text encoders, and the denoiser's base
    weights under LoRA) stay in it to save memory; trainable parameters are float32 (as in ddpo-pytorch). The text
    encoders run on ``pretrained.text_encoder_device`` ("cpu" keeps them off the GPU; their embeddings move to the
    device). Performance options (config/base.py): ``train.gradient_checkpointing`` (recompute the denoiser's
    activations in the backward: less memory, about a third more compute) and ``unet_channels_last`` (memory
    format, for UNets); ``compile_denoiser`` (the denoiser, UNet or transformer) is applied by the trainer, once the
    reference model (which may copy the denoiser or add an adapter to it) is built.
    """
    pretrained = config.pretrained
    family = load_family(pretrained.model, revision=pretrained.revision or None,
                         torch_dtype=DTYPES[config.mixed_precision], family=pretrained.family, config=config)
    return family, make_trainable(family, config, device)


def make_trainable(family, config, device) -> list:
    """Place a loaded family's modules on ``device`` (the text encoders on ``pretrained.text_encoder_device``), freeze
    what is not trained and return the trainable parameters (``build_policy``'s second half; the memory trace's
    whole, update/memory_trace.py)."""
    inference_dtype = DTYPES[config.mixed_precision]
    pretrained = config.pretrained
    pipe = family.pipe
    pipe.set_progress_bar_config(disable=True)
    text_device = pretrained.text_encoder_device or device
    for name, module in _frozen(family):
        module.requires_grad_(False)
        place(module, text_device if name in TEXT_ENCODERS else device, inference_dtype)
    model = family.model
    if config.use_lora:
        model.requires_grad_(False)
        place(model, device, inference_dtype)
        model.add_adapter(lora_config(config, family.lora_target_modules, dropout=config.lora_dropout))
        for param in model.parameters():
            if param.requires_grad:
                param.data = param.data.float()
    else:
        model.requires_grad_(True)
        place(model, device, torch.float32)
    if config.train.gradient_checkpointing:
        enable_checkpointing(model)
    if config.unet_channels_last and family.model_attribute == "unet":  # convolutions' memory format
        model.to(memory_format=torch.channels_last)
    trainable = [q for q in model.parameters() if q.requires_grad]
    if not trainable:
        raise ValueError(f"the policy has no trainable parameters (check use_lora and the {family.model_attribute}'s "
                         f"modules {list(family.lora_target_modules)})")
    return trainable


def _frozen(family) -> list:
    """(pipeline attribute, module) of every frozen module, in the pipeline's order."""
    return [(name, module) for name, module in family.pipe.components.items()
            if isinstance(module, torch.nn.Module) and module is not family.model]


def optimizer_settings(config) -> dict:
    """{optimizer keyword: (its value, the config fields it comes from)} of the policy's AdamW."""
    train = config.train
    return {"lr": (train.learning_rate, "train.learning_rate"),
            "betas": ((train.adam_beta1, train.adam_beta2), "train.adam_beta1, train.adam_beta2"),
            "weight_decay": (train.adam_weight_decay, "train.adam_weight_decay"),
            "eps": (train.adam_epsilon, "train.adam_epsilon")}


def make_optimizer(config, params) -> torch.optim.Optimizer:
    if config.train.use_8bit_adam:
        try:
            import bitsandbytes as bnb
        except ImportError as error:
            raise ImportError("train.use_8bit_adam=True needs bitsandbytes: pip install bitsandbytes") from error
        optimizer_cls = bnb.optim.AdamW8bit
    else:
        optimizer_cls = torch.optim.AdamW
    return optimizer_cls(params, **{key: value for key, (value, _) in optimizer_settings(config).items()})


def apply_settings(optimizer, settings: dict) -> list[str]:
    """Set ``settings`` ({keyword: (value, config fields)}) on every parameter group of a resumed ``optimizer`` (its
    groups come back from the checkpoint with the settings it was saved with) and say each one that changed."""
    changed = []
    for key, (value, fields) in settings.items():
        saved = {tuple(group[key]) if isinstance(group[key], (list, tuple)) else group[key]
                 for group in optimizer.param_groups}
        want = tuple(value) if isinstance(value, (list, tuple)) else value
        if saved != {want}:
            for group in optimizer.param_groups:
                group[key] = want
            before = ", ".join(str(v) for v in sorted(saved, key=str))
            changed.append(f"{fields}: the checkpoint's optimizer had {before}, this run's config {want}: applied on "
                           "resume (the optimizer's moments are the checkpoint's)")
    return changed
