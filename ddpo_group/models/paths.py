"""Where a model is: the embedded models' directories ("tiny-shapes", "tiny-shapes-flow", the shapes classifier), a
local diffusers directory or a hub id. Below the loader (models/__init__.py) and the families, which both read it."""

from __future__ import annotations

import os
from pathlib import Path

TINY_SHAPES = "tiny-shapes"
TINY_SHAPES_DIR = Path(__file__).resolve().parent / "tiny_shapes"
TINY_SHAPES_FLOW = "tiny-shapes-flow"
TINY_SHAPES_FLOW_DIR = Path(__file__).resolve().parent / "tiny_shapes_flow"
CLASSIFIER_DIR = Path(__file__).resolve().parent / "tiny_shapes_classifier"
EMBEDDED = {TINY_SHAPES: (TINY_SHAPES_DIR, ""), TINY_SHAPES_FLOW: (TINY_SHAPES_FLOW_DIR, " --family sd3")}
# The flow model has no T5: the SD3 pipeline then appends max_sequence_length zero "T5" tokens to the CLIP tokens.
# It was trained with one, so that is its default (the pipeline's own default, 256, would cost 4x the compute);
# call its pipeline with max_sequence_length=1 too.
TINY_SHAPES_FLOW_T5_TOKENS = 1


def resolve_model_path(name_or_path: str) -> str:
    """The local directory of an embedded model ("tiny-shapes", "tiny-shapes-flow"); any other value unchanged."""
    if name_or_path in EMBEDDED:
        directory, family = EMBEDDED[name_or_path]
        if not (directory / "model_index.json").is_file():
            raise FileNotFoundError(
                f"the embedded model is missing from {directory} (a broken install?); rebuild it with "
                f"`python scripts/pretrain_tiny.py{family}`"
            )
        return str(directory)
    return name_or_path


def locate(name_or_path: str) -> tuple[str, bool]:
    """(path or hub id, whether it is a local directory); FileNotFoundError for a path that does not exist."""
    path = resolve_model_path(name_or_path)
    local = os.path.isdir(path)
    if not local and (path.startswith((".", "/", "~")) or path.count("/") > 1):  # meant as a path, not a hub id
        raise FileNotFoundError(
            f"pretrained.model={name_or_path!r}: no such directory; give 'tiny-shapes', 'tiny-shapes-flow', a hub id "
            "(owner/name) or a local directory with model_index.json"
        )
    return path, local
