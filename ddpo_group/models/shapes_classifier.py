"""The embedded model's prompt-alignment judge: a small CNN with color, shape and background heads.

Trained by scripts/pretrain_tiny.py on the shapes data set; weights (safetensors) and config
(JSON) are shipped beside the embedded model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ddpo_group.models.shapes_data import COLOR_NAMES, SHAPE_NAMES

WEIGHTS_NAME = "classifier.safetensors"
CONFIG_NAME = "config.json"


class ShapesClassifier(nn.Module):
    """Images [B, 3, H, W] in [0, 1] -> logits of (color [B, 6], shape [B, 4], background [B, 6])."""

    def __init__(self, width: int = 32, num_colors: int = len(COLOR_NAMES), num_shapes: int = len(SHAPE_NAMES)):
        super().__init__()
        self.config = {"width": width, "num_colors": num_colors, "num_shapes": num_shapes}

        def block(c_in, c_out):
            return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True))

        self.features = nn.Sequential(
            block(3, width), block(width, width), nn.MaxPool2d(2),
            block(width, 2 * width), block(2 * width, 2 * width), nn.MaxPool2d(2),
            block(2 * width, 4 * width), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.color = nn.Linear(4 * width, num_colors)
        self.shape = nn.Linear(4 * width, num_shapes)
        self.background = nn.Linear(4 * width, num_colors)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.features(images * 2 - 1)
        return self.color(h), self.shape(h), self.background(h)

    def save_pretrained(self, directory) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(directory / WEIGHTS_NAME))
        (directory / CONFIG_NAME).write_text(json.dumps(self.config, indent=2))

    @classmethod
    def from_pretrained(cls, directory) -> "ShapesClassifier":
        directory = Path(directory)
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            if not (directory / name).is_file():
                raise FileNotFoundError(f"shapes classifier file {directory / name} is missing")
        model = cls(**json.loads((directory / CONFIG_NAME).read_text()))
        model.load_state_dict(load_file(str(directory / WEIGHTS_NAME)))
        return model.eval()
