"""DeepCache (Ma, Fang & Wang 2023): reuse a UNet's deep features between adjacent denoising steps.

A UNet's skip connections are numbered in the order the encoder produces them: 0 is ``conv_in``'s output, then
one per down-block layer (a resnet with its attention) and one per downsampler. Skip branch ``b`` keeps every
layer that produces or consumes a skip ``<= b`` (the shallow part: ``conv_in``, the first down layers, the last up
layers, ``conv_out``) and caches every deeper one (the rest of the encoder, the mid block, the first up layers).
On a full step the whole UNet runs and each deep layer's output is stored; on a cached step the deep layers return
what they stored and only the shallow branch is computed, so the up layer at depth ``b`` joins the cached deep
feature with a fresh skip ``b``, as in the paper (Fig. 2; branch 0 is the paper's shallowest, fastest choice).

Schedules over the ``T`` calls that reach the cache in a trajectory: ``uniform`` runs the full UNet every
``interval``-th call (0, N, 2N, ...); ``nonuniform`` places as many full calls, ``ceil(T / interval)``, by the
paper's non-uniform 1:N strategy around ``center * T`` (``full_steps``: equal to the DeepCache package's
``sample_from_quad_center``). Inside a chain with a forecast, ``T`` counts only the forecast's real calls.

Every UNet inside the denoiser (one for a plain or compressed UNet, one per expert of a timestep MoE) keeps its
own cache (layers shared by experts included); the calls are counted once, at the denoiser (``call``), over a
trajectory of as many calls as the scheduler makes (``SamplingContext.num_calls``: Heun calls twice a step); a
UNet's first call, or one whose batch or dtype differs from the cached one, runs in full, and a cached call is
recorded in the context (``ran = "cached"``). The
package ``DeepCache`` (0.1.1) patches a pipeline's ``unet.down_blocks`` the same way but needs the UNet to be
the pipeline's ``unet`` component (no MoE), finds the step by ``scheduler.timesteps.index(t)`` (wrong where a scheduler repeats a
timestep) and implements its non-uniform schedule only in pipelines copied from diffusers 0.24; the tests check
this implementation against its ``DeepCacheSDHelper`` on a Stable Diffusion layout.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from torch import nn

from distill.accelerate.base import Accelerator
from distill.accelerate.hooks import add_hook, remove_hook
from distill.accelerate.registry import ACCELERATORS

HOOK = "distill_deepcache"
SCHEDULES = ("uniform", "nonuniform")
# the non-uniform schedule's centre (a fraction of the steps) and power: DeepCache's own Stable Diffusion example
# (stable_diffusion.py) passes center=15 of its 50 steps and pow=1.4
CENTER, POWER = 0.3, 1.4


def is_unet(module: nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("conv_in", "down_blocks", "mid_block", "up_blocks"))


def branch_layers(unet: nn.Module) -> tuple[list[tuple[str, nn.Module, float]], int]:
    """``([(name, layer, depth), ...], number of skips)``: each cacheable layer of ``unet`` with the skip index
    it produces (encoder) or consumes (decoder); the mid block is infinitely deep; an upsampler has the depth of
    its block's last layer, whose output it upsamples."""
    layers, depth = [], 0

    def layer_pairs(prefix: str, block) -> list[tuple[list[tuple[str, nn.Module]]]]:
        attentions = getattr(block, "attentions", None)
        pairs = []
        for i, resnet in enumerate(block.resnets):
            pair = [(f"{prefix}.resnets.{i}", resnet)]
            if attentions is not None and i < len(attentions):
                pair.append((f"{prefix}.attentions.{i}", attentions[i]))
            pairs.append(pair)
        return pairs

    for k, block in enumerate(unet.down_blocks):
        for pair in layer_pairs(f"down_blocks.{k}", block):
            depth += 1
            layers += [(name, m, depth) for name, m in pair]
        for i, down in enumerate(getattr(block, "downsamplers", None) or []):
            depth += 1
            layers.append((f"down_blocks.{k}.downsamplers.{i}", down, depth))
    skips = depth + 1  # conv_in's output is skip 0
    if unet.mid_block is not None:
        layers.append(("mid_block", unet.mid_block, math.inf))
    consumed = depth
    for k, block in enumerate(unet.up_blocks):
        last = math.inf
        for pair in layer_pairs(f"up_blocks.{k}", block):
            layers += [(name, m, consumed) for name, m in pair]
            last, consumed = consumed, consumed - 1
        for i, up in enumerate(getattr(block, "upsamplers", None) or []):
            layers.append((f"up_blocks.{k}.upsamplers.{i}", up, last))
    return layers, skips


def full_steps(num_steps: int, interval: int, schedule: str = "uniform", center: float = CENTER,
               power: float = POWER) -> list[int]:
    """The steps (of ``num_steps``) on which the whole UNet runs; always step 0.

    ``nonuniform`` is DeepCache's non-uniform 1:N strategy (Ma et al. 2023, Sec. 3.3), ``k = ceil(T / N)`` full
    steps ``0`` and ``floor(linspace((-c)^(1/p), (T-c)^(1/p), k+1)^p) + c`` without its two ends, ``c`` the step
    nearest ``center * T``. DeepCache's code (``sample_from_quad_center``, which gave the paper's numbers) takes
    ``(-c)^(1/p)`` as the principal complex root and keeps the real part of the p-th power, truncated; this does
    the same, so the points are slightly denser near ``c`` than a uniform grid, not spaced as ``|u|^p``. Where two
    points truncate to one step, ``p`` is lowered by 0.02 until none do, as there; a ``ValueError`` where no
    ``p > 1`` gives ``k`` distinct steps."""
    if schedule == "uniform" or interval == 1 or num_steps <= 2:
        return list(range(0, num_steps, interval))
    count, c = math.ceil(num_steps / interval), int(center * num_steps + 0.5)
    p = power
    while p > 1:
        u = np.linspace(complex(-c) ** (1 / p), (num_steps - c) ** (1 / p), count + 1)
        offsets = np.unique(np.trunc((u ** p).real).astype(np.int64))[1:-1]  # both ends dropped
        steps = [0] + [c + int(o) for o in offsets]
        if len(steps) == count:
            return steps
        p -= 0.02
    raise ValueError(f"accelerate.options.schedule=nonuniform cannot place {count} distinct full steps among "
                     f"{num_steps} (interval={interval}, center={center}, power={power}); use a larger interval, "
                     "a higher power or schedule=uniform")


class _UNetCache:
    """The cache of one UNet: its deep layers' outputs, and whether the current call is a full one."""

    def __init__(self, unet: nn.Module, branch: int, owner: DeepCache):
        layers, skips = branch_layers(unet)
        if branch >= skips:
            raise ValueError(f"accelerate.options.branch={branch} is beyond this UNet's {skips} skip branches "
                             f"(0..{skips - 1}); use a smaller branch")
        self.network, self.owner = unet, owner
        self.deep = [(name, m) for name, m, depth in layers if depth > branch]
        self.full, self.key = True, None
        self.outputs: dict[int, object] = {}  # by id of the deep module
        add_hook(unet, HOOK, self._unet_call)

    def _unet_call(self, forward, *args, **kwargs):
        sample = args[0] if args else kwargs["sample"]
        key = (tuple(sample.shape), sample.dtype, sample.device)
        # a new batch shape, or a first call (e.g. an expert that starts mid-trajectory) runs in full
        self.full = self.key != key or self.owner.is_full(self.owner.step)
        if self.full:
            self.outputs.clear()
        else:
            self.owner.context.ran = "cached"
        self.key = key
        previous, self.owner.active = self.owner.active, self
        try:
            return forward(*args, **kwargs)
        finally:
            self.owner.active = previous

    def layer_call(self, module_id: int, forward, *args, **kwargs):
        if not self.full and module_id in self.outputs:
            return self.outputs[module_id]
        out = forward(*args, **kwargs)
        self.outputs[module_id] = out
        return out

    def reset(self) -> None:
        self.full, self.key = True, None
        self.outputs.clear()

    def remove(self) -> None:
        remove_hook(self.network, HOOK)


@ACCELERATORS.register("deepcache")
class DeepCache(Accelerator):
    """Cache the deep features of every UNet in the denoiser: the whole UNet on the full steps of ``schedule``
    (every ``interval``-th), the shallow skip branch ``branch`` only on the others. ``interval=1`` is plain
    sampling."""

    name = "deepcache"

    def __init__(self, interval: int = 3, branch: int = 0, schedule: str = "uniform", center: float = CENTER,
                 power: float = POWER):
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"accelerate.options.interval={interval!r} must be an integer >= 1 (1 = no caching)")
        if isinstance(branch, bool) or not isinstance(branch, int) or branch < 0:
            raise ValueError(f"accelerate.options.branch={branch!r} must be an integer >= 0 (0 = the shallowest skip)")
        if schedule not in SCHEDULES:
            raise ValueError(f"accelerate.options.schedule={schedule!r} is not one of {list(SCHEDULES)}")
        if not 0.0 <= center <= 1.0:
            raise ValueError(f"accelerate.options.center={center} must be in [0, 1] (a fraction of the steps)")
        if power < 1.0:
            raise ValueError(f"accelerate.options.power={power} must be >= 1 (1 = evenly spaced)")
        self.interval, self.branch, self.schedule, self.center, self.power = interval, branch, schedule, center, power
        self.caches: list[_UNetCache] = []
        self.layers: list[nn.Module] = []  # each deep layer once, though experts may share it
        self.active: _UNetCache | None = None  # the UNet whose call is running
        self.num_inference_steps, self.num_calls, self._full, self.step = None, None, None, -1

    def describe(self) -> str:
        extra = "" if self.schedule == "uniform" else f",{self.schedule}"
        return f"deepcache(N={self.interval},b={self.branch}{extra})"

    def attach(self, denoiser: nn.Module, context) -> None:
        self.detach()
        unets = [m for m in denoiser.modules() if is_unet(m)]
        if not unets:
            raise ValueError(f"accelerate=deepcache needs a UNet (conv_in, down_blocks, mid_block, up_blocks); "
                             f"the denoiser is a {type(denoiser).__name__}")
        try:
            for inner in unets:
                self.caches.append(_UNetCache(inner, self.branch, self))
        except ValueError:
            self.detach()
            raise
        seen = {}
        for cache in self.caches:
            for _, module in cache.deep:
                seen.setdefault(id(module), module)
        self.layers = list(seen.values())
        for module in self.layers:  # one hook per module, answering for whichever UNet is running
            add_hook(module, HOOK, functools.partial(self._layer_call, id(module)))
        super().attach(denoiser, context)

    def call(self, context, forward, *args, **kwargs):
        # counted once, at the denoiser (an MoE's experts share it), inside any accelerator chained after this
        # one (a forecast's predicted calls compute nothing and count not)
        self.step += 1
        return forward(*args, **kwargs)

    def _layer_call(self, module_id: int, forward, *args, **kwargs):
        if self.active is None:  # called outside a hooked UNet's forward: plain
            return forward(*args, **kwargs)
        return self.active.layer_call(module_id, forward, *args, **kwargs)

    def detach(self) -> None:
        # last registered first: diffusers' registry cannot unwire a hook that a later one wraps
        for module in self.layers:
            remove_hook(module, HOOK)
        for cache in reversed(self.caches):
            cache.remove()
        self.caches, self.layers, self.active = [], [], None
        super().detach()

    def begin(self, context, num_calls: int | None) -> None:
        super().begin(context, num_calls)
        self._full = (set(full_steps(self.num_calls, self.interval, self.schedule, self.center, self.power))
                      if self.num_calls and self.schedule != "uniform" else None)
        self.step = -1
        for cache in self.caches:
            cache.reset()

    def is_full(self, call: int) -> bool:
        """Whether the ``call``-th call of the trajectory that reaches the cache runs in full."""
        return call in self._full if self._full is not None else call % self.interval == 0
