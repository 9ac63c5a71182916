"""TaylorSeer per block (Liu et al. 2025, "From Reusing to Forecasting: Accelerating Diffusion Models with
TaylorSeers"): forecast each transformer block's features instead of the network's output.

On the real steps of the pattern (``distill.accelerate.forecast.real_steps``: the first ``warmup``, the last
``last``, one in ``interval`` between) the whole transformer runs and the outputs of every block's expensive
modules are recorded: its attention (``attn``, SD3.5's second ``attn2``) and feed-forward networks (``ff``,
``ff_context``); in a single-stream block (Flux), whose attention and MLP are concatenated into ``proj_out``,
the output of ``proj_out``. From those the finite-difference Taylor factors of order ``order`` are updated (the
paper's Eq. 8: the i-th divided backward difference over the steps between real ones). On the other steps the
network still runs its embedding, each block's timestep modulation (AdaLN), norms, gates and residual adds, and
its output head, but each expensive module returns its forecast

    F(k) = sum_i F^(i)(r) (k - r)^i / i!     (r: the last real step, k: this step, in steps)

instead of computing (a single-stream block's attention and MLP, which only feed ``proj_out``, return zeros of
their recorded shape). ``order=0`` reuses the last real features (FORA's reuse); ``interval=1`` is plain
sampling. ``accelerate=forecast`` does the same expansion on the network's output.

Such a call is recorded in the sampling context as ``ran = "cached"``: the cost meter counts it as an evaluation
and its FLOPs are those of the parts that ran. Calls that repeat a timestep (Flux's true CFG, conditional then
unconditional) keep separate factors, by their order at that timestep; another batch shape starts afresh.
Blocks are found with diffusers' block registry (``distill.accelerate.blockcache.stack_blocks``); a UNet is refused.
"""

from __future__ import annotations

import functools

import torch
from diffusers.hooks.taylorseer_cache import TaylorSeerState
from torch import nn

from distill.accelerate.base import call_input
from distill.accelerate.blockcache import stack_blocks
from distill.accelerate.forecast import Forecast
from distill.accelerate.hooks import add_hook, remove_hook
from distill.accelerate.registry import ACCELERATORS

HOOK = "distill_taylorseer"
FORECAST_MODULES = ("attn", "attn2", "ff", "ff_context")  # a two-stream / joint block's expensive parts
SINGLE_STREAM = ("proj_out", ("attn", "proj_mlp"))  # forecast proj_out; attn and proj_mlp only feed it


def block_modules(block: nn.Module) -> tuple[list[str], list[str]]:
    """The names of ``block``'s modules whose outputs are forecast, and of those skipped because their output
    only feeds a forecast one (a single-stream block's attention and MLP)."""
    if getattr(block, "proj_mlp", None) is not None:
        return [SINGLE_STREAM[0]], list(SINGLE_STREAM[1])
    names = [n for n in FORECAST_MODULES if isinstance(getattr(block, n, None), nn.Module)]
    if not names:
        raise ValueError(f"accelerate=taylorseer forecasts a block's attention and feed-forward modules "
                         f"({list(FORECAST_MODULES)}); a {type(block).__name__} has none of them")
    return names, []


def _tensors(out) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
    """The tensors of a module's output (a tensor or a tuple with Nones) and where they are in it."""
    items = out if isinstance(out, tuple) else (out,)
    where = tuple(i for i, v in enumerate(items) if torch.is_tensor(v))
    return tuple(items[i].detach() for i in where), where


def _rebuild(arity: int | None, tensors: list[torch.Tensor], where: tuple[int, ...]):
    """A module's output of ``arity`` items (None: a tensor) with ``tensors`` at ``where``, None elsewhere."""
    if arity is None:
        return tensors[0]
    items = [None] * arity
    for i, v in zip(where, tensors):
        items[i] = v
    return tuple(items)


class _Feature:
    """One module's Taylor factors in one branch of calls, and the form of its output."""

    def __init__(self, order: int):
        self.state = TaylorSeerState(taylor_factors_dtype=torch.float32, max_order=order)
        self.arity, self.where, self.shapes = None, (), []


@ACCELERATORS.register("taylorseer")
class TaylorSeer(Forecast):
    """TaylorSeer per block: the transformer runs in full on the real steps of the pattern (``interval``,
    ``warmup``, ``last`` or explicit ``steps``); on the others each block's attention and feed-forward outputs
    are a Taylor expansion of ``order`` from the real steps."""

    name = "taylorseer"

    def __init__(self, interval: int = 3, warmup: int = 2, last: int = 1, steps: list[int] | None = None,
                 order: int = 1):
        super().__init__("taylor", interval, warmup, last, steps, order)
        self.modules: list[tuple[str, nn.Module, bool]] = []  # (name, module, forecast: False = skipped)
        self.features: dict[tuple[int, str], _Feature] = {}
        self.keys: dict[int, tuple] = {}  # branch -> the batch its features are of
        self.active: tuple[int, int, bool] | None = None  # (branch, position, forecast) of the current call
        self.decisions: list[bool] = []  # computed in full, per call of the trajectory

    def describe(self) -> str:
        pattern = f"steps={list(self.steps)}" if self.steps is not None else f"N={self.interval}"
        return f"taylorseer(O={self.order},{pattern})"

    def attach(self, denoiser: nn.Module, context) -> None:
        self.detach()
        found = []
        for i, block in enumerate(stack_blocks(denoiser)):
            forecast, skipped = block_modules(block)
            found += [(f"{i}.{n}", getattr(block, n), True) for n in forecast]
            found += [(f"{i}.{n}", getattr(block, n), False) for n in skipped]
        for name, module, forecast in found:
            add_hook(module, HOOK, functools.partial(self._module_call, name, forecast))
        self.modules = found
        super().attach(denoiser, context)

    def detach(self) -> None:
        for _, module, _ in reversed(self.modules):  # kept listed: what was hooked (no hook left is a no-op)
            remove_hook(module, HOOK)
        super().detach()

    def begin(self, context, num_calls: int | None) -> None:
        super().begin(context, num_calls)
        self.features, self.keys, self.active, self.decisions = {}, {}, None, []
        self.at_timestep = 0

    def passed_calls(self, num_calls: int | None) -> int | None:
        return num_calls  # every call reaches the network (and the accelerators this one wraps)

    def call(self, context, forward, *args, **kwargs):
        timestep = args[1] if len(args) > 1 else kwargs.get("timestep")
        before = self.last_timestep
        position = self._advance(timestep)  # the index of this call's timestep among the distinct ones
        repeated = self.last_timestep is not None and self.last_timestep == before
        branch = self.at_timestep = self.at_timestep + 1 if repeated else 0
        sample = call_input(args, kwargs)
        key = (tuple(sample.shape), sample.dtype, sample.device)
        if self.keys.get(branch) != key:  # another batch: this branch's features start afresh
            self.features = {k: v for k, v in self.features.items() if k[0] != branch}
            self.keys[branch] = key
        has_features = any(k[0] == branch for k in self.features)
        forecast = self.real is not None and position not in self.real and has_features
        self.active = (branch, position, forecast)
        try:
            return forward(*args, **kwargs)
        finally:
            self.decisions.append(not forecast)
            self.active = None

    def _module_call(self, name: str, forecast_module: bool, forward, *args, **kwargs):
        if self.active is None:  # outside a call this accelerator saw (the network called directly): plain
            return forward(*args, **kwargs)
        branch, position, forecast = self.active
        feature = self.features.get((branch, name))
        if forecast:
            self.context.ran = "cached"
            if not forecast_module:  # its output only feeds a forecast module
                return _rebuild(feature.arity, [torch.zeros(s, dtype=d, device=self.keys[branch][2])
                                                for s, d in feature.shapes], feature.where)
            feature.state.current_step = position
            return _rebuild(feature.arity, feature.state.predict(), feature.where)
        out = forward(*args, **kwargs)
        if feature is None:
            feature = self.features[(branch, name)] = _Feature(self.order)
        tensors, feature.where = _tensors(out)
        feature.arity = len(out) if isinstance(out, tuple) else None
        feature.shapes = [(t.shape, t.dtype) for t in tensors]
        if forecast_module and feature.state.last_update_step != position:
            feature.state.current_step = position
            feature.state.update(tensors)
        return out
