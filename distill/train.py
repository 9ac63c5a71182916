"""Training entry point: compose and validate the config, build objects, fit, export.

    python -m distill.train [+exp=NAME] [group=option ...] [key=value ...]
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from distill.config.schema import register_configs
from distill.config.validate import ConfigError, validate
from distill.utils.loggers import register_resolvers

log = logging.getLogger("distill.train")
register_configs()
register_resolvers()


def global_rank() -> int:
    """The process's rank from the launcher's environment (torchrun, SLURM), before any Trainer exists."""
    for var in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def _fresh_run_dir(run_dir: Path) -> bool:
    """True when the directory holds nothing but what Hydra itself wrote at start-up."""
    return run_dir.is_dir() and all(p.name in (".hydra", "train.log") for p in run_dir.iterdir())


def _fail(run_dir: Path, message: str) -> None:
    if _fresh_run_dir(run_dir):
        shutil.rmtree(run_dir, ignore_errors=True)
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def _instantiate_all(cfg: DictConfig):
    from hydra.utils import instantiate

    datamodule = instantiate(cfg.data)
    student = instantiate(cfg.student)
    extra = {"student": student, "sampling": OmegaConf.to_container(cfg.scheduler, resolve=True)}
    if cfg.teacher:  # teacher=none composes to an empty node
        extra["teacher"] = instantiate(cfg.teacher)
    # objects are passed after instantiation: Hydra would turn a dataclass argument into a config node
    method = instantiate(cfg.method, _partial_=True, _convert_="all")(**extra)
    callbacks = [instantiate(c) for c in cfg.callbacks.values() if c is not None]
    callbacks.append(instantiate(cfg.checkpoint))
    loggers = [instantiate(c) for c in cfg.logger.values() if c is not None]
    if not loggers:  # a learning-rate monitor has nowhere to write without a logger
        from lightning.pytorch.callbacks import LearningRateMonitor

        callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    return datamodule, method, trainer


def _root_cause(err: BaseException) -> BaseException:
    while err.__cause__ is not None:
        err = err.__cause__
    return err


def run(cfg: DictConfig) -> dict:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        validate(cfg)
    except ConfigError as err:
        _fail(run_dir, str(err))

    import lightning as L
    from hydra.errors import InstantiationException

    L.seed_everything(cfg.seed + global_rank(), workers=True)
    try:
        datamodule, method, trainer = _instantiate_all(cfg)
    except (InstantiationException, ValueError, FileNotFoundError) as err:
        _fail(run_dir, str(_root_cause(err)))

    if trainer.is_global_zero:
        job_cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(job_cfg, resolve=True))
        n_params = sum(p.numel() for p in method.student.parameters())
        log.info("student: %s, %.2fM parameters; run directory %s", type(method.student).__name__, n_params / 1e6, run_dir)

    try:
        trainer.fit(method, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        if trainer.is_global_zero and not trainer.fast_dev_run:
            _finish(cfg, run_dir, method, trainer)
    finally:
        _close_loggers(trainer)
    return metrics


def _close_loggers(trainer) -> None:
    """End wandb runs so that the next job in this process (a multirun sweep) starts its own."""
    from lightning.pytorch.loggers import WandbLogger

    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger) and logger._experiment is not None:
            logger._experiment.finish()


def _finish(cfg: DictConfig, run_dir: Path, method, trainer) -> None:
    from distill.callbacks.ema import EMA
    from distill.callbacks.samples import save_sample_grid

    for callback in trainer.callbacks:
        if isinstance(callback, EMA):
            callback.copy_to(method)
    if cfg.export:
        out = method.export(run_dir / "export")
        log.info("exported student to %s", out)
    from distill.methods.base import DistillMethod

    if cfg.sample_grid_seeds > 0 and type(method).generate is not DistillMethod.generate:
        grid = run_dir / "samples" / "final.png"
        save_sample_grid(method, grid, cfg.sample_grid_seeds)
        log.info("sample grid: %s", grid)


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
