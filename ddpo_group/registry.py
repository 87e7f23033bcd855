"""A small generic name -> object registry.

Used for advantage estimators and policy losses (and usable for anything else the trainer
wants to look up by a config string)::

    ADV = Registry("advantage estimator")

    @ADV.register("grpo")
    def grpo(inputs, **params): ...

    ADV.get("grpo")      # -> the function
    ADV.get("nope")      # ValueError: unknown advantage estimator 'nope'; registered: [...]
"""

from __future__ import annotations

from typing import Callable, Dict, Iterator, List, TypeVar

T = TypeVar("T")


class Registry:
    """Maps names to objects. Registering a taken name and looking up an unknown name fail."""

    def __init__(self, kind: str):
        self.kind = kind
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

    def names(self) -> List[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
