"""Flux's packed latents: a (N, C, H, W) latent as a sequence of 2x2 patches, (N, H/2 * W/2, 4C), and the
positions its rotary embedding reads (Black Forest Labs' FLUX.1; diffusers' ``FluxPipeline._pack_latents``,
``_unpack_latents`` and ``_prepare_latent_image_ids``). The flow math of ``distill.diffusion.flow`` is elementwise,
so it runs unchanged on packed latents; only the shapes differ."""

from __future__ import annotations

import torch


def _check_even(height: int, width: int) -> None:
    if height % 2 or width % 2:
        raise ValueError(f"a {height}x{width} latent cannot be packed in 2x2 patches: both sides must be even "
                         "(Flux's images are multiples of 2 * vae_scale_factor pixels)")


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(N, C, H, W) -> (N, H/2 * W/2, 4C): patch (i, j) is token i * W/2 + j, its features (c, dy, dx) in that order."""
    n, c, h, w = latents.shape
    _check_even(h, w)
    patches = latents.reshape(n, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)  # (N, H/2, W/2, C, 2, 2)
    return patches.reshape(n, (h // 2) * (w // 2), c * 4)


def unpack_latents(packed: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(N, H/2 * W/2, 4C) -> (N, C, H, W) for a latent of ``height`` x ``width`` (latent pixels, not image pixels)."""
    n, tokens, features = packed.shape
    _check_even(height, width)
    if tokens != (height // 2) * (width // 2) or features % 4:
        raise ValueError(f"packed latents of shape {tuple(packed.shape)} are not a {height}x{width} latent in 2x2 "
                         f"patches ({(height // 2) * (width // 2)} tokens of 4C features)")
    patches = packed.reshape(n, height // 2, width // 2, features // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return patches.reshape(n, features // 4, height, width)


def latent_image_ids(height: int, width: int, device: torch.device | str = "cpu",
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(H/2 * W/2, 3) positions of the packed tokens of a ``height`` x ``width`` latent: (0, row, column) of each
    2x2 patch, the ``img_ids`` of Flux's 3-axis rotary embedding (axis 0 is the text's, 0 for image tokens)."""
    _check_even(height, width)
    rows = torch.arange(height // 2).repeat_interleave(width // 2)
    cols = torch.arange(width // 2).repeat(height // 2)
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=1).to(device=device, dtype=dtype)
