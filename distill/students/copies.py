"""Students built from a teacher's network (a UNet, or SD3's or Flux's transformer): a full copy (a UNet optionally
w-conditioned), a fresh UNet, an SD3 or Flux transformer with blocks removed (``shallow``), or LoRA adapters (peft).
A UNet trained before (``pretrained_student``) is loaded in ``distill.students.pretrained``, which knows every UNet
class distill exports."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from diffusers import UNet2DConditionModel
from torch import nn

from distill.students import STUDENTS


@STUDENTS.register("copy")
def copy_student(teacher_unet: UNet2DConditionModel, time_cond_proj_dim: int | None = None,
                 gradient_checkpointing: bool = False) -> UNet2DConditionModel:
    """The teacher's architecture and weights; with ``time_cond_proj_dim`` a guidance-scale embedding
    enters the time embedding through a new zero-initialised projection, so the student starts as the teacher.
    A denoiser of another class (SD3's or Flux's transformer) is copied as it is; it has no such input to add."""
    config = dict(teacher_unet.config)
    unet = isinstance(teacher_unet, UNet2DConditionModel)
    if time_cond_proj_dim is not None:
        if not unet:
            raise ValueError(f"student.time_cond_proj_dim={time_cond_proj_dim}: the teacher's "
                             f"{type(teacher_unet).__name__} has no guidance-scale (timestep_cond) input to add; set "
                             "student.time_cond_proj_dim=null (the guidance is then distilled in, without a w input)")
        config["time_cond_proj_dim"] = time_cond_proj_dim
    student = (UNet2DConditionModel if unet else type(teacher_unet)).from_config(config)
    missing, unexpected = student.load_state_dict(teacher_unet.state_dict(), strict=False)
    if unexpected or any(not k.startswith("time_embedding.cond_proj") for k in missing):
        raise ValueError(f"student does not match the teacher: missing {missing}, unexpected {unexpected}")
    if time_cond_proj_dim is not None:
        torch.nn.init.zeros_(student.time_embedding.cond_proj.weight)
    if gradient_checkpointing:
        student.enable_gradient_checkpointing()
    return student.train().requires_grad_(True)


@STUDENTS.register("fresh")
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


@STUDENTS.register("shallow")
def shallow_student(teacher_unet: nn.Module, num_layers: int | None = None, num_single_layers: int | None = None,
                    gradient_checkpointing: bool = False) -> nn.Module:
    """The teacher's transformer with some of its blocks kept, with their weights, the rest removed (BK-SDM's block
    removal, Kim et al. 2023): ``num_layers`` of the L joint blocks of SD3, or of the double-stream blocks of Flux,
    and Flux's ``num_single_layers`` single-stream blocks (each default: half, rounded up). Of each list, student
    block j is teacher block (j + 1) L // n - 1 (``evenly_spaced_blocks``, the last kept as the last: SD3's
    context_pre_only block), the block whose feature feature distillation matches it to
    (``ModelFamily.feature_block_pairs``), so that the student starts from the features it learns to reproduce."""
    from distill.compress.depth_prune import block_lists, keep_blocks
    from distill.families.base import evenly_spaced_blocks

    try:
        lists = block_lists(teacher_unet)  # the block lists it thins, in forward order, with their config keys
    except ValueError:
        raise ValueError(f"student=shallow removes blocks of an SD3 or Flux transformer; the teacher's denoiser is a "
                         f"{type(teacher_unet).__name__}: use student=pruned or lowrank") from None
    asked = {"num_layers": num_layers, "num_single_layers": num_single_layers}
    for key, value in asked.items():
        if value is not None and key not in lists.values():
            raise ValueError(f"student.{key}={value}: a {type(teacher_unet).__name__} has no such blocks (its block "
                             f"lists: {list(lists)}); set student.{key}=null")
    kept = {}
    for blocks, key in lists.items():
        total = len(getattr(teacher_unet, blocks))
        n = (total + 1) // 2 if asked[key] is None else asked[key]
        try:
            kept[blocks] = evenly_spaced_blocks(total, n)
        except ValueError as err:
            raise ValueError(f"student.{key}={n}: {err}") from None  # the key first (train shows the root)
    student = keep_blocks(teacher_unet, kept)
    if gradient_checkpointing:
        student.enable_gradient_checkpointing()
    return student.train().requires_grad_(True)


# LoRA's default target modules per denoiser class (the first of a network's classes, in method resolution order,
# found here); peft matches each name as a suffix of a module's dotted name (to_q: every attention's query)
LORA_TARGET_MODULES: dict[str, tuple[str, ...]] = {
    # diffusers' LCM-LoRA script (train_lcm_distill_lora_sd_wds.py): attention, feed-forward, resnet and
    # time-embedding layers and the down/upsampler convolutions
    "UNet2DConditionModel": ("to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2",
                             "conv1", "conv2", "conv_shortcut", "downsamplers.0.conv", "upsamplers.0.conv",
                             "time_emb_proj"),
    # MMDiT: every attention's image stream (SD3.5's second attention attn2 and Flux's single-stream blocks
    # included) and context stream (add_*_proj, to_add_out), as diffusers' train_dreambooth_lora_sd3.py targets, and
    # both streams' feed-forwards (ff, ff_context), as its train_dreambooth_lora_flux.py does: a distilled student
    # changes the whole function, so the MLPs adapt too, as LCM-LoRA's do in the UNet
    "SD3Transformer2DModel": ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj",
                              "to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"),
}
LORA_TARGET_MODULES["FluxTransformer2DModel"] = LORA_TARGET_MODULES["SD3Transformer2DModel"]


def lora_target_modules(network: nn.Module) -> tuple[str, ...]:
    """The default LoRA targets of ``network``'s class (``LORA_TARGET_MODULES``); a class without an entry is refused,
    naming ``student.target_modules``."""
    for cls in type(network).__mro__:
        if cls.__name__ in LORA_TARGET_MODULES:
            return LORA_TARGET_MODULES[cls.__name__]
    raise ValueError(f"student=lora has no default target modules for a {type(network).__name__} (known: "
                     f"{sorted(LORA_TARGET_MODULES)}); name its linear layers in student.target_modules=[...]")


def add_lora_adapter(network: nn.Module, rank: int, alpha: float | None = None,
                     target_modules: tuple[str, ...] | None = None, adapter_name: str = "default",
                     init_lora_weights: bool | str = True) -> nn.Module:
    """peft LoRA adapters ``adapter_name`` of ``rank`` (alpha default the rank) on ``network`` in place, on
    ``target_modules`` (default the class's ``LORA_TARGET_MODULES``; a name without a dot that the network lacks is
    skipped); B = 0, so the adapted network starts as ``network``."""
    from peft import LoraConfig

    present = {name.split(".")[-1] for name, _ in network.named_modules()}
    wanted = lora_target_modules(network) if target_modules is None else target_modules
    targets = [t for t in wanted if t.split(".")[-1] in present or "." in t]
    network.add_adapter(LoraConfig(r=rank, lora_alpha=alpha or rank, init_lora_weights=init_lora_weights,
                                   target_modules=targets), adapter_name=adapter_name)
    return network


@STUDENTS.register("lora")
def lora_student(teacher_unet: nn.Module, rank: int = 8, alpha: float | None = None,
                 target_modules: tuple[str, ...] | None = None, gradient_checkpointing: bool = False,
                 time_cond_proj_dim: int | None = None) -> nn.Module:
    """LoRA adapters (peft) on the teacher's network itself (a UNet, SD3's or Flux's transformer); with the adapters
    disabled it is the teacher (LCM-LoRA, Luo et al. 2023b). Only the adapter weights train. ``target_modules``:
    default the network class's (``LORA_TARGET_MODULES``); a name without a dot that the network lacks is skipped.
    ``time_cond_proj_dim`` is the teacher's own (an experiment may set it to null for every student); a
    guidance-scale input cannot be added to the teacher."""

    have = teacher_unet.config.get("time_cond_proj_dim")
    if time_cond_proj_dim is not None and time_cond_proj_dim != have:
        raise ValueError(f"student.time_cond_proj_dim={time_cond_proj_dim}: a LoRA student keeps the teacher's "
                         f"{type(teacher_unet).__name__}, whose guidance input is {have}; set "
                         "student.time_cond_proj_dim=null or use student=copy")

    teacher_unet.requires_grad_(False)
    add_lora_adapter(teacher_unet, rank, alpha, target_modules, init_lora_weights="gaussian")
    if gradient_checkpointing:
        teacher_unet.enable_gradient_checkpointing()
    return teacher_unet


@contextmanager
def adapters_disabled(network: nn.Module) -> Iterator[None]:
    """``network`` without its peft adapters meanwhile (the teacher under a LoRA student or a LoRA fake score),
    their gradient flags left alone. peft's ``disable_adapters``/``enable_adapters`` also set the adapters'
    ``requires_grad`` (False, then True for the active adapter): flipped between a forward pass and its backward, or
    against the role toggling of a multi-role method, that would drop or add gradients. Here only each tuner
    layer's own switch (``_disable_adapters``, what its forward reads) is set, and restored after. A network without
    adapters is unchanged."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in network.modules() if isinstance(m, BaseTunerLayer)]
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, state in zip(layers, before, strict=True):
            m._disable_adapters = state
