"""Sampling schedulers by name, each built ``from_config`` of the model's training noise schedule."""

from __future__ import annotations

from typing import Any

import diffusers

SCHEDULERS: dict[str, str] = {
    "ddpm": "DDPMScheduler",
    "ddim": "DDIMScheduler",
    "dpmsolver": "DPMSolverMultistepScheduler",
    "unipc": "UniPCMultistepScheduler",
    "euler": "EulerDiscreteScheduler",
    "heun": "HeunDiscreteScheduler",
    "lcm": "LCMScheduler",
    "tcd": "TCDScheduler",
}


def make_scheduler(name: str, base_config: Any, **options: Any):
    """``diffusers.<Class>.from_config(base_config, **options)`` for a scheduler ``name``."""
    if name not in SCHEDULERS:
        raise ValueError(f"scheduler.name={name!r} is unknown; use one of {sorted(SCHEDULERS)}")
    cls = getattr(diffusers, SCHEDULERS[name])
    return cls.from_config(base_config, **options)
