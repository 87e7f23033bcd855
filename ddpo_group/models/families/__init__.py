"""Model families, one file each in this folder (``FAMILY_REGISTRY.names()`` lists them; docs/model_families.md).

The family of a model is read from the pipeline class its ``model_index.json`` names (a local directory or a hub
id), or set with ``pretrained.family``. Adding a family is one file in this folder: a ``ModelFamily`` subclass
(base.py) registered with ``@register_family(name, PipelineClass)``; every module here is imported with the package.
"""

from __future__ import annotations

import json
import os

from ddpo_group.models.paths import locate
from ddpo_group.registry import Registry, import_submodules

FAMILY_REGISTRY = Registry("model family (pretrained.family)")
_BY_PIPELINE_CLASS: dict[str, str] = {}


def register_family(name: str, pipeline_class):
    """Class decorator: the family ``name``, chosen for models whose pipeline class is ``pipeline_class``."""
    def decorator(cls):
        cls.name, cls.pipeline_class = name, pipeline_class
        FAMILY_REGISTRY.register(name)(cls)
        _BY_PIPELINE_CLASS[pipeline_class.__name__] = name
        return cls
    return decorator


def pipeline_class_name(path: str, local: bool) -> str:
    """``_class_name`` of a model's ``model_index.json`` (a local directory, or fetched for a hub id)."""
    if local:
        with open(os.path.join(path, "model_index.json")) as f:
            return json.load(f)["_class_name"]
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.load_config(path)["_class_name"]


def family_name(model: str, chosen: str = "", path: str | None = None, local: bool | None = None) -> str:
    """The family of ``model`` (``pretrained.model``): ``chosen`` (``pretrained.family``) when set, else its pipeline
    class's family."""
    if chosen:
        FAMILY_REGISTRY.get(chosen)  # a clear error for an unknown name
        return chosen
    if path is None:
        path, local = locate(model)
    class_name = pipeline_class_name(path, local)
    if class_name not in _BY_PIPELINE_CLASS:
        raise ValueError(
            f"pretrained.model={model!r} is a {class_name}, which no model family handles; families: "
            f"{ {n: c for c, n in _BY_PIPELINE_CLASS.items()} } (or set pretrained.family)"
        )
    return _BY_PIPELINE_CLASS[class_name]


def get_family(name: str):
    """The family class registered under ``name``."""
    return FAMILY_REGISTRY.get(name)


# every module of the package, each registering its family (``@register_family``): adding a family is one file here
FAMILY_MODULES = import_submodules(__name__, __path__)
