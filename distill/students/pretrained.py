"""A student trained before (``student=pretrained``): a pipeline folder's UNet, or a UNet folder, of any class
distill exports (pruned, low-rank, MoE, EDM-preconditioned) or of diffusers. This module knows every one of those
classes: it sits above ``models/`` and ``compress/``, where they are defined."""

from __future__ import annotations

import json
from pathlib import Path

import diffusers
import torch
from torch import nn

from distill.compress.lowrank import LowRankUNet2DConditionModel
from distill.compress.prune import PrunedUNet2DConditionModel
from distill.models.moe import TimestepMoEUNet, TokenMoEUNet
from distill.models.precondition import EDMPreconditionedUNet2DConditionModel
from distill.students import STUDENTS


def unet_folder(path: str | Path) -> Path:
    """The diffusers model folder of ``path``: itself when it holds ``config.json``, else its ``unet/`` (a
    pipeline folder, e.g. a distill export)."""
    path = Path(path)
    for folder in (path, path / "unet"):
        if (folder / "config.json").is_file():
            return folder
    raise FileNotFoundError(f"student.path={str(path)!r} holds neither config.json nor unet/config.json; give a "
                            "diffusers pipeline folder (e.g. a run's export/) or its unet/ folder")


def _unet_class(name: str) -> type:
    """The UNet class a saved config names (``_class_name``): diffusers' own, or one that distill exports."""
    exported = (PrunedUNet2DConditionModel, LowRankUNet2DConditionModel, TimestepMoEUNet, TokenMoEUNet,
                EDMPreconditionedUNet2DConditionModel)
    cls = {c.__name__: c for c in exported}.get(name, getattr(diffusers, name, None))
    if not isinstance(cls, type):
        raise ValueError(f"student.path holds a {name!r}, which neither diffusers nor distill defines")
    return cls


def _check_pretrained(cfg) -> None:
    """``student.path`` holds a UNet (a config check, before anything is loaded)."""
    unet_folder(cfg.student.path)


@STUDENTS.register("pretrained", check_config=_check_pretrained)
def pretrained_student(teacher_unet: nn.Module, path: str, time_cond_proj_dim: int | None = None,
                       gradient_checkpointing: bool = False) -> nn.Module:
    """A UNet trained before, loaded from ``path`` (a pipeline folder or its ``unet/``), of any class distill
    exports: a recovered pruned or low-rank student, a MoE student, a plain UNet. It must take the teacher's
    latents and text states. With ``time_cond_proj_dim`` and no guidance-scale input yet, one is added as in
    ``copy_student`` (zero-initialised: the student starts as it was), so that latent consistency distillation
    can make a compressed student few-step."""
    folder = unet_folder(path)
    config = json.loads((folder / "config.json").read_text())
    cls = _unet_class(config.get("_class_name", ""))
    model = cls.from_pretrained(folder)
    for key in ("in_channels", "out_channels", "sample_size", "cross_attention_dim"):
        mine, theirs = model.config.get(key), teacher_unet.config.get(key)
        if mine is not None and theirs is not None and mine != theirs:
            raise ValueError(f"student.path={str(path)!r} has {key}={mine}, the teacher {theirs}: it was trained for "
                             "another model; give a student of this teacher")
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
