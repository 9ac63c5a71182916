"""Caches that skip a transformer's blocks on some calls: First-Block Cache and TeaCache.

A diffusion transformer (SD3's MMDiT, Flux, any stack of blocks diffusers' registry describes) runs its input embedding, then a stack of blocks,
then an output head. Both caches decide per network call whether the blocks run; when they do not, the stack's
output is its input plus the residual (output - input of the skipped part) stored at the last call that ran it,
and the head still runs. What decides:

* **First-Block Cache** (``fbcache``; ParaAttention, Cheng 2024, after AdaCache): the first block always runs;
  the rest are skipped when the relative mean absolute change of the first block's residual since the last call
  that ran them, ``mean|r1 - r1_prev| / mean|r1_prev|``, is below ``threshold``. A skip reuses the rest's residual
  (last block's output - first block's output) on the new first-block output. The reference after a skip stays
  the last computed residual, so the change accumulates until the blocks run again.
* **TeaCache** (``teacache``; Liu et al. 2024, "Timestep Embedding Tells: It's Time to Cache"): before any block,
  the timestep-modulated input of the first block (its ``norm1``, AdaLN-Zero, of the embedded tokens and the
  time/text embedding) is compared with the previous call's: ``rel = mean|m - m_prev| / mean|m_prev|``, rescaled
  by a polynomial fitted on the model's own trajectories (``python -m distill.fit_forecaster accelerate=teacache``:
  the output's relative change as a function of ``rel``; a negative estimate counts 0) and accumulated; the blocks run when the sum reaches
  ``threshold`` (then it restarts at 0), always on a trajectory's first and last step, and are skipped below it,
  the whole stack's residual reused on the new input.

Threshold 0 is plain sampling exactly (a change is never below 0; TeaCache computes whenever the sum reaches 0).
Calls that repeat a timestep (true CFG's separate conditional and unconditional passes, as ``FluxPipeline`` makes
them) keep separate states, by their order at that timestep. A skipped call is recorded in the sampling context
(``ran = "cached"``): the embedding, the first block (First-Block Cache) or its ``norm1`` (TeaCache) and the head
still run and are counted by the FLOP meter.

diffusers ships First-Block Cache as a hook (``apply_first_block_cache``); in diffusers 0.42 it needs a
``CacheMixin`` transformer (``SD3Transformer2DModel`` is not one) and fails at SD3's last block, whose text
stream is None (``context_pre_only``), so the blocks are hooked here with diffusers' block metadata
(``TransformerBlockRegistry``: where each block returns its image and text streams). No TeaCache ships with it.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from distill.accelerate.base import Accelerator, call_input
from distill.accelerate.hooks import add_hook, remove_hook
from distill.accelerate.registry import ACCELERATORS

HOOK = "distill_blockcache"
TEACACHE_FILE = "teacache.json"
# the block lists of diffusers' transformers, in the order their forward runs them
BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks")


def block_metadata(block: nn.Module):
    """diffusers' ``TransformerBlockMetadata`` of ``block``'s class (where its outputs are), None if unregistered."""
    from diffusers.hooks._helpers import TransformerBlockRegistry

    try:
        return TransformerBlockRegistry.get(type(block))
    except ValueError:
        return None


def stack_blocks(network: nn.Module) -> list[nn.Module]:
    """The transformer's blocks in the order they run; ValueError naming the network if it has none diffusers
    describes (a UNet: use ``deepcache``)."""
    blocks = [b for name in BLOCK_LISTS for b in getattr(network, name, None) or []]
    if not blocks or any(block_metadata(b) is None for b in blocks):
        unknown = sorted({type(b).__name__ for b in blocks if block_metadata(b) is None})
        raise ValueError(f"a block cache needs a diffusion transformer with diffusers-registered blocks in "
                         f"{list(BLOCK_LISTS)}; the denoiser is a {type(network).__name__}"
                         + (f" with unregistered {unknown}" if unknown else "") + " (a UNet: use accelerate=deepcache)")
    return blocks


def relative_l1(current: torch.Tensor, previous: torch.Tensor) -> float:
    """``mean|current - previous| / mean|previous|``, the change both caches measure."""
    return float((current - previous).abs().mean() / previous.abs().mean())


class _Branch:
    """The state of one branch of calls (all calls, or one CFG pass where the pipeline makes them separately)."""

    def __init__(self):
        self.reference: torch.Tensor | None = None  # fbcache: first-block residual; teacache: modulated input
        self.residual: torch.Tensor | None = None  # the skipped part's output - input at the last computed call
        self.accumulated, self.calls, self.key = 0.0, 0, None


class BlockCache(Accelerator):
    """Shared by both caches: the hooks on the blocks, the branch states and the skip itself."""

    def __init__(self, threshold: float):
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or threshold < 0:
            raise ValueError(f"accelerate.options.threshold={threshold!r} must be a number >= 0 (0 = no caching)")
        self.threshold = float(threshold)
        self.blocks: list[nn.Module] = []
        self.branches: dict[int, _Branch] = {}
        self.branch: _Branch | None = None
        self.skip = False
        self.last_timestep, self.at_timestep = None, 0
        self.decisions: list[tuple[int, bool]] = []  # (branch index, computed) per call of the trajectory

    def attach(self, denoiser: nn.Module, context) -> None:
        self.detach()
        self.blocks = stack_blocks(denoiser)
        self.meta = [block_metadata(b) for b in self.blocks]
        for i, block in enumerate(self.blocks):
            add_hook(block, HOOK, functools.partial(self._block_call, i))
        super().attach(denoiser, context)

    def detach(self) -> None:
        for block in self.blocks:
            remove_hook(block, HOOK)
        self.blocks = []
        super().detach()

    def begin(self, context, num_calls: int | None) -> None:
        super().begin(context, num_calls)
        self.branches, self.branch, self.decisions = {}, None, []
        self.last_timestep, self.at_timestep = None, 0

    def call(self, context, forward, *args, **kwargs):
        timestep = args[1] if len(args) > 1 else kwargs.get("timestep")
        t = float(timestep.flatten()[0]) if torch.is_tensor(timestep) else timestep
        self.at_timestep = self.at_timestep + 1 if t is not None and t == self.last_timestep else 0
        self.last_timestep = t
        index = self.at_timestep
        self.branch = self.branches.setdefault(index, _Branch())
        sample = call_input(args, kwargs)
        key = (tuple(sample.shape), sample.dtype, sample.device)
        if self.branch.key != key:  # another batch: start this branch afresh
            self.branch.__init__()
            self.branch.key = key
        self.skip = False
        try:
            return forward(*args, **kwargs)
        finally:
            self.decisions.append((index, not self.skip))
            self.branch.calls += 1
            self.branch = None

    def last_step(self, branch: _Branch) -> bool:
        return self.num_inference_steps is not None and branch.calls >= self.num_inference_steps - 1

    # ---------------------------------------------------------------- the blocks

    def _streams(self, i: int, args, kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        meta = self.meta[i]
        hidden = meta._get_parameter_from_args_kwargs("hidden_states", args, kwargs)
        encoder = (meta._get_parameter_from_args_kwargs("encoder_hidden_states", args, kwargs)
                   if meta.return_encoder_hidden_states_index is not None else None)
        return hidden, encoder

    def _output(self, i: int, hidden: torch.Tensor, encoder: torch.Tensor | None):
        """``hidden`` and ``encoder`` in block ``i``'s output form."""
        meta = self.meta[i]
        if meta.return_encoder_hidden_states_index is None:
            return hidden
        out = [None, None]
        out[meta.return_hidden_states_index], out[meta.return_encoder_hidden_states_index] = hidden, encoder
        return tuple(out)

    def _hidden(self, i: int, out) -> torch.Tensor:
        return out[self.meta[i].return_hidden_states_index] if isinstance(out, tuple) else out

    def _block_call(self, i: int, forward, *args, **kwargs):
        branch = self.branch
        if branch is None:  # outside a call this accelerator saw (e.g. the network called directly): plain
            return forward(*args, **kwargs)
        if i == 0:
            out = self._head_call(branch, forward, *args, **kwargs)
        elif self.skip:  # a skipped block passes its streams through
            return self._output(i, *self._streams(i, args, kwargs))
        else:
            out = forward(*args, **kwargs)
        if i == len(self.blocks) - 1 and not self.skip:
            branch.residual = (self._hidden(i, out) - self.stack_input).detach()
        return out

    def _head_call(self, branch: _Branch, forward, *args, **kwargs):
        raise NotImplementedError


@ACCELERATORS.register("fbcache")
class FirstBlockCache(BlockCache):
    """First-Block Cache: skip every block after the first while the first block's residual has changed by less
    than ``threshold`` (relative mean absolute change) since the blocks last ran."""

    name = "fbcache"

    def __init__(self, threshold: float = 0.08):  # ParaAttention's FLUX.1-dev example (diffusers' guide): 0.08
        super().__init__(threshold)

    def describe(self) -> str:
        return f"fbcache(threshold={self.threshold:g})"

    def _head_call(self, branch: _Branch, forward, *args, **kwargs):
        hidden_in, _ = self._streams(0, args, kwargs)
        out = forward(*args, **kwargs)
        hidden = self._hidden(0, out)
        residual = (hidden - hidden_in).detach()
        self.skip = (branch.reference is not None and branch.residual is not None and len(self.blocks) > 1
                     and relative_l1(residual, branch.reference) < self.threshold)
        if self.skip:
            self.context.ran = "cached"
            encoder = out[self.meta[0].return_encoder_hidden_states_index] if isinstance(out, tuple) else None
            return self._output(0, hidden + branch.residual, encoder)
        branch.reference = residual
        self.stack_input = hidden  # the rest of the stack starts here
        return out


def fit_rescale(input_changes, output_changes, degree: int = 4) -> list[float]:
    """TeaCache's rescaling polynomial: least squares of the output's relative change on the modulated input's,
    highest power first (``numpy.polyfit``)."""
    x, y = np.asarray(input_changes, dtype=np.float64), np.asarray(output_changes, dtype=np.float64)
    if len(x) <= degree:
        raise ValueError(f"{len(x)} pairs of changes cannot fit a polynomial of degree {degree}; record more "
                         "trajectories or steps")
    return [float(c) for c in np.polyfit(x, y, degree)]


def save_rescale(folder: str | Path, coefficients: list[float], **record) -> Path:
    path = Path(folder) / TEACACHE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"coefficients": coefficients, **record}, indent=1) + "\n")
    return path


def load_rescale(folder: str | Path) -> list[float]:
    path = Path(folder) / TEACACHE_FILE
    if not path.is_file():
        raise ValueError(f"accelerate=teacache rescales with the polynomial in {path}, which does not exist: fit it "
                         f"with python -m distill.fit_forecaster accelerate=teacache pipeline={folder}, or set "
                         "accelerate.options.rescale=false (the raw change, TeaCache without rescaling)")
    return list(json.loads(path.read_text())["coefficients"])


def modulated_input(block: nn.Module, hidden: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
    """The first block's timestep-modulated input: its AdaLN-Zero ``norm1`` (``norm`` in a single-stream block)
    of the tokens and the time/text embedding, the normalised, scaled and shifted tokens."""
    norm = getattr(block, "norm1", None) or block.norm
    out = norm(hidden, emb=temb)
    return out[0] if isinstance(out, tuple) else out


@ACCELERATORS.register("teacache")
class TeaCache(BlockCache):
    """TeaCache: skip the whole block stack while the accumulated, rescaled relative change of the first block's
    modulated input stays below ``threshold``. ``rescale``: the polynomial from ``teacache.json`` in ``path`` (the
    pipeline's folder by default); ``coefficients`` given instead (highest power first); ``rescale=false``: none."""

    name = "teacache"

    def __init__(self, threshold: float = 0.25, rescale: bool = True, coefficients: list[float] | None = None,
                 path: str | None = None):  # 0.25: TeaCache4FLUX's first setting (1.5x on FLUX.1-dev)
        super().__init__(threshold)
        self.rescale, self.path = rescale, path
        self.coefficients = list(coefficients) if coefficients is not None else None
        self.polynomial = None
        self.changes: list[float] = []  # the raw relative change at every call after a branch's first

    def describe(self) -> str:
        return f"teacache(threshold={self.threshold:g}{'' if self.rescale else ',raw'})"

    def check(self, scheduler: str | None = None, num_steps: int | None = None,
              guidance_scale: float | None = None) -> None:
        """Fail now if the rescaling polynomial is needed and missing (before any sampling; ``distill.evaluate``
        passes each row's scheduler, steps and guidance, which one polynomial serves)."""
        self._poly()

    def _poly(self):
        if self.polynomial is None:
            if not self.rescale:
                self.polynomial = np.poly1d([1.0, 0.0])
            else:
                if self.coefficients is None:
                    if self.path is None:
                        raise ValueError("accelerate=teacache needs its rescaling polynomial: set "
                                         "accelerate.options.path=<folder with teacache.json>, "
                                         "accelerate.options.coefficients=[...] or accelerate.options.rescale=false")
                    self.coefficients = load_rescale(self.path)
                self.polynomial = np.poly1d(self.coefficients)
        return self.polynomial

    def rescaled(self, change: float) -> float:
        """The polynomial's estimate of the output's change, at least 0: a polynomial of degree 4 fitted on a
        narrow range of changes can dip below 0 at its edge (docs/accelerators.md gives a measured case),
        where a change cannot be negative."""
        return max(float(self._poly()(change)), 0.0)

    def attach(self, denoiser: nn.Module, context) -> None:
        self._poly()
        super().attach(denoiser, context)

    def begin(self, context, num_calls: int | None) -> None:
        super().begin(context, num_calls)
        self.changes = []

    def _head_call(self, branch: _Branch, forward, *args, **kwargs):
        hidden_in, _ = self._streams(0, args, kwargs)
        temb = self.meta[0]._get_parameter_from_args_kwargs("temb", args, kwargs)
        with torch.no_grad():
            modulated = modulated_input(self.blocks[0], hidden_in, temb)
        change = relative_l1(modulated, branch.reference) if branch.reference is not None else None
        if change is not None:
            self.changes.append(change)
        compute = change is None or branch.residual is None or self.last_step(branch)
        if not compute:
            branch.accumulated += self.rescaled(change)
            compute = branch.accumulated >= self.threshold
        if compute:
            branch.accumulated = 0.0
        branch.reference = modulated
        self.skip = not compute
        if self.skip:
            self.context.ran = "cached"
            return self._output(0, hidden_in + branch.residual, self._streams(0, args, kwargs)[1])
        self.stack_input = hidden_in
        return forward(*args, **kwargs)
