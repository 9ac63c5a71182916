"""Loading any diffusers pipeline, and the intended call an export records in its distill.json."""

from __future__ import annotations

import inspect
import json
from pathlib import Path


def load_pipeline(name_or_path: str):
    """A diffusers pipeline from a local folder or a hub id (local files only when offline); distill's own
    pipeline classes (named in an export's model_index.json) are registered with diffusers first."""
    from diffusers import DiffusionPipeline

    import distill.inference.pipelines  # noqa: F401

    path = Path(name_or_path)
    if path.exists() and not (path / "model_index.json").is_file():
        raise FileNotFoundError(f"pipeline={name_or_path!r} has no model_index.json; give a diffusers pipeline folder")
    if path.exists():
        from distill.families.base import check_components

        check_components(path, key="pipeline")  # a component its family cannot run without, before any weights
    return DiffusionPipeline.from_pretrained(name_or_path, **absent_components(name_or_path))


def absent_components(name_or_path: str) -> dict:
    """``{name: None}`` for each component a local pipeline folder's model_index.json records as absent ([null,
    null]): an SD3 pipeline saved without T5 (``text_encoder_3``), which its class requires unless passed as None."""
    index = Path(name_or_path) / "model_index.json"
    if not index.is_file():
        return {}
    return {name: None for name, spec in json.loads(index.read_text()).items() if spec == [None, None]}


def pipeline_defaults(name_or_path: str) -> dict:
    """The export's intended call (scheduler name, num_inference_steps, guidance_scale); {} without distill.json."""
    from distill.inference.model_card import read_export_info

    return read_export_info(name_or_path).get("sampling", {})


def call_defaults(pipe) -> tuple[int, float]:
    """The step count and guidance of ``pipe(prompt)``: a distill pipeline's registered defaults, else the
    defaults of the pipeline class's ``__call__``."""
    config = pipe.config
    if "default_num_inference_steps" in config:
        return int(config.default_num_inference_steps), float(config.default_guidance_scale)
    params = inspect.signature(type(pipe).__call__).parameters
    steps, guidance = params.get("num_inference_steps"), params.get("guidance_scale")
    return (int(steps.default) if steps is not None and steps.default else 50,
            float(guidance.default) if guidance is not None and guidance.default is not None else 1.0)
