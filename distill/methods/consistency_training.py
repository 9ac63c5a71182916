"""Consistency training without a teacher's ODE solver (``+exp=consistency_training``): iCT (Song & Dhariwal
2023) from a freshly initialised network, or ECT (Geng et al. 2024) tuning the teacher's UNet into a consistency
model. The teacher supplies the VAE, the text encoder and the noise schedule; its UNet is only ECT's
initialisation (it never runs during training).

Parametrisations, each exported with the diffusers scheduler that samples with exactly it:

- ``ict``: EDM's, f(x, sigma) = c_skip(sigma) x + c_out(sigma) F(c_in(sigma) x, c_noise(sigma)) on x = x0 + sigma
  eps, boundary at sigma_min; exported with ``CMStochasticIterativeScheduler`` (the same c_skip, c_out, c_in and
  c_noise = 250 log sigma).
- ``ect``: the teacher's own VP time and prediction type with LCM's boundary scalings, f(x_tau, tau) = c_skip(tau)
  x_tau + c_out(tau) x0(x_tau, tau), where x_tau = (x0 + sigma eps) / sqrt(1 + sigma^2) and tau is the teacher's
  (continuous) timestep of noise level sigma; exported with ``LCMScheduler`` (it hard-codes sigma_data 0.5;
  timestep_scaling 10 is written to its config). ECT's t and r are noise levels sigma, as in the paper.
- ``ect`` on a flow-matching teacher (SD3, ``+exp=consistency_training_flow``): the pairs drawn and mapped in sigma as
  above, the network called at flow time t = sigma / (1 + sigma) on x_t = (1 - t)(x0 + sigma eps) = (1 - t) x0 + t eps
  (one eps for both points, on the straight path), with the flow consistency function f(x_t, t) = x_t - t v
  (``flow_boundary_scalings``: c_skip = 1, c_out = -t, f(x0, 0) = x0 exactly); the weight stays ECT's
  1 / (sigma_t - sigma_r), (1 - t)(1 - r) / (t - r) in flow times. Exported with ``FlowMatchLCMScheduler``
  (``scheduler=flow_lcm``: x0 = x_t - t v, re-noised to the next sigma). iCT (EDM's VE network) is refused there.
- ``ect`` on a Flux teacher (``+exp=consistency_training_flux``): trained as on SD3 (ECT's pairs, unshifted: the
  consistency function is learned at every flow time, whatever the resolution), sampled by ``FlowMatchLCMScheduler``
  through ``FluxPipeline``, which gives it the sigmas linspace(1, 1/N, N) shifted by mu of the image's packed token
  count (``use_dynamic_shifting``). The export samples at the training resolution by default
  (``resolution``: ``default_sample_size``), so its N steps are at FluxPipeline's N-step sigmas at that mu (2 steps:
  t = 1 and e^mu / (e^mu + 1)). A student with FLUX.1-dev's guidance embedding takes guidance 1 through it, in
  training and in the export's default call (consistency training has no guidance).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from distill.diffusion import FlowMatchingSchedule, to_x0_eps
from distill.diffusion import consistency_training as ct
from distill.diffusion.consistency import (
    boundary_scalings,
    consistency_output,
    flow_boundary_scalings,
    ict_huber_c,
)
from distill.diffusion.noise import stratified_unit
from distill.inference.schedulers import check_scheduler_kind, make_scheduler, scheduler_options
from distill.methods import METHODS
from distill.methods.checks import check_resolution
from distill.methods.distillation import TeacherStudentDistillation
from distill.models.conditioning import take_conditions
from distill.models.moe import no_routing_record
from distill.models.teacher import Teacher

VARIANTS = ("ict", "ect")


@METHODS.register("consistency_training")
class ConsistencyTraining(TeacherStudentDistillation):
    """f_theta(x_t) ~ stopgrad f_theta(x_r) for two noise levels r < t of one noisy trajectory (shared eps); the
    pairs, weights and distances are iCT's or ECT's (``variant``).

    On a flow-matching teacher (``FlowMatchingSchedule``) ECT tunes a copy of its transformer: t and r are drawn and
    mapped as ECT's noise levels sigma (its lognormal p(sigma), truncated to the levels of flow times [1/T, 1 - 1/T],
    rather than the teacher's own logit-normal time distribution: the pairs and weights are then the paper's), the
    network sees flow time sigma / (1 + sigma), and f(x_t, t) = x_t - t v is what ``FlowMatchLCMScheduler`` samples
    with."""

    method_name = "consistency_training"

    def __init__(
        self,
        teacher: Teacher,
        student: nn.Module | Callable[[nn.Module], nn.Module],
        optimizer: Callable,
        lr_scheduler: Callable | None = None,
        variant: Literal["ict", "ect"] = "ect",
        p_mean: float = -1.1,  # lognormal noise levels: log sigma ~ N(p_mean, p_std^2)
        p_std: float = 2.0,
        sigma_data: float = 1.0,  # iCT's EDM scalings: the data's std (SD-format latents are scaled to ~1)
        # iCT
        sigma_min: float = 0.002,
        sigma_max: float = 80.0,
        rho: float = 7.0,
        s0: int = 10,  # curriculum N(k) from s0 + 1 to s1 + 1 noise levels
        s1: int = 1280,
        curriculum_steps: int | None = None,  # the curricula's length (iCT's K of N(k), ECT's stages); None: max_steps
        huber_c: float | None = None,  # iCT's pseudo-Huber c; None: 0.00054 sqrt(d)
        # ECT
        q: float = 2.0,
        k: float = 8.0,
        b: float = 1.0,
        stages: int = 8,  # ECT's stages over the curriculum's length (the paper's 8): t - r halves at each
        ect_c: float = 0.0,  # sqrt(||d||^2 + c^2) - c; 0: the L2 norm (the paper's adaptive weighting, p = 1/2)
        timestep_scaling: float = 10.0,  # ect: LCM's boundary scalings (LCMScheduler's fixed values)
        # the training images' side in pixels (conf/method/consistency_training.yaml: data.resolution); read only where
        # the teacher's scheduler shifts by resolution (use_dynamic_shifting: Flux): the export samples at its mu
        resolution: int | None = None,
        cache_prompts: bool = True,
        sampling: dict | None = None,
        **speed,
    ):
        if variant not in VARIANTS:
            raise ValueError(f"method.variant={variant!r}; use one of {list(VARIANTS)}")
        ct.check_sigma_range(sigma_min, sigma_max)
        if s0 < 1 or s1 < s0:
            raise ValueError(f"method.s0={s0}, method.s1={s1}: the curriculum needs 1 <= s0 <= s1 (N = s + 1 >= 2)")
        if stages < 1:
            raise ValueError(f"method.stages={stages} must be >= 1 (ECT's mapping needs at least one stage)")
        if p_std <= 0 or sigma_data <= 0:
            raise ValueError(f"method.p_std={p_std}, method.sigma_data={sigma_data}: both must be > 0")
        if variant == "ict" and teacher.family is not None and isinstance(teacher.family.schedule, FlowMatchingSchedule):
            raise ValueError(f"method.variant=ict on the flow-matching teacher {teacher.source!r}: iCT trains a fresh "
                             "network in EDM's variance-exploding parametrisation (CMStochasticIterativeScheduler), "
                             "which a flow model does not sample with; use method.variant=ect (the teacher's "
                             "transformer tuned, sampled with scheduler=flow_lcm: +exp=consistency_training_flow)")
        super().__init__(teacher, student, optimizer, lr_scheduler, guidance_scale_min=1.0, guidance_scale_max=1.0,
                         cache_prompts=cache_prompts, **speed)
        if self.w_dim is not None:
            raise ValueError(f"student.time_cond_proj_dim={self.w_dim}: consistency training has no guidance to "
                             "condition on (the input would never train); set student.time_cond_proj_dim=null")
        if self.is_lora and variant == "ict":
            raise ValueError("method.variant=ict trains a freshly initialised network (student=fresh); a LoRA student "
                             "keeps the teacher's weights: use method.variant=ect")
        if variant == "ect" and self.noise.timesteps != "default":
            raise ValueError(f"method.noise.timesteps={self.noise.timesteps}: ECT draws t from its own continuous "
                             "lognormal (no time bins to re-weight); use method.noise.stratified=true or "
                             "method.variant=ict")
        if variant == "ict" and self.noise.timesteps == "lognormal":
            raise ValueError("method.noise.timesteps=lognormal: iCT already draws its pairs lognormally "
                             "(method.p_mean, method.p_std); use default or adaptive")
        if self.noise.preconditioning != "none":
            raise ValueError(f"method.noise.preconditioning={self.noise.preconditioning}: consistency training has its "
                             "own parametrisation (iCT: EDM's; ECT: the teacher's); set it to none")
        self.flow = isinstance(self.schedule, FlowMatchingSchedule)
        self.bind_resolution(resolution)  # under a resolution shift (Flux): the export's default size and its mu
        self.save_hyperparameters(ignore=["teacher", "student", "optimizer", "lr_scheduler"])
        self.variant, self.p_mean, self.p_std, self.sigma_data = variant, p_mean, p_std, sigma_data
        self.sigma_min, self.sigma_max, self.rho, self.s0, self.s1 = sigma_min, sigma_max, rho, s0, s1
        self.curriculum_steps, self.huber_c = curriculum_steps, huber_c
        self.q, self.k, self.b, self.stages, self.ect_c = q, k, b, stages, ect_c
        self.timestep_scaling = timestep_scaling
        name = "flow_lcm" if self.flow else "cm" if variant == "ict" else "lcm"
        self.sampling = dict(sampling or {"name": name, "num_inference_steps": 2, "guidance_scale": 1.0})
        check_scheduler_kind(self.sampling["name"], self.noise_scheduler_config)  # before any sample grid or export

    # ------------------------------------------------------------------ networks

    def frozen_networks(self) -> list[nn.Module]:
        return []  # the teacher's UNet never runs: nothing to compile or keep channels-last

    def _consistency_fn(self, net: nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: dict) -> torch.Tensor:
        """f(x0 + sigma eps, sigma) in x0 space, from the VE-view sample ``x`` = x0 + sigma eps."""
        shape = (-1,) + (1,) * (x.ndim - 1)
        if self.flow:  # x_t = (1 - t) x = (1 - t) x0 + t eps at flow time t = sigma / (1 + sigma)
            t = ct.flow_time(sigma.double())
            x_t = x * (1 - t).to(x).view(shape)
            out = self.family.denoise(net, x_t, t.float(), cond, **self._no_guidance(x)).float()
            return consistency_output(x_t, self.schedule.velocity(out, x_t, t.float()), *flow_boundary_scalings(t))
        if self.variant == "ict":
            c_skip, c_out = ct.edm_boundary_scalings(sigma.double(), self.sigma_data, self.sigma_min)
            c_in, c_noise = ct.edm_input_scalings(sigma.double(), self.sigma_data)
            out = self.family.denoise(net, x * c_in.to(x).view(shape), c_noise.float(), cond)
            return c_skip.to(x).view(shape) * x + c_out.to(x).view(shape) * out.float()
        tau = self.schedule.timestep_at(sigma)
        alpha, sigma_vp = self.schedule.alpha_sigma_at(sigma, x)
        x_vp = x * alpha
        out = self.family.denoise(net, x_vp, tau.float(), cond).float()
        x0, _ = to_x0_eps(self.schedule.prediction_type, out, x_vp, alpha, sigma_vp)
        c_skip, c_out = boundary_scalings(tau.to(x), 0.5, self.timestep_scaling)
        return consistency_output(x_vp, x0, c_skip, c_out)

    def _no_guidance(self, x: torch.Tensor) -> dict:
        """The guidance input of a student that has one (FLUX.1-dev's embedding): scale 1, no guidance, as the
        export's default call gives it (``extra_call_defaults``)."""
        if not self.student_guidance_embedded:
            return {}
        return self.family.guidance_input(torch.ones(x.shape[0], device=x.device))

    # ------------------------------------------------------------------ the training pairs

    def _curriculum_total(self) -> int:
        total = self.curriculum_steps or (self.trainer.max_steps if self._trainer is not None else -1)
        if total is None or total < 1:
            raise ValueError(f"method.variant={self.variant} needs the curriculum's length: set trainer.max_steps or "
                             "method.curriculum_steps")
        return total

    def ict_pairs(self, n: int, step: int, generator: torch.Generator | None = None):
        """(sigma_i, sigma_{i+1}, i, importance weights or None) for n examples: N(step) Karras levels, pairs drawn
        lognormally (through ``method.noise``: stratified, or from a proposal re-weighted to the lognormal)."""
        sigmas = ct.karras_sigmas(ct.ict_num_scales(step, self._curriculum_total(), self.s0, self.s1),
                                  self.sigma_min, self.sigma_max, self.rho)
        p = ct.lognormal_pair_probabilities(sigmas, self.p_mean, self.p_std)
        i, iw = self.draw_time_bins(n, sigmas[:-1], generator, target=p)
        return sigmas[i], sigmas[i + 1], i, iw

    def noise_range(self) -> tuple[float, float]:
        """The noise levels ECT's t is truncated to. VP: those of timesteps 1 and T - 1 (at timestep 0 LCM's c_out is
        0: the network's output would drop out, so a clamped draw would train nothing). Flow: those of flow times
        1 / T and 1 - 1 / T, 1 / (T - 1) and T - 1 (t = 1, pure noise, is an infinite level; c_out = -t vanishes at
        t = 0), the ends of the flow scheduler's unshifted training table."""
        if self.flow:
            T = self.schedule.num_train_timesteps
            lo, hi = self.schedule.noise_level(torch.tensor([1.0 / T, 1.0 - 1.0 / T], dtype=torch.float64)).tolist()
            return lo, hi
        levels = self.schedule.ve_sigmas
        return float(levels[1]), float(levels[-1])

    def ect_pairs(self, n: int, step: int, generator: torch.Generator | None = None):
        """(r, t, None, None) for n examples, noise levels sigma: t lognormal truncated to ``noise_range``, at
        stratified quantiles with ``method.noise.stratified``; r = ECT's mapping of t."""
        m = self.distinct_rows(n)  # antithetic pairs: their partners repeat the times
        unit = stratified_unit(m, generator) if self.noise.stratified else None
        t = self.paired(ct.truncated_lognormal_sigmas(m, *self.noise_range(), self.p_mean, self.p_std, generator,
                                                      unit=unit), n)
        # step 0 is stage 0 for any length (a loss called outside a Trainer has no max_steps to read)
        stage = ct.ect_stage(step, self._curriculum_total(), self.stages) if step else 0
        return ct.ect_r(t, stage, self.q, self.k, self.b), t, None, None

    # ------------------------------------------------------------------ objective

    def loss(self, batch: dict, generator: torch.Generator | None = None) -> torch.Tensor:
        batch = self.paired_batch(batch)  # method.noise.antithetic: rows in pairs sharing all but the noise's sign
        x0 = self.latents(batch, generator)
        self.check_latent_size(x0, "export's sampling grid")
        n, device = x0.shape[0], x0.device
        step = self.global_step if self._trainer is not None else 0
        pairs = self.ict_pairs if self.variant == "ict" else self.ect_pairs
        r, t, bins, iw = pairs(n, step, generator)
        r, t = r.to(device), t.to(device)
        cond, _ = self.text_conditions(batch, n, device)
        eps = self.draw_noise(x0, generator)
        shape = (-1,) + (1,) * (x0.ndim - 1)
        f_t = self._consistency_fn(self.student, x0 + t.to(x0).view(shape) * eps, t, cond)
        with torch.no_grad(), no_routing_record(self.student):  # the same weights under stop-gradient
            if self.variant == "ict":
                f_r = self._consistency_fn(self.student, x0 + r.to(x0).view(shape) * eps, r, cond)
            else:  # r = 0: the target is the data (the mapping's diffusion-training start; f's boundary on flow)
                live = r > 0
                f_r = x0.clone()
                if live.any():
                    idx = live.nonzero(as_tuple=True)[0]
                    f_r[idx] = self._consistency_fn(self.student, x0[idx] + r[idx].to(x0).view(shape) * eps[idx],
                                                    r[idx], take_conditions(cond, idx))
        # both: lambda(t, r) d(f_t, f_r) with lambda = 1 / (t - r) (iCT: 1 / (sigma_{i+1} - sigma_i)) and the
        # per-example pseudo-Huber distance sqrt(||.||^2 + c^2) - c (iCT: c = 0.00054 sqrt(d); ECT: c = 0, the norm);
        # t and r are noise levels on flow too (f is in x0 space either way)
        c = (self.huber_c if self.huber_c is not None else ict_huber_c(x0[0].numel())) if self.variant == "ict" \
            else self.ect_c
        per_example = ct.ect_loss(f_t, f_r, t, r, c)
        if bins is not None and self.training:
            self.record_time_losses(bins, per_example)
        return self.weighted_mean(per_example, iw)

    # ------------------------------------------------------------------ sampling and export

    @property
    def num_inference_steps(self) -> int:
        return self.sampling["num_inference_steps"]

    def sampling_scheduler(self, name: str | None = None):
        """The training parametrisation's scheduler (``cm`` for iCT, ``lcm`` for ECT, ``flow_lcm`` for ECT on a flow
        teacher) or another by ``name``."""
        name = name or self.sampling["name"]
        check_scheduler_kind(name, self.noise_scheduler_config)  # before the VP schedulers' own checks below
        options = {} if name == self.sampling["name"] else scheduler_options(name)
        if name == "cm":
            if self.variant != "ict":
                raise ValueError("scheduler=cm samples iCT's EDM parametrisation; method.variant=ect samples with lcm")
            # latents are not confined to [-1, 1]: the scheduler's default clipping of the denoised sample is off
            options.update(sigma_min=self.sigma_min, sigma_max=self.sigma_max, sigma_data=self.sigma_data, rho=self.rho,
                           clip_denoised=False)
        elif name == "lcm":
            if self.variant != "ect":
                raise ValueError("scheduler=lcm samples ECT's VP parametrisation; method.variant=ict samples with cm")
            options.update(timestep_scaling=self.timestep_scaling)
        elif name == "tcd":  # TCD leaves out c_skip/c_out and re-noises stochastically: not what was trained
            raise ValueError("scheduler=tcd does not sample the consistency-training parametrisation; use lcm (ect) "
                             "or cm (ict)")
        if name == self.sampling["name"]:
            options.update(self.sampling.get("options") or {})
        return make_scheduler(name, self.noise_scheduler_config, **options)

    def extra_call_defaults(self) -> dict:
        """No classifier-free guidance (there is no teacher to guide; a guidance input at 1, as trained). On a flow
        teacher with a static shift the steps are at the trailing sigmas shift(linspace(1, 1 / N, N)) (2 steps:
        t = 1, 0.75 at SD3's shift 3), not FlowMatchLCMScheduler's own N points from 1 to its smallest training sigma
        (2 steps: 1, 0.009, a second step that re-noises almost nothing), as LCMScheduler's 2 steps re-noise to
        mid-schedule; under a resolution shift FluxPipeline gives it those trailing sigmas itself, at the mu of the
        training resolution that the export samples at by default (the base's ``resolution_defaults``)."""
        defaults = {"default_guidance_scale": 1.0, "guidance_distilled": False}
        if self.flow and not self.schedule.use_dynamic_shifting:
            defaults["sigma_spacing"] = "trailing"
        return defaults

    def guidance_source(self) -> str:
        return "no guidance"

    def guidance_note(self) -> str:
        network = "transformer" if self.flow else "UNet"
        scale = ("its guidance embedding's input, trained at 1: another scale gives the network an input it was not "
                 "trained with" if self.student_guidance_embedded else
                 "a higher scale would add an unconditional pass the model was not trained for")
        return (f"trained by consistency training on conditional samples, with no teacher and no guidance: one {network} "
                f"evaluation per step at guidance_scale 1 ({scale}).")

    def export_info(self) -> dict:
        if self.flow:
            return {**super().export_info(), "variant": self.variant, "stages": self.stages,
                    "noise_levels": "sigma lognormal (p_mean, p_std) at flow time t = sigma / (1 + sigma)",
                    "consistency_function": "f(x_t, t) = x_t - t v (c_skip = 1, c_out = -t on the velocity)"}
        info = {"variant": self.variant, "sigma_data": self.sigma_data if self.variant == "ict" else 0.5}
        if self.variant == "ict":
            info.update(sigma_min=self.sigma_min, sigma_max=self.sigma_max, rho=self.rho)
        else:
            info.update(timestep_scaling=self.timestep_scaling, stages=self.stages)
        return info

    @classmethod
    def check_config(cls, cfg) -> None:
        """``method.resolution`` is the training images' (``check_resolution``)."""
        check_resolution(cfg)
