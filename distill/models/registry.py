"""The student registry: a builder registers itself under the name of its config option (``student=lora``), where
it is defined (``@STUDENTS.register("lora")``). The config's schema of each is generated from the builder's
signature (``distill.config.builds.registered``): a builder that takes ``teacher_unet`` is made from the teacher,
and the method calls it with the teacher's network. ``choices``, ``kwargs_of`` and ``convert`` at registration
type a string argument as a fixed set, name the callable a ``**kwargs`` goes to, and set Hydra's ``_convert_``.
A builder's config check, if it has one, is its registration's ``check_config`` (a function of the composed
config that raises ``ValueError`` naming the key and the fix); ``routed=True`` marks a student that routes samples
to experts (data-dependent shapes, experts per rank), which ``distill.config.validate`` refuses on XLA and FSDP."""

from __future__ import annotations

from distill.utils.registry import Registry

STUDENTS = Registry("student", modules=(
    "distill.models.students", "distill.models.moe", "distill.compress.students", "distill.models.unet",
    "distill.models.vae", "distill.models.noisy_classifier"))
