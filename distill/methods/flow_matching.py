"""Flow-matching training (rectified flow, Liu et al. 2023; SD3's recipe, Esser et al. 2024): a network trained
from scratch to predict the velocity v = eps - x0 on x_t = (1 - t) x0 + t eps, the way SD3 and Flux were trained."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from distill.diffusion import flow
from distill.methods import METHODS
from distill.methods.diffusion import DiffusionTraining
from distill.models.teacher import is_flow_matching


@METHODS.register("flow_matching", choices={"prediction_type": flow.FLOW_PREDICTION_TYPES,
                                            "loss_weighting": flow.LOSS_WEIGHTINGS,
                                            "time_sampling": flow.TIME_SAMPLINGS})
class FlowMatchingTraining(DiffusionTraining):
    """Trains ``student`` (e.g. an ``SD3Transformer2DModel``) on a flow-matching ``noise_scheduler``
    (``FlowMatchEulerDiscreteScheduler``): each example draws t from ``time_sampling`` (``logit_normal``: t =
    sigmoid(N(logit_mean, logit_std^2)), Esser et al. 2024 eq. 19; ``mode``, eq. 20; ``uniform``), shifted as the
    scheduler shifts its sigmas (``shift``), and regresses the network's output on ``prediction_type``'s target
    (``flow_prediction``: v = eps - x0) with SD3's per-example ``loss_weighting`` (``none``, ``sigma_sqrt``,
    ``cosmap``; independent of the time sampling: diffusers' ``--weighting_scheme=cosmap`` / ``sigma_sqrt`` is
    ``time_sampling=uniform`` with that weighting). Conditions are dropped with probability ``cond_dropout`` for classifier-free guidance; sampling,
    the exported pipeline (the conditioner's family: ``SD3Conditioner`` -> ``DistillSD3Pipeline``) and validation
    are ``DiffusionTraining``'s."""

    def __init__(self, student: nn.Module, noise_scheduler, conditioner: nn.Module, optimizer: Callable,
                 lr_scheduler: Callable | None = None, prediction_type: str = "flow_prediction",
                 cond_dropout: float = 0.1, loss_weighting: str = "none", time_sampling: str = "logit_normal",
                 logit_mean: float = flow.LOGIT_MEAN, logit_std: float = flow.LOGIT_STD,
                 mode_scale: float = flow.MODE_SCALE, sampling: dict | None = None, vae: nn.Module | None = None,
                 **speed):
        flow.check_flow_prediction_type(prediction_type)
        if loss_weighting not in flow.LOSS_WEIGHTINGS:
            raise ValueError(f"method.loss_weighting={loss_weighting!r}; use one of {list(flow.LOSS_WEIGHTINGS)}")
        if time_sampling not in flow.TIME_SAMPLINGS:
            raise ValueError(f"method.time_sampling={time_sampling!r}; use one of {list(flow.TIME_SAMPLINGS)}")
        if not is_flow_matching({**noise_scheduler.config, "_class_name": type(noise_scheduler).__name__}):
            raise ValueError(f"method.noise_scheduler is a {type(noise_scheduler).__name__}: flow matching trains on a "
                             "flow-matching schedule (diffusers.FlowMatchEulerDiscreteScheduler); for a DDPM-family "
                             "schedule use method=diffusion")
        sampling = sampling or {"name": "flow_euler", "num_inference_steps": 28, "guidance_scale": 1.0}
        super().__init__(student, noise_scheduler, conditioner, optimizer, lr_scheduler, prediction_type,
                         cond_dropout, loss_weighting="none", sampling=sampling, vae=vae, **speed)
        if self.noise.timesteps != "default" or self.noise.stratified or self.noise.antithetic:
            raise ValueError("method.noise (timesteps, stratified, antithetic) draws discrete VP timesteps; flow "
                             "matching draws t by method.time_sampling: leave method.noise at its defaults")
        self.loss_weighting, self.time_sampling = loss_weighting, time_sampling
        self.logit_mean, self.logit_std, self.mode_scale = logit_mean, logit_std, mode_scale

    def draw_times(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """(n,) training times in (0, 1): ``time_sampling``'s draw, shifted by the scheduler's ``shift``."""
        u = flow.sample_flow_times(n, self.time_sampling, self.logit_mean, self.logit_std, self.mode_scale,
                                   generator=generator)
        return self.schedule.shift_times(u)

    def loss(self, batch: dict, generator: torch.Generator | None = None, drop_conditions: bool = True) -> torch.Tensor:
        """E_t w(t) ||F(x_t, t) - target||^2 (Esser et al. 2024, eq. 13 with the velocity target)."""
        x0 = self.latents(batch, generator)  # (N, C, H, W)
        n = x0.shape[0]
        t = self.draw_times(n, generator).to(x0.device)
        eps = self.draw_noise(x0, generator)
        drop = (torch.rand(n, generator=generator) < self.cond_dropout) if drop_conditions else None
        cond = {k: v.to(x0.device) for k, v in self.family.condition(batch, drop).items()}
        x_t = self.schedule.add_noise(x0, eps, t)
        pred = self.family.denoise(self.student, x_t, t, cond)
        target = self.schedule.prediction_target(x0, eps, t, self.prediction_type)
        per_example = (pred.float() - target.float()).pow(2).flatten(1).mean(1)  # (N,)
        return (flow.flow_loss_weight(self.loss_weighting, t).to(per_example) * per_example).mean()

    def export_details(self) -> dict:
        return {"time_sampling": self.time_sampling, "shift": self.schedule.shift, "loss_weighting": self.loss_weighting}
