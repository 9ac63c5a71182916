"""The process group of parallel denoising: torchrun's processes over torch.distributed (gloo on CPU, NCCL on
GPU), every collective bounded by a timeout, so that a dead or stuck rank fails the others with a message
instead of a hang."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


class ParallelError(RuntimeError):
    """A collective of parallel denoising failed: a peer process died, or did not answer within the timeout."""


def world_size() -> int:
    """The number of processes torchrun started (1 without torchrun), read before any group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


class Group:
    """The default process group, created from torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``/``PORT``) with ``timeout_s`` on every collective (or the one the caller initialised);
    ``backend`` defaults to NCCL when CUDA is available, else gloo. Its collectives raise ``ParallelError``
    naming the rank, the collective and the timeout."""

    def __init__(self, timeout_s: float = 120.0, backend: str | None = None):
        self.timeout_s = timeout_s
        self.owned = not dist.is_initialized()  # a group the caller made stays theirs to close
        if self.owned:
            backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
            if backend == "nccl":  # a timed-out NCCL collective raises here instead of the watchdog aborting
                os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
                       if dist.get_backend() == "nccl" else torch.device("cpu"))

    def _run(self, name: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (RuntimeError, dist.DistError) as err:
            raise ParallelError(f"rank {self.rank} of {self.world_size}: {name} failed: a peer process died or did "
                                f"not answer within timeout_s={self.timeout_s:g} s ({type(err).__name__}: "
                                f"{str(err).splitlines()[0] if str(err) else ''})") from err

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (the same shape on each), in rank order."""
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._run("all_gather", dist.all_gather, out, tensor.contiguous())
        return out

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """``tensor`` of rank ``src`` into ``tensor`` on every rank (in place)."""
        self._run(f"broadcast from rank {src}", dist.broadcast, tensor, src)
        return tensor

    def barrier(self) -> None:
        self._run("barrier", dist.barrier)

    def close(self) -> None:
        if self.owned and dist.is_initialized():
            dist.destroy_process_group()
