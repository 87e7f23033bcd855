"""Prompt alignment for the embedded tiny-shapes model, judged by its shipped classifier.

For an image x and a prompt "a {c} {s} on a {b} background", with the classifier's softmax
probabilities p_color, p_shape, p_background:

    reward(x) = ( p_color(c | x) + p_shape(s | x) + p_background(b | x) ) / 3      in [0, 1]

The mean (not the product) keeps a gradient of credit: getting the shape right while the color
is still wrong already scores. ``info`` holds each head's probability and whether its argmax is
right (logged as reward_info/*_correct, the accuracy).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from ddpo_group.models import CLASSIFIER_DIR
from ddpo_group.models.shapes_classifier import ShapesClassifier
from ddpo_group.models.shapes_data import RESOLUTION, attribute_labels, parse_caption

HEADS = ("color", "shape", "background")


def prompt_attributes(prompt: str, metadata: dict | None) -> tuple[int, int, int]:
    """Label indices (color, shape, background) from the metadata when it has them, else from the prompt."""
    metadata = metadata or {}
    if all(key in metadata for key in HEADS):
        return attribute_labels(metadata["color"], metadata["shape"], metadata["background"])
    return attribute_labels(*parse_caption(prompt))


def shapes_alignment(classifier_path: str | None = None, device: str | None = None):
    """Factory: load the classifier once; return fn(images, prompts, metadata) -> (rewards [B], info)."""
    classifier = ShapesClassifier.from_pretrained(classifier_path or CLASSIFIER_DIR)
    lock = threading.Lock()  # one classifier shared by the reward threads

    @torch.no_grad()
    def fn(images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None):
        labels = torch.tensor([prompt_attributes(p, m) for p, m in zip(prompts, metadata or [None] * len(prompts))])
        x = images.detach().float()
        if x.shape[-2:] != (RESOLUTION, RESOLUTION):
            x = F.interpolate(x, size=(RESOLUTION, RESOLUTION), mode="bilinear", antialias=True, align_corners=False)
        with lock:
            target = torch.device(device) if device else x.device
            classifier.to(target)
            logits = classifier(x.to(target).clamp(0, 1))
        probs = torch.stack(
            [lg.softmax(-1).gather(1, labels[:, k : k + 1].to(lg.device)).squeeze(1) for k, lg in enumerate(logits)], dim=1
        ).cpu().double()
        correct = torch.stack([lg.argmax(-1).cpu() == labels[:, k] for k, lg in enumerate(logits)], dim=1).double()
        info = {f"{head}_prob": probs[:, k] for k, head in enumerate(HEADS)}
        info.update({f"{head}_correct": correct[:, k] for k, head in enumerate(HEADS)})
        info["all_correct"] = correct.prod(dim=1)
        return probs.mean(dim=1), info

    return fn
