"""The teacher-student base of every distillation method: everything but the method's own loss."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from distill.data.latents import batch_size_of
from distill.families.base import trailing_sigmas
from distill.methods.base import DistillMethod, pipeline_images
from distill.models.conditioning import concat_conditions
from distill.models.teacher import Teacher
from distill.students import make_student


class TeacherStudentDistillation(DistillMethod):
    """A frozen teacher (its network and its ``family``: VAE, conditioning, noise schedule) and a student built
    from it (``make_student``). The base freezes the teacher, conditions through the family, keeps the frozen
    weights out of checkpoints, validates, builds the in-memory pipeline, generates and exports (pipeline folder,
    distill.json, model card). Every network call is ``family.denoise``.

    A method writes its ``loss``, its ``sampling_scheduler``, its intended ``num_inference_steps`` and what its
    export says about the guidance (``guidance_source``, ``export_info``); ``method_name`` names it in exports.
    """

    method_name: str = ""

    def __init__(
        self,
        teacher: Teacher,
        student: nn.Module | Callable[[nn.Module], nn.Module],
        optimizer: Callable,
        lr_scheduler: Callable | None = None,
        *,
        guidance_scale_min: float,
        guidance_scale_max: float,
        cache_prompts: bool = True,
        **speed,  # DistillMethod's training-speed switches (compile, frozen_dtype, ...)
    ):
        if guidance_scale_min > guidance_scale_max:
            raise ValueError(f"method.guidance_scale_min={guidance_scale_min} > method.guidance_scale_max={guidance_scale_max}")
        super().__init__(optimizer, lr_scheduler, **speed)
        self.teacher_source, self.teacher_load_options = teacher.source, teacher.load_options
        if teacher.family is None:
            raise ValueError(f"teacher {teacher.source!r} has no model family: load it with "
                             "distill.families.load_teacher (teacher._target_), which detects and attaches it")
        self.teacher_unet = teacher.denoiser.requires_grad_(False).eval()
        self.family = teacher.family.copy(cache_prompts=cache_prompts)  # this method's own prompt cache
        # the family's frozen parts, registered here under their old names: they move with the method, and the
        # checkpoint keys stay those of every earlier run
        self.vae, self.conditioner = self.family.vae, self.family.conditioner
        self.noise_scheduler_config = self.family.scheduler_config
        self.schedule = self.family.schedule  # what every loss noises and converts with
        self.student = make_student(student, teacher)
        if self.noise.preconditioning == "edm":
            self.student = self._edm_student(student)
        # LoRA adapters on the teacher's own network: with the adapters disabled the student is the teacher
        self.is_lora = self.student is self.teacher_unet
        self.w_dim = self.student.config.get("time_cond_proj_dim")  # None: no guidance-scale input
        self.guidance_scale_min, self.guidance_scale_max = guidance_scale_min, guidance_scale_max
        # FLUX.1-dev: the guidance scale is the network's input, not a CFG pass (the family's guidance_input)
        self.teacher_guidance_embedded = self.family.guidance_embedded(self.teacher_unet)
        self.student_guidance_embedded = self.family.guidance_embedded(self.student)
        # the training images' side, latent side and shift under a resolution shift (bind_resolution); None elsewhere
        self.resolution, self.latent_size, self.mu = None, None, None
        self.strict_loading = False  # frozen teacher parts are not stored in checkpoints

    def _edm_student(self, student) -> nn.Module:
        """The freshly initialised student as EDM's F (``method.noise.preconditioning=edm``), predicting what the
        teacher predicts; a student that starts from trained weights would start as another function."""
        from distill.models.precondition import EDMPreconditionedUNet2DConditionModel
        from distill.students.copies import fresh_student

        if getattr(student, "func", None) is not fresh_student:
            raise ValueError("method.noise.preconditioning=edm re-parametrises the network, so it applies to a freshly "
                             "initialised student (student=fresh); this one starts from trained weights, whose "
                             "function the preconditioning would change: set method.noise.preconditioning=none")
        return EDMPreconditionedUNet2DConditionModel.wrap(self.student, self.family.scheduler.config,
                                                          self.family.prediction_type, self.noise.sigma_data)

    # ------------------------------------------------------------------ resolution shift

    def bind_resolution(self, resolution: int | None) -> None:
        """Under a resolution shift (a ``use_dynamic_shifting`` flow scheduler: Flux's mu of the image's packed token
        count) the student is trained at one resolution, ``resolution`` (the training images' side): its latent side
        and mu are kept (``latent_size``, ``mu``), the flow grid is built at that mu (``trailing_flow_sigmas``) and
        the export samples at that size by default (the family's ``resolution_defaults``). Nothing without one."""
        if not getattr(self.schedule, "use_dynamic_shifting", False):
            return
        if not self.family.resolution_shift:
            raise ValueError(f"method={self.method_name} on {self.teacher_source!r}: its scheduler shifts the sigmas by "
                             "the image's resolution (use_dynamic_shifting), which the "
                             f"{type(self.family).__name__}'s pipeline does not reproduce here (Flux's does); set "
                             "use_dynamic_shifting=false with a fixed shift in the teacher's scheduler_config.json")
        factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        if resolution is None or resolution % factor:
            raise ValueError(f"method.resolution={resolution} on {self.teacher_source!r}, whose scheduler shifts the "
                             "sigmas by the image's resolution (use_dynamic_shifting): the student's time grid is built "
                             f"at the training images' resolution, a multiple of the VAE's factor {factor}; set "
                             f"method.resolution=${{data.resolution}} (conf/method/{self.method_name}.yaml does)")
        size = resolution // factor
        self.family.resolution_defaults(size, size)  # refuses a size the export cannot sample at by default
        self.resolution, self.latent_size, self.mu = resolution, size, self.family.shift_mu(size, size)

    def trailing_flow_sigmas(self, num_inference_steps: int) -> torch.Tensor:
        """(N + 1,) the sigmas a flow pipeline samples N steps with from the unshifted sigmas linspace(1, 1 / N, N),
        the terminal 0 appended: shifted by the scheduler's static shift (SD3, given them as ``sigmas``), or under a
        resolution shift by mu of the training latents (``FluxPipeline.__call__``'s own sigmas at that size)."""
        if self.latent_size is not None:
            return self.family.inference_sigmas(num_inference_steps, self.latent_size, self.latent_size)[0]
        return self.schedule.inference_sigmas(sigmas=trailing_sigmas(num_inference_steps))[0]

    def check_latent_size(self, x0: torch.Tensor, grid: str) -> None:
        """Under a resolution shift, latents of the size the ``grid``'s mu was built for (before any network runs)."""
        if self.latent_size is not None and tuple(x0.shape[-2:]) != (self.latent_size, self.latent_size):
            raise ValueError(f"the training latents are {tuple(x0.shape[-2:])}, but the {grid} is built at mu="
                             f"{self.mu:.4f} of method.resolution={self.resolution} ({self.latent_size}x"
                             f"{self.latent_size} latents): train on images of one resolution, that one (data."
                             "resolution), or set method.resolution to the data's")

    # ------------------------------------------------------------------ frozen teacher and checkpoints

    def train(self, mode: bool = True):
        super().train(mode)
        self.vae.eval()
        if self.teacher_unet is not self.student:  # a LoRA student's base weights take the student's mode
            self.teacher_unet.eval()
        return self

    @property
    def teacher_is_original(self) -> bool:
        """Whether ``teacher_unet`` is the loaded teacher (run in ``frozen_dtype``); a trained student acting as
        the teacher runs at the student's precision, as a consistency target does."""
        return True

    @property
    def teacher_reloads(self) -> bool:
        """Whether ``teacher_unet`` is the loaded teacher, rebuilt from its pipeline on resume and so left out of
        checkpoints; a method whose teacher becomes a trained network says otherwise."""
        return True

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        frozen = ("vae.", "conditioner.") + (("teacher_unet.",) if self.teacher_reloads else ())
        state = checkpoint["state_dict"]
        for key in [k for k in state if k.startswith(frozen)]:
            if not (self.is_lora and "lora" in key):
                del state[key]

    # ------------------------------------------------------------------ networks

    def frozen_student_copy(self) -> nn.Module:
        """A frozen copy of the student as it is now: a consistency target, the next progressive round's teacher."""
        return copy.deepcopy(self.student).requires_grad_(False)

    def frozen_networks(self) -> list[nn.Module]:
        return [] if self.is_lora else [self.teacher_unet]

    def encode(self, pixels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return self.family.encode(pixels, generator)

    def text_conditions(self, batch: dict, n: int, device: torch.device) -> tuple[dict, dict]:
        """The family's conditioning of the batch's captions and its null condition (that of CFG)."""
        cond = self.family.condition(batch)
        return cond, self.family.null_condition(n, device, like=cond)

    @property
    def teacher_carries_other_adapters(self) -> bool:
        """Whether ``teacher_unet`` carries adapters that are not the teacher's (a LoRA student's on the teacher's
        own network), switched off for its calls; a frozen copy of a LoRA student acting as a later teacher
        (progressive rounds) keeps its adapters: they are that teacher."""
        return self.teacher_unet is self.student

    @torch.no_grad()
    def teacher_forward(self, x: torch.Tensor, t: torch.Tensor, cond: dict, **extra) -> torch.Tensor:
        """The teacher's output at (x, t) under ``cond``, in float32; adapters on the teacher's network that are
        not the teacher's (``teacher_carries_other_adapters``) are off meanwhile."""
        from contextlib import nullcontext

        from distill.students.copies import adapters_disabled

        off = adapters_disabled(self.teacher_unet) if self.teacher_carries_other_adapters else nullcontext()
        with off, self.frozen_autocast(self.teacher_is_original):
            return self.family.denoise(self.teacher_unet, x, t, cond, **extra).float()

    def teacher_cond_uncond(self, x: torch.Tensor, t: torch.Tensor, cond: dict,
                            uncond: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's conditional and unconditional outputs at (x, t), from one batched pass (what ``cfg`` mixes)."""
        return self.teacher_forward(torch.cat([x, x]), torch.cat([t, t]), concat_conditions(cond, uncond)).chunk(2)

    # ------------------------------------------------------------------ objective

    def loss(self, batch: dict, generator: torch.Generator | None = None) -> torch.Tensor:
        """The method's training objective on ``batch``; randomness from ``generator`` (None: the global RNG)."""
        raise NotImplementedError

    def validation_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        # fixed noise, timesteps and guidance scales: the held-out loss is comparable across steps and runs
        loss = self.loss(batch, torch.Generator().manual_seed(1000 + batch_idx))
        self.log("val/loss", loss, prog_bar=True, batch_size=batch_size_of(batch), sync_dist=True)
        return loss

    # ------------------------------------------------------------------ sampling and export

    @property
    def num_inference_steps(self) -> int:
        """The step count the student is meant to sample with."""
        raise NotImplementedError

    def sampling_scheduler(self, name: str | None = None):
        """The scheduler the student samples with (``name`` None: the method's own)."""
        raise NotImplementedError

    def call_defaults(self) -> dict:
        """The intended call: ``num_inference_steps``; the configured guidance as the student's w input (a
        ``timestep_cond`` embedding or FLUX.1-dev's guidance embedding), or, for a student without one, guidance 1
        and no CFG pass, the guidance being distilled into it; under a resolution shift the size it was trained at
        (so that a default call samples at that mu); then the method's own entries."""
        takes_w = self.w_dim is not None or self.student_guidance_embedded
        defaults = {"default_num_inference_steps": self.num_inference_steps,
                    "default_guidance_scale": self.sampling["guidance_scale"] if takes_w else 1.0,
                    "guidance_distilled": not takes_w}
        if self.latent_size is not None:
            defaults.update(self.family.resolution_defaults(self.latent_size, self.latent_size))
        return {**defaults, **self.extra_call_defaults()}

    def extra_call_defaults(self) -> dict:
        """A method's own entries of the intended call (a flow student's sigma spacing, its trained resolution)."""
        return {}

    def pipeline(self, scheduler: str | None = None):
        """The student as an in-memory pipeline of the family with the export's call defaults (``call_defaults``),
        sampling with ``sampling_scheduler(scheduler)``."""
        return self.family.pipeline(self.student, self.sampling_scheduler(scheduler), **self.call_defaults())

    def generate(self, batch: dict, generator: torch.Generator, num_inference_steps: int | None = None,
                 guidance_scale: float | None = None, scheduler: str | None = None) -> torch.Tensor:
        return pipeline_images(self.pipeline(scheduler), batch["caption"], generator, num_inference_steps, guidance_scale)

    def guidance_source(self) -> str:
        """Which classifier-free guidance the student learned, e.g. "the teacher's classifier-free guidance at
        scales drawn from [2.0, 6.0]"."""
        raise NotImplementedError

    def guidance_note(self) -> str:
        """How the student takes guidance, for distill.json and the model card."""
        if self.student_guidance_embedded:
            return (f"distilled from {self.guidance_source()}, taken as an input (guidance_scale through the "
                    "transformer's guidance embedding, as the pipeline passes it): one evaluation per step, never a "
                    "CFG pass.")
        if self.w_dim is not None:
            return (f"distilled from {self.guidance_source()}, taken as an input (the embedding of guidance_scale - 1 "
                    "through timestep_cond): one UNet evaluation per step at any scale in that range, never a CFG pass.")
        return (f"distilled from {self.guidance_source()}, without a guidance input: the one UNet evaluation per step is "
                "already guided; no CFG pass is run and guidance_scale has no effect.")

    def export_info(self) -> dict:
        """The method's own entries of distill.json (a method adds its own to these): under a resolution shift the
        training resolution, latent side and mu, at which the export samples by default."""
        if self.mu is None:
            return {}
        return {"resolution": self.resolution, "latent_size": self.latent_size, "mu": self.mu}

    def save_pipeline(self, pipe, out_dir: Path) -> str:
        """Save ``pipe`` to ``out_dir`` with the teacher's safety checker and feature extractor, where it has them;
        returns the student's description. A LoRA student is saved also alone (lora/pytorch_lora_weights.safetensors,
        for ``pipe.load_lora_weights`` on the teacher, in the family's format: ``ModelFamily.lora_weights``); the full
        pipeline holds a copy with the adapters merged into the weights and removed."""
        from distill.models.teacher import load_safety_components

        pipe.register_modules(**load_safety_components(self.teacher_source, **self.teacher_load_options))
        student = type(self.student).__name__
        if self.is_lora:
            pipe.save_lora_weights(out_dir / "lora", safe_serialization=True, **self.family.lora_weights(self.student))
            merged = copy.deepcopy(self.student)
            merged.fuse_lora()
            merged.unload_lora()
            self.family.set_denoiser(pipe, merged)
            student += " with its LoRA adapters merged (adapters alone in lora/)"
        pipe.save_pretrained(out_dir)
        return student

    def cfg_pass(self, defaults: dict) -> bool:
        """Whether the intended call runs a second (unconditional) UNet pass a step, as diffusers decides it: a
        student without a guidance input (w embedding) whose guidance is not distilled, at a scale above 1."""
        return (self.w_dim is None and not self.student_guidance_embedded and not defaults["guidance_distilled"]
                and defaults["default_guidance_scale"] > 1)

    def export(self, out_dir: str | Path) -> Path:
        """A distill text-to-image pipeline folder (``pipeline``, its call defaults registered) with distill.json and
        a model card stating the intended call and how the guidance was distilled."""
        from distill.inference.model_card import call_info, write_export_info

        out_dir = Path(out_dir)
        pipe = self.pipeline()
        student = self.save_pipeline(pipe, out_dir)
        defaults = self.call_defaults()
        checker = getattr(pipe, "safety_checker", None)  # SDXL pipelines have none
        info = {"method": self.method_name, "teacher": self.teacher_source, "student": student,
                "pipeline": type(pipe).__name__,
                "sampling": call_info(self.sampling["name"], type(pipe.scheduler).__name__,
                                      defaults["default_num_inference_steps"],
                                      defaults["default_guidance_scale"], cfg_pass=self.cfg_pass(defaults)),
                "guidance": self.guidance_note(), "guidance_distilled": defaults["guidance_distilled"],
                "safety_checker": type(checker).__name__ if checker is not None else None,
                **self.export_info()}
        return write_export_info(out_dir, info)
