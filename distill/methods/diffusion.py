"""Plain denoising diffusion training (Ho et al. 2020) with eps / x0 / v prediction and CFG dropout."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from distill.data.latents import batch_size_of
from distill.diffusion import diffusion_loss, snr_weight
from distill.diffusion.losses import WEIGHTINGS
from distill.diffusion.noise import edm_timestep_probabilities
from distill.diffusion.parametrization import PREDICTION_TYPES
from distill.families import family_for
from distill.families.class_unet import ClassUNetFamily
from distill.inference.schedulers import check_scheduler_kind, make_scheduler, scheduler_options
from distill.methods import METHODS
from distill.methods.base import DistillMethod, pipeline_images
from distill.methods.checks import check_probability
from distill.models.teacher import is_flow_matching


@METHODS.register("diffusion", choices={"prediction_type": PREDICTION_TYPES, "loss_weighting": WEIGHTINGS})
class DiffusionTraining(DistillMethod):
    """Trains ``student`` (a diffusers UNet) to denoise x_t = alpha_t x0 + sigma_t eps.

    With a ``vae`` this is latent diffusion (Rombach et al. 2022): x0 = vae.encode(image) * scaling_factor,
    and the frozen VAE decodes samples. The ``conditioner`` picks the model family (``family_for``): a text
    conditioner the ``sd`` family, exported as a StableDiffusionPipeline; class labels the ``class_unet`` one.

    ``loss_weighting``: ``min_snr``, ``truncated_snr``, ``none`` (t uniform over the timesteps), or ``edm``, EDM's
    training objective (Karras et al. 2022, table 1): lambda(sigma) on ||D - x0||^2 with t drawn from ln sigma ~
    N(-1.2, 1.2^2) mapped onto the discrete timesteps (``edm_timestep_probabilities``), ``method.noise.sigma_data``
    the data's std. With ``method.noise.preconditioning=edm`` too it is EDM's recipe: a unit-weight MSE on F.
    """

    def __init__(
        self,
        student: nn.Module,
        noise_scheduler,
        conditioner: nn.Module,
        optimizer: Callable,
        lr_scheduler: Callable | None = None,
        prediction_type: str = "epsilon",
        cond_dropout: float = 0.1,
        loss_weighting: str = "min_snr",
        snr_gamma: float = 5.0,
        sampling: dict | None = None,
        vae: nn.Module | None = None,
        **speed,  # DistillMethod's training-speed switches (compile, frozen_dtype, ...)
    ):
        super().__init__(optimizer, lr_scheduler, **speed)
        if self.frozen_dtype is not None:
            raise ValueError(f"method.frozen_dtype={self.frozen_dtype}: plain diffusion training has no frozen network "
                             "run every step (the VAE encodes in float32, or use method.latent_cache=true); set it to null")
        self.save_hyperparameters(ignore=["student", "noise_scheduler", "conditioner", "optimizer", "lr_scheduler", "vae"])
        if noise_scheduler.config.get("prediction_type", prediction_type) != prediction_type:
            raise ValueError(
                f"noise_scheduler.prediction_type={noise_scheduler.config.prediction_type!r} differs from "
                f"method.prediction_type={prediction_type!r}; set them equal"
            )
        if self.noise.preconditioning == "edm":  # a freshly initialised network here: re-parametrised as EDM's F
            from distill.models.precondition import EDMPreconditionedUNet2DConditionModel

            student = EDMPreconditionedUNet2DConditionModel.wrap(student, noise_scheduler.config, prediction_type,
                                                                 self.noise.sigma_data)
        self.student = student
        self.family = family_for(noise_scheduler, vae, conditioner)
        # the training scheduler's config with its class, as saved (what tells a flow-matching schedule)
        self.scheduler_config = {**noise_scheduler.config, "_class_name": type(noise_scheduler).__name__}
        if self.family.flow_matching != is_flow_matching(self.scheduler_config):
            raise ValueError(
                f"method.conditioner ({type(conditioner).__name__}) makes a {type(self.family).__name__} network, "
                f"which is {'' if self.family.flow_matching else 'not '}flow matching, but method.noise_scheduler is a "
                f"{type(noise_scheduler).__name__}; train it with "
                + ("method=flow_matching (FlowMatchEulerDiscreteScheduler)" if self.family.flow_matching else
                   "method=diffusion (a DDPM-family scheduler), or use an SD3Conditioner with method=flow_matching"))
        self.text = not isinstance(self.family, ClassUNetFamily)  # prompts, or class labels
        if self.text and vae is None:
            raise ValueError(f"a text-conditioned model exports as a {self.family.pipeline_class.__name__}, which "
                             "needs a VAE; set method.vae (latent diffusion) or use a class conditioner")
        self.vae = self.family.vae  # the family's frozen parts under their old names (checkpoint keys)
        self.noise_scheduler = noise_scheduler
        self.conditioner = conditioner
        self.prediction_type = prediction_type
        self.cond_dropout = cond_dropout
        self.loss_weighting, self.snr_gamma = loss_weighting, snr_gamma
        self.sampling = dict(sampling or {"name": "ddim", "num_inference_steps": 50, "guidance_scale": 1.0})
        check_scheduler_kind(self.sampling["name"], self.scheduler_config)  # before any sample grid or export
        self.schedule = self.family.schedule  # what the loss noises with
        self.num_train_timesteps = noise_scheduler.config.num_train_timesteps
        self.time_target = None  # the timesteps' distribution: uniform, or EDM's lognormal in sigma
        if loss_weighting == "edm":
            sigmas = self.schedule.ve_sigmas
            if not bool(torch.isfinite(sigmas).all()) or float(sigmas.min()) <= 0:
                raise ValueError("method.loss_weighting=edm needs 0 < alpha_bar < 1 at every timestep (finite sigma); "
                                 "this schedule has zero terminal SNR (rescale_betas_zero_snr): set it to false or "
                                 "choose another method.loss_weighting")
            self.time_target = edm_timestep_probabilities(sigmas, self.noise.sigma_data)

    def train(self, mode: bool = True):
        super().train(mode)
        if self.vae is not None:
            self.vae.eval()  # frozen
        return self

    def encode(self, pixels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Images (N, C, H, W) -> diffusion space: identity, or scaled VAE latents (N, 4, H/f, W/f)."""
        return self.family.encode(pixels, generator)

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        return self.family.decode(x0)

    def loss(self, batch: dict, generator: torch.Generator | None = None, drop_conditions: bool = True) -> torch.Tensor:
        batch = self.paired_batch(batch)  # method.noise.antithetic: rows in pairs sharing all but the noise's sign
        x0 = self.latents(batch, generator)  # (N, C, H, W)
        n = x0.shape[0]
        bins, iw = self.draw_time_bins(n, self.schedule.ve_sigmas.float(), generator, target=self.time_target)
        t = bins.to(x0.device)
        eps = self.draw_noise(x0, generator)
        drop = self.paired(torch.rand(n, generator=generator) < self.cond_dropout) if drop_conditions else None
        cond = self.family.condition(batch, drop)
        cond = {k: v.to(x0.device) for k, v in cond.items()}
        x_t = self.schedule.add_noise(x0, eps, t)
        pred = self.family.denoise(self.student, x_t, t, cond)
        target = self.schedule.prediction_target(x0, eps, t)
        weight = snr_weight(self.schedule.snr(t, x0.ndim), self.prediction_type, self.loss_weighting, self.snr_gamma,
                            sigma_data=self.noise.sigma_data)
        per_example = diffusion_loss(pred, target, weight, reduce=False)
        if self.training:
            self.record_time_losses(bins, per_example)
        return self.weighted_mean(per_example, iw)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch_size_of(batch))
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        # Fixed noise, timesteps and no dropout: the held-out loss is comparable across steps and runs.
        generator = torch.Generator().manual_seed(1000 + batch_idx)
        loss = self.loss(batch, generator, drop_conditions=False)
        self.log("val/loss", loss, prog_bar=True, batch_size=batch_size_of(batch), sync_dist=True)
        return loss

    def sampling_scheduler(self, name: str | None = None):
        """The configured sampling scheduler, or another one by ``name`` with the options of its
        ``conf/scheduler/<name>.yaml`` (as every sweep row gets them)."""
        if name is not None and name != self.sampling["name"]:
            return make_scheduler(name, self.scheduler_config, **scheduler_options(name))
        options = dict(self.sampling.get("options") or {})
        return make_scheduler(self.sampling["name"], self.scheduler_config, **options)

    @torch.no_grad()
    def generate(self, batch: dict, generator: torch.Generator, num_inference_steps: int | None = None,
                 guidance_scale: float | None = None, scheduler: str | None = None) -> torch.Tensor:
        """Images from the pipeline the export holds (``pipeline``): captions, or the batch's class labels."""
        prompts = batch["caption"] if self.text else self.family.condition(batch)["class_labels"].tolist()
        return pipeline_images(self.pipeline(scheduler), prompts, generator, num_inference_steps, guidance_scale)

    def pipeline(self, scheduler: str | None = None):
        """The model as an in-memory distill pipeline whose call defaults are the configured sampling: text-to-image
        for a text-conditioned latent model, else class-conditional (labels drawn when none are given)."""
        defaults = {"default_num_inference_steps": self.sampling["num_inference_steps"],
                    "default_guidance_scale": self.sampling["guidance_scale"]}
        return self.family.pipeline(self.student, self.sampling_scheduler(scheduler), **defaults)

    def export(self, out_dir: str | Path) -> Path:
        """A diffusers folder (``pipeline``) plus distill.json and a model card with the intended call."""
        from distill.inference.model_card import call_info, write_export_info

        out_dir = Path(out_dir)
        pipe = self.pipeline()
        pipe.save_pretrained(out_dir)
        text = self.text
        guidance_scale = self.sampling["guidance_scale"]
        network = type(self.student).__name__
        info = {"method": METHODS.name_of(type(self)), "teacher": None, "student": network,
                "pipeline": type(pipe).__name__, "conditioning": "text" if text else "class",
                "prediction_type": self.prediction_type,
                "sampling": call_info(self.sampling["name"], type(pipe.scheduler).__name__,
                                      self.sampling["num_inference_steps"], guidance_scale,
                                      cfg_pass=guidance_scale > 1 if text else guidance_scale != 1),
                "guidance": (f"classifier-free guidance at sampling time (trained with condition dropout "
                             f"{self.cond_dropout}): guidance_scale={guidance_scale} runs a conditional and an "
                             f"unconditional pass per step, batched in one {network} call; 1 runs the conditional "
                             "one only."), **self.export_details()}
        if not text:
            info.update(num_classes=self.conditioner.num_classes, null_class=self.conditioner.num_classes)
        return write_export_info(out_dir, info)

    def export_details(self) -> dict:
        """The objective's own entries of distill.json (a subclass's; none for plain diffusion)."""
        return {}

    @classmethod
    def check_config(cls, cfg) -> None:
        """The condition-dropout rate is a probability."""
        check_probability(cfg.method, "cond_dropout")
