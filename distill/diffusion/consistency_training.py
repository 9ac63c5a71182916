"""Consistency training without a teacher's solver: iCT (Song & Dhariwal 2023) and ECT (Geng et al. 2024).

Both work in the variance-exploding (EDM) view, x_sigma = x0 + sigma * eps, and train
f(x_sigma, sigma) ~ f(x_sigma', sigma') for two noise levels of the same noisy trajectory (shared eps), the
smaller one's output under stop-gradient; at sigma = sigma_min the boundary condition f = x holds by the
parametrisation.

- iCT: Karras noise levels sigma_1 < ... < sigma_N, N growing with the training step (the discretisation
  curriculum); the pair (sigma_i, sigma_{i+1}) drawn with lognormal probabilities; loss weight
  1 / (sigma_{i+1} - sigma_i); pseudo-Huber distance with c = 0.00054 sqrt(d); no EMA target.
- ECT: continuous t ~ lognormal, r = t (1 - n(t) / q^(stage+1)) with n(t) = 1 + k sigmoid(-b t), clamped at 0
  (r = 0: the target is the data, i.e. diffusion training); the run is split into ``stages`` equal parts (the
  paper's 8: 200k iterations, one stage per 25k), so t - r halves at each and shrinks towards the consistency limit; loss sqrt(||delta||^2 + c^2) - c (c = 0: the L2 norm, the paper's
  adaptive weighting with p = 1/2) weighted by 1 / (t - r).

On a flow-matching model (x_t = (1 - t) x0 + t eps) the same pairs are drawn in sigma and the network is called at
flow time t = sigma / (1 + sigma) (``flow_time``) on x_t = (1 - t)(x0 + sigma eps), since x_t / (1 - t) = x0 +
t / (1 - t) eps: the flow consistency function is ECT's f(x0 + sigma eps, sigma) in another coordinate, and the
loss, weight 1 / (sigma_t - sigma_r) = (1 - t)(1 - r) / (t - r) in flow times, is ECT's unchanged.

All functions are pure (tensors in, tensors out); the training method is ``distill.methods.consistency_training``.
"""

from __future__ import annotations

import math

import torch


def karras_sigmas(n: int, sigma_min: float = 0.002, sigma_max: float = 80.0, rho: float = 7.0,
                  dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """sigma_i = (sigma_min^(1/rho) + (i-1)/(N-1) (sigma_max^(1/rho) - sigma_min^(1/rho)))^rho, i = 1..N,
    ascending (Karras et al. 2022, eq. 5; iCT section 3)."""
    check_sigma_range(sigma_min, sigma_max)
    if n < 2:
        raise ValueError(f"{n} noise levels; a consistency pair needs N >= 2")
    ramp = torch.linspace(0, 1, n, dtype=dtype)
    lo, hi = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    return (lo + ramp * (hi - lo)) ** rho


def check_sigma_range(sigma_min: float, sigma_max: float) -> None:
    if not 0 < sigma_min < sigma_max:
        raise ValueError(f"sigma_min={sigma_min}, sigma_max={sigma_max}: need 0 < sigma_min < sigma_max")


def ict_num_scales(step: int, total_steps: int, s0: int = 10, s1: int = 1280) -> int:
    """iCT's discretisation curriculum N(k) = min(s0 2^floor(k / K'), s1) + 1 with
    K' = floor(K / (log2(s1 / s0) + 1)): N doubles at evenly spaced steps, from s0 + 1 to s1 + 1."""
    if s0 < 1 or s1 < s0:
        raise ValueError(f"s0={s0}, s1={s1}: need 1 <= s0 <= s1")
    k_prime = math.floor(total_steps / (math.log2(s1 / s0) + 1))
    doublings = step // k_prime if k_prime > 0 else 0
    return min(s0 * 2 ** doublings, s1) + 1


def lognormal_pair_probabilities(sigmas: torch.Tensor, p_mean: float = -1.1, p_std: float = 2.0) -> torch.Tensor:
    """p(sigma_i) for the pair (sigma_i, sigma_{i+1}), i = 1..N-1: the lognormal mass between them,
    erf((log sigma_{i+1} - P_mean) / (sqrt 2 P_std)) - erf((log sigma_i - P_mean) / (sqrt 2 P_std)), normalised
    (iCT section 3.5)."""
    cdf = torch.erf((sigmas.log() - p_mean) / (math.sqrt(2) * p_std))
    mass = cdf[1:] - cdf[:-1]
    return mass / mass.sum()


def ict_weight(sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
    """lambda(sigma_i) = 1 / (sigma_{i+1} - sigma_i) (iCT section 3.2)."""
    return 1.0 / (sigma_next - sigma)


def ect_r(t: torch.Tensor, stage: int, q: float = 2.0, k: float = 8.0, b: float = 1.0) -> torch.Tensor:
    """ECT's mapping r(t) = t (1 - n(t) / q^(stage+1)), n(t) = 1 + k sigmoid(-b t), clamped at 0."""
    n = 1 + k * torch.sigmoid(-b * t)
    return (t * (1 - n / q ** (stage + 1))).clamp(min=0)


def ect_stage(step: int, total_steps: int, stages: int) -> int:
    """The stage of the mapping at ``step`` of a ``total_steps`` run split into ``stages`` equal parts: floor(step
    stages / total), the last stage kept from the final step on (ECT's run: 8 stages, t - r halving 7 times)."""
    if total_steps < 1 or stages < 1:
        raise ValueError(f"total_steps={total_steps}, stages={stages}: both must be >= 1")
    return min(stages - 1, step * stages // total_steps)


def flow_time(sigma: torch.Tensor) -> torch.Tensor:
    """t = sigma / (1 + sigma): the flow time whose x_t = (1 - t) x0 + t eps is (1 - t)(x0 + sigma eps), the inverse of
    the flow schedule's noise level t / (1 - t); sigma = 0 is t = 0 (the data)."""
    return sigma / (1 + sigma)


def lognormal_sigmas(n: int, p_mean: float = -1.1, p_std: float = 2.0, generator: torch.Generator | None = None,
                     device: torch.device | str | None = None) -> torch.Tensor:
    """t = exp(P_mean + P_std z), z ~ N(0, 1) (EDM's training distribution, ECT's t)."""
    z = torch.randn(n, generator=generator, device=device, dtype=torch.float64)
    return (p_mean + p_std * z).exp()


def truncated_lognormal_sigmas(n: int, lo: float, hi: float, p_mean: float = -1.1, p_std: float = 2.0,
                               generator: torch.Generator | None = None, unit: torch.Tensor | None = None) -> torch.Tensor:
    """t = exp(P_mean + P_std z) conditioned on lo <= t <= hi (inverse CDF of the truncated normal in log t): the
    lognormal restricted to a model's noise range, with no mass piled on the ends as clamping would put there.
    ``unit``: the (n,) points of [0, 1) to map (e.g. stratified ones); default i.i.d. uniform."""
    if not 0 < lo < hi:
        raise ValueError(f"noise range [{lo}, {hi}]: need 0 < lo < hi")
    std_normal = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64))
    a, b = (std_normal.cdf(torch.tensor((math.log(v) - p_mean) / p_std, dtype=torch.float64)) for v in (lo, hi))
    unit = torch.rand(n, generator=generator, dtype=torch.float64) if unit is None else unit.double()
    u = a + (b - a) * unit
    z = std_normal.icdf(u.clamp(1e-12, 1 - 1e-12))
    return (p_mean + p_std * z).exp().clamp(lo, hi)


def edm_boundary_scalings(sigma: torch.Tensor, sigma_data: float, sigma_min: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(c_skip, c_out) of the consistency parametrisation f = c_skip x + c_out F (Song et al. 2023, appendix C):
    c_skip = sigma_data^2 / ((sigma - sigma_min)^2 + sigma_data^2), c_out = (sigma - sigma_min) sigma_data /
    sqrt(sigma^2 + sigma_data^2); at sigma = sigma_min, c_skip = 1 and c_out = 0 (f = x)."""
    c_skip = sigma_data ** 2 / ((sigma - sigma_min) ** 2 + sigma_data ** 2)
    c_out = (sigma - sigma_min) * sigma_data / (sigma ** 2 + sigma_data ** 2).sqrt()
    return c_skip, c_out


def edm_input_scalings(sigma: torch.Tensor, sigma_data: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(c_in, c_noise): the network sees c_in x = x / sqrt(sigma^2 + sigma_data^2) and c_noise = 1000 * 0.25 log
    sigma (the consistency models' timestep input, as diffusers' CMStochasticIterativeScheduler computes it)."""
    return 1.0 / (sigma ** 2 + sigma_data ** 2).sqrt(), 1000 * 0.25 * torch.log(sigma + 1e-44)


def ect_loss(pred: torch.Tensor, target: torch.Tensor, t: torch.Tensor, r: torch.Tensor, c: float = 0.0) -> torch.Tensor:
    """Per-example sqrt(||pred - target||^2 + c^2) - c, divided by t - r: ECT's loss (c = 0 by default: the norm,
    its adaptive weighting with p = 1/2), and iCT's lambda d with the pseudo-Huber c and lambda = 1 / (t - r)."""
    sq = (pred.float() - target.float()).pow(2).flatten(1).sum(1)
    return ((sq + c ** 2).sqrt() - c) / (t - r).to(sq.dtype)

