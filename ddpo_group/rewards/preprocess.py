"""Image preprocessing of reward models, on the images' device (batched, no PIL round trip).

Images are float tensors [B, 3, H, W] in [0, 1]. Two resize rules are used by the models here:

* ``resize_shortest_crop`` (transformers' CLIPImageProcessor): bicubic resize so the short side is
  ``shortest_edge`` (long side ``int(shortest_edge * long / short)``, as transformers computes it),
  then a center crop to ``crop``;
* ``resize_longest_pad`` (open_clip ``resize_mode="longest"``, HPSv2's validation transform):
  bicubic resize so the long side is ``size``, then zero (black) padding to a centered square,
  the extra pixel of an odd margin on the right/bottom.

Then ``(x - mean) / std`` per channel. Bicubic resizing is antialiased to follow PIL's resampling.

The Qwen-VL rewards (hpsv3, vqascore) size their PIL images by ``qwen_vl_smart_resize``, qwen_vl_utils' rule.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def normalise(images: torch.Tensor, mean, std) -> torch.Tensor:
    mean = torch.tensor(mean, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    std = torch.tensor(std, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    return (images - mean) / std


def _resize(images: torch.Tensor, height: int, width: int) -> torch.Tensor:
    if tuple(images.shape[-2:]) == (height, width):
        return images
    return F.interpolate(images, size=(height, width), mode="bicubic", align_corners=False, antialias=True).clamp(0, 1)


def resize_shortest_crop(images: torch.Tensor, shortest_edge: int, crop: tuple[int, int], mean, std) -> torch.Tensor:
    """CLIPImageProcessor's resize (short side), center crop and normalisation -> [B, 3, crop_h, crop_w]."""
    images = images.float()
    h, w = images.shape[-2:]
    short, long = (w, h) if w <= h else (h, w)
    new_long = int(shortest_edge * long / short)
    new_h, new_w = (new_long, shortest_edge) if w <= h else (shortest_edge, new_long)
    images = _resize(images, new_h, new_w)
    crop_h, crop_w = crop
    if new_h < crop_h or new_w < crop_w:
        raise ValueError(f"crop {crop} is larger than the resized image {(new_h, new_w)} (shortest_edge={shortest_edge})")
    top, left = (new_h - crop_h) // 2, (new_w - crop_w) // 2
    return normalise(images[..., top : top + crop_h, left : left + crop_w], mean, std)


def resize_longest_pad(images: torch.Tensor, size: int, mean, std) -> torch.Tensor:
    """open_clip's "longest" resize, centered zero padding to a square, normalisation -> [B, 3, size, size]."""
    images = images.float()
    h, w = images.shape[-2:]
    ratio = max(h / size, w / size)
    new_h, new_w = round(h / ratio), round(w / ratio)
    images = _resize(images, new_h, new_w)
    pad_w, pad_h = size - new_w, size - new_h
    images = F.pad(images, (pad_w // 2, (pad_w + 1) // 2, pad_h // 2, (pad_h + 1) // 2))  # zeros: black
    return normalise(images, mean, std)


def qwen_vl_smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int,
                         reward: str, max_ratio: int = 200) -> tuple[int, int]:
    """qwen_vl_utils' ``smart_resize`` (the size hpsv3 and t2v_metrics give Qwen-VL): both sides multiples of
    ``factor`` (at least one), the area within [min_pixels, max_pixels], the aspect ratio kept as closely as possible;
    an aspect ratio above ``max_ratio`` is refused, as Qwen2-VL refuses it."""
    if max(height, width) / min(height, width) > max_ratio:
        raise ValueError(f"{reward} reward: an image of {height} x {width} px has an aspect ratio above {max_ratio}, "
                         "which Qwen2-VL refuses")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = math.floor(height / beta / factor) * factor
        w_bar = math.floor(width / beta / factor) * factor
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar
