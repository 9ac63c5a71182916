"""Sampling schedulers by name, each built ``from_config`` of the model's training noise schedule, and
``GridDDIMScheduler``, the DDIM sampler on the exact grid that progressive distillation trains on."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import diffusers
import torch
from diffusers import ConfigMixin, DDPMScheduler, SchedulerMixin
from diffusers.configuration_utils import register_to_config
from diffusers.schedulers.scheduling_ddim import DDIMSchedulerOutput
from diffusers.schedulers.scheduling_utils import KarrasDiffusionSchedulers
from omegaconf import OmegaConf

import distill.inference.trigflow_schedulers  # noqa: F401  (registers distill's schedulers in diffusers' namespace)
from distill.diffusion import add_noise, alpha_sigma, ddim_step, to_x0_eps
from distill.models.teacher import is_flow_matching

SCHEDULERS: dict[str, str] = {
    "ddpm": "DDPMScheduler",
    "ddim": "DDIMScheduler",
    "dpmsolver": "DPMSolverMultistepScheduler",
    "unipc": "UniPCMultistepScheduler",
    "euler": "EulerDiscreteScheduler",
    "heun": "HeunDiscreteScheduler",
    "lcm": "LCMScheduler",
    "tcd": "TCDScheduler",
    "cm": "CMStochasticIterativeScheduler",  # consistency models in EDM's parametrisation (iCT exports)
    "flow_euler": "FlowMatchEulerDiscreteScheduler",  # flow matching (SD3, Flux): Euler on the shifted sigmas
    "flow_lcm": "FlowMatchLCMScheduler",  # a flow consistency student: predict x0, re-noise to the next sigma
    "trigflow": "TrigFlowScheduler",  # sCM students of a VP teacher (distill.inference.trigflow_schedulers)
    "flow_trigflow": "FlowMatchTrigFlowScheduler",  # sCM students of a flow teacher
    "meanflow": "MeanFlowScheduler",  # MeanFlow students of a VP UNet (distill.inference.meanflow)
    "flow_meanflow": "FlowMatchMeanFlowScheduler",  # MeanFlow students of a flow teacher
}
FLOW_SCHEDULERS = tuple(name for name, cls in SCHEDULERS.items() if cls.startswith("FlowMatch"))


def check_scheduler_kind(name: str, base_config: Any, key: str = "scheduler.name") -> None:
    """A flow-matching model samples with a flow scheduler (``FLOW_SCHEDULERS``), a discrete VP one with any other:
    ``from_config`` of the other kind's config would build a scheduler on a schedule the model was not trained on."""
    flow_model, flow_scheduler = is_flow_matching(base_config), name in FLOW_SCHEDULERS
    if flow_model and not flow_scheduler:
        raise ValueError(f"{key}: {name!r} steps a discrete VP (DDPM-family) schedule, but the model is flow matching "
                         f"({base_config.get('_class_name', 'a flow schedule')}); use one of {list(FLOW_SCHEDULERS)}")
    if flow_scheduler and not flow_model:
        raise ValueError(f"{key}: {name!r} is a flow-matching scheduler, but the model has a discrete VP schedule "
                         f"({base_config.get('_class_name', 'DDPM-family')}); use one of "
                         f"{sorted(set(SCHEDULERS) - set(FLOW_SCHEDULERS))}")


# Pixel-space defaults of DDPM/DDIM (x0 clipped to [-1, 1], dynamic thresholding). A latent x0 is not in that
# range, so SD's own DDIM config turns them off; a config of another class (PNDM, Euler) does not name them and
# from_config would take the class default (clip_sample=True). diffusers' pipelines correct that when they are
# built; a scheduler swapped in afterwards is not, hence this.
PIXEL_SPACE_OPTIONS = ("clip_sample", "thresholding")


def unstated_pixel_options(cls: type, base_config: Any) -> dict[str, bool]:
    """``{option: False}`` for each of ``PIXEL_SPACE_OPTIONS`` that ``cls`` takes and ``base_config`` does not
    state itself (absent, or filled in from a class default: diffusers' ``_use_default_values``)."""
    takes = inspect.signature(cls.__init__).parameters
    defaulted = set(base_config.get("_use_default_values") or ())
    return {key: False for key in PIXEL_SPACE_OPTIONS if key in takes and (key not in base_config or key in defaulted)}


def make_scheduler(name: str, base_config: Any, **options: Any):
    """``diffusers.<Class>.from_config(base_config, **options)`` for a scheduler ``name`` of the model's kind
    (``check_scheduler_kind``); x0 clipping and thresholding stay off unless ``base_config`` or ``options`` turn
    them on."""
    if name not in SCHEDULERS:
        raise ValueError(f"scheduler.name={name!r} is unknown; use one of {sorted(SCHEDULERS)}")
    check_scheduler_kind(name, base_config)
    cls = getattr(diffusers, SCHEDULERS[name])
    return cls.from_config(base_config, **{**unstated_pixel_options(cls, base_config), **options})


def grid_timesteps(i: torch.Tensor, num_steps: int, num_train_timesteps: int) -> torch.Tensor:
    """Timestep of point ``i`` of an N-step DDIM grid, t_i = floor(i T / N) - 1 (i = N..1); i = 0 is the clean
    sample, index T (progressive distillation's grid, Salimans & Ho 2022, Algorithm 2 with T discrete steps)."""
    t = (i * num_train_timesteps) // num_steps - 1
    return torch.where(i == 0, torch.full_like(t, num_train_timesteps), t)


class GridDDIMScheduler(SchedulerMixin, ConfigMixin):
    """Deterministic DDIM (Song et al. 2021, eq. 12, eta = 0) from t_i to t_{i-1} on the grid of
    ``grid_timesteps``, the last step landing on the clean sample (alpha = 1, sigma = 0).

    These are the (t, t_prev) pairs a progressive-distillation student is trained on, for every N. diffusers'
    DDIMScheduler with trailing spacing visits the same points only where N divides T: it rounds i T / N and
    steps to t - T // N, which for T / N not whole is neither the training pair nor its own next timestep.
    """

    _compatibles = [e.name for e in KarrasDiffusionSchedulers]  # from_config of their configs drops their own keys
    order = 1

    @register_to_config
    def __init__(self, num_train_timesteps: int = 1000, beta_start: float = 0.0001, beta_end: float = 0.02,
                 beta_schedule: str = "linear", trained_betas: list[float] | None = None,
                 prediction_type: str = "epsilon", rescale_betas_zero_snr: bool = False):
        schedule = DDPMScheduler(num_train_timesteps=num_train_timesteps, beta_start=beta_start, beta_end=beta_end,
                                 beta_schedule=beta_schedule, trained_betas=trained_betas,
                                 rescale_betas_zero_snr=rescale_betas_zero_snr)
        self.alphas_cumprod = schedule.alphas_cumprod.float()
        # index T holds abar = 1: the clean sample, where the last step lands
        self._abar = torch.cat([self.alphas_cumprod, torch.ones(1)])
        self.init_noise_sigma = 1.0
        self.num_inference_steps: int | None = None
        self.timesteps = torch.arange(num_train_timesteps - 1, -1, -1)

    def __len__(self) -> int:
        return self.config.num_train_timesteps

    def set_timesteps(self, num_inference_steps: int, device: str | torch.device | None = None) -> None:
        """timesteps = t_N, ..., t_1 (descending)."""
        T = self.config.num_train_timesteps
        if not 1 <= num_inference_steps <= T:
            raise ValueError(f"num_inference_steps={num_inference_steps} must be in [1, {T}]")
        self.num_inference_steps = num_inference_steps
        self.timesteps = grid_timesteps(torch.arange(num_inference_steps, 0, -1), num_inference_steps, T).to(device)

    def previous_timestep(self, timestep: int | torch.Tensor) -> int:
        """t_{i-1} for t_i on the current grid; T stands for the clean sample."""
        if self.num_inference_steps is None:
            raise ValueError("call set_timesteps(num_inference_steps) before stepping")
        position = (self.timesteps.cpu() == int(timestep)).nonzero()
        if position.numel() == 0:
            raise ValueError(f"timestep {int(timestep)} is not on the {self.num_inference_steps}-step grid {self.timesteps.tolist()}")
        i = self.num_inference_steps - int(position[0, 0])
        return int(grid_timesteps(torch.tensor(i - 1), self.num_inference_steps, self.config.num_train_timesteps))

    def scale_model_input(self, sample: torch.Tensor, timestep: int | None = None) -> torch.Tensor:
        return sample

    def step(self, model_output: torch.Tensor, timestep: int | torch.Tensor, sample: torch.Tensor,
             return_dict: bool = True, **kwargs) -> DDIMSchedulerOutput | tuple:
        t = torch.tensor([int(timestep), self.previous_timestep(timestep)])
        alpha, sigma = alpha_sigma(self._abar, t, ndim=1)
        alpha, sigma = alpha.to(sample.device), sigma.to(sample.device)
        x0, eps = to_x0_eps(self.config.prediction_type, model_output, sample, alpha[0], sigma[0])
        prev = ddim_step(x0, eps, alpha[1], sigma[1]).to(sample.dtype)
        if not return_dict:
            return prev, x0
        return DDIMSchedulerOutput(prev_sample=prev, pred_original_sample=x0)

    def add_noise(self, original_samples: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        alpha, sigma = alpha_sigma(self._abar, timesteps.cpu(), original_samples.ndim)
        return add_noise(original_samples, noise, alpha.to(original_samples), sigma.to(original_samples))


SCHEDULER_CONF = Path(__file__).resolve().parents[1] / "conf" / "scheduler"


def scheduler_options(name: str) -> dict:
    """The ``options`` of the package's ``conf/scheduler/<name>.yaml`` (e.g. DDIM's trailing spacing); none
    for a scheduler without one (``make_scheduler`` rejects unknown names)."""
    path = SCHEDULER_CONF / f"{name}.yaml"
    return dict(OmegaConf.to_container(OmegaConf.load(path)).get("options") or {}) if path.is_file() else {}
