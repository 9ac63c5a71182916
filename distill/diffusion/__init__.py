"""The math of diffusion as pure functions: schedules, parametrisations, losses, samplers of t."""

from distill.diffusion.losses import diffusion_loss, snr_weight
from distill.diffusion.parametrization import PREDICTION_TYPES, prediction_target, to_x0_eps
from distill.diffusion.schedules import add_noise, alpha_sigma, snr
from distill.diffusion.timesteps import TIMESTEP_SAMPLERS, sample_timesteps

__all__ = [
    "PREDICTION_TYPES",
    "TIMESTEP_SAMPLERS",
    "add_noise",
    "alpha_sigma",
    "diffusion_loss",
    "prediction_target",
    "sample_timesteps",
    "snr",
    "snr_weight",
    "to_x0_eps",
]
