"""LoRA export in diffusers format: the trained adapter, loadable on the base pipeline.

    pipe = StableDiffusionPipeline.from_pretrained(base_model)
    pipe.load_lora_weights("<run>/lora")          # or "<run>/checkpoints/checkpoint_<epoch>/lora"

The adapter's peft state dict is converted to diffusers' key names
(peft's ``get_peft_model_state_dict`` + diffusers' ``convert_state_dict_to_diffusers``) and written
with ``StableDiffusionPipeline.save_lora_weights`` (``pytorch_lora_weights.safetensors``), with the
adapter's LoraConfig as metadata so rank and alpha (the scale alpha / r) survive the round trip.
"""

from __future__ import annotations

import os
from pathlib import Path

from diffusers import StableDiffusionPipeline
from diffusers.utils import convert_state_dict_to_diffusers
from peft.utils import get_peft_model_state_dict

LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"


def _unwrap(model):
    while hasattr(model, "module"):  # DDP / accelerate wrappers
        model = model.module
    return getattr(model, "_orig_mod", model)  # torch.compile


def has_lora(unet) -> bool:
    return bool(getattr(_unwrap(unet), "peft_config", None))


def save_lora(unet, directory: str | os.PathLike, adapter_name: str = "default") -> Path:
    """Write ``unet``'s LoRA adapter ``adapter_name`` to ``directory`` in diffusers format; returns the directory."""
    unet = _unwrap(unet)
    if adapter_name not in getattr(unet, "peft_config", {}):
        raise ValueError(f"the UNet has no LoRA adapter {adapter_name!r} to export (use_lora=False?)")
    state = get_peft_model_state_dict(unet, adapter_name=adapter_name)
    state = convert_state_dict_to_diffusers({k: v.detach().float().cpu().contiguous() for k, v in state.items()})
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    StableDiffusionPipeline.save_lora_weights(
        save_directory=str(directory), unet_lora_layers=state, safe_serialization=True,
        unet_lora_adapter_metadata=unet.peft_config[adapter_name].to_dict(),
    )
    return directory


def is_lora_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / LORA_WEIGHT_NAME).is_file()
