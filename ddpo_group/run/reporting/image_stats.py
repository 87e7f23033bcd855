"""What an evaluation's images show besides their rewards: how different each prompt's images are (diversity) and how
their look moves from the images before training (drift); the signs of a hacked reward that a reward curve hides.

    eval/diversity          the mean over prompts of the mean pairwise distance of a prompt's M images' features:
                            "pixels": the images at 32 x 32 px, d(a, b) = ||a - b|| / sqrt(dims) (the RMS difference
                            of their pixels in [0, 1]); a CLIP image encoder: d(a, b) = 1 - cos(a, b). 0: equal images
    eval/image/<statistic>  each statistic's mean over the images, in [0, 1]:
                            brightness       the luminance Y = 0.299 R + 0.587 G + 0.114 B
                            contrast         the standard deviation of an image's luminance
                            saturation       HSV's (max - min) / max of a pixel's channels (0 for black)
                            high_frequency   the share of the luminance spectrum's energy (its mean removed) above half
                                             the Nyquist frequency: grid patterns and noise raise it, blur lowers it
    eval/image_spread/<statistic>  each statistic's standard deviation over the images
    eval/drift/<statistic>  eval/image/<statistic> minus its value at the evaluation before training (an image
                            against itself: 0); the guard reads it in units of the spread before training

A video's statistics are its frames' means; its pixel feature the mean of its frames'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

STATISTICS = ("brightness", "contrast", "saturation", "high_frequency")
PIXELS = "pixels"
PIXEL_SIZE = 32  # the pixel feature's side


def as_images(images: torch.Tensor) -> torch.Tensor:
    """Float images [N, 3, H, W] in [0, 1] from uint8 or float images, a video's frames [N, F, 3, H, W] flattened."""
    images = images.float() / 255 if images.dtype == torch.uint8 else images.float()
    return images.flatten(0, 1) if images.ndim == 5 else images


def luminance(images: torch.Tensor) -> torch.Tensor:
    weights = torch.tensor([0.299, 0.587, 0.114], dtype=images.dtype, device=images.device)
    return (images * weights[:, None, None]).sum(dim=1)  # [N, H, W]


def per_image_statistics(images: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each statistic of STATISTICS (module docstring) of each image (a video: of each frame), [N] each."""
    images = as_images(images)
    y = luminance(images)
    high, low = images.max(dim=1).values, images.min(dim=1).values
    saturation = torch.where(high > 0, (high - low) / high.clamp_min(1e-12), torch.zeros_like(high))
    energy = torch.fft.fft2(y - y.mean(dim=(1, 2), keepdim=True)).abs().square()  # [N, H, W]
    fy, fx = torch.fft.fftfreq(y.shape[1]), torch.fft.fftfreq(y.shape[2])  # cycles per pixel, Nyquist at 0.5
    high_band = (fy[:, None].square() + fx[None, :].square()).sqrt() > 0.25
    total = energy.sum(dim=(1, 2))
    share = torch.where(total > 0, energy[:, high_band].sum(dim=1) / total.clamp_min(1e-30), torch.zeros_like(total))
    return {"brightness": y.mean(dim=(1, 2)), "contrast": y.flatten(1).std(dim=1, unbiased=False),
            "saturation": saturation.flatten(1).mean(dim=1), "high_frequency": share}


def image_statistics(images: torch.Tensor) -> dict[str, float]:
    """The mean over ``images`` of each statistic of STATISTICS (module docstring)."""
    return {name: float(values.mean()) for name, values in per_image_statistics(images).items()}


def image_spreads(images: torch.Tensor) -> dict[str, float]:
    """eval/image_spread/<statistic>: each statistic's standard deviation over ``images`` (ddof 1; 0 for one image):
    the scale the guard's drift rule measures a move in."""
    return {name: float(values.std()) if len(values) > 1 else 0.0
            for name, values in per_image_statistics(images).items()}


def pixel_features(images: torch.Tensor) -> torch.Tensor:
    """[N, 3 * 32 * 32] the images at 32 x 32 px (area resampling); a video's: the mean of its frames'."""
    count = images.shape[0]
    features = F.interpolate(as_images(images), size=(PIXEL_SIZE, PIXEL_SIZE), mode="area").flatten(1)
    return features.view(count, -1, features.shape[-1]).mean(dim=1)


def diversity(features: torch.Tensor, num_seeds: int, cosine: bool) -> float:
    """The mean over prompts of the mean pairwise distance of each prompt's ``num_seeds`` consecutive rows of
    ``features`` (module docstring; ``cosine``: 1 - cos, else the RMS difference); 0 with one image a prompt."""
    if num_seeds < 2:
        return 0.0
    groups = features.float().view(-1, num_seeds, features.shape[-1])
    if cosine:
        unit = groups / groups.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        distances = 1 - unit @ unit.transpose(1, 2)
    else:
        distances = torch.cdist(groups, groups) / groups.shape[-1] ** 0.5
    pairs = num_seeds * (num_seeds - 1)
    return float((distances.sum(dim=(1, 2)) / pairs).mean())


def spread_of(drift_key: str) -> str:
    """The spread a drift is measured in: eval/drift/<statistic> -> eval/image_spread/<statistic>,
    eval/drift/<kind>/<statistic> (audio_stats.py's audio) -> eval/<kind>_spread/<statistic>."""
    kind, _, name = drift_key.removeprefix("eval/drift/").rpartition("/")
    return f"eval/{kind or 'image'}_spread/{name}"


def drift(statistics: dict[str, float], start: dict[str, float] | None) -> dict[str, float]:
    """eval/drift/<statistic>: ``statistics`` minus ``start`` (the evaluation's before training); none without it."""
    if not start:
        return {}
    return {f"eval/drift/{name}": statistics[name] - start[name] for name in STATISTICS if name in start}
