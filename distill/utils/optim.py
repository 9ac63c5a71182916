"""Facts about the optimizer step that just ran, shared by the EMA callback and the methods' EMA targets."""

from __future__ import annotations

import torch


def has_gradients(module: torch.nn.Module) -> bool:
    """Whether the optimizer step that just ran moved ``module``: the non-finite guard skips a step by dropping
    every gradient (on the host), and Lightning zeroes gradients only before the next backward. Under a method
    with several roles each role's update runs with only its own parameters requiring gradients, so another
    role's update neither gives ``module`` gradients nor drops them."""
    return any(p.grad is not None for p in module.parameters())


def step_applied(pl_module, module: torch.nn.Module) -> bool | torch.Tensor:
    """Whether the optimizer step that just ran moved ``module``: ``False`` when the non-finite guard skipped it
    on the host (every gradient dropped); when the guard skips on the device (an optimizer that takes
    ``found_inf``, as AMP's GradScaler uses it), a 0-dim float tensor on the device, 1 for a step that ran and 0
    for a skipped one, so that what follows the step (EMA updates) can be masked without a host sync."""
    if not has_gradients(module):
        return False
    mask = getattr(pl_module, "step_applied_mask", None)
    return True if mask is None else mask


@torch.no_grad()
def ema_update_(average: torch.nn.Module, live: torch.nn.Module, weight: float | torch.Tensor,
                buffers: bool = True) -> None:
    """``average <- average + weight * (live - average)`` for every floating-point tensor in one fused
    ``torch._foreach_lerp_`` (weight = 1 - decay); integer tensors (counters) are copied. With ``buffers`` the
    whole state dict is averaged (the EMA callback), without it the parameters only (a consistency target).
    ``weight`` may be a 0-dim tensor on the device (a weight masked by ``step_applied``): a zero weight leaves
    the average and its counters as they were."""
    from distill.utils.sharding import local, reshard

    reshard(average)  # sharded networks: both sides in their shards
    reshard(live)
    if buffers:
        pairs = list(zip(average.state_dict().values(), live.state_dict().values()))
    else:
        pairs = list(zip(average.parameters(), live.parameters()))
    # sharded (FSDP) networks: both sides hold the same shards, averaged in place on each rank
    pairs = [(local(a), local(b)) for a, b in pairs]
    floats = [(a, b.to(a.dtype)) for a, b in pairs if a.dtype.is_floating_point]
    if floats:
        targets, sources = (list(t) for t in zip(*floats))
        if isinstance(weight, torch.Tensor):  # _foreach_lerp_ would read a tensor weight on the host (.item())
            steps = torch._foreach_sub(sources, targets)
            torch._foreach_mul_(steps, weight.to(targets[0].dtype))
            torch._foreach_add_(targets, steps)
        else:
            torch._foreach_lerp_(targets, sources, weight)
    for a, b in pairs:
        if not a.dtype.is_floating_point:
            a.copy_(b if not isinstance(weight, torch.Tensor) else torch.where(weight > 0, b.to(a.device), a))
