"""Worlds: each a self-contained configuration of the package (a data set and its evaluation set, the small
networks it ships and the trainers that build them, its metrics, its presets). Generic code names no world: it
reaches one through the config (``_target_`` strings, ``${distill.asset:NAME}``, the option files of
``distill/conf``) and through the registries, which import the modules each world lists for their kind.

A world is a package here that defines ``PARTS`` (kind of registry -> modules that register its parts),
``OPTIONS`` (config group -> option name -> ``_target_``, options with a generated schema), ``ASSET_NAMES`` and
``asset_path(name)`` (its shipped folders). This module imports only those packages' ``__init__`` (no torch).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

WORLDS: tuple[str, ...] = ("distill.worlds.digits",)


def worlds() -> list[ModuleType]:
    return [importlib.import_module(name) for name in WORLDS]


def parts(kind: str) -> tuple[str, ...]:
    """The modules that register the worlds' parts of ``kind`` (a registry's kind: method, student, ...)."""
    return tuple(module for world in worlds() for module in world.PARTS.get(kind, ()))


def options(group: str) -> dict[str, str]:
    """Option name -> ``_target_`` of the worlds' options of config group ``group``."""
    return {name: target for world in worlds() for name, target in world.OPTIONS.get(group, {}).items()}


def asset_path(name: str) -> Path:
    """The folder of the shipped asset ``name`` (``${distill.asset:NAME}``), from the world that ships it."""
    for world in worlds():
        if name in world.ASSET_NAMES:
            return world.asset_path(name)
    known = sorted(asset for world in worlds() for asset in world.ASSET_NAMES)
    raise FileNotFoundError(f"no world ships an asset {name!r}; known assets: {', '.join(known)}")
