"""Facts about the optimizer step that just ran, shared by the EMA callback and the methods' EMA targets."""

from __future__ import annotations

import torch


def has_gradients(module: torch.nn.Module) -> bool:
    """Whether the optimizer step that just ran moved ``module``: the non-finite guard skips a step by dropping
    every gradient, and Lightning zeroes gradients only before the next backward."""
    return any(p.grad is not None for p in module.parameters())
