"""The embedded models and the pipeline loader.

``pretrained.model = "tiny-shapes"`` (the default) is the Stable-Diffusion-format model shipped in this package,
``"tiny-shapes-flow"`` its SD3-format flow-matching sibling (both trained by scripts/pretrain_tiny.py on the same
shapes, judged by the same classifier); any other value is a hub id or a local diffusers directory, loaded by its
model family's pipeline class (models/families/).
"""

from __future__ import annotations

from ddpo_group.models.paths import (  # noqa: F401  (where the models are; the families read it too)
    CLASSIFIER_DIR, EMBEDDED, TINY_SHAPES, TINY_SHAPES_DIR, TINY_SHAPES_FLOW, TINY_SHAPES_FLOW_DIR,
    TINY_SHAPES_FLOW_T5_TOKENS, locate, resolve_model_path,
)


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


def load_family(name_or_path: str, revision: str | None = None, torch_dtype=None, family: str = "", *, config):
    """The model family (models/families/) of an embedded model, a local diffusers directory or a hub id, with its
    pipeline loaded; ``family`` overrides the one read from ``model_index.json`` (clear error if nothing loads).
    ``config``: the run's config, which the family reads (a caller without one passes ``config.base.base()``)."""
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


def load_pipeline(name_or_path: str, revision: str | None = None, torch_dtype=None, family: str = "", *, config):
    """The diffusers pipeline of ``name_or_path`` (``load_family``'s pipeline, the family built with ``config``)."""
    return load_family(name_or_path, revision, torch_dtype, family, config=config).pipe
