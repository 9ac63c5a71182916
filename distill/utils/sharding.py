"""Sharded data parallel training: FSDP2 (``torch.distributed.fsdp.fully_shard``) under Lightning's
``ModelParallelStrategy``.

``trainer=fsdp`` shards the student's parameters, gradients and optimizer state across the ranks (each rank keeps
1/world of them and all-gathers a block's parameters just before that block runs), and the frozen networks that
run every step (teacher, consistency target) too. Checkpoints are sharded: a folder per checkpoint written by
``torch.distributed.checkpoint`` (one file per rank plus Lightning's ``meta.pt``), written to a temporary folder
and renamed into place, so that a crash mid-save leaves the previous checkpoint whole.

Code that runs on rank 0 only (evaluation, sample grids, export) cannot call a sharded network: its forward
all-gathers, and the other ranks would never join. :func:`gathered` therefore collects the full weights on every
rank's call and lends rank 0 plain, unsharded copies for the duration of a ``with`` block.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Literal

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from distill.utils.checkpoint import SHARDED_META as META
from distill.utils.checkpoint import safe_load

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (in-place ops on it change the DTensor); a plain tensor as it is."""
    return t.to_local() if is_dtensor(t) else t


def reshard(module) -> None:
    """Put every FSDP unit of ``module`` in its sharded state (a local op: frees gathered parameters). With
    ``reshard_after_forward=false`` a unit that took no part in the backward keeps its gathered parameters."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):  # a sharded network's root is a unit: nothing to walk for any other
        for m in module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


def is_sharded(module: nn.Module) -> bool:
    return any(is_dtensor(p) for p in module.parameters())


def unsharded_class(module) -> type:
    """The module's own class: ``fully_shard`` swaps a module's class for a subclass of (FSDPModule, class)."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    if isinstance(module, FSDPModule):
        return next(c for c in cls.__mro__[1:] if not issubclass(c, FSDPModule))
    return cls


def block_classes(net: nn.Module) -> set[str]:
    """Class names a network declares unsplittable (diffusers' ``_no_split_modules``, of it and of its
    sub-networks, e.g. each expert of a mixture): the units FSDP shards and all-gathers one at a time."""
    names: set[str] = set()
    for module in net.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return names


def shard_units(net: nn.Module) -> list[nn.Module]:
    """The outermost sub-modules of a declared block class; without declared classes, the entries of the
    network's ModuleLists (its stages). Nested matches are left to their parent's unit."""
    classes = block_classes(net)
    units: list[nn.Module] = []
    inside: set[int] = set()
    for name, module in net.named_modules():
        if id(module) in inside or module is net:
            continue
        if classes:
            hit = type(module).__name__ in classes
        else:
            parent = net.get_submodule(name.rsplit(".", 1)[0]) if "." in name else net
            hit = isinstance(parent, nn.ModuleList)
        if hit:
            units.append(module)
            inside.update(id(m) for m in module.modules())
    return units


def meta_copy(net: nn.Module) -> nn.Module:
    """A copy of ``net`` whose parameters and buffers are on the meta device (no memory): the skeleton that
    :func:`gathered` fills with the full weights."""
    memo: dict[int, object] = {}
    for p in net.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in net.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(net, memo)


class ShardedStrategy(ModelParallelStrategy):
    """Fully sharded data parallel over all ranks (a 1-D mesh), for a ``DistillMethod``.

    - ``param_dtype``/``reduce_dtype``: FSDP's mixed precision (the all-gathered parameters and the gradient
      reduce-scatter); null keeps float32 (``trainer.precision=bf16-mixed`` autocasts the compute either way).
    - ``reshard_after_forward``: free a block's gathered parameters after its forward (ZeRO-3; more
      communication, least memory) or keep them for the backward (ZeRO-2-like).
    - ``activation_checkpointing``: recompute the student's block activations in the backward
      (``enable_gradient_checkpointing`` of a diffusers model).
    - ``shard_frozen``: shard the teacher and a consistency target as well (they run every step).
    """

    def __init__(self, param_dtype: Literal["bf16", "fp16", "fp32"] | None = None,
                 reduce_dtype: Literal["bf16", "fp16", "fp32"] | None = None, reshard_after_forward: bool = True,
                 activation_checkpointing: bool = False, shard_frozen: bool = True,
                 process_group_backend: str | None = None, timeout_s: float = 1800.0):
        for name, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if value is not None and value not in DTYPES:
                raise ValueError(f"trainer.strategy.{name}={value!r}; use one of {sorted(DTYPES)} or null")
        super().__init__(save_distributed_checkpoint=True, process_group_backend=process_group_backend,
                         timeout=timedelta(seconds=timeout_s))
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.reshard_after_forward, self.activation_checkpointing = reshard_after_forward, activation_checkpointing
        self.shard_frozen = shard_frozen
        self.skeletons: dict[str, nn.Module] = {}  # attribute name -> meta copy, for gathered()

    def setup_environment(self) -> None:
        # one data-parallel dimension over every rank (Lightning's defaults would make it tensor parallel)
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()

    # ------------------------------------------------------------------ sharding

    def shard(self, method: nn.Module) -> None:
        """Apply ``fully_shard`` to the method's networks (called from ``DistillMethod.configure_model``)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = self.device_mesh["data_parallel"]
        mp = MixedPrecisionPolicy(param_dtype=DTYPES.get(self.param_dtype), reduce_dtype=DTYPES.get(self.reduce_dtype))
        student = method.student
        if self.activation_checkpointing:
            if not hasattr(student, "enable_gradient_checkpointing"):
                raise ValueError(f"trainer.strategy.activation_checkpointing=true, but the student "
                                 f"({type(student).__name__}) has no enable_gradient_checkpointing(); set it to false")
            student.enable_gradient_checkpointing()
        student_like = {"student", "target"}  # an EMA target is averaged shard by shard with the student
        for name in sharded_attributes(method):
            net = getattr(method, name)
            if is_sharded(net) or (name not in student_like and not self.shard_frozen):
                continue
            self._broadcast_from_rank0(net)
            self.skeletons[name] = meta_copy(net)
            # a frozen network runs no backward, where FSDP would reshard a block kept gathered after its forward
            reshard = self.reshard_after_forward if name in student_like else True
            for unit in shard_units(net):
                fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
            fully_shard(net, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        # other trainable parts of the method (feature-distillation regressors): one unit each, so that their
        # gradients are reduced across ranks like the student's (nothing else averages them under this strategy)
        for name, child in method.named_children():
            if name not in self.skeletons and not is_sharded(child) and any(
                    p.requires_grad for p in child.parameters()):
                self._broadcast_from_rank0(child)
                fully_shard(child, mesh=mesh, mp_policy=mp, reshard_after_forward=self.reshard_after_forward)

    @torch.no_grad()
    def _broadcast_from_rank0(self, net: nn.Module) -> None:
        """Rank 0's weights on every rank, as DDP does when it wraps a model: ``fully_shard`` keeps each rank's own
        slice of its local tensors, so a network initialised differently per rank (each rank seeds its RNG with
        its rank) would otherwise become a mixture. The networks are still on the CPU here (Lightning moves them
        after ``configure_model``); NCCL broadcasts device tensors, so each goes through the rank's device."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        via_device = dist.get_backend() == "nccl"
        for tensor in [*net.parameters(), *net.buffers()]:
            if via_device:
                moved = tensor.data.to(self.root_device)
                dist.broadcast(moved, src=0)
                tensor.data.copy_(moved)
            else:
                dist.broadcast(tensor.data, src=0)

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """The sharded checkpoint written into ``<path>.tmp`` and renamed to ``<path>`` once every rank's shard and
        the metadata are on disk; the previous checkpoint of that name is removed only then."""
        if storage_options is not None:
            raise TypeError("ShardedStrategy.save_checkpoint takes no storage_options")
        path = Path(self.broadcast(str(filepath)))
        tmp = path.with_name(path.name + ".tmp")
        if self.global_rank == 0 and tmp.exists():
            shutil.rmtree(tmp)
        self.barrier()
        super().save_checkpoint(checkpoint, tmp)
        self.barrier()
        if self.global_rank == 0:  # <name>.old is the previous checkpoint while the new one is renamed in
            old = path.with_name(path.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            if path.is_dir():
                path.rename(old)
            elif path.exists():
                path.unlink()
            tmp.rename(path)
            _fsync_dir(path.parent)
            shutil.rmtree(old, ignore_errors=True)
        self.barrier()

    def remove_checkpoint(self, filepath) -> None:
        if self.global_rank == 0:
            path = Path(filepath)
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict:
        """Load the sharded states that the checkpoint holds (the frozen teacher is rebuilt from its pipeline and
        not stored: its keys are left as built), each rank reading its own shards. The metadata loads weights-only
        whatever the caller's ``weights_only`` (as every other checkpoint does): a checkpoint never runs pickled
        code."""
        from torch.distributed.checkpoint import FileSystemReader, load
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(self.broadcast(str(checkpoint_path)))
        if not (path / META).is_file():
            raise ValueError(f"{path} is not a sharded checkpoint folder (no {META}); trainer=fsdp resumes from the "
                             "folders it writes")
        stored = set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
        model_state = get_model_state_dict(self.model)
        missing = [k for k in model_state if k.startswith("student.") and f"state_dict.{k}" not in stored]
        lora = any(k.startswith("student.") and "lora" in k for k in model_state)
        if missing and not lora:  # a LoRA student's frozen base weights are the teacher's, rebuilt on load
            raise ValueError(f"checkpoint {path} lacks {len(missing)} student weights (e.g. {missing[0]}); it was "
                             "written for a different student architecture")
        wanted = {k: v for k, v in model_state.items() if f"state_dict.{k}" in stored}
        state = {"state_dict": wanted}
        load(state, checkpoint_id=str(path))
        self.model.load_state_dict(state["state_dict"], strict=False)
        for idx, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{idx}"
            optim_state = {key: get_optimizer_state_dict(self.model, optimizer)}
            load(optim_state, checkpoint_id=str(path))
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=optim_state[key],
                                     options=StateDictOptions(cpu_offload=True))
        return safe_load(path)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sharded_attributes(method: nn.Module, frozen: bool = True) -> list[str]:
    """Names of the method's attributes that hold networks to shard: the student, and (``frozen``) the networks
    it runs every step (teacher, consistency target); a network reachable under two names (a LoRA student is
    the teacher's UNet) is listed once."""
    nets = [method.student] + (list(method.frozen_networks()) if frozen else [])
    names, seen = [], set()
    for net in nets:
        if id(net) in seen:
            continue
        name = next((n for n, m in method.named_children() if m is net), None)
        if name is None:
            raise ValueError(f"{type(net).__name__} is not a direct attribute of {type(method).__name__}; "
                             "FSDP shards the method's own networks")
        names.append(name)
        seen.add(id(net))
    return names


def strategy_of(trainer) -> ShardedStrategy | None:
    strategy = getattr(trainer, "strategy", None)
    return strategy if isinstance(strategy, ShardedStrategy) else None


@contextmanager
def gathered(trainer, module: nn.Module) -> Iterator[None]:
    """Every rank must enter. Under :class:`ShardedStrategy`, the full weights of each sharded network of
    ``module`` are gathered to rank 0, which holds plain copies under the same attribute names for the ``with``
    block (the other ranks wait); the sharded networks are put back after it. Any other strategy: nothing
    changes (and only rank 0 needs to enter)."""
    strategy = strategy_of(trainer)
    if strategy is None or not strategy.skeletons:
        yield
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    lent: dict[str, nn.Module] = {}
    for name, skeleton in strategy.skeletons.items():
        live = getattr(module, name)
        full = get_model_state_dict(live, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if strategy.global_rank == 0:
            plain = copy.deepcopy(skeleton).to_empty(device=strategy.root_device)
            plain.load_state_dict(full)
            for buffer_name, buffer in live.named_buffers():  # buffers are not sharded (non-persistent ones too)
                plain.get_buffer(buffer_name).copy_(buffer)
            plain.train(live.training)
            lent[name] = live
            _swap(module, live, plain)
        del full
    try:
        yield
    finally:
        for name, live in lent.items():
            _swap(module, getattr(module, name), live)
        strategy.barrier("gathered")


def _swap(module: nn.Module, old: nn.Module, new: nn.Module) -> None:
    for name, child in list(module._modules.items()):  # every name (named_children lists a shared module once)
        if child is old:
            setattr(module, name, new)


def full_state(state: dict) -> dict:
    """A state dict with each DTensor gathered to a full CPU tensor (a collective: every rank must call it)."""
    return {k: v.full_tensor().cpu() if is_dtensor(v) else v for k, v in state.items()}


class StateCopy:
    """Detached clones of a sharded module's state dict, the same shards on each rank: what an EMA keeps of a
    sharded student (FSDP modules cannot be deep-copied). ``load_state_dict`` takes shards or full tensors."""

    def __init__(self, module: nn.Module):
        self._state = {k: v.detach().clone() for k, v in module.state_dict().items()}

    def state_dict(self) -> dict:
        return self._state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.tensor import distribute_tensor

        if state.keys() != self._state.keys():
            raise ValueError(f"EMA state has keys {sorted(set(state) ^ set(self._state))[:4]} that the student "
                             "does not (or lacks them): it was saved for another student")
        for key, dst in self._state.items():
            src = state[key]
            if is_dtensor(dst) and not is_dtensor(src):  # a full tensor: this rank's shard of it, no communication
                src = distribute_tensor(src.to(dst.device, dst.dtype), dst.device_mesh, dst.placements,
                                        src_data_rank=None)
            local(dst).copy_(local(src))
