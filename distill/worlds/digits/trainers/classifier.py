"""Supervised training of the digit classifier whose features are the digits world's FID space."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from distill.methods import METHODS
from distill.methods.base import DistillMethod


def random_affine(x: torch.Tensor, max_translate: float, max_rotate_deg: float, max_scale: float,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Random small rotation, isotropic scaling and translation of (N, C, H, W) images in [-1, 1].

    ``max_translate`` is a fraction of the image size (0.0625 = 2 px at 32x32). Pixels moved in from
    outside are background (-1), not the border's value.
    """
    n = x.shape[0]

    def uniform(bound: float) -> torch.Tensor:
        return (torch.rand(n, generator=generator) * 2 - 1) * bound

    angle = uniform(math.radians(max_rotate_deg))
    scale = 1.0 + uniform(max_scale)
    # affine_grid maps output to input coordinates in [-1, 1]; a shift of 2 * t moves by t image widths.
    tx, ty = uniform(2 * max_translate), uniform(2 * max_translate)
    cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
    theta = torch.stack([torch.stack([cos, -sin, tx], 1), torch.stack([sin, cos, ty], 1)], 1).to(x)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    # Shift to [0, 2] so that grid_sample's zero padding is the -1 background.
    return F.grid_sample(x + 1, grid, mode="bilinear", padding_mode="zeros", align_corners=False) - 1


@METHODS.register("classifier")
class ClassifierTraining(DistillMethod):
    """Cross-entropy training of ``student`` (a ``ImageClassifier``) with light affine augmentation."""

    def __init__(
        self,
        student: nn.Module,
        optimizer: Callable,
        lr_scheduler: Callable | None = None,
        max_translate: float = 0.0625,  # fraction of the image size: 2 px at 32x32, half a pixel of 8x8 digits
        max_rotate_deg: float = 10.0,
        max_scale: float = 0.1,  # zoom in [0.9, 1.1]
        label_smoothing: float = 0.0,
        sampling: dict | None = None,
    ):
        super().__init__(optimizer, lr_scheduler)
        self.save_hyperparameters(ignore=["student", "optimizer", "lr_scheduler", "sampling"])
        self.student = student
        self.max_translate, self.max_rotate_deg, self.max_scale = max_translate, max_rotate_deg, max_scale
        self.label_smoothing = label_smoothing

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        x = random_affine(batch["pixel_values"], self.max_translate, self.max_rotate_deg, self.max_scale)
        labels = torch.as_tensor(batch["label"], device=x.device)
        logits = self.student(x)
        loss = F.cross_entropy(logits, labels, label_smoothing=self.label_smoothing)
        n = x.shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=n)
        self.log("train/acc", (logits.argmax(1) == labels).float().mean(), batch_size=n)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        x = batch["pixel_values"]
        labels = torch.as_tensor(batch["label"], device=x.device)
        logits = self.student(x)
        loss = F.cross_entropy(logits, labels)
        n = x.shape[0]
        self.log("val/loss", loss, prog_bar=True, batch_size=n, sync_dist=True)
        self.log("val/acc", (logits.argmax(1) == labels).float().mean(), prog_bar=True, batch_size=n, sync_dist=True)
        return loss

    def export(self, out_dir: str | Path) -> Path:
        """``config.json`` + ``model.safetensors``: ``ImageClassifier.from_pretrained(out_dir)`` loads it."""
        out_dir = Path(out_dir)
        self.student.save_pretrained(out_dir)
        return out_dir
