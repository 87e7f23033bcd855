"""The source images of a prompt (image editing): ``metadata["image"]``, one absolute path or a list of them, as a
.jsonl prompt file gives them (prompts.py ``from_file``); the editing families and the edit rewards load them here."""

from __future__ import annotations

SOURCE_IMAGE_KEY = "image"  # the metadata key of a prompt's source image path(s)
# the metadata key of a prompt's own negative prompt (a .jsonl row's; models/families/base.py: the negative prompt rule)
NEGATIVE_PROMPT_KEY = "negative_prompt"


def source_images(metadata: dict) -> list:
    """The source images of a prompt's metadata (``metadata["image"]``: one absolute path or a list of them, as a
    .jsonl prompt file gives them), loaded as RGB PIL images; [] when it has none."""
    from PIL import Image

    value = metadata.get(SOURCE_IMAGE_KEY) if metadata else None
    if value is None:
        return []
    paths = value if isinstance(value, (list, tuple)) else [value]
    images = []
    for path in paths:
        with Image.open(path) as image:
            images.append(image.convert("RGB"))
    return images
