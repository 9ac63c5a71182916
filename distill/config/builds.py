"""Config schemas generated from the constructors they build, so that every default lives in one place.

``builds("ImageFolderDataConfig", "distill.data.ImageFolderDataModule")`` is a dataclass whose fields are the
constructor's parameters with their defaults (``???`` where the parameter has none) and their types, narrowed to
what OmegaConf can hold (``Any`` for objects such as an optimizer or a teacher). A fixed set of strings becomes a
``Choice`` (a ``StrEnum``), so that Hydra itself rejects any other value, naming the key and the allowed values;
a ``typing.Literal`` of strings, which OmegaConf 2.3 cannot hold, becomes a ``Choice`` too.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import enum
import inspect
import sys
import types
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from hydra.utils import get_object
from omegaconf import MISSING, DictConfig, OmegaConf


class Choice(enum.StrEnum):
    """One of a fixed set of strings; each member's name is its value, as the YAML and the command line spell it."""


def choice(name: str, values: Iterable[str]) -> type[Choice]:
    """The ``Choice`` named ``name`` over ``values``, created once (the same name always means the same set)."""
    values = tuple(values)
    module = sys.modules[__name__]
    existing = getattr(module, name, None)
    if existing is not None:
        if [m.value for m in existing] != list(values):
            raise ValueError(f"choice {name!r} already holds {[m.value for m in existing]}, not {list(values)}")
        return existing
    made = Choice(name, [(v, v) for v in values], module=__name__, qualname=name)
    setattr(module, name, made)  # importable by name: configs pickle (submitit) with their types
    return made


def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.split("_"))


def _hints(fn: Callable) -> dict[str, Any]:
    """The parameters' annotations as objects; one that names a type imported only for type checking is Any."""
    try:
        return typing.get_type_hints(fn)
    except (NameError, TypeError):
        namespace = getattr(inspect.unwrap(fn), "__globals__", {})
        hints = {}
        for name, annotation in getattr(fn, "__annotations__", {}).items():
            try:
                hints[name] = eval(annotation, namespace) if isinstance(annotation, str) else annotation
            except (NameError, TypeError, AttributeError):
                hints[name] = Any
        return hints


def _field_type(hint: Any, enum_name: str) -> Any:
    """The nearest type OmegaConf holds: objects, callables and unions of several types become Any."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        inner = _field_type(rest[0], enum_name) if len(rest) == 1 else Any
        return Any if inner is Any else inner | None
    if origin is typing.Literal:
        return choice(enum_name, args) if all(isinstance(a, str) for a in args) else Any
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):  # a group of options: a nested schema
        return hint
    if hint in (int, float, bool, str, bytes, Path) or (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        return hint
    if origin in (list, tuple, collections.abc.Sequence, collections.abc.MutableSequence):
        items = {a for a in args if a is not Ellipsis}
        item = _field_type(items.pop(), enum_name) if len(items) == 1 else Any
        return list[item]
    if origin in (dict, collections.abc.Mapping) and args and args[0] is str:
        return dict[str, _field_type(args[1], enum_name)]
    return Any


def _field(value: Any, kind: Any, where: str) -> dataclasses.Field:
    if value is inspect.Parameter.empty:
        return dataclasses.field(default=MISSING)
    if isinstance(value, tuple | list):
        return dataclasses.field(default_factory=lambda items=tuple(value): list(items))
    if isinstance(value, dict):
        return dataclasses.field(default_factory=lambda items=value: dict(items))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.field(default_factory=lambda v=value: dataclasses.replace(v))
    if isinstance(kind, type) and issubclass(kind, Choice) and isinstance(value, str):
        return dataclasses.field(default=kind(value))
    if value is None or isinstance(value, int | float | bool | str | bytes | enum.Enum):
        return dataclasses.field(default=value)
    raise TypeError(f"{where} defaults to {value!r}, which a config cannot hold; exclude it from the schema")


def parameters(target: Callable, kwargs_of: Callable | None = None) -> list[inspect.Parameter]:
    """The keyword parameters of ``target`` (its ``**kwargs`` replaced by those of ``kwargs_of``)."""
    params = [p for p in inspect.signature(target).parameters.values() if p.kind != p.VAR_POSITIONAL]
    if any(p.kind == p.VAR_KEYWORD for p in params) and kwargs_of is not None:
        named = {p.name for p in params}
        params += [p for p in parameters(kwargs_of) if p.name not in named]
    return [p for p in params if p.kind not in (p.VAR_KEYWORD, p.POSITIONAL_ONLY)]


def builds(name: str, target: str, *, exclude: Iterable[str] = (), choices: dict[str, type[Choice]] | None = None,
           kwargs_of: str | None = None, partial: bool = False, convert: str | None = None,
           module: str | None = None) -> type:
    """The dataclass ``name`` (a schema of the ``_target_`` ``target``): one field per keyword parameter with the
    constructor's own default and type. ``exclude`` names the arguments the caller passes at run time (the
    teacher, the student, ...); ``choices`` types a string parameter as a fixed set; ``kwargs_of`` names the
    callable that a ``**kwargs`` parameter is passed on to (its parameters join the schema). The schema's
    ``__builds__`` records ``(target, kwargs_of)`` for the test that its defaults are the constructor's."""
    fn = get_object(target)
    source = get_object(kwargs_of) if kwargs_of else None
    init = fn.__init__ if isinstance(fn, type) else fn
    hints = {**(_hints(source.__init__ if isinstance(source, type) else source) if source else {}), **_hints(init)}
    params = parameters(fn, source)
    exclude, choices = set(exclude), dict(choices or {})
    unknown = (exclude | set(choices)) - {p.name for p in params}
    if unknown:
        raise ValueError(f"{target} has no parameter(s) {sorted(unknown)}")
    fields: list[tuple] = [("_target_", str, dataclasses.field(default=target))]
    if partial:
        fields.append(("_partial_", bool, dataclasses.field(default=True)))
    if convert:
        fields.append(("_convert_", str, dataclasses.field(default=convert)))
    for p in params:
        if p.name in exclude:
            continue
        kind = choices.get(p.name) or _field_type(hints.get(p.name, Any), name.removesuffix("Config") + _camel(p.name))
        if p.name in choices and p.default is None:
            kind = kind | None
        chosen = typing.get_args(kind)[0] if typing.get_origin(kind) is types.UnionType else kind
        fields.append((p.name, kind, _field(p.default, chosen, f"{target}({p.name}=...)")))
    module = module or sys._getframe(1).f_globals["__name__"]  # the module that names the schema (pickling)
    schema = dataclasses.make_dataclass(name, fields, namespace={"__module__": module, "__builds__": (target, kwargs_of)})
    schema.__doc__ = f"Schema of ``{target}``, generated from its signature (distill.config.builds)."
    return schema


def registered(registry, suffix: str, *, passed: Iterable[str] = (), partial_if: str | None = None,
               kwargs_of: str | None = None, module: str | None = None,
               only: Iterable[str] | None = None) -> dict[str, type]:
    """A schema per part of ``registry`` (a ``distill.utils.registry.Registry``): option name -> ``builds`` of the
    part, named ``<Name><suffix>`` (``consistency`` -> ``ConsistencyMethodConfig``) and set on ``module`` (the caller's)
    so that configs pickle. ``passed`` names the arguments the caller passes at run time, excluded where the part
    takes them; a part that takes ``partial_if`` is a partial (a student made from the teacher's network).
    ``kwargs_of`` is the default callable that a part's ``**kwargs`` goes to. The part's registration may give ``choices``
    (argument -> its fixed values), ``kwargs_of`` and ``convert`` (``@STUDENTS.register("clip", kwargs_of=...)``).
    ``only``: these names alone (the parts registered since the first call)."""
    module = module or sys._getframe(1).f_globals["__name__"]
    only = None if only is None else set(only)
    schemas = {}
    for name, part in registry.items():
        if only is not None and name not in only:
            continue
        meta = registry.meta(name)
        schema_name = f"{_camel(name)}{suffix}"
        takes = inspect.signature(part).parameters
        choices = {key: choice(f"{schema_name.removesuffix('Config')}{_camel(key)}", values)
                   for key, values in meta.get("choices", {}).items()}
        variadic = any(p.kind == p.VAR_KEYWORD for p in takes.values())
        source = meta.get("kwargs_of", kwargs_of if variadic else None)
        schema = builds(schema_name, _path(part), exclude=[p for p in passed if p in takes], choices=choices,
                        kwargs_of=_path(source) if source is not None else None, partial=partial_if in takes,
                        convert=meta.get("convert"), module=module)
        setattr(sys.modules[module], schema_name, schema)
        schemas[name] = schema
    return schemas


def _path(obj: Any) -> str:
    """The dotted path of a class or function (a string is one already)."""
    return obj if isinstance(obj, str) else f"{obj.__module__}.{obj.__qualname__}"


def plain_choices(cfg: DictConfig) -> DictConfig:
    """``cfg`` with every ``Choice`` as its plain string, in struct mode as before: what the objects, the
    loggers and the checkpoints (read back weights-only) receive. Interpolations are left unresolved."""
    plain = OmegaConf.create(OmegaConf.to_container(cfg, enum_to_str=True))
    OmegaConf.set_struct(plain, True)
    return plain
