"""MeanFlow (Geng et al. 2025, "Mean Flows for One-step Generative Modeling", arXiv 2505.13447) on a flow-matching
teacher (SD3 family): a one- or few-step student that learns the average velocity u(z, r, t) between two times.

The student is the teacher's transformer with a second time embedding (``MeanFlowSD3Transformer2DModel``: the interval
t - r embedded and added to the time embedding, its output layer at zero so that the student starts as the teacher's
velocity, the average velocity at r = t). One training step (MeanFlow Algorithm 1):

- (r, t) logit-normal, r = t on all but ``ratio_r_neq_t`` of the rows (``sample_time_pairs``);
- z_t = (1 - t) x + t eps; v = the teacher's velocity at (z_t, t), guided by classifier-free guidance at
  ``guidance_scale`` (distillation), or with ``teacher_free`` the path's own eps - x (training from data);
- u, du/dt = JVP of the student along the tangent (v, 0, 1) in (z, r, t), no gradient (``torch.func.jvp``, or a
  central difference with ``method.jvp=finite_difference``);
- loss sg(w) ||u_theta - sg(v - (t - r) du/dt)||^2, w = 1 / (||delta||^2 + c)^p (adaptive weighting).

Sampling: N uniform steps 1 = t_0 > ... > t_N = 0, z_{t_{i+1}} = z_{t_i} - (t_i - t_{i+1}) u (1 step: z_0 = z_1 - u),
exported as ``DistillMeanFlowSD3Pipeline`` with ``FlowMatchMeanFlowScheduler``: one transformer call per step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from distill.diffusion import FlowMatchingSchedule, cfg
from distill.diffusion import meanflow as mf
from distill.diffusion.jvp import JVP_MODES, time_derivative
from distill.inference.meanflow import DistillMeanFlowSD3Pipeline, FlowMatchMeanFlowScheduler
from distill.methods import METHODS
from distill.methods.distillation import TeacherStudentDistillation
from distill.models.meanflow import MeanFlowSD3Transformer2DModel
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
        schedule = getattr(teacher.family, "schedule", None)
        if not isinstance(schedule, FlowMatchingSchedule):
            raise ValueError(f"method=meanflow on {teacher.source!r}, whose schedule is not flow matching: MeanFlow "
                             "learns the average velocity of a flow path; use a flow-matching teacher "
                             "(+exp=meanflow teacher=digits_flow, or an SD3 pipeline)")
        super().__init__(teacher, student, optimizer, lr_scheduler, guidance_scale_min=guidance_scale,
                         guidance_scale_max=guidance_scale, cache_prompts=cache_prompts, **speed)
        if type(self.student).__name__ != "SD3Transformer2DModel" or self.is_lora:
            raise ValueError(f"the student is a {type(self.student).__name__}{' with LoRA adapters' * self.is_lora}: "
                             "MeanFlow adds its interval embedding to a full copy of a stock SD3Transformer2DModel; "
                             "use student=copy")
        self.student = MeanFlowSD3Transformer2DModel.from_transformer(self.student)
        self.save_hyperparameters(ignore=["teacher", "student", "optimizer", "lr_scheduler"])
        self.logit_mean, self.logit_std, self.ratio_r_neq_t = logit_mean, logit_std, ratio_r_neq_t
        self.adaptive_weight_power, self.adaptive_weight_c = adaptive_weight_power, adaptive_weight_c
        self.guidance_scale, self.teacher_free = guidance_scale, teacher_free
        self.jvp, self.finite_difference_step = jvp, finite_difference_step
        self.sampling = dict(sampling or {"name": "flow_meanflow", "num_inference_steps": 1, "guidance_scale": 1.0})
        if self.sampling["name"] != "flow_meanflow":
            raise ValueError(f"scheduler.name={self.sampling['name']!r}: a MeanFlow student samples with its average "
                             "velocity; use scheduler=flow_meanflow")

    # ------------------------------------------------------------------ the average velocity

    def average_velocity(self, network: nn.Module, z: torch.Tensor, r: torch.Tensor, t: torch.Tensor,
                         cond: dict) -> torch.Tensor:
        """u(z, r, t) of ``network``: the transformer at timestep 1000 t and interval 1000 (t - r), differentiable in
        (z, r, t)."""
        interval = self.schedule.timestep((t - r).float())
        return self.family.denoise(network, z, t, cond, interval=interval).float()

    @torch.no_grad()
    def teacher_velocity(self, z: torch.Tensor, t: torch.Tensor, cond: dict, uncond: dict) -> torch.Tensor:
        """v(z_t, t): the teacher's velocity, classifier-free guided at ``guidance_scale`` (SD3's CFG in velocity)."""
        v_c, v_u = self.teacher_cond_uncond(z, t.float(), cond, uncond)
        return v_c if self.guidance_scale == 1.0 else cfg(v_c, v_u, self.guidance_scale)

    def meanflow_terms(self, batch: dict, generator: torch.Generator | None = None) -> dict:
        """The step's z_t, r, t, condition and stop-gradient target u_tgt = v - (t - r) du/dt."""
        batch = self.paired_batch(batch)
        x = self.latents(batch, generator).contiguous()  # forward AD cannot view a channels-last input in group_norm
        n, device = x.shape[0], x.device
        cond, uncond = self.text_conditions(batch, n, device)
        r, t = mf.sample_time_pairs(self.distinct_rows(n), self.logit_mean, self.logit_std, self.ratio_r_neq_t,
                                    generator)
        r, t = self.paired(r, n).to(device), self.paired(t, n).to(device)
        eps = self.draw_noise(x, generator)
        z = self.schedule.add_noise(x, eps, t.float())
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

    def sampling_scheduler(self, name: str | None = None) -> FlowMatchMeanFlowScheduler:
        return FlowMatchMeanFlowScheduler.from_config(self.noise_scheduler_config)

    def pipeline(self, scheduler: str | None = None) -> DistillMeanFlowSD3Pipeline:
        """The SD3 family's export pipeline with the MeanFlow loop (both times to the denoiser)."""
        pipe = self.family.pipeline(self.student, self.sampling_scheduler(scheduler), **self.call_defaults())
        pipe = DistillMeanFlowSD3Pipeline(**pipe.components, **{k: v for k, v in pipe.config.items()
                                                                 if k.startswith("default_") or k in (
                                                                     "guidance_distilled", "sigma_spacing")})
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def guidance_source(self) -> str:
        return "no guidance (trained from data)" if self.teacher_free else \
            f"the teacher's classifier-free guidance at scale {self.guidance_scale}"

    def export_info(self) -> dict:
        return {**super().export_info(), "teacher_free": self.teacher_free, "jvp": self.jvp,
                "denoiser": "u(z, r, t): timestep 1000 t, interval 1000 (t - r) (a second time embedding added to the "
                            "first)", "step": "z_r = z_t - (t - r) u, t_i = 1 - i / N"}

    @classmethod
    def check_config(cls, cfg) -> None:
        """Before any model is built: the MeanFlow sampler, and a local teacher that is flow matching."""
        from distill.methods.dmd2 import _flow_teacher

        name = str(getattr(cfg.scheduler.name, "value", cfg.scheduler.name))
        if name != "flow_meanflow":
            raise ValueError(f"scheduler.name={name!r}: a MeanFlow student samples with its average velocity; use "
                             "scheduler=flow_meanflow (+exp=meanflow sets it)")
        if _flow_teacher(cfg) is False:
            raise ValueError(f"method=meanflow on the discrete VP teacher {str(cfg.teacher.pretrained_model_name_or_path)!r}: "
                             "MeanFlow learns the average velocity of a flow path; use a flow-matching teacher "
                             "(+exp=meanflow teacher=digits_flow, or an SD3 pipeline)")
