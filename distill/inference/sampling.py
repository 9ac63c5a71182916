"""One guided sampling loop for every diffusers scheduler (Ho & Salimans 2022 classifier-free guidance)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from distill.diffusion import cfg
from distill.models.conditioning import concat_conditions


@torch.no_grad()
def sample(
    model: Callable[..., torch.Tensor],
    scheduler,
    noise: torch.Tensor,
    cond: dict,
    uncond: dict | None = None,
    guidance_scale: float = 1.0,
    num_inference_steps: int = 50,
    generator: torch.Generator | None = None,
    callback_on_step_end: Callable[[int, torch.Tensor, dict], dict] | None = None,
) -> torch.Tensor:
    """Integrate from ``noise`` (N, C, H, W) to x0 with ``scheduler``; returns (N, C, H, W).

    ``model(x, t, **cond)`` returns the network output in the scheduler's prediction type.
    With guidance_scale != 1 the conditional and unconditional passes run as one batch:
    out = out_uncond + w * (out_cond - out_uncond). ``callback_on_step_end(i, t, {"latents": x})`` after each
    step, as diffusers' pipelines call theirs (without the pipeline), returns the tensors to go on with.
    """
    scheduler.set_timesteps(num_inference_steps, device=noise.device)
    # stochastic schedulers (DDPM, multistep LCM, TCD) draw their noise from ``generator``, so a seeded call repeats
    step_kwargs = {"generator": generator} if "generator" in inspect.signature(scheduler.step).parameters else {}
    x = noise * scheduler.init_noise_sigma
    guided = uncond is not None and guidance_scale != 1.0
    both = concat_conditions(cond, uncond) if guided else cond
    for i, t in enumerate(scheduler.timesteps):
        x_in = scheduler.scale_model_input(x, t)
        if guided:
            out = cfg(*model(torch.cat([x_in, x_in]), t, **both).chunk(2), guidance_scale)
        else:
            out = model(x_in, t, **both)
        x = scheduler.step(out, t, x, **step_kwargs).prev_sample
        if callback_on_step_end is not None:
            x = callback_on_step_end(i, t, {"latents": x}).get("latents", x)
    return x
