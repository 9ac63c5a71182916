"""The math of diffusion: one schedule object (``DiscreteVPSchedule``) and pure functions: schedules,
parametrisations, losses, samplers of t, solver steps, guidance."""

from distill.diffusion.guidance import cfg, guidance_condition, guidance_scale_embedding
from distill.diffusion.losses import diffusion_loss, snr_weight
from distill.diffusion.parametrization import PREDICTION_TYPES, prediction_target, to_x0_eps
from distill.diffusion.schedules import DiscreteVPSchedule, add_noise, alpha_sigma, snr
from distill.diffusion.solvers import ddim_step

__all__ = [
    "DiscreteVPSchedule",
    "PREDICTION_TYPES",
    "add_noise",
    "alpha_sigma",
    "cfg",
    "ddim_step",
    "diffusion_loss",
    "guidance_condition",
    "guidance_scale_embedding",
    "prediction_target",
    "snr",
    "snr_weight",
    "to_x0_eps",
]
