"""Feature spaces next to the evaluation set's own network, selected by ``eval.extra_features``.

The evaluation set's feature network (a classifier's penultimate layer, a CLIP or DINOv2 tower) sees what
it was trained to see: a semantic space can ignore a brightness shift that any viewer notices, and a
low-level space can ignore a wrong class. FID and KID in a second space of another nature show what the
first misses (``distill.metrics.sanity`` measures which degradation each space catches).

- ``pixels``: the images area-averaged to ``PIXEL_GRID`` x ``PIXEL_GRID`` and flattened: brightness,
  contrast, colour and coarse layout statistics, no weights, available for every evaluation set.
- ``clip``: the image tower of the evaluation set's CLIP model (``eval.clip``), its projected embedding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

EXTRA_FEATURE_SPACES = ("pixels", "clip")
PIXEL_GRID = 8  # cells per side of the pixel space: 8x8 keeps 1-channel features at 64 dims, RGB at 192


class PixelFeatures(nn.Module):
    """Images (N, C, H, W) in [-1, 1] -> their area averages over a ``size`` x ``size`` grid, flattened
    (N, C * size * size): FID on these is the Frechet distance of the low-resolution pixel distributions."""

    def __init__(self, size: int = PIXEL_GRID):
        super().__init__()
        if size < 1:
            raise ValueError(f"PixelFeatures size={size} must be >= 1 (grid cells per side)")
        self.size = size

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return F.adaptive_avg_pool2d(images, self.size).flatten(1)  # (N, C * size^2)
