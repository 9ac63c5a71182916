"""Config schemas of every group, registered in Hydra's ConfigStore.

A schema of a ``_target_`` is generated from the constructor's signature (``distill.config.builds``): the
constructor's default is the only default, and each YAML option holds only what it changes. Each YAML option
starts from its schema (``defaults: [base_<name>, _self_]``), so Hydra rejects an unknown key, a wrong type, a
value outside a fixed set of choices or a missing ``???`` value at composition, naming the key, before any object
is built (exit code 1); ``distill.config.validate`` then checks what a schema cannot express (exit code 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from distill.accelerate.registry import ACCELERATORS
from distill.config.builds import builds, choice, registered
from distill.inference.schedulers import SCHEDULERS
from distill.methods import METHODS
from distill.students import STUDENTS
from distill.worlds import options as world_options

# ---------------------------------------------------------------- fixed sets of choices

SchedulerName = choice("SchedulerName", SCHEDULERS)
MonitorMode = choice("MonitorMode", ("min", "max"))
AcceleratorKind = choice("AcceleratorKind", ACCELERATORS.names())  # every registered accelerator (distill.accelerate)
ParallelKind = choice("ParallelKind", ("none", "cfg", "asyncdiff"))  # distill.inference.parallel.KINDS

# ---------------------------------------------------------------- data

ImageFolderDataConfig = builds("ImageFolderDataConfig", "distill.data.ImageFolderDataModule")
WebDatasetDataConfig = builds("WebDatasetDataConfig", "distill.data.WebDatasetDataModule")
# the embedded worlds' data sets (distill.worlds), e.g. data=<world name>
WORLD_DATA_CONFIGS = {name: builds(f"{name.capitalize()}DataConfig", target)
                      for name, target in world_options("data").items()}
globals().update({schema.__name__: schema for schema in WORLD_DATA_CONFIGS.values()})  # by name: configs pickle

# ---------------------------------------------------------------- method
# A schema per registered method (distill.methods.METHODS), ``method=<name>``. The entry point passes what it
# builds first: the student, the teacher, the sampling scheduler's settings; a method's ``**speed`` goes to
# DistillMethod (the training-speed switches every method takes).

METHOD_OPTIONS = dict(passed=("student", "sampling", "teacher"), kwargs_of="distill.methods.base.DistillMethod")
METHOD_SCHEMAS = registered(METHODS, "MethodConfig", **METHOD_OPTIONS)

# ---------------------------------------------------------------- teacher

TeacherConfig = builds("TeacherConfig", "distill.families.load_teacher")

# ---------------------------------------------------------------- student
# A schema per registered student builder (distill.students.STUDENTS), ``student=<name>``. A builder made
# from the teacher is a partial: the method calls it on the teacher's UNet (and noise schedule, or the teacher).

STUDENT_OPTIONS = dict(passed=("teacher_unet", "noise_scheduler", "teacher"), partial_if="teacher_unet")
STUDENT_SCHEMAS = registered(STUDENTS, "StudentConfig", **STUDENT_OPTIONS)

# ---------------------------------------------------------------- sampling scheduler


@dataclass
class SchedulerConfig:
    """The sampling scheduler: diffusers' scheduler ``name`` built ``from_config`` of the model's noise schedule
    (distill.inference.schedulers), with ``options`` passed to ``from_config``."""

    name: SchedulerName = MISSING  # each option of conf/scheduler names its own
    num_inference_steps: int = 50
    guidance_scale: float = 2.0  # classifier-free guidance (1 = none)
    options: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- trainer / checkpoint / paths
# Lightning's own defaults; distill's choices are deltas in conf/trainer/default.yaml and conf/checkpoint.

TrainerConfig = builds("TrainerConfig", "lightning.pytorch.Trainer",
                       exclude=("callbacks", "logger", "plugins"))  # train.py passes its own
ShardedStrategyConfig = builds("ShardedStrategyConfig", "distill.utils.sharding.ShardedStrategy")  # trainer=fsdp
CheckpointConfig = builds("CheckpointConfig", "lightning.pytorch.callbacks.ModelCheckpoint",
                          choices={"mode": MonitorMode})

# ---------------------------------------------------------------- callbacks and loggers
# An option of these groups places each node under its name: defaults: [base_ema@ema, ...].

EMACallbackConfig = builds("EMACallbackConfig", "distill.callbacks.ema.EMA")
SampleGridCallbackConfig = builds("SampleGridCallbackConfig", "distill.callbacks.samples.SampleGrid")
QualityCostCallbackConfig = builds("QualityCostCallbackConfig", "distill.callbacks.quality_cost.QualityCostCallback")
ProgressBarCallbackConfig = builds("ProgressBarCallbackConfig", "lightning.pytorch.callbacks.RichProgressBar",
                                   exclude=("theme",))  # an object
LRMonitorCallbackConfig = builds("LRMonitorCallbackConfig", "lightning.pytorch.callbacks.LearningRateMonitor")
CSVLoggerConfig = builds("CSVLoggerConfig", "distill.utils.loggers.ResumableCSVLogger")
TensorBoardLoggerConfig = builds("TensorBoardLoggerConfig", "lightning.pytorch.loggers.TensorBoardLogger")
WandbLoggerConfig = builds("WandbLoggerConfig", "lightning.pytorch.loggers.WandbLogger",
                           exclude=("experiment",))  # an object


@dataclass
class PathsConfig:
    root_dir: str = MISSING
    output_dir: str = MISSING
    data_dir: str = MISSING


# ---------------------------------------------------------------- evaluation set


@dataclass
class EvalConfig:
    """An evaluation set (``distill.metrics.eval_set.EvalSet``): prompts, reference images, measuring networks."""

    _target_: str = "distill.metrics.eval_set.EvalSet"
    _convert_: str = "all"
    name: str = MISSING  # names the reference in caches and protocol.json
    prompts: list[str] | None = None  # the prompts; null: eval.prompts_file, else the captions of eval.data
    prompts_file: str | None = None  # a text file, one prompt a line
    labels: list[int] | None = None  # the class of each prompt (prompt accuracy, bootstrap strata); null: none
    data: Any = None  # a data module: held-out captions (prompts), held-out images (reference), training images (floor)
    num_prompts: int | None = None  # at most this many prompts, the first ones (null: all)
    reference: str | None = None  # a folder of images or a .npz (mu, sigma[, features]); null: eval.data's held-out split
    channels: int = 3  # of reference images read from a folder
    resolution: int = 32  # samples and reference are judged at this size
    feature: Any = None  # FID/KID features: a vision model folder or hub id (CLIP, DINOv2), a .pt, inception, a factory
    clip: str | None = None  # CLIPModel folder or hub id (with its tokenizer) for the CLIP score; null: skip
    classifier: Any = None  # a classifier (TorchScript .pt or a factory) reading each sample's label; null: skip
    extra_features: list[str] = field(default_factory=list)  # more FID/KID spaces: pixels, clip (fid_pixels, ... columns)
    metrics: list[str] | None = None  # the metrics measured (distill.metrics.registry.METRICS); null: every registered one
    fid_bootstrap: int = 50  # resamples of the generated set for each FID's spread (fid_std)
    kid_subsets: int = 100  # KID: subsets averaged (kid_std is their spread)
    kid_subset_size: int = 1000  # KID: samples per subset (capped at half the smaller set)


# ---------------------------------------------------------------- top level


@dataclass
class ResilienceConfig:
    max_consecutive_nonfinite: int = 10  # abort after this many non-finite steps in a row (each is skipped)
    inject_nonfinite_at_steps: list = field(default_factory=list)  # fault injection (tests): NaN grads at these steps
    preemption_signals: list = field(default_factory=lambda: ["SIGUSR1", "SIGTERM"])


@dataclass
class TrainConfig:
    data: Any = MISSING
    eval: Any = MISSING  # the evaluation set of sample grids and quality-cost sweeps (conf/eval)
    method: Any = MISSING
    teacher: Any = None
    student: Any = MISSING
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    callbacks: dict[str, Any] = field(default_factory=dict)
    logger: dict[str, Any] = field(default_factory=dict)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    exp_name: str = "diffusion"
    seed: int = 0
    ckpt_path: str | None = None  # resume: a checkpoint file, or "last" (the newest readable one of this run directory)
    export: bool = True
    sample_grid_seeds: int = 8
    tags: list[str] = field(default_factory=list)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    # what the command returns to a Hydra sweeper (Optuna: one name is one objective, several a Pareto search):
    # columns of the student's final quality-cost evaluation (fid, kid, clip_score, latency_s, gflops_per_image, ...)
    # at objective_steps steps of scheduler.name, or metrics the run logged (names with a "/": train/loss)
    objectives: list[str] = field(default_factory=list)
    objective_steps: int | None = None  # default: the student's intended step count (scheduler.num_inference_steps)


@dataclass
class ParallelConfig:
    """Denoising spread over torchrun's processes (distill.inference.parallel; launch/parallel.sh)."""
    kind: ParallelKind = ParallelKind.none  # cfg: the two guidance branches on 2 processes; asyncdiff: a component each
    warmup_steps: int = 1  # asyncdiff: the first steps of each trajectory, run whole on every process
    stride: int = 1  # asyncdiff: 2 runs two steps a parallel round on one process more than components (1 or 2)
    timeout_s: float = 120.0  # every collective: a dead or stuck process fails the others after this
    backend: str | None = None  # default: nccl with CUDA, else gloo


@dataclass
class SampleConfig:
    pipeline: str = MISSING  # a diffusers pipeline folder or hub id
    out: str = "samples.png"
    prompts: list[str] | None = None  # default: the first ten prompts of the evaluation set
    data: Any = None  # the data group, which the evaluation set follows by default (eval: ${data})
    eval: Any = MISSING  # the evaluation set (conf/eval) whose prompts are the default rows
    num_seeds: int = 8
    seed: int = 0
    sampler: str | None = None  # a scheduler name (conf/scheduler); default: the pipeline's own
    num_inference_steps: int | None = None  # default: the pipeline's distill.json, else the pipeline's own default
    guidance_scale: float | None = None  # default: the pipeline's distill.json, else its pipeline class's __call__ default
    upscale: int = 4
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # over torchrun's processes (conf/parallel)


EVALUATE_STEPS = (1, 2, 4, 8, 25, 50)  # distill.evaluate's sweep for a pipeline without an intended step count


@dataclass
class AccelerateConfig:
    """A training-free sampling accelerator (distill.accelerate): its kind and the options its class takes."""
    kind: AcceleratorKind = AcceleratorKind.none
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class EvaluateConfig:
    pipeline: str = MISSING  # a diffusers pipeline folder or hub id
    model_name: str | None = None  # label in tables and plots; default: the folder name
    data: Any = None  # the data group, which the evaluation set follows by default (eval: ${data})
    eval: Any = MISSING  # the evaluation set (conf/eval): prompts, reference, feature network, CLIP model
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    schedulers: list[str] | None = None  # several scheduler names in one sweep (overrides `scheduler`)
    accelerate: AccelerateConfig = field(default_factory=AccelerateConfig)  # a sampling accelerator (conf/accelerate)
    accelerators: list[str] | None = None  # several accelerator presets in one sweep (overrides `accelerate`)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # over torchrun's processes (conf/parallel)
    # sample from the empty prompt, each sample keeping its prompt's label (prompt accuracy then measures what a
    # guide such as accelerate=classifier steers alone: the classifier-guidance setting of an unconditional model)
    null_prompts: bool = False
    steps: list[int] | None = None  # step counts, a row each; null: EVALUATE_STEPS plus the export's intended count (distill.json)
    num_per_class: int = 50  # samples of each prompt of the evaluation set
    seed: int = 0
    guidance_scale: float | None = None  # default: the pipeline's distill.json, else its pipeline class's __call__ default
    grids: bool = True
    grid_seeds: int = 4
    cost_repeats: int = 3
    # training-free speed-ups of the loaded denoiser (distill.compress.fusion.fuse_denoiser), each a sampling option
    fuse_qkv: bool = False  # one projection for q, k, v (diffusers' fuse_qkv_projections; SD3's with qk_norm)
    channels_last: bool = False  # channels-last memory format (a UNet's; refused on a transformer)
    compile: bool = False  # torch.compile (inductor); the compile time falls in the first samples, not the cost rows
    sanity: bool = False  # instead of a sweep: the metric sensitivity suite on the eval set (distill.metrics.sanity)
    sanity_images: int | None = None  # held-out images it uses (half reference, half degraded); null: all
    # +sanity_strengths.<degradation>=[...] replaces its default strengths (distill.metrics.sanity); [] skips it
    sanity_strengths: dict[str, Any] = field(default_factory=dict)  # lists of numbers, checked by the suite


@dataclass
class FitForecasterConfig:
    pipeline: str = MISSING  # a diffusers pipeline folder or hub id whose trajectories are recorded
    data: Any = None  # the data group, which the evaluation set follows by default (eval: ${data})
    eval: Any = MISSING  # the evaluation set whose prompts drive the recorded trajectories
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    accelerate: AccelerateConfig = field(default_factory=AccelerateConfig)  # the real/predicted pattern (options)
    steps: list[int] = field(default_factory=lambda: [50])  # step counts, a fit each
    num_per_class: int = 4  # trajectories of each prompt
    seed: int = 1000  # the evaluation's seeds start at 0: fit on other noise
    batch_size: int = 16
    guidance_scale: float | None = None  # default: the pipeline's distill.json, else its pipeline class's __call__ default
    lags: int = 2  # real outputs each prediction combines
    ridge: float = 1e-4  # ridge penalty, relative to the mean diagonal of the normal equations
    degree: int = 4  # accelerate=teacache: the degree of the rescaling polynomial (TeaCache's)
    out: str | None = None  # default: the pipeline folder (a folder inside the package or a hub id: the run dir)


# the engine's own settings (its signature's defaults); the entry point passes the pipeline and the request defaults
EngineConfig = builds("EngineConfig", "distill.serve.engine.Engine",
                      exclude=("pipe", "steps", "guidance_scale", "scheduler", "own_scheduler", "scheduler_options",
                               "accelerator", "metrics"))


@dataclass
class ServeConfig:
    pipeline: str = MISSING  # a diffusers pipeline folder or hub id (StableDiffusionPipeline layout)
    # a request's defaults: the command line's, else the export's intended call (distill.json), else the pipeline's own
    scheduler: Any = None  # a scheduler option (scheduler=dpmsolver: conf/scheduler); default: the pipeline's own
    steps: int | None = None
    guidance_scale: float | None = None
    accelerate: AccelerateConfig = field(default_factory=AccelerateConfig)  # on every call (not with engine.mode=stream)
    engine: Any = field(default_factory=EngineConfig)  # batching, stages, queue, deadlines (distill.serve.engine.Engine)
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (the log line names it)
    device: str | None = None  # default: cuda when available, else cpu
    dtype: str = "float32"  # float32, float16 or bfloat16
    threads: int | None = None  # torch intra-op threads; default: torch's
    drain_timeout_s: float = 150.0  # on SIGTERM: how long requests in flight may take (> engine.timeout_s)
    max_body_bytes: int = 2**20  # a larger request body is answered 413 before it is read in full
    # access control (distill.serve.app): the bearer token every route but /health, / and /docs needs; default: the
    # environment variable DISTILL_SERVE_API_KEY (so that the key is not on the command line), else none
    api_key: str | None = "${oc.env:DISTILL_SERVE_API_KEY,null}"
    allowed_hosts: list[str] | None = None  # Host header names served (any port); default: loopback names on loopback
    cors_origins: list[str] = field(default_factory=list)  # origins browsers may call from; default: none (no CORS)
    insecure: bool = False  # serve a non-loopback host without api_key (refused unless set)


CONF = Path(__file__).resolve().parents[1] / "conf"  # the package's option files
SCHEMAS: dict[str, dict[str, type]] = {
    "callbacks": {"ema": EMACallbackConfig, "samples": SampleGridCallbackConfig, "quality_cost": QualityCostCallbackConfig,
                  "progress": ProgressBarCallbackConfig, "lr_monitor": LRMonitorCallbackConfig},
    "logger": {"csv": CSVLoggerConfig, "tensorboard": TensorBoardLoggerConfig, "wandb": WandbLoggerConfig},
    "data": {**WORLD_DATA_CONFIGS, "imagefolder": ImageFolderDataConfig, "webdataset": WebDatasetDataConfig},
    "method": METHOD_SCHEMAS,
    "teacher": {"teacher": TeacherConfig},
    "student": STUDENT_SCHEMAS,
    "scheduler": {"scheduler": SchedulerConfig},
    "accelerate": {"accelerate": AccelerateConfig},
    "parallel": {"parallel": ParallelConfig},
    "eval": {"eval": EvalConfig},
    "trainer": {"trainer": TrainerConfig},
    "trainer/strategy": {"sharded": ShardedStrategyConfig},
    "checkpoint": {"checkpoint": CheckpointConfig},
    "paths": {"paths": PathsConfig},
}


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="base_train", node=TrainConfig)
    cs.store(name="base_sample", node=SampleConfig)
    cs.store(name="base_evaluate", node=EvaluateConfig)
    cs.store(name="base_fit_forecaster", node=FitForecasterConfig)
    cs.store(name="base_serve", node=ServeConfig)
    for group, nodes in SCHEMAS.items():
        for name, node in nodes.items():
            cs.store(group=group, name=f"base_{name}", node=node)
    # a registered method, student or accelerator without an option file of its own (a plugin's) is an option as
    # it is (an accelerator with its defaults: accelerate=<kind>); a part registered after this module was imported
    # (a module imported later in the process) gets its schema now
    for schemas, registry, suffix, options in ((METHOD_SCHEMAS, METHODS, "MethodConfig", METHOD_OPTIONS),
                                               (STUDENT_SCHEMAS, STUDENTS, "StudentConfig", STUDENT_OPTIONS)):
        schemas.update(registered(registry, suffix, only=set(registry.names()) - set(schemas), module=__name__,
                                  **options))
        ordered = sorted(schemas.items())  # the options in name order, as the registry lists them
        schemas.clear()
        schemas.update(ordered)
    accelerators = {kind.value: AccelerateConfig(kind=kind) for kind in AcceleratorKind}
    for group, nodes in (("method", METHOD_SCHEMAS), ("student", STUDENT_SCHEMAS), ("accelerate", accelerators)):
        for name, node in nodes.items():
            if not (CONF / group / f"{name}.yaml").is_file():
                cs.store(group=group, name=name, node=node)
