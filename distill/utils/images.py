"""Image grids as PIL images (torchvision is not in the default install)."""

from __future__ import annotations

import torch
from PIL import Image


def image_grid(images: torch.Tensor, nrow: int, pad: int = 1) -> Image.Image:
    """(N, C, H, W) in [-1, 1] -> one PIL image with ``nrow`` images per row."""
    images = ((images.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    n, c, h, w = images.shape
    rows = (n + nrow - 1) // nrow
    grid = torch.zeros((c, rows * (h + pad) + pad, nrow * (w + pad) + pad), dtype=torch.uint8)
    for i in range(n):
        r, col = divmod(i, nrow)
        grid[:, pad + r * (h + pad): pad + r * (h + pad) + h, pad + col * (w + pad): pad + col * (w + pad) + w] = images[i]
    array = grid.permute(1, 2, 0).numpy()
    return Image.fromarray(array[..., 0] if c == 1 else array, mode="L" if c == 1 else "RGB")


def upscale(image: Image.Image, factor: int) -> Image.Image:
    return image.resize((image.width * factor, image.height * factor), Image.NEAREST)
