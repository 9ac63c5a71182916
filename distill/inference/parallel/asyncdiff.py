"""AsyncDiff (Chen et al. 2024, "AsyncDiff: Parallelizing Diffusion Models by Asynchronous Denoising",
arXiv 2406.06911): the denoiser's block sequence split into N consecutive components, one per rank.

After the warm-up calls, which every rank runs whole and alike, component k on rank k takes as its input the
output of component k-1 computed at the previous call (its hidden states and, in a UNet, the skip tensors of the
down blocks it holds), so that the N components of one call run at the same time. At the start of each call
every rank but the last broadcasts its component's outputs of the previous call (one flat buffer); each rank then
runs the denoiser: its own blocks for real, every other block returning its broadcast output; the last rank's
prediction, the only one whose blocks all ran on the stale-input scheme's inputs, is broadcast to all, which step
their schedulers alike. The split points are chosen from each block's time measured during warm-up (the
contiguous split with the smallest largest component; rank 0's measurement, so that every rank splits alike).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from distill.accelerate.hooks import add_hook, remove_hook
from distill.inference.parallel.cfg import _prediction, _with_prediction
from distill.inference.parallel.group import Group

HOOK = "distill_asyncdiff"


def balanced_split(costs: list[float], parts: int) -> list[int]:
    """The component (0..parts-1) of each block: consecutive blocks, each component at least one, with the
    smallest largest component cost (linear partition by dynamic programming)."""
    n = len(costs)
    if not 1 <= parts <= n:
        raise ValueError(f"{parts} components of {n} blocks: use between 1 and {n} processes")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]  # best[p][i]: first i blocks in p components
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for p in range(1, parts + 1):
        for i in range(p, n + 1):
            for j in range(p - 1, i):
                value = max(best[p - 1][j], prefix[i] - prefix[j])
                if value < best[p][i]:
                    best[p][i], cut[p][i] = value, j
    owners, i = [0] * n, n
    for p in range(parts, 0, -1):
        j = cut[p][i]
        owners[j:i] = [p - 1] * (i - j)
        i = j
    return owners


def _flatten(value: Any, out: list[torch.Tensor]) -> Any:
    """The structure of a block's output (tensors, None, nested tuples); its tensors appended to ``out``."""
    if torch.is_tensor(value):
        out.append(value)
        return "tensor"
    if isinstance(value, tuple):
        return tuple(_flatten(v, out) for v in value)
    if value is None:
        return None
    raise TypeError(f"AsyncDiff caches tensors and tuples of them, not {type(value).__name__}")


def _unflatten(structure: Any, tensors) -> Any:
    if structure == "tensor":
        return next(tensors)
    if isinstance(structure, tuple):
        return tuple(_unflatten(s, tensors) for s in structure)
    return None


class AsyncDiff:
    """AsyncDiff over the ranks of ``group`` on ``blocks`` (the denoiser's blocks in the order they run), with
    ``warmup_steps`` sequential steps at the start of each trajectory (a new one begins at the first call after
    ``scheduler_of()``'s timesteps change, as ``set_timesteps`` does).

    ``stride=2`` (the paper's stride denoising) runs two steps per parallel round on one process more
    than components: on a round's first call rank k < N computes component k at the next step's timestep while
    the extra rank N computes the last component at this step's, whose prediction serves this step; the round's
    second call computes nothing, its prediction the last component's output of the round's first call, after
    one exchange of every component's outputs."""

    def __init__(self, group: Group, warmup_steps: int, scheduler_of, stride: int = 1):
        if warmup_steps < 1:
            raise ValueError(f"parallel.warmup_steps={warmup_steps} must be >= 1: the first asynchronous step "
                             "needs every component's output of a sequential one")
        if stride not in (1, 2):
            raise ValueError(f"parallel.stride={stride}: AsyncDiff's stride is 1 or 2")
        self.group, self.warmup_steps, self.scheduler_of, self.stride = group, warmup_steps, scheduler_of, stride
        self.components = group.world_size - stride + 1  # N; stride 2: the last rank holds the last one too
        self.component = min(group.rank, self.components - 1)
        self.extra = group.rank >= self.components
        self.denoiser: torch.nn.Module | None = None
        self.blocks: list[torch.nn.Module] = []
        self.owners: list[int] | None = None  # the component of each block, chosen after the first warm-up
        self.costs: list[float] = []
        self.cache: list[tuple[Any, list[torch.Tensor]] | None] = []  # each block's (structure, tensors)
        self.call, self._timesteps, self.warmup_calls = 0, None, 0
        self.order: list[int] = []  # the blocks' calls of the current warm-up call, checked against the chain

    def enable(self, denoiser: torch.nn.Module, blocks: list[torch.nn.Module]) -> AsyncDiff:
        if not 1 <= self.components <= len(blocks):
            raise ValueError(f"parallel=asyncdiff on {self.group.world_size} processes at stride {self.stride}: "
                             f"{self.components} components, and {type(denoiser).__name__} has {len(blocks)} "
                             f"blocks; use at most {len(blocks) + self.stride - 1} processes")
        self.denoiser, self.blocks = denoiser, list(blocks)
        self.costs, self.cache = [float("inf")] * len(blocks), [None] * len(blocks)
        for i, block in enumerate(self.blocks):
            add_hook(block, HOOK, lambda forward, *a, i=i, **k: self._block(i, forward, *a, **k))
        add_hook(denoiser, HOOK, self._call)
        return self

    def disable(self) -> None:
        if self.denoiser is not None:
            remove_hook(self.denoiser, HOOK)
            for block in self.blocks:
                remove_hook(block, HOOK)
            self.denoiser = None

    @property
    def warm(self) -> bool:
        return self.call < self.warmup_calls

    @property
    def phase(self) -> int:
        """0: a call whose components compute; 1 (stride 2): a call answered from the round's first one."""
        return (self.call - self.warmup_calls) % self.stride

    def _follow(self) -> None:
        scheduler = self.scheduler_of()
        if scheduler.timesteps is not self._timesteps:  # a new trajectory
            self._timesteps, self.call = scheduler.timesteps, 0
            self.warmup_calls = self.warmup_steps * getattr(scheduler, "order", 1)  # Heun: two calls a step

    def _call(self, forward, *args, **kwargs):
        self._follow()
        self.order = []
        if not self.warm:
            if self.owners is None:
                self._split()
            if self.phase == self.stride - 1 and self.call > self.warmup_calls:  # the first one: caches alike
                self._sync()
            if self.stride == 2 and self.phase == 0 and not self.extra:
                args, kwargs = self._next_timestep(args, kwargs)
        result = forward(*args, **kwargs)
        if self.warm and self.order != list(range(len(self.blocks))):
            raise RuntimeError(f"AsyncDiff's blocks of {type(self.denoiser).__name__} ran in the order {self.order}, "
                               "not once each in the chain's order: its split would cut the wrong places")
        if not self.warm and self.phase == 0:  # the last rank's: the last component's (stride 1), the extra's (2)
            prediction = _prediction(result).contiguous()
            result = _with_prediction(result, self.group.broadcast(prediction, self.group.world_size - 1))
        self.call += 1
        return result

    def _next_timestep(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call's inputs at the next call's timestep (the last call keeps its own)."""
        timesteps = self.scheduler_of().timesteps
        if self.call + 1 >= len(timesteps):
            return args, kwargs
        value = timesteps[self.call + 1].item()
        if len(args) > 1:
            t = args[1]
            return (args[0], torch.full_like(t, value) if torch.is_tensor(t) else value, *args[2:]), kwargs
        t = kwargs["timestep"]
        return args, {**kwargs, "timestep": torch.full_like(t, value) if torch.is_tensor(t) else value}

    def _block(self, i: int, forward, *args, **kwargs):
        if self.warm:
            self.order.append(i)
            start = time.perf_counter()
            out = forward(*args, **kwargs)
            self.costs[i] = min(self.costs[i], time.perf_counter() - start)
            if self.call == self.warmup_calls - 1:
                self._store(i, out)
            return out
        if self.phase == 0 and self.owners[i] == self.component:
            out = forward(*args, **kwargs)
            if not self.extra:  # the extra rank's last component serves this step only
                self._store(i, out)
            return out
        structure, tensors = self.cache[i]
        return _unflatten(structure, iter(tensors))

    def _store(self, i: int, out: Any) -> None:
        tensors: list[torch.Tensor] = []
        self.cache[i] = (_flatten(out, tensors), tensors)

    def _split(self) -> None:
        costs = torch.tensor(self.costs, dtype=torch.float64, device=self.group.device)
        self.group.broadcast(costs, 0)
        self.owners = balanced_split(costs.tolist(), self.components)

    def _sync(self) -> None:
        """Each component's block outputs of the round's computing call, from its rank to all (stride 1: the last
        one's feed only the prediction, which its rank broadcasts itself; stride 2: they are the next step's)."""
        for component in range(self.components - (self.stride == 1)):
            mine = [i for i, owner in enumerate(self.owners) if owner == component]
            tensors = [t for i in mine for t in self.cache[i][1]]
            if component == self.group.rank:
                buffer = torch.cat([t.reshape(-1) for t in tensors])
            else:
                buffer = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device)
            self.group.broadcast(buffer, component)
            pieces = iter(buffer.split([t.numel() for t in tensors]))
            for i in mine:
                structure, old = self.cache[i]
                self.cache[i] = (structure, [next(pieces).view_as(t) for t in old])
