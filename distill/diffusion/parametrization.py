"""eps / x0 / v parametrisations and the conversions between them.

Names follow diffusers' ``prediction_type``: ``epsilon``, ``sample`` (x0) and ``v_prediction``
(v = alpha_t * eps - sigma_t * x0, Salimans & Ho 2022, sec. 4).
"""

from __future__ import annotations

import torch

PREDICTION_TYPES = ("epsilon", "sample", "v_prediction")


def check_prediction_type(prediction_type: str) -> None:
    if prediction_type not in PREDICTION_TYPES:
        raise ValueError(
            f"prediction_type={prediction_type!r} is not supported; use one of {PREDICTION_TYPES}"
        )


def prediction_target(
    prediction_type: str, x0: torch.Tensor, eps: torch.Tensor, alpha: torch.Tensor, sigma: torch.Tensor
) -> torch.Tensor:
    """The regression target of the network for each parametrisation."""
    check_prediction_type(prediction_type)
    if prediction_type == "epsilon":
        return eps
    if prediction_type == "sample":
        return x0
    return alpha * eps - sigma * x0


def to_x0_eps(
    prediction_type: str, pred: torch.Tensor, x_t: torch.Tensor, alpha: torch.Tensor, sigma: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recover (x0, eps) from a network output, using alpha_t^2 + sigma_t^2 = 1."""
    check_prediction_type(prediction_type)
    if prediction_type == "epsilon":
        return (x_t - sigma * pred) / alpha, pred
    if prediction_type == "sample":
        return pred, (x_t - alpha * pred) / sigma
    return alpha * x_t - sigma * pred, sigma * x_t + alpha * pred
