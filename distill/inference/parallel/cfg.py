"""CFG parallelism: the two branches of each classifier-free-guided denoiser call on two ranks.

A guided pipeline calls its denoiser on the doubled batch ``[uncond, cond]`` (N = 2B). A hook on the denoiser
hands each rank its slice of every batched input (rank 0 the unconditional half, rank 1 the conditional one),
runs the network on it and all-gathers the two predictions in rank order, so that the pipeline receives the
prediction of the whole batch and combines it with its own CFG formula; every scheduler and pipeline runs
unchanged, in lockstep on every rank. A call whose batch does not split evenly runs whole on every rank."""

from __future__ import annotations

from typing import Any

import torch

from distill.accelerate.hooks import add_hook, remove_hook
from distill.inference.parallel.group import Group

HOOK = "distill_cfg_parallel"


def _slice(value: Any, n: int, index: slice) -> Any:
    """``value`` with every tensor of leading size ``n`` (in dicts, lists, tuples) cut to ``index``."""
    if torch.is_tensor(value):
        return value[index] if value.dim() > 0 and value.shape[0] == n else value
    if isinstance(value, dict):
        return {k: _slice(v, n, index) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_slice(v, n, index) for v in value)
    return value


def batch_size(args: tuple, kwargs: dict) -> int:
    """The batch size of a denoiser call: its first input (``sample``: a UNet's, ``hidden_states``: a
    transformer's, positional or by name)."""
    sample = args[0] if args else kwargs.get("sample", kwargs.get("hidden_states"))
    return sample.shape[0]


def _prediction(result: Any) -> torch.Tensor:
    return result[0] if isinstance(result, tuple) else result.sample


def _with_prediction(result: Any, prediction: torch.Tensor) -> Any:
    if isinstance(result, tuple):
        return (prediction, *result[1:])
    result.sample = prediction
    return result


class CFGParallel:
    """The denoiser's calls split over the ranks of ``group`` along the batch (``enable`` / ``disable``)."""

    def __init__(self, group: Group):
        self.group = group
        self.denoiser: torch.nn.Module | None = None

    def enable(self, denoiser: torch.nn.Module) -> CFGParallel:
        add_hook(denoiser, HOOK, self._call)
        self.denoiser = denoiser
        return self

    def disable(self) -> None:
        if self.denoiser is not None:
            remove_hook(self.denoiser, HOOK)
            self.denoiser = None

    def _call(self, forward, *args, **kwargs):
        n, ranks = batch_size(args, kwargs), self.group.world_size
        if n % ranks:
            return forward(*args, **kwargs)
        size = n // ranks
        index = slice(self.group.rank * size, (self.group.rank + 1) * size)
        result = forward(*_slice(args, n, index), **_slice(kwargs, n, index))
        return _with_prediction(result, torch.cat(self.group.all_gather(_prediction(result)), dim=0))
