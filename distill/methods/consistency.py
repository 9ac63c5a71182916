"""Latent consistency distillation (Luo et al. 2023, "Latent Consistency Models", Algorithm 1)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from distill.diffusion import add_noise, alpha_sigma, to_x0_eps
from distill.diffusion.consistency import (
    boundary_scalings,
    check_consistency_loss,
    consistency_loss,
    consistency_output,
    ddim_step,
    ddim_timesteps,
    guidance_scale_embedding,
)
from distill.methods.base import (
    DistillMethod,
    encode_latents,
    pipeline_images,
    text_to_image_pipeline,
)
from distill.models.conditioning import TextConditioner
from distill.models.moe import no_routing_record
from distill.models.students import make_student
from distill.models.teacher import Teacher
from distill.utils.optim import has_gradients

FROZEN_PREFIXES = ("teacher_unet.", "vae.", "conditioner.text_encoder.")


class LatentConsistencyDistillation(DistillMethod):
    """A student f(x_t, t, c, w) = c_skip x_t + c_out x0_student learns to map every point of the teacher's
    guided PF-ODE to the same x0: f_student(x_{t_n}) ~ f_target(x_{t_{n-k}}), where x_{t_{n-k}} is one
    skipping DDIM step of the classifier-free-guided teacher from x_{t_n}."""

    def __init__(
        self,
        teacher: Teacher,
        student: nn.Module | Callable[[nn.Module], nn.Module],
        optimizer: Callable,
        lr_scheduler: Callable | None = None,
        num_ddim_timesteps: int = 50,
        guidance_scale_min: float = 2.0,
        guidance_scale_max: float = 6.0,
        ema_decay: float = 0.95,
        loss_type: str = "pseudo_huber",
        huber_c: float | None = 0.001,
        timestep_scaling: float = 10.0,
        sigma_data: float = 0.5,
        cache_prompts: bool = True,
        sampling: dict | None = None,
    ):
        super().__init__(optimizer, lr_scheduler)
        if guidance_scale_min > guidance_scale_max:
            raise ValueError(f"method.guidance_scale_min={guidance_scale_min} > method.guidance_scale_max={guidance_scale_max}")
        check_consistency_loss(loss_type, huber_c)
        self.save_hyperparameters(ignore=["teacher", "student", "optimizer", "lr_scheduler"])
        self.teacher_source = teacher.source
        self.teacher_unet = teacher.unet.requires_grad_(False).eval()
        self.vae = teacher.vae.requires_grad_(False).eval()
        self.conditioner = TextConditioner(teacher.text_encoder, teacher.tokenizer, cache=cache_prompts)
        self.noise_scheduler_config = dict(teacher.scheduler.config)
        self.prediction_type = teacher.prediction_type
        self.student = make_student(student, teacher)
        self.is_lora = self.student is self.teacher_unet
        if self.is_lora and ema_decay > 0:
            raise ValueError("a LoRA student trains against a stop-gradient target; set method.ema_decay=0")
        # ema_decay = 0: the target is the student itself under stop-gradient (no copy kept).
        self.target = copy.deepcopy(self.student).requires_grad_(False) if ema_decay > 0 else None
        self.ema_decay = ema_decay
        self.w_dim = self.student.config.time_cond_proj_dim
        self.num_ddim_timesteps, self.guidance_scale_min, self.guidance_scale_max = (
            num_ddim_timesteps, guidance_scale_min, guidance_scale_max)
        self.loss_type, self.huber_c = loss_type, huber_c
        self.timestep_scaling, self.sigma_data = timestep_scaling, sigma_data
        self.sampling = dict(sampling or {"name": "lcm", "num_inference_steps": 4, "guidance_scale": 3.0})
        T = teacher.scheduler.config.num_train_timesteps
        self.skip = T // num_ddim_timesteps
        self.register_buffer("solver_timesteps", ddim_timesteps(T, num_ddim_timesteps), persistent=False)
        self.register_buffer("alphas_cumprod", teacher.scheduler.alphas_cumprod.clone().float(), persistent=False)
        self.strict_loading = False  # frozen teacher parts are not stored in checkpoints

    # ------------------------------------------------------------------ modes and checkpoints

    def train(self, mode: bool = True):
        super().train(mode)
        self.vae.eval()
        if not self.is_lora:
            self.teacher_unet.eval()
        if self.target is not None:
            self.target.eval()
        return self

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint["state_dict"]
        for key in [k for k in state if k.startswith(FROZEN_PREFIXES)]:
            if not (self.is_lora and "lora" in key):
                del state[key]

    # ------------------------------------------------------------------ networks

    def _w_embedding(self, w: torch.Tensor) -> dict:
        return {} if self.w_dim is None else {"timestep_cond": guidance_scale_embedding(w, self.w_dim).to(w.device)}

    def _teacher(self, x_t, t, cond, uncond, w):
        """Guided teacher (x0, eps) at (x_t, t): conditional and unconditional passes in one batch."""
        alpha, sigma = alpha_sigma(self.alphas_cumprod, t, x_t.ndim)
        if self.is_lora:
            self.student.disable_adapters()
        try:
            out = self.teacher_unet(torch.cat([x_t, x_t]), torch.cat([t, t]),
                                    encoder_hidden_states=torch.cat([cond, uncond])).sample
        finally:
            if self.is_lora:
                self.student.enable_adapters()
        out_c, out_u = out.chunk(2)
        x0_c, eps_c = to_x0_eps(self.prediction_type, out_c, x_t, alpha, sigma)
        x0_u, eps_u = to_x0_eps(self.prediction_type, out_u, x_t, alpha, sigma)
        w = w.reshape(-1, 1, 1, 1)
        return x0_c + w * (x0_c - x0_u), eps_c + w * (eps_c - eps_u)

    def _consistency_fn(self, net, x_t, t, cond, w_kwargs):
        alpha, sigma = alpha_sigma(self.alphas_cumprod, t, x_t.ndim)
        out = net(x_t, t, encoder_hidden_states=cond, **w_kwargs).sample
        x0, _ = to_x0_eps(self.prediction_type, out, x_t, alpha, sigma)
        c_skip, c_out = boundary_scalings(t, self.sigma_data, self.timestep_scaling)
        return consistency_output(x_t, x0, c_skip, c_out)

    def encode(self, pixels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return encode_latents(self.vae, pixels, generator)

    # ------------------------------------------------------------------ objective

    def loss(self, batch: dict, generator: torch.Generator | None = None) -> torch.Tensor:
        x0 = self.encode(batch["pixel_values"], generator)  # (N, 4, h, w)
        n, device = x0.shape[0], x0.device
        index = torch.randint(0, self.num_ddim_timesteps, (n,), generator=generator).to(device)
        t = self.solver_timesteps[index]  # t_n
        t_prev = (t - self.skip).clamp(min=0)  # t_{n-k}
        w = (self.guidance_scale_min - 1) + (self.guidance_scale_max - self.guidance_scale_min) * torch.rand(n, generator=generator)
        w = w.to(device)  # LCM's w = cfg scale - 1
        w_kwargs = self._w_embedding(w)
        cond = self.conditioner(batch)["encoder_hidden_states"]
        uncond = self.conditioner.null(n, device)["encoder_hidden_states"]

        eps = torch.randn(x0.shape, generator=generator).to(x0)
        alpha, sigma = alpha_sigma(self.alphas_cumprod, t, x0.ndim)
        x_t = add_noise(x0, eps, alpha, sigma)
        f_student = self._consistency_fn(self.student, x_t, t, cond, w_kwargs)
        with torch.no_grad():
            x0_w, eps_w = self._teacher(x_t, t, cond, uncond, w)
            alpha_prev, sigma_prev = alpha_sigma(self.alphas_cumprod, t_prev, x0.ndim)
            x_prev = ddim_step(x0_w, eps_w, alpha_prev, sigma_prev)
            target = self.target if self.target is not None else self.student
            with no_routing_record(target):  # the student's own routing record is the one its loss trains
                f_target = self._consistency_fn(target, x_prev, t_prev, cond, w_kwargs)
        return consistency_loss(f_student, f_target, self.loss_type, self.huber_c)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["pixel_values"].shape[0])
        return self.add_student_aux_loss(loss, batch["pixel_values"].shape[0])

    def optimizer_step(self, *args, **kwargs) -> None:
        """The optimizer step, then the target's EMA update: once per optimizer step (not per micro-batch under
        gradient accumulation) and before the checkpoint callbacks run, so that a checkpoint holds the target of
        its own step. A step skipped by the non-finite guard (every gradient dropped, the student unchanged)
        leaves the target unchanged too."""
        super().optimizer_step(*args, **kwargs)
        if self.target is not None and has_gradients(self.student):
            self._update_target()

    @torch.no_grad()
    def _update_target(self) -> None:
        for p_target, p_student in zip(self.target.parameters(), self.student.parameters()):
            p_target.lerp_(p_student, 1.0 - self.ema_decay)

    def validation_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch, torch.Generator().manual_seed(1000 + batch_idx))
        self.log("val/loss", loss, prog_bar=True, batch_size=batch["pixel_values"].shape[0], sync_dist=True)
        return loss

    # ------------------------------------------------------------------ sampling and export

    def pipeline(self, scheduler: str | None = None):
        """The student as an in-memory distill text-to-image pipeline whose call defaults are the export's
        (``call_defaults``), with an LCM scheduler by default on the solver grid the student was trained on."""
        from distill.inference.schedulers import make_scheduler, scheduler_options

        name = scheduler or self.sampling["name"]
        options = {} if name == self.sampling["name"] else scheduler_options(name)  # as the teacher's rows get
        if name in ("lcm", "tcd"):  # their inference timesteps are taken from a grid of original_inference_steps
            if self.sigma_data != 0.5:
                raise ValueError(f"method.sigma_data={self.sigma_data}: diffusers' {name} scheduler fixes sigma_data=0.5")
            options.update(timestep_scaling=self.timestep_scaling, original_inference_steps=self.num_ddim_timesteps)
        if name == self.sampling["name"]:
            options.update(self.sampling.get("options") or {})
        scheduler = make_scheduler(name, self.noise_scheduler_config, **options)
        return text_to_image_pipeline(self.vae, self.conditioner, self.student, scheduler, **self.call_defaults())

    def call_defaults(self) -> dict:
        """The intended call: the configured steps; the configured guidance as the student's w input, or, for a
        student without one (LoRA), guidance 1 and no CFG pass, the guidance being distilled into it."""
        return {"default_num_inference_steps": self.sampling["num_inference_steps"],
                "default_guidance_scale": self.sampling["guidance_scale"] if self.w_dim is not None else 1.0,
                "guidance_distilled": self.w_dim is None}

    def generate(self, batch: dict, generator: torch.Generator, num_inference_steps: int | None = None,
                 guidance_scale: float | None = None, scheduler: str | None = None) -> torch.Tensor:
        return pipeline_images(self.pipeline(scheduler), batch["caption"], generator, num_inference_steps, guidance_scale)

    def export(self, out_dir: str | Path) -> Path:
        """A distill text-to-image pipeline folder with an LCMScheduler on the training grid, distill.json and a
        model card; for a LoRA student also the adapter weights alone (lora/pytorch_lora_weights.safetensors, for
        ``pipe.load_lora_weights`` on the teacher)."""
        from distill.inference.model_card import call_info, write_export_info

        out_dir = Path(out_dir)
        pipe = self.pipeline()
        student = type(self.student).__name__
        if self.is_lora:
            from diffusers import StableDiffusionPipeline
            from diffusers.utils import convert_state_dict_to_diffusers
            from peft.utils import get_peft_model_state_dict

            lora = convert_state_dict_to_diffusers(get_peft_model_state_dict(self.student))
            StableDiffusionPipeline.save_lora_weights(out_dir / "lora", unet_lora_layers=lora, safe_serialization=True)
            # The full pipeline holds a copy with the adapters merged into the weights and removed.
            merged = copy.deepcopy(self.student)
            merged.fuse_lora()
            merged.unload_lora()
            pipe.register_modules(unet=merged)
            student += " with its LoRA adapters merged (adapters alone in lora/)"
        pipe.save_pretrained(out_dir)
        defaults = self.call_defaults()
        scales = f"[{self.guidance_scale_min}, {self.guidance_scale_max}]"
        if self.w_dim is not None:
            guidance = (f"distilled from the teacher's classifier-free guidance at scales drawn from {scales}, taken as "
                        "an input (the embedding of guidance_scale - 1 through timestep_cond): one UNet evaluation per "
                        "step at any scale in that range, never a CFG pass.")
        else:
            guidance = (f"distilled from the teacher's classifier-free guidance at scales drawn from {scales}, without a "
                        "guidance input: the one UNet evaluation per step is already guided; no CFG pass is run and "
                        "guidance_scale has no effect.")
        write_export_info(out_dir, {
            "method": "consistency", "teacher": self.teacher_source, "student": student, "pipeline": type(pipe).__name__,
            "sampling": call_info(type(pipe.scheduler).__name__, defaults["default_num_inference_steps"],
                                  defaults["default_guidance_scale"], cfg_pass=False),
            "guidance": guidance, "guidance_distilled": defaults["guidance_distilled"],
            "guidance_scale_range": [self.guidance_scale_min, self.guidance_scale_max],
            "num_ddim_timesteps": self.num_ddim_timesteps, "timestep_scaling": self.timestep_scaling,
        })
        return out_dir
