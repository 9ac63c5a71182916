"""Generate a sample grid (rows = prompts, columns = seeds) from any Stable-Diffusion-format pipeline, or
from a class-conditional export (rows = classes; prompts are class indices).

    python -m distill.sample pipeline='${distill.asset:teacher}' out=grid.png    (the embedded default's teacher)
    python -m distill.sample pipeline=<dir or hub id> sampler=dpmsolver num_inference_steps=10
    python -m distill.sample pipeline=<dir> prompts='[a red circle,a blue square]'

Without ``prompts`` the rows are the first ten prompts of the evaluation set (config group ``eval``, which
follows ``data``). The step count and guidance default to the export's intended call (its distill.json),
else the pipeline's own. The grid's PNG metadata (text chunk ``prompts``) lists the rows' prompts.
"""

from __future__ import annotations

import sys
import time

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from distill.config.resolvers import register_resolvers
from distill.config.schema import register_configs
from distill.utils.seeding import global_rng_seeded_by

register_configs()
register_resolvers()


def default_prompts(cfg: DictConfig) -> list[str]:
    """The first ten prompts of the configured evaluation set."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    from distill.config.validate import missing_keys

    missing = missing_keys(cfg)
    if missing:
        raise ValueError(f"required value(s) missing: {', '.join(missing)}; set them, or give prompts=[...]")
    try:
        return instantiate(cfg.eval).prompts()[0][:10]
    except InstantiationException as err:
        raise ValueError(str(err.__cause__ or err)) from err


@hydra.main(version_base="1.3", config_path="conf", config_name="sample")
def main(cfg: DictConfig) -> None:
    from distill.families import native_size
    from distill.inference.loading import call_defaults, load_pipeline, pipeline_defaults
    from distill.inference.parallel import ParallelError, start
    from distill.inference.pipelines import DistillClassPipeline
    from distill.inference.schedulers import SCHEDULERS, make_scheduler, scheduler_options
    from distill.metrics.report import save_grid

    if cfg.sampler is not None and cfg.sampler not in SCHEDULERS:
        sys.exit(f"error: sampler={cfg.sampler!r} is unknown; use one of {sorted(SCHEDULERS)}")
    try:
        pipe = load_pipeline(cfg.pipeline)
        classes = isinstance(pipe, DistillClassPipeline)
        prompts = list(cfg.prompts) if cfg.prompts else (
            [str(i) for i in range(pipe.num_classes)] if classes else default_prompts(cfg))
    except (FileNotFoundError, OSError, ValueError) as err:
        sys.exit(f"error: {err}")
    pipe.set_progress_bar_config(disable=True)
    if cfg.sampler is not None:
        try:  # a scheduler of the model's kind (flow matching or discrete VP)
            pipe.scheduler = make_scheduler(cfg.sampler, pipe.scheduler.config, **scheduler_options(cfg.sampler))
        except ValueError as err:
            sys.exit(f"error: sampler={cfg.sampler!r}: {err}")
    defaults = pipeline_defaults(cfg.pipeline)
    guidance = cfg.guidance_scale if cfg.guidance_scale is not None else defaults.get("guidance_scale",
                                                                                      call_defaults(pipe)[1])
    steps = cfg.num_inference_steps or defaults.get("num_inference_steps")
    step_kwargs = {"num_inference_steps": steps} if steps else {}  # else the pipeline's own default
    size = native_size(pipe)
    options = OmegaConf.to_container(cfg.parallel, resolve=True, enum_to_str=True)
    try:  # refused (exit 2) on every rank alike, before any process group exists
        parallel = start(pipe, options.pop("kind"), guidance, **options)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    rows = []
    begun = time.perf_counter()
    try:
        for prompt in prompts:
            generator = torch.Generator().manual_seed(cfg.seed)
            with global_rng_seeded_by(generator):  # a stock flow pipeline's scheduler steps draw from the global RNG
                rows.append(pipe([prompt] * cfg.num_seeds, guidance_scale=guidance, height=size, width=size,
                                 generator=generator, output_type="pt", **step_kwargs).images * 2 - 1)
    except ParallelError as err:
        sys.exit(f"error: {err}")
    seconds = time.perf_counter() - begun
    if parallel is not None:
        parallel.group.close()
        if parallel.group.rank:  # every rank sampled the same images: rank 0 writes them
            return
    save_grid(torch.cat(rows), cfg.out, cfg.num_seeds, prompts, scale=cfg.upscale)
    n = len(prompts) * cfg.num_seeds
    print(f"{n} images, {steps or 'default'} steps, guidance {guidance}: {seconds:.1f} s -> {cfg.out}")


if __name__ == "__main__":
    main()
