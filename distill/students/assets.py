"""Students of the asset trainers (``+exp=asset_*``) that are not a world's own, each built from its sizes: the
latent VAE and the noisy classifier of classifier guidance (``distill.models``). A world's own networks (its CLIP,
its classifier) are built by the world's package (``distill.worlds.<world>``)."""

from __future__ import annotations

from collections.abc import Sequence

from diffusers import AutoencoderKL

from distill.models.noisy_classifier import NoisyLatentClassifier
from distill.students import STUDENTS


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


@STUDENTS.register("noisy_classifier", convert="all")
def build_noisy_classifier(in_channels: int = 4, sample_size: int = 8, channels: list[int] | tuple[int, ...] = (64, 128),
                           time_dim: int = 128, num_classes: int = 10, groups: int = 8) -> NoisyLatentClassifier:
    return NoisyLatentClassifier(in_channels, sample_size, list(channels), time_dim, num_classes, groups)
