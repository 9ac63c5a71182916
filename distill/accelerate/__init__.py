"""Training-free sampling accelerators for any diffusers pipeline and any UNet (teacher or student): feature
caching (DeepCache), step forecasting (Taylor or fitted) and classifier guidance (instead of or on top of
classifier-free guidance), each a sampling option that ``distill.evaluate``
and the quality-cost callback sweep like schedulers (``accelerate=deepcache`` or ``accelerators=[none,...]``).

    from distill.accelerate import DeepCache, accelerated
    with accelerated(pipe, DeepCache(interval=3)) as context:
        image = pipe(prompt, callback_on_step_end=context.step_end).images[0]

Each accelerator sees the network calls with one ``SamplingContext`` (``distill.accelerate.context``). A new one
is one file: a subclass of ``Accelerator`` registered with ``@ACCELERATORS.register("<kind>")`` (see
``tests/examples/toy_accelerator.py``).
"""

from __future__ import annotations

import inspect
from pathlib import Path

from omegaconf import OmegaConf

from distill.accelerate.base import (
    Accelerator,
    Chain,
    NoAccelerator,
    accelerated,
    accelerated_denoiser,
    check_schedulers,
    disable,
    enable,
)
from distill.accelerate.context import SamplingContext, context_of
from distill.accelerate.deepcache import DeepCache
from distill.accelerate.forecast import Forecast
from distill.accelerate.guidance import ClassifierGuidance
from distill.accelerate.registry import ACCELERATORS

ACCELERATE_CONF = Path(__file__).resolve().parents[1] / "conf" / "accelerate"


def accelerator_options(name: str) -> dict:
    """The kind and ``options`` of the package's ``conf/accelerate/<name>.yaml`` (a named preset), else of the
    registered kind ``name`` with its defaults (an accelerator of one's own, which has no preset file)."""
    path = ACCELERATE_CONF / f"{name}.yaml"
    if not path.is_file():
        if name in ACCELERATORS:
            return {"kind": name, "options": {}}
        presets = sorted(p.stem for p in ACCELERATE_CONF.glob("*.yaml"))
        raise ValueError(f"accelerator {name!r} is unknown; use one of the presets {presets} or the registered "
                         f"kinds {ACCELERATORS.names()}")
    node = OmegaConf.to_container(OmegaConf.load(path), resolve=True)  # a guide named by ${distill.asset:...}
    return {"kind": node.get("kind", name), "options": dict(node.get("options") or {})}


def make_accelerator(kind: str, options: dict | None = None, **context) -> Accelerator | None:
    """The accelerator ``kind`` with ``options`` (None for ``none``); ``context`` fills the options its class
    takes and the user left out (``path``: the pipeline's folder, where a fitted forecaster's coefficients are)."""
    if kind not in ACCELERATORS:
        raise ValueError(f"accelerate.kind={kind!r} is unknown; use one of {sorted(ACCELERATORS)}")
    if kind == "none":
        return None
    cls, options = ACCELERATORS.get(kind), dict(options or {})
    takes = inspect.signature(cls).parameters
    for key, value in context.items():
        if key in takes and options.get(key) is None:
            options[key] = value
    try:
        return cls(**options)
    except TypeError as err:  # an option the accelerator does not take
        raise ValueError(f"accelerate.options for {kind}: {err}") from err


def preset(name: str, **context) -> Accelerator | None:
    """The accelerator of preset ``name`` (``conf/accelerate/<name>.yaml``); ``a+b`` chains presets (b wraps a)."""
    if "+" in name:
        parts = [p for p in (preset(part, **context) for part in name.split("+")) if p is not None]
        return Chain(parts) if parts else None
    node = accelerator_options(name)
    return make_accelerator(node["kind"], node["options"], **context)


__all__ = ["ACCELERATORS", "Accelerator", "Chain", "ClassifierGuidance", "DeepCache", "Forecast", "NoAccelerator",
           "SamplingContext", "accelerated", "accelerated_denoiser", "accelerator_options", "check_schedulers",
           "context_of", "disable", "enable", "make_accelerator", "preset"]
