"""A depth-pruned student (``student=depth_pruned``): the teacher's SD3 or Flux transformer with its least important
blocks removed (``distill.compress.depth_prune``: the relative change of the velocity when a block alone is skipped,
on calibration batches of the training data), the stock diffusers class with fewer blocks, recovered by
``method=feature_distillation`` with each kept block matched to itself in the teacher."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from diffusers import SD3Transformer2DModel
from torch import nn

from distill.compress.depth_prune import block_lists, depth_prune
from distill.compress.prune_transformer import calibration_times, transformer_example_inputs
from distill.students import STUDENTS
from distill.students.compressed import calibration_batches

log = logging.getLogger(__name__)

COUNT_KEYS = ("num_layers", "num_single_layers")  # the student's keys: the kept blocks of each list (config keys)


def _check_depth_pruned(cfg) -> None:
    """Before anything is built: calibration data given, flow times in [0, 1], and against a local teacher's transformer
    config, a transformer with the named block lists and counts it can keep."""
    from pathlib import Path

    from distill.families.flux import FLUX_BLOCK_LISTS
    from distill.families.sd3 import SD3_BLOCK_LISTS
    from distill.models.teacher import pipeline_configs

    student = cfg.student
    if student.calib_data is None:
        raise ValueError("student=depth_pruned ranks blocks on calibration batches: set student.calib_data=${data}")
    if student.flow_times is not None:
        calibration_times(list(student.flow_times))
    path = (cfg.get("teacher") or {}).get("pretrained_model_name_or_path")
    if path is None or not Path(str(path)).exists():
        return
    config = pipeline_configs(str(path)).get("transformer", {})
    lists = {"SD3Transformer2DModel": SD3_BLOCK_LISTS, "FluxTransformer2DModel": FLUX_BLOCK_LISTS}.get(
        config.get("_class_name"))
    if lists is None:
        raise ValueError(f"student=depth_pruned removes blocks of an SD3 or Flux transformer; the teacher {path} has "
                         f"{config.get('_class_name') or 'a UNet'}: use student=pruned or lowrank")
    for key in COUNT_KEYS:
        _count(student.get(key), key, config.get(key), key in lists.values(), last_fixed=lists is SD3_BLOCK_LISTS)


def _count(value: int | None, key: str, total: int | None, has: bool, last_fixed: bool) -> int | None:
    """The kept count of one list (default half, rounded up), refused where out of range, naming the key."""
    if not has:
        if value is not None:
            raise ValueError(f"student.{key}={value}: the teacher's transformer has no such blocks; set "
                             f"student.{key}=null")
        return None
    n = (total + 1) // 2 if value is None else value
    if not 1 <= n <= total:
        raise ValueError(f"student.{key}={n}: keep 1 to {total} of the teacher's {total} blocks"
                         + (" (its last, context_pre_only, always stays)" if last_fixed else ""))
    return n


@STUDENTS.register("depth_pruned", check_config=_check_depth_pruned)
def depth_pruned_student(teacher_unet: nn.Module, num_layers: int | None = None, num_single_layers: int | None = None,
                         flow_times: Sequence[float] | None = None, calib_data=None, calib_batches: int = 4,
                         gradient_checkpointing: bool = False, seed: int = 0, teacher=None) -> nn.Module:
    """The teacher's transformer with ``num_layers`` of its joint (SD3) or double-stream (Flux) blocks and Flux's
    ``num_single_layers`` single-stream blocks kept (each default half, rounded up): in each list those whose skipping
    alone changes the velocity most over ``flow_times`` (default 8) on ``calib_batches`` batches of ``calib_data``
    (the training data module), eps seeded by ``seed``. SD3's last block always stays. Its export is the stock class
    with only ``num_layers`` (``num_single_layers``) changed."""
    lists = block_lists(teacher_unet)
    if calib_data is None or teacher is None:
        raise ValueError("student=depth_pruned ranks blocks on calibration batches: set student.calib_data=${data}")
    asked = {"num_layers": num_layers, "num_single_layers": num_single_layers}
    num_blocks = {}
    for blocks, key in lists.items():
        total = len(getattr(teacher_unet, blocks))
        num_blocks[blocks] = _count(asked[key], key, total, True, last_fixed=isinstance(teacher_unet, SD3Transformer2DModel))
    for key in set(COUNT_KEYS) - set(lists.values()):
        _count(asked[key], key, None, False, False)
    calib = calibration_batches(calib_data, teacher, calib_batches, seed)
    text_len = teacher.family.null_condition(1)["encoder_hidden_states"].shape[1]
    student, report = depth_prune(teacher_unet, num_blocks, teacher.family, calib, flow_times,
                                  example_inputs=transformer_example_inputs(teacher_unet, text_len=text_len), seed=seed)
    log.info("depth-pruned student: %s", report.table())
    if gradient_checkpointing:
        student.enable_gradient_checkpointing()
    return student.train().requires_grad_(True)
