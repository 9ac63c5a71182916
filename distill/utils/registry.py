"""Registries: each kind of part (method, student, family, accelerator, metric) is a :class:`Registry`, and a part
registers itself where it is defined (``@FAMILIES.register("sd")``), so that adding one is one file.

A registry maps a name to the object (a class or a function). It knows the modules of the built-in parts and
imports them on the first lookup (``Registry.load``), so that a lookup never depends on import order; config
choices are generated from ``names()``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any


class Registry:
    """Named parts of one kind. ``register(name)`` is a decorator; ``get(name)`` returns the part, with an error
    naming the known names for an unknown one; ``modules`` are imported on the first lookup (the built-in parts)."""

    def __init__(self, kind: str, modules: tuple[str, ...] = ()):
        self.kind = kind
        self.modules = tuple(modules)
        self._parts: dict[str, Any] = {}
        self._loaded = False

    def register(self, name: str, *, replace: bool = False) -> Callable[[Any], Any]:
        if not name or not isinstance(name, str):
            raise ValueError(f"a {self.kind} needs a non-empty name; got {name!r}")

        def add(part: Any) -> Any:
            old = self._parts.get(name)
            if old is not None and old is not part and not replace and _qualname(old) != _qualname(part):
                raise ValueError(f"{self.kind} {name!r} is already registered by {_qualname(old)}; pick another name "
                                 f"for {_qualname(part)} or pass replace=True")
            self._parts[name] = part
            return part

        return add

    def load(self) -> Registry:
        """Import the built-in modules once (each registers its parts)."""
        if not self._loaded:
            self._loaded = True
            for module in self.modules:
                importlib.import_module(module)
        return self

    def get(self, name: str) -> Any:
        self.load()
        if name not in self._parts:
            raise KeyError(f"unknown {self.kind} {name!r}; registered: {sorted(self._parts)}. Register one with "
                           f"@{self.kind.upper()}S.register({name!r}) in the module that defines it")
        return self._parts[name]

    def names(self) -> list[str]:
        return sorted(self.load()._parts)

    def __contains__(self, name: object) -> bool:
        return name in self.load()._parts

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def items(self) -> list[tuple[str, Any]]:
        self.load()
        return sorted(self._parts.items())


def _qualname(part: Any) -> str:
    return f"{getattr(part, '__module__', '?')}.{getattr(part, '__qualname__', repr(part))}"
