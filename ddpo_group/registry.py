"""Names to objects, and the plugins that extend them: one resolver for rewards, prompts, estimators and losses.

A registry maps names to objects; ``resolve(spec)`` finds what a config string names, tried in this order:

1. a name in the registry (``"jpeg_compressibility"``, ``"grpo"``);
2. an import path ``"package.module:attribute"`` (the module must be importable, e.g. on ``PYTHONPATH``)
   or a file path ``"/path/to/file.py:attribute"``;
3. the name of an entry point of an installed package in the registry's entry point group, e.g. in the
   plugin package's pyproject.toml::

       [project.entry-points."ddpo_group.rewards"]
       my_reward = "my_package.rewards:make_my_reward"

::

    ADV = Registry("advantage estimator", entry_point_group="ddpo_group.adv_estimators")

    @ADV.register("grpo")
    def grpo(inputs, **params): ...

    ADV.get("grpo")                  # -> the function
    ADV.resolve("/tmp/my.py:mine")   # -> the attribute ``mine`` of that file
    ADV.get("nope")                  # ValueError: unknown advantage estimator 'nope'; registered: [...]
"""

from __future__ import annotations

import importlib
import inspect
import importlib.util
import sys
from importlib import metadata
from pathlib import Path
from typing import Callable, Dict, Iterator, List, TypeVar

T = TypeVar("T")


class Registry:
    """Maps names to objects. Registering a taken name and looking up an unknown name fail."""

    def __init__(self, kind: str, entry_point_group: str | None = None):
        self.kind = kind
        self.entry_point_group = entry_point_group
        self._items: Dict[str, object] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator registering its target under ``name``; ValueError if the name is taken."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def decorator(obj: T) -> T:
            if name in self._items:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered (by {self._items[name]!r}); "
                    f"choose another name"
                )
            self._items[name] = obj
            return obj

        return decorator

    def get(self, name: str):
        """The object registered under ``name``; ValueError listing the registered names if unknown."""
        try:
            return self._items[name]
        except (KeyError, TypeError):
            raise ValueError(
                f"unknown {self.kind} {name!r}; registered: {self.names()}"
            ) from None

    def resolve(self, spec: str):
        """The object ``spec`` names: registry name, import/file path, or entry point (in that order)."""
        if not isinstance(spec, str) or not spec:
            raise ValueError(f"{self.kind} must be a non-empty string, got {spec!r}")
        if spec in self:
            return self.get(spec)
        if ":" in spec:
            return load_from_path(spec)
        group = self.entry_point_group
        found = load_entry_point(group, spec) if group else None
        if found is not None:
            return found
        installed = f"; installed plugins (entry point group {group!r}): {entry_point_names(group)}" if group else ""
        raise ValueError(
            f"unknown {self.kind} {spec!r}; registered: {self.names()}{installed}; or give 'package.module:function' "
            "or '/path/file.py:function'"
        )

    def resolve_spec(self, spec: str, spec_type: type, wrap: Callable):
        """``resolve(spec)`` as a ``spec_type``: a registered or decorated one as it is, a plain function through
        ``wrap(function, spec)`` (a plugin that declared nothing)."""
        found = self.resolve(spec)
        if isinstance(found, spec_type):
            return found
        if not callable(found):
            raise TypeError(f"{self.kind} {spec!r} is a {type(found).__name__}, not a function")
        return wrap(found, spec)

    def names(self) -> List[str]:
        return sorted(self._items)

    def in_order(self) -> list:
        """The registered objects in the order they were registered."""
        return list(self._items.values())

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"


def import_submodules(package: str, path, programs: tuple[str, ...] = ()) -> list[str]:
    """Import every module (not subpackage) of ``package`` found on its ``path`` (``__path__``), in name order, so that
    the decorators in them register what they define: a reward or a model family is one file dropped into
    ddpo_group/rewards/ or ddpo_group/models/families/. The imported modules' full names are returned.

    ``programs``: modules that are run with ``python -m`` and register nothing; they are left out, as runpy warns about
    a module its package imported before running it. A module imports its optional dependencies (models, engines)
    where it uses them, so that importing it needs none of them; an error while importing a module is raised as is."""
    import pkgutil

    names = [f"{package}.{info.name}" for info in pkgutil.iter_modules(path)
             if not info.ispkg and info.name not in programs]
    for name in names:
        importlib.import_module(name)
    return names


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
        if module is None:  # loaded once per process: every resolve of the file returns the same objects
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


def read_field(config, dotted: str):
    """The value of a dotted config field, ``read_field(config, "train.scale_rewards")``; KeyError naming it."""
    value = config
    for part in dotted.split("."):
        try:
            value = value[part]
        except (KeyError, TypeError, AttributeError):
            raise KeyError(f"the config has no field {dotted!r}") from None
    return value


def accepted_keywords(fn, skip: tuple = ()) -> list[str] | None:
    """The keyword arguments ``fn`` accepts, without ``skip``; None when it accepts any (``**kwargs``, or a callable
    without an introspectable signature)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in skip]


def keyword_errors(fn, kwargs, field: str, label: str, skip: tuple = ()) -> list[str]:
    """One message per keyword of ``kwargs`` that ``fn`` does not take, naming the config field, the function
    (``label``) and the keywords it takes: ``prompt_fn_kwargs.path: prompt_fn 'simple_animals' takes no keyword
    'path'; its keywords: []``."""
    allowed = accepted_keywords(fn, skip)
    if allowed is None:
        return []
    return [f"{field}.{key}: {label} takes no keyword {key!r}; its keywords: {allowed}"
            for key in kwargs if key not in allowed]
