"""MeanFlow (Geng et al. 2025, "Mean Flows for One-step Generative Modeling", arXiv 2505.13447) on a flow-matching
teacher (SD3, Flux) or a VP one (SD UNet): a one- or few-step student that learns the average velocity u(z, r, t)
between two times of the flow path z_t = (1 - t) x + t eps.

The student is the teacher's network with a second time embedding, of the interval t - r, starting at zero so that the
student starts as the teacher's velocity, the average velocity at r = t (``distill.models.meanflow``: the SD3 or Flux
transformer's own interval embedder; the UNet's ``timestep_cond`` input, a copy student's ``time_cond_proj_dim``). A VP
UNet is read as a flow network, as sCM reads it as a TrigFlow one: at flow time t it sees the VP sample c z_t at its
timestep of noise level t / (1 - t) (``distill.diffusion.meanflow.vp_view``), and its output's (x0, eps) give the
velocity eps - x0; times are kept below the UNet's largest noise level, t <= t_max = sigma_max / (1 + sigma_max).
One training step (MeanFlow Algorithm 1):

- (r, t) logit-normal, r = t on all but ``ratio_r_neq_t`` of the rows (``sample_time_pairs``);
- z_t = (1 - t) x + t eps; v = the teacher's velocity at (z_t, t), guided by classifier-free guidance at
  ``guidance_scale`` (distillation; a teacher with FLUX.1-dev's guidance embedding: one pass at that guidance input,
  and the student is called at the same input), or with ``teacher_free`` the path's own eps - x (training from data);
- u, du/dt = JVP of the student along the tangent (v, 0, 1) in (z, r, t), no gradient (``torch.func.jvp``, or a
  central difference with ``method.jvp=finite_difference``);
- loss sg(w) ||u_theta - sg(v - (t - r) du/dt)||^2, w = 1 / (||delta||^2 + c)^p (adaptive weighting).

Sampling: N uniform steps t_max = t_0 > ... > t_N = 0, z_{t_{i+1}} = z_{t_i} - (t_i - t_{i+1}) u (1 step: z_0 = z_1 - u
on a flow teacher, t_max = 1, unshifted on SD3 and Flux alike), exported as ``DistillMeanFlowSD3Pipeline`` /
``DistillMeanFlowFluxPipeline`` with ``FlowMatchMeanFlowScheduler`` (flow) or ``DistillMeanFlowPipeline`` with
``MeanFlowScheduler`` (UNet): one network call per step. On Flux the export samples at the training resolution by
default (``resolution``, ``bind_resolution``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from distill.diffusion import FlowMatchingSchedule, cfg, to_x0_eps
from distill.diffusion import meanflow as mf
from distill.diffusion.flow import flow_add_noise
from distill.diffusion.jvp import JVP_MODES, time_derivative
from distill.diffusion.schedules import vp_timestep
from distill.inference.meanflow import (
    FlowMatchMeanFlowScheduler,
    MeanFlowScheduler,
    meanflow_pipeline_class,
)
from distill.methods import METHODS
from distill.methods.distillation import TeacherStudentDistillation
from distill.models.meanflow import interval_condition, meanflow_transformer
from distill.models.teacher import Teacher


@METHODS.register("meanflow", choices={"jvp": JVP_MODES})
class MeanFlowDistillation(TeacherStudentDistillation):
    """MeanFlow from a flow teacher's guided velocity (or from data); see the module."""

    method_name = "meanflow"

    def __init__(
        self,
        teacher: Teacher,
        student: nn.Module | Callable[[nn.Module], nn.Module],
        optimizer: Callable,
        lr_scheduler: Callable | None = None,
        logit_mean: float = -0.4,  # (r, t) ~ logit-normal (MeanFlow's ImageNet setting: lognorm(-0.4, 1.0))
        logit_std: float = 1.0,
        ratio_r_neq_t: float = 0.25,  # the fraction of rows with r != t (the paper's 25%)
        adaptive_weight_power: float = 1.0,  # p of w = 1 / (||delta||^2 + c)^p (the paper's 1.0)
        adaptive_weight_c: float = 1.0e-3,
        guidance_scale: float = 3.0,  # the teacher's CFG scale in v (distilled in: one call per step)
        teacher_free: bool = False,  # v = eps - x (training from data; the teacher never runs)
        jvp: str = "autograd",
        finite_difference_step: float = 1.0e-3,
        # the training images' side in pixels (conf/method/meanflow.yaml: data.resolution); read only where the
        # teacher's scheduler shifts by resolution (Flux): the export samples at that size by default
        resolution: int | None = None,
        cache_prompts: bool = True,
        sampling: dict | None = None,
        **speed,
    ):
        if not 0.0 <= ratio_r_neq_t <= 1.0:
            raise ValueError(f"method.ratio_r_neq_t={ratio_r_neq_t} must be in [0, 1] (MeanFlow: 0.25)")
        if logit_std <= 0 or adaptive_weight_c <= 0 or adaptive_weight_power < 0:
            raise ValueError(f"method.logit_std={logit_std}, method.adaptive_weight_c={adaptive_weight_c} must be > 0 "
                             f"and method.adaptive_weight_power={adaptive_weight_power} >= 0")
        if guidance_scale < 1.0:
            raise ValueError(f"method.guidance_scale={guidance_scale} must be >= 1 (1 = the unguided teacher)")
        if jvp not in JVP_MODES or finite_difference_step <= 0:
            raise ValueError(f"method.jvp={jvp!r}, method.finite_difference_step={finite_difference_step}: use one of "
                             f"{list(JVP_MODES)} and a step > 0")
        super().__init__(teacher, student, optimizer, lr_scheduler, guidance_scale_min=guidance_scale,
                         guidance_scale_max=guidance_scale, cache_prompts=cache_prompts, **speed)
        self.flow = isinstance(self.schedule, FlowMatchingSchedule)
        name = type(self.student).__name__
        if self.is_lora or name not in ("SD3Transformer2DModel", "FluxTransformer2DModel", "UNet2DConditionModel"):
            raise ValueError(f"the student is a {name}{' with LoRA adapters' * self.is_lora}: MeanFlow adds its "
                             "interval input to a full copy of a stock SD3Transformer2DModel, FluxTransformer2DModel "
                             "or UNet2DConditionModel; use student=copy")
        if self.flow:
            self.student = meanflow_transformer(self.student)
        elif self.w_dim is None:
            raise ValueError("student.time_cond_proj_dim=null: a MeanFlow UNet takes its second time (the interval "
                             "t - r) through timestep_cond; set student.time_cond_proj_dim=256 (+exp=meanflow does)")
        # the largest flow time the network can see: 1 on flow; a UNet's largest noise level otherwise
        self.t_max = 1.0 if self.flow else mf.flow_time_of_level(float(self.schedule.ve_sigmas[-1]))
        self.save_hyperparameters(ignore=["teacher", "student", "optimizer", "lr_scheduler"])
        self.logit_mean, self.logit_std, self.ratio_r_neq_t = logit_mean, logit_std, ratio_r_neq_t
        self.adaptive_weight_power, self.adaptive_weight_c = adaptive_weight_power, adaptive_weight_c
        self.guidance_scale, self.teacher_free = guidance_scale, teacher_free
        # FLUX.1-dev's guidance input: the teacher's scale (from data there is no guidance: 1)
        self.embedded_guidance = 1.0 if teacher_free else guidance_scale
        self.bind_resolution(resolution)  # under a resolution shift (Flux): the export's default size
        self.jvp, self.finite_difference_step = jvp, finite_difference_step
        own = "flow_meanflow" if self.flow else "meanflow"
        self.sampling = dict(sampling or {"name": own, "num_inference_steps": 1, "guidance_scale": 1.0})
        if self.sampling["name"] != own:
            raise ValueError(f"scheduler.name={self.sampling['name']!r}: a MeanFlow student samples with its average "
                             f"velocity; use scheduler={own}")

    # ------------------------------------------------------------------ the average velocity

    def network_input(self, z: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """(the network's sample, its time argument for ``family.denoise``, the VP (alpha, sigma) or None) at flow
        time t; differentiable in (z, t)."""
        if self.flow:
            return z, t, ()
        shape = (-1,) + (1,) * (z.ndim - 1)
        c, alpha, sigma = (v.to(z).view(shape) for v in mf.vp_view(t))
        return c * z, vp_timestep(t / (1 - t), self.schedule.ve_sigmas).float(), (alpha, sigma)

    def velocity(self, out: torch.Tensor, x: torch.Tensor, view: tuple) -> torch.Tensor:
        """The flow velocity of a network output at its sample ``x``: itself on flow; eps - x0 of a VP output."""
        out = out.to(torch.promote_types(out.dtype, torch.float32))  # a half-precision output in float32
        if not view:
            return out
        x0, eps = to_x0_eps(self.schedule.prediction_type, out, x, *view)
        return eps - x0

    def average_velocity(self, network: nn.Module, z: torch.Tensor, r: torch.Tensor, t: torch.Tensor,
                         cond: dict) -> torch.Tensor:
        """u(z, r, t) of ``network`` at time t with the interval 1000 (t - r) (``interval_condition``),
        differentiable in (z, r, t)."""
        x, time, view = self.network_input(z, t)
        out = self.family.denoise(network, x, time, cond, **interval_condition(network, 1000 * (t - r).float()),
                                  **self.guidance_kwargs(self.student_guidance_embedded, len(x), x.device))
        return self.velocity(out, x, view)

    def guidance_kwargs(self, embedded: bool, n: int, device) -> dict:
        """The guidance input at ``embedded_guidance`` for ``n`` rows of a network with FLUX.1-dev's embedding
        (``embedded``); none otherwise."""
        return self.family.guidance_input(torch.full((n,), self.embedded_guidance, device=device)) if embedded else {}

    @torch.no_grad()
    def teacher_velocity(self, z: torch.Tensor, t: torch.Tensor, cond: dict, uncond: dict) -> torch.Tensor:
        """v(z_t, t): the teacher's velocity, classifier-free guided at ``guidance_scale`` (CFG is linear in the
        output, so in the velocity too), or one pass at that guidance input of a teacher with FLUX.1-dev's embedding."""
        x, time, view = self.network_input(z, t)
        if self.teacher_guidance_embedded:
            extra = self.guidance_kwargs(True, len(x), x.device)
            return self.velocity(self.teacher_forward(x, time.float(), cond, **extra), x, view)
        out_c, out_u = self.teacher_cond_uncond(x, time.float(), cond, uncond)
        v_c = self.velocity(out_c, x, view)
        return v_c if self.guidance_scale == 1.0 else cfg(v_c, self.velocity(out_u, x, view), self.guidance_scale)

    def meanflow_terms(self, batch: dict, generator: torch.Generator | None = None) -> dict:
        """The step's z_t, r, t, condition and stop-gradient target u_tgt = v - (t - r) du/dt."""
        batch = self.paired_batch(batch)
        x = self.latents(batch, generator).contiguous()  # forward AD cannot view a channels-last input in group_norm
        n, device = x.shape[0], x.device
        cond, uncond = self.text_conditions(batch, n, device)
        r, t = mf.sample_time_pairs(self.distinct_rows(n), self.logit_mean, self.logit_std, self.ratio_r_neq_t,
                                    generator)
        # a UNet's times kept below its largest noise level (t_max < 1)
        r, t = (self.paired(v.clamp(max=self.t_max), n).to(device) for v in (r, t))
        eps = self.draw_noise(x, generator)
        z = flow_add_noise(x, eps, t.to(x.dtype).view((-1,) + (1,) * (x.ndim - 1)))  # the flow path, on any teacher
        v = eps - x if self.teacher_free else self.teacher_velocity(z, t, cond, uncond)
        with torch.no_grad():
            _, du_dt = time_derivative(lambda z, r, t: self.average_velocity(self.student, z, r, t, cond), (z, r, t),
                                       (v, torch.zeros_like(r), torch.ones_like(t)), self.jvp,
                                       self.finite_difference_step, networks=[self.student])
        return {"z": z, "r": r, "t": t, "cond": cond, "target": mf.meanflow_target(v, du_dt, r, t)}

    def loss(self, batch: dict, generator: torch.Generator | None = None) -> torch.Tensor:
        terms = self.meanflow_terms(batch, generator)
        u = self.average_velocity(self.student, terms["z"], terms["r"], terms["t"], terms["cond"])
        return mf.meanflow_loss(u, terms["target"], self.adaptive_weight_power, self.adaptive_weight_c).mean()

    # ------------------------------------------------------------------ sampling and export

    @property
    def num_inference_steps(self) -> int:
        return self.sampling["num_inference_steps"]

    def sampling_scheduler(self, name: str | None = None):
        """``FlowMatchMeanFlowScheduler`` (flow) or ``MeanFlowScheduler`` (VP UNet, from t_max)."""
        if self.flow:
            return FlowMatchMeanFlowScheduler.from_config(self.noise_scheduler_config)
        return MeanFlowScheduler.from_config(self.noise_scheduler_config, t_max=self.t_max)

    def call_defaults(self) -> dict:
        """The intended call: the step count, no CFG pass (the guidance is distilled; a UNet's ``timestep_cond`` is
        the interval, not a guidance scale); a student with FLUX.1-dev's guidance embedding at the guidance input it
        was trained at; under a resolution shift the size it was trained at."""
        embedded = self.student_guidance_embedded
        defaults = {"default_num_inference_steps": self.num_inference_steps,
                    "default_guidance_scale": self.embedded_guidance if embedded else 1.0,
                    "guidance_distilled": not embedded}
        if self.latent_size is not None:
            defaults.update(self.family.resolution_defaults(self.latent_size, self.latent_size))
        return defaults

    def pipeline(self, scheduler: str | None = None):
        """The family's export pipeline with the MeanFlow loop (both times to the denoiser)."""
        pipe = self.family.pipeline(self.student, self.sampling_scheduler(scheduler), **self.call_defaults())
        cls = meanflow_pipeline_class(type(pipe))
        keys = ("guidance_distilled", "sigma_spacing", "requires_safety_checker")
        pipe = cls(**pipe.components, **{k: v for k, v in pipe.config.items() if k.startswith("default_") or k in keys})
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def guidance_note(self) -> str:
        scale = (f"guidance_scale is the transformer's guidance input, trained at {self.embedded_guidance} (the "
                 "default)" if self.student_guidance_embedded else "guidance_scale has no effect")
        return (f"distilled from {self.guidance_source()} into the average velocity: one network evaluation per step, "
                f"never a CFG pass; {scale}.")

    def guidance_source(self) -> str:
        kind = "embedded guidance" if self.teacher_guidance_embedded else "classifier-free guidance"
        return "no guidance (trained from data)" if self.teacher_free else \
            f"the teacher's {kind} at scale {self.guidance_scale}"

    def export_info(self) -> dict:
        return {**super().export_info(), "teacher_free": self.teacher_free, "jvp": self.jvp,
                "denoiser": "u(z, r, t): timestep 1000 t, interval 1000 (t - r) (a second time embedding added to the "
                            "first)", "step": "z_r = z_t - (t - r) u, t_i = t_max (1 - i / N)",
                "stock_note": "diffusers' stock pipelines pass the denoiser one time; this model takes two (t and the "
                              "interval t - r) and samples only through its own class, "
                              f"`{meanflow_pipeline_class(self.family.pipeline_class).__name__}`, which "
                              "`DiffusionPipeline.from_pretrained` loads after the import above."}

    @classmethod
    def check_config(cls, cfg) -> None:
        """Before any model is built: the MeanFlow sampler of a local teacher's kind, a UNet student's interval
        input and ``method.resolution`` the data's."""
        from distill.methods.checks import check_resolution
        from distill.methods.dmd2 import _flow_teacher

        name = str(getattr(cfg.scheduler.name, "value", cfg.scheduler.name))
        flow = _flow_teacher(cfg)
        if name not in ("meanflow", "flow_meanflow") or (flow is not None and flow != (name == "flow_meanflow")):
            fix = ("scheduler=flow_meanflow (+exp=meanflow_flow)" if flow else "scheduler=meanflow (+exp=meanflow)"
                   ) if flow is not None else "scheduler=meanflow or flow_meanflow"
            raise ValueError(f"scheduler.name={name!r}: a MeanFlow student samples with its average velocity; use {fix}")
        if flow is False and cfg.get("student", {}).get("time_cond_proj_dim") is None:
            raise ValueError("student.time_cond_proj_dim=null: a MeanFlow UNet takes its second time (the interval "
                             "t - r) through timestep_cond; set student.time_cond_proj_dim=256 (+exp=meanflow does)")
        check_resolution(cfg)
