"""TrigFlow and the continuous-time consistency loss (Lu & Song 2024, "Simplifying, Stabilizing and Scaling
Continuous-Time Consistency Models", arXiv 2410.11081), as pure functions.

TrigFlow (sec. 2): x_t = cos(t) x0 + sin(t) z, z ~ N(0, sigma_d^2 I), t in [0, pi/2]; the PF-ODE dx_t/dt =
sigma_d F(x_t / sigma_d, t) with F the network, and the consistency function f(x_t, t) = cos(t) x_t - sin(t) sigma_d
F (sec. 3; f(x, 0) = x exactly). With z = sigma_d eps the conditional velocity
is dx_t/dt = cos(t) z - sin(t) x0, so F = cos(t) eps - sin(t) x0 / sigma_d: a teacher's (x0, eps) at the same point
gives its TrigFlow prediction, whatever it was trained to predict (``trigflow_from_x0_eps``).

The same point in a teacher's own parametrisation x = a x0 + b eps is x = c x_t with a = c cos t, b = c sigma_d sin t:
a VP teacher (a^2 + b^2 = 1) sees c = 1 / sqrt(cos^2 t + sigma_d^2 sin^2 t) at noise level sigma = sigma_d tan t
(``vp_view``); a flow teacher ((1 - s) x0 + s eps) sees c = 1 / (cos t + sigma_d sin t) at flow time s = c sigma_d sin t
(``flow_view``). With sigma_d = 1 a VP teacher's sample is the TrigFlow sample itself (c = 1, alpha = cos t).
"""

from __future__ import annotations

import math

import torch


def _b(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(N,) times shaped (N, 1, ..., 1) to broadcast against ``like``, in its dtype."""
    return t.to(like.dtype).view((-1,) + (1,) * (like.ndim - 1))


def trigflow_sample(x0: torch.Tensor, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = cos(t) x0 + sin(t) z (sCM sec. 2, TrigFlow); z ~ N(0, sigma_d^2 I)."""
    return _b(t.cos(), x0) * x0 + _b(t.sin(), x0) * z


def trigflow_velocity(x0: torch.Tensor, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """dx_t/dt = cos(t) z - sin(t) x0 of one path (sCT's tangent input, sCM Algorithm 1)."""
    return _b(t.cos(), x0) * z - _b(t.sin(), x0) * x0


def consistency_function(x_t: torch.Tensor, F: torch.Tensor, t: torch.Tensor, sigma_d: float) -> torch.Tensor:
    """f(x_t, t) = cos(t) x_t - sin(t) sigma_d F (sCM sec. 3); f(x, 0) = x exactly."""
    return _b(t.cos(), x_t) * x_t - _b(t.sin(), x_t) * sigma_d * F


def trigflow_from_x0_eps(x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor, sigma_d: float) -> torch.Tensor:
    """F = cos(t) eps - sin(t) x0 / sigma_d: the TrigFlow prediction of a model's (x0, eps) at x_t (sigma_d F is the
    expected velocity cos(t) z - sin(t) x0 with z = sigma_d eps)."""
    return _b(t.cos(), x0) * eps - _b(t.sin(), x0) * x0 / sigma_d


def x0_eps_from_trigflow(F: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor, sigma_d: float
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x0, eps) of a TrigFlow prediction F at x_t: x0 = f(x_t, t) = cos(t) x_t - sin(t) sigma_d F, eps = sin(t) x_t /
    sigma_d + cos(t) F (the inverse of ``trigflow_from_x0_eps`` given x_t = cos(t) x0 + sin(t) sigma_d eps)."""
    cos, sin = _b(t.cos(), x_t), _b(t.sin(), x_t)
    return cos * x_t - sin * sigma_d * F, sin * x_t / sigma_d + cos * F


def noise_level(t: torch.Tensor, sigma_d: float) -> torch.Tensor:
    """The EDM noise level sigma = sigma_d tan(t) of TrigFlow time t (x_t / cos t = x0 + sigma eps)."""
    return sigma_d * t.tan()


def time_at(sigma: torch.Tensor, sigma_d: float) -> torch.Tensor:
    """TrigFlow time t = arctan(sigma / sigma_d) of noise level sigma (sCM sec. 2: t = arctan(e^tau / sigma_d))."""
    return torch.atan(sigma / sigma_d)


def vp_view(t: torch.Tensor, sigma_d: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(c, alpha, sigma) of the VP sample c x_t = alpha x0 + sigma eps at TrigFlow time t: c = 1 / sqrt(cos^2 t +
    sigma_d^2 sin^2 t), alpha = c cos t, sigma = c sigma_d sin t (alpha^2 + sigma^2 = 1)."""
    cos, sin = t.cos(), t.sin()
    c = (cos ** 2 + sigma_d ** 2 * sin ** 2).rsqrt()
    return c, c * cos, c * sigma_d * sin


def flow_view(t: torch.Tensor, sigma_d: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(c, s) of the flow sample c x_t = (1 - s) x0 + s eps at TrigFlow time t: c = 1 / (cos t + sigma_d sin t), flow
    time s = c sigma_d sin t (s = 1 at t = pi/2)."""
    cos, sin = t.cos(), t.sin()
    c = 1.0 / (cos + sigma_d * sin)
    return c, c * sigma_d * sin


def flow_time_to_trigflow(s: torch.Tensor, sigma_d: float) -> torch.Tensor:
    """TrigFlow time of flow time s: tan t = s / (sigma_d (1 - s)) (the same noise level)."""
    return torch.atan2(s, sigma_d * (1 - s))


def tangent_warmup(step: int, warmup_steps: int) -> float:
    """r = min(1, step / H) (sCM sec. 4.2, tangent warmup; H = 10,000 in the paper); 1 without warm-up."""
    return 1.0 if warmup_steps <= 0 else min(1.0, step / warmup_steps)


def scm_tangent(F_minus: torch.Tensor, dF_dt: torch.Tensor, x_t: torch.Tensor, dx_dt: torch.Tensor, t: torch.Tensor,
                sigma_d: float, r: float = 1.0) -> torch.Tensor:
    """g = cos(t) df-/dt with the warm-up r on its second term: -cos^2(t) (sigma_d F- - dx_t/dt) - r cos(t) sin(t)
    (x_t + sigma_d dF-/dt) (sCM Algorithm 1; df/dt of f = cos(t) x_t - sin(t) sigma_d F along the PF-ODE is
    -cos(t) (sigma_d F - dx_t/dt) - sin(t) (x_t + sigma_d dF/dt), sec. 4)."""
    cos, sin = _b(t.cos(), x_t), _b(t.sin(), x_t)
    return -cos ** 2 * (sigma_d * F_minus - dx_dt) - r * cos * sin * (x_t + sigma_d * dF_dt)


def normalize_tangent(g: torch.Tensor, c: float = 0.1) -> torch.Tensor:
    """g / (||g|| + c) per example (sCM sec. 4.2, tangent normalisation; c = 0.1); ``c`` <= 0: g unchanged."""
    if c <= 0:
        return g
    norm = g.flatten(1).norm(dim=1)
    return g / _b(norm + c, g)


def scm_loss(F: torch.Tensor, F_minus: torch.Tensor, g: torch.Tensor, log_weight: torch.Tensor) -> torch.Tensor:
    """(N,) e^{w(t)} / D ||F - F- - g||^2 - w(t) (sCM Algorithm 1 with the adaptive weighting w_phi of sec. 4.3): the
    gradient to F is the continuous-time consistency gradient, the one to w learns the loss's scale per time."""
    d = F[0].numel()
    residual = (F - F_minus - g).flatten(1).pow(2).sum(dim=1)
    return log_weight.exp() / d * residual - log_weight


class AdaptiveWeighting(torch.nn.Module):
    """w_phi(t), the learned log-weight of sCM sec. 4.3 (EDM2's uncertainty weighting, Karras et al. 2024): Fourier
    features of c_noise = log(sigma_d tan t) / 4 with fixed random frequencies and phases (buffers, checkpointed), then
    a linear map to one scalar, zero-initialised (w = 0: every time weighted 1 at the start)."""

    def __init__(self, channels: int = 128, sigma_d: float = 1.0, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.sigma_d = sigma_d
        self.register_buffer("freqs", 2 * math.pi * torch.randn(channels, generator=g))
        self.register_buffer("phases", 2 * math.pi * torch.rand(channels, generator=g))
        self.linear = torch.nn.Linear(channels, 1)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        c_noise = (self.sigma_d * t.float().tan()).clamp(min=1e-20).log() / 4
        features = (c_noise[:, None] * self.freqs + self.phases).cos() * math.sqrt(2)  # (N, C)
        return self.linear(features).squeeze(1)  # (N,)
