"""Image file -> tensor in [-1, 1], shared by the folder and shard data modules."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image


def image_to_tensor(image: Image.Image, resolution: int, channels: int) -> torch.Tensor:
    """Resize (shorter side), centre-crop to ``resolution`` and scale to [-1, 1]: (C, R, R)."""
    if channels not in (1, 3):
        raise ValueError(f"channels={channels} is not supported; use 1 (grey) or 3 (RGB)")
    image = image.convert("L" if channels == 1 else "RGB")
    w, h = image.size
    scale = resolution / min(w, h)
    image = image.resize((max(resolution, round(w * scale)), max(resolution, round(h * scale))), Image.BICUBIC)
    w, h = image.size
    left, top = (w - resolution) // 2, (h - resolution) // 2
    image = image.crop((left, top, left + resolution, top + resolution))
    array = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
    if channels == 1:
        array = array[None]
    else:
        array = array.transpose(2, 0, 1)
    return torch.from_numpy(np.ascontiguousarray(array))
