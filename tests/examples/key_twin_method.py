"""A method whose settings are named like LCM's (``num_ddim_timesteps``, ``ema_decay``, ``sigma_data``, a guidance
range) and latent diffusion's (``vae``, here a loss weight) and mean something else. The config checks a method by its own class (``check_config``), never by the
names of its keys, so none of LCM's checks reach it; registered from this one file, it is an option of the method
group::

    DISTILL_PLUGINS=tests.examples.key_twin_method python -m distill.train method=key_twin

It only stands for a method's settings (tests/test_registries.py composes and validates it; nothing trains it).
"""

from __future__ import annotations

from collections.abc import Callable

from distill.methods import METHODS
from distill.methods.base import DistillMethod


@METHODS.register("key_twin")
class KeyTwin(DistillMethod):
    """Settings only: ``num_ddim_timesteps`` (0: none), ``ema_decay`` (a growth factor, >= 1), ``sigma_data`` and an
    inverted guidance range, each of which LCM's checks would refuse; ``vae``, a number, is no VAE to check the
    student's sample size against."""

    def __init__(self, student=None, optimizer: Callable | None = None, num_ddim_timesteps: int = 0,
                 ema_decay: float = 1.5, sigma_data: float = 0.7, guidance_scale_min: float = 8.0,
                 guidance_scale_max: float = 4.0, vae: float = 0.5, sampling: dict | None = None):
        super().__init__(optimizer)

    @classmethod
    def check_config(cls, cfg) -> None:
        if cfg.method.ema_decay < 1.0:
            raise ValueError(f"method.ema_decay={cfg.method.ema_decay} is key_twin's growth factor: it must be >= 1")
