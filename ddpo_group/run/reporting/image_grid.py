"""Captioned image grids (training samples, evaluate.py's base-vs-fine-tuned comparison); an edit is shown after its
source images (``with_sources``).

Every caption is shown whole: it is wrapped to the tile's width, measured in pixels with the font that draws it,
on as many lines as it needs (a word wider than a tile is split), and the caption strip under each row of tiles is
as tall as the longest caption. A newline in a caption starts a new line (the reward gets its own).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from ddpo_group.models.source_images import source_images

FONT_SIZE = 11
MARGIN = 3  # pixels between a tile's edge and its caption text, and between lines
MIN_TILE = 96
MAX_FRAMES = 8  # a video's frames shown in its strip: evenly spaced, the first and the last among them
COLUMNS = 8  # images a row of a grid by default


@lru_cache(maxsize=4)
def caption_font(size: int = FONT_SIZE) -> ImageFont.ImageFont:
    """Pillow's built-in font: scalable (FreeType) where Pillow has it, its small bitmap font otherwise."""
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, ImportError, OSError):  # Pillow < 10.1 or without FreeType
        return ImageFont.load_default()


def line_height(font: ImageFont.ImageFont) -> int:
    top, bottom = font.getbbox("Ágy|0")[1::2]  # accents, descenders and digits: the tallest line
    return bottom - min(top, 0) + MARGIN


def caption_lines(caption: str, width: int, font: ImageFont.ImageFont | None = None) -> list[str]:
    """``caption`` broken into lines no wider than ``width`` pixels in ``font``: at spaces, and inside a word only
    when the word alone is wider than a line. Joining the lines gives back every word of the caption."""
    font = font or caption_font()
    lines: list[str] = []
    for paragraph in caption.split("\n"):
        line = ""
        for word in paragraph.split():
            candidate = f"{line} {word}" if line else word
            if font.getlength(candidate) <= width:
                line = candidate
                continue
            if line:
                lines.append(line)
            line = ""
            while font.getlength(word) > width and len(word) > 1:  # a word wider than the tile: split it
                cut = len(word) - 1
                while cut > 1 and font.getlength(word[:cut]) > width:
                    cut -= 1
                lines.append(word[:cut])
                word = word[cut:]
            line = word
        if line or not lines:
            lines.append(line)
    return lines


def image_grid(images: torch.Tensor, captions: list[str], columns: int | None = None,
               min_tile: int = MIN_TILE) -> Image.Image:
    """Images [B, 3, H, W] in [0, 1] tiled in a grid (small images upscaled by an integer factor toward ``min_tile``
    px; a tile is at least MIN_TILE px wide), each over its whole caption. Videos [B, F, 3, H, W] (a video family's
    frames) are shown as frame strips: a tile holds up to MAX_FRAMES of a video's frames left to right. ``columns``:
    tiles a row (default: COLUMNS images, or as many videos as make about COLUMNS frames)."""
    frame_w = images.shape[-1]
    shown = 1
    if images.ndim == 5:  # frames side by side: [B, 3, H, F' W]
        frames = torch.linspace(0, images.shape[1] - 1, min(images.shape[1], MAX_FRAMES)).round().long().unique()
        images, shown = torch.cat(images[:, frames].unbind(1), dim=-1), len(frames)
    columns = columns or max(1, COLUMNS // shown)
    arrays = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    b, h, w = arrays.shape[:3]
    scale = max(1, min_tile // frame_w)
    tile_w, tile_h = max(w * scale, MIN_TILE), h * scale
    font = caption_font()
    wrapped = [caption_lines(caption, tile_w - 2 * MARGIN, font) for caption in captions[:b]]
    step = line_height(font)
    caption_h = MARGIN + step * max((len(lines) for lines in wrapped), default=0)
    columns = max(1, min(columns, b))
    rows = (b + columns - 1) // columns
    grid = Image.new("RGB", (columns * tile_w, rows * (tile_h + caption_h)), "white")
    draw = ImageDraw.Draw(grid)
    for i, array in enumerate(arrays):
        x, y = (i % columns) * tile_w, (i // columns) * (tile_h + caption_h)
        tile = Image.fromarray(np.ascontiguousarray(array)).resize((w * scale, tile_h), Image.NEAREST)
        grid.paste(tile, (x + (tile_w - w * scale) // 2, y))
        for line_no, line in enumerate(wrapped[i] if i < len(wrapped) else []):
            draw.text((x + MARGIN, y + tile_h + MARGIN + step * line_no), line, fill="black", font=font)
    return grid


def with_sources(images: torch.Tensor, metadata: list) -> torch.Tensor:
    """Images [B, 3, H, W] in [0, 1] with their prompts' source images (an editing dataset's ``metadata["image"]``)
    before them, as strips [B, S + 1, 3, H, W] that ``image_grid`` draws like a video's frames (each source resized to
    H x W; a row with fewer sources is padded with white); the images unchanged when no row has a source, or when a
    source cannot be read (a grid must not stop a run)."""
    try:
        sources = [source_images(m) for m in metadata[: len(images)]]
    except OSError:
        return images
    most = max((len(row) for row in sources), default=0)
    if most == 0 or images.ndim != 4:
        return images
    images = images.detach().float().cpu()
    h, w = images.shape[-2:]
    white = torch.ones(3, h, w)
    strips = []
    for image, row in zip(images, sources + [[]] * (len(images) - len(sources))):
        frames = [torch.from_numpy(np.asarray(s.resize((w, h)), dtype=np.float32) / 255).permute(2, 0, 1) for s in row]
        strips.append(torch.stack(frames + [white] * (most - len(row)) + [image]))
    return torch.stack(strips)
