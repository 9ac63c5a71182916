"""Student builders, every one: a builder registers itself under the name of its config option (``student=lora``),
where it is defined (``@STUDENTS.register("lora")``), in one of this package's modules:

- ``copies``: the teacher's network copied, freshly initialised, or under LoRA adapters;
- ``compressed``: the teacher's network pruned or factorised (``distill.compress``), then trained back;
- ``depth``: the teacher's transformer with its least important blocks removed, then trained back;
- ``pretrained``: a network trained before, of any class distill exports;
- ``moe``: mixtures of experts made from the teacher (``distill.models.moe``);
- ``sized``: UNets built from a size table, trained from scratch (plain diffusion training);
- ``assets``: networks the asset trainers train that are no world's own (the VAE, the noisy classifier); a
  world's own (its CLIP, its classifier) register from the world's package (``distill.worlds``).

The networks themselves (their classes) stay in ``distill.models`` and ``distill.compress``, whose module paths
exports name in ``model_index.json``; this package sits above both and only builds students from them.

The config's schema of each builder is generated from its signature (``distill.config.builds.registered``): a
builder that takes ``teacher_unet`` is made from the teacher, and the method calls it with the teacher's network
(``make_student``). ``choices``, ``kwargs_of`` and ``convert`` at registration type a string argument as a fixed
set, name the callable a ``**kwargs`` goes to, and set Hydra's ``_convert_``. A builder's config check, if it has
one, is its registration's ``check_config`` (a function of the composed config that raises ``ValueError`` naming
the key and the fix); ``routed=True`` marks a student that routes samples to experts (data-dependent shapes,
experts per rank), which ``distill.config.validate`` refuses on XLA and FSDP."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from torch import nn

from distill.utils.registry import Registry

STUDENTS = Registry("student", modules=(
    "distill.students.copies", "distill.students.compressed", "distill.students.depth", "distill.students.pretrained",
    "distill.students.moe", "distill.students.sized", "distill.students.assets"))


def make_student(student: nn.Module | Callable[..., nn.Module], teacher) -> nn.Module:
    """A ready module, or a builder called on the teacher's denoiser (and its noise schedule, or the whole teacher:
    its family's conditioning and latents, if it asks: a builder that calibrates on data)."""
    if isinstance(student, nn.Module):
        return student
    wants = inspect.signature(student).parameters
    extra = {"noise_scheduler": teacher.scheduler} if "noise_scheduler" in wants else {}
    if "teacher" in wants:
        extra["teacher"] = teacher
    return student(teacher.denoiser, **extra)
