"""Model loading (placeholder until the embedded-model branch lands: local paths and hub ids only)."""

from __future__ import annotations

import os

from diffusers import StableDiffusionPipeline

TINY_SHAPES = "tiny-shapes"


def resolve_model_path(name_or_path: str) -> str:
    return name_or_path


def load_pipeline(name_or_path: str, revision: str | None = None, torch_dtype=None) -> StableDiffusionPipeline:
    try:
        return StableDiffusionPipeline.from_pretrained(
            resolve_model_path(name_or_path), revision=revision or None, torch_dtype=torch_dtype,
            safety_checker=None, requires_safety_checker=False,
        )
    except (OSError, ValueError) as error:
        raise FileNotFoundError(
            f"pretrained.model={name_or_path!r} could not be loaded: it must be 'tiny-shapes', a hub id, "
            f"or a local directory with model_index.json ({error})"
        ) from error
