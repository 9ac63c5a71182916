"""The diffusers hooks accelerators are made of: a call of a module handed to a function of one's own."""

from __future__ import annotations

import torch
from diffusers.hooks import HookRegistry, ModelHook


class CallHook(ModelHook):
    """A diffusers ``ModelHook`` that hands each forward call to ``fn(original_forward, *args, **kwargs)``."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def new_forward(self, module: torch.nn.Module, *args, **kwargs):
        return self.fn(self.fn_ref.original_forward, *args, **kwargs)


def add_hook(module: torch.nn.Module, name: str, fn) -> None:
    HookRegistry.check_if_exists_or_initialize(module).register_hook(CallHook(fn), name)


def remove_hook(module: torch.nn.Module, name: str) -> None:
    """Remove hook ``name`` of ``module``; it must be the last one registered there (diffusers' registry rewires
    a removed inner hook's wrapper, not the outer hook's reference to it). With none left, ``module.forward`` is
    the class's again."""
    registry = getattr(module, "_diffusers_hook", None)
    if registry is None or registry.get_hook(name) is None:
        return
    if registry._hook_order[-1] != name:
        raise RuntimeError(f"hook {name!r} of {type(module).__name__} is wrapped by {registry._hook_order[-1]!r}; "
                           "remove hooks in the reverse order of adding them")
    registry.remove_hook(name, recurse=False)
    if not registry.hooks:
        module.__dict__.pop("forward", None)
