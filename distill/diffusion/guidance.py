"""Classifier-free guidance (Ho & Salimans 2022) and the guidance-scale (w) input of guidance-distilled students."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _per_example(scale: float | torch.Tensor, ndim: int) -> float | torch.Tensor:
    """A scalar as is; an (N,) tensor shaped (N, 1, ..., 1) to broadcast over ``ndim`` dimensions."""
    if isinstance(scale, torch.Tensor) and scale.ndim == 1:
        return scale.reshape((-1,) + (1,) * (ndim - 1))
    return scale


def cfg(cond: torch.Tensor, uncond: torch.Tensor, guidance_scale: float | torch.Tensor | None = None, *,
        w: float | torch.Tensor | None = None) -> torch.Tensor:
    """Classifier-free guidance (Ho & Salimans 2022, eq. 6): (1 + w) cond - w uncond, guidance_scale = 1 + w.

    Given ``guidance_scale`` (diffusers' convention) it is computed as diffusers' pipelines do,
    uncond + guidance_scale (cond - uncond); given ``w`` (LCM's convention, Luo et al. 2023 sec. 4.2), as
    LCM does, cond + w (cond - uncond). The two are equal in exact arithmetic but round differently, so each
    caller keeps the arithmetic its results were measured with. A scale may be a float or an (N,) tensor.
    """
    if (guidance_scale is None) == (w is None):
        raise ValueError("cfg takes exactly one of guidance_scale and w (= guidance_scale - 1)")
    if w is not None:
        return cond + _per_example(w, cond.ndim) * (cond - uncond)
    return uncond + _per_example(guidance_scale, cond.ndim) * (cond - uncond)


def guidance_scale_embedding(w: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of 1000 * w, (N,) -> (N, dim); w is the LCM guidance w = cfg_scale - 1
    (the embedding diffusers' pipelines feed to ``timestep_cond``; Luo et al. 2023 sec. 4.2)."""
    half = dim // 2
    # float32 throughout, in this order: at 1000 * w the sines are sensitive to the last bit of the frequencies
    step = torch.log(torch.tensor(10000.0)) / (half - 1)
    freqs = torch.exp(torch.arange(half, dtype=torch.float32) * -step).to(w.device)
    args = (w.float() * 1000.0)[:, None] * freqs[None, :]
    emb = torch.cat([torch.sin(args), torch.cos(args)], dim=1)
    return F.pad(emb, (0, 1)) if dim % 2 else emb


def guidance_condition(w: torch.Tensor, dim: int | None, like: torch.Tensor) -> dict:
    """The UNet keyword arguments that give a guidance-conditioned student its w = guidance_scale - 1:
    ``timestep_cond`` (diffusers' name) in ``like``'s dtype and device; none for a student without that input
    (``dim`` None)."""
    return {} if dim is None else {"timestep_cond": guidance_scale_embedding(w, dim).to(like)}
