"""Latent consistency distillation (Luo et al. 2023, "Latent Consistency Models", Algorithm 1), on a discrete VP
teacher (skipping-step DDIM solver) or a flow-matching one (SD3, Flux: Euler steps of the flow ODE on its shifted
sigmas)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from distill.diffusion import FlowMatchingSchedule, cfg, ddim_step, guidance_condition
from distill.diffusion.consistency import (
    CONSISTENCY_LOSSES,
    boundary_scalings,
    check_consistency_loss,
    consistency_loss,
    consistency_output,
    ddim_timesteps,
    flow_boundary_scalings,
    flow_solver_grid,
)
from distill.diffusion.flow import euler_step
from distill.families.base import SIGMA_SPACINGS
from distill.methods import METHODS
from distill.methods.checks import check_guidance_range, check_resolution
from distill.methods.distillation import TeacherStudentDistillation
from distill.models.moe import no_routing_record
from distill.models.teacher import Teacher
from distill.utils.optim import ema_update_, step_applied


@METHODS.register("consistency", choices={"loss_type": CONSISTENCY_LOSSES, "sigma_spacing": SIGMA_SPACINGS})
class LatentConsistencyDistillation(TeacherStudentDistillation):
    """A student f(x_t, t, c, w) = c_skip x_t + c_out x0_student learns to map every point of the teacher's
    guided PF-ODE to the same x0: f_student(x_{t_n}) ~ f_target(x_{t_{n-k}}), where x_{t_{n-k}} is one
    skipping DDIM step of the classifier-free-guided teacher from x_{t_n}.

    On a flow-matching teacher (``FlowMatchingSchedule``: x_t = (1 - t) x0 + t eps, the velocity v = eps - x0)
    the same algorithm runs on the flow ODE dx/dt = v: the grid is the teacher scheduler's ``num_ddim_timesteps``-step
    shifted sigmas (``FlowMatchEulerDiscreteScheduler.set_timesteps``; SD3's shift 3.0), x_{t_{n-1}} is one Euler
    step of the teacher's velocity guided in velocity form, v_u + (1 + w) (v_c - v_u), and the consistency function
    is f(x_t, t) = x_t - t v_student (``flow_boundary_scalings``: c_skip = 1, c_out = -t on the velocity, the
    boundary condition f(x_0, 0) = x_0 by construction), which diffusers' ``FlowMatchLCMScheduler`` (``scheduler=
    flow_lcm``) samples with: predict x0, re-noise to the next sigma. ``timestep_scaling`` and ``sigma_data`` (LCM's
    VP scalings) have no part in it.

    A scheduler that shifts by resolution (``use_dynamic_shifting``: Flux's mu of the image's token count) is
    distilled at one resolution, ``resolution`` (the training images' side): the grid is the sigmas the teacher's
    pipeline samples ``num_ddim_timesteps`` steps with at that mu (``ModelFamily.inference_sigmas``), and the export's
    default call samples at that resolution (``resolution_defaults``), so at the same mu, on sigmas of the grid.
    A teacher that takes the guidance scale as an input (FLUX.1-dev's guidance embedding: ``guidance_embedded``) is
    stepped as its pipeline calls it, at guidance 1 + w with no CFG pass, and a student with that input learns
    f(x_t, t, c, 1 + w) through it; a teacher without one (FLUX.1-schnell's layout, SD3) is guided by CFG in velocity
    form (``FluxPipeline``'s ``true_cfg_scale``)."""

    def __init__(
        self,
        teacher: Teacher,
        student: nn.Module | Callable[[nn.Module], nn.Module],
        optimizer: Callable,
        lr_scheduler: Callable | None = None,
        num_ddim_timesteps: int = 50,  # the skipping-step solver's grid
        # the training images' side in pixels (conf/method/consistency.yaml: data.resolution); read only where the
        # teacher's scheduler shifts by resolution (use_dynamic_shifting: Flux), whose grid is built at its mu
        resolution: int | None = None,
        # on a flow teacher with a static shift (SD3): "scheduler", the grid is the scheduler's own N sigmas (1 to its
        # smallest training sigma); "trailing", shift(linspace(1, 1/N, N)) and the export samples its steps on the
        # trailing sigmas of those counts (sigma_spacing in model_index.json), which lie on the grid where they divide N
        sigma_spacing: str = "scheduler",
        # classifier-free guidance scales (w + 1) sampled per example: diffusers' LCM distillation script samples
        # its w (guidance = w + 1) uniformly in [5, 15] for Stable Diffusion; +exp=consistency narrows it for the embedded default
        guidance_scale_min: float = 6.0,
        guidance_scale_max: float = 16.0,
        ema_decay: float = 0.95,  # target = EMA of the student; 0 = stop-gradient copy
        loss_type: str = "pseudo_huber",  # distill.diffusion.consistency.CONSISTENCY_LOSSES
        huber_c: float | None = 0.001,  # c (delta for huber); None: iCT's 0.00054 sqrt(d) for pseudo_huber
        timestep_scaling: float = 10.0,
        sigma_data: float = 0.5,
        cache_prompts: bool = True,
        sampling: dict | None = None,
        **speed,  # DistillMethod's training-speed switches (compile, frozen_dtype, ...)
    ):
        check_consistency_loss(loss_type, huber_c)
        super().__init__(teacher, student, optimizer, lr_scheduler, guidance_scale_min=guidance_scale_min,
                         guidance_scale_max=guidance_scale_max, cache_prompts=cache_prompts, **speed)
        self.save_hyperparameters(ignore=["teacher", "student", "optimizer", "lr_scheduler"])
        if self.is_lora and ema_decay > 0:
            raise ValueError("a LoRA student trains against a stop-gradient target; set method.ema_decay=0")
        # ema_decay = 0: the target is the student itself under stop-gradient (no copy kept).
        self.target = self.frozen_student_copy() if ema_decay > 0 else None
        self.ema_decay = ema_decay
        self.num_ddim_timesteps = num_ddim_timesteps
        self.loss_type, self.huber_c = loss_type, huber_c
        self.timestep_scaling, self.sigma_data = timestep_scaling, sigma_data
        self.sampling = dict(sampling or {"name": "lcm", "num_inference_steps": 4, "guidance_scale": 3.0})
        from distill.inference.schedulers import check_scheduler_kind

        self.flow = isinstance(self.schedule, FlowMatchingSchedule)
        check_scheduler_kind(self.sampling["name"], self.noise_scheduler_config, key="scheduler.name")
        self.bind_resolution(resolution)  # under a resolution shift (Flux): the grid at the training images' mu
        if sigma_spacing not in SIGMA_SPACINGS:
            raise ValueError(f"method.sigma_spacing={sigma_spacing!r}; use one of {list(SIGMA_SPACINGS)}")
        self.sigma_spacing = sigma_spacing
        if self.flow:  # the teacher pipeline's N-step sigmas: t_n -> t_{n-1}, the last step to t = 0
            grid, previous = flow_solver_grid(self._flow_sigmas(num_ddim_timesteps))
        else:  # LCM's skipping-step grid: t_n -> t_n - k, k = T / N
            T = self.schedule.num_train_timesteps
            grid = ddim_timesteps(T, num_ddim_timesteps)
            previous = (grid - T // num_ddim_timesteps).clamp(min=0)
        self.register_buffer("solver_timesteps", grid, persistent=False)
        self.register_buffer("solver_previous", previous, persistent=False)

    method_name = "consistency"

    def _flow_sigmas(self, num_ddim_timesteps: int) -> torch.Tensor:
        """The N-step sigmas (N + 1,) the teacher's pipeline samples with: its scheduler's own (SD3 with
        ``sigma_spacing="scheduler"``), or from the trailing sigmas linspace(1, 1 / N, N) at the static shift (SD3)
        or at mu of the training latents (Flux, ``bind_resolution``), where the student's sampling sigmas must lie
        too (their steps a divisor of N) for it to be sampled where it was trained."""
        if not self.schedule.use_dynamic_shifting and self.sigma_spacing == "scheduler":
            grid = self.schedule.inference_sigmas(num_ddim_timesteps)[0]
            steps = self.sampling["num_inference_steps"]
            if steps > 1 and self.sampling.get("name") == "flow_lcm":
                sampled = self.schedule.inference_sigmas(steps)[0][:-1]
                if not bool(torch.isin(sampled, grid).all()):  # FlowMatchLCMScheduler samples its own N sigmas
                    raise ValueError(
                        f"method.sigma_spacing=scheduler: FlowMatchLCMScheduler samples scheduler.num_inference_steps="
                        f"{steps} at sigmas {[round(x, 4) for x in sampled.tolist()]}, off the method.num_ddim_timesteps="
                        f"{num_ddim_timesteps} grid the student is trained on (its last step re-noises to the "
                        "scheduler's smallest sigma: 2 steps sample as 1); set method.sigma_spacing=trailing "
                        "method.num_ddim_timesteps=48 (as +exp=consistency_flow does)")
            return grid
        sigmas = self.trailing_flow_sigmas(num_ddim_timesteps)
        where = "" if self.mu is None else f" (at mu={self.mu:.4f})"
        self._check_on_grid(sigmas, self.trailing_flow_sigmas(self.sampling["num_inference_steps"]),
                            num_ddim_timesteps, where)
        return sigmas

    def _check_on_grid(self, grid: torch.Tensor, sampled: torch.Tensor, num_ddim_timesteps: int, where: str = ""):
        """Refuse an intended step count whose sigmas are not points of the solver grid."""
        steps = self.sampling["num_inference_steps"]
        if not bool(torch.isin(sampled, grid).all()):
            raise ValueError(f"scheduler.num_inference_steps={steps} samples sigmas {sampled.tolist()} off the "
                             f"method.num_ddim_timesteps={num_ddim_timesteps} grid the student is trained on{where}; "
                             f"use a step count that divides {num_ddim_timesteps}, or set method.num_ddim_timesteps "
                             f"to a multiple of {steps}")

    def train(self, mode: bool = True):
        super().train(mode)
        if self.target is not None:
            self.target.eval()
        return self

    # ------------------------------------------------------------------ networks

    def frozen_networks(self) -> list[nn.Module]:  # compiled / channels-last as the student is
        return super().frozen_networks() + ([self.target] if self.target is not None else [])

    def _solver_step(self, x_t, t, t_prev, cond, uncond, w):
        """x_{t_prev} from x_t by one solver step of the guided teacher, guided with LCM's w (Luo et al. 2023,
        sec. 4.2): DDIM in (x0, eps) on a VP schedule; on a flow schedule an Euler step of the velocity guided in
        velocity form (``flow.euler_step``, what ``FlowMatchEulerDiscreteScheduler.step`` computes)."""
        if self.teacher_guidance_embedded:  # as its pipeline calls it: guidance 1 + w as an input, no CFG pass
            out = self.teacher_forward(x_t, t, cond, **self.family.guidance_input(1.0 + w))
            return euler_step(self.schedule.velocity(out, x_t, t), x_t, t, t_prev)
        out_c, out_u = self.teacher_cond_uncond(x_t, t, cond, uncond)
        if self.flow:
            v = cfg(self.schedule.velocity(out_c, x_t, t), self.schedule.velocity(out_u, x_t, t), w=w)
            return euler_step(v, x_t, t, t_prev)
        x0_c, eps_c = self.schedule.to_x0_eps(out_c, x_t, t)
        x0_u, eps_u = self.schedule.to_x0_eps(out_u, x_t, t)
        return ddim_step(cfg(x0_c, x0_u, w=w), cfg(eps_c, eps_u, w=w), *self.schedule.alpha_sigma(t_prev, x_t.ndim))

    def _consistency_fn(self, net, x_t, t, cond, w_kwargs):
        """f(x_t, t) = c_skip(t) x_t + c_out(t) y: y the network's x0 with LCM's scalings (VP), its velocity with
        ``flow_boundary_scalings`` (flow)."""
        out = self.family.denoise(net, x_t, t, cond, **w_kwargs)
        if self.flow:
            return consistency_output(x_t, self.schedule.velocity(out, x_t, t), *flow_boundary_scalings(t))
        x0, _ = self.schedule.to_x0_eps(out, x_t, t)
        c_skip, c_out = boundary_scalings(t, self.sigma_data, self.timestep_scaling)
        return consistency_output(x_t, x0, c_skip, c_out)

    def _solver_levels(self) -> torch.Tensor:
        """The grid's noise levels sigma / alpha (ascending), what the time sampler bins by; a flow grid's t = 1
        (infinite level) at the level of the training table's next point, t = 1 - 1 / T."""
        if not self.flow:
            return self.schedule.ve_sigmas[self.solver_timesteps].float()
        t = self.solver_timesteps.clamp(max=1.0 - 1.0 / self.schedule.num_train_timesteps)
        return t / (1.0 - t)

    # ------------------------------------------------------------------ objective

    def loss(self, batch: dict, generator: torch.Generator | None = None) -> torch.Tensor:
        batch = self.paired_batch(batch)  # method.noise.antithetic: rows in pairs sharing all but the noise's sign
        x0 = self.latents(batch, generator)  # (N, 4, h, w)
        self.check_latent_size(x0, "solver grid")
        n, device = x0.shape[0], x0.device
        # one bin per grid point t_n, by its noise level
        bins, iw = self.draw_time_bins(n, self._solver_levels(), generator)
        t = self.solver_timesteps[bins.to(device)]  # t_n
        t_prev = self.solver_previous[bins.to(device)]  # t_{n-k}
        w = (self.guidance_scale_min - 1) + (self.guidance_scale_max - self.guidance_scale_min) * torch.rand(n, generator=generator)
        w = self.paired(w).to(device)  # LCM's w = cfg scale - 1
        w_kwargs = (self.family.guidance_input(1.0 + w) if self.student_guidance_embedded
                    else guidance_condition(w, self.w_dim, x0))
        cond, uncond = self.text_conditions(batch, n, device)

        eps = self.draw_noise(x0, generator)
        x_t = self.schedule.add_noise(x0, eps, t)
        f_student = self._consistency_fn(self.student, x_t, t, cond, w_kwargs)
        f_target = self.consistency_target(x_t, t, t_prev, cond, uncond, w, w_kwargs)
        per_example = consistency_loss(f_student, f_target, self.loss_type, self.huber_c, reduce=False)
        if self.training:
            self.record_time_losses(bins, per_example)
        return self.weighted_mean(per_example, iw)

    @torch.no_grad()
    def consistency_target(self, x_t, t, t_prev, cond, uncond, w, w_kwargs) -> torch.Tensor:
        """f_target(x_{t_prev}, t_prev): the target network's consistency function one guided teacher solver step
        (``_solver_step``) from x_t; at t_prev = 0 the boundary makes it x_{t_prev} itself."""
        x_prev = self._solver_step(x_t, t, t_prev, cond, uncond, w)
        target = self.target if self.target is not None else self.student
        # the target runs at the student's precision (frozen_dtype is the teacher's): the residual
        # f_student - f_target must compare like with like; the student's own routing record trains
        with no_routing_record(target):
            return self._consistency_fn(target, x_prev, t_prev, cond, w_kwargs)

    def optimizer_step(self, *args, **kwargs) -> None:
        """The optimizer step, then the target's EMA update: once per optimizer step (not per micro-batch under
        gradient accumulation) and before the checkpoint callbacks run, so that a checkpoint holds the target of
        its own step. A step skipped by the non-finite guard (the student unchanged) leaves the target unchanged
        too: on the host (every gradient dropped) or on the device (the guard's 0/1 mask scales the update)."""
        super().optimizer_step(*args, **kwargs)
        if self.target is None:
            return
        applied = step_applied(self, self.student)
        if applied is not False:
            self._update_target(applied)

    def _update_target(self, applied: bool | torch.Tensor = True) -> None:
        weight = 1.0 - self.ema_decay
        ema_update_(self.target, self.student, weight if applied is True else weight * applied, buffers=False)

    # ------------------------------------------------------------------ sampling and export

    @property
    def num_inference_steps(self) -> int:
        return self.sampling["num_inference_steps"]

    def sampling_scheduler(self, name: str | None = None):
        """The configured scheduler (LCM by default) or another by ``name``; LCM and TCD on the solver grid the
        student was trained on."""
        from distill.inference.schedulers import make_scheduler, scheduler_options

        name = name or self.sampling["name"]
        options = {} if name == self.sampling["name"] else scheduler_options(name)  # as the teacher's rows get
        if name in ("lcm", "tcd"):  # their inference timesteps are taken from a grid of original_inference_steps
            if self.sigma_data != 0.5:
                raise ValueError(f"method.sigma_data={self.sigma_data}: diffusers' {name} scheduler fixes sigma_data=0.5")
            options.update(timestep_scaling=self.timestep_scaling, original_inference_steps=self.num_ddim_timesteps)
        if name == self.sampling["name"]:
            options.update(self.sampling.get("options") or {})
        return make_scheduler(name, self.noise_scheduler_config, **options)

    def guidance_source(self) -> str:
        kind = "embedded guidance (its guidance input)" if self.teacher_guidance_embedded else "classifier-free guidance"
        return f"the teacher's {kind} at scales drawn from [{self.guidance_scale_min}, {self.guidance_scale_max}]"

    def extra_call_defaults(self) -> dict:
        """A static-shift grid's trailing sigma spacing (under a resolution shift FluxPipeline's own sigmas are the
        trailing ones)."""
        if self.flow and not self.schedule.use_dynamic_shifting and self.sigma_spacing == "trailing":
            return {"sigma_spacing": "trailing"}
        return {}

    def export_info(self) -> dict:
        info = {**super().export_info(), "guidance_scale_range": [self.guidance_scale_min, self.guidance_scale_max],
                "num_ddim_timesteps": self.num_ddim_timesteps}
        if not self.flow:
            return {**info, "timestep_scaling": self.timestep_scaling}
        shift = "" if self.mu is None else f" at mu={self.mu:.6g} of the {self.resolution}px training images"
        spacing = (" (trailing: shift(linspace(1, 1/N, N)))" if self.sigma_spacing == "trailing"
                   and not self.schedule.use_dynamic_shifting else "")
        info.update(solver=f"Euler steps of the guided teacher's flow ODE on its pipeline's {self.num_ddim_timesteps}-"
                           f"step shifted sigmas{spacing}{shift}",
                    consistency_function="f(x_t, t) = x_t - t v (c_skip = 1, c_out = -t on the velocity)")
        return info

    @classmethod
    def check_config(cls, cfg) -> None:
        """The guidance range, the target's EMA decay, and what the export's LCMScheduler fixes: sigma_data = 0.5 in
        its boundary scalings, inference steps a subset of the ``num_ddim_timesteps`` grid."""
        method = cfg.method
        check_guidance_range(method)
        if method.sigma_data != 0.5:
            raise ValueError(
                f"method.sigma_data={method.sigma_data} cannot be exported: diffusers' LCMScheduler (and TCDScheduler) "
                "fix sigma_data=0.5 in the boundary scalings c_skip, c_out; set method.sigma_data=0.5"
            )
        if method.num_ddim_timesteps < 1:
            raise ValueError(f"method.num_ddim_timesteps={method.num_ddim_timesteps} must be >= 1")
        if cfg.scheduler.name in ("lcm", "tcd") and cfg.scheduler.num_inference_steps > method.num_ddim_timesteps:
            raise ValueError(
                f"scheduler.num_inference_steps={cfg.scheduler.num_inference_steps} exceeds method.num_ddim_timesteps="
                f"{method.num_ddim_timesteps}: the {cfg.scheduler.name} scheduler samples on that training grid; "
                f"use at most {method.num_ddim_timesteps} steps"
            )
        check_resolution(cfg)
        if not 0.0 <= method.ema_decay < 1.0:
            raise ValueError(f"method.ema_decay={method.ema_decay} must be in [0, 1) (0 = stop-gradient target)")
