"""Denoising spread over processes (torchrun; gloo on CPU, NCCL on GPU): ``parallel=cfg`` (the guided batch's
two halves on two ranks, ``cfg.py``) and ``parallel=asyncdiff`` (the denoiser's blocks split into one component a
rank, each working on the previous step's output of the one before, ``asyncdiff.py``). Every rank loads the same
pipeline and samples the same calls in lockstep; the parallel part hooks the pipeline's denoiser, so schedulers
and pipeline classes run unchanged. Rank 0 writes the results.

    torchrun --standalone --nproc_per_node=2 -m distill.sample parallel=cfg pipeline=<dir>   (launch/parallel.sh)
"""

from __future__ import annotations

from distill.inference.parallel.asyncdiff import AsyncDiff, balanced_split
from distill.inference.parallel.cfg import CFGParallel
from distill.inference.parallel.group import Group, ParallelError, rank, world_size

KINDS = ("none", "cfg", "asyncdiff")
LAUNCH = "launch with torchrun --standalone --nproc_per_node=2 -m distill.<command> ... (launch/parallel.sh)"


def check(kind: str, processes: int, guidance_scale: float | None = None, warmup_steps: int = 1,
          num_blocks: int | None = None, accelerated: bool = False, stride: int = 1) -> None:
    """Refuse a parallel setting that cannot work, naming the fix, before anything is sampled: ``processes`` is
    the world size torchrun gives, ``guidance_scale`` the sampling call's, ``num_blocks`` the denoiser's block
    count (asyncdiff; None: not known yet)."""
    if kind not in KINDS:
        raise ValueError(f"parallel={kind!r} is unknown; use one of {list(KINDS)}")
    if kind == "none":
        return
    if accelerated:
        raise ValueError(f"parallel={kind} hooks the denoiser as a training-free accelerator does; use accelerate=none")
    if kind == "cfg":
        if processes != 2:
            raise ValueError(f"parallel=cfg runs the two guidance branches on 2 processes, not {processes}; "
                             "launch with torchrun --nproc_per_node=2")
        if guidance_scale is not None and guidance_scale <= 1:
            raise ValueError(f"parallel=cfg at guidance_scale={guidance_scale:g}: without classifier-free guidance "
                             "there is one branch to run; set guidance_scale > 1, or parallel=none")
    if kind == "asyncdiff":
        if processes < 2:
            raise ValueError(f"parallel=asyncdiff splits the denoiser over processes, and there is {processes}; "
                             + LAUNCH)
        if warmup_steps < 1:
            raise ValueError(f"parallel.warmup_steps={warmup_steps} must be >= 1: the first asynchronous step needs "
                             "every component's output of a sequential step")
        if stride not in (1, 2):
            raise ValueError(f"parallel.stride={stride}: AsyncDiff's stride is 1 or 2")
        if num_blocks is not None and processes - stride + 1 > num_blocks:
            raise ValueError(f"parallel=asyncdiff on {processes} processes at stride {stride}: "
                             f"{processes - stride + 1} components, and the denoiser has {num_blocks} blocks; use at "
                             f"most {num_blocks + stride - 1} processes")


def denoiser_blocks(pipe) -> list:
    """The pipeline's denoiser as the chain of modules AsyncDiff splits, in the order they run: its family's
    feature blocks (the UNet's mid block included), a UNet block taken apart into its resnets and attentions,
    interleaved as its forward runs them (resnet 0, attention 0, resnet 1, ...), then its down- or upsamplers (a
    finer chain balances the components better; the skip tensors a down block returns are these modules' outputs);
    a transformer's blocks as they are."""
    from distill.families import denoiser_of, family_of

    chain = []
    for block in family_of(pipe).feature_blocks(denoiser_of(pipe), mid_block=True).values():
        resnets = list(getattr(block, "resnets", None) or [])
        if not resnets:
            chain.append(block)
            continue
        attentions = list(getattr(block, "attentions", None) or [])
        for i, resnet in enumerate(resnets):
            chain += [resnet, *attentions[i:i + 1]]
        chain += list(getattr(block, "downsamplers", None) or []) + list(getattr(block, "upsamplers", None) or [])
    return chain


def enable(pipe, kind: str, group: Group, warmup_steps: int = 1, stride: int = 1):
    """Parallel denoising ``kind`` on ``pipe``'s denoiser over ``group`` (its ``disable()`` undoes it); None for
    ``none``."""
    from distill.families import denoiser_of

    if kind == "none":
        return None
    if group.device.type == "cuda":
        pipe.to(group.device)
    if kind == "cfg":
        return CFGParallel(group).enable(denoiser_of(pipe))
    return AsyncDiff(group, warmup_steps, lambda: pipe.scheduler, stride).enable(denoiser_of(pipe),
                                                                                denoiser_blocks(pipe))




def start(pipe, kind: str, guidance_scale: float | None, warmup_steps: int = 1, stride: int = 1,
          timeout_s: float = 120.0, backend: str | None = None, accelerated: bool = False):
    """A command's parallel setup on a loaded ``pipe``: the setting checked (``check``; ValueError before any
    process group exists, so that every rank refuses alike), then the process group and ``enable``. Returns what
    ``enable`` returns (its ``group``, ``disable()``; None for ``none``)."""
    check(kind, world_size(), guidance_scale, warmup_steps,
          len(denoiser_blocks(pipe)) if kind == "asyncdiff" else None, accelerated, stride)
    if kind == "none":
        return None
    return enable(pipe, kind, Group(timeout_s, backend), warmup_steps, stride)


__all__ = ["KINDS", "AsyncDiff", "CFGParallel", "Group", "ParallelError", "balanced_split", "check",
           "denoiser_blocks", "enable", "rank", "start", "world_size"]
