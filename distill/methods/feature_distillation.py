"""Output and feature distillation of a smaller denoiser from its teacher (BK-SDM, Kim et al. 2023, eq. 1-3).

A compressed student (pruned, low rank, or any UNet with the teacher's block structure) recovers the teacher's
quality at the teacher's own step count with three terms at one noise level per example:

* the task loss: the denoising regression of the student on the data, ``|| target - s(x_t, c, t) ||^2``;
* output distillation: ``|| T(x_t, c, t) - s(x_t, c, t) ||^2``, the teacher's prediction as the target;
* feature distillation: ``sum_l || T_l - s_l ||^2`` over the outputs of every down block and every up block
  (the stages BK-SDM's code matches, whose students drop the mid block; ``match_mid_block`` adds it for students
  that keep it, as pruned and low-rank ones do), each a mean squared error. Where a pruned student's block output is narrower than the
  teacher's, a learned 1x1 convolution maps it to the teacher's width first (FitNets' regressor, Romero et al.
  2015); the regressors train with the student and are not part of the export.

An addition to BK-SDM, which trains on captions only: the condition is dropped to the empty prompt with
probability ``cond_dropout`` for teacher and student alike,
so that the student learns the unconditional branch too and samples with classifier-free guidance like the
teacher, at the teacher's step counts (``scheduler``, ``scheduler.num_inference_steps``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from distill.data.latents import batch_size_of
from distill.methods import METHODS
from distill.methods.distillation import TeacherStudentDistillation
from distill.models.teacher import Teacher


class _Recorder:
    """Forward hooks keeping each block's output (a down block's hidden states, not its skip tensors)."""

    def __init__(self, blocks: dict[str, nn.Module]):
        self.outputs: dict[str, torch.Tensor] = {}
        self.handles = [b.register_forward_hook(self._hook(name)) for name, b in blocks.items()]

    def _hook(self, name: str):
        def hook(module, args, output):
            self.outputs[name] = output[0] if isinstance(output, tuple) else output
        return hook

    def pop(self) -> dict[str, torch.Tensor]:
        out, self.outputs = self.outputs, {}
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@METHODS.register("feature_distillation")
class FeatureDistillation(TeacherStudentDistillation):
    method_name = "feature_distillation"

    def __init__(
        self,
        teacher: Teacher,
        student: nn.Module | Callable[[nn.Module], nn.Module],
        optimizer: Callable,
        lr_scheduler: Callable | None = None,
        task_weight: float = 1.0,
        output_weight: float = 1.0,
        feature_weight: float = 1.0,
        cond_dropout: float = 0.1,
        match_mid_block: bool = False,
        sampling: dict | None = None,
        **speed,  # DistillMethod's training-speed switches (compile, frozen_dtype, ...)
    ):
        self.check_settings(task_weight, output_weight, feature_weight, cond_dropout)
        super().__init__(teacher, student, optimizer, lr_scheduler, guidance_scale_min=1.0, guidance_scale_max=1.0,
                         **speed)
        self.save_hyperparameters(ignore=["teacher", "student", "optimizer", "lr_scheduler"])
        if self.is_lora:
            raise ValueError("method=feature_distillation trains a separate smaller student; a LoRA student on the "
                             "teacher's own UNet has nothing to compress: use student=pruned or lowrank")
        if self.w_dim is not None:
            raise ValueError(f"student.time_cond_proj_dim={self.w_dim}: method=feature_distillation trains the "
                             "teacher's conditional and unconditional predictions and samples with classifier-free "
                             "guidance, which diffusers turns off for a UNet with a guidance input; set "
                             "student.time_cond_proj_dim=null")
        self.task_weight, self.output_weight, self.feature_weight = task_weight, output_weight, feature_weight
        self.cond_dropout = cond_dropout
        self.sampling = dict(sampling or {"name": "ddim", "guidance_scale": 3.0, "num_inference_steps": 25})
        self.num_train_timesteps = self.schedule.num_train_timesteps
        self.regressors = nn.ModuleDict()
        if feature_weight > 0:
            # the blocks the family names (a UNet's down and up blocks, BK-SDM's stages)
            self._teacher_rec = _Recorder(self.family.feature_blocks(self.teacher_unet, match_mid_block))
            self._student_rec = _Recorder(self.family.feature_blocks(self.student, match_mid_block))
            self._build_regressors()

    @torch.no_grad()
    def _build_regressors(self) -> None:
        """One probe forward of both networks: a 1x1 conv for every block whose output width differs."""
        x, t, cond = self.family.example_inputs(self.teacher_unet)  # the student takes the teacher's inputs
        self.family.denoise(self.teacher_unet, x, t, cond)
        self.family.denoise(self.student, x, t, cond)
        teacher, student = self._teacher_rec.pop(), self._student_rec.pop()
        for name, f_t in teacher.items():
            f_s = student[name]
            if f_s.shape[2:] != f_t.shape[2:]:
                raise ValueError(f"student block {name} outputs {tuple(f_s.shape[1:])}, the teacher's "
                                 f"{tuple(f_t.shape[1:])}: spatial sizes must match for feature distillation; set "
                                 "method.feature_weight=0")
            if f_s.shape[1] != f_t.shape[1]:
                conv = nn.Conv2d(f_s.shape[1], f_t.shape[1], 1)
                self.regressors[name.replace(".", "_")] = conv

    # ------------------------------------------------------------------ objective

    def loss_terms(self, batch: dict, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """The three terms (unweighted) and their weighted sum ``loss`` at one noise level per example."""
        batch = self.paired_batch(batch)  # method.noise.antithetic: rows in pairs sharing all but the noise's sign
        x0 = self.latents(batch, generator)
        n = x0.shape[0]
        drop = self.paired(torch.rand(n, generator=generator) < self.cond_dropout) if self.cond_dropout > 0 else None
        cond = self.family.condition(batch, drop)
        bins, iw = self.draw_time_bins(n, self.schedule.ve_sigmas.float(), generator)  # one bin per timestep
        t = bins.to(x0.device)
        eps = self.draw_noise(x0, generator)
        x_t = self.schedule.add_noise(x0, eps, t)
        teacher_out = self.teacher_forward(x_t, t, cond) if self.output_weight > 0 or self.feature_weight > 0 else None
        teacher_feats = self._teacher_rec.pop() if self.feature_weight > 0 else {}
        pred = self.family.denoise(self.student, x_t, t, cond).float()
        def mse(a, b):  # per example: the importance weights (method.noise) apply per example
            return (a.float() - b.float()).pow(2).flatten(1).mean(1)

        terms = {"task": mse(pred, self.schedule.prediction_target(x0, eps, t))}
        if teacher_out is not None:
            terms["output"] = mse(pred, teacher_out)
        if self.feature_weight > 0:
            student_feats = self._student_rec.pop()
            feats = []
            for name, f_t in teacher_feats.items():
                f_s = student_feats[name].float()
                key = name.replace(".", "_")
                if key in self.regressors:
                    f_s = self.regressors[key](f_s)
                feats.append(mse(f_s, f_t))
            terms["feature"] = torch.stack(feats).sum(0)
        weights = {"task": self.task_weight, "output": self.output_weight, "feature": self.feature_weight}
        per_example = sum(weights[k] * v for k, v in terms.items() if weights[k] > 0)
        if self.training:
            self.record_time_losses(bins, per_example)
        terms = {k: self.weighted_mean(v, iw) for k, v in terms.items()}
        terms["loss"] = self.weighted_mean(per_example, iw)
        return terms

    def loss(self, batch: dict, generator: torch.Generator | None = None) -> torch.Tensor:
        terms = self.loss_terms(batch, generator)
        if self._trainer is not None and self.training:
            self.log_dict({f"train/{k}_loss": v.detach() for k, v in terms.items() if k != "loss"},
                          batch_size=batch_size_of(batch))
        return terms["loss"]

    def trainable_parameters(self):
        return [*super().trainable_parameters(), *self.regressors.parameters()]

    # ------------------------------------------------------------------ sampling and export

    @property
    def num_inference_steps(self) -> int:
        return int(self.sampling.get("num_inference_steps") or 25)

    def sampling_scheduler(self, name: str | None = None):
        from distill.inference.schedulers import make_scheduler, scheduler_options

        name = name or self.sampling["name"]
        options = dict(self.sampling.get("options") or {}) if name == self.sampling["name"] else scheduler_options(name)
        return make_scheduler(name, self.noise_scheduler_config, **options)

    def call_defaults(self) -> dict:
        """Sampled as the teacher is: its step count and classifier-free guidance (two branches per step)."""
        return {"default_num_inference_steps": self.num_inference_steps,
                "default_guidance_scale": self.sampling["guidance_scale"], "guidance_distilled": False}

    def guidance_source(self) -> str:
        return "none: the student learns the teacher's conditional and unconditional predictions"

    def guidance_note(self) -> str:
        return (f"classifier-free guidance at sampling time, as the teacher (trained with condition dropout "
                f"{self.cond_dropout}): guidance_scale={self.sampling['guidance_scale']} runs a conditional and an "
                "unconditional branch per step.")

    def export_info(self) -> dict:
        return {"prediction_type": self.schedule.prediction_type, "task_weight": self.task_weight,
                "output_weight": self.output_weight, "feature_weight": self.feature_weight,
                "cond_dropout": self.cond_dropout}

    @staticmethod
    def check_settings(task_weight: float, output_weight: float, feature_weight: float, cond_dropout: float) -> None:
        """Loss weights >= 0, not all 0; a condition-dropout rate in [0, 1) (the constructor's and the config's check)."""
        for key, value in (("task_weight", task_weight), ("output_weight", output_weight),
                           ("feature_weight", feature_weight)):
            if not value >= 0:
                raise ValueError(f"method.{key}={value} must be >= 0")
        if task_weight + output_weight + feature_weight <= 0:
            raise ValueError("method.task_weight, output_weight and feature_weight are all 0: nothing to train; "
                             "set at least one > 0")
        if not 0 <= cond_dropout < 1:
            raise ValueError(f"method.cond_dropout={cond_dropout} must be in [0, 1)")

    @classmethod
    def check_config(cls, cfg) -> None:
        """The constructor's checks of the settings, before anything is built."""
        method = cfg.method
        cls.check_settings(method.task_weight, method.output_weight, method.feature_weight, method.cond_dropout)
