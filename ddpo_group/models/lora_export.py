"""LoRA export in diffusers format: the trained adapter, loadable on the base pipeline of its family.

    pipe = StableDiffusionPipeline.from_pretrained(base_model)     # or StableDiffusion3Pipeline, FluxPipeline
    pipe.load_lora_weights("<run>/lora")          # or "<run>/checkpoints/checkpoint_<epoch>/lora"

The adapter's peft state dict is converted to diffusers' key names (peft's ``get_peft_model_state_dict`` +
diffusers' ``convert_state_dict_to_diffusers``) and written with the family's pipeline class's
``save_lora_weights`` (``pytorch_lora_weights.safetensors``), with the adapter's LoraConfig as metadata so rank and
alpha (the scale alpha / r) survive the round trip. The family writes it (``ModelFamily.save_lora``,
models/families/base.py: its pipeline class and the keyword of its trained module); this module holds what every
family shares and what the readers of an export need, and imports no family.
"""

from __future__ import annotations

import os
from pathlib import Path

LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"


def unwrap(model):
    """The module inside DDP / accelerate wrappers and torch.compile."""
    while hasattr(model, "module"):
        model = model.module
    return getattr(model, "_orig_mod", model)


def is_lora_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / LORA_WEIGHT_NAME).is_file()


def lora_dir_of(path: str | os.PathLike) -> Path | None:
    """The LoRA export at ``path``, or in its ``lora/`` (a run directory's); None when neither holds one."""
    for candidate in (Path(path), Path(path) / "lora"):
        if is_lora_dir(candidate):
            return candidate
    return None
