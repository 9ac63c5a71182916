"""Quality-cost sweep of any text-to-image pipeline: a table, a CSV, a Pareto plot and sample grids.

    python -m distill.evaluate pipeline=<dir or hub id> scheduler=dpmsolver nfe=[1,2,4,8,25,50]
    python -m distill.evaluate schedulers=[ddim,dpmsolver,euler] num_per_class=50

Protocol: ``num_per_class`` prompts "a handwritten digit <word>" per digit with fixed seeds; FID against
the digits' held-out split in the shipped classifier's feature space; the real-data floor is
FID(training digits, held-out) with the same number of images of each digit as the prompts ask.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from distill.config.schema import register_configs
from distill.utils.loggers import register_resolvers

register_configs()
register_resolvers()


def digit_rows_grid(images: torch.Tensor, seeds: int) -> torch.Tensor:
    """Reorder interleaved digit samples (0..9, 0..9, ...) into rows of one digit each: (10 * seeds, C, H, W)."""
    index = [j * 10 + d for d in range(10) for j in range(seeds)]
    return images[index]


def sweep(cfg: DictConfig, out_dir: Path) -> list[dict]:
    from distill.config.schema import EVALUATE_NFE
    from distill.inference.schedulers import SCHEDULERS
    from distill.metrics.quality_cost import (
        PipelineSampler,
        build_evaluator,
        format_table,
        format_uncertain,
        plot_pareto,
        write_csv,
    )
    from distill.sample import load_pipeline, pipeline_defaults
    from distill.utils.images import image_grid, upscale

    names = list(cfg.schedulers) if cfg.schedulers else [cfg.scheduler.name]
    for name in names:
        if name not in SCHEDULERS:
            raise ValueError(f"scheduler {name!r} is unknown; use one of {sorted(SCHEDULERS)}")
    defaults = pipeline_defaults(cfg.pipeline)  # an export's intended call, for what the command line leaves out
    intended = {defaults["num_inference_steps"]} if "num_inference_steps" in defaults else set()
    nfe = list(cfg.nfe) if cfg.nfe else sorted(set(EVALUATE_NFE) | intended)  # the default sweep has the intended count
    if any(n < 1 for n in nfe):
        raise ValueError(f"nfe={nfe} must hold step counts >= 1")
    pipe = load_pipeline(cfg.pipeline)
    guidance = cfg.guidance_scale if cfg.guidance_scale is not None else defaults.get("guidance_scale", 1.0)
    model = cfg.model_name or Path(str(cfg.pipeline)).name
    evaluator, floor, key = build_evaluator(cfg.feature, cfg.clip, cfg.classifier, cfg.num_per_class, cfg.seed,
                                            cfg.resolution, cfg.cost_repeats, cfg.fid_bootstrap)
    # The scheduler group's options (with any overrides) for its own scheduler; every other one of the
    # sweep takes those of its conf/scheduler/<name>.yaml; an export's own scheduler keeps its class and config.
    sampler = PipelineSampler(pipe, {cfg.scheduler.name: dict(cfg.scheduler.options)}, own=defaults.get("name"))
    rows = []
    for name in names:
        for steps in nfe:
            start = time.perf_counter()
            row, images = evaluator.evaluate(sampler, model, name, int(steps), guidance)
            rows.append(row)
            quality = " ".join(f"{label}={format_uncertain(row[col], row[f'{col}_std'])}" for label, col in
                               (("FID", "fid"), ("CLIP", "clip_score"), ("acc", "prompt_accuracy")) if col in row)
            print(f"{model} {name:>9} steps={steps:<3} {quality} latency={row['latency_s'] * 1e3:.1f} ms/img "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
            if cfg.grids:
                seeds = min(cfg.grid_seeds, cfg.num_per_class)
                (out_dir / "grids").mkdir(parents=True, exist_ok=True)
                grid = image_grid(digit_rows_grid(images, seeds), nrow=seeds)
                upscale(grid, 3).save(out_dir / "grids" / f"{model}-{name}-{steps}.png")
    write_csv(rows, out_dir / "quality_cost.csv")
    plot_pareto(rows, out_dir / "pareto.png", title=f"{model}: FID vs latency", floor=floor)
    table = format_table(rows, floor)
    (out_dir / "table.md").write_text(table + "\n")
    (out_dir / "protocol.json").write_text(json.dumps({
        "pipeline": str(cfg.pipeline), "num_per_class": cfg.num_per_class, "num_samples": len(evaluator.captions),
        "seed": cfg.seed, "guidance_scale": guidance, "reference": key, "feature": cfg.feature,
        "fid_feature_fingerprint": evaluator.fid.fingerprint, "real_data_floor": floor["fid"],
        "real_data_floor_std": floor["fid_std"], "fid_bootstrap": cfg.fid_bootstrap,
    }, indent=2))
    print(table)
    print(f"results in {out_dir}")
    return rows


@hydra.main(version_base="1.3", config_path="conf", config_name="evaluate")
def main(cfg: DictConfig) -> None:
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        sweep(cfg, out_dir)
    except (ValueError, FileNotFoundError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
