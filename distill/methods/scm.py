"""Continuous-time consistency distillation, sCD (Lu & Song 2024, "Simplifying, Stabilizing and Scaling
Continuous-Time Consistency Models", arXiv 2410.11081), on a VP (SD UNet) or flow-matching (SD3, Flux transformer)
teacher.

TrigFlow (``distill.diffusion.trigflow``): x_t = cos(t) x0 + sin(t) z, z ~ N(0, sigma_d^2 I); the consistency function
f(x_t, t) = cos(t) x_t - sin(t) sigma_d F(x_t, t). The student is a copy of the teacher's network read through the
teacher's own parametrisation: at TrigFlow time t it sees the teacher's sample c(t) x_t at the teacher's own time input
(a VP teacher: its continuous timestep of noise level sigma_d tan t; a flow teacher: 1000 s(t)), and its output (eps, v
or velocity) becomes F by way of its (x0, eps). So the time embedding is the teacher's and nothing but the loss changes;
with sigma_d = 1 a VP teacher's sample is x_t itself.

One training step (sCM Algorithm 1, sCD):

- sigma ~ lognormal(p_mean + log(sigma_d / 0.5), p_std) truncated to the teacher's noise range (the paper's P_mean is
  stated for data of std 0.5), t = arctan(sigma / sigma_d);
- dx_t/dt = sigma_d F_teacher(x_t, t), the teacher's classifier-free guided prediction at ``guidance_scale``
  converted to TrigFlow (a teacher with FLUX.1-dev's guidance embedding: one pass at that guidance input, and the
  student is called at the same input; with ``teacher_free``: the path's own cos(t) z - sin(t) x0, sCT);
- F-, dF-/dt of the student under stop-gradient by ``torch.func.jvp`` with tangent (dx_t/dt, 1) (``method.jvp=
  finite_difference``: a central difference instead, ``distill.diffusion.jvp``);
- g = -cos^2(t) (sigma_d F- - dx_t/dt) - r cos(t) sin(t) (x_t + sigma_d dF-/dt), r = min(1, step / H) (tangent warm-up),
  g / (||g|| + c) (tangent normalisation);
- loss e^{w(t)} / D ||F - F- - g||^2 - w(t), w the adaptive weighting network (``AdaptiveWeighting``) trained jointly
  with the student (one optimizer; checkpointed with it).

Sampling (``TrigFlowScheduler`` / ``FlowMatchTrigFlowScheduler``): f at t_max (the teacher's largest noise level; pi/2 on
flow), and for two steps f again after re-noising to the paper's intermediate t = 1.1; one network call per step. On
Flux (a resolution shift) the times are not shifted (the consistency function is learned on sCM's own proposal at
every time); the export samples at the training resolution by default (``resolution``, ``bind_resolution``).

With ``dmd_weight`` > 0 this is rCM (``distill.methods.rcm``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from distill.diffusion import FlowMatchingSchedule, cfg, to_x0_eps
from distill.diffusion import consistency_training as ct
from distill.diffusion import trigflow as tf
from distill.diffusion.jvp import JVP_MODES, time_derivative
from distill.diffusion.schedules import vp_timestep
from distill.inference.schedulers import check_scheduler_kind, make_scheduler
from distill.inference.trigflow_schedulers import SCM_INTERMEDIATE_TIMES
from distill.methods import METHODS
from distill.methods.distillation import TeacherStudentDistillation
from distill.models.moe import no_routing_record
from distill.models.teacher import Teacher

SCM_PAPER_SIGMA_DATA = 0.5  # the data std at which sCM states its proposal (P_mean, P_std)


@METHODS.register("scm", choices={"jvp": JVP_MODES})
class ContinuousTimeConsistencyDistillation(TeacherStudentDistillation):
    """sCD (sCM's consistency distillation) of the teacher's guided PF-ODE into a 1-2 step student; see the module."""

    method_name = "scm"

    def __init__(
        self,
        teacher: Teacher,
        student: nn.Module | Callable[[nn.Module], nn.Module],
        optimizer: Callable,
        lr_scheduler: Callable | None = None,
        sigma_data: float = 1.0,  # TrigFlow's data std (SD-format latents are scaled to ~1; the paper's pixels: 0.5)
        # sCM's proposal for sCD (ImageNet 512): log sigma ~ N(p_mean, p_std^2) at the paper's sigma_d = 0.5; at another
        # sigma_d the mean moves by log(sigma_d / 0.5), so that sigma / sigma_d (the SNR) is drawn as in the paper
        p_mean: float = -0.8,
        p_std: float = 1.6,
        guidance_scale: float = 3.0,  # the teacher's CFG scale in dx_t/dt (distilled in: the student has no w input)
        teacher_free: bool = False,  # sCT: dx_t/dt = cos(t) z - sin(t) x0, the teacher never runs
        tangent_normalization: float = 0.1,  # c of g / (||g|| + c); 0: off
        tangent_warmup_steps: int = 10000,  # H of r = min(1, step / H) (the paper's 10k); 0: r = 1 from the start
        weighting_channels: int = 128,  # Fourier features of the adaptive weighting w(t)
        jvp: str = "autograd",  # "autograd": torch.func.jvp; "finite_difference": central difference
        finite_difference_step: float = 1.0e-3,  # h (TrigFlow time) of method.jvp=finite_difference
        intermediate_times: list[float] | None = None,  # TrigFlow times after t_max for steps 2, ...; None: [1.1]
        # the training images' side in pixels (conf/method/scm.yaml: data.resolution); read only where the teacher's
        # scheduler shifts by resolution (Flux): the export samples at that size by default
        resolution: int | None = None,
        cache_prompts: bool = True,
        sampling: dict | None = None,
        **speed,
    ):
        check_options(sigma_data, p_std, guidance_scale, tangent_normalization, tangent_warmup_steps, jvp,
                      finite_difference_step, intermediate_times)
        super().__init__(teacher, student, optimizer, lr_scheduler, guidance_scale_min=guidance_scale,
                         guidance_scale_max=guidance_scale, cache_prompts=cache_prompts, **speed)
        if self.w_dim is not None:
            raise ValueError(f"student.time_cond_proj_dim={self.w_dim}: an sCM student distils the teacher's guidance "
                             "at method.guidance_scale without a guidance input; set student.time_cond_proj_dim=null")
        self.flow = isinstance(self.schedule, FlowMatchingSchedule)
        # rCM's critic partials too (Lightning collects the subclass's arguments as well)
        self.save_hyperparameters(ignore=["teacher", "student", "optimizer", "lr_scheduler", "critic_optimizer",
                                          "critic_lr_scheduler"])
        self.sigma_data, self.p_mean, self.p_std = sigma_data, p_mean, p_std
        self.guidance_scale, self.teacher_free = guidance_scale, teacher_free
        # FLUX.1-dev's guidance input: the teacher's scale (sCT has no guidance: 1, as ECT gives it)
        self.embedded_guidance = 1.0 if teacher_free else guidance_scale
        self.bind_resolution(resolution)  # under a resolution shift (Flux): the export's default size
        self.tangent_normalization, self.tangent_warmup_steps = tangent_normalization, tangent_warmup_steps
        self.jvp, self.finite_difference_step = jvp, finite_difference_step
        self.intermediate_times = tuple(intermediate_times or SCM_INTERMEDIATE_TIMES)
        self.weighting = tf.AdaptiveWeighting(weighting_channels, sigma_data)
        name = "flow_trigflow" if self.flow else "trigflow"
        self.sampling = dict(sampling or {"name": name, "num_inference_steps": 2, "guidance_scale": 1.0})
        check_scheduler_kind(self.sampling["name"], self.noise_scheduler_config)
        if self.sampling["name"] != name:
            raise ValueError(f"scheduler.name={self.sampling['name']!r}: an sCM student samples with its own "
                             f"consistency function at TrigFlow times; use scheduler={name}")
        self.sampling_scheduler()  # refuses a step count beyond the intermediate times before any training

    # ------------------------------------------------------------------ parameters

    def trainable_parameters(self):
        """The student's and the adaptive weighting's: both minimise the one loss (sCM sec. 4.3)."""
        return [p for p in [*self.student.parameters(), *self.weighting.parameters()] if p.requires_grad]

    # ------------------------------------------------------------------ TrigFlow through the teacher's parametrisation

    def noise_range(self) -> tuple[float, float]:
        """The noise levels sigma = sigma_d tan t trained on: a VP teacher's first and last (its table's), a flow
        teacher's at flow times 1 / T and 1 - 1 / T (s / (1 - s) = sigma_d tan t)."""
        if self.flow:
            T = self.schedule.num_train_timesteps
            lo, hi = self.schedule.noise_level(torch.tensor([1.0 / T, 1.0 - 1.0 / T], dtype=torch.float64)).tolist()
            return lo, hi
        levels = self.schedule.ve_sigmas
        return float(levels[0]), float(levels[-1])

    def network_input(self, x_t: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(the teacher-space sample c x_t, the network's time argument for ``family.denoise``, what converts its
        output: alpha/sigma on VP, s on flow) at TrigFlow time t (N,) float64; differentiable in (x_t, t)."""
        shape = (-1,) + (1,) * (x_t.ndim - 1)
        if self.flow:
            c, s = tf.flow_view(t, self.sigma_data)
            return x_t * c.to(x_t).view(shape), s, {"s": s}
        c, alpha, sigma = tf.vp_view(t, self.sigma_data)
        tau = vp_timestep(tf.noise_level(t, self.sigma_data), self.schedule.ve_sigmas)
        return (x_t * c.to(x_t).view(shape), tau.float(),
                {"alpha": alpha.to(x_t).view(shape), "sigma": sigma.to(x_t).view(shape)})

    def to_trigflow(self, out: torch.Tensor, x: torch.Tensor, t: torch.Tensor, view: dict) -> torch.Tensor:
        """F of a network output ``out`` at the teacher-space sample ``x``."""
        if self.flow:
            x0, eps = self.schedule.to_x0_eps(out, x, view["s"].float())
        else:
            x0, eps = to_x0_eps(self.schedule.prediction_type, out, x, view["alpha"], view["sigma"])
        return tf.trigflow_from_x0_eps(x0, eps, t, self.sigma_data)

    def guidance_kwargs(self, embedded: bool, n: int, device) -> dict:
        """The guidance input at ``embedded_guidance`` for ``n`` rows of a network with FLUX.1-dev's embedding
        (``embedded``); none otherwise."""
        return self.family.guidance_input(torch.full((n,), self.embedded_guidance, device=device)) if embedded else {}

    def trigflow_F(self, network: nn.Module, x_t: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        """F(x_t, t) of ``network`` (the student), differentiable in (x_t, t) for the JVP."""
        x, time, view = self.network_input(x_t, t)
        extra = self.guidance_kwargs(self.student_guidance_embedded, len(x), x.device)
        return self.to_trigflow(self.family.denoise(network, x, time, cond, **extra).float(), x, t, view)

    def consistency(self, network: nn.Module, x_t: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        """f(x_t, t) = cos(t) x_t - sin(t) sigma_d F (x0 of the student's one step)."""
        return tf.consistency_function(x_t, self.trigflow_F(network, x_t, t, cond), t, self.sigma_data)

    @torch.no_grad()
    def teacher_F(self, x_t: torch.Tensor, t: torch.Tensor, cond: dict, uncond: dict) -> torch.Tensor:
        """The teacher's TrigFlow prediction, guided: CFG of its (x0, eps) at ``guidance_scale``, or one pass at that
        guidance input of a teacher with FLUX.1-dev's embedding."""
        x, time, view = self.network_input(x_t, t)
        if self.teacher_guidance_embedded:
            extra = self.guidance_kwargs(True, len(x), x.device)
            return self.to_trigflow(self.teacher_forward(x, time, cond, **extra), x, t, view)
        out_c, out_u = self.teacher_cond_uncond(x, time, cond, uncond)
        F_c = self.to_trigflow(out_c, x, t, view)
        if self.guidance_scale == 1.0:
            return F_c
        return cfg(F_c, self.to_trigflow(out_u, x, t, view), self.guidance_scale)  # F is affine in (x0, eps)

    # ------------------------------------------------------------------ objective

    def draw_trigflow_times(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """(n,) TrigFlow times t = arctan(sigma / sigma_d), sigma lognormal truncated to ``noise_range`` (float64), its
        log-mean ``proposal_mean``."""
        m = self.distinct_rows(n)
        sigma = ct.truncated_lognormal_sigmas(m, *self.noise_range(), self.proposal_mean, self.p_std, generator)
        return self.paired(tf.time_at(sigma, self.sigma_data), n)

    @property
    def proposal_mean(self) -> float:
        """The mean of log sigma: ``p_mean`` (stated at sCM's sigma_d = 0.5) + log(sigma_d / 0.5). The paper's values
        are for data of std 0.5; on SD-format latents (sigma_d = 1) the same noise-to-signal ratios need sigma twice
        as large (with sigma_d = 1 the median sigma / sigma_d is 0.90, as the paper's, not 0.45)."""
        return self.p_mean + math.log(self.sigma_data / SCM_PAPER_SIGMA_DATA)

    def tangent_scale(self) -> float:
        """r of the tangent warm-up at this step."""
        step = self.global_step if self._trainer is not None else 0
        return tf.tangent_warmup(step, self.tangent_warmup_steps)

    def scm_terms(self, batch: dict, generator: torch.Generator | None = None) -> dict:
        """The step's x_t, t, condition, F- and the normalised tangent g (no gradient), and x0."""
        batch = self.paired_batch(batch)
        # contiguous: forward AD's group_norm rule cannot view a channels-last input (a VAE posterior sample can be)
        x0 = self.latents(batch, generator).contiguous()
        n, device = x0.shape[0], x0.device
        cond, uncond = self.text_conditions(batch, n, device)
        t = self.draw_trigflow_times(n, generator).to(device)
        z = self.sigma_data * self.draw_noise(x0, generator)
        x_t = tf.trigflow_sample(x0, z, t)
        dx_dt = (tf.trigflow_velocity(x0, z, t) if self.teacher_free
                 else self.sigma_data * self.teacher_F(x_t, t, cond, uncond))
        with torch.no_grad(), no_routing_record(self.student):
            F_minus, dF_dt = time_derivative(lambda x, s: self.trigflow_F(self.student, x, s, cond), (x_t, t),
                                             (dx_dt, torch.ones_like(t)), self.jvp, self.finite_difference_step,
                                             networks=[self.student])
            g = tf.scm_tangent(F_minus, dF_dt, x_t, dx_dt, t, self.sigma_data, self.tangent_scale())
            g = tf.normalize_tangent(g, self.tangent_normalization)
        return {"x0": x0, "x_t": x_t, "t": t, "cond": cond, "uncond": uncond, "F_minus": F_minus, "g": g}

    def scm_loss(self, terms: dict) -> torch.Tensor:
        """The batch mean of e^{w(t)} / D ||F - F- - g||^2 - w(t)."""
        F = self.trigflow_F(self.student, terms["x_t"], terms["t"], terms["cond"])
        return tf.scm_loss(F, terms["F_minus"], terms["g"], self.weighting(terms["t"])).mean()

    def loss(self, batch: dict, generator: torch.Generator | None = None) -> torch.Tensor:
        return self.scm_loss(self.scm_terms(batch, generator))

    # ------------------------------------------------------------------ sampling and export

    @property
    def num_inference_steps(self) -> int:
        return self.sampling["num_inference_steps"]

    def sampling_scheduler(self, name: str | None = None):
        """``TrigFlowScheduler`` (VP) or ``FlowMatchTrigFlowScheduler`` (flow) with this method's sigma_d and
        intermediate times, set to the intended step count (refusing one the times cannot give)."""
        name = name or self.sampling["name"]
        scheduler = make_scheduler(name, self.noise_scheduler_config, sigma_data=self.sigma_data,
                                   intermediate_times=list(self.intermediate_times),
                                   **(self.sampling.get("options") or {}))
        scheduler.set_timesteps(self.num_inference_steps)
        return scheduler

    def sampling_times(self) -> list[float]:
        """The TrigFlow times of the intended call's steps."""
        return self.sampling_scheduler().trigflow_times.tolist()

    def extra_call_defaults(self) -> dict:
        """A student with FLUX.1-dev's guidance embedding is called at the guidance input it was trained at."""
        return {"default_guidance_scale": self.embedded_guidance} if self.student_guidance_embedded else {}

    def guidance_source(self) -> str:
        kind = "embedded guidance" if self.teacher_guidance_embedded else "classifier-free guidance"
        return "no guidance (sCT)" if self.teacher_free else f"the teacher's {kind} at scale {self.guidance_scale}"

    def export_info(self) -> dict:
        t_max = self.sampling_times()[0]
        return {**super().export_info(), "sigma_data": self.sigma_data, "trigflow_times": self.sampling_times(),
                "t_max": t_max, "t_max_is_pi_over_2": math.isclose(t_max, math.pi / 2),
                "jvp": self.jvp, "teacher_free": self.teacher_free,
                "consistency_function": "f(x_t, t) = cos(t) x_t - sin(t) sigma_d F, F from the network's (x0, eps) "
                                        "in the teacher's parametrisation"}

    @classmethod
    def check_config(cls, cfg) -> None:
        _check_scm_config(cfg)


def _check_scm_config(cfg) -> None:
    """Before any model is built: the options, the sampler of the teacher's kind (a local teacher's scheduler config),
    a step count the intermediate times give and ``method.resolution`` the data's."""
    from distill.methods.checks import check_resolution
    from distill.methods.dmd2 import _flow_teacher

    m = cfg.method
    check_options(m.sigma_data, m.p_std, m.guidance_scale, m.tangent_normalization, m.tangent_warmup_steps,
                  str(m.jvp), m.finite_difference_step, m.intermediate_times)
    name = str(getattr(cfg.scheduler.name, "value", cfg.scheduler.name))
    flow = _flow_teacher(cfg)
    if name not in ("trigflow", "flow_trigflow") or (flow is not None and flow != (name == "flow_trigflow")):
        fix = "scheduler=flow_trigflow (+exp=scm_flow)" if flow else "scheduler=trigflow (+exp=scm)"
        raise ValueError(f"scheduler.name={name!r}: an sCM student samples with its consistency function at TrigFlow "
                         f"times; use {fix if flow is not None else 'scheduler=trigflow or flow_trigflow'}")
    steps = 1 + len(m.intermediate_times or SCM_INTERMEDIATE_TIMES)
    if not 1 <= cfg.scheduler.num_inference_steps <= steps:
        raise ValueError(f"scheduler.num_inference_steps={cfg.scheduler.num_inference_steps}: an sCM student samples "
                         f"1 step or up to {steps} with method.intermediate_times; give more intermediate times")
    check_resolution(cfg)


def check_options(sigma_data: float, p_std: float, guidance_scale: float, tangent_normalization: float,
                  tangent_warmup_steps: int, jvp: str, finite_difference_step: float,
                  intermediate_times: list[float] | None) -> None:
    """sCM's options, each refused with the key and the fix."""
    if sigma_data <= 0 or p_std <= 0:
        raise ValueError(f"method.sigma_data={sigma_data}, method.p_std={p_std}: both must be > 0")
    if guidance_scale < 1.0:
        raise ValueError(f"method.guidance_scale={guidance_scale} must be >= 1 (1 = the unguided teacher)")
    if tangent_normalization < 0 or tangent_warmup_steps < 0:
        raise ValueError(f"method.tangent_normalization={tangent_normalization}, method.tangent_warmup_steps="
                         f"{tangent_warmup_steps}: both must be >= 0 (0 turns each off)")
    if jvp not in JVP_MODES:
        raise ValueError(f"method.jvp={jvp!r}; use one of {list(JVP_MODES)}")
    if finite_difference_step <= 0:
        raise ValueError(f"method.finite_difference_step={finite_difference_step} must be > 0")
    times = list(intermediate_times or SCM_INTERMEDIATE_TIMES)
    if any(not 0 < a < math.pi / 2 for a in times) or times != sorted(times, reverse=True):
        raise ValueError(f"method.intermediate_times={times}: TrigFlow times in (0, pi/2), descending (sCM: [1.1])")
