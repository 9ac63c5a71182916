"""Registries: each kind of part (method, student, family, accelerator, metric) is a :class:`Registry`, and a part
registers itself where it is defined (``@FAMILIES.register("sd")``), so that adding one is one file.

A registry maps a name to the object (a class or a function). It knows the modules of the built-in parts and
imports them on the first lookup (``Registry.load``), with the modules of the same kind that each world lists
(``distill.worlds.parts(kind)``: a world's asset trainers, its students), so that a lookup never depends on
import order; config
choices are generated from ``names()``. ``register(name, **meta)`` keeps what the config needs to know of a part
beyond its signature (``meta(name)``: e.g. the fixed choices of a string argument).

Plugins: the environment variable ``DISTILL_PLUGINS`` names modules (comma-separated, as ``PYTEST_PLUGINS`` does
for pytest) imported before the first lookup of any registry, so that a part registered in a file of one's own is
selectable by name like a built-in one, with no edit of the package::

    DISTILL_PLUGINS=tests.examples.toy_metric python -m distill.evaluate pipeline=... eval.metrics=[fid,toy]

The commands read their config choices from the registries before Hydra composes the config, so a plugin must
be named by the environment (not by an override); it is imported from ``sys.path`` (``python -m`` puts the
working directory first).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator
from typing import Any


class Registry:
    """Named parts of one kind. ``register(name)`` is a decorator; ``get(name)`` returns the part, with an error
    naming the known names for an unknown one; ``modules`` are imported on the first lookup (the built-in parts)."""

    def __init__(self, kind: str, modules: tuple[str, ...] = (), *, ordered: bool = False):
        self.kind = kind
        self.modules = tuple(modules)
        self.ordered = ordered  # names() in registration order (the metrics' column order) instead of sorted
        self._parts: dict[str, Any] = {}
        self._meta: dict[str, dict[str, Any]] = {}
        self._replaced: set[str] = set()  # names a part took with replace=True: it stays against a later plain one
        self._loaded = False
        self._loading = False  # a lookup while the modules import (one of them reads it) sees the parts so far

    def register(self, name: str, *, replace: bool = False, **meta: Any) -> Callable[[Any], Any]:
        """Decorator: ``part`` is this registry's ``name``. Another part under a taken name is an error, unless one
        of the two is registered with ``replace=True``: that one is kept, whichever comes first (a plugin, imported
        before the built-in modules, replaces a built-in part)."""
        if not name or not isinstance(name, str):
            raise ValueError(f"a {self.kind} needs a non-empty name; got {name!r}")

        def add(part: Any) -> Any:
            old = self._parts.get(name)
            if old is not None and old is not part and not replace and _qualname(old) != _qualname(part):
                if name in self._replaced:
                    return part  # the replacement registered first stays
                raise ValueError(f"{self.kind} {name!r} is already registered by {_qualname(old)}; pick another name "
                                 f"for {_qualname(part)}, or replace it with @{self.plural.upper()}.register({name!r}, "
                                 "replace=True)")
            if replace:
                self._replaced.add(name)
            self._parts[name] = part
            self._meta[name] = meta
            return part

        return add

    @property
    def plural(self) -> str:
        """The kind in the plural, as the registries are named (family: FAMILIES)."""
        return f"{self.kind[:-1]}ies" if self.kind.endswith("y") else f"{self.kind}s"

    def unregister(self, name: str) -> Any:
        """Remove ``name`` (a test's temporary part) and return it."""
        self._meta.pop(name, None)
        self._replaced.discard(name)
        return self._parts.pop(name)

    def load(self) -> Registry:
        """Import the plugins (``DISTILL_PLUGINS``), the built-in modules and the worlds' modules of this kind
        once (each registers its parts). The registry counts as loaded once every import succeeded: after a failed
        one, the next lookup tries again (and fails again, naming the module) instead of answering with the parts
        registered so far."""
        if not (self._loaded or self._loading):
            self._loading = True
            try:
                load_plugins()
                worlds = importlib.import_module(WORLDS_PACKAGE)  # a table of module names: imports no part
                for module in (*self.modules, *worlds.parts(self.kind)):
                    importlib.import_module(module)
                self._loaded = True
            finally:
                self._loading = False
        return self

    def get(self, name: str) -> Any:
        self.load()
        if name not in self._parts:
            raise KeyError(f"unknown {self.kind} {name!r}; registered: {sorted(self._parts)}. Register one with "
                           f"@{self.plural.upper()}.register({name!r}) in the module that defines it")
        return self._parts[name]

    def meta(self, name: str) -> dict[str, Any]:
        """What ``register(name, **meta)`` was given besides the part."""
        self.get(name)
        return dict(self._meta[name])

    def name_of(self, part: Any) -> str | None:
        """The name ``part`` is registered under (None: not registered here)."""
        return next((name for name, known in self.items() if known is part), None)

    def names(self) -> list[str]:
        self.load()
        return list(self._parts) if self.ordered else sorted(self._parts)

    def __getitem__(self, name: str) -> Any:
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self.load()._parts

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.load()._parts)

    def items(self) -> list[tuple[str, Any]]:
        return [(name, self._parts[name]) for name in self.names()]


WORLDS_PACKAGE = "distill.worlds"  # named, not imported: a world's parts sit in the layers above this module
PLUGINS_VARIABLE = "DISTILL_PLUGINS"
_plugins_loaded: set[str] = set()


def plugin_modules() -> list[str]:
    """The module names ``DISTILL_PLUGINS`` holds (comma-separated; blanks ignored)."""
    return [name.strip() for name in os.environ.get(PLUGINS_VARIABLE, "").split(",") if name.strip()]


def load_plugins() -> list[str]:
    """Import each module ``DISTILL_PLUGINS`` names (once per process); returns the names."""
    names = plugin_modules()
    for name in names:
        if name in _plugins_loaded:
            continue
        try:
            importlib.import_module(name)
        except ImportError as err:
            missing = getattr(err, "name", None)
            if isinstance(err, ModuleNotFoundError) and missing and (name + ".").startswith(missing + "."):
                raise ImportError(f"{PLUGINS_VARIABLE}={os.environ[PLUGINS_VARIABLE]!r} names {name!r}, which cannot "
                                  f"be imported ({err}); give dotted module names importable from sys.path, e.g. "
                                  f"{PLUGINS_VARIABLE}=tests.examples.toy_metric from the repository root") from err
            raise ImportError(f"{PLUGINS_VARIABLE}: the plugin {name!r} was found but an import in it failed ({err}); "
                              "fix the plugin or install what it imports") from err
        _plugins_loaded.add(name)
    return names


def _qualname(part: Any) -> str:
    return f"{getattr(part, '__module__', '?')}.{getattr(part, '__qualname__', repr(part))}"
