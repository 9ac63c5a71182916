"""What every training-free sampling accelerator shares: the accelerator interface and the ways to put one on a
pipeline's denoiser for a session (``distill.accelerate.context``).

``accelerated(pipe, accelerator, **context)`` samples with it inside a ``with`` block; ``enable(pipe, accelerator)``
until ``disable(pipe)``; ``accelerated_denoiser`` on a sampling loop of one's own. The pipeline is still called as
``pipe(prompt, ...)``. An accelerator sees each network call as ``call(context, forward, *args, **kwargs)``: it
may call ``forward`` (the network, or the accelerators it wraps), change what it returns, or return an output of
its own without calling it; the context then records that no network ran, and the cost meter does not count it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from distill.accelerate.context import SamplingContext, Session, scheduler_calls
from distill.accelerate.registry import ACCELERATORS


class Accelerator:
    """Base class. ``attach(denoiser, context)`` once per session (hooks inside the network, checks, loading);
    ``begin(context, num_calls)`` before each trajectory, of which ``num_calls`` calls reach this accelerator
    (None: unknown); ``call`` on each of them; ``detach`` at the end."""

    name = "none"

    def attach(self, denoiser: torch.nn.Module, context: SamplingContext) -> None:
        self.denoiser, self.context = denoiser, context

    def detach(self) -> None:
        self.denoiser = None

    def begin(self, context: SamplingContext, num_calls: int | None) -> None:
        self.num_inference_steps, self.num_calls, self.scheduler_order = (context.num_inference_steps, num_calls,
                                                                          context.order)

    def call(self, context: SamplingContext, forward, *args, **kwargs):
        """One network call: plain here."""
        return forward(*args, **kwargs)

    def passed_calls(self, num_calls: int | None) -> int | None:
        """How many of the trajectory's ``num_calls`` calls (after ``begin``) reach the accelerators attached
        before this one, which it wraps (a forecast lets only its real calls through)."""
        return num_calls

    def describe(self) -> str:
        return self.name

    def check_scheduler(self, scheduler) -> None:
        """Fail now if this accelerator cannot sample with ``scheduler`` (a diffusers scheduler class or object)."""


@ACCELERATORS.register("none")
class NoAccelerator(Accelerator):
    """Plain sampling (the ``none`` option of a sweep)."""


class Chain(Accelerator):
    """Several accelerators at once, in order (a later one wraps the earlier ones: ``deepcache+forecast``
    forecasts some steps and caches features on the steps it computes)."""

    def __init__(self, parts: list[Accelerator]):
        self.parts = list(parts)
        self.name = "+".join(p.name for p in self.parts)

    def describe(self) -> str:
        return "+".join(p.describe() for p in self.parts)

    def attach(self, denoiser: torch.nn.Module, context: SamplingContext) -> None:
        for part in self.parts:
            part.attach(denoiser, context)
        super().attach(denoiser, context)

    def detach(self) -> None:
        for part in reversed(self.parts):
            part.detach()
        super().detach()

    def begin(self, context: SamplingContext, num_calls: int | None) -> None:
        super().begin(context, num_calls)
        for part in reversed(self.parts):  # outermost first: each counts the calls the ones around it let through
            part.begin(context, num_calls)
            num_calls = part.passed_calls(num_calls)

    def call(self, context: SamplingContext, forward, *args, **kwargs):
        for part in self.parts:
            forward = functools.partial(part.call, context, forward)
        return forward(*args, **kwargs)

    def passed_calls(self, num_calls: int | None) -> int | None:
        for part in reversed(self.parts):
            num_calls = part.passed_calls(num_calls)
        return num_calls

    def check_scheduler(self, scheduler) -> None:
        for part in self.parts:
            part.check_scheduler(scheduler)


def check_schedulers(accelerator: Accelerator | None, names) -> None:
    """Fail now if ``accelerator`` cannot sample with one of the schedulers ``names`` (``distill.inference``
    names; others, such as an export's own, are checked when they sample)."""
    import diffusers

    from distill.inference.schedulers import SCHEDULERS

    for name in names if accelerator is not None else ():
        if name in SCHEDULERS:
            accelerator.check_scheduler(getattr(diffusers, SCHEDULERS[name]))


_ENABLED: dict[int, tuple[object, Session]] = {}  # id(pipe) -> (pipe, its session), for disable(pipe)


def enable(pipe, accelerator: Accelerator, **context) -> SamplingContext:
    """``accelerator`` on ``pipe`` until ``disable(pipe)``: every later ``pipe(...)`` call samples with it.
    ``context``: the caller's fields of the ``SamplingContext`` (``scheduler_name``, ``guidance_scale``, ``labels``,
    ``prompts``), which the returned context's ``update`` changes for later calls."""
    from distill.families import denoiser_of

    disable(pipe)
    session = Session(denoiser_of(pipe), accelerator, SamplingContext(pipe=pipe).update(**context)).start()
    _ENABLED[id(pipe)] = (pipe, session)
    return session.context


def disable(pipe) -> None:
    """Remove the accelerator ``enable`` put on ``pipe`` (nothing if none)."""
    _, session = _ENABLED.pop(id(pipe), (None, None))
    if session is not None:
        session.stop()


@contextlib.contextmanager
def accelerated(pipe, accelerator: Accelerator | None, **context) -> Iterator[SamplingContext | None]:
    """``pipe`` sampling with ``accelerator`` inside the block (plain with None); yields the sampling context,
    whose ``step_end`` is the step callback to pass as ``callback_on_step_end``."""
    if accelerator is None:
        yield None
        return
    ctx = enable(pipe, accelerator, **context)
    try:
        yield ctx
    finally:
        disable(pipe)


@contextlib.contextmanager
def accelerated_denoiser(denoiser: torch.nn.Module, accelerator: Accelerator | None, num_inference_steps: int,
                     scheduler: str | None = None, guidance_scale: float | None = None, pipe=None,
                     **context) -> Iterator[torch.nn.Module]:
    """``accelerator`` on ``denoiser`` for one trajectory of ``num_inference_steps`` (a sampling loop that builds
    its own pipeline, e.g. a training method's ``generate``; ``pipe``: one like it, for its scheduler and VAE,
    whose calls for that many steps are counted on a copy of its scheduler); plain with None."""
    if accelerator is None:
        yield denoiser
        return
    calls, order = num_inference_steps, 1
    if pipe is not None:
        counted = type(pipe.scheduler).from_config(pipe.scheduler.config)
        counted.set_timesteps(num_inference_steps)
        calls, order = scheduler_calls(counted)[0], counted.order
    ctx = SamplingContext(pipe=pipe, scheduler_name=scheduler, guidance_scale=guidance_scale).update(**context)
    session = Session(denoiser, accelerator, ctx, follow=False).start()
    try:
        session.begin(num_inference_steps, calls, order)
        yield denoiser
    finally:
        session.stop()


def call_input(args, kwargs) -> torch.Tensor:
    """The noisy input of a denoiser call: the first argument, else ``sample`` (a UNet) or ``hidden_states``
    (a diffusers transformer, as the SD3 and Flux pipelines pass it)."""
    if args:
        return args[0]
    return kwargs["sample"] if "sample" in kwargs else kwargs["hidden_states"]


def output_tensor(out):
    """The sample tensor of a network call's output: a tensor, a tuple or a diffusers ``BaseOutput``."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple):
        return out[0]
    return out.sample


def like_output(out, sample: torch.Tensor):
    """``sample`` in the form of the network output ``out``."""
    if isinstance(out, torch.Tensor):
        return sample
    if isinstance(out, tuple):
        return (sample, *out[1:])
    return type(out)(sample=sample)
