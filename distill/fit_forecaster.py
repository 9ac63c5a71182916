"""Fit a step forecaster on recorded trajectories of a pipeline (the fitted predictor of ``accelerate=forecast``).

    python -m distill.fit_forecaster pipeline=<dir> scheduler=ddim steps=[50] accelerate.options.interval=2
    python -m distill.evaluate pipeline=<dir> accelerate=forecast_fitted scheduler=ddim steps=[50]

Runs the pipeline on the evaluation set's prompts (``num_per_class`` of each, seeds from ``seed``, which by
default differ from the evaluation's), records the UNet's input and output at every call, and fits, for each
predicted step of the real/predicted pattern of ``accelerate.options``, the coefficients of its output on the
last ``lags`` real outputs and its input by ridge regression (``distill.accelerate.forecast``). The result is
added to ``forecaster.json`` in ``out``: by default the pipeline's own folder (where ``accelerate=forecast_fitted``
looks), or this run's directory when the pipeline is a hub id or a folder inside the distill package.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from distill.config.resolvers import register_resolvers
from distill.config.schema import register_configs

log = logging.getLogger(__name__)

register_configs()
register_resolvers()
PACKAGE = Path(__file__).resolve().parent


def output_folder(cfg: DictConfig, run_dir: Path) -> Path:
    if cfg.out is not None:
        return Path(cfg.out)
    pipeline = Path(str(cfg.pipeline))
    inside_package = pipeline.exists() and PACKAGE in pipeline.resolve().parents
    return pipeline if pipeline.is_dir() and not inside_package else run_dir


@torch.no_grad()
def record(pipe, prompts: list[str], steps: int, guidance_scale: float, seed: int, batch_size: int):
    """(inputs, outputs) of the UNet at every call: (batches, calls, batch rows, ...), a batch a trajectory set."""
    from distill.families import denoiser_of

    inputs, outputs = [], []
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(module, args, kwargs, out):
        sample = args[0] if args else kwargs["sample"]
        tensor = out if isinstance(out, torch.Tensor) else (out[0] if isinstance(out, tuple) else out.sample)
        calls.append((sample.detach().float().cpu(), tensor.detach().float().cpu()))

    handle = denoiser_of(pipe).register_forward_hook(hook, with_kwargs=True)
    try:
        for i, start in enumerate(range(0, len(prompts), batch_size)):
            calls.clear()
            pipe(prompts[start:start + batch_size], num_inference_steps=steps, guidance_scale=guidance_scale,
                 generator=torch.Generator().manual_seed(seed + i), output_type="latent")
            if len(calls) != steps:
                raise ValueError(f"scheduler made {len(calls)} UNet calls for {steps} steps; a fitted forecaster "
                                 "needs one call a step (a first-order or multistep scheduler)")
            if len(calls[0][0]) != len(calls[-1][0]):
                raise ValueError("the batch changed between calls of one trajectory")
            inputs.append(torch.stack([c[0] for c in calls], 1))
            outputs.append(torch.stack([c[1] for c in calls], 1))
    finally:
        handle.remove()
    return torch.cat(inputs), torch.cat(outputs)  # trajectories (the batch rows) x calls x ...


def fit(cfg: DictConfig, run_dir: Path) -> Path:
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    from distill.accelerate.forecast import Forecast, fit_forecaster, save_forecasters
    from distill.config.validate import missing_keys
    from distill.inference.loading import call_defaults, load_pipeline, pipeline_defaults
    from distill.inference.schedulers import SCHEDULERS, scheduler_options
    from distill.metrics.quality_cost import PipelineSampler

    missing = missing_keys(cfg)
    if missing:
        raise ValueError(f"required value(s) missing: {', '.join(missing)}; set them on the command line, e.g. "
                         f"{missing[0]}=...")
    name = cfg.scheduler.name
    if name not in SCHEDULERS:
        raise ValueError(f"scheduler {name!r} is unknown; use one of {sorted(SCHEDULERS)}")
    if not cfg.steps or any(n < 2 for n in cfg.steps):
        raise ValueError(f"steps={list(cfg.steps or [])} must list step counts >= 2")
    if cfg.lags < 1:
        raise ValueError(f"lags={cfg.lags} must be >= 1 (real outputs a prediction combines)")
    if cfg.num_per_class < 1:
        raise ValueError(f"num_per_class={cfg.num_per_class} must be >= 1")
    pattern_options = {k: v for k, v in OmegaConf.to_container(cfg.accelerate.options).items() if k != "predictor"}
    pattern = Forecast(predictor="fitted", **pattern_options)  # checks the pattern before anything is loaded
    try:
        eval_set = instantiate(cfg.eval)
    except InstantiationException as err:
        raise ValueError(str(err.__cause__ or err)) from err
    prompts = [p for _ in range(cfg.num_per_class) for p in eval_set.prompts()[0]]
    pipe = load_pipeline(cfg.pipeline)
    pipe.set_progress_bar_config(disable=True)
    defaults = pipeline_defaults(cfg.pipeline)
    guidance = cfg.guidance_scale if cfg.guidance_scale is not None else defaults.get("guidance_scale",
                                                                                      call_defaults(pipe)[1])
    # the scheduler as distill.evaluate builds it: an export's own scheduler class for its own name
    options = dict(cfg.scheduler.options) or scheduler_options(name)
    pipe.scheduler = PipelineSampler(pipe, {name: options}, own=defaults.get("name")).scheduler(name)
    fitted = []
    for steps in cfg.steps:
        inputs, outputs = record(pipe, prompts, steps, guidance, cfg.seed, cfg.batch_size)
        real = pattern.pattern(steps)
        result = fit_forecaster(outputs, inputs, name, real, lags=cfg.lags, ridge=cfg.ridge, guidance_scale=guidance,
                                scheduler_class=type(pipe.scheduler).__name__)
        worst = max((f.residual for f in result.steps.values()), default=0.0)
        log.info("%s %d steps: %d real, %d predicted, fitted on %d trajectories; relative residual <= %.3f",
                 name, steps, len(real), len(result.steps), result.trajectories, worst)
        fitted.append(result)
    path = save_forecasters(output_folder(cfg, run_dir), fitted)
    print(f"forecaster saved to {path}; sample with: python -m distill.evaluate pipeline={cfg.pipeline} "
          f"accelerate=forecast_fitted accelerate.options.path={path.parent} scheduler={name} "
          f"steps=[{','.join(map(str, cfg.steps))}] guidance_scale={guidance:g}" +
          "".join(f" accelerate.options.{k}={v}" for k, v in pattern_options.items() if v is not None))
    return path


@hydra.main(version_base="1.3", config_path="conf", config_name="fit_forecaster")
def main(cfg: DictConfig) -> None:
    try:
        fit(cfg, Path(HydraConfig.get().runtime.output_dir))
    except (ValueError, FileNotFoundError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
