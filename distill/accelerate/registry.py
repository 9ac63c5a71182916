"""The accelerator registry: an accelerator class registers itself under the kind that ``accelerate.kind`` names
(``@ACCELERATORS.register("deepcache")``), and the config's choice of kinds is generated from it."""

from __future__ import annotations

from distill.utils.registry import Registry

ACCELERATORS = Registry("accelerator", modules=("distill.accelerate.base", "distill.accelerate.blockcache",
                                                "distill.accelerate.deepcache", "distill.accelerate.forecast",
                                                "distill.accelerate.guidance", "distill.accelerate.taylorseer"))
