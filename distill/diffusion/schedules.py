"""Variance-preserving noise schedules: x_t = alpha_t * x0 + sigma_t * eps (Ho et al. 2020, eq. 4).

Pure functions on an alpha_bar table, and ``DiscreteVPSchedule``, the one schedule object every method asks for
alpha(t), sigma(t), the forward process and the conversions between the network's output and (x0, eps).
"""

from __future__ import annotations

import torch
from torch import nn

from distill.diffusion.parametrization import check_prediction_type, prediction_target, to_x0_eps


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


def vp_sigmas(alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """sigma(t) = sqrt((1 - alpha_bar_t) / alpha_bar_t) of a discrete VP schedule, for t = 0..T-1: x_t / alpha_t =
    x0 + sigma(t) eps, the VE view of a DDPM teacher (Karras et al. 2022, table 1's VP sigma(t)), in float64."""
    a = alphas_cumprod.double()
    return ((1 - a) / a).sqrt()


def vp_timestep(sigma: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """The continuous timestep of a discrete VP schedule at noise level ``sigma``: linear interpolation of t in
    log sigma between the schedule's levels (clamped to [0, T-1]); what a VP network takes as its time input."""
    log_s = sigmas.log().to(sigma.device)
    x = sigma.double().clamp(min=float(sigmas[0]), max=float(sigmas[-1])).log()
    idx = torch.searchsorted(log_s, x).clamp(1, len(log_s) - 1)
    lo, hi = log_s[idx - 1], log_s[idx]
    frac = ((x - lo) / (hi - lo)).clamp(0, 1)
    return (idx - 1).double() + frac


class DiscreteVPSchedule(nn.Module):
    """A discrete VP teacher's noise schedule as functions of time t, with the family's ``prediction_type``.

    ``alpha_sigma(t)`` indexes the teacher scheduler's own ``alphas_cumprod`` (float32, as diffusers computes it:
    nothing interpolated or recomputed) at integer t = 0..T-1; index T is the clean sample (alpha 1, sigma 0),
    where a DDIM grid's last step lands. The VE view (``ve_sigmas``, ``timestep_at``, ``alpha_sigma_at``) is the
    same schedule in noise levels x_t / alpha_t = x0 + sigma eps, for methods that draw continuous levels (ECT).
    Its tables are non-persistent buffers: they move with the method and add nothing to its checkpoints.
    """

    def __init__(self, alphas_cumprod: torch.Tensor, prediction_type: str = "epsilon"):
        super().__init__()
        check_prediction_type(prediction_type)
        self.prediction_type = prediction_type
        # (T + 1,) float32: alpha_bar at t = 0..T-1, then the clean sample's 1 at index T
        self.register_buffer("abar", torch.cat([alphas_cumprod.clone().float(), torch.ones(1)]), persistent=False)
        self.register_buffer("ve_sigmas", vp_sigmas(alphas_cumprod), persistent=False)  # (T,) float64

    @classmethod
    def from_scheduler(cls, scheduler) -> DiscreteVPSchedule:
        """The schedule of a diffusers DDPM-family scheduler (DDPM, DDIM, LCM, ...): its table and prediction type."""
        if getattr(scheduler, "alphas_cumprod", None) is None:
            raise ValueError(f"{type(scheduler).__name__} has no alphas_cumprod: a discrete VP schedule needs a "
                             "DDPM-family scheduler (DDPMScheduler, DDIMScheduler, ...)")
        return cls(scheduler.alphas_cumprod, scheduler.config.prediction_type)

    @property
    def num_train_timesteps(self) -> int:
        return len(self.ve_sigmas)

    # ------------------------------------------------------------------ time t

    def alpha_sigma(self, t: torch.Tensor, ndim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """(alpha(t), sigma(t)) in float32, shaped (N, 1, ..., 1) with ``ndim`` dimensions for broadcasting."""
        if t.is_floating_point():
            raise ValueError(f"t has dtype {t.dtype}: a discrete VP schedule is defined at integer timesteps "
                             f"0..{self.num_train_timesteps} (T = the clean sample); pass t as an integer tensor, or "
                             "a noise level through timestep_at / alpha_sigma_at")
        return alpha_sigma(self.abar, t, ndim)

    def alpha(self, t: torch.Tensor, ndim: int = 1) -> torch.Tensor:
        return self.alpha_sigma(t, ndim)[0]

    def sigma(self, t: torch.Tensor, ndim: int = 1) -> torch.Tensor:
        return self.alpha_sigma(t, ndim)[1]

    def snr(self, t: torch.Tensor, ndim: int = 1) -> torch.Tensor:
        """alpha(t)^2 / sigma(t)^2 (Kingma et al. 2021, eq. 1)."""
        return snr(*self.alpha_sigma(t, ndim))

    def add_noise(self, x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """x_t = alpha(t) x0 + sigma(t) eps: q(x_t | x0) (Ho et al. 2020, eq. 4), or a DDIM step's landing point."""
        return add_noise(x0, eps, *self.alpha_sigma(t, x0.ndim))

    def to_x0_eps(self, pred: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor,
                  prediction_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x0, eps) from a network output ``pred`` at (x_t, t), read as ``prediction_type`` (default: the
        family's; a progressive round's teacher is a student with its own)."""
        return to_x0_eps(prediction_type or self.prediction_type, pred, x_t, *self.alpha_sigma(t, x_t.ndim))

    def prediction_target(self, x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor,
                          prediction_type: str | None = None) -> torch.Tensor:
        """What a network predicting ``prediction_type`` (default: the family's) should output at x_t."""
        return prediction_target(prediction_type or self.prediction_type, x0, eps, *self.alpha_sigma(t, x0.ndim))

    # ------------------------------------------------------------------ noise level sigma (the VE view)

    def timestep_at(self, sigma: torch.Tensor) -> torch.Tensor:
        """The continuous timestep (float64) at VE noise level ``sigma`` (``vp_timestep``)."""
        return vp_timestep(sigma, self.ve_sigmas)

    @staticmethod
    def alpha_sigma_at(sigma: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The VP (alpha, sigma) of VE level ``sigma`` (alpha = 1 / sqrt(1 + sigma^2), sigma_vp = sqrt(1 - alpha^2):
        alpha (x0 + sigma eps) is a VP sample), as ``like``'s dtype and device, shaped to broadcast against it."""
        alpha = (1 / (1 + sigma.double() ** 2).sqrt()).to(like).view((-1,) + (1,) * (like.ndim - 1))
        return alpha, (1 - alpha ** 2).sqrt()
