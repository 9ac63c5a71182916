"""Samplers of training timesteps t in {0, ..., T-1}."""

from __future__ import annotations

import torch

TIMESTEP_SAMPLERS = ("uniform", "stratified")


def sample_timesteps(
    batch_size: int,
    num_train_timesteps: int,
    method: str = "uniform",
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Draw (N,) integer timesteps.

    ``stratified`` is the low-discrepancy sampler of Kingma et al. 2021 (App. I.1): one uniform
    offset u shared by the batch, t_i = floor(T * ((u + i / N) mod 1)), which covers [0, T) evenly
    and lowers the variance of the batch loss.
    """
    if method == "uniform":
        t = torch.randint(0, num_train_timesteps, (batch_size,), generator=generator)
    elif method == "stratified":
        u = torch.rand((), generator=generator)
        frac = torch.remainder(u + torch.arange(batch_size) / batch_size, 1.0)
        t = (frac * num_train_timesteps).long().clamp_(max=num_train_timesteps - 1)
    else:
        raise ValueError(f"timestep sampler {method!r} is not supported; use one of {TIMESTEP_SAMPLERS}")
    return t.to(device)
