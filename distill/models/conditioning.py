"""Conditioners turn a batch (labels, captions) into the keyword arguments of a UNet call.

``drop`` (N,) bool marks examples whose condition is replaced by the null condition
(classifier-free guidance dropout, Ho & Salimans 2022).
"""

from __future__ import annotations

import torch
from torch import nn


class ClassConditioner(nn.Module):
    """Class labels for ``UNet2DModel(num_class_embeds=num_classes + 1)``; index num_classes is null.

    Unlabelled examples (label -1, e.g. from an image folder) get the null class: unconditional training.
    """

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.num_classes = num_classes

    def forward(self, batch: dict, drop: torch.Tensor | None = None) -> dict:
        labels = torch.as_tensor(batch["label"]).long()
        if (labels < -1).any() or (labels >= self.num_classes).any():
            raise ValueError(f"labels must be in [0, {self.num_classes}) or -1 (unlabelled); got {labels.unique().tolist()}")
        labels = torch.where(labels < 0, torch.full_like(labels, self.num_classes), labels)
        if drop is not None:
            labels = torch.where(drop.to(labels.device), torch.full_like(labels, self.num_classes), labels)
        return {"class_labels": labels}

    def null(self, batch_size: int, device: torch.device | str = "cpu") -> dict:
        return {"class_labels": torch.full((batch_size,), self.num_classes, dtype=torch.long, device=device)}


def concat_conditions(a: dict, b: dict) -> dict:
    """Stack two condition dicts along the batch (one forward for conditional + unconditional)."""
    return {k: torch.cat([a[k], b[k]]) for k in a}
