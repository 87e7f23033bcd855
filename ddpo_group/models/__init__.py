"""The embedded models and the pipeline loader.

``pretrained.model = "tiny-shapes"`` (the default) is the Stable-Diffusion-format model shipped in this package,
``"tiny-shapes-flow"`` its SD3-format flow-matching sibling (both trained by scripts/pretrain_tiny.py on the same
shapes, judged by the same classifier); any other value is a hub id or a local diffusers directory, loaded by its
model family's pipeline class (models/families/).
"""

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


def default_max_sequence_length(name_or_path: str) -> int:
    """The T5 token count a model's prompts get when ``pretrained.max_sequence_length`` is 0: the embedded flow
    model's; 0 (the pipeline's default) for any other."""
    return TINY_SHAPES_FLOW_T5_TOKENS if name_or_path == TINY_SHAPES_FLOW else 0


def _dtype_kwargs(dtype) -> dict:
    """The load dtype under the keyword this diffusers takes: ``dtype`` (newer; ``torch_dtype`` is deprecated) or
    ``torch_dtype``."""
    if dtype is None:
        return {}
    try:
        from diffusers.utils.deprecation_utils import _resolve_dtype  # noqa: F401  (only in diffusers with ``dtype``)
    except ImportError:
        return {"torch_dtype": dtype}
    return {"dtype": dtype}


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


def load_family(name_or_path: str, revision: str | None = None, torch_dtype=None, family: str = "", config=None):
    """The model family (models/families/) of an embedded model, a local diffusers directory or a hub id, with its
    pipeline loaded; ``family`` overrides the one read from ``model_index.json`` (clear error if nothing loads)."""
    from ddpo_group.models.families import family_name, get_family

    path, local = locate(name_or_path)
    try:
        cls = get_family(family_name(name_or_path, family, path, local))
        pipe = cls.load_pipeline(path, local, revision, _dtype_kwargs(torch_dtype))
    except (OSError, ValueError) as error:
        raise FileNotFoundError(
            f"pretrained.model={name_or_path!r} could not be loaded: it must be 'tiny-shapes', 'tiny-shapes-flow', a hub id, "
            f"or a local directory with model_index.json ({type(error).__name__}: {error})"
        ) from error
    return cls(pipe, config)


def load_pipeline(name_or_path: str, revision: str | None = None, torch_dtype=None, family: str = ""):
    """The diffusers pipeline of ``name_or_path`` (``load_family``'s pipeline)."""
    return load_family(name_or_path, revision, torch_dtype, family).pipe
