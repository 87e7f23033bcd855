"""Built-in rewards: JPEG (in)compressibility (DDPO) and the embedded model's prompt alignment."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from ddpo_group.rewards import register_reward


def jpeg_size_kb(images: torch.Tensor, quality: int = 95) -> torch.Tensor:
    """Size in kB of each image [B, 3, H, W] in [0, 1] saved as a JPEG of the given quality."""
    arrays = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    sizes = []
    for array in arrays:
        buffer = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(array)).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float64)


@register_reward("jpeg_compressibility")
def jpeg_compressibility(quality: int = 95):
    """reward = -(size in kB of the quality-95 JPEG): smaller files score higher."""

    def fn(images, prompts, metadata):
        size = jpeg_size_kb(images, quality)
        return -size, {"jpeg_kb": size}

    return fn


@register_reward("jpeg_incompressibility")
def jpeg_incompressibility(quality: int = 95):
    """reward = size in kB of the quality-95 JPEG: larger files score higher."""

    def fn(images, prompts, metadata):
        size = jpeg_size_kb(images, quality)
        return size, {"jpeg_kb": size}

    return fn


@register_reward("shapes_alignment")
def shapes_alignment(**kwargs):
    """Prompt alignment of the embedded tiny-shapes model, scored by its classifier (see its module)."""
    from ddpo_group.rewards.shapes_alignment import shapes_alignment as make

    return make(**kwargs)
