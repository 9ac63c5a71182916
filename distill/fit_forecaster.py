"""Fit a step forecaster on recorded trajectories of a pipeline (the fitted predictor of ``accelerate=forecast``),
or TeaCache's rescaling polynomial (``accelerate=teacache``).

    python -m distill.fit_forecaster pipeline=<dir> scheduler=ddim steps=[50] accelerate.options.interval=2
    python -m distill.evaluate pipeline=<dir> accelerate=forecast_fitted scheduler=ddim steps=[50]
    python -m distill.fit_forecaster accelerate=teacache pipeline=<dir> scheduler=flow_euler steps=[28]

Runs the pipeline on the evaluation set's prompts (``num_per_class`` of each, seeds from ``seed``, which by
default differ from the evaluation's), records the UNet's input and output at every call, and fits, for each
predicted step of the real/predicted pattern of ``accelerate.options``, the coefficients of its output on the
last ``lags`` real outputs and its input by ridge regression (``distill.accelerate.forecast``). The result is
added to ``forecaster.json`` in ``out``: by default the pipeline's own folder (where ``accelerate=forecast_fitted``
looks), or this run's directory when the pipeline is a hub id or a folder inside the distill package.

With ``accelerate=teacache`` it records, at every call after a trajectory's first, the relative change of the first
block's timestep-modulated input and of the transformer's output since the previous call of the same trajectory
(every call computed), and fits the output's change on the input's by a polynomial of ``degree`` (TeaCache's
rescaling), written to ``teacache.json`` in the same place.
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
    from distill.accelerate.base import call_input
    from distill.families import denoiser_of

    inputs, outputs = [], []
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(module, args, kwargs, out):
        sample = call_input(args, kwargs)
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


@torch.no_grad()
def record_changes(pipe, prompts: list[str], steps: int, guidance_scale: float, seed: int, batch_size: int
                   ) -> tuple[list[float], list[float]]:
    """TeaCache's calibration pairs: (the modulated input's relative change, the output's) at every call after each
    trajectory's first, every call computed (TeaCache at threshold 0), paired within each branch of calls."""
    from distill.accelerate import accelerated
    from distill.accelerate.base import output_tensor
    from distill.accelerate.blockcache import TeaCache, relative_l1
    from distill.families import denoiser_of

    inputs, outputs = [], []
    cache = TeaCache(threshold=0.0, rescale=False)
    outs: list[torch.Tensor] = []
    handle = denoiser_of(pipe).register_forward_hook(lambda m, a, out: outs.append(output_tensor(out).float()))
    try:
        for i, start in enumerate(range(0, len(prompts), batch_size)):
            outs.clear()
            with accelerated(pipe, cache):
                pipe(prompts[start:start + batch_size], num_inference_steps=steps, guidance_scale=guidance_scale,
                     generator=torch.Generator().manual_seed(seed + i), output_type="latent")
                branches = [b for b, _ in cache.decisions]
                changes = iter(cache.changes)
            last: dict[int, torch.Tensor] = {}
            for branch, out in zip(branches, outs):
                if branch in last:
                    inputs.append(next(changes))
                    outputs.append(relative_l1(out, last[branch]))
                last[branch] = out
    finally:
        handle.remove()
    return inputs, outputs


def check_common(cfg: DictConfig) -> str:
    """The scheduler name, after the checks every fit shares (before anything is loaded)."""
    from distill.inference.schedulers import SCHEDULERS

    name = cfg.scheduler.name
    if name not in SCHEDULERS:
        raise ValueError(f"scheduler {name!r} is unknown; use one of {sorted(SCHEDULERS)}")
    if not cfg.steps or any(n < 2 for n in cfg.steps):
        raise ValueError(f"steps={list(cfg.steps or [])} must list step counts >= 2")
    if cfg.num_per_class < 1:
        raise ValueError(f"num_per_class={cfg.num_per_class} must be >= 1")
    return name


def prepare(cfg: DictConfig, name: str, check=None) -> tuple[object, list[str], float]:
    """(the pipeline with scheduler ``name`` as distill.evaluate builds it, the prompts, the guidance scale);
    ``check(pipe)`` runs on the loaded pipeline before anything else."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    from distill.inference.loading import call_defaults, load_pipeline, pipeline_defaults
    from distill.inference.schedulers import scheduler_options
    from distill.metrics.quality_cost import PipelineSampler

    try:
        eval_set = instantiate(cfg.eval)
    except InstantiationException as err:
        raise ValueError(str(err.__cause__ or err)) from err
    prompts = [p for _ in range(cfg.num_per_class) for p in eval_set.prompts()[0]]
    pipe = load_pipeline(cfg.pipeline)
    pipe.set_progress_bar_config(disable=True)
    if check is not None:
        check(pipe)
    defaults = pipeline_defaults(cfg.pipeline)
    guidance = cfg.guidance_scale if cfg.guidance_scale is not None else defaults.get("guidance_scale",
                                                                                      call_defaults(pipe)[1])
    # the scheduler as distill.evaluate builds it: an export's own scheduler class for its own name
    options = dict(cfg.scheduler.options) or scheduler_options(name)
    pipe.scheduler = PipelineSampler(pipe, {name: options}, own=defaults.get("name")).scheduler(name)
    return pipe, prompts, guidance


def fit_teacache(cfg: DictConfig, run_dir: Path) -> Path:
    """TeaCache's rescaling polynomial on the pipeline's trajectories, saved as teacache.json."""
    from distill.accelerate.blockcache import fit_rescale, save_rescale, stack_blocks
    from distill.families import denoiser_of

    name = check_common(cfg)
    if cfg.degree < 1:
        raise ValueError(f"degree={cfg.degree} must be >= 1 (TeaCache's polynomial has degree 4)")
    # a transformer, before any sampling
    pipe, prompts, guidance = prepare(cfg, name, check=lambda pipe: stack_blocks(denoiser_of(pipe)))
    x, y = [], []
    for steps in cfg.steps:
        a, b = record_changes(pipe, prompts, steps, guidance, cfg.seed, cfg.batch_size)
        x, y = x + a, y + b
    coefficients = fit_rescale(x, y, cfg.degree)
    import numpy as np

    residual = float(np.sqrt(np.mean((np.polyval(coefficients, x) - np.asarray(y)) ** 2)))
    log.info("TeaCache rescaling on %d pairs (%s, steps %s, guidance %g): rms residual %.4f of output changes "
             "%.3f-%.3f", len(x), name, list(cfg.steps), guidance, residual, min(y), max(y))
    path = save_rescale(output_folder(cfg, run_dir), coefficients, scheduler=name, steps=list(cfg.steps),
                        guidance_scale=guidance, pairs=len(x), rms_residual=residual,
                        input_change_range=[min(x), max(x)], output_change_range=[min(y), max(y)])
    print(f"TeaCache rescaling saved to {path}; sample with: python -m distill.evaluate pipeline={cfg.pipeline} "
          f"accelerate=teacache accelerate.options.path={path.parent} schedulers=[{name}] "
          f"steps=[{','.join(map(str, cfg.steps))}] guidance_scale={guidance:g}")
    return path


def fit(cfg: DictConfig, run_dir: Path) -> Path:
    from distill.accelerate.forecast import Forecast, fit_forecaster, save_forecasters
    from distill.config.validate import missing_keys

    missing = missing_keys(cfg)
    if missing:
        raise ValueError(f"required value(s) missing: {', '.join(missing)}; set them on the command line, e.g. "
                         f"{missing[0]}=...")
    if cfg.accelerate.kind == "teacache":
        return fit_teacache(cfg, run_dir)
    name = check_common(cfg)
    if cfg.lags < 1:
        raise ValueError(f"lags={cfg.lags} must be >= 1 (real outputs a prediction combines)")
    pattern_options = {k: v for k, v in OmegaConf.to_container(cfg.accelerate.options).items() if k != "predictor"}
    pattern = Forecast(predictor="fitted", **pattern_options)  # checks the pattern before anything is loaded
    pipe, prompts, guidance = prepare(cfg, name)
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
