"""Compressed students built from the teacher's UNet, for every method (``student=lowrank``, ``student=pruned``).

Each starts as the teacher's copy (``copy_student``: optionally with the zero-initialised guidance-scale input
a latent consistency student takes), then is made smaller; the method trains it back to quality. The report of
what was removed is logged at build time and written beside the export by the method.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from diffusers import UNet2DConditionModel

from distill.compress.lowrank import UNET_KEEP_DENSE, LowRankUNet2DConditionModel, lowrank_unet
from distill.models.students import copy_student

log = logging.getLogger(__name__)


def lowrank_student(teacher_unet: UNet2DConditionModel, rank: int | Mapping[str, int] | None = None,
                    energy: float | Mapping[str, float] | None = None, budget: float | None = None,
                    keep_dense: Sequence[str] = UNET_KEEP_DENSE, layer_kinds: Sequence[str] = ("linear", "conv"),
                    time_cond_proj_dim: int | None = None,
                    gradient_checkpointing: bool = False) -> LowRankUNet2DConditionModel:
    """The teacher with its Linear and Conv2d weights factorised by truncated SVD (``distill.compress.lowrank``):
    exactly one of ``rank`` (per layer, or per kind / name pattern), ``energy`` (the fraction of each layer's
    squared singular values kept) or ``budget`` (the fraction of the factorisable parameters kept)."""
    given = [k for k, v in (("rank", rank), ("energy", energy), ("budget", budget)) if v is not None]
    if len(given) != 1:
        raise ValueError(f"student=lowrank needs exactly one of student.rank, student.energy, student.budget; got "
                         f"{given or 'none'} (e.g. student.budget=0.5)")
    dense = copy_student(teacher_unet, time_cond_proj_dim)
    student, report = lowrank_unet(dense, rank=rank, energy=energy, budget=budget, keep_dense=tuple(keep_dense),
                                   layer_kinds=tuple(layer_kinds))
    log.info("low-rank student (%s): %d of %d parameters (%.1f%%), %d layers factorised", report.rule,
             report.model_params_after, report.model_params, 100 * report.model_params_after / report.model_params,
             sum(layer.factorised for layer in report.layers))
    if gradient_checkpointing:
        student.enable_gradient_checkpointing()
    return student.train().requires_grad_(True)
