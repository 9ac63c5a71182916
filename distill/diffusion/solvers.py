"""Deterministic ODE solver steps on the variance-preserving schedule x_t = alpha_t x0 + sigma_t eps."""

from __future__ import annotations

import torch


def ddim_step(x0_pred: torch.Tensor, eps_pred: torch.Tensor, alpha_prev: torch.Tensor, sigma_prev: torch.Tensor) -> torch.Tensor:
    """Deterministic DDIM update to an earlier time s: x_s = alpha_s x0 + sigma_s eps (Song et al. 2021, eq. 12, eta=0)."""
    return alpha_prev * x0_pred + sigma_prev * eps_pred
