"""Captioned grids show every caption whole, the reward included (ddpo_group/run/reporting/image_grid.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ddpo_group.offline.comparison import comparison_grid
from ddpo_group.models import shapes_data
from ddpo_group.run.reporting.image_grid import (MARGIN, MIN_TILE, caption_font, caption_lines, image_grid, line_height,
                                      with_sources)


def longest_tiny_shapes_prompt() -> str:
    names = shapes_data.COLOR_NAMES
    captions = [shapes_data.caption(c, s, b) for c in names for s in shapes_data.SHAPE_NAMES for b in names if b != c]
    return max(captions, key=len)


def read_text(image) -> list[str]:
    """The lines OCR reads in ``image`` (RapidOCR, the ocr reward's engine; nothing downloads)."""
    rapidocr = pytest.importorskip("rapidocr_onnxruntime")
    result, _ = rapidocr.RapidOCR()(np.asarray(image.convert("RGB")))
    return [text for _, text, _ in result or []]


def test_the_longest_tiny_shapes_caption_is_wrapped_whole_within_the_tile():
    prompt = longest_tiny_shapes_prompt()
    assert len(prompt) == 40  # "a yellow triangle on a purple background": what the old grid cut after 2 x 16 chars
    width, font = MIN_TILE - 2 * MARGIN, caption_font()
    lines = caption_lines(f"{prompt}\nreward 0.993", width, font)
    assert " ".join(lines).split() == prompt.split() + ["reward", "0.993"]  # every word, in order
    assert lines[-1] == "reward 0.993"  # the reward on a line of its own
    assert all(font.getlength(line) <= width for line in lines)
    assert len(lines) >= 3  # it does need more than the two lines the old grid drew


def test_the_reward_is_in_the_rendered_caption_of_the_longest_prompt():
    prompt = longest_tiny_shapes_prompt()
    images = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))  # noise: no text in the tiles
    grid = image_grid(images, [f"{prompt}\nreward 0.993", "a cat\nreward 0.125", "a dog\nreward -1.500"], columns=3)
    tile = MIN_TILE  # 32 px images upscaled 3x
    read = read_text(grid.crop((0, tile, tile, grid.height)))  # the first tile's caption strip
    assert "reward 0.993" in [line.replace("reward0", "reward 0") for line in read], read
    assert "".join(read).replace(" ", "").startswith(prompt.replace(" ", ""))


def test_the_caption_strip_fits_the_longest_caption_and_the_layout():
    font = caption_font()
    captions = [f"prompt {i}\nreward 0.5" for i in range(9)] + ["a much longer prompt than the others\nreward 0.5"]
    grid = image_grid(torch.rand(10, 3, 16, 16), captions, columns=4)
    lines = max(len(caption_lines(c, MIN_TILE - 2 * MARGIN, font)) for c in captions)
    assert lines == 4  # "a much longer prompt" / "than the others" / ... / "reward 0.5" at 90 px
    caption_h = MARGIN + lines * line_height(font)
    # 4 columns of 96 px tiles (16 px images upscaled 6x), 3 rows of (96 px image + the caption strip)
    assert grid.size == (4 * 96, 3 * (96 + caption_h))
    # the last line of the longest caption (tile 9: row 2, column 1) is drawn inside its strip
    strip = np.asarray(grid.crop((96, 2 * (96 + caption_h) + 96, 192, 3 * (96 + caption_h))).convert("L"))
    last_line = strip[MARGIN + 3 * line_height(font):]
    assert (last_line < 128).any()


def test_a_word_wider_than_a_tile_is_split_not_lost():
    word = "x" * 60
    lines = caption_lines(f"{word} end", 40)
    assert len(lines) > 1 and "".join(lines).replace(" ", "") == word + "end"
    assert all(caption_font().getlength(line) <= 40 for line in lines)


def test_the_evaluation_grid_shows_model_seed_reward_and_the_whole_prompt():
    prompt = longest_tiny_shapes_prompt()
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    grid = comparison_grid(images[:1], images[1:], [prompt], [[7]], torch.tensor([0.25]), torch.tensor([0.875]))
    read = [line.replace(" ", "") for line in read_text(grid.crop((MIN_TILE, MIN_TILE, 2 * MIN_TILE, grid.height)))]
    assert read[:2] == ["tuned,seed7", "reward0.875"], read  # the fine-tuned tile
    assert "".join(read[2:]) == prompt.replace(" ", "")


def test_an_edit_is_shown_after_its_sources_and_a_grid_without_sources_is_unchanged(tmp_path):
    from PIL import Image

    Image.new("RGB", (4, 6), (255, 0, 0)).save(tmp_path / "red.png")  # another size: resized to the edit's
    Image.new("RGB", (8, 8), (0, 255, 0)).save(tmp_path / "green.png")
    edits = torch.zeros(3, 3, 8, 8)
    edits[:, 2] = 1.0  # blue
    metadata = [{"image": str(tmp_path / "red.png")}, {"image": [str(tmp_path / "red.png"), str(tmp_path / "green.png")]},
                {}]
    strips = with_sources(edits, metadata)
    assert strips.shape == (3, 3, 3, 8, 8)  # the most sources (2) and the edit
    colour = lambda frame: tuple(int(v) for v in frame.mean(dim=(1, 2)) * 255)  # noqa: E731
    assert [colour(f) for f in strips[0]] == [(255, 0, 0), (255, 255, 255), (0, 0, 255)]  # one source, white, edit
    assert [colour(f) for f in strips[1]] == [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
    assert [colour(f) for f in strips[2]] == [(255, 255, 255), (255, 255, 255), (0, 0, 255)]
    assert with_sources(edits, [{}, {}, {}]) is edits and with_sources(edits, []) is edits
    assert with_sources(edits, [{"image": str(tmp_path / "gone.png")}]) is edits  # unreadable: the edits alone
    grid = image_grid(strips, ["a", "b", "c"])
    assert grid.width == 2 * 3 * MIN_TILE  # 3-frame strips: two a row (about 8 frames)
