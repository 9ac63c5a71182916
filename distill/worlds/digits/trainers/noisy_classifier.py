"""Training of the noise-aware latent classifier that guides sampling (``accelerate=classifier``): cross-entropy
on VAE latents of the training images noised to a uniformly drawn timestep of the teacher's schedule (Dhariwal
& Nichol 2021, Sec. 4), validated at fixed noise levels."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from distill.diffusion.schedules import DiscreteVPSchedule
from distill.methods import METHODS
from distill.methods.base import DistillMethod, encode_latents

VAL_TIMESTEPS = (0, 250, 500, 750, 999)


@METHODS.register("noisy_classifier")
class NoisyClassifierTraining(DistillMethod):
    """``student`` (a ``NoisyLatentClassifier``) learns p(y | x_t, t) on ``vae`` latents noised by ``noise_scheduler``."""

    def __init__(self, student: nn.Module, vae: nn.Module, noise_scheduler, optimizer: Callable,
                 lr_scheduler: Callable | None = None, val_timesteps: tuple[int, ...] | list[int] = VAL_TIMESTEPS,
                 sampling: dict | None = None):
        super().__init__(optimizer, lr_scheduler)
        self.save_hyperparameters(ignore=["student", "vae", "noise_scheduler", "optimizer", "lr_scheduler", "sampling"])
        self.student, self.vae, self.noise_scheduler = student, vae.requires_grad_(False).eval(), noise_scheduler
        self.val_timesteps = list(val_timesteps)
        if max(self.val_timesteps) >= noise_scheduler.config.num_train_timesteps or min(self.val_timesteps) < 0:
            raise ValueError(f"method.val_timesteps={self.val_timesteps} must lie in [0, "
                             f"{noise_scheduler.config.num_train_timesteps})")

    def frozen_networks(self) -> list[torch.nn.Module]:
        return [self.vae]

    def _noisy(self, batch: dict, timesteps: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            latents = encode_latents(self.vae, batch["pixel_values"])
        n = latents.shape[0]
        if timesteps is None:
            timesteps = torch.randint(0, self.noise_scheduler.config.num_train_timesteps, (n,), device=latents.device)
        noisy = DiscreteVPSchedule.from_scheduler(self.noise_scheduler).add_noise(latents, torch.randn_like(latents),
                                                                                  timesteps)
        return noisy, timesteps, torch.as_tensor(batch["label"], device=latents.device)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        x, t, labels = self._noisy(batch)
        logits = self.student(x, t)
        loss = F.cross_entropy(logits, labels)
        self.log("train/loss", loss, prog_bar=True, batch_size=len(labels))
        self.log("train/acc", (logits.argmax(1) == labels).float().mean(), batch_size=len(labels))
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        accuracies = []
        for t in self.val_timesteps:
            n = batch["pixel_values"].shape[0]
            x, ts, labels = self._noisy(batch, torch.full((n,), t, device=self.device, dtype=torch.long))
            acc = (self.student(x, ts).argmax(1) == labels).float().mean()
            accuracies.append(acc)
            self.log(f"val/acc_t{t}", acc, batch_size=n, sync_dist=True)
        self.log("val/acc", torch.stack(accuracies).mean(), prog_bar=True, batch_size=n, sync_dist=True)

    def export(self, out_dir: str | Path) -> Path:
        """``config.json`` + ``model.safetensors``: ``NoisyLatentClassifier.from_pretrained(out_dir)`` loads it."""
        out_dir = Path(out_dir)
        self.student.save_pretrained(out_dir)
        return out_dir
