"""Generate a sample grid (rows = prompts, columns = seeds) from any Stable-Diffusion-format pipeline, or
from a class-conditional export (rows = classes; prompts are class indices).

    python -m distill.sample pipeline=distill/assets/digits/teacher out=grid.png
    python -m distill.sample pipeline=<dir or hub id> sampler=dpmsolver num_inference_steps=10

The step count and guidance default to the export's intended call (its distill.json), else the pipeline's own.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from distill.config.schema import register_configs
from distill.data.digits import caption_for
from distill.utils.loggers import register_resolvers

register_configs()
register_resolvers()


def load_pipeline(name_or_path: str):
    """A diffusers pipeline from a local folder or a hub id (local files only when offline); distill's own
    pipeline classes (named in an export's model_index.json) are registered with diffusers first."""
    from diffusers import DiffusionPipeline

    import distill.inference.pipelines  # noqa: F401

    path = Path(name_or_path)
    if path.exists() and not (path / "model_index.json").is_file():
        raise FileNotFoundError(f"pipeline={name_or_path!r} has no model_index.json; give a diffusers pipeline folder")
    return DiffusionPipeline.from_pretrained(name_or_path)


def pipeline_defaults(name_or_path: str) -> dict:
    """The export's intended call (scheduler name, num_inference_steps, guidance_scale); {} without distill.json."""
    from distill.inference.model_card import read_export_info

    return read_export_info(name_or_path).get("sampling", {})


@hydra.main(version_base="1.3", config_path="conf", config_name="sample")
def main(cfg: DictConfig) -> None:
    from distill.inference.pipelines import DistillClassPipeline
    from distill.inference.schedulers import SCHEDULERS, make_scheduler
    from distill.utils.images import image_grid, upscale

    if cfg.sampler is not None and cfg.sampler not in SCHEDULERS:
        sys.exit(f"error: sampler={cfg.sampler!r} is unknown; use one of {sorted(SCHEDULERS)}")
    try:
        pipe = load_pipeline(cfg.pipeline)
    except (FileNotFoundError, OSError, ValueError) as err:
        sys.exit(f"error: {err}")
    pipe.set_progress_bar_config(disable=True)
    if cfg.sampler is not None:
        pipe.scheduler = make_scheduler(cfg.sampler, pipe.scheduler.config)
    defaults = pipeline_defaults(cfg.pipeline)
    guidance = cfg.guidance_scale if cfg.guidance_scale is not None else defaults.get("guidance_scale", 1.0)
    steps = cfg.num_inference_steps or defaults.get("num_inference_steps")
    step_kwargs = {"num_inference_steps": steps} if steps else {}  # else the pipeline's own default
    classes = isinstance(pipe, DistillClassPipeline)
    prompts = list(cfg.prompts) if cfg.prompts else [
        str(i) if classes else caption_for(i) for i in range(pipe.num_classes if classes else 10)]
    size = pipe.unet.config.sample_size * pipe.vae_scale_factor
    rows = []
    start = time.perf_counter()
    for prompt in prompts:
        generator = torch.Generator().manual_seed(cfg.seed)
        rows.append(pipe([prompt] * cfg.num_seeds, guidance_scale=guidance, height=size, width=size,
                         generator=generator, output_type="pt", **step_kwargs).images * 2 - 1)
    seconds = time.perf_counter() - start
    grid = upscale(image_grid(torch.cat(rows), nrow=cfg.num_seeds), cfg.upscale)
    Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
    grid.save(cfg.out)
    n = len(prompts) * cfg.num_seeds
    print(f"{n} images, {steps or 'default'} steps, guidance {guidance}: {seconds:.1f} s -> {cfg.out}")


if __name__ == "__main__":
    main()
