"""MeanFlow (Geng et al. 2025, "Mean Flows for One-step Generative Modeling", arXiv 2505.13447), as pure functions.

On the flow path z_t = (1 - t) x + t eps (t = 1: noise) with instantaneous velocity v, the average velocity between
times r < t is u(z_t, r, t) = 1 / (t - r) int_r^t v(z_tau, tau) dtau, so that one step z_r = z_t - (t - r) u(z_t, r, t)
is exact. Differentiating (t - r) u in t gives the MeanFlow identity u = v - (t - r) du/dt, with the total derivative
du/dt = v d_z u + d_t u: the JVP of u along the tangent (v, 0, 1) in (z, r, t). The network is trained to the
stop-gradient target u_tgt = v - (t - r) du/dt (``meanflow_target``) with the adaptive loss weight
w = 1 / (||delta||^2 + c)^p (``adaptive_weight``), at (r, t) drawn logit-normally with a fraction of r = t rows
(``sample_time_pairs``; the paper's ImageNet setting: lognorm(-0.4, 1.0), 25% r != t, p = 1, c = 1e-3).
"""

from __future__ import annotations

import torch


def sample_time_pairs(n: int, logit_mean: float = -0.4, logit_std: float = 1.0, ratio_r_neq_t: float = 0.25,
                      generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(r, t), (n,) float64 each: two logit-normal draws sigmoid(N(logit_mean, logit_std^2)), t the larger and r the
    smaller; then r = t on all but a fraction ``ratio_r_neq_t`` of the rows (MeanFlow sec. 4.3, Table 1)."""
    a, b = (torch.sigmoid(logit_mean + logit_std * torch.randn(n, generator=generator, dtype=torch.float64))
            for _ in range(2))
    t, r = torch.maximum(a, b), torch.minimum(a, b)
    keep = torch.rand(n, generator=generator, dtype=torch.float64) < ratio_r_neq_t
    return torch.where(keep, r, t), t


def meanflow_target(v: torch.Tensor, du_dt: torch.Tensor, r: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """u_tgt = v - (t - r) du/dt (MeanFlow identity, Geng et al. 2025 sec. 4.1), r and t (N,)."""
    return v - (t - r).to(v.dtype).view((-1,) + (1,) * (v.ndim - 1)) * du_dt


def adaptive_weight(squared_error: torch.Tensor, power: float = 1.0, c: float = 1.0e-3) -> torch.Tensor:
    """w = 1 / (||delta||^2 + c)^p per example, detached (MeanFlow sec. 4.3, adaptive loss weighting; p = 0: 1)."""
    return (squared_error.detach() + c).pow(-power)


def meanflow_loss(u: torch.Tensor, target: torch.Tensor, power: float = 1.0, c: float = 1.0e-3) -> torch.Tensor:
    """(N,) sg(w) ||u - sg(u_tgt)||^2 (squared L2 over each example's elements)."""
    squared = (u - target.detach()).flatten(1).pow(2).sum(dim=1)
    return adaptive_weight(squared, power, c) * squared


def meanflow_step(z_t: torch.Tensor, u: torch.Tensor, r, t) -> torch.Tensor:
    """z_r = z_t - (t - r) u(z_t, r, t): one step of the average velocity (one network call); r, t floats or (N,)."""
    d = torch.as_tensor(t - r, dtype=z_t.dtype, device=z_t.device)
    return z_t - (d.view((-1,) + (1,) * (z_t.ndim - 1)) if d.ndim else d) * u


def vp_view(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(c, alpha, sigma) of a VP network's view of the flow sample z_t = (1 - t) x + t eps: c z_t = alpha x + sigma eps
    with c = 1 / sqrt((1 - t)^2 + t^2), alpha = c (1 - t), sigma = c t (noise level sigma / alpha = t / (1 - t))."""
    c = ((1 - t) ** 2 + t ** 2).rsqrt()
    return c, c * (1 - t), c * t


def flow_time_of_level(sigma: float) -> float:
    """The flow time t of noise level sigma = t / (1 - t)."""
    return sigma / (1 + sigma)
