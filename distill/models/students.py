"""Students built from a teacher UNet: a full copy (optionally w-conditioned), LoRA adapters (peft), or a UNet
trained before (an export's ``unet/``, e.g. a recovered pruned student made few-step next)."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from pathlib import Path

import torch
from diffusers import UNet2DConditionModel
from torch import nn


def make_student(student: nn.Module | Callable[..., nn.Module], teacher) -> nn.Module:
    """A ready module, or a builder called on the teacher's UNet (and its noise schedule, or the whole teacher:
    VAE, text encoder, tokenizer, if it asks: a builder that calibrates on data)."""
    if isinstance(student, nn.Module):
        return student
    wants = inspect.signature(student).parameters
    extra = {"noise_scheduler": teacher.scheduler} if "noise_scheduler" in wants else {}
    if "teacher" in wants:
        extra["teacher"] = teacher
    return student(teacher.unet, **extra)


def copy_student(teacher_unet: UNet2DConditionModel, time_cond_proj_dim: int | None = None,
                 gradient_checkpointing: bool = False) -> UNet2DConditionModel:
    """The teacher's architecture and weights; with ``time_cond_proj_dim`` a guidance-scale embedding
    enters the time embedding through a new zero-initialised projection, so the student starts as the teacher."""
    config = dict(teacher_unet.config)
    if time_cond_proj_dim is not None:
        config["time_cond_proj_dim"] = time_cond_proj_dim
    student = UNet2DConditionModel.from_config(config)
    missing, unexpected = student.load_state_dict(teacher_unet.state_dict(), strict=False)
    if unexpected or any(not k.startswith("time_embedding.cond_proj") for k in missing):
        raise ValueError(f"student does not match the teacher: missing {missing}, unexpected {unexpected}")
    if time_cond_proj_dim is not None:
        torch.nn.init.zeros_(student.time_embedding.cond_proj.weight)
    if gradient_checkpointing:
        student.enable_gradient_checkpointing()
    return student.train().requires_grad_(True)


def fresh_student(teacher_unet: UNet2DConditionModel, seed: int = 0, time_cond_proj_dim: int | None = None,
                  gradient_checkpointing: bool = False) -> UNet2DConditionModel:
    """The teacher's architecture, freshly initialised (diffusers' own initialisation, from ``seed``): what
    consistency training from scratch (iCT) trains; ``time_cond_proj_dim`` as in ``copy_student``."""
    config = {**dict(teacher_unet.config), "time_cond_proj_dim": time_cond_proj_dim}
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        student = UNet2DConditionModel.from_config(config)
    finally:
        torch.random.set_rng_state(state)
    if gradient_checkpointing:
        student.enable_gradient_checkpointing()
    return student.train().requires_grad_(True)


def lora_student(teacher_unet: UNet2DConditionModel, rank: int = 8, alpha: float | None = None,
                 target_modules: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out",
                                                   "ff.net.0.proj", "ff.net.2", "conv1", "conv2", "conv_shortcut",
                                                   "downsamplers.0.conv", "upsamplers.0.conv", "time_emb_proj"),
                 gradient_checkpointing: bool = False, time_cond_proj_dim: int | None = None) -> UNet2DConditionModel:
    """LoRA adapters (peft) on the teacher UNet itself; with the adapters disabled it is the teacher
    (LCM-LoRA, Luo et al. 2023b). Only the adapter weights train. The default targets are those of
    diffusers' LCM-LoRA script (train_lcm_distill_lora_sd_wds.py): attention, feed-forward, resnet and
    time-embedding layers and the down/upsampler convolutions. ``time_cond_proj_dim`` is the teacher's own (an
    experiment may set it to null for every student); a guidance-scale input cannot be added to the teacher."""
    from peft import LoraConfig

    have = teacher_unet.config.get("time_cond_proj_dim")
    if time_cond_proj_dim is not None and time_cond_proj_dim != have:
        raise ValueError(f"student.time_cond_proj_dim={time_cond_proj_dim}: a LoRA student keeps the teacher's UNet, "
                         f"whose guidance input is {have}; set student.time_cond_proj_dim=null or use student=copy")

    teacher_unet.requires_grad_(False)
    present = {name.split(".")[-1] for name, _ in teacher_unet.named_modules()}
    targets = [t for t in target_modules if t.split(".")[-1] in present or "." in t]
    teacher_unet.add_adapter(LoraConfig(r=rank, lora_alpha=alpha or rank, init_lora_weights="gaussian",
                                        target_modules=targets))
    if gradient_checkpointing:
        teacher_unet.enable_gradient_checkpointing()
    return teacher_unet


def unet_folder(path: str | Path) -> Path:
    """The diffusers model folder of ``path``: itself when it holds ``config.json``, else its ``unet/`` (a
    pipeline folder, e.g. a distill export)."""
    path = Path(path)
    for folder in (path, path / "unet"):
        if (folder / "config.json").is_file():
            return folder
    raise FileNotFoundError(f"student.path={str(path)!r} holds neither config.json nor unet/config.json; give a "
                            "diffusers pipeline folder (e.g. a run's export/) or its unet/ folder")


def _model_class(name: str) -> type:
    """A UNet class named in a saved config: diffusers' own, or distill's (pruned, low-rank, MoE, EDM-preconditioned)."""
    import diffusers

    import distill.inference.pipelines  # noqa: F401  (imports the libraries of distill's model classes)
    from distill.compress import lowrank, prune
    from distill.models import moe, precondition

    for namespace in (diffusers, prune, lowrank, moe, precondition):
        if isinstance(getattr(namespace, name, None), type):
            return getattr(namespace, name)
    raise ValueError(f"student.path holds a {name!r}, which neither diffusers nor distill defines")


def pretrained_student(teacher_unet: nn.Module, path: str, time_cond_proj_dim: int | None = None,
                       gradient_checkpointing: bool = False) -> nn.Module:
    """A UNet trained before, loaded from ``path`` (a pipeline folder or its ``unet/``), of any class distill
    exports: a recovered pruned or low-rank student, a MoE student, a plain UNet. It must take the teacher's
    latents and text states. With ``time_cond_proj_dim`` and no guidance-scale input yet, one is added as in
    ``copy_student`` (zero-initialised: the student starts as it was), so that latent consistency distillation
    can make a compressed student few-step."""
    folder = unet_folder(path)
    config = json.loads((folder / "config.json").read_text())
    cls = _model_class(config.get("_class_name", ""))
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
