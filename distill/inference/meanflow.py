"""The MeanFlow exports: a scheduler holding the times t_0 > ... > t_N = 0 and the step z_r = z_t - (t - r) u, and a
pipeline whose loop passes the denoiser both times, its timestep at t and the interval 1000 (t - r) (a stock pipeline
passes one timestep): one network call per step.

- flow transformer (SD3, Flux): ``FlowMatchMeanFlowScheduler`` (t_0 = 1, timesteps 1000 t) and
  ``DistillMeanFlowSD3Pipeline`` / ``DistillMeanFlowFluxPipeline`` (packed latents, FLUX.1-dev's guidance input);
- VP UNet (SD family): ``MeanFlowScheduler`` (t_0 at the UNet's largest noise level sigma_max / (1 + sigma_max); the
  UNet sees the VP sample c z_t at its timestep of noise level t / (1 - t), and its (x0, eps) give u = eps - x0) and
  ``DistillMeanFlowPipeline``.
"""

from __future__ import annotations

import diffusers
import torch
from diffusers import ConfigMixin, DDPMScheduler, SchedulerMixin
from diffusers.configuration_utils import register_to_config
from diffusers.pipelines.flux.pipeline_output import FluxPipelineOutput
from diffusers.pipelines.stable_diffusion.pipeline_output import StableDiffusionPipelineOutput
from diffusers.pipelines.stable_diffusion_3.pipeline_output import StableDiffusion3PipelineOutput
from diffusers.schedulers.scheduling_lcm import LCMSchedulerOutput
from diffusers.schedulers.scheduling_utils import KarrasDiffusionSchedulers

from distill.diffusion import meanflow as mf
from distill.diffusion import to_x0_eps
from distill.diffusion.meanflow import meanflow_step
from distill.diffusion.schedules import vp_sigmas, vp_timestep
from distill.families.flux import DistillFluxPipeline
from distill.families.sd3 import DistillSD3Pipeline
from distill.inference.intended_call import DistillTextToImagePipeline
from distill.models.meanflow import interval_condition


class FlowMatchMeanFlowScheduler(SchedulerMixin, ConfigMixin):
    """MeanFlow's few-step sampler (Geng et al. 2025, Algorithm 2): N uniform steps t_i = 1 - i / N, each z_{t_{i+1}} =
    z_{t_i} - (t_i - t_{i+1}) u(z_{t_i}, t_{i+1}, t_i). ``timesteps``: 1000 t_i; ``intervals``: 1000 (t_i - t_{i+1})."""

    _compatibles = ["FlowMatchEulerDiscreteScheduler", "FlowMatchLCMScheduler"]
    order = 1

    @register_to_config
    def __init__(self, num_train_timesteps: int = 1000, shift: float = 1.0):
        self.init_noise_sigma = 1.0
        self.times = self.timesteps = self.intervals = None
        self._step_index = 0

    def set_timesteps(self, num_inference_steps: int, device: str | torch.device | None = None, **kwargs) -> None:
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps={num_inference_steps} must be >= 1")
        self.times = torch.linspace(1, 0, num_inference_steps + 1, dtype=torch.float64)
        T = self.config.num_train_timesteps
        self.timesteps = (T * self.times[:-1]).float().to(device)
        self.intervals = (T * (self.times[:-1] - self.times[1:])).float().to(device)
        self._step_index = 0

    def scale_model_input(self, sample: torch.Tensor, timestep=None) -> torch.Tensor:
        return sample

    def step(self, model_output: torch.Tensor, timestep, sample: torch.Tensor, return_dict: bool = True, **kwargs):
        """z_r = z_t - (t - r) u with u = ``model_output`` at this step's (r, t); ``denoised``: z_0 in one jump."""
        i = self._step_index
        t, r = float(self.times[i]), float(self.times[i + 1])
        self._step_index += 1
        prev = meanflow_step(sample, model_output, r, t)
        if not return_dict:
            return (prev,)
        return LCMSchedulerOutput(prev_sample=prev, denoised=meanflow_step(sample, model_output, 0.0, t))

    def __len__(self) -> int:
        return self.config.num_train_timesteps


class DistillMeanFlowSD3Pipeline(DistillSD3Pipeline):
    """A ``DistillSD3Pipeline`` whose denoiser is a MeanFlow network (``MeanFlowSD3Transformer2DModel``): each step calls
    it once at (timestep 1000 t, interval 1000 (t - r)) and jumps z_r = z_t - (t - r) u. No CFG pass: the guidance is
    distilled in (``guidance_distilled``)."""

    @torch.no_grad()
    def __call__(self, prompt=None, num_inference_steps: int | None = None, guidance_scale: float | None = None,
                 height: int | None = None, width: int | None = None, num_images_per_prompt: int = 1,
                 generator: torch.Generator | None = None, latents: torch.Tensor | None = None,
                 prompt_embeds: torch.Tensor | None = None, pooled_prompt_embeds: torch.Tensor | None = None,
                 output_type: str = "pil", return_dict: bool = True, max_sequence_length: int | None = None,
                 callback_on_step_end=None, **kwargs):
        steps = num_inference_steps or self.config.default_num_inference_steps
        height = height or self.default_sample_size * self.vae_scale_factor
        width = width or self.default_sample_size * self.vae_scale_factor
        device = self._execution_device
        prompt_embeds, _, pooled, _ = self.encode_prompt(
            prompt=prompt, prompt_2=None, prompt_3=None, device=device, num_images_per_prompt=num_images_per_prompt,
            do_classifier_free_guidance=False, prompt_embeds=prompt_embeds, pooled_prompt_embeds=pooled_prompt_embeds,
            max_sequence_length=max_sequence_length or self.config.default_max_sequence_length)
        z = self.prepare_latents(len(prompt_embeds), self.transformer.config.in_channels, height, width,
                                 prompt_embeds.dtype, device, generator, latents)
        self.scheduler.set_timesteps(steps, device=device)
        for i, (timestep, interval) in enumerate(zip(self.scheduler.timesteps, self.scheduler.intervals)):
            u = self.transformer(hidden_states=z, timestep=timestep.expand(len(z)),
                                 **interval_condition(self.transformer, interval.expand(len(z))),
                                 encoder_hidden_states=prompt_embeds, pooled_projections=pooled,
                                 return_dict=False)[0]
            z = self.scheduler.step(u, timestep, z, return_dict=False)[0]
            if callback_on_step_end is not None:
                z = callback_on_step_end(self, i, timestep, {"latents": z}).pop("latents", z)
        if output_type == "latent":
            image = z
        else:
            z = z / self.vae.config.scaling_factor + self.vae.config.shift_factor
            image = self.image_processor.postprocess(self.vae.decode(z, return_dict=False)[0], output_type=output_type)
        self.maybe_free_model_hooks()
        return StableDiffusion3PipelineOutput(images=image) if return_dict else (image,)


class DistillMeanFlowFluxPipeline(DistillFluxPipeline):
    """A ``DistillFluxPipeline`` whose denoiser is a MeanFlow network (``MeanFlowFluxTransformer2DModel``): each step
    calls it once, as ``FluxPipeline`` calls the transformer (packed latents, ``timestep / 1000``, the guidance input
    where it has FLUX.1-dev's embedding), with the interval 1000 (t - r), and jumps z_r = z_t - (t - r) u. No CFG
    pass: the guidance is distilled in (``guidance_distilled``) or taken through the embedding."""

    @torch.no_grad()
    def __call__(self, prompt=None, num_inference_steps: int | None = None, guidance_scale: float | None = None,
                 height: int | None = None, width: int | None = None, num_images_per_prompt: int = 1,
                 generator: torch.Generator | None = None, latents: torch.Tensor | None = None,
                 prompt_embeds: torch.Tensor | None = None, pooled_prompt_embeds: torch.Tensor | None = None,
                 output_type: str = "pil", return_dict: bool = True, max_sequence_length: int | None = None,
                 callback_on_step_end=None, **kwargs):
        steps = num_inference_steps or self.config.default_num_inference_steps
        height = height or self.default_sample_size * self.vae_scale_factor
        width = width or self.default_sample_size * self.vae_scale_factor
        device = self._execution_device
        prompt_embeds, pooled, text_ids = self.encode_prompt(
            prompt=prompt, prompt_2=None, prompt_embeds=prompt_embeds, pooled_prompt_embeds=pooled_prompt_embeds,
            device=device, num_images_per_prompt=num_images_per_prompt,
            max_sequence_length=max_sequence_length or self.config.default_max_sequence_length)
        z, image_ids = self.prepare_latents(len(prompt_embeds), self.transformer.config.in_channels // 4, height, width,
                                            prompt_embeds.dtype, device, generator, latents)  # (N, T, 4C) packed
        guidance = None
        if self.transformer.config.guidance_embeds:
            scale = self.config.default_guidance_scale if guidance_scale is None else guidance_scale
            guidance = torch.full((len(z),), scale, device=device, dtype=torch.float32)
        self.scheduler.set_timesteps(steps, device=device)
        for i, (timestep, interval) in enumerate(zip(self.scheduler.timesteps, self.scheduler.intervals)):
            u = self.transformer(hidden_states=z, timestep=timestep.expand(len(z)).to(z.dtype) / 1000,
                                 interval=interval.expand(len(z)), guidance=guidance, pooled_projections=pooled,
                                 encoder_hidden_states=prompt_embeds, txt_ids=text_ids, img_ids=image_ids,
                                 return_dict=False)[0]
            z = self.scheduler.step(u, timestep, z, return_dict=False)[0]
            if callback_on_step_end is not None:
                z = callback_on_step_end(self, i, timestep, {"latents": z}).pop("latents", z)
        if output_type == "latent":
            image = z
        else:
            z = self._unpack_latents(z, height, width, self.vae_scale_factor)
            z = z / self.vae.config.scaling_factor + self.vae.config.shift_factor
            image = self.image_processor.postprocess(self.vae.decode(z, return_dict=False)[0], output_type=output_type)
        self.maybe_free_model_hooks()
        return FluxPipelineOutput(images=image) if return_dict else (image,)


class MeanFlowScheduler(SchedulerMixin, ConfigMixin):
    """MeanFlow's few-step sampler for a VP UNet read as an average velocity: N uniform flow times from t_0 = sigma_max /
    (1 + sigma_max) (the UNet's largest noise level; or ``t_max``) to 0. The UNet sees the VP sample c z_t
    (``scale_model_input``) at ``timesteps`` (its continuous timestep of noise level t / (1 - t)) with the interval
    1000 (t - r) (``intervals``); ``step`` reads its output as (x0, eps) at that sample, u = eps - x0, and jumps
    z_r = z_t - (t - r) u."""

    _compatibles = [e.name for e in KarrasDiffusionSchedulers]
    order = 1

    @register_to_config
    def __init__(self, num_train_timesteps: int = 1000, beta_start: float = 0.0001, beta_end: float = 0.02,
                 beta_schedule: str = "linear", trained_betas: list[float] | None = None,
                 prediction_type: str = "epsilon", rescale_betas_zero_snr: bool = False, t_max: float | None = None):
        schedule = DDPMScheduler(num_train_timesteps=num_train_timesteps, beta_start=beta_start, beta_end=beta_end,
                                 beta_schedule=beta_schedule, trained_betas=trained_betas,
                                 rescale_betas_zero_snr=rescale_betas_zero_snr)
        self.ve_sigmas = vp_sigmas(schedule.alphas_cumprod)
        self.t_max = mf.flow_time_of_level(float(self.ve_sigmas[-1])) if t_max is None else t_max
        # the flow sample at t_max, (1 - t) x + t eps, has spread 1 / c(t_max) for unit-variance latents: the UNet's
        # first input c z is then unit-variance noise, as in training (at t_max < 1, 1 / c < 1)
        self.init_noise_sigma = 1.0 / float(mf.vp_view(torch.tensor([self.t_max], dtype=torch.float64))[0])
        self.times = self.timesteps = self.intervals = None
        self._step_index = 0

    def set_timesteps(self, num_inference_steps: int, device: str | torch.device | None = None, **kwargs) -> None:
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps={num_inference_steps} must be >= 1")
        self.times = torch.linspace(self.t_max, 0, num_inference_steps + 1, dtype=torch.float64)
        t = self.times[:-1]
        self.timesteps = vp_timestep(t / (1 - t), self.ve_sigmas).float().to(device)
        self.intervals = (1000 * (self.times[:-1] - self.times[1:])).float().to(device)
        self._step_index = 0

    def _view(self, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t = self.times[self._step_index: self._step_index + 1]
        return tuple(v.to(like).view(-1, *[1] * (like.ndim - 1)) for v in mf.vp_view(t))

    def scale_model_input(self, sample: torch.Tensor, timestep=None) -> torch.Tensor:
        """The UNet's input c z_t of the flow sample z_t."""
        return sample * self._view(sample)[0]

    def step(self, model_output: torch.Tensor, timestep, sample: torch.Tensor, return_dict: bool = True, **kwargs):
        c, alpha, sigma = self._view(sample)
        x0, eps = to_x0_eps(self.config.prediction_type, model_output, c * sample, alpha, sigma)
        i = self._step_index
        t, r = float(self.times[i]), float(self.times[i + 1])
        self._step_index += 1
        prev = meanflow_step(sample, eps - x0, r, t)
        if not return_dict:
            return (prev,)
        return LCMSchedulerOutput(prev_sample=prev, denoised=meanflow_step(sample, eps - x0, 0.0, t))

    def __len__(self) -> int:
        return self.config.num_train_timesteps


class DistillMeanFlowPipeline(DistillTextToImagePipeline):
    """A ``DistillTextToImagePipeline`` whose UNet is a MeanFlow network (the interval through ``timestep_cond``): each
    step calls it once at its timestep of t with the interval 1000 (t - r) and jumps z_r = z_t - (t - r) u
    (``MeanFlowScheduler``). No CFG pass: the guidance is distilled in."""

    @torch.no_grad()
    def __call__(self, prompt=None, num_inference_steps: int | None = None, guidance_scale: float | None = None,
                 height: int | None = None, width: int | None = None, num_images_per_prompt: int = 1,
                 generator: torch.Generator | None = None, latents: torch.Tensor | None = None,
                 prompt_embeds: torch.Tensor | None = None, output_type: str = "pil", return_dict: bool = True,
                 callback_on_step_end=None, **kwargs):
        steps = num_inference_steps or self.config.default_num_inference_steps
        height = height or self.unet.config.sample_size * self.vae_scale_factor
        width = width or self.unet.config.sample_size * self.vae_scale_factor
        device = self._execution_device
        prompt_embeds, _ = self.encode_prompt(prompt, device, num_images_per_prompt, False, prompt_embeds=prompt_embeds)
        z = self.prepare_latents(len(prompt_embeds), self.unet.config.in_channels, height, width, prompt_embeds.dtype,
                                 device, generator, latents)
        self.scheduler.set_timesteps(steps, device=device)
        for i, (timestep, interval) in enumerate(zip(self.scheduler.timesteps, self.scheduler.intervals)):
            out = self.unet(self.scheduler.scale_model_input(z, timestep), timestep.expand(len(z)),
                            encoder_hidden_states=prompt_embeds,
                            **interval_condition(self.unet, interval.expand(len(z)))).sample
            z = self.scheduler.step(out, timestep, z, return_dict=False)[0]
            if callback_on_step_end is not None:
                z = callback_on_step_end(self, i, timestep, {"latents": z}).pop("latents", z)
        if output_type == "latent":
            image = z
        else:
            image = self.vae.decode(z / self.vae.config.scaling_factor, return_dict=False)[0]
            image = self.image_processor.postprocess(image, output_type=output_type)
        self.maybe_free_model_hooks()
        return StableDiffusionPipelineOutput(images=image, nsfw_content_detected=None) if return_dict else (image,)


for _cls in (FlowMatchMeanFlowScheduler, DistillMeanFlowSD3Pipeline, DistillMeanFlowFluxPipeline, MeanFlowScheduler,
             DistillMeanFlowPipeline):
    setattr(diffusers, _cls.__name__, _cls)  # make_scheduler and from_pretrained resolve the class there


def meanflow_pipeline_class(family_pipeline: type) -> type:
    """The MeanFlow export class of a family's pipeline class: Flux's, SD3's, else the UNet one."""
    for base, cls in ((DistillFluxPipeline, DistillMeanFlowFluxPipeline), (DistillSD3Pipeline, DistillMeanFlowSD3Pipeline)):
        if issubclass(family_pipeline, base):
            return cls
    return DistillMeanFlowPipeline
