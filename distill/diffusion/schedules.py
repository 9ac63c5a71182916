"""Variance-preserving noise schedules: x_t = alpha_t * x0 + sigma_t * eps (Ho et al. 2020, eq. 4)."""

from __future__ import annotations

import torch


def _expand(v: torch.Tensor, ndim: int) -> torch.Tensor:
    return v.reshape(v.shape + (1,) * (ndim - v.ndim))


def alpha_sigma(
    alphas_cumprod: torch.Tensor, t: torch.Tensor, ndim: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    """alpha_t = sqrt(abar_t), sigma_t = sqrt(1 - abar_t), shaped (N, 1, ..., 1) for broadcasting."""
    abar = alphas_cumprod.to(t.device)[t.long()].float()
    return _expand(abar.sqrt(), ndim), _expand((1.0 - abar).sqrt(), ndim)


def add_noise(x0: torch.Tensor, eps: torch.Tensor, alpha: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Forward process q(x_t | x0), Ho et al. 2020 eq. 4."""
    return alpha * x0 + sigma * eps


def snr(alpha: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Signal-to-noise ratio alpha_t^2 / sigma_t^2 (Kingma et al. 2021, eq. 1)."""
    return alpha.pow(2) / sigma.pow(2)
