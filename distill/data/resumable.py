"""Training data whose order is a pure function of (seed, epoch, rank), so a run can resume mid-epoch.

A ``ResumableSampler`` draws each epoch's permutation from its own generator (never the global RNG),
shards it over ranks and, after a resume, skips the batches the checkpoint had already trained on.
``ResumableDataMixin`` gives a LightningDataModule ``state_dict`` / ``load_state_dict`` hooks that store
the data position (epoch and batches done) in every checkpoint.

Why not torchdata's ``StatefulDataLoader`` (whose state Lightning saves and restores itself)? Tried over
torch's ``DistributedSampler`` (which draws the same ``randperm(len, seed + epoch)`` order as this sampler):
its state round trip works on its own, but under Lightning the mid-epoch / epoch-boundary resume test
(tests/test_resilience.py::test_resume_mid_epoch_and_at_an_epoch_boundary_is_bit_identical) no longer
gave bit-identical weights; until that is understood, this sampler stays. It reads Lightning's loop
counters (``batch_progress``), which are public attributes of the fit loop but not a documented API.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import DataLoader, Sampler


def _world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class ResumableSampler(Sampler[int]):
    """Shuffled (or ordered) indices of one rank's shard for one epoch; ``set_epoch`` picks the epoch
    (Lightning calls it), ``resume_from(epoch, batches)`` skips what that epoch already delivered."""

    def __init__(self, length: int, batch_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = True):
        self.length, self.batch_size, self.shuffle, self.seed, self.drop_last = length, batch_size, shuffle, seed, drop_last
        self.rank, self.world_size = _world()
        self.epoch = 0
        self._resume: tuple[int, int] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def resume_from(self, epoch: int, batches_done: int) -> None:
        self.epoch, self._resume = epoch, (epoch, batches_done)

    def _shard_size(self) -> int:
        return self.length // self.world_size if self.drop_last else math.ceil(self.length / self.world_size)

    def __len__(self) -> int:
        n = self._shard_size()
        return (n // self.batch_size) * self.batch_size if self.drop_last else n

    def indices(self, epoch: int) -> list[int]:
        if self.shuffle:
            order = torch.randperm(self.length, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
        else:
            order = list(range(self.length))
        per_rank = self._shard_size()
        order = (order * math.ceil(per_rank * self.world_size / max(1, len(order))))[: per_rank * self.world_size]
        return order[self.rank::self.world_size][: len(self)]

    def __iter__(self):
        order = self.indices(self.epoch)
        if self._resume is not None and self._resume[0] == self.epoch:
            order = order[self._resume[1] * self.batch_size:]
        self._resume = None  # only the first pass after a resume skips
        return iter(order)


def resumable_loader(dataset, batch_size: int, seed: int, shuffle: bool = True, drop_last: bool = True,
                     num_workers: int = 0) -> DataLoader:
    """A DataLoader over a ``ResumableSampler``; its worker seeds come from its own generator too. Batches are
    prepared off the training loop's critical path: in ``num_workers`` persistent worker processes, and in pinned
    memory when a CUDA device will take them (an asynchronous host-to-device copy)."""
    sampler = ResumableSampler(len(dataset), batch_size, shuffle, seed, drop_last)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, num_workers=num_workers,
                      persistent_workers=num_workers > 0, pin_memory=torch.cuda.is_available(),
                      generator=torch.Generator().manual_seed(seed))


def evaluation_loader(dataset, batch_size: int, seed: int = 0) -> DataLoader:
    """An in-order DataLoader with a generator of its own. Each pass over a DataLoader draws a base seed for its
    workers from its generator, from the global torch RNG when it has none; a validation pass drawing from the
    global RNG right after a checkpoint (every step where both fall) would put a run resumed from that checkpoint
    off the random numbers of the unbroken run, since the checkpoint was saved before the draw."""
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, generator=torch.Generator().manual_seed(seed))


class ResumableDataMixin:
    """Checkpoint hooks for a LightningDataModule whose ``train_dataloader`` uses ``resumable_loader``."""

    _resume_position: tuple[int, int] | None = None

    def state_dict(self) -> dict:
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return {}
        loop = trainer.fit_loop.epoch_loop
        # batches of the current epoch whose optimizer step is done (the checkpoint holds their effect)
        done = loop.batch_progress.current.processed
        epoch = trainer.current_epoch
        if trainer.num_training_batches != float("inf") and done >= trainer.num_training_batches:
            epoch, done = epoch + 1, 0  # saved on the epoch's last batch: resume at the next epoch's start
        return {"epoch": int(epoch), "batches_done": int(done)}

    def load_state_dict(self, state: dict) -> None:
        if state:
            self._resume_position = (state["epoch"], state["batches_done"])

    def _train_loader(self, dataset, batch_size: int, seed: int, drop_last: bool, num_workers: int) -> DataLoader:
        loader = resumable_loader(dataset, batch_size, seed, True, drop_last, num_workers)
        if self._resume_position is not None:
            loader.sampler.resume_from(*self._resume_position)
            self._resume_position = None
        return loader
