"""sCM's few-step sampler (Lu & Song 2024, arXiv 2410.11081, Algorithm 2 of its appendix: x0 = f(x_T, T), then
re-noised to an intermediate time and denoised again) for a student whose consistency function is read through its
teacher's own parametrisation: ``TrigFlowScheduler`` for a VP network (epsilon / v-prediction at the VP timestep of
TrigFlow time t), ``FlowMatchTrigFlowScheduler`` for a flow-matching one (the velocity at flow time s(t)).

The pipeline's latents are the network's own inputs: a VP sample alpha x0 + sigma eps (``scale_model_input`` maps
TrigFlow's x_t onto it), a flow sample (1 - s) x0 + s eps. Step i evaluates f(x_{t_i}, t_i) = cos(t_i) x_t - sin(t_i)
sigma_d F (``distill.diffusion.trigflow``, exactly what the student was trained on) and re-noises it to t_{i+1}; the last
step returns f. The times: t_0 = t_max (arctan(sigma_max / sigma_d); pi/2 on a flow model, pure noise), then
``intermediate_times`` (the paper's 1.1 for two steps): one network evaluation per step.
"""

from __future__ import annotations

import math

import diffusers
import torch
from diffusers import ConfigMixin, DDPMScheduler, SchedulerMixin
from diffusers.configuration_utils import register_to_config
from diffusers.schedulers.scheduling_lcm import LCMSchedulerOutput
from diffusers.schedulers.scheduling_utils import KarrasDiffusionSchedulers
from diffusers.utils.torch_utils import randn_tensor

from distill.diffusion import to_x0_eps
from distill.diffusion import trigflow as tf
from distill.diffusion.flow import flow_to_x0_eps
from distill.diffusion.schedules import vp_sigmas, vp_timestep

SCM_INTERMEDIATE_TIMES = (1.1,)  # sCM's two-step sampling: t = 1.1 after t_max (Lu & Song 2024, sec. 5 / appendix)


class _TrigFlowSteps:
    """The few-step loop shared by both schedulers: TrigFlow times, a step index, f at each step, re-noising."""

    order = 1

    def _trigflow_times(self, num_inference_steps: int, t_max: float) -> torch.Tensor:
        extra = list(self.config.intermediate_times)
        if not 1 <= num_inference_steps <= 1 + len(extra):
            raise ValueError(f"num_inference_steps={num_inference_steps}: this consistency model samples with 1 step "
                             f"(t_max = {t_max:.4f}) or up to {1 + len(extra)} with the intermediate TrigFlow times "
                             f"{extra}; give more intermediate_times (descending, in (0, pi/2)) to sample more steps")
        return torch.tensor([t_max, *extra[:num_inference_steps - 1]], dtype=torch.float64)

    def _begin(self, num_inference_steps: int, t_max: float) -> None:
        self.num_inference_steps = num_inference_steps
        self.trigflow_times = self._trigflow_times(num_inference_steps, t_max)
        self._step_index = 0

    def _current(self) -> torch.Tensor:
        if getattr(self, "trigflow_times", None) is None:
            raise ValueError("call set_timesteps(num_inference_steps) before stepping")
        return self.trigflow_times[self._step_index: self._step_index + 1]

    def _finish(self, x0: torch.Tensor, generator, as_sample, return_dict: bool):
        """Re-noise f = x0 to the next time's sample (``as_sample(x0, noise, t_next)``), or return it at the end."""
        i = self._step_index
        self._step_index += 1
        if i + 1 < len(self.trigflow_times):
            noise = randn_tensor(x0.shape, generator=generator, device=x0.device, dtype=x0.dtype)
            prev = as_sample(x0, noise, self.trigflow_times[i + 1: i + 2])
        else:
            prev = x0
        if not return_dict:
            return prev, x0
        return LCMSchedulerOutput(prev_sample=prev, denoised=x0)


class TrigFlowScheduler(_TrigFlowSteps, SchedulerMixin, ConfigMixin):
    """sCM sampling of a VP network (``prediction_type`` epsilon / v_prediction / sample) trained as a TrigFlow
    consistency model with ``sigma_data``: TrigFlow time t is the network's VP timestep at noise level sigma_d tan t
    (``vp_timestep``, continuous), its input the VP sample c x_t; t_max at the schedule's last noise level, or
    ``sigma_max``."""

    _compatibles = [e.name for e in KarrasDiffusionSchedulers]

    @register_to_config
    def __init__(self, num_train_timesteps: int = 1000, beta_start: float = 0.0001, beta_end: float = 0.02,
                 beta_schedule: str = "linear", trained_betas: list[float] | None = None,
                 prediction_type: str = "epsilon", rescale_betas_zero_snr: bool = False, sigma_data: float = 1.0,
                 sigma_max: float | None = None, intermediate_times: tuple[float, ...] = SCM_INTERMEDIATE_TIMES):
        schedule = DDPMScheduler(num_train_timesteps=num_train_timesteps, beta_start=beta_start, beta_end=beta_end,
                                 beta_schedule=beta_schedule, trained_betas=trained_betas,
                                 rescale_betas_zero_snr=rescale_betas_zero_snr)
        self.ve_sigmas = vp_sigmas(schedule.alphas_cumprod)  # (T,) float64
        level = float(self.ve_sigmas[-1]) if sigma_max is None else sigma_max
        self.t_max = math.atan(level / sigma_data)
        self.init_noise_sigma = 1.0  # x_{t_max}'s VP sample: alpha x0 + sigma eps with sigma ~ 1
        self.trigflow_times, self.num_inference_steps = None, None
        self.timesteps = torch.tensor([])

    def set_timesteps(self, num_inference_steps: int, device: str | torch.device | None = None) -> None:
        """timesteps: the VP timesteps (floats) of the TrigFlow times t_max, intermediate_times[:N - 1]."""
        self._begin(num_inference_steps, self.t_max)
        sigma = tf.noise_level(self.trigflow_times, self.config.sigma_data)
        self.timesteps = vp_timestep(sigma, self.ve_sigmas).float().to(device)

    def scale_model_input(self, sample: torch.Tensor, timestep=None) -> torch.Tensor:
        return sample  # the latents are already the VP network's input

    def step(self, model_output: torch.Tensor, timestep, sample: torch.Tensor, generator=None,
             return_dict: bool = True, **kwargs):
        """f(x_t, t) of the network's output at the VP sample ``sample``, re-noised to the next time's VP sample."""
        sigma_d = self.config.sigma_data
        t = self._current().to(sample.device)
        c, alpha, sigma = (v.to(sample).view(-1, *[1] * (sample.ndim - 1)) for v in tf.vp_view(t, sigma_d))
        x0, eps = to_x0_eps(self.config.prediction_type, model_output, sample, alpha, sigma)
        f = tf.consistency_function(sample / c, tf.trigflow_from_x0_eps(x0, eps, t, sigma_d), t, sigma_d)

        def vp_sample(x0, noise, t_next):
            _, a, s = (v.to(x0).view(-1, *[1] * (x0.ndim - 1)) for v in tf.vp_view(t_next.to(x0.device), sigma_d))
            return a * x0 + s * noise

        return self._finish(f.to(sample.dtype), generator, vp_sample, return_dict)

    def __len__(self) -> int:
        return self.config.num_train_timesteps


class FlowMatchTrigFlowScheduler(_TrigFlowSteps, SchedulerMixin, ConfigMixin):
    """sCM sampling of a flow-matching network (velocity at timestep 1000 s) trained as a TrigFlow consistency model
    with ``sigma_data``: TrigFlow time t is flow time s = sigma_d sin t / (cos t + sigma_d sin t), t_max = pi/2 (s = 1).
    The flow scheduler's ``shift`` is accepted and not applied: the times are the student's own. So are the ``sigmas``
    and ``mu`` that ``FluxPipeline`` passes to ``set_timesteps`` (linspace(1, 1 / N, N) and its resolution shift): only
    their count N is read."""

    _compatibles = ["FlowMatchEulerDiscreteScheduler", "FlowMatchLCMScheduler"]

    @register_to_config
    def __init__(self, num_train_timesteps: int = 1000, shift: float = 1.0, sigma_data: float = 1.0,
                 intermediate_times: tuple[float, ...] = SCM_INTERMEDIATE_TIMES):
        self.init_noise_sigma = 1.0
        self.trigflow_times, self.num_inference_steps = None, None
        self.timesteps = torch.tensor([])

    def set_timesteps(self, num_inference_steps: int | None = None, device: str | torch.device | None = None,
                      sigmas: list[float] | None = None, mu: float | None = None, **kwargs) -> None:
        """timesteps: 1000 s(t) of the TrigFlow times pi/2, intermediate_times[:N - 1]; N = len(sigmas) where only
        sigmas are given (FluxPipeline's call)."""
        self._begin(len(sigmas) if num_inference_steps is None and sigmas is not None else num_inference_steps,
                    math.pi / 2)
        _, s = tf.flow_view(self.trigflow_times, self.config.sigma_data)
        self.sigmas = s.float().to(device)
        self.timesteps = (s * self.config.num_train_timesteps).float().to(device)

    def set_begin_index(self, begin_index: int = 0) -> None:
        """FluxPipeline's call sets it; the steps always run from the first time."""

    def scale_model_input(self, sample: torch.Tensor, timestep=None) -> torch.Tensor:
        return sample

    def step(self, model_output: torch.Tensor, timestep, sample: torch.Tensor, generator=None,
             return_dict: bool = True, **kwargs):
        """f(x_t, t) of the velocity at the flow sample ``sample``, re-noised to the next time's flow sample."""
        sigma_d = self.config.sigma_data
        t = self._current().to(sample.device)
        c, s = (v.to(sample).view(-1, *[1] * (sample.ndim - 1)) for v in tf.flow_view(t, sigma_d))
        x0, eps = flow_to_x0_eps("flow_prediction", model_output, sample, s)
        f = tf.consistency_function(sample / c, tf.trigflow_from_x0_eps(x0, eps, t, sigma_d), t, sigma_d)

        def flow_sample(x0, noise, t_next):
            _, s_next = (v.to(x0).view(-1, *[1] * (x0.ndim - 1)) for v in tf.flow_view(t_next.to(x0.device), sigma_d))
            return (1 - s_next) * x0 + s_next * noise

        return self._finish(f.to(sample.dtype), generator, flow_sample, return_dict)

    def __len__(self) -> int:
        return self.config.num_train_timesteps


for _cls in (TrigFlowScheduler, FlowMatchTrigFlowScheduler):
    setattr(diffusers, _cls.__name__, _cls)  # make_scheduler and from_pretrained resolve the class there
