"""Plugin lookup shared by reward and prompt functions.

A spec string names an object in one of three ways, tried in this order:

1. a name in the registry (``"jpeg_compressibility"``);
2. an import path ``"package.module:attribute"`` (the module must be importable, e.g. on
   ``PYTHONPATH``) or a file path ``"/path/to/file.py:attribute"``;
3. the name of an entry point of an installed package in ``group`` (importlib.metadata), e.g.
   in the plugin package's pyproject.toml::

       [project.entry-points."ddpo_group.rewards"]
       my_reward = "my_package.rewards:make_my_reward"
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from importlib import metadata
from pathlib import Path

from ddpo_group.registry import Registry


def entry_point_names(group: str) -> list[str]:
    """Names of the installed entry points in ``group``."""
    return sorted(ep.name for ep in metadata.entry_points(group=group))


def load_entry_point(group: str, name: str):
    """The object of entry point ``name`` in ``group``, or None when no installed package provides it."""
    for ep in metadata.entry_points(group=group):
        if ep.name == name:
            return ep.load()
    return None


def load_from_path(spec: str):
    """The attribute named by ``"package.module:attribute"`` or ``"/path/file.py:attribute"``."""
    module_name, _, attribute = spec.rpartition(":")
    if not module_name or not attribute:
        raise ValueError(f"{spec!r} is not of the form 'package.module:attribute' or '/path/file.py:attribute'")
    if module_name.endswith(".py"):
        path = Path(module_name).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"{spec!r}: file {str(path)!r} does not exist")
        unique = f"ddpo_group_plugin_{abs(hash(str(path.resolve())))}"
        module = sys.modules.get(unique)
        if module is None:
            module_spec = importlib.util.spec_from_file_location(unique, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[unique] = module
            module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            raise ModuleNotFoundError(
                f"{spec!r}: cannot import module {module_name!r} ({error}); is it installed or on PYTHONPATH?"
            ) from error
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise AttributeError(f"{spec!r}: module {module_name!r} has no attribute {attribute!r}") from None


def resolve(spec: str, registry: Registry, group: str):
    """The object ``spec`` names: registry name, import/file path, or entry point of ``group`` (in that order)."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"{registry.kind} must be a non-empty string, got {spec!r}")
    if spec in registry:
        return registry.get(spec)
    if ":" in spec:
        return load_from_path(spec)
    found = load_entry_point(group, spec)
    if found is not None:
        return found
    raise ValueError(
        f"unknown {registry.kind} {spec!r}; registered: {registry.names()}; installed plugins "
        f"(entry point group {group!r}): {entry_point_names(group)}; or give 'package.module:function'"
    )
