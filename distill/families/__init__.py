"""Model families: one file per family (``sd``: SD-1.x/2.x; ``sdxl``: SDXL; ``class_unet``: the class-conditional
UNet; ``sd3``: SD3/3.5, flow matching, trained by consistency distillation), each a ``ModelFamily``
registered in ``FAMILIES``. Pipeline-level code asks ``family_of(pipe)``, ``denoiser_of(pipe)``,
``set_denoiser(pipe, network)`` and ``native_size(pipe)`` instead of reaching for the pipeline's UNet."""

from distill.families.base import (
    FAMILIES,
    ModelFamily,
    denoiser_of,
    detect_family,
    family_for,
    family_of,
    load_teacher,
    native_size,
    set_denoiser,
)

__all__ = ["FAMILIES", "ModelFamily", "denoiser_of", "detect_family", "family_for", "family_of", "load_teacher",
           "native_size", "set_denoiser"]
