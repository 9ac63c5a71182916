"""Training entry point: compose and validate the config, build objects, fit, export.

    python -m distill.train [+exp=NAME] [group=option ...] [key=value ...]
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from distill.config.builds import plain_choices
from distill.config.resolvers import register_resolvers
from distill.config.schema import register_configs
from distill.config.validate import ConfigError, validate

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


def _fail(run_dir: Path, message: str, code: int = 2) -> None:
    if _fresh_run_dir(run_dir):
        shutil.rmtree(run_dir, ignore_errors=True)
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def _resume_checkpoint(cfg: DictConfig, run_dir: Path) -> tuple[str | None, dict | None]:
    """The checkpoint to resume from and its contents: ``ckpt_path=last`` takes the newest readable file
    in this run's checkpoint folder (none yet: a fresh start), a path takes that file."""
    from distill.utils.checkpoint import resolve_resume, safe_load

    if cfg.ckpt_path is None:
        return None, None
    if cfg.ckpt_path == "last":
        path, checkpoint = resolve_resume(str(cfg.checkpoint.dirpath))
        if path is None:
            log.info("ckpt_path=last: no checkpoint in %s yet; starting from scratch", cfg.checkpoint.dirpath)
            return None, None
        log.info("resuming from %s (step %d)", path, checkpoint.get("global_step", -1))
        return str(path), checkpoint
    return cfg.ckpt_path, safe_load(cfg.ckpt_path)


def _refuse_to_overwrite(cfg: DictConfig) -> None:
    """A fresh start (no ``ckpt_path``) in a checkpoint folder that already holds checkpoints would overwrite them:
    refused, naming the two ways on."""
    from distill.utils.checkpoint import candidate_checkpoints

    if cfg.ckpt_path is not None:
        return
    found = candidate_checkpoints(str(cfg.checkpoint.dirpath))
    if found:
        raise FileExistsError(
            f"{cfg.checkpoint.dirpath} already holds {len(found)} checkpoint(s) (e.g. {found[0]}); a fresh start would "
            "overwrite them. Resume with ckpt_path=last, or start in a new run directory (hydra.run.dir=...)")


def _check_compatible(checkpoint: dict, path: str, method) -> None:
    """A checkpoint from another method or student architecture is refused before any compute."""
    from distill.callbacks.resilience import describe_run

    saved = checkpoint.get("distill", {})
    here = describe_run(method)
    for key in ("method", "student"):
        if key in saved and saved[key] != here[key]:
            raise ValueError(f"checkpoint {path} was written by {key} {saved[key]}, but this run builds "
                             f"{here[key]}; resume with the config it was trained with, or start a new run directory")
    if "state_dict" not in checkpoint:  # a sharded checkpoint: its shards are checked as they load
        return
    own = method.state_dict()
    for key, value in checkpoint.get("state_dict", {}).items():
        if key in own and tuple(own[key].shape) != tuple(value.shape):
            raise ValueError(f"checkpoint {path} does not fit this student: {key} has shape {tuple(value.shape)} "
                             f"there and {tuple(own[key].shape)} here; resume with the same student config")
    missing = [k for k in own if k.startswith("student.") and k not in checkpoint.get("state_dict", {})]
    if missing and not any(k.startswith("student.") and "lora" in k for k in own):
        raise ValueError(f"checkpoint {path} lacks {len(missing)} student weights (e.g. {missing[0]}); "
                         "it was written for a different student architecture")


def _instantiate_all(cfg: DictConfig):
    from hydra.utils import instantiate

    from distill.callbacks.resilience import (
        FinalCheckpoint,
        NonFiniteGuard,
        Preemption,
        RNGState,
        RunIdentity,
    )
    from distill.utils.checkpoint import AtomicCheckpointIO, local_path

    datamodule = instantiate(cfg.data)
    datamodule.setup("fit")  # an empty, unreadable or too small data set fails here, before any model is built
    student = instantiate(cfg.student)
    extra = {"student": student, "sampling": OmegaConf.to_container(cfg.scheduler, resolve=True)}
    if cfg.teacher:  # teacher=none composes to an empty node
        _check_method_serves_teacher(cfg)  # a hub teacher too, from its JSON configs, before its weights download
        extra["teacher"] = instantiate(cfg.teacher)
    # objects are passed after instantiation: Hydra would turn a dataclass argument into a config node
    method = instantiate(cfg.method, _partial_=True, _convert_="all")(**extra)
    callbacks = [FinalCheckpoint(), *(instantiate(c) for c in cfg.callbacks.values() if c is not None)]
    # Lightning takes a file:// dirpath for a relative path (it realpath()s the URL), so a local URL goes in
    # as a plain path; any other fsspec URL (s3://, gs://, memory://) goes through as given.
    local = local_path(cfg.checkpoint.dirpath)
    callbacks.append(instantiate(cfg.checkpoint, dirpath=str(local) if local is not None else cfg.checkpoint.dirpath))
    res = cfg.resilience
    callbacks += [RNGState(), RunIdentity(), Preemption(tuple(res.preemption_signals)),
                  NonFiniteGuard(res.max_consecutive_nonfinite, list(res.inject_nonfinite_at_steps))]
    loggers = [instantiate(c) for c in cfg.logger.values() if c is not None]
    if not loggers:  # a learning-rate monitor has nowhere to write without a logger
        from lightning.pytorch.callbacks import LearningRateMonitor

        callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    from distill.config.validate import is_xla
    from distill.utils.xla import atomic_xla_checkpoint_io

    checkpoint_io = atomic_xla_checkpoint_io() if is_xla(cfg.trainer.accelerator) else AtomicCheckpointIO()
    # a method with several roles clips each role's update itself (Lightning refuses to under manual optimization)
    # and runs DDP that finds unused parameters
    adopt = getattr(method, "adopt_trainer_settings", None)
    own = adopt(cfg.trainer.gradient_clip_val, cfg.trainer.gradient_clip_algorithm, cfg.trainer.accumulate_grad_batches,
                cfg.trainer.get("strategy")) if adopt is not None else {}
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False, plugins=[checkpoint_io], **own)
    return datamodule, method, trainer


def _check_method_serves_teacher(cfg: DictConfig) -> None:
    """The chosen method serves the teacher's model family (``distill.families.base.check_method_serves``); a
    local teacher was checked at validation already, a hub id is checked here from its downloaded configs."""
    from hydra.utils import get_object

    from distill.families.base import check_method_serves
    from distill.methods import METHODS
    from distill.models.teacher import pipeline_configs

    source = cfg.teacher.get("pretrained_model_name_or_path")
    if source is not None and not Path(str(source)).exists():
        configs = pipeline_configs(str(source), cfg.teacher.get("revision"))
        check_method_serves(source, configs, METHODS.name_of(get_object(str(cfg.method._target_))))


def _root_cause(err: BaseException) -> BaseException:
    while err.__cause__ is not None:
        err = err.__cause__
    return err


def _quiet_known_warnings() -> None:
    import warnings

    # The data modules resume mid-epoch themselves (distill.data.resumable), through their own state_dict.
    warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")


def _quiet_manual_optimization_warnings() -> None:
    import warnings

    # A method with several roles optimizes manually; its checkpoint of a step holds the weights after that step's
    # updates, as under automatic optimization (Lightning offers to save the weights from before them instead).
    warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")


def _write_launch_record(run_dir: Path, launched: str) -> None:
    """Hydra's record of this launch in ``.hydra/`` (the job's config as composed, Hydra's config, the overrides),
    written once every check has passed: conf/hydra turns off Hydra's own write, which comes before the task runs,
    so that a relaunch refused for a bad value leaves the record of the run it was pointed at."""
    hydra_cfg = HydraConfig.instance().cfg
    folder = run_dir / ".hydra"
    folder.mkdir(exist_ok=True)
    (folder / "config.yaml").write_text(launched)
    (folder / "hydra.yaml").write_text(OmegaConf.to_yaml(hydra_cfg))
    (folder / "overrides.yaml").write_text(OmegaConf.to_yaml(hydra_cfg.hydra.overrides.task))


def run(cfg: DictConfig) -> dict:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    launched = OmegaConf.to_yaml(cfg)
    try:
        validate(cfg)
        check_objectives(cfg)
    except ConfigError as err:
        _fail(run_dir, str(err))
    cfg = plain_choices(cfg)

    import lightning as L
    from hydra.errors import InstantiationException

    from distill.callbacks.resilience import (
        NONFINITE_EXIT_CODE,
        PREEMPTED_EXIT_CODE,
        NonFiniteLossError,
        Preempted,
    )
    from distill.data.resumable import ResumableDataMixin
    from distill.utils.checkpoint import CheckpointError

    try:
        ckpt_path, checkpoint = _resume_checkpoint(cfg, run_dir)
        _refuse_to_overwrite(cfg)
    except (CheckpointError, FileNotFoundError, FileExistsError) as err:
        _fail(run_dir, str(err))
    wandb_id = (checkpoint or {}).get("distill", {}).get("wandb_run_id")
    from hydra.types import RunMode

    wandb_cfg = cfg.logger.get("wandb")
    if wandb_cfg is not None and HydraConfig.get().mode == RunMode.MULTIRUN and not wandb_cfg.get("group"):
        # the runs of one sweep form one wandb group (named after the sweep directory), with the job's overrides
        OmegaConf.update(cfg, "logger.wandb.group", Path(HydraConfig.get().sweep.dir).name, force_add=True)
    if wandb_id and wandb_cfg is not None:  # the resumed run continues the same wandb run
        cfg.logger.wandb.id = wandb_id
        OmegaConf.update(cfg, "logger.wandb.resume", "allow", force_add=True)

    L.seed_everything(cfg.seed + global_rank(), workers=True)
    try:
        datamodule, method, trainer = _instantiate_all(cfg)
        if hasattr(method, "check_latent_cache"):
            method.check_latent_cache(datamodule)
        if isinstance(datamodule, ResumableDataMixin):
            _quiet_known_warnings()
        if not method.automatic_optimization:
            _quiet_manual_optimization_warnings()
        if checkpoint is not None:
            _check_compatible(checkpoint, ckpt_path, method)
    except (InstantiationException, ValueError, FileNotFoundError) as err:
        _fail(run_dir, str(_root_cause(err)))
    del checkpoint

    job_cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    for logger in trainer.loggers:  # the whole composed config, not only the method's arguments
        logger.log_hyperparams(OmegaConf.to_container(job_cfg, resolve=True))
    if trainer.is_global_zero:
        _write_launch_record(run_dir, launched)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(job_cfg, resolve=True))
        n_params = sum(p.numel() for p in method.student.parameters())
        log.info("student: %s, %.2fM parameters; run directory %s", type(method.student).__name__, n_params / 1e6, run_dir)

    preempted = False
    try:
        trainer.fit(method, datamodule=datamodule, ckpt_path=ckpt_path)
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        if not trainer.fast_dev_run:
            _ema_to_live(trainer, method)  # every rank: a sharded student's EMA is in shards
            from distill.utils.sharding import gathered, strategy_of

            if trainer.is_global_zero or strategy_of(trainer) is not None:
                with gathered(trainer, method):  # sharded: rank 0 holds the full networks, the others wait
                    if trainer.is_global_zero:
                        _finish(cfg, run_dir, method, trainer)
    except Preempted:  # only the checkpoint was saved: no evaluation, no export
        preempted = True
        log.warning("preempted at step %d; exiting with code %d so that the scheduler requeues this command",
                    trainer.global_step, PREEMPTED_EXIT_CODE)
    except NonFiniteLossError as err:
        _fail(run_dir, str(err), NONFINITE_EXIT_CODE)
    except CheckpointError as err:
        _fail(run_dir, str(err), 4)
    finally:
        _close_loggers(trainer)
    if preempted:
        sys.exit(PREEMPTED_EXIT_CODE)
    return metrics


def _close_loggers(trainer) -> None:
    """End wandb runs so that the next job in this process (a multirun sweep) starts its own."""
    from lightning.pytorch.loggers import WandbLogger

    if any(isinstance(logger, WandbLogger) for logger in trainer.loggers):
        import wandb

        if wandb.run is not None:  # the run this job started (wandb's public handle; None if never used)
            wandb.finish()


def _ema_to_live(trainer, method) -> None:
    """The EMA weights (what is exported and judged) into the student."""
    from distill.callbacks.ema import EMA

    for callback in trainer.callbacks:
        if isinstance(callback, EMA):
            callback.copy_to(method)


def _finish(cfg: DictConfig, run_dir: Path, method, trainer) -> None:
    from distill.callbacks.samples import save_sample_grid

    if cfg.export:
        out = method.export(run_dir / "export")
        log.info("exported student to %s", out)
    _attach_quality_cost(trainer, run_dir)
    _log_final_hparams(cfg, run_dir, trainer)
    from distill.methods.base import DistillMethod

    if cfg.sample_grid_seeds > 0 and type(method).generate is not DistillMethod.generate:
        from hydra.utils import instantiate

        grid = run_dir / "samples" / "final.png"
        save_sample_grid(method, grid, instantiate(cfg.eval).grid_batch(cfg.sample_grid_seeds), cfg.sample_grid_seeds)
        log.info("sample grid: %s", grid)


HPARAM_COSTS = ("latency_s", "nfe", "gflops_per_image")  # the cost columns beside the quality ones


def final_hparams(row: dict | None) -> dict[str, float]:
    """The HParams dashboard's metrics of the student's final quality-cost row: every registered metric with its
    std (``distill.metrics.report.quality_columns``, a metric of one's own included) and ``HPARAM_COSTS``, where
    the row holds them."""
    from distill.metrics.report import quality_columns

    return {f"hparams/{n}": float(row[n]) for n in (*quality_columns(), *HPARAM_COSTS)
            if row and row.get(n) not in (None, "")}


def _log_final_hparams(cfg: DictConfig, run_dir: Path, trainer) -> None:
    """TensorBoard's HParams dashboard: the job's overrides against the student's final quality and cost (its
    row at the intended step count), so that the runs of a sweep compare there."""
    from lightning.pytorch.loggers import TensorBoardLogger

    loggers = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
    if not loggers:
        return
    final = final_hparams(student_row(cfg, run_dir))
    if not final:
        return
    params = {"exp_name": cfg.exp_name, "seed": cfg.seed}
    for override in HydraConfig.get().overrides.task:
        key, _, value = override.lstrip("+~").partition("=")
        params[key] = value
    for logger in loggers:
        logger.log_hyperparams(params, metrics=final)


def _attach_quality_cost(trainer, run_dir: Path) -> None:
    """The quality-cost rows measured during training go into distill.json and the model card of each export
    they measured (the final export, and every progressive round's)."""
    from distill.callbacks.quality_cost import QualityCostCallback
    from distill.inference.model_card import attach_quality_cost
    from distill.metrics.report import format_table

    history = [row for c in trainer.callbacks if isinstance(c, QualityCostCallback) for row in c.history]
    if history:
        for folder in [run_dir / "export", *sorted((run_dir / "rounds").glob("*-steps"))]:
            attach_quality_cost(folder, history, format_table)


def check_objectives(cfg: DictConfig) -> None:
    """Each objective names a quality-cost column (the quality_cost callback then must be on) or a logged
    metric ("group/name"); raises ConfigError before any compute."""
    from distill.config.validate import ConfigError
    from distill.metrics.report import columns

    known = set(columns()) - {"model", "scheduler", "accelerate", "step"}
    for name in cfg.get("objectives") or []:
        if "/" in name:
            continue
        if name not in known:
            raise ConfigError(f"objectives: {name!r} is neither a quality-cost column ({sorted(known)}) nor a logged "
                              "metric (group/name, e.g. train/loss)")
        callback = (cfg.get("callbacks") or {}).get("quality_cost")
        if callback is None:
            raise ConfigError(f"objectives: {name!r} is measured by the quality_cost callback, which this run does not "
                              "have; add callbacks=[default,quality_cost] (or use a +exp that has it)")
        steps = cfg.get("objective_steps") or cfg.scheduler.num_inference_steps
        measured = callback.get("steps")
        if measured is not None and steps not in list(measured):
            raise ConfigError(f"objectives at {steps} steps: callbacks.quality_cost.steps={list(measured)} does not "
                              "measure that count; set objective_steps to one of them")


def student_row(cfg: DictConfig, run_dir: Path) -> dict | None:
    """The student's row of its last quality-cost evaluation at ``objective_steps`` steps of ``scheduler.name``
    (quality_cost.csv of the run directory); None when there is none."""
    import csv

    path = run_dir / "quality_cost.csv"
    steps = cfg.get("objective_steps") or cfg.scheduler.num_inference_steps
    with open(path) if path.is_file() else contextlib.nullcontext([]) as f:
        rows = [r for r in csv.DictReader(f) if r["model"] == "student" and r["scheduler"] == cfg.scheduler.name
                and int(float(r["steps"])) == steps] if path.is_file() else []
    if not rows:
        return None
    last = max(float(r.get("step") or 0) for r in rows)
    return [r for r in rows if float(r.get("step") or 0) == last][-1]


def objective(cfg: DictConfig, run_dir: Path, metrics: dict) -> float | list[float] | None:
    """The values of ``cfg.objectives`` after training: quality-cost columns from the student's last evaluation
    (rows of quality_cost.csv with model "student", the largest step, ``objective_steps`` steps of the
    scheduler ``scheduler.name``) and logged metrics; one name gives a float, several a list."""
    names = list(cfg.get("objectives") or [])
    if not names:
        return None
    row: dict = {}
    if any("/" not in n for n in names):
        row = student_row(cfg, run_dir)
        if row is None:
            steps = cfg.get("objective_steps") or cfg.scheduler.num_inference_steps
            raise ValueError(f"objectives {names}: {run_dir / 'quality_cost.csv'} has no student row at {steps} "
                             f"steps of {cfg.scheduler.name}; set objective_steps to a step count the quality_cost "
                             "callback measures")
    values = []
    for name in names:
        value = metrics.get(name) if "/" in name else row.get(name)
        if value in (None, ""):
            raise ValueError(f"objective {name!r} was not measured (logged metrics: {sorted(metrics)})")
        values.append(float(value))
    log.info("objectives %s", ", ".join(f"{n}={v:.4g}" for n, v in zip(names, values)))
    return values[0] if len(values) == 1 else values


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | list[float] | None:
    """Train; returns ``cfg.objectives`` (what a Hydra sweeper optimises), None without them."""
    metrics = run(cfg)
    if global_rank() != 0:
        return None
    # a value that was not measured raises: in a sweep that trial fails and the sweep goes on
    return objective(cfg, Path(HydraConfig.get().runtime.output_dir), metrics)


if __name__ == "__main__":
    main()
