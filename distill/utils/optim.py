"""Facts about the optimizer step that just ran, shared by the EMA callback and the methods' EMA targets."""

from __future__ import annotations

import torch


def has_gradients(module: torch.nn.Module) -> bool:
    """Whether the optimizer step that just ran moved ``module``: the non-finite guard skips a step by dropping
    every gradient, and Lightning zeroes gradients only before the next backward."""
    return any(p.grad is not None for p in module.parameters())


@torch.no_grad()
def ema_update_(average: torch.nn.Module, live: torch.nn.Module, weight: float, buffers: bool = True) -> None:
    """``average <- average + weight * (live - average)`` for every floating-point tensor in one fused
    ``torch._foreach_lerp_`` (weight = 1 - decay); integer tensors (counters) are copied. With ``buffers`` the
    whole state dict is averaged (the EMA callback), without it the parameters only (a consistency target)."""
    if buffers:
        pairs = list(zip(average.state_dict().values(), live.state_dict().values()))
    else:
        pairs = list(zip(average.parameters(), live.parameters()))
    floats = [(a, b.to(a.dtype)) for a, b in pairs if a.dtype.is_floating_point]
    if floats:
        targets, sources = zip(*floats)
        torch._foreach_lerp_(list(targets), list(sources), weight)
    for a, b in pairs:
        if not a.dtype.is_floating_point:
            a.copy_(b)
