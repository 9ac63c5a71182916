"""Quality-cost sweep of any text-to-image pipeline on an evaluation set: a table, a CSV, a Pareto plot and
sample grids.

    python -m distill.evaluate pipeline=<dir or hub id> scheduler=dpmsolver steps=[1,2,4,8,25,50]
    python -m distill.evaluate schedulers=[ddim,dpmsolver,euler] num_per_class=50
    python -m distill.evaluate accelerators=[none,deepcache,forecast] schedulers=[ddim,dpmsolver] steps=[20,50]
    python -m distill.evaluate pipeline=<dir> data=imagefolder data.root=<images> eval.feature=<vision model>
    python -m distill.evaluate sanity=true eval.extra_features=[pixels,clip]   # does each metric see known defects?

Protocol: the evaluation set (config group ``eval``, following ``data`` by default) gives the prompts,
``num_per_class`` samples of each with fixed seeds; every registered metric (FID and KID in the set's
feature space against its reference, CLIP score, prompt accuracy where the set has labels and a classifier)
with its uncertainty; the real-data floor is the same metrics of real training images, as many of each
label as the prompts ask, against the reference.

``sanity=true`` runs the metric sensitivity suite (``distill.metrics.sanity``) instead of a sweep: real
held-out images of the evaluation set degraded at several strengths (blur, noise, brightness, contrast,
dropped classes, collapsed diversity), every distance in every feature space; no pipeline is loaded.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf

from distill.config.resolvers import register_resolvers
from distill.config.schema import register_configs

log = logging.getLogger(__name__)

register_configs()
register_resolvers()


def sweep(cfg: DictConfig, out_dir: Path) -> list[dict]:
    from hydra.utils import instantiate

    from distill.config.schema import EVALUATE_STEPS
    from distill.config.validate import missing_keys
    from distill.families.base import check_supported
    from distill.inference.loading import call_defaults, load_pipeline, pipeline_defaults
    from distill.inference.parallel import start
    from distill.inference.schedulers import SCHEDULERS, check_scheduler_kind
    from distill.metrics.fid import describe
    from distill.metrics.quality_cost import PipelineSampler, build_evaluator
    from distill.metrics.report import (
        format_quality,
        format_table,
        plot_pareto,
        save_grid,
        write_csv,
    )
    from distill.models.teacher import pipeline_configs

    missing = missing_keys(cfg)
    if missing:
        raise ValueError(f"required value(s) missing: {', '.join(missing)}; set them on the command line, e.g. "
                         f"{missing[0]}=...")
    configs = pipeline_configs(cfg.pipeline)
    check_supported(cfg.pipeline, configs, key="pipeline")  # from its configs, before any weights
    names = list(cfg.schedulers) if cfg.schedulers else [cfg.scheduler.name]
    for name in names:
        if name not in SCHEDULERS:
            raise ValueError(f"scheduler {name!r} is unknown; use one of {sorted(SCHEDULERS)}")
        if configs["scheduler"]:  # a flow model samples with flow schedulers only, a VP one with VP schedulers
            check_scheduler_kind(name, configs["scheduler"], key="schedulers" if cfg.schedulers else "scheduler")
    accelerators = _accelerators(cfg)  # built (options checked) before anything is loaded
    from distill.compress.fusion import check_fusions

    check_fusions("transformer" if configs.get("transformer") else "unet", cfg.channels_last)
    defaults = pipeline_defaults(cfg.pipeline)  # an export's intended call, for what the command line leaves out
    intended = {defaults["num_inference_steps"]} if "num_inference_steps" in defaults else set()
    steps = list(cfg.steps) if cfg.steps else sorted(set(EVALUATE_STEPS) | intended)  # the default sweep has the intended count
    if any(n < 1 for n in steps):
        raise ValueError(f"steps={steps} must hold step counts >= 1")
    try:
        eval_set = instantiate(cfg.eval)
    except InstantiationException as err:
        raise ValueError(str(err.__cause__ or err)) from err
    eval_set.check(needs_fid=True)  # before the pipeline is loaded
    pipe = load_pipeline(cfg.pipeline)
    applied = []
    if cfg.fuse_qkv or cfg.channels_last or cfg.compile:
        from distill.compress.fusion import fuse_denoiser
        from distill.families import denoiser_of, set_denoiser

        if cfg.compile:
            from distill.methods.base import _check_compile_supported

            _check_compile_supported(pipe.device)
        fused, applied = fuse_denoiser(denoiser_of(pipe), qkv=cfg.fuse_qkv, channels_last=cfg.channels_last,
                                       compile=cfg.compile)
        set_denoiser(pipe, fused)
        log.info("denoiser speed-ups: %s", ", ".join(applied))
    # the command line's, else the export's intended call, else the pipeline class's own (StableDiffusionPipeline: 7.5)
    guidance = cfg.guidance_scale if cfg.guidance_scale is not None else defaults.get("guidance_scale",
                                                                                      call_defaults(pipe)[1])
    if cfg.null_prompts and guidance > 1:
        raise ValueError(f"null_prompts=true samples the empty prompt, where CFG at guidance_scale={guidance} would run "
                         "the same pass twice; set guidance_scale=1")
    options = OmegaConf.to_container(cfg.parallel, resolve=True, enum_to_str=True)
    accelerated = any(label != "none" for label, _ in accelerators)
    parallel_kind = options.pop("kind")
    parallel = start(pipe, parallel_kind, guidance, accelerated=accelerated, **options)
    if parallel is not None and parallel.group.rank:  # every rank samples the same images: rank 0 writes the results
        out_dir = Path(tempfile.mkdtemp(prefix=f"evaluate-rank{parallel.group.rank}-"))
    variant = "".join(f"+{name}" for name, on in (("qkv", cfg.fuse_qkv), ("channels_last", cfg.channels_last),
                                                     ("compile", cfg.compile)) if on)
    variant += f"+{parallel_kind}_parallel" if parallel is not None else ""
    model = cfg.model_name or Path(str(cfg.pipeline)).name + variant + ("(null prompt)" if cfg.null_prompts else "")
    evaluator, floor, key = build_evaluator(eval_set, cfg.num_per_class, cfg.seed, cfg.cost_repeats)
    # The scheduler group's options (with any overrides) for its own scheduler; every other one of the
    # sweep takes those of its conf/scheduler/<name>.yaml; an export's own scheduler keeps its class and config.
    sampler = PipelineSampler(pipe, {cfg.scheduler.name: dict(cfg.scheduler.options)}, own=defaults.get("name"),
                              null_prompts=cfg.null_prompts)
    seeds = min(cfg.grid_seeds, cfg.num_per_class)
    start = time.perf_counter()

    def report(row: dict, images) -> None:
        from tqdm.auto import tqdm

        nonlocal start
        tqdm.write(f"{model} {row['scheduler']:>9} steps={row['steps']:<3} {format_quality(row)} "
                   f"latency={row['latency_s'] * 1e3:.1f} ms/img ({time.perf_counter() - start:.0f} s)")
        start = time.perf_counter()
        if cfg.grids:
            save_grid(evaluator.grid(images, seeds), out_dir / "grids" / f"{model}-{row['scheduler']}-{row['steps']}.png",
                      seeds, evaluator.grid_prompts())

    built = [(label, make(pipeline=str(cfg.pipeline))) for label, make in accelerators]
    for _, accelerator in built:  # coefficients a fitted forecaster needs exist, before any sampling
        check = getattr(accelerator, "check", None)
        for name in names if check else []:
            for n in steps:
                check(name, n, guidance)
    rows = []
    for label, accelerator in built:
        sampler.accelerator = accelerator
        rows += [{**row, "accelerate": label} for row in evaluator.sweep(
            sampler, model if label == "none" else f"{model}+{label}", [(name, n) for name in names for n in steps],
            guidance, on_row=report)]
    write_csv(rows, out_dir / "quality_cost.csv")
    plot_pareto(rows, out_dir / "pareto.png", title=f"{model}: FID vs latency", floor=floor)
    table = format_table(rows, floor)
    (out_dir / "table.md").write_text(table + "\n")
    fid = eval_set.fid()
    (out_dir / "protocol.json").write_text(json.dumps({
        "pipeline": str(cfg.pipeline), "eval": eval_set.name, "prompts": evaluator.prompts,
        "num_per_class": cfg.num_per_class, "num_samples": len(evaluator.captions), "seed": cfg.seed,
        "guidance_scale": guidance, "reference": key, "feature": describe(eval_set.feature),
        "fid_feature_fingerprint": fid.fingerprint, "metrics": [m.name for m in evaluator.metrics],
        "real_data_floor": floor["fid"] if floor else None, "real_data_floor_std": floor["fid_std"] if floor else None,
        "real_data_floor_metrics": floor, "fid_bootstrap": eval_set.fid_bootstrap,
    }, indent=2))
    if parallel is not None:
        parallel.group.close()
        if parallel.group.rank:
            shutil.rmtree(out_dir)
            return rows
    print(table)
    print(f"results in {out_dir}")
    return rows


def _accelerators(cfg: DictConfig) -> list[tuple[str, object]]:
    """(label, factory) of each accelerator of the sweep: the presets ``accelerators`` names (``a+b`` chains
    presets), else the chosen ``accelerate`` option. Each is built once here, so that a bad option fails before
    anything is loaded; the factory takes the pipeline folder (where a fitted forecaster's coefficients are)."""
    from distill.accelerate import make_accelerator, preset

    if cfg.accelerators:
        out = []
        for name in cfg.accelerators:
            preset(name)
            out.append((name, lambda pipeline, name=name: preset(name, path=pipeline)))
        return out
    node = OmegaConf.to_container(cfg.accelerate, resolve=True, enum_to_str=True)  # a guide named by ${distill.asset:...}
    kind, options = str(node["kind"]), dict(node.get("options") or {})
    probe = make_accelerator(kind, options)
    label = "none" if probe is None else probe.describe()
    return [(label, lambda pipeline: make_accelerator(kind, options, path=pipeline))]


def sanity(cfg: DictConfig, out_dir: Path) -> list[dict]:
    """The metric sensitivity suite on ``cfg.eval``: sanity.csv, sanity_verdicts.csv, sanity.md, sanity.png."""
    from hydra.utils import instantiate

    from distill.config.validate import missing_keys
    from distill.metrics.sanity import check_strengths, run_sanity

    missing = [key for key in missing_keys(cfg) if key != "pipeline"]
    if missing:
        raise ValueError(f"required value(s) missing: {', '.join(missing)}; set them on the command line, e.g. "
                         f"{missing[0]}=...")
    strengths = OmegaConf.to_container(cfg.sanity_strengths)
    check_strengths(strengths)  # before anything is loaded
    if cfg.sanity_images is not None and cfg.sanity_images < 8:
        raise ValueError(f"sanity_images={cfg.sanity_images} must be >= 8 (half reference, half probes) or null (all)")
    try:
        eval_set = instantiate(cfg.eval)
    except InstantiationException as err:
        raise ValueError(str(err.__cause__ or err)) from err
    rows, _ = run_sanity(eval_set, out_dir, strengths, cfg.sanity_images, cfg.seed)
    print((out_dir / "sanity.md").read_text())
    print(f"results in {out_dir}")
    return rows


@hydra.main(version_base="1.3", config_path="conf", config_name="evaluate")
def main(cfg: DictConfig) -> None:
    # imported here: torch.distributed is not a start-up import of a command that may refuse its config first
    from distill.inference.parallel.group import ParallelError

    out_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        if cfg.sanity:
            sanity(cfg, out_dir)
        else:
            sweep(cfg, out_dir)
    except (ValueError, FileNotFoundError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except ParallelError as err:  # a peer process died or timed out
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
