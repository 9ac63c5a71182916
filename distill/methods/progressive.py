"""Progressive distillation (Salimans & Ho 2022, Algorithm 2) in latent space, for any SD-format teacher.

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
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from distill.diffusion import add_noise, prediction_target, snr, snr_weight, to_x0_eps
from distill.diffusion.consistency import ddim_step, guidance_scale_embedding
from distill.diffusion.losses import diffusion_loss
from distill.diffusion.progressive import progressive_x_target, round_schedule
from distill.inference.schedulers import grid_timesteps
from distill.methods.base import (
    DistillMethod,
    encode_latents,
    pipeline_images,
    text_to_image_pipeline,
)
from distill.models.conditioning import TextConditioner
from distill.models.students import make_student
from distill.models.teacher import Teacher


class ProgressiveDistillation(DistillMethod):
    def __init__(
        self,
        teacher: Teacher,
        student: nn.Module | Callable[[nn.Module], nn.Module],
        optimizer: Callable,
        lr_scheduler: Callable | None = None,
        start_steps: int = 64,
        final_steps: int = 4,
        steps_per_round: int = 300,
        guidance_scale: float = 3.0,
        student_prediction_type: str = "v_prediction",
        loss_weighting: str = "truncated_snr",
        guided_stage_steps: int = 0,
        guidance_scale_min: float = 2.0,
        guidance_scale_max: float = 6.0,
        sampling: dict | None = None,
    ):
        super().__init__(optimizer, lr_scheduler)
        self.save_hyperparameters(ignore=["teacher", "student", "optimizer", "lr_scheduler"])
        self.rounds = round_schedule(start_steps, final_steps)  # student step counts, e.g. [32, 16, 8, 4]
        self.start_steps, self.steps_per_round = start_steps, steps_per_round
        self.teacher_source = teacher.source
        self.vae = teacher.vae.requires_grad_(False).eval()
        self.conditioner = TextConditioner(teacher.text_encoder, teacher.tokenizer)
        self.noise_scheduler_config = dict(teacher.scheduler.config)
        self.teacher_prediction_type = teacher.prediction_type
        self.student_prediction_type, self.loss_weighting = student_prediction_type, loss_weighting
        self.guidance_scale = guidance_scale
        self.teacher_unet = teacher.unet.requires_grad_(False).eval()
        self.student = make_student(student, teacher)
        self.guided_stage_steps = guided_stage_steps
        self.w_dim = self.student.config.get("time_cond_proj_dim")
        if guided_stage_steps > 0 and self.w_dim is None:
            raise ValueError("method.guided_stage_steps > 0 trains a w-conditioned student; use student=copy with "
                             "student.time_cond_proj_dim=256 (it is null)")
        if guided_stage_steps == 0 and self.w_dim is not None:
            raise ValueError(f"student.time_cond_proj_dim={self.w_dim} but the guidance scale is fixed "
                             "(method.guided_stage_steps=0); set student.time_cond_proj_dim=null or guided_stage_steps>0")
        if guidance_scale_min > guidance_scale_max:
            raise ValueError(f"method.guidance_scale_min={guidance_scale_min} > method.guidance_scale_max={guidance_scale_max}")
        self.guidance_scale_min, self.guidance_scale_max = guidance_scale_min, guidance_scale_max
        # round -1 is the guided stage: the original teacher, distilled at its own step count into a w-conditioned student
        self.first_round = -1 if guided_stage_steps > 0 else 0
        default_w = guidance_scale if self.w_conditioned else 1.0
        self.sampling = dict(sampling or {"name": "ddim", "guidance_scale": default_w})
        self.num_train_timesteps = teacher.scheduler.config.num_train_timesteps
        # abar with a final entry 1.0 at index T: "t = -1" is the clean image (alpha 1, sigma 0)
        abar = teacher.scheduler.alphas_cumprod.clone().float()
        self.register_buffer("abar", torch.cat([abar, torch.ones(1)]), persistent=False)
        self.round_index = self.first_round
        self.strict_loading = False

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

    def finish_round(self) -> None:
        if self._trainer is not None and self.trainer.is_global_zero:
            self.export(Path(self.trainer.default_root_dir) / "rounds" / f"{self.student_steps:03d}-steps")
        self.teacher_unet = copy.deepcopy(self.student).requires_grad_(False).eval()
        self.teacher_prediction_type = self.student_prediction_type
        self.guidance_scale = 1.0  # only the original teacher runs CFG; later teachers are students
        self.round_index += 1

    def on_train_end(self) -> None:
        if self.trainer.is_global_zero and not self.trainer.fast_dev_run:  # the last round's student
            self.export(Path(self.trainer.default_root_dir) / "rounds" / f"{self.student_steps:03d}-steps")

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint["state_dict"]
        for key in [k for k in state if k.startswith(("vae.", "conditioner.text_encoder."))]:
            del state[key]
        if self.round_index == self.first_round:  # the original teacher reloads from its pipeline
            for key in [k for k in state if k.startswith("teacher_unet.")]:
                del state[key]
        checkpoint["progressive"] = {"round_index": self.round_index, "guidance_scale": self.guidance_scale,
                                     "teacher_prediction_type": self.teacher_prediction_type}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        info = checkpoint["progressive"]
        if info["round_index"] > self.first_round:  # the teacher of a later round is an earlier student
            self.teacher_unet = copy.deepcopy(self.student).requires_grad_(False).eval()
        self.round_index, self.guidance_scale = info["round_index"], info["guidance_scale"]
        self.teacher_prediction_type = info["teacher_prediction_type"]

    # ------------------------------------------------------------------ objective

    def _times(self, i: torch.Tensor, steps: int) -> torch.Tensor:
        """Timestep of grid point i on an ``steps``-step DDIM grid; i = 0 is the clean end (index T). The
        exported GridDDIMScheduler samples on the same grid."""
        return grid_timesteps(i, steps, self.num_train_timesteps)

    def _alpha_sigma(self, t: torch.Tensor):
        abar = self.abar[t].reshape(-1, 1, 1, 1)
        return abar.sqrt(), (1 - abar).clamp(min=0).sqrt()

    def _scales(self, n: int, generator: torch.Generator | None) -> torch.Tensor:
        """Per-sample CFG scale: drawn from [min, max] for a w-conditioned student, else the fixed one."""
        if not self.w_conditioned:
            return torch.full((n,), float(self.guidance_scale))
        u = torch.rand(n, generator=generator)
        return self.guidance_scale_min + (self.guidance_scale_max - self.guidance_scale_min) * u

    def _w_kwargs(self, scale: torch.Tensor) -> dict:
        if not self.w_conditioned:
            return {}
        return {"timestep_cond": guidance_scale_embedding(scale - 1.0, self.w_dim)}  # pipelines embed (scale - 1)

    @torch.no_grad()
    def _teacher_x0_eps(self, x, t, cond, uncond, scale, w_kwargs):
        """The current teacher's (x0, eps) at (x, t): the original teacher with CFG at ``scale`` in the
        first round (or guided stage), later the previous student (w as an input when w-conditioned)."""
        a, s = self._alpha_sigma(t)
        tt = t.clamp(max=self.num_train_timesteps - 1)
        if self.round_index == self.first_round and bool((scale != 1.0).any()):
            out_c, out_u = self.teacher_unet(torch.cat([x, x]), torch.cat([tt, tt]),
                                             encoder_hidden_states=torch.cat([cond, uncond])).sample.chunk(2)
            out = out_u + scale.to(x).reshape(-1, 1, 1, 1) * (out_c - out_u)
        elif self.round_index == self.first_round:
            out = self.teacher_unet(x, tt, encoder_hidden_states=cond).sample
        else:
            out = self.teacher_unet(x, tt, encoder_hidden_states=cond, **w_kwargs).sample
        return to_x0_eps(self.teacher_prediction_type, out, x, a, s)

    def _teacher_step(self, x, t, t_next, cond, uncond, scale, w_kwargs):
        x0, eps = self._teacher_x0_eps(x, t, cond, uncond, scale, w_kwargs)
        a_next, s_next = self._alpha_sigma(t_next)
        return ddim_step(x0, eps, a_next, s_next)

    def loss(self, batch: dict, generator: torch.Generator | None = None) -> torch.Tensor:
        x0 = encode_latents(self.vae, batch["pixel_values"], generator)
        n, steps = x0.shape[0], self.student_steps
        cond = self.conditioner(batch)["encoder_hidden_states"]
        uncond = self.conditioner.null(n, x0.device)["encoder_hidden_states"]
        scale = self._scales(n, generator).to(x0.device)
        w_kwargs = {k: v.to(x0) for k, v in self._w_kwargs(scale).items()}
        i = torch.randint(1, steps + 1, (n,), generator=generator).to(x0.device)
        if self.round_index < 0:  # guided stage: the student's prediction matches the guided teacher's
            t = self._times(i, steps)
        else:  # student step i -> i - 1 on its grid = teacher steps 2i -> 2i - 1 -> 2i - 2
            t, t_mid, t_end = self._times(2 * i, 2 * steps), self._times(2 * i - 1, 2 * steps), self._times(2 * i - 2, 2 * steps)
        eps = torch.randn(x0.shape, generator=generator).to(x0)
        a_t, s_t = self._alpha_sigma(t)
        x_t = add_noise(x0, eps, a_t, s_t)
        if self.round_index < 0:
            x_target, eps_target = self._teacher_x0_eps(x_t, t, cond, uncond, scale, w_kwargs)
        else:
            x_mid = self._teacher_step(x_t, t, t_mid, cond, uncond, scale, w_kwargs)
            x_end = self._teacher_step(x_mid, t_mid, t_end, cond, uncond, scale, w_kwargs)
            a_e, s_e = self._alpha_sigma(t_end)
            x_target = progressive_x_target(x_t, x_end, a_t, s_t, a_e, s_e)
            eps_target = (x_t - a_t * x_target) / s_t
        target = prediction_target(self.student_prediction_type, x_target, eps_target, a_t, s_t)
        pred = self.student(x_t, t, encoder_hidden_states=cond, **w_kwargs).sample
        weight = snr_weight(snr(a_t, s_t).flatten(), self.student_prediction_type, self.loss_weighting)
        return diffusion_loss(pred, target, weight)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        n = batch["pixel_values"].shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=n)
        self.log("train/student_steps", float(self.student_steps), batch_size=n)
        return self.add_student_aux_loss(loss, n)

    def validation_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch, torch.Generator().manual_seed(1000 + batch_idx))
        self.log("val/loss", loss, prog_bar=True, batch_size=batch["pixel_values"].shape[0], sync_dist=True)
        return loss

    # ------------------------------------------------------------------ sampling and export

    def pipeline(self, scheduler: str | None = None):
        """The student as an in-memory distill text-to-image pipeline with the export's call defaults
        (``call_defaults``). DDIM (the default) is ``GridDDIMScheduler``: the (t, t_prev) pairs of the training
        grid at every step count, the last step to the clean sample; other names are diffusers' schedulers
        with trailing spacing."""
        from distill.inference.schedulers import GridDDIMScheduler, make_scheduler

        name = scheduler or self.sampling["name"]
        if name == "ddim":
            sched = GridDDIMScheduler.from_config(self.noise_scheduler_config, prediction_type=self.student_prediction_type)
        else:
            sched = make_scheduler(name, self.noise_scheduler_config, prediction_type=self.student_prediction_type,
                                   timestep_spacing="trailing")
        return text_to_image_pipeline(self.vae, self.conditioner, self.student, sched, **self.call_defaults())

    def call_defaults(self) -> dict:
        """This round's step count; a w-conditioned student takes the configured guidance as its input, a w-fixed
        one has its guidance distilled (no CFG pass, guidance 1)."""
        return {"default_num_inference_steps": self.student_steps,
                "default_guidance_scale": self.sampling["guidance_scale"] if self.w_conditioned else 1.0,
                "guidance_distilled": not self.w_conditioned}

    def generate(self, batch: dict, generator: torch.Generator, num_inference_steps: int | None = None,
                 guidance_scale: float | None = None, scheduler: str | None = None) -> torch.Tensor:
        return pipeline_images(self.pipeline(scheduler), batch["caption"], generator, num_inference_steps, guidance_scale)

    def export(self, out_dir: str | Path) -> Path:
        """A distill text-to-image pipeline folder whose GridDDIMScheduler samples this round's student on its
        training grid, with distill.json and a model card."""
        from distill.inference.model_card import call_info, write_export_info

        out_dir = Path(out_dir)
        pipe = self.pipeline()
        pipe.save_pretrained(out_dir)
        defaults = self.call_defaults()
        if self.w_conditioned:
            guidance = (f"distilled from the teacher's classifier-free guidance at scales in [{self.guidance_scale_min}, "
                        f"{self.guidance_scale_max}], taken as an input (the embedding of guidance_scale - 1 through "
                        "timestep_cond): one UNet evaluation per step at any scale in that range, never a CFG pass.")
        else:
            guidance = (f"distilled from the first teacher's classifier-free guidance at scale {self.hparams.guidance_scale}, "
                        "without a guidance input: the one UNet evaluation per step is already guided; no CFG pass is "
                        "run and guidance_scale has no effect.")
        info = {"method": "progressive", "teacher": self.teacher_source, "student": type(self.student).__name__,
                "pipeline": type(pipe).__name__,
                "sampling": call_info(type(pipe.scheduler).__name__, defaults["default_num_inference_steps"],
                                      defaults["default_guidance_scale"], cfg_pass=False),
                "guidance": guidance, "guidance_distilled": defaults["guidance_distilled"],
                "w_conditioned": self.w_conditioned, "prediction_type": self.student_prediction_type}
        if self.w_conditioned:
            info["guidance_scale_range"] = [self.guidance_scale_min, self.guidance_scale_max]
        return write_export_info(out_dir, info)
