"""A small diffusers ``AutoencoderKL`` (the embedded default world's VAE) and its latent scaling factor.

As in Stable Diffusion (Rombach et al. 2022, sec. 4.3.2 and D.1), latent diffusion trains on
``z * scaling_factor`` where ``scaling_factor = 1 / std(z)`` is measured on the training data, so
that the latents have unit variance like the diffusion noise.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from diffusers import AutoencoderKL

from distill.models.registry import STUDENTS


@STUDENTS.register("vae")
def build_vae(
    in_channels: int = 1,
    sample_size: int = 32,
    block_out_channels: Sequence[int] = (16, 32, 64),
    layers_per_block: int = 1,
    latent_channels: int = 4,
    norm_num_groups: int = 8,
    gradient_checkpointing: bool = False,
) -> AutoencoderKL:
    """An ``AutoencoderKL`` that downsamples ``len(block_out_channels) - 1`` times (32x32x1 -> 4x8x8 by default).

    ``gradient_checkpointing`` recomputes each encoder/decoder block in the backward pass (diffusers' switch,
    non-reentrant); forwards without gradients (encoding latents, reconstructions) are unaffected."""
    levels = len(block_out_channels)
    if sample_size % 2 ** (levels - 1):
        raise ValueError(
            f"student.sample_size={sample_size} is not divisible by 2**{levels - 1} (the VAE's downsamplings); "
            f"pick a resolution that is a multiple of {2 ** (levels - 1)}"
        )
    if any(c % norm_num_groups for c in block_out_channels):
        raise ValueError(f"student.block_out_channels={list(block_out_channels)} must be multiples of norm_num_groups={norm_num_groups}")
    vae = AutoencoderKL(
        in_channels=in_channels,
        out_channels=in_channels,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=tuple(int(c) for c in block_out_channels),  # a Hydra ListConfig is not JSON
        layers_per_block=layers_per_block,
        latent_channels=latent_channels,
        norm_num_groups=norm_num_groups,
        sample_size=sample_size,
        scaling_factor=1.0,  # a placeholder until it is measured on the data (measure_scaling_factor)
    )
    if gradient_checkpointing:
        vae.enable_gradient_checkpointing()
    return vae


def latent_scaling_factor(latents: torch.Tensor) -> float:
    """``1 / std`` over all latent elements (Stable Diffusion's 0.18215 is this number for its VAE)."""
    return 1.0 / latents.detach().double().std().item()


@torch.no_grad()
def encode_latents(vae: AutoencoderKL, images: Iterable[torch.Tensor], generator: torch.Generator | None = None,
                   sample: bool = True) -> torch.Tensor:
    """Latents (N, C, h, w) of all ``images`` batches: posterior samples (what latent diffusion trains on) or means."""
    was_training = vae.training
    vae.eval()
    device = next(vae.parameters()).device
    out = []
    for x in images:
        posterior = vae.encode(x.to(device)).latent_dist
        out.append((posterior.sample(generator) if sample else posterior.mode()).float().cpu())
    vae.train(was_training)
    return torch.cat(out)


def measure_scaling_factor(vae: AutoencoderKL, images: Iterable[torch.Tensor], seed: int = 0) -> float:
    """Measure ``1 / std`` of posterior samples of ``images`` and store it in the VAE's config."""
    generator = torch.Generator(next(vae.parameters()).device).manual_seed(seed)
    factor = latent_scaling_factor(encode_latents(vae, images, generator))
    vae.register_to_config(scaling_factor=factor)
    return factor
