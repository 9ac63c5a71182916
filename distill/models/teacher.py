"""Teachers are Stable-Diffusion-format pipelines: a local folder or a hub id, loaded the same way."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from distill.diffusion.parametrization import PREDICTION_TYPES

REQUIRED = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")


@dataclass
class Teacher:
    """The frozen parts of a text-to-image latent diffusion model."""

    unet: nn.Module
    vae: nn.Module
    text_encoder: nn.Module
    tokenizer: object
    scheduler: object
    source: str

    @property
    def prediction_type(self) -> str:
        return self.scheduler.config.prediction_type

    @property
    def vae_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)


def check_pipeline_folder(path: str | Path) -> dict:
    """model_index.json of a local pipeline folder, with a clear error for anything else."""
    path = Path(path)
    index = path / "model_index.json"
    if not index.is_file():
        raise FileNotFoundError(
            f"teacher.pretrained_model_name_or_path={str(path)!r} is not a diffusers pipeline folder "
            "(no model_index.json); give a StableDiffusionPipeline folder or a hub id"
        )
    spec = json.loads(index.read_text())
    missing = [k for k in REQUIRED if k not in spec]
    if missing:
        raise ValueError(f"teacher pipeline {str(path)!r} lacks {missing}; a Stable-Diffusion-format pipeline has {list(REQUIRED)}")
    sched = path / "scheduler" / "scheduler_config.json"
    if sched.is_file():
        prediction_type = json.loads(sched.read_text()).get("prediction_type", "epsilon")
        if prediction_type not in PREDICTION_TYPES:
            raise ValueError(
                f"teacher {str(path)!r} has prediction_type={prediction_type!r}; supported: {list(PREDICTION_TYPES)}"
            )
    return spec


def load_teacher(pretrained_model_name_or_path: str, revision: str | None = None, variant: str | None = None,
                 torch_dtype: str | None = None) -> Teacher:
    """Load and freeze a Stable-Diffusion-format teacher (``requires_grad_(False)``, ``eval()``)."""
    from diffusers import StableDiffusionPipeline

    if Path(pretrained_model_name_or_path).exists():
        check_pipeline_folder(pretrained_model_name_or_path)
    dtype = getattr(torch, torch_dtype) if torch_dtype else None
    pipe = StableDiffusionPipeline.from_pretrained(
        pretrained_model_name_or_path, revision=revision, variant=variant, torch_dtype=dtype,
        safety_checker=None, requires_safety_checker=False,
    )
    if pipe.scheduler.config.prediction_type not in PREDICTION_TYPES:
        raise ValueError(f"teacher prediction_type={pipe.scheduler.config.prediction_type!r} is not supported")
    for module in (pipe.unet, pipe.vae, pipe.text_encoder):
        module.requires_grad_(False).eval()
    return Teacher(pipe.unet, pipe.vae, pipe.text_encoder, pipe.tokenizer, pipe.scheduler, str(pretrained_model_name_or_path))
