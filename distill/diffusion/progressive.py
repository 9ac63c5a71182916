"""Progressive distillation math (Salimans & Ho 2022, "Progressive Distillation for Fast Sampling")."""

from __future__ import annotations

import torch


def progressive_x_target(
    x_t: torch.Tensor, x_end: torch.Tensor, alpha_t: torch.Tensor, sigma_t: torch.Tensor,
    alpha_end: torch.Tensor, sigma_end: torch.Tensor,
) -> torch.Tensor:
    """The x0 target that makes ONE student DDIM step t -> t'' land on x_end = two teacher steps
    (Algorithm 2): x~ = (x_end - (sigma_end / sigma_t) x_t) / (alpha_end - (sigma_end / sigma_t) alpha_t)."""
    ratio = sigma_end / sigma_t
    return (x_end - ratio * x_t) / (alpha_end - ratio * alpha_t)


def round_schedule(start_steps: int, final_steps: int) -> list[int]:
    """Student step counts of each round: start/2, start/4, ..., final (each round halves the teacher's)."""
    if final_steps < 1 or start_steps < 1:
        raise ValueError(f"step counts must be >= 1; got start={start_steps}, final={final_steps}")
    if final_steps >= start_steps:
        raise ValueError(f"final step count {final_steps} must be below the start {start_steps}")
    if start_steps % final_steps or (start_steps // final_steps) & (start_steps // final_steps - 1):
        raise ValueError(
            f"start={start_steps} and final={final_steps} are not powers of two apart; "
            f"use e.g. start={final_steps * 2 ** max(1, (start_steps // final_steps).bit_length() - 1)}"
        )
    rounds, steps = [], start_steps
    while steps > final_steps:
        steps //= 2
        rounds.append(steps)
    return rounds
