"""A small diffusers ``AutoencoderKL`` (the embedded default world's VAE, built by
``distill.students.assets.build_vae``): its latents and their scaling factor.

As in Stable Diffusion (Rombach et al. 2022, sec. 4.3.2 and D.1), latent diffusion trains on
``z * scaling_factor`` where ``scaling_factor = 1 / std(z)`` is measured on the training data, so
that the latents have unit variance like the diffusion noise.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from diffusers import AutoencoderKL


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


def latent_shift_and_scaling(latents: torch.Tensor) -> tuple[float, float]:
    """SD3's latent normalisation (Esser et al. 2024; diffusers' ``(z - shift_factor) * scaling_factor``):
    ``shift_factor`` the mean of all latent elements, ``scaling_factor`` 1 / std of the shifted latents."""
    z = latents.detach().double()
    shift = z.mean().item()
    return shift, 1.0 / (z - shift).std().item()


def load_vae(pretrained_model_name_or_path: str, shift_factor: float | None = None,
             scaling_factor: float | None = None, **kwargs) -> AutoencoderKL:
    """``AutoencoderKL.from_pretrained``, with ``shift_factor`` / ``scaling_factor`` set in its config where given (a
    flow-matching pipeline in SD3's layout decodes ``latents / scaling_factor + shift_factor``)."""
    vae = AutoencoderKL.from_pretrained(pretrained_model_name_or_path, **kwargs)
    vae.register_to_config(**{k: v for k, v in (("shift_factor", shift_factor), ("scaling_factor", scaling_factor))
                              if v is not None})
    return vae
