"""Progressive distillation (Salimans & Ho 2022, Algorithm 2) in latent space, on a discrete VP teacher (DDIM
steps) or a flow-matching one (SD3, Flux: Euler steps of the flow ODE).

Round r trains a student to do in one DDIM step what the current teacher does in two; then the
student becomes the teacher and the step count halves. Classifier-free guidance follows Meng et al.
2023 ("On Distillation of Guided Diffusion Models") in one of two forms:

* w fixed (``guided_stage_steps=0``): the first round's teacher is the original one guided at
  ``guidance_scale``; every student runs one network evaluation per step at that scale.
* w conditioned (``guided_stage_steps>0``): a first stage trains a student that takes the guidance
  scale as an input (a sinusoidal embedding through ``timestep_cond``, diffusers' convention) to
  match the guided teacher's prediction at the teacher's own step count, with the scale drawn from
  [guidance_scale_min, guidance_scale_max] per sample; the rounds then halve steps with w as an input.
  The exported pipelines take ``guidance_scale`` at sampling time and still run one evaluation per step.

On a flow-matching teacher (``FlowMatchingSchedule``: x_t = (1 - t) x0 + t eps, velocity v = eps - x0) the same
algorithm runs unchanged in (x0, eps): a flow Euler step x_t + (t' - t) v is exactly the DDIM step of the straight
path, (1 - t') x0 + t' eps, so two teacher Euler steps, the student's x-target and its SNR weighting are the VP
ones with alpha = 1 - t, sigma = t. Only the grid differs: the N-step student grid is t_i = shift(i / N), i = 0..N
(the scheduler's static shift; i = N is pure noise), whose points the 2N-step teacher grid contains. The student
predicts the velocity (``flow_prediction``, what ``FlowMatchEulerDiscreteScheduler`` steps) and is sampled on that
grid by the stock Euler scheduler given the unshifted sigmas linspace(1, 1/N, N) (as FluxPipeline passes them;
the export's ``sigma_spacing="trailing"``).

A scheduler that shifts by resolution (``use_dynamic_shifting``: Flux's mu of the image's packed token count) is
distilled at one resolution, ``resolution`` (the training images' side): the N-step grid is what
``FluxPipeline.__call__`` samples N steps with at that size, linspace(1, 1/N, N) shifted by its mu, terminal 0
(``trailing_flow_sigmas``; linspace(1, 1/2N, 2N) holds linspace(1, 1/N, N) and the shift is monotone, so the 2N-step
teacher grid holds it too), and the export samples at that size by default, where the stock pipeline's own sigmas
are that grid. A teacher that takes the guidance scale as an input (FLUX.1-dev's guidance embedding:
``guidance_embedded``) is stepped as its pipeline calls it, at ``guidance_scale`` through the embedding with no CFG
pass, and a student with that input takes the same scale through it (every round's, the export's default); a
teacher without one (FLUX.1-schnell's layout) is guided by CFG in velocity form, distilled into the students.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from distill.data.latents import batch_size_of
from distill.diffusion import (
    FlowMatchingSchedule,
    cfg,
    ddim_step,
    diffusion_loss,
    guidance_condition,
    snr_weight,
)
from distill.diffusion.flow import FLOW_PREDICTION_TYPES
from distill.diffusion.losses import WEIGHTINGS
from distill.diffusion.parametrization import PREDICTION_TYPES
from distill.diffusion.progressive import progressive_x_target, round_schedule
from distill.inference.schedulers import grid_timesteps
from distill.methods import METHODS
from distill.methods.checks import check_guidance_range, check_resolution, is_sharded
from distill.methods.distillation import TeacherStudentDistillation
from distill.models.teacher import Teacher

STUDENT_PREDICTION_TYPES = tuple(dict.fromkeys((*PREDICTION_TYPES, *FLOW_PREDICTION_TYPES)))
VP_STUDENT_PREDICTION, FLOW_STUDENT_PREDICTION = "v_prediction", "flow_prediction"  # None: the teacher's kind's


@METHODS.register("progressive", choices={"student_prediction_type": STUDENT_PREDICTION_TYPES,
                                          "loss_weighting": WEIGHTINGS})
class ProgressiveDistillation(TeacherStudentDistillation):
    method_name = "progressive"

    def __init__(
        self,
        teacher: Teacher,
        student: nn.Module | Callable[[nn.Module], nn.Module],
        optimizer: Callable,
        lr_scheduler: Callable | None = None,
        start_steps: int = 64,
        final_steps: int = 4,
        steps_per_round: int = 300,
        guidance_scale: float = 3.0,  # CFG of the first teacher, distilled into the students (w fixed)
        student_prediction_type: str | None = None,  # v_prediction on a VP teacher, flow_prediction on a flow one
        loss_weighting: str = "truncated_snr",  # max(SNR, 1) on the x-error (the paper's default)
        guided_stage_steps: int = 0,  # > 0: Meng et al. stage 1, a w-conditioned student first (time_cond_proj_dim)
        guidance_scale_min: float = 2.0,  # range of the CFG scale a w-conditioned student learns
        guidance_scale_max: float = 4.0,
        # the training images' side in pixels (conf/method/progressive.yaml: data.resolution); read only where the
        # teacher's scheduler shifts by resolution (use_dynamic_shifting: Flux), whose grids are built at its mu
        resolution: int | None = None,
        sampling: dict | None = None,
        **speed,  # DistillMethod's training-speed switches (compile, frozen_dtype, ...)
    ):
        if loss_weighting == "edm":
            raise ValueError("method.loss_weighting=edm is EDM's denoising objective, t drawn lognormally over the "
                             "schedule (plain diffusion training); progressive distillation trains on its student "
                             "grid: use truncated_snr, min_snr or none")
        rounds = round_schedule(start_steps, final_steps)  # student step counts, e.g. [32, 16, 8, 4]
        super().__init__(teacher, student, optimizer, lr_scheduler, guidance_scale_min=guidance_scale_min,
                         guidance_scale_max=guidance_scale_max, **speed)
        self.save_hyperparameters(ignore=["teacher", "student", "optimizer", "lr_scheduler"])
        self.rounds = rounds
        self.start_steps, self.steps_per_round = start_steps, steps_per_round
        self.teacher_prediction_type = self.family.prediction_type
        self.flow = isinstance(self.schedule, FlowMatchingSchedule)
        student_prediction_type = check_student_prediction(student_prediction_type, self.flow, self.teacher_source)
        self.bind_resolution(resolution)  # under a resolution shift (Flux): the grids at the training images' mu
        self.student_prediction_type, self.loss_weighting = student_prediction_type, loss_weighting
        if self.noise.preconditioning == "edm":  # the EDM-wrapped student predicts what the student is trained to
            self.student.register_to_config(edm_prediction_type=student_prediction_type)
        self.guidance_scale = guidance_scale
        self.guided_stage_steps = guided_stage_steps
        if self.flow:
            check_flow_settings(guided_stage_steps, loss_weighting, (sampling or {}).get("name", "flow_euler"),
                                self.teacher_source)
        if guided_stage_steps > 0 and self.w_dim is None:
            raise ValueError("method.guided_stage_steps > 0 trains a w-conditioned student; use student=copy with "
                             "student.time_cond_proj_dim=256 (it is null)")
        if guided_stage_steps == 0 and self.w_dim is not None:
            raise ValueError(f"student.time_cond_proj_dim={self.w_dim} but the guidance scale is fixed "
                             "(method.guided_stage_steps=0); set student.time_cond_proj_dim=null or guided_stage_steps>0")
        # round -1 is the guided stage: the original teacher, distilled at its own step count into a w-conditioned student
        self.first_round = -1 if guided_stage_steps > 0 else 0
        default_w = guidance_scale if self.w_conditioned else 1.0
        self.sampling = dict(sampling or {"name": "flow_euler" if self.flow else "ddim", "guidance_scale": default_w})
        self.num_train_timesteps = self.schedule.num_train_timesteps
        self.round_index = self.first_round

    # ------------------------------------------------------------------ rounds

    @property
    def w_conditioned(self) -> bool:
        return self.guided_stage_steps > 0

    @property
    def student_steps(self) -> int:
        return self.start_steps if self.round_index < 0 else self.rounds[self.round_index]

    def round_of(self, global_step: int) -> int:
        step = global_step - self.guided_stage_steps
        return -1 if step < 0 else min(step // self.steps_per_round, len(self.rounds) - 1)

    def on_train_batch_start(self, batch, batch_idx) -> None:
        target = self.round_of(self.global_step)
        while self.round_index < target:  # hand over: the student becomes the teacher
            self.finish_round()

    def _export_round(self) -> None:
        self.export(Path(self.trainer.default_root_dir) / "rounds" / f"{self.student_steps:03d}-steps")

    def finish_round(self) -> None:
        if self._trainer is not None and self.trainer.is_global_zero:
            self._export_round()
        self.teacher_unet = self.prepare_network(self.frozen_student_copy().eval())
        self.teacher_prediction_type = self.student_prediction_type
        self.guidance_scale = 1.0  # only the original teacher runs CFG; later teachers are students
        self.round_index += 1

    def on_train_end(self) -> None:
        if self.trainer.is_global_zero and not self.trainer.fast_dev_run:  # the last round's student
            self._export_round()

    @property
    def teacher_reloads(self) -> bool:
        return self.round_index == self.first_round  # later teachers are trained students, kept in checkpoints

    @property
    def teacher_is_original(self) -> bool:
        # later teachers are students: their errors are amplified by the x-target's 1 / (a_e - s_e a_t / s_t)
        return self.round_index == self.first_round

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["progressive"] = {"round_index": self.round_index, "guidance_scale": self.guidance_scale,
                                     "teacher_prediction_type": self.teacher_prediction_type}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        info = checkpoint["progressive"]
        if info["round_index"] > self.first_round:  # the teacher of a later round is an earlier student
            self.teacher_unet = self.prepare_network(self.frozen_student_copy().eval())
        self.round_index, self.guidance_scale = info["round_index"], info["guidance_scale"]
        self.teacher_prediction_type = info["teacher_prediction_type"]

    # ------------------------------------------------------------------ objective

    def _times(self, i: torch.Tensor, steps: int) -> torch.Tensor:
        """Time of grid point i on a ``steps``-step grid; i = 0 is the clean end. VP: the DDIM grid's integer
        timestep (index T: the clean sample), as the exported GridDDIMScheduler samples. Flow: t = shift(i / steps),
        as FlowMatchEulerDiscreteScheduler shifts the sigmas linspace(1, 1 / N, N) (by its static shift, or by mu of
        the training resolution) and ends at 0."""
        if self.flow:  # the scheduler's own float32 arithmetic, so that sampling steps on these very points
            sigmas = self.trailing_flow_sigmas(steps).to(i.device)  # t_N .. t_1, 0
            return sigmas[steps - i]
        return grid_timesteps(i, steps, self.num_train_timesteps)

    def _scales(self, n: int, generator: torch.Generator | None) -> torch.Tensor:
        """Per-sample CFG scale: drawn from [min, max] for a w-conditioned student, else the fixed one."""
        if not self.w_conditioned:
            return torch.full((n,), float(self.guidance_scale))
        u = torch.rand(n, generator=generator)
        return self.guidance_scale_min + (self.guidance_scale_max - self.guidance_scale_min) * u

    @torch.no_grad()
    def _teacher_x0_eps(self, x, t, cond, uncond, scale, w_kwargs):
        """The current teacher's (x0, eps) at (x, t): the original teacher with CFG at ``scale`` in the
        first round (or guided stage), later the previous student (w as an input when w-conditioned)."""
        tt = t if self.flow else t.clamp(max=self.num_train_timesteps - 1)  # VP: index T is the clean end
        original = self.round_index == self.first_round
        if original and self.teacher_guidance_embedded:  # as its pipeline calls it: the scale as an input, no CFG pass
            out = self.teacher_forward(x, tt, cond, **self.family.guidance_input(scale.to(x)))
        elif original and bool((scale != 1.0).any()):
            out = cfg(*self.teacher_cond_uncond(x, tt, cond, uncond), scale.to(x))
        else:
            out = self.teacher_forward(x, tt, cond, **({} if original else w_kwargs))
        return self.schedule.to_x0_eps(out, x, t, self.teacher_prediction_type)

    def _teacher_step(self, x, t, t_next, cond, uncond, scale, w_kwargs):
        x0, eps = self._teacher_x0_eps(x, t, cond, uncond, scale, w_kwargs)
        return ddim_step(x0, eps, *self.schedule.alpha_sigma(t_next, x.ndim))

    def student_target(self, x0, eps, i, cond, uncond, scale, w_kwargs):
        """(x_t, t, target) at student grid points ``i`` (1..N): x_t noised from (x0, eps) at t_i, and what the
        student's ``student_prediction_type`` output should be there: the prediction whose one step t_i -> t_{i-1}
        lands where two steps of the current teacher land (Salimans & Ho 2022, Algorithm 2); in the guided stage,
        the guided teacher's own prediction. On a flow teacher the flow_prediction target is the velocity of the
        straight line from x_t to the teacher's landing point, (x_end - x_t) / (t_{i-1} - t_i)."""
        steps = self.student_steps
        if self.round_index < 0:  # guided stage: the student's prediction matches the guided teacher's
            t = self._times(i, steps)
        else:  # student step i -> i - 1 on its grid = teacher steps 2i -> 2i - 1 -> 2i - 2
            t, t_mid, t_end = self._times(2 * i, 2 * steps), self._times(2 * i - 1, 2 * steps), self._times(2 * i - 2, 2 * steps)
        a_t, s_t = self.schedule.alpha_sigma(t, x0.ndim)
        x_t = self.schedule.add_noise(x0, eps, t)
        if self.round_index < 0:
            x_target, eps_target = self._teacher_x0_eps(x_t, t, cond, uncond, scale, w_kwargs)
        else:
            x_mid = self._teacher_step(x_t, t, t_mid, cond, uncond, scale, w_kwargs)
            x_end = self._teacher_step(x_mid, t_mid, t_end, cond, uncond, scale, w_kwargs)
            a_e, s_e = self.schedule.alpha_sigma(t_end, x0.ndim)
            x_target = progressive_x_target(x_t, x_end, a_t, s_t, a_e, s_e)
            eps_target = (x_t - a_t * x_target) / s_t
        return x_t, t, self.schedule.prediction_target(x_target, eps_target, t, self.student_prediction_type)

    def loss(self, batch: dict, generator: torch.Generator | None = None) -> torch.Tensor:
        batch = self.paired_batch(batch)  # method.noise.antithetic: rows in pairs sharing all but the noise's sign
        x0 = self.latents(batch, generator)
        self.check_latent_size(x0, "student grid")
        n, steps = x0.shape[0], self.student_steps
        cond, uncond = self.text_conditions(batch, n, x0.device)
        scale = self.paired(self._scales(n, generator)).to(x0.device)
        if self.student_guidance_embedded:  # FLUX.1-dev: every student takes the first teacher's scale as its input
            w_kwargs = self.family.guidance_input(torch.full((n,), float(self.hparams.guidance_scale), device=x0.device))
        else:
            w_kwargs = guidance_condition(scale - 1.0, self.w_dim, x0)  # pipelines embed w = scale - 1
        # bins 0..steps-1 = student grid points i = 1..steps (ascending noise: i = 0 is the clean end)
        grid = self._times(torch.arange(1, steps + 1, device=x0.device), steps)
        bins, iw = self.draw_time_bins(n, self.schedule.noise_level(grid), generator, stage=self.round_index)
        i = (bins + 1).to(x0.device)
        eps = self.draw_noise(x0, generator)
        x_t, t, target = self.student_target(x0, eps, i, cond, uncond, scale, w_kwargs)
        pred = self.family.denoise(self.student, x_t, t, cond, **w_kwargs)
        weight = snr_weight(self.schedule.snr(t), self.student_prediction_type, self.loss_weighting)
        per_example = diffusion_loss(pred, target, weight, reduce=False)
        if self.training:
            self.record_time_losses(bins, per_example)
        return self.weighted_mean(per_example, iw)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train/student_steps", float(self.student_steps), batch_size=batch_size_of(batch))
        return loss

    # ------------------------------------------------------------------ sampling and export

    @property
    def num_inference_steps(self) -> int:
        return self.student_steps  # this round's

    def sampling_scheduler(self, name: str | None = None):
        """DDIM (the default) is ``GridDDIMScheduler``: the (t, t_prev) pairs of the training grid at every step
        count, the last step to the clean sample; other names are diffusers' schedulers with trailing spacing."""
        from distill.inference.schedulers import GridDDIMScheduler, make_scheduler

        name = name or self.sampling["name"]
        if self.flow:  # the student's velocity, stepped on the grid it learned (the pipeline's trailing sigmas)
            return make_scheduler(name, self.noise_scheduler_config)
        if name == "ddim":
            return GridDDIMScheduler.from_config(self.noise_scheduler_config, prediction_type=self.student_prediction_type)
        return make_scheduler(name, self.noise_scheduler_config, prediction_type=self.student_prediction_type,
                              timestep_spacing="trailing")

    def guidance_source(self) -> str:
        if self.w_conditioned:
            return (f"the teacher's classifier-free guidance at scales in [{self.guidance_scale_min}, "
                    f"{self.guidance_scale_max}]")
        kind = "embedded guidance (its guidance input)" if self.teacher_guidance_embedded else "classifier-free guidance"
        return f"the first teacher's {kind} at scale {self.hparams.guidance_scale}"

    def extra_call_defaults(self) -> dict:
        """A flow student samples on the trailing sigmas linspace(1, 1 / N, N) it was trained on (``sigma_spacing``),
        not on the scheduler's own N points between 1 and its smallest training sigma (under a resolution shift
        FluxPipeline's own sigmas are those); a student with a guidance input at the scale it was trained at."""
        defaults = {"sigma_spacing": "trailing"} if self.flow and not self.schedule.use_dynamic_shifting else {}
        if self.student_guidance_embedded:
            defaults["default_guidance_scale"] = float(self.hparams.guidance_scale)
        return defaults

    def export_info(self) -> dict:
        info = {**super().export_info(), "w_conditioned": self.w_conditioned,
                "prediction_type": self.student_prediction_type}
        if self.flow:
            shift = (f"shift by mu={self.mu:.6g} of the {self.resolution}px training images" if self.mu is not None
                     else f"shift {self.schedule.shift}")
            info["grid"] = (f"t_i = shift(i / N), i = 0..N ({shift}): Euler steps on the unshifted "
                            "sigmas linspace(1, 1/N, N), the last step to 0")
        if self.w_conditioned:
            info["guidance_scale_range"] = [self.guidance_scale_min, self.guidance_scale_max]
        return info

    @classmethod
    def check_config(cls, cfg) -> None:
        """Not sharded (each round turns the student into the next teacher); a halving round schedule; the guidance
        range; a local teacher with a DDPM beta schedule (the DDIM steps of the teacher read alphas_cumprod)."""
        import json

        method = cfg.method
        if is_sharded(cfg):
            raise ValueError("trainer=fsdp does not run progressive distillation: each round turns the student into "
                             "the next teacher, which the sharded networks do not support; use trainer=ddp")
        try:
            round_schedule(method.start_steps, method.final_steps)
        except ValueError as err:
            raise ValueError(f"method.start_steps / method.final_steps: {err}") from err
        check_guidance_range(method)
        check_resolution(cfg)
        folder = (cfg.get("teacher") or {}).get("pretrained_model_name_or_path")
        teacher = Path(str(folder)) if folder is not None else None
        if teacher is not None and teacher.is_dir():
            from distill.models.teacher import is_flow_matching

            sched = teacher / "scheduler" / "scheduler_config.json"
            config = json.loads(sched.read_text()) if sched.is_file() else {}
            if is_flow_matching(config):  # Euler steps of the flow ODE (the family says whether progressive serves it)
                check_flow_settings(method.guided_stage_steps, str(getattr(method.loss_weighting, "value",
                                                                           method.loss_weighting)),
                                    str(getattr(cfg.scheduler.name, "value", cfg.scheduler.name)), str(teacher))
                return
            if "beta_schedule" not in config and "trained_betas" not in config:
                raise ValueError(
                    f"teacher {str(teacher)!r} has scheduler {config.get('_class_name', 'unknown')!r} without a DDPM "
                    "beta schedule; progressive distillation needs a DDIM-compatible (alphas_cumprod) teacher or a "
                    "flow-matching one (FlowMatchEulerDiscreteScheduler)"
                )


def check_flow_settings(guided_stage_steps: int, loss_weighting: str, scheduler: str, teacher: str) -> None:
    """What progressive distillation on a flow-matching teacher cannot do: a w-conditioned student (a transformer has
    no timestep_cond input to add), min-SNR weighting (SNR = 0 at t = 1: the first step from pure noise would weigh 0),
    a sampler other than flow Euler (the student is trained to take deterministic Euler steps on its grid)."""
    if guided_stage_steps > 0:
        raise ValueError(f"method.guided_stage_steps={guided_stage_steps} on the flow-matching teacher {teacher!r}: a "
                         "w-conditioned student needs a guidance-scale (timestep_cond) input, which a flow transformer "
                         "does not have; set method.guided_stage_steps=0 (the guidance is then distilled in)")
    if loss_weighting == "min_snr":
        raise ValueError(f"method.loss_weighting=min_snr on the flow-matching teacher {teacher!r}: the SNR is 0 at "
                         "t = 1, so the student's first step (from pure noise) would weigh 0; use truncated_snr or none")
    if scheduler != "flow_euler":
        raise ValueError(f"scheduler.name={scheduler!r} on the flow-matching teacher {teacher!r}: a progressive "
                         "student takes deterministic Euler steps on its grid; use scheduler=flow_euler "
                         "(+exp=progressive_flow)")


def check_student_prediction(prediction_type: str | None, flow: bool, teacher: str) -> str:
    """The student's prediction type: given, or v_prediction on a VP teacher and flow_prediction (the velocity) on a
    flow one. A flow student predicts the velocity, which the exported Euler scheduler steps; a VP student one of
    the DDPM-family types."""
    if prediction_type is None:
        return FLOW_STUDENT_PREDICTION if flow else VP_STUDENT_PREDICTION
    if flow and prediction_type != FLOW_STUDENT_PREDICTION:
        raise ValueError(f"method.student_prediction_type={prediction_type!r} on the flow-matching teacher {teacher!r}: "
                         "the exported FlowMatchEulerDiscreteScheduler steps a velocity; set "
                         f"method.student_prediction_type={FLOW_STUDENT_PREDICTION} (or null)")
    if not flow and prediction_type not in PREDICTION_TYPES:
        raise ValueError(f"method.student_prediction_type={prediction_type!r} on the discrete VP teacher {teacher!r}; "
                         f"use one of {list(PREDICTION_TYPES)} (or null: {VP_STUDENT_PREDICTION})")
    return prediction_type
