"""Consistency-model math (Song et al. 2023) in the latent-consistency form of Luo et al. 2023 (LCM)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

CONSISTENCY_LOSSES = ("l2", "huber", "pseudo_huber", "pseudo_huber_elementwise")


def boundary_scalings(
    t: torch.Tensor, sigma_data: float = 0.5, timestep_scaling: float = 10.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """c_skip(t), c_out(t) with c_skip(0) = 1, c_out(0) = 0 (Song et al. 2023 eq. 8 on a discrete t,
    as diffusers' LCMScheduler: s = timestep_scaling * t, c_skip = sd^2 / (s^2 + sd^2), c_out = s / sqrt(s^2 + sd^2))."""
    s = t.float() * timestep_scaling
    c_skip = sigma_data**2 / (s**2 + sigma_data**2)
    c_out = s / (s**2 + sigma_data**2).sqrt()
    return c_skip, c_out


def flow_boundary_scalings(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """c_skip(t) = 1, c_out(t) = -t on a flow network's velocity v: f(x_t, t) = x_t - t v(x_t, t), one Euler step
    of the flow ODE from t to 0, which is the x0 the velocity predicts (``flow.x0_from_velocity``). The boundary
    condition of Song et al. 2023 (eq. 8: c_skip(0) = 1, c_out(0) = 0, so f(x_0, 0) = x_0) holds by construction
    for any network, as in the flow consistency models of Yang et al. 2024 ("Consistency Flow Matching", their
    f(x_t, t) = x_t + (1 - t) v with data at t = 1); and it is what diffusers' ``FlowMatchLCMScheduler.step`` reads
    the model output as (x0 = sample - sigma * model_output), so an export samples with the f it was trained as."""
    t = t.float()
    return torch.ones_like(t), -t


def flow_solver_grid(sigmas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(t_n, t_{n-1}), each (N,) ascending in t_n, of a flow scheduler's N-step sigmas ``sigmas`` (N + 1,
    descending, the terminal 0 last: ``FlowMatchingSchedule.inference_sigmas``): the pairs a consistency solver
    steps between, the last step landing on t = 0 (the data)."""
    if sigmas.ndim != 1 or len(sigmas) < 2 or float(sigmas[-1]) != 0.0 or not bool((sigmas.diff() < 0).all()):
        raise ValueError(f"sigmas {sigmas.tolist()} are not a flow scheduler's descending sigmas ending in 0")
    return sigmas[:-1].flip(0), sigmas[1:].flip(0)


def consistency_output(x_t: torch.Tensor, x0_pred: torch.Tensor, c_skip: torch.Tensor, c_out: torch.Tensor) -> torch.Tensor:
    """f(x_t, t) = c_skip(t) x_t + c_out(t) x0_pred (Luo et al. 2023 eq. 9)."""
    shape = (-1,) + (1,) * (x_t.ndim - 1)
    return c_skip.reshape(shape) * x_t + c_out.reshape(shape) * x0_pred


def ict_huber_c(numel: int) -> float:
    """iCT's pseudo-Huber constant c = 0.00054 sqrt(d), d = elements per example (Song & Dhariwal 2023, sec. 3.3)."""
    return 0.00054 * math.sqrt(numel)


def pseudo_huber(pred: torch.Tensor, target: torch.Tensor, c: float, reduce: bool = True) -> torch.Tensor:
    """sqrt(||x - y||_2^2 + c^2) - c per example, averaged over the batch (Song & Dhariwal 2023, iCT sec. 3.3)."""
    sq_norm = (pred.float() - target.float()).pow(2).flatten(1).sum(1)  # (N,)
    per_example = (sq_norm + c**2).sqrt().sub(c)
    return per_example.mean() if reduce else per_example


def pseudo_huber_elementwise(pred: torch.Tensor, target: torch.Tensor, c: float, reduce: bool = True) -> torch.Tensor:
    """mean over elements of sqrt((x - y)^2 + c^2) - c (diffusers' examples/consistency_distillation/
    train_lcm_distill_*.py, --loss_type=huber, --huber_c=0.001)."""
    per_example = ((pred.float() - target.float()).pow(2) + c**2).sqrt().sub(c).flatten(1).mean(1)
    return per_example.mean() if reduce else per_example


def scaled_huber(pred: torch.Tensor, target: torch.Tensor, delta: float, reduce: bool = True) -> torch.Tensor:
    """Huber(x - y; delta) / delta averaged over elements (Huber 1964): |d| - delta/2 for |d| > delta, d^2 / (2 delta)
    below; the division keeps the magnitude of L1 (its limit for |d| >> delta) however small delta is."""
    per_example = F.huber_loss(pred.float(), target.float(), delta=delta, reduction="none").flatten(1).mean(1) / delta
    return per_example.mean() if reduce else per_example


def check_consistency_loss(kind: str, huber_c: float | None) -> None:
    """Rejects an unknown ``method.loss_type`` or an unusable ``method.huber_c`` before any compute."""
    if kind not in CONSISTENCY_LOSSES:
        raise ValueError(f"method.loss_type={kind!r} is not supported; use one of {CONSISTENCY_LOSSES}")
    if kind == "l2":
        return
    if huber_c is None and kind != "pseudo_huber":
        raise ValueError(f"method.huber_c=null (iCT's c = 0.00054 sqrt(d)) is defined only for method.loss_type="
                         f"pseudo_huber; set method.huber_c to a number (e.g. 0.001) for method.loss_type={kind!r}")
    if huber_c is not None and huber_c <= 0:
        raise ValueError(f"method.huber_c={huber_c} must be > 0 (or null for iCT's c with method.loss_type=pseudo_huber)")


def consistency_loss(pred: torch.Tensor, target: torch.Tensor, kind: str, huber_c: float | None,
                     reduce: bool = True) -> torch.Tensor:
    """Distance d(f_student, f_target) of ``kind`` in CONSISTENCY_LOSSES: ``l2`` mean squared error, ``huber``
    (``scaled_huber``, delta = huber_c), ``pseudo_huber`` (per example, iCT; huber_c=None: iCT's c for this
    example size) or ``pseudo_huber_elementwise`` (diffusers' LCM scripts); ``reduce=False``: the (N,) per-example
    terms whose mean is the loss."""
    check_consistency_loss(kind, huber_c)
    if kind == "l2":
        per_example = (pred.float() - target.float()).pow(2).flatten(1).mean(1)
        return per_example.mean() if reduce else per_example
    if kind == "huber":
        return scaled_huber(pred, target, huber_c, reduce)
    if kind == "pseudo_huber_elementwise":
        return pseudo_huber_elementwise(pred, target, huber_c, reduce)
    return pseudo_huber(pred, target, ict_huber_c(pred[0].numel()) if huber_c is None else huber_c, reduce)


def ddim_timesteps(num_train_timesteps: int, num_ddim_timesteps: int) -> torch.Tensor:
    """The solver grid t_n = (n + 1) k - 1, k = T / N, n = 0..N-1 (LCM's skipping-step schedule)."""
    if num_train_timesteps % num_ddim_timesteps:
        raise ValueError(
            f"method.num_ddim_timesteps={num_ddim_timesteps} must divide num_train_timesteps={num_train_timesteps}"
        )
    k = num_train_timesteps // num_ddim_timesteps
    return torch.arange(1, num_ddim_timesteps + 1) * k - 1
