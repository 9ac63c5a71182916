"""What every training-free sampling accelerator shares: hooks on a pipeline's UNet that live for one sampling call
or until removed, a fresh state at the start of each pipeline call, and honest evaluation counts.

An accelerator attaches to the denoiser (``attach(unet)``) through diffusers' hook registry, so the pipeline is
still called as ``pipe(prompt, ...)``. ``accelerated(pipe, accelerator)`` attaches it for a ``with`` block;
``enable(pipe, accelerator)`` until ``disable(pipe)``. Each pipeline call opens its progress bar once before the
first denoising step, after setting the scheduler's timesteps (one per UNet call): that is where the
accelerator's state is reset, so every call starts a new trajectory. A pipeline without a progress bar cannot
be accelerated this way; a sampling loop of one's own uses ``accelerated_unet``. A trajectory's length is counted in
UNet calls (``scheduler_calls``), not steps: Heun calls twice a step, PNDM once more for its PLMS warm-up, and
img2img or inpainting at ``strength < 1`` runs only the last steps of the scheduler's timesteps.

A call of the UNet whose output was predicted instead of computed sets ``unet._distill_predicted``; the NFE
counter (``distill.metrics.cost.NFECounter``) does not count it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from diffusers.hooks import HookRegistry, ModelHook

PREDICTED = "_distill_predicted"  # set on the UNet after a call whose output no network computed


class Accelerator:
    """Base class: ``attach`` / ``detach`` hooks on a UNet, ``reset`` before each trajectory of
    ``num_inference_steps`` steps that calls the UNet ``num_calls`` times (``scheduler_calls``; None when unknown)
    with a scheduler of ``order`` (2: two calls a step at two points, as Heun's)."""

    name = "none"

    def attach(self, unet: torch.nn.Module) -> None:
        self.unet = unet

    def detach(self) -> None:
        self.unet = None

    def reset(self, num_inference_steps: int | None = None, num_calls: int | None = None, order: int = 1) -> None:
        self.num_inference_steps, self.scheduler_order = num_inference_steps, order
        self.num_calls = num_calls if num_calls is not None else num_inference_steps

    def passed_calls(self, num_calls: int | None) -> int | None:
        """How many of the trajectory's ``num_calls`` calls (after ``reset``) reach the accelerators attached
        before this one, which it wraps (a forecast lets only its real calls through)."""
        return num_calls

    def describe(self) -> str:
        return self.name

    def check_scheduler(self, scheduler) -> None:
        """Fail now if this accelerator cannot sample with ``scheduler`` (a diffusers scheduler class or object)."""

    def use_scheduler(self, name: str, guidance_scale: float | None = None) -> None:
        """The scheduler (name) and guidance scale the next calls sample with (what a fitted forecaster looks up)."""

    def use_pipeline(self, pipe) -> None:
        """The pipeline the accelerator is enabled on (its scheduler, VAE: what classifier guidance needs)."""

    def use_labels(self, labels: torch.Tensor | None) -> None:
        """The class label of each prompt of the next calls (-1: none), for guidance by a classifier."""

    def use_prompts(self, prompts: list[str] | None) -> None:
        """The prompts of the next calls (also where the pipeline samples the empty one), for guidance by CLIP."""


class NoAccelerator(Accelerator):
    """Plain sampling (the ``none`` option of a sweep)."""


class Chain(Accelerator):
    """Several accelerators at once, attached in order (a later one wraps the earlier ones: ``deepcache+forecast``
    forecasts some steps and caches features on the steps it computes)."""

    def __init__(self, parts: list[Accelerator]):
        self.parts = list(parts)
        self.name = "+".join(p.name for p in self.parts)

    def describe(self) -> str:
        return "+".join(p.describe() for p in self.parts)

    def attach(self, unet: torch.nn.Module) -> None:
        for part in self.parts:
            part.attach(unet)
        super().attach(unet)

    def detach(self) -> None:
        for part in reversed(self.parts):
            part.detach()
        super().detach()

    def reset(self, num_inference_steps: int | None = None, num_calls: int | None = None, order: int = 1) -> None:
        super().reset(num_inference_steps, num_calls, order)
        calls = self.num_calls
        for part in reversed(self.parts):  # outermost first: each counts the calls the ones around it let through
            part.reset(num_inference_steps, calls, order)
            calls = part.passed_calls(calls)

    def passed_calls(self, num_calls: int | None) -> int | None:
        for part in reversed(self.parts):
            num_calls = part.passed_calls(num_calls)
        return num_calls

    def check_scheduler(self, scheduler) -> None:
        for part in self.parts:
            part.check_scheduler(scheduler)

    def use_scheduler(self, name: str, guidance_scale: float | None = None) -> None:
        for part in self.parts:
            part.use_scheduler(name, guidance_scale)

    def use_pipeline(self, pipe) -> None:
        for part in self.parts:
            part.use_pipeline(pipe)

    def use_labels(self, labels: torch.Tensor | None) -> None:
        for part in self.parts:
            part.use_labels(labels)

    def use_prompts(self, prompts: list[str] | None) -> None:
        for part in self.parts:
            part.use_prompts(prompts)


def check_schedulers(accelerator: Accelerator | None, names) -> None:
    """Fail now if ``accelerator`` cannot sample with one of the schedulers ``names`` (``distill.inference``
    names; others, such as an export's own, are checked when they sample)."""
    import diffusers

    from distill.inference.schedulers import SCHEDULERS

    for name in names if accelerator is not None else ():
        if name in SCHEDULERS:
            accelerator.check_scheduler(getattr(diffusers, SCHEDULERS[name]))


class CallHook(ModelHook):
    """A diffusers ``ModelHook`` that hands each forward call to ``fn(original_forward, *args, **kwargs)``."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def new_forward(self, module: torch.nn.Module, *args, **kwargs):
        return self.fn(self.fn_ref.original_forward, *args, **kwargs)


def add_hook(module: torch.nn.Module, name: str, fn) -> None:
    HookRegistry.check_if_exists_or_initialize(module).register_hook(CallHook(fn), name)


def remove_hook(module: torch.nn.Module, name: str) -> None:
    """Remove hook ``name`` of ``module``; it must be the last one registered there (diffusers' registry rewires
    a removed inner hook's wrapper, not the outer hook's reference to it). With none left, ``module.forward`` is
    the class's again."""
    registry = getattr(module, "_diffusers_hook", None)
    if registry is None or registry.get_hook(name) is None:
        return
    if registry._hook_order[-1] != name:
        raise RuntimeError(f"hook {name!r} of {type(module).__name__} is wrapped by {registry._hook_order[-1]!r}; "
                           "remove hooks in the reverse order of adding them")
    registry.remove_hook(name, recurse=False)
    if not registry.hooks:
        module.__dict__.pop("forward", None)


def scheduler_calls(scheduler, num_inference_steps: int) -> int:
    """The UNet calls of a pipeline loop of ``num_inference_steps`` steps with ``scheduler`` after its
    ``set_timesteps``: the timesteps the loop iterates (two a step for Heun, PNDM's extra PLMS warm-up call),
    from the one it begins at. At ``strength < 1`` img2img and inpainting run the last ``num_inference_steps``
    of the scheduler's ``scheduler.num_inference_steps`` and skip the first ``t_start * order`` timesteps
    (diffusers' ``get_timesteps``, which also sets ``begin_index`` where the scheduler has one)."""
    begin = getattr(scheduler, "begin_index", None)
    if begin is None:
        scheduled = getattr(scheduler, "num_inference_steps", None) or num_inference_steps
        begin = max(scheduled - num_inference_steps, 0) * getattr(scheduler, "order", 1)
    return len(scheduler.timesteps) - begin


def _reset_on_call(pipe, accelerator: Accelerator):
    original = pipe.progress_bar

    def progress_bar(iterable=None, total=None):
        steps = total if total is not None else (len(iterable) if iterable is not None else None)
        scheduler = pipe.scheduler  # its timesteps are set before the loop
        known = steps is not None and getattr(scheduler, "timesteps", None) is not None
        accelerator.reset(steps, scheduler_calls(scheduler, steps) if known else steps, getattr(scheduler, "order", 1))
        return original(iterable=iterable, total=total)

    return original, progress_bar


def enable(pipe, accelerator: Accelerator):
    """``accelerator`` on ``pipe`` until ``disable(pipe)``: every later ``pipe(...)`` call samples with it."""
    disable(pipe)
    accelerator.use_pipeline(pipe)
    accelerator.attach(pipe.unet)
    accelerator.reset()
    own = pipe.__dict__.get("progress_bar")  # an instance override of the class's method, kept
    _, pipe.progress_bar = _reset_on_call(pipe, accelerator)
    pipe._distill_accelerator = (accelerator, own)
    return pipe


def disable(pipe) -> None:
    """Remove the accelerator ``enable`` put on ``pipe`` (nothing if none)."""
    state = pipe.__dict__.pop("_distill_accelerator", None)
    if state is not None:
        accelerator, own = state
        accelerator.detach()
        del pipe.__dict__["progress_bar"]  # back to the class's method ...
        if own is not None:
            pipe.progress_bar = own  # ... or to what the instance had


@contextlib.contextmanager
def accelerated(pipe, accelerator: Accelerator | None) -> Iterator:
    """``pipe`` sampling with ``accelerator`` inside the block (plain with None)."""
    if accelerator is None:
        yield pipe
        return
    enable(pipe, accelerator)
    try:
        yield pipe
    finally:
        disable(pipe)


@contextlib.contextmanager
def accelerated_unet(unet: torch.nn.Module, accelerator: Accelerator | None, num_inference_steps: int,
                     scheduler: str | None = None, guidance_scale: float | None = None, pipe=None) -> Iterator:
    """``accelerator`` on ``unet`` for one trajectory of ``num_inference_steps`` (a sampling loop that builds
    its own pipeline, e.g. a training method's ``generate``; ``pipe``: one like it, for its scheduler and VAE,
    whose calls for that many steps are counted on a copy of its scheduler); plain with None."""
    if accelerator is None:
        yield unet
        return
    if scheduler is not None:
        accelerator.use_scheduler(scheduler, guidance_scale)
    if pipe is not None:
        accelerator.use_pipeline(pipe)
    calls, order = num_inference_steps, 1
    if pipe is not None:
        counted = type(pipe.scheduler).from_config(pipe.scheduler.config)
        counted.set_timesteps(num_inference_steps)
        calls, order = scheduler_calls(counted, num_inference_steps), counted.order
    accelerator.attach(unet)
    try:
        accelerator.reset(num_inference_steps, calls, order)
        yield unet
    finally:
        accelerator.detach()


def output_tensor(out):
    """The sample tensor of a UNet call's output: a tensor, a tuple or a diffusers ``BaseOutput``."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple):
        return out[0]
    return out.sample


def like_output(out, sample: torch.Tensor):
    """``sample`` in the form of the UNet output ``out``."""
    if isinstance(out, torch.Tensor):
        return sample
    if isinstance(out, tuple):
        return (sample, *out[1:])
    return type(out)(sample=sample)
