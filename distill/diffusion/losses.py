"""Denoising losses and their SNR weightings."""

from __future__ import annotations

import torch

WEIGHTINGS = ("none", "min_snr", "truncated_snr", "edm")


def edm_loss_weight(sigma: torch.Tensor, sigma_data: float) -> torch.Tensor:
    """EDM's lambda(sigma) = (sigma^2 + sigma_data^2) / (sigma sigma_data)^2 on ||D(x; sigma) - x0||^2 (Karras et al.
    2022, table 1): 1 / c_out(sigma)^2, a unit weight on the network's own target F."""
    return (sigma ** 2 + sigma_data ** 2) / (sigma * sigma_data) ** 2


def snr_weight(
    snr_t: torch.Tensor, prediction_type: str, weighting: str = "none", gamma: float = 5.0,
    sigma_data: float | None = None,
) -> torch.Tensor:
    """Per-example weight that turns the plain MSE of ``prediction_type`` into the chosen weighting.

    ``min_snr``: Hang et al. 2023 (Min-SNR-gamma), an eps-MSE weighted by min(SNR, gamma)/SNR.
    ``truncated_snr``: Salimans & Ho 2022 eq. 10, an x0-MSE weighted by max(SNR, 1).
    ``edm``: Karras et al. 2022, table 1, an x0-MSE weighted by ``edm_loss_weight`` at the VE noise level
    sigma = SNR^(-1/2) (x_t / alpha_t = x0 + sigma eps), with the data std ``sigma_data``.
    All are expressed in x0-MSE units (w_x0) and converted to the network's target:
    MSE_eps = SNR * MSE_x0 and MSE_v = (SNR + 1) * MSE_x0; for a flow velocity v = eps - x0 on x_t = (1 - t) x0 +
    t eps (``flow_prediction``), x0 = x_t - t v, so MSE_x0 = t^2 MSE_flow with t = 1 / (1 + sqrt(SNR)).
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting={weighting!r} is not supported; use one of {WEIGHTINGS}")
    if weighting == "none":
        return torch.ones_like(snr_t)
    if weighting == "min_snr":
        w_x0 = torch.clamp(snr_t, max=gamma)
    elif weighting == "truncated_snr":
        w_x0 = torch.clamp(snr_t, min=1.0)
    else:
        if sigma_data is None:
            raise ValueError("weighting='edm' needs sigma_data, the data's standard deviation")
        w_x0 = edm_loss_weight(snr_t.rsqrt(), sigma_data)
    if prediction_type == "epsilon":
        return w_x0 / snr_t
    if prediction_type == "v_prediction":
        return w_x0 / (snr_t + 1.0)
    if prediction_type == "flow_prediction":
        return w_x0 / (1.0 + snr_t.sqrt()) ** 2
    return w_x0


def diffusion_loss(pred: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                   reduce: bool = True) -> torch.Tensor:
    """Weighted mean squared error: mean_n w_n * mean_{c,h,w} (pred - target)^2 (``reduce=False``: the (N,) terms)."""
    per_example = (pred.float() - target.float()).pow(2).flatten(1).mean(1)  # (N,)
    if weight is not None:
        per_example = per_example * weight.flatten()
    return per_example.mean() if reduce else per_example
