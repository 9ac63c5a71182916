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

On a flow-matching teacher (SD3: ``FlowMatchingSchedule``, x_t = (1 - t) x0 + t eps) the noise level is drawn as SD3
trains (``time_sampling``: logit-normal by default, Esser et al. 2024 sec. 3.1, shifted by the scheduler's shift), the
task target is the velocity eps - x0, and the student samples with flow Euler. Which blocks are matched, which element
of a block's output is its feature (a joint transformer block's image tokens (N, T, D), not its text stream), which
teacher block a shallower student's block stands for (evenly spaced, ``evenly_spaced_blocks``) and the regressor of a
narrower one (a linear map on the token width) are the family's: ``feature_blocks``, ``block_feature``,
``feature_block_pairs``, ``feature_regressor``.

On a teacher whose scheduler shifts by resolution (Flux: ``use_dynamic_shifting``) the draw is shifted by mu of the
training images' resolution (``resolution``, ``bind_resolution``), and the export samples at that resolution by
default, so at the same mu. Where the pipeline passes the guidance scale to the network (FLUX.1-dev's guidance
embedding) teacher and student are both called at the export's default scale, as the pipeline calls them; Flux's
pipeline runs no CFG pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from distill.data.latents import batch_size_of
from distill.diffusion import FlowMatchingSchedule, flow
from distill.inference.schedulers import check_scheduler_kind
from distill.methods import METHODS
from distill.methods.checks import check_resolution
from distill.methods.distillation import TeacherStudentDistillation
from distill.models.teacher import Teacher


class _Recorder:
    """Forward hooks keeping each block's feature, the element of its output that ``feature_of`` (the family's
    ``block_feature``) picks: a down block's hidden states, not its skip tensors; a joint transformer block's image
    tokens, not its text stream."""

    def __init__(self, blocks: dict[str, nn.Module], feature_of: Callable):
        self.outputs: dict[str, torch.Tensor] = {}
        self.feature_of = feature_of
        self.handles = [b.register_forward_hook(self._hook(name)) for name, b in blocks.items()]

    def _hook(self, name: str):
        def hook(module, args, output):
            self.outputs[name] = self.feature_of(output)
        return hook

    def pop(self) -> dict[str, torch.Tensor]:
        out, self.outputs = self.outputs, {}
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@METHODS.register("feature_distillation", choices={"time_sampling": flow.TIME_SAMPLINGS})
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
        time_sampling: str = "logit_normal",  # on a flow-matching teacher: SD3's training draw of t
        logit_mean: float = flow.LOGIT_MEAN,
        logit_std: float = flow.LOGIT_STD,
        mode_scale: float = flow.MODE_SCALE,
        # the training images' side in pixels (conf/method/feature_distillation.yaml: data.resolution); read only where
        # the teacher's scheduler shifts by resolution (use_dynamic_shifting: Flux), whose t draw is shifted by its mu
        resolution: int | None = None,
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
        self.flow = isinstance(self.schedule, FlowMatchingSchedule)
        if self.flow:
            check_flow_settings(self.noise, time_sampling, self.teacher_source)
            self.bind_resolution(resolution)  # under a resolution shift (Flux): t drawn at the training images' mu
        self.time_sampling, self.logit_mean, self.logit_std, self.mode_scale = (time_sampling, logit_mean, logit_std,
                                                                                 mode_scale)
        self.sampling = dict(sampling or self.default_sampling())
        check_scheduler_kind(self.sampling["name"], self.noise_scheduler_config)  # before any sample grid or export
        self.num_train_timesteps = self.schedule.num_train_timesteps
        self.regressors = nn.ModuleDict()
        if feature_weight > 0:
            # student block -> teacher block, as the family pairs them (a UNet's down and up blocks by name, BK-SDM's
            # stages; a transformer's blocks by index, evenly spaced for a shallower student)
            self.feature_pairs = self.family.feature_block_pairs(self.teacher_unet, self.student, match_mid_block)
            teacher_blocks = self.family.feature_blocks(self.teacher_unet, match_mid_block)
            student_blocks = self.family.feature_blocks(self.student, match_mid_block)
            self._teacher_rec = _Recorder({t: teacher_blocks[t] for t in self.feature_pairs.values()},
                                          self.family.block_feature)
            self._student_rec = _Recorder({s: student_blocks[s] for s in self.feature_pairs},
                                          self.family.block_feature)
            self._build_regressors()

    def default_sampling(self) -> dict:
        """Without a scheduler config, sampled as the teacher is: DDIM 25 steps at guidance 3 on a VP teacher; flow
        Euler on a flow one, at the steps and guidance its pipeline's call defaults to (a distill export's registered
        defaults, else those of the family's stock pipeline class: StableDiffusion3Pipeline's 28 steps at 7)."""
        if not self.flow:
            return {"name": "ddim", "guidance_scale": 3.0, "num_inference_steps": 25}
        import inspect

        from distill.models.teacher import pipeline_configs

        index = pipeline_configs(self.teacher_source, self.teacher_load_options.get("revision"))["pipeline"]
        stock = {}
        for cls in self.family.pipeline_class.__mro__:  # the first __call__ with defaults (distill's mixin has none)
            params = inspect.signature(cls.__call__).parameters if "__call__" in vars(cls) else {}
            if getattr(params.get("guidance_scale"), "default", None) not in (None, inspect.Parameter.empty):
                stock = {k: params[k].default for k in ("guidance_scale", "num_inference_steps")}
                break
        return {"name": "flow_euler",
                "guidance_scale": index.get("default_guidance_scale", stock.get("guidance_scale", 1.0)),
                "num_inference_steps": index.get("default_num_inference_steps", stock.get("num_inference_steps", 28))}

    @torch.no_grad()
    def _build_regressors(self) -> None:
        """One probe forward of both networks: a regressor (the family's: a 1x1 conv on a UNet's channels, a linear
        map on a transformer's token width) for every student block whose feature is narrower or wider."""
        x, t, cond = self.family.example_inputs(self.teacher_unet)  # the student takes the teacher's inputs
        self.family.denoise(self.teacher_unet, x, t, cond)
        self.family.denoise(self.student, x, t, cond)
        teacher, student = self._teacher_rec.pop(), self._student_rec.pop()
        d = self.family.feature_width_dim
        for name, teacher_name in self.feature_pairs.items():
            f_s, f_t = student[name], teacher[teacher_name]
            rest_s, rest_t = list(f_s.shape[1:]), list(f_t.shape[1:])
            width_s, width_t = rest_s.pop(d if d < 0 else d - 1), rest_t.pop(d if d < 0 else d - 1)
            if rest_s != rest_t:
                raise ValueError(f"student block {name} outputs {tuple(f_s.shape[1:])}, teacher block {teacher_name} "
                                 f"{tuple(f_t.shape[1:])}: all but the width (axis {d}) must match for feature "
                                 "distillation (the same latent size, patch size and token count); set "
                                 "method.feature_weight=0")
            if width_s != width_t:
                self.regressors[name.replace(".", "_")] = self.family.feature_regressor(width_s, width_t)

    def draw_times(self, n: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(t, importance weights) for ``n`` examples: on a flow teacher SD3's training draw (``time_sampling``;
        Esser et al. 2024, sec. 3.1) shifted as its scheduler shifts its sigmas, by the static shift (SD3) or by mu of
        the training images' resolution (Flux: e^mu / (e^mu + 1 / t - 1)), antithetic partners sharing it,
        unweighted; on a VP teacher one integer timestep bin each (``method.noise``)."""
        if self.flow:
            u = flow.sample_flow_times(self.distinct_rows(n), self.time_sampling, self.logit_mean, self.logit_std,
                                       self.mode_scale, generator=generator)
            t = (self.schedule.shift_times(u) if self.mu is None
                 else flow.time_shift(u, self.mu, 1.0, self.schedule.time_shift_type))
            return self.paired(t, n), None
        return self.draw_time_bins(n, self.schedule.ve_sigmas.float(), generator)

    # ------------------------------------------------------------------ objective

    def loss_terms(self, batch: dict, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """The three terms (unweighted) and their weighted sum ``loss`` at one noise level per example."""
        batch = self.paired_batch(batch)  # method.noise.antithetic: rows in pairs sharing all but the noise's sign
        x0 = self.latents(batch, generator)
        self.check_latent_size(x0, "training time distribution")
        n = x0.shape[0]
        drop = self.paired(torch.rand(n, generator=generator) < self.cond_dropout) if self.cond_dropout > 0 else None
        cond = self.family.condition(batch, drop)
        t, iw = self.draw_times(n, generator)
        t = t.to(x0.device)
        eps = self.draw_noise(x0, generator)
        x_t = self.schedule.add_noise(x0, eps, t)
        extra = self.guidance_inputs(n, x0.device)
        teacher_out = (self.teacher_forward(x_t, t, cond, **extra) if self.output_weight > 0 or self.feature_weight > 0
                       else None)
        teacher_feats = self._teacher_rec.pop() if self.feature_weight > 0 else {}
        pred = self.family.denoise(self.student, x_t, t, cond, **extra).float()
        def mse(a, b):  # per example: the importance weights (method.noise) apply per example
            return (a.float() - b.float()).pow(2).flatten(1).mean(1)

        terms = {"task": mse(pred, self.schedule.prediction_target(x0, eps, t))}
        if teacher_out is not None:
            terms["output"] = mse(pred, teacher_out)
        if self.feature_weight > 0:
            student_feats = self._student_rec.pop()
            feats = []
            for name, teacher_name in self.feature_pairs.items():
                f_s = student_feats[name].float()
                key = name.replace(".", "_")
                if key in self.regressors:
                    f_s = self.regressors[key](f_s)
                feats.append(mse(f_s, teacher_feats[teacher_name]))
            terms["feature"] = torch.stack(feats).sum(0)
        weights = {"task": self.task_weight, "output": self.output_weight, "feature": self.feature_weight}
        per_example = sum(weights[k] * v for k, v in terms.items() if weights[k] > 0)
        if self.training and not self.flow:
            self.record_time_losses(t, per_example)  # the timestep bins of method.noise's adaptive proposal
        terms = {k: self.weighted_mean(v, iw) for k, v in terms.items()}
        terms["loss"] = self.weighted_mean(per_example, iw)
        return terms

    def guidance_inputs(self, n: int, device: torch.device) -> dict:
        """The networks' guidance input where the family's pipeline passes the guidance scale to the network (FLUX.1-
        dev's embedding, ``guidance_input``): teacher and student both at the export's default scale, the one its
        pipeline calls the student with; none elsewhere (classifier-free guidance is learnt through cond_dropout)."""
        return self.family.guidance_input(torch.full((n,), float(self.sampling["guidance_scale"]), device=device))

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
        """Sampled as the teacher is: its step count and its guidance (classifier-free, two branches per step; FLUX.1-
        dev's through its embedding), under a resolution shift at the training size (the base's)."""
        return {**super().call_defaults(), "default_guidance_scale": self.sampling["guidance_scale"],
                "guidance_distilled": False}

    def cfg_pass(self, defaults: dict) -> bool:
        """A CFG pass only where the family's pipeline runs one for a scale above 1 (not Flux's)."""
        return self.family.classifier_free_guidance and super().cfg_pass(defaults)

    def guidance_source(self) -> str:
        if not self.family.classifier_free_guidance:
            return "none: the student learns the teacher's predictions, both called as the teacher's pipeline calls it"
        return "none: the student learns the teacher's conditional and unconditional predictions"

    def guidance_note(self) -> str:
        scale = self.sampling["guidance_scale"]
        if self.teacher_guidance_embedded:
            return (f"as the teacher's pipeline: guidance_scale={scale} through the transformer's guidance embedding, "
                    "the scale teacher and student were both called at in training; one pass a step, no CFG pass.")
        if not self.family.classifier_free_guidance:
            return "as the teacher's pipeline: one unguided pass a step (no guidance input, no CFG pass)."
        return (f"classifier-free guidance at sampling time, as the teacher (trained with condition dropout "
                f"{self.cond_dropout}): guidance_scale={scale} runs a conditional and an "
                "unconditional branch per step.")

    def export_info(self) -> dict:
        info = {**super().export_info(), "prediction_type": self.schedule.prediction_type, "task_weight": self.task_weight,
                "output_weight": self.output_weight, "feature_weight": self.feature_weight,
                "cond_dropout": self.cond_dropout}
        if self.flow:  # under a resolution shift the base records its mu instead of a static shift
            info["time_sampling"] = self.time_sampling
            if self.mu is None:
                info["shift"] = self.schedule.shift
        if self.teacher_guidance_embedded:
            info["embedded_guidance"] = self.sampling["guidance_scale"]
        if self.feature_weight > 0 and any(s != t for s, t in self.feature_pairs.items()):
            info["feature_pairs"] = dict(self.feature_pairs)  # student block -> teacher block
        return info

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
        """The constructor's checks of the settings, before anything is built; on a local flow-matching teacher also
        its time draw and a flow sampler (a hub teacher: when it loads, before any step)."""
        import json
        from pathlib import Path

        from distill.models.teacher import is_flow_matching

        method = cfg.method
        cls.check_settings(method.task_weight, method.output_weight, method.feature_weight, method.cond_dropout)
        check_resolution(cfg)
        folder = (cfg.get("teacher") or {}).get("pretrained_model_name_or_path")
        config_file = Path(str(folder)) / "scheduler" / "scheduler_config.json" if folder is not None else None
        if config_file is None or not config_file.is_file():
            return
        config = json.loads(config_file.read_text())
        if is_flow_matching(config):
            check_flow_settings(method.noise, method.time_sampling, str(folder))
        check_scheduler_kind(getattr(cfg.scheduler.name, "value", cfg.scheduler.name), config)  # the choice's name


def check_flow_settings(noise, time_sampling: str, teacher: str) -> None:
    """What feature distillation on a flow-matching teacher cannot do: ``method.noise``'s VP timestep-bin proposals
    and stratification (t is drawn by ``method.time_sampling``)."""
    if noise.timesteps != "default" or noise.stratified:
        raise ValueError(f"method.noise.timesteps={noise.timesteps!r} / stratified={noise.stratified} on the "
                         f"flow-matching teacher {teacher!r}: they draw discrete VP timestep bins; a flow teacher's t "
                         "is drawn by method.time_sampling: leave method.noise.timesteps=default, stratified=false")
    if time_sampling not in flow.TIME_SAMPLINGS:
        raise ValueError(f"method.time_sampling={time_sampling!r}; use one of {list(flow.TIME_SAMPLINGS)}")
