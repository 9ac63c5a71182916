"""Mixture-of-experts students built from a dense teacher UNet (the networks: ``distill.models.moe``): an
ensemble of timestep-routed experts (``student=moe_timestep``) or token-routed feed-forward experts
(``student=moe_token``), each expert starting as the teacher's copy."""

from __future__ import annotations

import torch
from diffusers import UNet2DConditionModel

from distill.models.moe import SPLITS, TimestepMoEUNet, TokenMoEUNet, expert_boundaries
from distill.students import STUDENTS
from distill.students.copies import copy_student


@STUDENTS.register("moe_timestep", choices={"split": SPLITS}, routed=True)  # routed: neither XLA nor FSDP
def timestep_moe_student(teacher_unet: UNet2DConditionModel, num_experts: int = 2, split: str = "equal_step",
                         boundaries: list[int] | None = None, shared_layers: list[str] | tuple = (),
                         time_cond_proj_dim: int | None = None, gradient_checkpointing: bool = False,
                         noise_scheduler=None) -> TimestepMoEUNet:
    """K experts, each a copy of the teacher (w-conditioned like the copy student when asked)."""
    dense = copy_student(teacher_unet, time_cond_proj_dim)
    T = noise_scheduler.config.num_train_timesteps if noise_scheduler is not None else 1000
    if boundaries is None:
        abar = getattr(noise_scheduler, "alphas_cumprod", None)
        boundaries = expert_boundaries(num_experts, split, abar, T)
    elif len(boundaries) != num_experts - 1:
        raise ValueError(f"student.boundaries={list(boundaries)} must list num_experts - 1 = {num_experts - 1} timesteps")
    model = TimestepMoEUNet(unet_config=dict(dense.config), boundaries=list(boundaries),
                            shared_layers=list(shared_layers))
    model.register_to_config(num_train_timesteps=T)
    for expert in model.experts:
        expert.load_state_dict(dense.state_dict())
    if gradient_checkpointing:
        model.enable_gradient_checkpointing()
    return model.train().requires_grad_(True)


@STUDENTS.register("moe_token", routed=True)
def token_moe_student(teacher_unet: UNet2DConditionModel, num_experts: int = 4, top_k: int = 1,
                      capacity_factor: float | None = 1.25, eval_capacity_factor: float | None = None,
                      load_balance_weight: float = 0.01, z_loss_weight: float = 0.0, init_noise: float = 0.01,
                      time_cond_proj_dim: int | None = None, gradient_checkpointing: bool = False,
                      noise_scheduler=None) -> TokenMoEUNet:
    """Every expert starts as the dense FFN plus Gaussian noise of ``init_noise`` times each weight's
    std (none with one expert, which then computes exactly the dense function). With ``top_k=1`` the
    chosen expert's output is scaled by its router probability (about 1 / E at the start), so a fresh
    student with several experts starts away from the dense function; k >= 2 gates sum to one."""
    dense = copy_student(teacher_unet, time_cond_proj_dim)
    model = TokenMoEUNet(unet_config=dict(dense.config), num_experts=num_experts, top_k=top_k,
                         capacity_factor=capacity_factor, eval_capacity_factor=eval_capacity_factor,
                         load_balance_weight=load_balance_weight, z_loss_weight=z_loss_weight)
    T = noise_scheduler.config.num_train_timesteps if noise_scheduler is not None else 1000
    model.register_to_config(num_train_timesteps=T)
    state = {}
    for key, value in dense.state_dict().items():
        head, sep, tail = key.partition(".ff.")
        if sep:
            for e in range(num_experts):
                state[f"{head}.ff.experts.{e}.{tail}"] = value
        else:
            state[key] = value
    missing, unexpected = model.unet.load_state_dict(state, strict=False)
    if unexpected or any(not k.endswith("router.weight") for k in missing):
        raise ValueError(f"MoE student does not match the teacher: missing {missing}, unexpected {unexpected}")
    if num_experts > 1 and init_noise > 0:
        with torch.no_grad():
            for layer in model.moe_layers():
                for p in layer.experts.parameters():
                    if p.ndim > 1:
                        p.add_(torch.randn_like(p) * p.std() * init_noise)
    if gradient_checkpointing:
        model.enable_gradient_checkpointing()
    return model.train().requires_grad_(True)
