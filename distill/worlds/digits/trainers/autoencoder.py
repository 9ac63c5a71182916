"""Training of the digits world's KL autoencoder (the VAE of latent diffusion, Rombach et al. 2022)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL

from distill.methods import METHODS
from distill.methods.base import DistillMethod
from distill.models.vae import measure_scaling_factor

RECON_LOSSES = ("l1", "l2")


def psnr(mse: torch.Tensor, data_range: float = 2.0) -> torch.Tensor:
    """Peak signal-to-noise ratio in dB of images spanning ``data_range`` ([-1, 1] spans 2)."""
    return 10.0 * torch.log10(data_range**2 / mse.clamp_min(1e-12))


@METHODS.register("vae", choices={"recon_loss": RECON_LOSSES})
class VAETraining(DistillMethod):
    """Pixel reconstruction loss of posterior samples plus a small KL pull of the posterior towards N(0, I).

    The KL term is averaged per latent element (diffusers' ``kl()`` sums them), so that ``kl_weight``
    does not change with the latent size. It keeps the latents bounded and smooth for the diffusion
    model; the export measures their scale (``scaling_factor``) on the training data.
    """

    def __init__(
        self,
        student: AutoencoderKL,
        optimizer: Callable,
        lr_scheduler: Callable | None = None,
        recon_loss: str = "l1",  # RECON_LOSSES
        kl_weight: float = 1e-4,  # per latent element, relative to the per-pixel reconstruction loss
        scale_max_batches: int = 64,  # training batches over which the exported scaling_factor is measured
        sampling: dict | None = None,
    ):
        super().__init__(optimizer, lr_scheduler)
        if recon_loss not in RECON_LOSSES:
            raise ValueError(f"method.recon_loss={recon_loss!r} is not supported; use one of {list(RECON_LOSSES)}")
        self.save_hyperparameters(ignore=["student", "optimizer", "lr_scheduler", "sampling"])
        self.student = student
        self.recon_loss, self.kl_weight = recon_loss, kl_weight
        self.scale_max_batches = scale_max_batches

    def losses(self, x: torch.Tensor, sample: bool = True) -> dict[str, torch.Tensor]:
        posterior = self.student.encode(x).latent_dist
        z = posterior.sample() if sample else posterior.mode()
        recon = self.student.decode(z).sample
        rec = F.l1_loss(recon, x) if self.recon_loss == "l1" else F.mse_loss(recon, x)
        kl = posterior.kl().mean() / posterior.mean[0].numel()
        return {"loss": rec + self.kl_weight * kl, "recon": rec, "kl": kl, "mse": F.mse_loss(recon.clamp(-1, 1), x)}

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        out = self.losses(batch["pixel_values"])
        n = batch["pixel_values"].shape[0]
        self.log("train/loss", out["loss"], prog_bar=True, batch_size=n)
        self.log("train/kl", out["kl"], batch_size=n)
        return out["loss"]

    def validation_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        # Posterior means: a deterministic reconstruction, comparable across steps and runs.
        out = self.losses(batch["pixel_values"], sample=False)
        n = batch["pixel_values"].shape[0]
        self.log("val/loss", out["loss"], prog_bar=True, batch_size=n, sync_dist=True)
        self.log("val/kl", out["kl"], batch_size=n, sync_dist=True)
        self.log("val/mse", out["mse"], batch_size=n, sync_dist=True)
        # PSNR of the batch-averaged MSE (per-batch PSNRs would average a log).
        self.log("val/psnr", psnr(out["mse"]), prog_bar=True, batch_size=n, sync_dist=True)
        return out["loss"]

    def _training_images(self) -> Iterator[torch.Tensor]:
        """Up to ``scale_max_batches`` batches of the training split (streamed data sets may not end)."""
        loader = self.trainer.datamodule.train_dataloader()
        for i, batch in enumerate(loader):
            if i >= self.scale_max_batches:
                return
            yield batch["pixel_values"]

    def export(self, out_dir: str | Path, images: Iterable[torch.Tensor] | None = None) -> Path:
        """A diffusers ``AutoencoderKL`` folder whose ``scaling_factor`` is measured on the training split."""
        out_dir = Path(out_dir)
        factor = measure_scaling_factor(self.student, images if images is not None else self._training_images())
        if not math.isfinite(factor):
            raise RuntimeError(f"the measured latent scaling factor is {factor}; the VAE has diverged")
        self.student.save_pretrained(out_dir)
        return out_dir
