"""Noise schedules x_t = alpha_t * x0 + sigma_t * eps: variance-preserving (Ho et al. 2020, eq. 4) and flow matching
(alpha_t = 1 - t, sigma_t = t; Liu et al. 2023, Esser et al. 2024).

Pure functions on an alpha_bar table, and the schedule objects every method asks for alpha(t), sigma(t), the
forward process and the conversions between the network's output and (x0, eps): ``DiscreteVPSchedule`` (integer
t of a DDPM-family scheduler) and ``FlowMatchingSchedule`` (continuous t in [0, 1] of a flow-matching scheduler),
with the same interface.
"""

from __future__ import annotations

import torch
from torch import nn

from distill.diffusion import flow
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


class NoiseSchedule(nn.Module):
    """The schedule interface every method asks: ``alpha_sigma(t, ndim)`` of x_t = alpha(t) x0 + sigma(t) eps,
    ``add_noise``, ``to_x0_eps`` and ``prediction_target`` in the family's ``prediction_type``; a subclass defines
    them for its kind of t."""

    prediction_type: str

    def alpha_sigma(self, t: torch.Tensor, ndim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def alpha(self, t: torch.Tensor, ndim: int = 1) -> torch.Tensor:
        return self.alpha_sigma(t, ndim)[0]

    def sigma(self, t: torch.Tensor, ndim: int = 1) -> torch.Tensor:
        return self.alpha_sigma(t, ndim)[1]

    def snr(self, t: torch.Tensor, ndim: int = 1) -> torch.Tensor:
        """alpha(t)^2 / sigma(t)^2 (Kingma et al. 2021, eq. 1)."""
        return snr(*self.alpha_sigma(t, ndim))


class DiscreteVPSchedule(NoiseSchedule):
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

    def noise_level(self, t: torch.Tensor) -> torch.Tensor:
        """The VE noise level sigma(t) / alpha(t) at integer timesteps t < T (what the time samplers bin by)."""
        return self.ve_sigmas[t]

    def timestep_at(self, sigma: torch.Tensor) -> torch.Tensor:
        """The continuous timestep (float64) at VE noise level ``sigma`` (``vp_timestep``)."""
        return vp_timestep(sigma, self.ve_sigmas)

    @staticmethod
    def alpha_sigma_at(sigma: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The VP (alpha, sigma) of VE level ``sigma`` (alpha = 1 / sqrt(1 + sigma^2), sigma_vp = sqrt(1 - alpha^2):
        alpha (x0 + sigma eps) is a VP sample), as ``like``'s dtype and device, shaped to broadcast against it."""
        alpha = (1 / (1 + sigma.double() ** 2).sqrt()).to(like).view((-1,) + (1,) * (like.ndim - 1))
        return alpha, (1 - alpha ** 2).sqrt()


class FlowMatchingSchedule(NoiseSchedule):
    """A flow-matching teacher's schedule (rectified flow, Liu et al. 2023; SD3, Esser et al. 2024) with the interface
    of ``DiscreteVPSchedule``: alpha(t) = 1 - t, sigma(t) = t at continuous t in [0, 1] (diffusers' flow ``sigma``;
    the network's time input is ``timestep(t)`` = t * num_train_timesteps), prediction type ``flow_prediction``
    (the velocity v = eps - x0; ``epsilon`` and ``sample`` students convert too).

    It also holds the scheduler's time shift: a static ``shift`` (SD3: 3.0) or, with ``use_dynamic_shifting``,
    Flux's resolution-dependent mu (``flow.resolution_shift_mu`` of the image's sequence length), for
    ``shift_times`` (training) and ``inference_sigmas`` (sampling, as the scheduler's ``set_timesteps``). It has no
    tables: nothing to move, nothing in a checkpoint.
    """

    # scheduler options that change the sigmas or the step beyond the plain shifted schedule: refused
    UNSUPPORTED = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas",
                   "shift_terminal", "stochastic_sampling")

    def __init__(self, num_train_timesteps: int = flow.NUM_TRAIN_TIMESTEPS, shift: float = 1.0,
                 use_dynamic_shifting: bool = False, base_shift: float = flow.BASE_SHIFT,
                 max_shift: float = flow.MAX_SHIFT, base_image_seq_len: int = flow.BASE_IMAGE_SEQ_LEN,
                 max_image_seq_len: int = flow.MAX_IMAGE_SEQ_LEN, time_shift_type: str = "exponential",
                 prediction_type: str = "flow_prediction"):
        super().__init__()
        flow.check_flow_prediction_type(prediction_type)
        if shift <= 0:
            raise ValueError(f"shift={shift} must be > 0 (1: no shift; SD3 uses 3.0)")
        if time_shift_type not in flow.TIME_SHIFT_TYPES:
            raise ValueError(f"time_shift_type={time_shift_type!r}; use one of {flow.TIME_SHIFT_TYPES}")
        self.prediction_type, self.num_train_timesteps = prediction_type, num_train_timesteps
        self.shift, self.use_dynamic_shifting, self.time_shift_type = shift, use_dynamic_shifting, time_shift_type
        self.base_shift, self.max_shift = base_shift, max_shift
        self.base_image_seq_len, self.max_image_seq_len = base_image_seq_len, max_image_seq_len

    @classmethod
    def from_scheduler(cls, scheduler) -> FlowMatchingSchedule:
        """The schedule of a diffusers flow-matching scheduler (``FlowMatchEulerDiscreteScheduler`` and the
        schedulers sharing its config): its T, shift and dynamic-shift settings."""
        config = scheduler.config
        if getattr(scheduler, "alphas_cumprod", None) is not None or "shift" not in config:
            raise ValueError(f"{type(scheduler).__name__} is not a flow-matching scheduler (no 'shift' in its config"
                             "); a DDPM-family scheduler is a DiscreteVPSchedule")
        unsupported = [k for k in cls.UNSUPPORTED if config.get(k)]
        if unsupported:
            raise ValueError(f"{type(scheduler).__name__} sets {unsupported}: the flow schedule reproduces the plain "
                             "shifted schedule only; set them off (False / None) in the scheduler's config")
        defaults = {"base_shift": flow.BASE_SHIFT, "max_shift": flow.MAX_SHIFT,
                    "base_image_seq_len": flow.BASE_IMAGE_SEQ_LEN, "max_image_seq_len": flow.MAX_IMAGE_SEQ_LEN}
        return cls(config.num_train_timesteps, config.shift, bool(config.get("use_dynamic_shifting")),
                   time_shift_type=config.get("time_shift_type", "exponential"),
                   **{k: d if config.get(k) is None else config[k] for k, d in defaults.items()})

    # ------------------------------------------------------------------ time t

    def alpha_sigma(self, t: torch.Tensor, ndim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """(1 - t, t) in t's dtype, shaped (N, 1, ..., 1) with ``ndim`` dimensions for broadcasting."""
        if not t.is_floating_point():
            raise ValueError(f"t has dtype {t.dtype}: a flow-matching schedule is defined at continuous t in [0, 1] "
                             "(diffusers' sigma; 1 = noise); pass t as a float tensor (the network's timestep is "
                             "timestep(t) = t * num_train_timesteps)")
        t = _expand(t, ndim)
        return 1.0 - t, t

    def noise_level(self, t: torch.Tensor) -> torch.Tensor:
        """The noise level t / (1 - t) of x_t / (1 - t) = x0 + t / (1 - t) eps (what the time samplers bin by); at
        t = 1 (infinite) the level of the training table's last point below it, t = 1 - 1 / T."""
        t = t.double().clamp(max=1.0 - 1.0 / self.num_train_timesteps)
        return t / (1.0 - t)

    def timestep(self, t: torch.Tensor) -> torch.Tensor:
        """The network's time input at t (``flow.flow_timestep``)."""
        return flow.flow_timestep(t, self.num_train_timesteps)

    def add_noise(self, x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """x_t = (1 - t) x0 + t eps (``flow.flow_add_noise``)."""
        return flow.flow_add_noise(x0, eps, self.sigma(t, x0.ndim))

    def to_x0_eps(self, pred: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor,
                  prediction_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x0, eps) from a network output ``pred`` at (x_t, t), read as ``prediction_type`` (default: the
        family's)."""
        return flow.flow_to_x0_eps(prediction_type or self.prediction_type, pred, x_t, self.sigma(t, x_t.ndim))

    def prediction_target(self, x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor,
                          prediction_type: str | None = None) -> torch.Tensor:
        """What a network predicting ``prediction_type`` (default: the family's) should output at x_t."""
        self.alpha_sigma(t)  # refuses an integer t, as every other call does
        return flow.flow_prediction_target(prediction_type or self.prediction_type, x0, eps)

    def velocity(self, pred: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor,
                 prediction_type: str | None = None) -> torch.Tensor:
        """The velocity eps - x0 of a network output, what ``flow.euler_step`` integrates."""
        return flow.flow_to_velocity(prediction_type or self.prediction_type, pred, x_t, self.sigma(t, x_t.ndim))

    # ------------------------------------------------------------------ the scheduler's time shift

    def mu(self, image_seq_len: int | None) -> float | None:
        """Flux's mu for an image of ``image_seq_len`` latent tokens (``use_dynamic_shifting``); None otherwise."""
        if not self.use_dynamic_shifting:
            return None
        if image_seq_len is None:
            raise ValueError("this flow schedule shifts by resolution (use_dynamic_shifting): give image_seq_len, "
                             "the latent tokens of the image (flow.image_seq_len)")
        return flow.resolution_shift_mu(image_seq_len, self.base_image_seq_len, self.max_image_seq_len,
                                        self.base_shift, self.max_shift)

    def shift_times(self, t: torch.Tensor, image_seq_len: int | None = None) -> torch.Tensor:
        """Uniform-in-[0, 1] or sampled times shifted as the scheduler shifts its sigmas: by ``shift`` (SD3), or by
        the resolution's mu (Flux)."""
        mu = self.mu(image_seq_len)
        if mu is None:
            return t if self.shift == 1.0 else flow.shift_time(t, self.shift)
        return flow.time_shift(t, mu, 1.0, self.time_shift_type)

    def inference_sigmas(self, num_inference_steps: int | None = None, image_seq_len: int | None = None,
                         sigmas=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(sigmas (n + 1,), timesteps (n,)) as the scheduler's ``set_timesteps(num_inference_steps, sigmas=..., mu=...)``
        makes them (``flow.flow_inference_sigmas``), mu from ``image_seq_len`` where the shift is dynamic."""
        return flow.flow_inference_sigmas(num_inference_steps, self.shift, self.mu(image_seq_len), sigmas,
                                          self.num_train_timesteps, self.time_shift_type)
