"""The embedded default model and the pipeline loader.

``pretrained.model = "tiny-shapes"`` (the default) is the Stable-Diffusion-format model shipped in
this package (trained by scripts/pretrain_tiny.py); any other value is passed to
``StableDiffusionPipeline.from_pretrained`` as a hub id or a local directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from diffusers import StableDiffusionPipeline

TINY_SHAPES = "tiny-shapes"
TINY_SHAPES_DIR = Path(__file__).resolve().parent / "tiny_shapes"
CLASSIFIER_DIR = Path(__file__).resolve().parent / "tiny_shapes_classifier"


def resolve_model_path(name_or_path: str) -> str:
    """The local directory of the embedded model for "tiny-shapes"; any other value unchanged."""
    if name_or_path == TINY_SHAPES:
        if not (TINY_SHAPES_DIR / "model_index.json").is_file():
            raise FileNotFoundError(
                f"the embedded model is missing from {TINY_SHAPES_DIR} (a broken install?); rebuild it with "
                "`python scripts/pretrain_tiny.py`"
            )
        return str(TINY_SHAPES_DIR)
    return name_or_path


def load_pipeline(name_or_path: str, revision: str | None = None, torch_dtype=None) -> StableDiffusionPipeline:
    """A StableDiffusionPipeline from "tiny-shapes", a local diffusers directory or a hub id (clear error if none)."""
    path = resolve_model_path(name_or_path)
    local = os.path.isdir(path)
    if not local and (path.startswith((".", "/", "~")) or path.count("/") > 1):  # meant as a path, not a hub id
        raise FileNotFoundError(
            f"pretrained.model={name_or_path!r}: no such directory; give 'tiny-shapes', a hub id "
            "(owner/name) or a local directory with model_index.json"
        )
    try:
        return StableDiffusionPipeline.from_pretrained(
            path, revision=revision or None, torch_dtype=torch_dtype, safety_checker=None,
            requires_safety_checker=False, local_files_only=local,
        )
    except (OSError, ValueError) as error:
        raise FileNotFoundError(
            f"pretrained.model={name_or_path!r} could not be loaded: it must be 'tiny-shapes', a hub id, "
            f"or a local directory with model_index.json ({type(error).__name__}: {error})"
        ) from error
