"""Compressed students built from the teacher's network, for every method (``student=lowrank``, ``student=pruned``;
both also take SD3's and Flux's transformers).

Each starts as the teacher's copy (``copy_student``: optionally with the zero-initialised guidance-scale input
a latent consistency student takes), then is made smaller; the method trains it back to quality. The report of
what was removed is logged at build time; the exported UNet's config records the resulting shapes (pruned) or ranks
(low rank). A compressed UNet trained before is loaded as ``student=pretrained`` (``distill.students.pretrained``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from itertools import islice

import torch
from torch import nn

from distill.compress.lowrank import UNET_KEEP_DENSE, lowrank_unet
from distill.compress.lowrank_transformer import TRANSFORMER_KEEP_DENSE, lowrank_transformer
from distill.compress.prune import _check_ratio, prune_unet, unet_example_inputs
from distill.compress.prune_transformer import (
    TRANSFORMERS,
    prune_transformer,
    transformer_example_inputs,
)
from distill.students import STUDENTS
from distill.students.copies import copy_student

log = logging.getLogger(__name__)


def _check_lowrank(cfg) -> None:
    """One rank rule, a budget's fraction and target, and the options the teacher's denoiser takes (a local
    teacher's configs, no weights)."""
    from distill.compress.lowrank import BUDGET_TARGETS, _check_fraction

    student = cfg.student
    given = [k for k in ("rank", "energy", "budget") if student.get(k) is not None]
    if len(given) != 1:
        raise ValueError(f"student=lowrank needs exactly one of student.rank, student.energy, student.budget; got "
                         f"{given or 'none'} (e.g. student.budget=0.5, or student.budget=null student.energy=0.9)")
    if student.target not in BUDGET_TARGETS:
        raise ValueError(f"student.target={student.target!r} is not one of {list(BUDGET_TARGETS)}")
    if student.budget is not None:
        _check_fraction("student.budget", student.budget)
    if student.time_cond_proj_dim is not None and _teacher_denoiser(cfg) in {c.__name__ for c in TRANSFORMERS}:
        raise ValueError(f"student.time_cond_proj_dim={student.time_cond_proj_dim}: the teacher's "
                         f"{_teacher_denoiser(cfg)} has no guidance-scale (timestep_cond) input to add; set "
                         "student.time_cond_proj_dim=null")


def _example_inputs(dense: nn.Module, teacher) -> dict:
    """Inputs of one call of ``dense`` for counting FLOPs: the teacher's context length (a transformer's from its
    conditioner, a UNet's its tokenizer's), each input's default without a teacher."""
    if isinstance(dense, TRANSFORMERS):
        if teacher is None:
            return transformer_example_inputs(dense)
        text_len = teacher.family.null_condition(1)["encoder_hidden_states"].shape[1]
        return transformer_example_inputs(dense, text_len=text_len)
    return unet_example_inputs(dense) if teacher is None else unet_example_inputs(
        dense, text_len=teacher.tokenizer.model_max_length)


@STUDENTS.register("lowrank", check_config=_check_lowrank)
def lowrank_student(teacher_unet: nn.Module, rank: int | Mapping[str, int] | None = None,
                    energy: float | Mapping[str, float] | None = None, budget: float | None = None,
                    target: str = "params", keep_dense: Sequence[str] | None = None,
                    layer_kinds: Sequence[str] = ("linear", "conv"), time_cond_proj_dim: int | None = None,
                    gradient_checkpointing: bool = False, teacher=None) -> nn.Module:
    """The teacher with its Linear and Conv2d weights factorised by truncated SVD (``distill.compress.lowrank``; an
    SD3 or Flux transformer's block linears, ``distill.compress.lowrank_transformer``): exactly one of ``rank`` (per
    layer, or per kind / name pattern), ``energy`` (the fraction of each layer's squared singular values kept) or
    ``budget``: the fraction of the factorisable parameters kept (``target=params``) or of one call's FLOPs
    (``target=flops``, attention counted, at the teacher's sample size and text length). ``keep_dense`` (fnmatch
    patterns) defaults to the family's: ``UNET_KEEP_DENSE``, ``TRANSFORMER_KEEP_DENSE``."""
    given = [k for k, v in (("rank", rank), ("energy", energy), ("budget", budget)) if v is not None]
    if len(given) != 1:
        raise ValueError(f"student=lowrank needs exactly one of student.rank, student.energy, student.budget; got "
                         f"{given or 'none'} (e.g. student.budget=0.5)")
    dense = copy_student(teacher_unet, time_cond_proj_dim)
    rules = dict(rank=rank, energy=energy, budget=budget, target=target, layer_kinds=tuple(layer_kinds))
    if isinstance(dense, TRANSFORMERS):
        student, report = lowrank_transformer(
            dense, keep_dense=TRANSFORMER_KEEP_DENSE if keep_dense is None else tuple(keep_dense),
            example_inputs=_example_inputs(dense, teacher), **rules)
    else:
        inputs = _example_inputs(dense, teacher) if budget is not None and target == "flops" else None
        student, report = lowrank_unet(dense, keep_dense=UNET_KEEP_DENSE if keep_dense is None else tuple(keep_dense),
                                       example_inputs=inputs, **rules)
    log.info("low-rank student (%s): %d of %d parameters (%.1f%%), %d layers factorised%s", report.rule,
             report.model_params_after, report.model_params, 100 * report.model_params_after / report.model_params,
             sum(layer.factorised for layer in report.layers),
             f", {report.flops_after / report.flops:.1%} of the FLOPs" if report.flops else "")
    if gradient_checkpointing:
        student.enable_gradient_checkpointing()
    return student.train().requires_grad_(True)


def calibration_batches(datamodule, teacher, num_batches: int, seed: int = 0) -> list[tuple[torch.Tensor, dict]]:
    """(latents, conditioning) of the first ``num_batches`` training batches of ``datamodule``, through the teacher's
    family: its latents (a posterior draw, seeded) and its conditioning keyword arguments (a UNet's
    ``encoder_hidden_states``, SD3's and Flux's with their pooled projections), with no prompt cache (each batch's
    prompts encoded together): what Taylor importance is measured on."""
    if num_batches < 1:
        raise ValueError(f"student.calib_batches={num_batches} must be >= 1")
    datamodule.setup("fit")
    family = teacher.family.copy(cache_prompts=False)
    generator = torch.Generator().manual_seed(seed)
    batches = []
    with torch.no_grad():
        for batch in islice(datamodule.train_dataloader(), num_batches):
            batches.append((family.encode(batch["pixel_values"], generator), family.condition(batch)))
    return batches


def check_pruning_options(transformer: bool, per_block: bool, timesteps, flow_times) -> None:
    """Refuse an option of the other kind of denoiser: global ranking and VP timesteps on a transformer (UNet only),
    flow times on a UNet."""
    if transformer and not per_block:
        raise ValueError("student.per_block=false ranks channels over a whole UNet (torch-pruning's global pruning); a "
                         "transformer is pruned by the same fraction of heads and MLP channels in every block: set "
                         "student.per_block=true")
    if transformer and timesteps is not None:
        raise ValueError(f"student.timesteps={list(timesteps)} are a UNet teacher's discrete timesteps; a transformer's "
                         "Taylor score sums over flow times in [0, 1]: set student.timesteps=null (and "
                         "student.flow_times=[...] to choose them)")
    if not transformer and flow_times is not None:
        raise ValueError(f"student.flow_times={list(flow_times)} are a flow transformer's times; the teacher is a UNet, "
                         "whose Taylor score sums over its timesteps: set student.flow_times=null (and "
                         "student.timesteps=[...] to choose them)")


def _teacher_denoiser(cfg) -> str | None:
    """The class name of a local teacher's denoiser, its transformer or else its UNet (model_index.json and configs, no
    weights); None for a teacher that is not a local folder."""
    from pathlib import Path

    from distill.models.teacher import pipeline_configs

    path = (cfg.get("teacher") or {}).get("pretrained_model_name_or_path")
    if path is None or not Path(str(path)).exists():
        return None
    configs = pipeline_configs(str(path))
    return (configs.get("transformer") or configs.get("unet") or {}).get("_class_name")


def _check_pruned(cfg) -> None:
    """``student.ratio`` and the options that fit the teacher's denoiser (a local teacher's configs, no weights)."""
    student = cfg.student
    _check_ratio("student.ratio", student.ratio)
    denoiser = _teacher_denoiser(cfg)
    if denoiser is not None:
        check_pruning_options(denoiser in {cls.__name__ for cls in TRANSFORMERS}, student.per_block,
                              student.timesteps, student.flow_times)


@STUDENTS.register("pruned", check_config=_check_pruned)
def pruned_student(teacher_unet: nn.Module, ratio: float = 0.5, target: str = "flops",
                   importance: str = "magnitude", per_block: bool = True, prune_heads: bool = True,
                   iterative_steps: int = 50, timesteps: Sequence[int] | None = None, threshold: float = 0.05,
                   flow_times: Sequence[float] | None = None, calib_data=None, calib_batches: int = 4,
                   time_cond_proj_dim: int | None = None, gradient_checkpointing: bool = False, seed: int = 0,
                   teacher=None):
    """The teacher with ``ratio`` of its FLOPs (or parameters) removed by structured pruning, magnitude or
    Diff-Pruning's Taylor importance; the latter is measured on ``calib_batches`` batches of ``calib_data`` (a data
    module; ``+exp=compress`` passes the training data). A UNet loses channels and heads (``distill.compress.prune``):
    Taylor over every training timestep until the ``threshold`` stops it (``timesteps`` thins them), ``per_block`` (a
    uniform width multiplier) or global ranking, which alone takes ``iterative_steps``: see ``prune_unet``. An SD3 or
    Flux transformer loses the same fraction of every block's attention heads and MLP channels
    (``distill.compress.prune_transformer``; ``prune_heads=False``: MLP channels only), Taylor over ``flow_times``
    (default 8) until the ``threshold`` stops it. FLOPs are counted at the teacher's sample size and text length."""
    _check_ratio("student.ratio", ratio)  # before the copy and any calibration compute
    transformer = isinstance(teacher_unet, TRANSFORMERS)
    check_pruning_options(transformer, per_block, timesteps, flow_times)
    calib = None
    if importance == "taylor":
        if calib_data is None or teacher is None:
            raise ValueError("student.importance=taylor needs calibration data: set student.calib_data=${data} "
                             "(the training data) or use student.importance=magnitude")
        calib = calibration_batches(calib_data, teacher, calib_batches, seed)
    dense = copy_student(teacher_unet, time_cond_proj_dim)
    if transformer:
        inputs = _example_inputs(dense, teacher) if teacher is not None else None
        student, report = prune_transformer(dense, ratio, target=target, importance=importance,
                                            family=teacher.family if teacher is not None else None, calib=calib,
                                            flow_times=flow_times, threshold=threshold, prune_heads=prune_heads,
                                            example_inputs=inputs, seed=seed)
    else:
        inputs = _example_inputs(dense, teacher) if teacher is not None else None
        calib = [(x0, cond["encoder_hidden_states"]) for x0, cond in calib] if calib is not None else None
        student, report = prune_unet(dense, ratio, target=target, importance=importance, calib=calib,
                                     noise_scheduler=teacher.scheduler if teacher is not None else None,
                                     timesteps=timesteps, threshold=threshold, per_block=per_block,
                                     prune_heads=prune_heads, iterative_steps=iterative_steps, example_inputs=inputs,
                                     seed=seed)
    log.info("pruned student: %s", report.table())
    if gradient_checkpointing:
        student.enable_gradient_checkpointing()
    return student.train().requires_grad_(True)
