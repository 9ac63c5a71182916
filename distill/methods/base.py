"""What every method shares: optimizers from partials, sampling, export."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_ratio: float = 0.1):
    """Linear warm-up to the base LR, then cosine decay to ``min_ratio`` of it at ``total_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / max(1, warmup_steps)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class DistillMethod(L.LightningModule):
    """Base of every method: ``self.student`` is what trains; ``optimizer``/``lr_scheduler`` are partials."""

    def __init__(self, optimizer: Callable, lr_scheduler: Callable | None = None):
        super().__init__()
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler

    def trainable_parameters(self):
        return [p for p in self.student.parameters() if p.requires_grad]

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(self.trainable_parameters())
        if self.lr_scheduler_factory is None:
            return optimizer
        scheduler = self.lr_scheduler_factory(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def generate(self, batch: dict, generator: torch.Generator) -> torch.Tensor:
        """Images (N, C, H, W) in [-1, 1] for the conditions in ``batch``; each method defines how."""
        raise NotImplementedError

    def export(self, out_dir: str | Path) -> Path:
        """Save the student in an ecosystem format (a diffusers folder); each method defines which."""
        raise NotImplementedError
