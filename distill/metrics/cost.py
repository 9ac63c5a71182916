"""The cost axis: network evaluations, latency, throughput, peak memory, FLOPs and parameters."""

from __future__ import annotations

import inspect
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn

from distill.accelerate.context import context_of
from distill.utils.flops import count_flops


class NFECounter:
    """Counts forward calls of a network, and the examples passing through them, with a forward hook
    (the network itself is not wrapped, so pipelines that inspect it keep working). What ran on each call comes
    from the network's sampling context (``distill.accelerate.context_of``): a call whose output a sampling
    accelerator predicted without the network is not an evaluation (``predicted`` counts them); one that reused
    cached features is (``cached`` counts those too; their saving shows in FLOPs and latency)."""

    def __init__(self, module: nn.Module):
        self.calls = self.examples = self.cached = self.predicted = 0
        # the network's first input (a UNet's ``sample``, a transformer's ``hidden_states``), which SD3's and Flux's
        # pipelines pass by keyword: from the class's signature (a diffusers hook replaces the instance's forward);
        # ``sample`` for a wrapper taking *args, **kwargs (torch.compile's)
        named = [p.name for p in list(inspect.signature(type(module).forward).parameters.values())[1:]
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self._input = named[0] if named else "sample"
        self._handle = module.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output):
        context = context_of(module)
        ran = context.ran if context is not None else "full"
        if ran == "predicted":
            self.predicted += 1
            return
        sample = args[0] if args else kwargs[self._input]
        self.calls += 1
        self.cached += ran == "cached"
        self.examples += sample.shape[0]

    def reset(self) -> None:
        self.calls = self.examples = self.cached = self.predicted = 0

    def remove(self) -> None:
        self._handle.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


@dataclass
class Cost:
    nfe: float  # network evaluations per image (a CFG step batches 2 evaluations: counted as 2)
    latency_s: float  # seconds per image at this batch size (median over repeats)
    images_per_s: float
    peak_memory_mb: float  # CUDA: allocator peak above the baseline; CPU: the process's peak RSS
    gflops_per_image: float
    params_m: float
    active_params_m: float

    def as_dict(self) -> dict:
        return asdict(self)


class _PeakRSS:
    """Peak resident memory of this process while active, sampled every millisecond."""

    def __enter__(self):
        import psutil

        self.process, self.peak, self.stop = psutil.Process(), 0, threading.Event()
        self.base = self.process.memory_info().rss

        def watch():
            while not self.stop.is_set():
                self.peak = max(self.peak, self.process.memory_info().rss)
                time.sleep(0.001)

        self.thread = threading.Thread(target=watch, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def peak_mb(self) -> float:
        return self.peak / 2**20


def measure_cost(
    generate: Callable[[], torch.Tensor],
    counter: NFECounter,
    batch_size: int,
    params: int,
    active_params: int | None = None,
    warmup: int = 1,
    repeats: int = 3,
    device: torch.device | str = "cpu",
) -> Cost:
    """Run ``generate`` (one batch of ``batch_size`` images) warm-up + ``repeats`` times; median latency."""
    for _ in range(warmup):
        generate()
    counter.reset()
    generate()
    nfe = counter.examples / batch_size
    cuda = torch.device(device).type == "cuda"
    timings = []
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    with _PeakRSS() as rss:
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            generate()
            if cuda:
                torch.cuda.synchronize(device)
            timings.append(time.perf_counter() - start)
    # On CPU the allocator keeps what the warm-up allocated, so a delta would read ~0: report the process peak.
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if cuda else rss.peak_mb
    batch_seconds = statistics.median(timings)
    flops = count_flops(generate)
    return Cost(
        nfe=nfe, latency_s=batch_seconds / batch_size, images_per_s=batch_size / batch_seconds,
        peak_memory_mb=peak, gflops_per_image=flops / batch_size / 1e9, params_m=params / 1e6,
        active_params_m=(active_params if active_params is not None else params) / 1e6,
    )
