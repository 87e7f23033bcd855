"""prompt_fn=from_file with a .jsonl file: prompt, image paths relative to the file, a per-row negative prompt, free
metadata; clear errors."""

import json

import pytest
from PIL import Image

from ddpo_group.models.source_images import source_images
from ddpo_group.prompts import PromptSampler


def write_rows(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_jsonl_rows_give_prompts_absolute_image_paths_and_free_metadata(tmp_path):
    (tmp_path / "img").mkdir()
    Image.new("RGB", (8, 6), (255, 0, 0)).save(tmp_path / "img" / "red.png")
    Image.new("RGB", (8, 6), (0, 0, 255)).save(tmp_path / "img" / "blue.png")
    path = write_rows(tmp_path / "edits.jsonl", [
        {"prompt": "make it blue", "image": "img/red.png", "target": [0, 0, 255]},
        "",
        {"prompt": " a cat ", "tag": 3},
        {"prompt": "both", "image": ["img/red.png", "img/blue.png"]},
        {"prompt": "a dog", "negative_prompt": "blurry, low quality"},
    ])
    prompts, metadata = PromptSampler("from_file", {"path": path}, seed=0).sample(40)
    rows = {p: m for p, m in zip(prompts, metadata)}
    assert set(rows) == {"make it blue", "a cat", "both", "a dog"}
    assert rows["a dog"] == {"negative_prompt": "blurry, low quality"}  # the families read it from the metadata
    assert rows["make it blue"] == {"image": str(tmp_path / "img" / "red.png"), "target": [0, 0, 255]}
    assert rows["a cat"] == {"tag": 3}
    assert rows["both"]["image"] == [str(tmp_path / "img" / "red.png"), str(tmp_path / "img" / "blue.png")]
    red, blue = source_images(rows["both"])
    assert red.size == (8, 6) and red.mode == "RGB" and red.getpixel((0, 0)) == (255, 0, 0)
    assert blue.getpixel((7, 5)) == (0, 0, 255)
    assert source_images(rows["a cat"]) == []


@pytest.mark.parametrize("line, message", [
    ("{\"prompt\": \"a\", ", r"line 2: not valid JSON"),
    ("[\"a cat\"]", r"line 2: a row must be a JSON object"),
    ("{\"image\": \"x.png\"}", r"line 2: field 'prompt' is None; it is required"),
    ("{\"prompt\": \"  \"}", r"line 2: field 'prompt' is '  '"),
    ("{\"prompt\": \"a\", \"image\": 3}", r"line 2: field 'image' is 3"),
    ("{\"prompt\": \"a\", \"image\": \"missing.png\"}", r"line 2: field 'image': 'missing.png' .* does not exist"),
    ("{\"prompt\": \"a\", \"negative_prompt\": 3}", r"line 2: field 'negative_prompt' is 3; it must be a string"),
    ("{\"prompt\": \"a\", \"negative_prompt\": null}", r"line 2: field 'negative_prompt' is None; it must be"),
    ("{\"prompt\": \"a\", \"negative_prompt\": [\"x\"]}", r"line 2: field 'negative_prompt' is \['x'\]"),
])
def test_a_bad_jsonl_row_names_the_file_line_and_field(tmp_path, line, message):
    path = write_rows(tmp_path / "bad.jsonl", [{"prompt": "fine"}, line])
    with pytest.raises((ValueError, FileNotFoundError), match="bad.jsonl, " + message):
        PromptSampler("from_file", {"path": path}).probe()


def test_an_empty_jsonl_file_is_an_error(tmp_path):
    path = write_rows(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(ValueError, match="holds no row"):
        PromptSampler("from_file", {"path": path}).probe()
