"""The math of diffusion: the schedule objects (``DiscreteVPSchedule``, ``FlowMatchingSchedule``, one interface)
and pure functions: schedules, parametrisations, losses, samplers of t, solver steps, guidance; flow matching's
in ``distill.diffusion.flow``, Flux's latent packing in ``distill.diffusion.packing``."""

from distill.diffusion.guidance import cfg, guidance_condition, guidance_scale_embedding
from distill.diffusion.losses import diffusion_loss, snr_weight
from distill.diffusion.parametrization import PREDICTION_TYPES, prediction_target, to_x0_eps
from distill.diffusion.schedules import (
    DiscreteVPSchedule,
    FlowMatchingSchedule,
    add_noise,
    alpha_sigma,
    snr,
)
from distill.diffusion.solvers import ddim_step

__all__ = [
    "DiscreteVPSchedule",
    "FlowMatchingSchedule",
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
