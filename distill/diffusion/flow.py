"""Flow matching (Lipman et al. 2023) on the straight path of rectified flow (Liu et al. 2023), SD3's recipe
(Esser et al. 2024): x_t = (1 - t) x0 + t eps, the network predicting the velocity v = dx_t/dt = eps - x0.

Time convention: t in [0, 1] is diffusers' flow ``sigma`` (t = 0 the data, t = 1 pure noise), the ``sigmas`` of
``FlowMatchEulerDiscreteScheduler``; every function here takes and returns t. The network's time input is the
scheduler's ``timesteps`` = t * ``num_train_timesteps`` (1000): SD3's transformer takes it as is, Flux's pipeline
divides it by 1000 again (``flow_timestep``). Sampling integrates from t = 1 down to 0.

Pure functions on tensors; the shifts and the tables also take numpy arrays and floats (diffusers computes its
inference sigmas in numpy, and reproducing them bit for bit means doing the same arithmetic in the same dtype).
``distill.diffusion.schedules.FlowMatchingSchedule`` binds them into the schedule interface every method uses.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from distill.diffusion.parametrization import to_x0_eps

FLOW_PREDICTION_TYPES = ("flow_prediction", "epsilon", "sample")  # diffusers' name for v = eps - x0
TIME_SAMPLINGS = ("uniform", "logit_normal", "mode")
LOSS_WEIGHTINGS = ("none", "sigma_sqrt", "cosmap")
TIME_SHIFT_TYPES = ("exponential", "linear")
# The defaults of diffusers' FlowMatchEulerDiscreteScheduler config (Flux's resolution-dependent shift)
NUM_TRAIN_TIMESTEPS = 1000
BASE_IMAGE_SEQ_LEN, MAX_IMAGE_SEQ_LEN = 256, 4096
BASE_SHIFT, MAX_SHIFT = 0.5, 1.15
# SD3's training-time sampling (Esser et al. 2024, sec. 3.1 and 5.1: logit-normal m = 0, s = 1; the mode scale of
# diffusers' SD3 training scripts)
LOGIT_MEAN, LOGIT_STD, MODE_SCALE = 0.0, 1.0, 1.29


def per_example(t: float | torch.Tensor, like: torch.Tensor) -> float | torch.Tensor:
    """A float or 0-d tensor as is; an (N,) tensor shaped (N, 1, ..., 1) to broadcast against ``like``."""
    if isinstance(t, torch.Tensor) and t.ndim == 1 and like.ndim > 1:
        return t.reshape((-1,) + (1,) * (like.ndim - 1))
    return t


# ---------------------------------------------------------------------- the path and its parametrisations


def flow_add_noise(x0: torch.Tensor, eps: torch.Tensor, t: float | torch.Tensor) -> torch.Tensor:
    """x_t = (1 - t) x0 + t eps: the straight path of rectified flow (Liu et al. 2023; Esser et al. 2024, eq. 3
    with a_t = 1 - t, b_t = t), as diffusers' ``FlowMatchEulerDiscreteScheduler.scale_noise`` computes it."""
    t = per_example(t, x0)
    return t * eps + (1.0 - t) * x0


def flow_velocity(x0: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """The conditional velocity u_t = dx_t/dt = eps - x0 (Lipman et al. 2023, eq. 23: the OT path at sigma_min = 0,
    their t running from noise to data): the regression target of a flow-matching network (diffusers' training
    scripts' ``noise - model_input``)."""
    return eps - x0


def x0_from_velocity(v: torch.Tensor, x_t: torch.Tensor, t: float | torch.Tensor) -> torch.Tensor:
    """x0 = x_t - t v (the x0 of diffusers' stochastic flow step and of ``FlowMatchLCMScheduler``)."""
    return x_t - per_example(t, x_t) * v


def eps_from_velocity(v: torch.Tensor, x_t: torch.Tensor, t: float | torch.Tensor) -> torch.Tensor:
    """eps = x_t + (1 - t) v."""
    return x_t + (1.0 - per_example(t, x_t)) * v


def velocity_from_x0(x0: torch.Tensor, x_t: torch.Tensor, t: float | torch.Tensor) -> torch.Tensor:
    """v = (x_t - x0) / t; undefined at t = 0, where x_t = x0."""
    return (x_t - x0) / per_example(t, x_t)


def velocity_from_eps(eps: torch.Tensor, x_t: torch.Tensor, t: float | torch.Tensor) -> torch.Tensor:
    """v = (eps - x_t) / (1 - t); undefined at t = 1, where x_t = eps."""
    return (eps - x_t) / (1.0 - per_example(t, x_t))


def score_from_velocity(v: torch.Tensor, x_t: torch.Tensor, t: float | torch.Tensor) -> torch.Tensor:
    """grad log p_t(x_t) = -(x_t + (1 - t) v) / t for x_t = (1 - t) x0 + t eps and v = E[eps - x0 | x_t].

    Tweedie for x_t given x0 ~ N((1 - t) x0, t^2 I): grad log p_t(x_t) = -E[eps | x_t] / t, and
    E[eps | x_t] = x_t + (1 - t) v (``eps_from_velocity``: x_t = x0 + t v, eps = x0 + v). Equivalently
    -(x_t - (1 - t) x0_hat) / t^2 with x0_hat = x_t - t v. Undefined at t = 0."""
    return -eps_from_velocity(v, x_t, t) / per_example(t, x_t)


def velocity_from_score(score: torch.Tensor, x_t: torch.Tensor, t: float | torch.Tensor) -> torch.Tensor:
    """v = -(x_t + t score) / (1 - t), the inverse of ``score_from_velocity``; undefined at t = 1."""
    t = per_example(t, x_t)
    return -(x_t + t * score) / (1.0 - t)


def classifier_guided_velocity(v: torch.Tensor, grad_log_p: torch.Tensor, t: float | torch.Tensor,
                               scale: float = 1.0) -> torch.Tensor:
    """Classifier guidance (Dhariwal & Nichol 2021) in velocity form: the velocity of the score
    grad log p_t(x_t) + s grad log p_t(y | x_t), v - s t / (1 - t) grad log p_t(y | x_t).

    ``velocity_from_score`` is affine in the score with slope -t / (1 - t), so the classifier's term enters
    scaled by it; in eps form the same term is eps - t s grad (sigma_t = t), and v = (eps - x_t) / (1 - t). At
    s = 1 with the exact classifier it is the exact velocity of p(x0 | y) (tests/test_flow_guidance.py). Undefined
    at t = 1, where the exact p_t(y | x_t) = p(y) has no gradient."""
    t = per_example(t, v)
    return v - scale * t / (1.0 - t) * grad_log_p


def check_flow_prediction_type(prediction_type: str) -> None:
    if prediction_type not in FLOW_PREDICTION_TYPES:
        hint = (" (v = alpha eps - sigma x0 assumes alpha^2 + sigma^2 = 1, a VP schedule; a flow schedule's "
                "velocity eps - x0 is 'flow_prediction')" if prediction_type == "v_prediction" else "")
        raise ValueError(f"prediction_type={prediction_type!r} is not a flow-matching parametrisation{hint}; use "
                         f"one of {FLOW_PREDICTION_TYPES}")


def flow_to_x0_eps(prediction_type: str, pred: torch.Tensor, x_t: torch.Tensor,
                   t: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x0, eps) from a network output at (x_t, t) read as ``prediction_type``: the velocity (``flow_prediction``),
    or eps / x0 through the general x_t = alpha x0 + sigma eps with alpha = 1 - t, sigma = t."""
    check_flow_prediction_type(prediction_type)
    if prediction_type == "flow_prediction":
        return x0_from_velocity(pred, x_t, t), eps_from_velocity(pred, x_t, t)
    t = per_example(t, x_t)
    return to_x0_eps(prediction_type, pred, x_t, 1.0 - t, t)


def flow_prediction_target(prediction_type: str, x0: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """What a network predicting ``prediction_type`` on the flow path should output (none depends on t)."""
    check_flow_prediction_type(prediction_type)
    if prediction_type == "flow_prediction":
        return flow_velocity(x0, eps)
    return eps if prediction_type == "epsilon" else x0


def flow_to_velocity(prediction_type: str, pred: torch.Tensor, x_t: torch.Tensor,
                     t: float | torch.Tensor) -> torch.Tensor:
    """The velocity of a network output of any flow parametrisation (the output itself for ``flow_prediction``)."""
    if prediction_type == "flow_prediction":
        return pred
    x0, eps = flow_to_x0_eps(prediction_type, pred, x_t, t)
    return flow_velocity(x0, eps)


def euler_step(v: torch.Tensor, x_t: torch.Tensor, t: float | torch.Tensor,
               t_next: float | torch.Tensor) -> torch.Tensor:
    """One Euler step of the flow ODE dx/dt = v (Lipman et al. 2023, eq. 1): x_{t_next} = x_t + (t_next - t) v, as
    ``FlowMatchEulerDiscreteScheduler.step`` computes it (x_t upcast to float32, the result in v's dtype)."""
    dt = per_example(t_next, x_t) - per_example(t, x_t)
    return (x_t.float() + dt * v).to(v.dtype)


def flow_timestep(t: torch.Tensor, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS) -> torch.Tensor:
    """The network's time input at t: diffusers' ``timesteps = sigmas * num_train_timesteps``."""
    return t * num_train_timesteps


# ---------------------------------------------------------------------- time shifts


def shift_time(t, shift: float):
    """SD3's timestep shift t' = s t / (1 + (s - 1) t) (Esser et al. 2024, sec. 5.3.2, eq. 23 with s = sqrt(m / n)
    for m pixels against a base n): s > 1 moves t towards noise. Equal to ``time_shift_exponential`` at mu = ln s."""
    return shift * t / (1 + (shift - 1) * t)


def _numerator(c: float, t):
    """``c`` as a tensor of t's dtype where t is one: torch divides a Python number by a tensor as c * (1 / t),
    a rounding apart from numpy's (and diffusers') c / t."""
    return torch.tensor(c, dtype=t.dtype, device=t.device) if isinstance(t, torch.Tensor) else c


def time_shift_exponential(t, mu: float, sigma: float = 1.0):
    """Flux's time shift e^mu / (e^mu + (1 / t - 1)^sigma), diffusers' ``time_shift_type="exponential"``."""
    return _numerator(math.exp(mu), t) / (math.exp(mu) + (1 / t - 1) ** sigma)


def time_shift_linear(t, mu: float, sigma: float = 1.0):
    """mu / (mu + (1 / t - 1)^sigma), diffusers' ``time_shift_type="linear"`` (mu is then the shift itself)."""
    return _numerator(mu, t) / (mu + (1 / t - 1) ** sigma)


def time_shift(t, mu: float, sigma: float = 1.0, time_shift_type: str = "exponential"):
    """The resolution-dependent shift of ``time_shift_type`` (``TIME_SHIFT_TYPES``)."""
    if time_shift_type not in TIME_SHIFT_TYPES:
        raise ValueError(f"time_shift_type={time_shift_type!r}; use one of {TIME_SHIFT_TYPES}")
    shifted = time_shift_exponential if time_shift_type == "exponential" else time_shift_linear
    return shifted(t, mu, sigma)


def resolution_shift_mu(image_seq_len: int, base_seq_len: int = BASE_IMAGE_SEQ_LEN,
                        max_seq_len: int = MAX_IMAGE_SEQ_LEN, base_shift: float = BASE_SHIFT,
                        max_shift: float = MAX_SHIFT) -> float:
    """Flux's mu of an image of ``image_seq_len`` latent tokens: linear from ``base_shift`` at ``base_seq_len`` to
    ``max_shift`` at ``max_seq_len`` (diffusers' ``calculate_shift``; Esser et al. 2024 sec. 5.3.2 shift more
    for more pixels, Flux interpolates the log-shift mu in the sequence length)."""
    if max_seq_len == base_seq_len:
        raise ValueError(f"max_image_seq_len = base_image_seq_len = {base_seq_len}: the shift's line needs two lengths")
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * slope + (base_shift - slope * base_seq_len)


def image_seq_len(height: int, width: int, patch_size: int) -> int:
    """Latent tokens of an (height, width) latent cut in patch_size^2 patches (SD3: the transformer's
    ``patch_size``; Flux: 2, its 2x2 packing)."""
    return (height // patch_size) * (width // patch_size)


# ---------------------------------------------------------------------- sigma tables (diffusers' schedules)


def flow_train_sigmas(num_train_timesteps: int = NUM_TRAIN_TIMESTEPS, shift: float = 1.0) -> torch.Tensor:
    """(T,) float32 descending: the table a ``FlowMatchEulerDiscreteScheduler`` builds at construction, t = k / T for
    k = T..1, shifted by ``shift`` (1: none, as for dynamic shifting); diffusers' SD3/Flux training scripts draw
    their t from it as ``sigmas[(u * T).long()]``, so a drawn u lands at t = shift_time(1 - u) on a 1/T grid."""
    t = torch.arange(num_train_timesteps, 0, -1, dtype=torch.float32) / num_train_timesteps
    return t if shift == 1.0 else shift_time(t, shift)


def flux_sigmas(num_inference_steps: int) -> np.ndarray:
    """FluxPipeline's default unshifted sigmas: linspace(1, 1 / n, n) (float64; mu shifts them)."""
    return np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)


def flow_inference_sigmas(
    num_inference_steps: int | None = None, shift: float = 1.0, mu: float | None = None,
    sigmas=None, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS, time_shift_type: str = "exponential",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sigmas (n + 1,), timesteps (n,)) in float32 as ``FlowMatchEulerDiscreteScheduler.set_timesteps`` makes them:
    ``sigmas`` given (Flux's ``flux_sigmas``) or n points evenly spaced between the training table's ends (so a
    static ``shift`` applies twice there, as diffusers does), then shifted by ``mu`` (``time_shift``; a
    ``use_dynamic_shifting`` scheduler) or else by ``shift`` (SD3: 3.0), the terminal 0 appended; timesteps =
    sigmas * T. Karras / exponential / beta sigmas, ``shift_terminal`` and ``invert_sigmas`` are not reproduced."""
    if sigmas is None:
        if not num_inference_steps or num_inference_steps < 1:
            raise ValueError(f"num_inference_steps={num_inference_steps}: give at least 1 step, or the sigmas")
        table = flow_train_sigmas(num_train_timesteps, 1.0 if mu is not None else shift)
        grid = np.linspace(table[0].item() * num_train_timesteps, table[-1].item() * num_train_timesteps,
                           num_inference_steps)
        sigmas = grid / num_train_timesteps  # float64, as diffusers computes them
    else:
        if num_inference_steps is not None and len(sigmas) != num_inference_steps:
            raise ValueError(f"{len(sigmas)} sigmas for num_inference_steps={num_inference_steps}; give as many")
        sigmas = np.array(sigmas).astype(np.float32)
    sigmas = time_shift(sigmas, mu, 1.0, time_shift_type) if mu is not None else shift_time(sigmas, shift)
    sigmas = torch.from_numpy(np.asarray(sigmas)).to(torch.float32)
    return torch.cat([sigmas, torch.zeros(1)]), sigmas * num_train_timesteps


# ---------------------------------------------------------------------- training-time sampling and loss weights


def sample_flow_times(n: int, time_sampling: str = "logit_normal", logit_mean: float = LOGIT_MEAN,
                      logit_std: float = LOGIT_STD, mode_scale: float = MODE_SCALE, shift: float = 1.0,
                      generator: torch.Generator | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """(n,) training times t in (0, 1), shifted by ``shift``: ``logit_normal`` t = sigmoid(N(m, s^2)) (Esser et al.
    2024, sec. 3.1, eq. 19), ``mode`` t = 1 - u - mode_scale (cos^2(pi u / 2) - 1 + u) (eq. 20), or ``uniform``;
    the draws of diffusers' ``compute_density_for_timestep_sampling`` (the same generator calls: the same numbers).
    Both densities are symmetric about 1/2 at m = 0, so t and diffusers' table index 1 - t draw alike."""
    if time_sampling not in TIME_SAMPLINGS:
        raise ValueError(f"time_sampling={time_sampling!r}; use one of {TIME_SAMPLINGS}")
    if time_sampling == "logit_normal":
        if logit_std <= 0:
            raise ValueError(f"logit_std={logit_std} must be > 0")
        u = torch.sigmoid(torch.normal(mean=logit_mean, std=logit_std, size=(n,), device=device, generator=generator))
    else:
        u = torch.rand(size=(n,), device=device, generator=generator)
        if time_sampling == "mode":
            if not -1 <= mode_scale <= 2 / (math.pi - 2):
                raise ValueError(f"mode_scale={mode_scale} must be in [-1, 2 / (pi - 2)] for the mode density to be "
                                 "monotone (Esser et al. 2024, eq. 20)")
            u = 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    return u if shift == 1.0 else shift_time(u, shift)


def flow_loss_weight(loss_weighting: str, t: torch.Tensor) -> torch.Tensor:
    """Per-example loss weights of diffusers' ``compute_loss_weighting_for_sd3``: ``sigma_sqrt`` t^-2, ``cosmap``
    2 / (pi (1 - 2t + 2t^2)) (the CosMap density, Esser et al. 2024, eq. 21), ``none`` ones."""
    if loss_weighting not in LOSS_WEIGHTINGS:
        raise ValueError(f"loss_weighting={loss_weighting!r}; use one of {LOSS_WEIGHTINGS}")
    if loss_weighting == "sigma_sqrt":
        return (t ** -2.0).float()
    if loss_weighting == "cosmap":
        return 2 / (math.pi * (1 - 2 * t + 2 * t ** 2))
    return torch.ones_like(t)
