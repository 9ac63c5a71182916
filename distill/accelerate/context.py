"""The one sampling context every accelerator receives, and the session that keeps it for a denoiser.

A session (``Session``) puts one hook on the denoiser and hands each of its calls to the accelerator together
with the ``SamplingContext``: what the sampling call knows (its pipeline and scheduler, the scheduler's name and
the guidance scale it samples with, the batch's class labels and prompts), where the trajectory stands (its
length in network calls, the calls so far, the denoising step from the step callback) and what ran on the current
call (the whole network, a cached part of it, or nothing: a prediction). The cost meter
(``distill.metrics.cost.NFECounter``) reads that last field through ``context_of(denoiser)``.

A trajectory begins at the first denoiser call after the scheduler's ``set_timesteps`` (every diffusers pipeline
and ``distill.inference.sampling.sample`` call it once per call, before the first step), so each pipeline call
starts afresh, also after one that stopped early. A loop of one's own without a pipeline gives the trajectory's
length up front (``Session.begin``). Its length is counted in network calls, not steps (``scheduler_calls``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Literal

import torch

from distill.accelerate.hooks import add_hook, remove_hook

Ran = Literal["full", "cached", "predicted"]
HOOK = "distill_sampling_session"


@dataclass
class SamplingContext:
    """What one accelerated sampling call tells its accelerators.

    ``pipe`` is the sampled pipeline (its ``scheduler`` and VAE; None for a loop of one's own). The caller fills
    ``scheduler_name`` (the ``distill.inference`` name, what a fitted forecaster looks coefficients up by),
    ``guidance_scale``, ``labels`` (each prompt's class, -1: none) and ``prompts``; the session fills the rest as
    the trajectory runs."""

    pipe: Any = None
    scheduler_name: str | None = None
    guidance_scale: float | None = None
    labels: torch.Tensor | None = None
    prompts: list[str] | None = None
    num_inference_steps: int | None = None  # the steps this trajectory runs (None: unknown)
    num_calls: int | None = None  # the network calls it makes (Heun: two a step; None: unknown)
    order: int = 1  # the scheduler's order (2: two calls a step at two points)
    call: int = -1  # index of the current network call in the trajectory, predicted ones included
    step: int = 0  # denoising steps done (from ``step_end``, the step callback; 0 where the loop gives none)
    ran: Ran = "full"  # what computed the current call's output: the whole network, part of it, or no network

    @property
    def scheduler(self):
        """The scheduler sampling now: the pipeline's (None for a loop without one)."""
        return self.pipe.scheduler if self.pipe is not None else None

    def update(self, **values) -> SamplingContext:
        """Set the caller's fields for the next calls (``scheduler_name``, ``guidance_scale``, ``labels``, ...)."""
        for key, value in values.items():
            if key not in CALLER_FIELDS:
                raise TypeError(f"SamplingContext.update({key}=...): a caller sets only {sorted(CALLER_FIELDS)}")
            setattr(self, key, value)
        return self

    def step_end(self, pipe, step: int, timestep, callback_kwargs: dict) -> dict:
        """diffusers' ``callback_on_step_end``: ``step`` (from 0) is done; the tensors are passed on unchanged."""
        self.step = step + 1
        return callback_kwargs


CALLER_FIELDS = frozenset({"scheduler_name", "guidance_scale", "labels", "prompts"})  # the pipe is the session's
_ACTIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # denoiser -> its session's context


def context_of(denoiser: torch.nn.Module) -> SamplingContext | None:
    """The context of the session on ``denoiser`` (None when it samples plainly)."""
    return _ACTIVE.get(denoiser)


def _timestep_value(timestep) -> float | None:
    if timestep is None:
        return None
    return float(timestep.flatten()[0]) if torch.is_tensor(timestep) else float(timestep)


def scheduler_calls(scheduler, first_timestep=None) -> tuple[int, int | None]:
    """``(calls, steps)`` of a loop over ``scheduler``'s timesteps (after ``set_timesteps``) from the one it
    begins at: two calls a step for Heun, PNDM's extra PLMS warm-up call. img2img and inpainting at
    ``strength < 1`` skip the first ``t_start * order`` timesteps: where the scheduler has a ``begin_index``
    (diffusers' ``get_timesteps`` sets it), the loop begins there, else at the first call's timestep."""
    timesteps = scheduler.timesteps
    begin = getattr(scheduler, "begin_index", None)
    if begin is None:
        t = _timestep_value(first_timestep)
        hits = (timesteps.float() == t).nonzero() if t is not None else []
        begin = int(hits[0, 0]) if len(hits) else 0
    order = getattr(scheduler, "order", 1)
    scheduled = getattr(scheduler, "num_inference_steps", None)
    return len(timesteps) - begin, (scheduled - begin // order) if scheduled else None


class Session:
    """``accelerator`` on ``denoiser`` with ``context``: one hook hands it each call. ``follow``: a pipeline's
    trajectories, each begun at the first call after its scheduler set new timesteps."""

    def __init__(self, denoiser: torch.nn.Module, accelerator, context: SamplingContext, follow: bool = True):
        self.denoiser, self.accelerator, self.context, self.follow = denoiser, accelerator, context, follow
        self._timesteps = None  # the scheduler's timesteps of the current trajectory (held: identity is the key)

    def start(self) -> Session:
        if self.denoiser in _ACTIVE:
            raise RuntimeError(f"the {type(self.denoiser).__name__} already samples with an accelerator; disable it "
                               "first (distill.accelerate.disable) or chain them (Chain, presets a+b)")
        self.accelerator.attach(self.denoiser, self.context)
        try:
            add_hook(self.denoiser, HOOK, self._call)
        except BaseException:
            self.accelerator.detach()
            raise
        _ACTIVE[self.denoiser] = self.context
        return self

    def stop(self) -> None:
        _ACTIVE.pop(self.denoiser, None)
        remove_hook(self.denoiser, HOOK)  # added after the accelerator's own: removed first
        self.accelerator.detach()

    def begin(self, num_inference_steps: int | None = None, num_calls: int | None = None, order: int = 1) -> None:
        """A new trajectory of ``num_inference_steps`` steps and ``num_calls`` network calls (default: one a step)."""
        ctx = self.context
        ctx.num_inference_steps, ctx.order = num_inference_steps, order
        ctx.num_calls = num_calls if num_calls is not None else num_inference_steps
        ctx.call, ctx.step = -1, 0
        self.accelerator.begin(ctx, ctx.num_calls)

    def _follow(self, timestep) -> None:
        scheduler = self.context.scheduler
        timesteps = getattr(scheduler, "timesteps", None)
        if timesteps is None or timesteps is self._timesteps:
            return
        self._timesteps = timesteps
        calls, steps = scheduler_calls(scheduler, timestep)
        self.begin(steps, calls, getattr(scheduler, "order", 1))

    def _call(self, forward, *args, **kwargs):
        ctx = self.context
        if self.follow:
            self._follow(args[1] if len(args) > 1 else kwargs.get("timestep"))
        ctx.call += 1
        ctx.ran = "predicted"  # until the network itself is called

        def network(*a, **k):
            ctx.ran = "full"  # an accelerator that reuses part of the network says "cached" while it runs
            return forward(*a, **k)

        return self.accelerator.call(ctx, network, *args, **kwargs)
