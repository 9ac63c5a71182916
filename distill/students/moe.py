"""Mixture-of-experts students built from a dense teacher (the networks: ``distill.models.moe`` for a UNet,
``distill.models.moe_transformer`` for SD3's and Flux's transformers): an ensemble of timestep-routed experts
(``student=moe_timestep``) or token-routed feed-forward experts (``student=moe_token``), each expert starting as the
teacher's copy."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from distill.models.moe import SPLITS, TimestepMoEUNet, TokenMoEUNet, expert_boundaries
from distill.models.moe_transformer import (
    TIMESTEP_EXPORTS,
    TOKEN_EXPORTS,
    TRANSFORMERS,
    dense_class,
    expert_state_dict,
    flow_alphas_cumprod,
)
from distill.students import STUDENTS
from distill.students.copies import copy_student


def _teacher_is_transformer(cfg) -> bool:
    """Whether a local teacher's denoiser is an SD3 or Flux transformer (its configs only, no weights)."""
    from distill.models.teacher import pipeline_configs

    path = (cfg.get("teacher") or {}).get("pretrained_model_name_or_path")
    if path is None or not Path(str(path)).exists():
        return False
    name = pipeline_configs(str(path)).get("transformer", {}).get("_class_name")
    return name in {cls.__name__ for cls in TRANSFORMERS}


def _check_moe(cfg) -> None:
    """The expert counts, and what a transformer teacher cannot take: a guidance-scale input, shared layers."""
    student = cfg.student
    if student.num_experts < 1:
        raise ValueError(f"student.num_experts={student.num_experts} must be >= 1")
    top_k = student.get("top_k")
    if top_k is not None and not 1 <= top_k <= student.num_experts:
        raise ValueError(f"student.top_k={top_k} must be between 1 and student.num_experts={student.num_experts}")
    if not _teacher_is_transformer(cfg):
        return
    if student.time_cond_proj_dim is not None:
        raise ValueError(f"student.time_cond_proj_dim={student.time_cond_proj_dim}: the teacher's transformer has no "
                         "guidance-scale input to add; set student.time_cond_proj_dim=null (the guidance is then "
                         "distilled in, as +exp=consistency_flow does)")
    if list(student.get("shared_layers") or []):
        raise ValueError(f"student.shared_layers={list(student.shared_layers)}: the experts of a transformer teacher "
                         "are whole transformers and share nothing; set student.shared_layers=[]")


def _trainable(model: nn.Module, gradient_checkpointing: bool) -> nn.Module:
    if gradient_checkpointing:
        model.enable_gradient_checkpointing()
    return model.train().requires_grad_(True)


@STUDENTS.register("moe_timestep", choices={"split": SPLITS}, routed=True,  # routed: neither XLA nor FSDP
                   check_config=_check_moe)
def timestep_moe_student(teacher_unet: nn.Module, num_experts: int = 2, split: str = "equal_step",
                         boundaries: list[int] | None = None, shared_layers: list[str] | tuple = (),
                         time_cond_proj_dim: int | None = None, gradient_checkpointing: bool = False,
                         noise_scheduler=None) -> nn.Module:
    """K experts, each a copy of the teacher (w-conditioned like the copy student when asked). On an SD3 or Flux
    transformer the hand-over timesteps are on the pipeline's scale 1000 t for flow time t, ``equal_snr`` over the
    flow's log-SNR 2 log((1 - t) / t) (``flow_alphas_cumprod``)."""
    dense = copy_student(teacher_unet, time_cond_proj_dim)
    transformer = isinstance(dense, TRANSFORMERS)
    T = noise_scheduler.config.num_train_timesteps if noise_scheduler is not None else 1000
    if boundaries is None:
        abar = flow_alphas_cumprod(T) if transformer else getattr(noise_scheduler, "alphas_cumprod", None)
        boundaries = expert_boundaries(num_experts, split, abar, T)
    elif len(boundaries) != num_experts - 1:
        raise ValueError(f"student.boundaries={list(boundaries)} must list num_experts - 1 = {num_experts - 1} timesteps")
    if transformer:
        if shared_layers:
            raise ValueError(f"student.shared_layers={list(shared_layers)}: a transformer's experts share nothing; "
                             "set student.shared_layers=[]")
        model = TIMESTEP_EXPORTS[dense_class(dense)].from_config(dict(dense.config), handover_timesteps=list(boundaries))
        state = dense.state_dict()
        model.load_state_dict({**state, **{f"later_experts.{k}.{name}": value for k in range(num_experts - 1)
                                           for name, value in state.items()}})
        return _trainable(model, gradient_checkpointing)
    model = TimestepMoEUNet(unet_config=dict(dense.config), boundaries=list(boundaries),
                            shared_layers=list(shared_layers))
    model.register_to_config(num_train_timesteps=T)
    for expert in model.experts:
        expert.load_state_dict(dense.state_dict())
    return _trainable(model, gradient_checkpointing)


@STUDENTS.register("moe_token", routed=True, check_config=_check_moe)
def token_moe_student(teacher_unet: nn.Module, num_experts: int = 4, top_k: int = 1,
                      capacity_factor: float | None = 1.25, eval_capacity_factor: float | None = None,
                      load_balance_weight: float = 0.01, z_loss_weight: float = 0.0, init_noise: float = 0.01,
                      time_cond_proj_dim: int | None = None, gradient_checkpointing: bool = False,
                      noise_scheduler=None) -> nn.Module:
    """Every expert starts as the dense FFN plus Gaussian noise of ``init_noise`` times each weight's
    std (none with one expert, which then computes exactly the dense function). With ``top_k=1`` the
    chosen expert's output is scaled by its router probability (about 1 / E at the start), so a fresh
    student with several experts starts away from the dense function; k >= 2 gates sum to one. An SD3 or Flux
    transformer's feed-forwards of both streams and Flux's single-stream MLPs become experts
    (``distill.models.moe_transformer``)."""
    dense = copy_student(teacher_unet, time_cond_proj_dim)
    moe = {"num_experts": num_experts, "top_k": top_k, "capacity_factor": capacity_factor,
           "eval_capacity_factor": eval_capacity_factor, "load_balance_weight": load_balance_weight,
           "z_loss_weight": z_loss_weight}
    if isinstance(dense, TRANSFORMERS):
        model = TOKEN_EXPORTS[dense_class(dense)].from_config(dict(dense.config), **moe)
        target, state = model, expert_state_dict(dense.state_dict(), model)
    else:
        model = TokenMoEUNet(unet_config=dict(dense.config), **moe)
        T = noise_scheduler.config.num_train_timesteps if noise_scheduler is not None else 1000
        model.register_to_config(num_train_timesteps=T)
        target, state = model.unet, {}
        for key, value in dense.state_dict().items():
            head, sep, tail = key.partition(".ff.")
            if sep:
                for e in range(num_experts):
                    state[f"{head}.ff.experts.{e}.{tail}"] = value
            else:
                state[key] = value
    missing, unexpected = target.load_state_dict(state, strict=False)
    if unexpected or any(not k.endswith("router.weight") for k in missing):
        raise ValueError(f"MoE student does not match the teacher: missing {missing}, unexpected {unexpected}")
    if num_experts > 1 and init_noise > 0:
        with torch.no_grad():
            for layer in model.moe_layers():
                for p in layer.experts.parameters():
                    if p.ndim > 1:
                        p.add_(torch.randn_like(p) * p.std() * init_noise)
    return _trainable(model, gradient_checkpointing)
