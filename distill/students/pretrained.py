"""A student trained before (``student=pretrained``): a pipeline folder's denoiser (``unet/`` or, for SD3 and Flux,
``transformer/``), or that model folder itself, of any class distill exports (pruned, low-rank, MoE,
EDM-preconditioned UNets; pruned, low-rank and MoE SD3/Flux transformers) or of diffusers. This module knows every
one of those classes: it sits above ``models/`` and ``compress/``, where they are defined."""

from __future__ import annotations

import json
from pathlib import Path

import diffusers
import torch
from torch import nn

from distill.compress.lowrank import LowRankUNet2DConditionModel
from distill.compress.lowrank_transformer import (
    LowRankFluxTransformer2DModel,
    LowRankSD3Transformer2DModel,
)
from distill.compress.prune import PrunedUNet2DConditionModel
from distill.compress.prune_transformer import (
    PrunedFluxTransformer2DModel,
    PrunedSD3Transformer2DModel,
)
from distill.models.moe import TimestepMoEUNet, TokenMoEUNet
from distill.models.moe_transformer import (
    TimestepMoEFluxTransformer2DModel,
    TimestepMoESD3Transformer2DModel,
    TokenMoEFluxTransformer2DModel,
    TokenMoESD3Transformer2DModel,
)
from distill.models.precondition import EDMPreconditionedUNet2DConditionModel
from distill.students import STUDENTS

# the denoiser classes distill exports (named in an export's model_index.json and config.json)
EXPORTED = (PrunedUNet2DConditionModel, LowRankUNet2DConditionModel, TimestepMoEUNet, TokenMoEUNet,
            EDMPreconditionedUNet2DConditionModel, PrunedSD3Transformer2DModel, PrunedFluxTransformer2DModel,
            LowRankSD3Transformer2DModel, LowRankFluxTransformer2DModel, TokenMoESD3Transformer2DModel,
            TokenMoEFluxTransformer2DModel, TimestepMoESD3Transformer2DModel, TimestepMoEFluxTransformer2DModel)
# what a student must share with the teacher to take its latents and conditioning (those a config names)
SHARED_KEYS = ("in_channels", "out_channels", "sample_size", "cross_attention_dim", "patch_size",
               "joint_attention_dim", "pooled_projection_dim", "guidance_embeds")


def denoiser_folder(path: str | Path) -> Path:
    """The diffusers model folder of ``path``: itself when it holds ``config.json``, else its ``unet/`` or
    ``transformer/`` (a pipeline folder, e.g. a distill export)."""
    path = Path(path)
    for folder in (path, path / "unet", path / "transformer"):
        if (folder / "config.json").is_file():
            return folder
    raise FileNotFoundError(f"student.path={str(path)!r} holds none of config.json, unet/config.json, "
                            "transformer/config.json; give a diffusers pipeline folder (e.g. a run's export/) or its "
                            "unet/ or transformer/ folder")


def _denoiser_class(name: str) -> type:
    """The denoiser class a saved config names (``_class_name``): diffusers' own, or one that distill exports."""
    if name.startswith("MeanFlow"):  # distill.models.meanflow: a flow map, not a denoiser of one time
        raise ValueError(f"student.path holds a {name}, a MeanFlow student: it takes two times (r, t), which the "
                         "other methods never pass; continue training it with method=meanflow, or give a student "
                         "of one time")
    cls = {c.__name__: c for c in EXPORTED}.get(name, getattr(diffusers, name, None))
    if not isinstance(cls, type):
        raise ValueError(f"student.path holds a {name!r}, which neither diffusers nor distill defines")
    return cls


def _is_unet(cls: type) -> bool:
    return issubclass(cls, diffusers.UNet2DConditionModel) or cls in (TimestepMoEUNet, TokenMoEUNet)


def _check_pretrained(cfg) -> None:
    """``student.path`` holds a denoiser (a config check, before anything is loaded)."""
    denoiser_folder(cfg.student.path)


@STUDENTS.register("pretrained", check_config=_check_pretrained)
def pretrained_student(teacher_unet: nn.Module, path: str, time_cond_proj_dim: int | None = None,
                       gradient_checkpointing: bool = False) -> nn.Module:
    """A denoiser trained before, loaded from ``path`` (a pipeline folder or its ``unet/``/``transformer/``), of
    any class distill exports: a recovered pruned or low-rank student, a MoE student, a plain UNet or transformer.
    It must take the teacher's latents and conditioning (``SHARED_KEYS``), and be a UNet for a UNet teacher, a
    transformer for a transformer. With ``time_cond_proj_dim`` and no guidance-scale input yet, one is added to a
    UNet as in ``copy_student`` (zero-initialised: the student starts as it was), so that latent consistency
    distillation can make a compressed student few-step; a transformer has no such input."""
    folder = denoiser_folder(path)
    config = json.loads((folder / "config.json").read_text())
    cls = _denoiser_class(config.get("_class_name", ""))
    if _is_unet(cls) != _is_unet(type(teacher_unet)):
        raise ValueError(f"student.path={str(path)!r} holds a {cls.__name__}, the teacher a "
                         f"{type(teacher_unet).__name__}: give a student of this teacher's kind (a UNet for a UNet "
                         "teacher, a transformer for SD3/Flux)")
    model = cls.from_pretrained(folder)
    for key in SHARED_KEYS:
        mine, theirs = model.config.get(key), teacher_unet.config.get(key)
        if mine is not None and theirs is not None and mine != theirs:
            raise ValueError(f"student.path={str(path)!r} has {key}={mine}, the teacher {theirs}: it was trained for "
                             "another model; give a student of this teacher")
    if time_cond_proj_dim is not None and not _is_unet(cls):
        raise ValueError(f"student.time_cond_proj_dim={time_cond_proj_dim}: the {cls.__name__} at {str(path)!r} has "
                         "no guidance-scale (timestep_cond) input to add; set student.time_cond_proj_dim=null")
    have = model.config.get("time_cond_proj_dim")
    if time_cond_proj_dim is not None and have != time_cond_proj_dim:
        if have is not None:
            raise ValueError(f"student.path={str(path)!r} already has a guidance-scale input of size {have}; set "
                             f"student.time_cond_proj_dim={have} or null")
        widened = cls.from_config({**model.config, "time_cond_proj_dim": time_cond_proj_dim})
        missing, unexpected = widened.load_state_dict(model.state_dict(), strict=False)
        if unexpected or any(not k.startswith("time_embedding.cond_proj") for k in missing):
            raise ValueError(f"cannot add a guidance-scale input to the {cls.__name__} at {str(path)!r}: missing "
                             f"{missing}, unexpected {unexpected}")
        torch.nn.init.zeros_(widened.time_embedding.cond_proj.weight)
        model = widened
    if gradient_checkpointing:
        model.enable_gradient_checkpointing()
    return model.float().train().requires_grad_(True)  # fp32 master weights, as copy_student
