"""Sampling that depends on the call's generator alone, also where a stock pipeline draws from the global RNG."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def global_rng_seeded_by(generator: torch.Generator | list[torch.Generator] | None) -> Iterator[None]:
    """Inside: torch's global RNG (CPU and every CUDA device) seeded by ``generator.initial_seed()``; outside: as it
    was. diffusers' StableDiffusion3Pipeline and FluxPipeline call ``scheduler.step`` without the call's generator,
    so a scheduler that adds noise between steps (FlowMatchLCMScheduler: a consistency student sampled in several
    steps) draws it from the global RNG; under this context the images are a function of the call's seed, as the
    starting noise is, and a training's own RNG stream is left untouched. ``None``: nothing changes."""
    if generator is None:
        yield
        return
    first = generator[0] if isinstance(generator, list) else generator
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(first.initial_seed())
        yield
