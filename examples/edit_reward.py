"""An image-editing reward plugin: how much of the source image the edit keeps, plus how well its colour follows the
prompt. It runs on the CPU and downloads nothing; name it by path:

    accelerate launch scripts/train.py --config config/base.py:grpo --config.pretrained.model=<a FLUX.1 Kontext> \
        --config.prompt_fn=from_file --config.prompt_fn_kwargs='{"path": "edits.jsonl"}' \
        --config.reward_fn=examples/edit_reward.py:edit_reward \
        --config.reward_fn_kwargs='{"keep_weight": 1.0, "colour_weight": 1.0}'

with ``edits.jsonl`` rows such as ``{"prompt": "make the ball blue", "image": "ball.png"}`` (prompt_fn from_file).

Each image gets, against its prompt's source image (``metadata["image"]``: the source's absolute path, which a .jsonl
row's ``image`` becomes; ddpo_group.models.source_images loads it):

    keep   = 1 - mean |edit - source| over pixels and channels (values in [0, 1]; the source resized to the edit's size)
    colour = 1 - |mean colour of the edit - target colour| / sqrt(3), the target the row's ``target_color``
             ([r, g, b] in 0..255, or a colour name of COLOURS), else the last colour word of COLOURS in the prompt ("turn the red ball blue" asks
             for blue); 0 when there is none
    reward = keep_weight * keep + colour_weight * colour

Keep alone is maximised by copying the source; the colour term alone by painting everything: together they ask for
the edit the prompt names and nothing else (a stand-in for a learned edit judge, e.g. a VLM, through a reward server).
"""

from __future__ import annotations

import re

import numpy as np
import torch

from ddpo_group.models.source_images import SOURCE_IMAGE_KEY, source_images

COLOURS = {"red": (255, 0, 0), "green": (0, 128, 0), "blue": (0, 0, 255), "yellow": (255, 255, 0),
           "white": (255, 255, 255), "black": (0, 0, 0), "orange": (255, 165, 0), "purple": (128, 0, 128)}


def target_colour(prompt: str, metadata: dict) -> torch.Tensor | None:
    """The colour [3] in [0, 1] the edit asks for: the row's ``target_color``, else the last colour word of the
    prompt, else None."""
    if "target_color" in metadata:
        value = metadata["target_color"]
        if isinstance(value, str):  # a colour name
            if value.lower() not in COLOURS:
                raise ValueError(f"target_color={value!r}: a colour name of {sorted(COLOURS)} or [r, g, b] in 0..255")
            value = COLOURS[value.lower()]
        return torch.tensor(value, dtype=torch.float64) / 255
    words = [word for word in re.findall(r"[a-z]+", prompt.lower()) if word in COLOURS]
    return torch.tensor(COLOURS[words[-1]], dtype=torch.float64) / 255 if words else None


def edit_reward(keep_weight: float = 1.0, colour_weight: float = 1.0):
    """The reward function (module docstring): rewards [B] float64 and info {"edit_keep", "edit_colour"}."""

    def fn(images, prompts, metadata):
        images = images.detach().float().clamp(0, 1).cpu().double()
        keep, colour = [], []
        for image, prompt, meta in zip(images, prompts, metadata):
            sources = source_images(meta)
            if len(sources) != 1:
                raise ValueError(f"edit_reward needs one source image per prompt in metadata[{SOURCE_IMAGE_KEY!r}] "
                                 f"(a .jsonl prompt file's 'image'); prompt {prompt!r} has {len(sources)}")
            height, width = image.shape[1:]
            source = np.asarray(sources[0].resize((width, height)), dtype=np.float64) / 255
            source = torch.from_numpy(source).permute(2, 0, 1)
            keep.append(1 - float((image - source).abs().mean()))
            target = target_colour(prompt, meta)
            colour.append(0.0 if target is None else 1 - float((image.mean((1, 2)) - target).norm()) / 3 ** 0.5)
        keep, colour = torch.tensor(keep, dtype=torch.float64), torch.tensor(colour, dtype=torch.float64)
        return keep_weight * keep + colour_weight * colour, {"edit_keep": keep, "edit_colour": colour}

    return fn
