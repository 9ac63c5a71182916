"""Image grids as PIL images, through diffusers' ``make_image_grid`` (torchvision is not in the default install)."""

from __future__ import annotations

import torch
from diffusers.utils import make_image_grid
from PIL import Image, ImageOps


def to_pil(images: torch.Tensor) -> list[Image.Image]:
    """(N, C, H, W) in [-1, 1] -> N PIL images (grey for C=1, RGB for C=3), rounded to uint8."""
    array = ((images.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    array = array.permute(0, 2, 3, 1).numpy()
    return [Image.fromarray(a[..., 0] if a.shape[-1] == 1 else a) for a in array]


def image_grid(images: torch.Tensor, nrow: int, pad: int = 1) -> Image.Image:
    """(N, C, H, W) in [-1, 1] -> one RGB image with ``nrow`` images per row, each framed by ``pad`` black
    pixels; an incomplete last row is filled with black tiles."""
    tiles = [ImageOps.expand(tile.convert("RGB"), border=pad) for tile in to_pil(images)]
    rows = -(-len(tiles) // nrow)
    tiles += [Image.new("RGB", tiles[0].size)] * (rows * nrow - len(tiles))
    return make_image_grid(tiles, rows=rows, cols=nrow)


def upscale(image: Image.Image, factor: int) -> Image.Image:
    return image.resize((image.width * factor, image.height * factor), Image.NEAREST)
