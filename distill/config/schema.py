"""Dataclass schemas for every config group.

Each YAML option starts from its schema (``defaults: [base_<name>, _self_]``), so Hydra rejects an
unknown key, a wrong type or a missing ``???`` value at composition, naming the key, before any
object is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

# ---------------------------------------------------------------- data


@dataclass
class DigitsDataConfig:
    _target_: str = "distill.data.DigitsDataModule"
    resolution: int = 16
    batch_size: int = 128
    eval_batch_size: int = 256
    heldout_fraction: float = 0.2
    split_seed: int = 0
    num_workers: int = 0
    channels: int = 1
    shuffle_seed: int = 0


@dataclass
class ImageFolderDataConfig:
    _target_: str = "distill.data.ImageFolderDataModule"
    root: str = MISSING
    resolution: int = 32
    channels: int = 3
    batch_size: int = 32
    eval_batch_size: int = 64
    heldout_fraction: float = 0.1
    split_seed: int = 0
    caption_ext: str = ".txt"
    default_caption: str = ""
    skip_unreadable: bool = True
    num_workers: int = 0
    shuffle_seed: int = 0


@dataclass
class WebDatasetDataConfig:
    _target_: str = "distill.data.WebDatasetDataModule"
    urls: str = MISSING
    heldout_urls: str | None = None
    resolution: int = 32
    channels: int = 3
    batch_size: int = 32
    eval_batch_size: int = 64
    shuffle_buffer: int = 1000
    seed: int = 0
    num_workers: int = 0


# ---------------------------------------------------------------- method


@dataclass
class DiffusionMethodConfig:
    _target_: str = "distill.methods.diffusion.DiffusionTraining"
    prediction_type: str = "epsilon"
    cond_dropout: float = 0.1
    timestep_sampler: str = "stratified"
    loss_weighting: str = "min_snr"
    snr_gamma: float = 5.0
    noise_scheduler: Any = MISSING
    conditioner: Any = MISSING
    optimizer: Any = MISSING
    lr_scheduler: Any = None
    vae: Any = None


@dataclass
class CLIPMethodConfig:
    _target_: str = "distill.assets.clip.CLIPTraining"
    tokenizer: Any = MISSING
    keep_caption_prob: float = 0.5
    max_shift: int = 0
    max_logit_scale: float = 100.0
    optimizer: Any = MISSING
    lr_scheduler: Any = None


@dataclass
class ClassifierMethodConfig:
    _target_: str = "distill.assets.classifier.ClassifierTraining"
    max_translate: float = 0.0625
    max_rotate_deg: float = 10.0
    max_scale: float = 0.1
    label_smoothing: float = 0.0
    optimizer: Any = MISSING
    lr_scheduler: Any = None


@dataclass
class VAEMethodConfig:
    _target_: str = "distill.assets.autoencoder.VAETraining"
    recon_loss: str = "l1"
    kl_weight: float = 1e-4
    scale_max_batches: int = 64
    optimizer: Any = MISSING
    lr_scheduler: Any = None


@dataclass
class ConsistencyMethodConfig:
    _target_: str = "distill.methods.consistency.LatentConsistencyDistillation"
    num_ddim_timesteps: int = 50
    guidance_scale_min: float = 2.0  # classifier-free guidance scales (w + 1) sampled per example
    guidance_scale_max: float = 6.0
    ema_decay: float = 0.95  # target = EMA of the student; 0 = stop-gradient copy
    loss_type: str = "pseudo_huber"  # l2 | huber | pseudo_huber | pseudo_huber_elementwise (distill.diffusion.consistency)
    huber_c: float | None = 0.001  # c (delta for huber); null: iCT's 0.00054 sqrt(d) for pseudo_huber
    timestep_scaling: float = 10.0
    sigma_data: float = 0.5
    cache_prompts: bool = True
    optimizer: Any = MISSING
    lr_scheduler: Any = None


@dataclass
class ProgressiveMethodConfig:
    _target_: str = "distill.methods.progressive.ProgressiveDistillation"
    start_steps: int = 64
    final_steps: int = 4
    steps_per_round: int = 300
    guidance_scale: float = 3.0
    student_prediction_type: str = "v_prediction"
    loss_weighting: str = "truncated_snr"
    guided_stage_steps: int = 0
    guidance_scale_min: float = 2.0
    guidance_scale_max: float = 6.0
    optimizer: Any = MISSING
    lr_scheduler: Any = None


# ---------------------------------------------------------------- teacher


@dataclass
class TeacherConfig:
    _target_: str = "distill.models.teacher.load_teacher"
    pretrained_model_name_or_path: str = MISSING
    revision: str | None = None
    variant: str | None = None
    torch_dtype: str | None = None


# ---------------------------------------------------------------- student


@dataclass
class CopyStudentConfig:
    _target_: str = "distill.models.students.copy_student"
    _partial_: bool = True
    time_cond_proj_dim: int | None = 256
    gradient_checkpointing: bool = False


@dataclass
class LoraStudentConfig:
    _target_: str = "distill.models.students.lora_student"
    _partial_: bool = True
    rank: int = 8
    alpha: float | None = None
    gradient_checkpointing: bool = False


@dataclass
class TimestepMoEStudentConfig:
    _target_: str = "distill.models.moe.timestep_moe_student"
    _partial_: bool = True
    num_experts: int = 2
    split: str = "equal_snr"
    boundaries: Any = None
    shared_layers: list = field(default_factory=list)
    time_cond_proj_dim: int | None = 256
    gradient_checkpointing: bool = False


@dataclass
class TokenMoEStudentConfig:
    _target_: str = "distill.models.moe.token_moe_student"
    _partial_: bool = True
    num_experts: int = 4
    top_k: int = 1
    capacity_factor: float | None = 1.25
    eval_capacity_factor: float | None = None
    load_balance_weight: float = 0.01
    z_loss_weight: float = 0.001
    init_noise: float = 0.01
    time_cond_proj_dim: int | None = 256
    gradient_checkpointing: bool = False



@dataclass
class ClassUNetConfig:
    _target_: str = "distill.models.unet.build_class_unet"
    sample_size: int = MISSING
    in_channels: int = 1
    size: str = "tiny"
    num_classes: int = 10
    gradient_checkpointing: bool = False


@dataclass
class TextUNetConfig:
    _target_: str = "distill.models.unet.build_text_unet"
    sample_size: int = MISSING
    in_channels: int = 4
    size: str = "tiny"
    cross_attention_dim: int = MISSING
    gradient_checkpointing: bool = False


@dataclass
class CLIPStudentConfig:
    _target_: str = "distill.models.clip.build_clip_model"
    model_max_length: int = 16
    projection_dim: int = 64
    text_hidden_size: int = 64
    text_layers: int = 3
    text_heads: int = 4
    image_size: int = MISSING
    patch_size: int = 8
    num_channels: int = 1
    vision_hidden_size: int = 64
    vision_layers: int = 3
    vision_heads: int = 4
    mlp_ratio: int = 4
    gradient_checkpointing: bool = False


@dataclass
class DigitClassifierConfig:
    _target_: str = "distill.models.classifier.build_digit_classifier"
    _convert_: str = "all"  # plain lists: the hub mixin writes the init arguments to config.json
    in_channels: int = 1
    channels: list[int] = field(default_factory=lambda: [32, 64, 64])
    feature_dim: int = 128
    num_classes: int = 10
    resolution: int = MISSING
    dropout: float = 0.2
    gradient_checkpointing: bool = False


@dataclass
class VAEStudentConfig:
    _target_: str = "distill.models.vae.build_vae"
    in_channels: int = 1
    sample_size: int = MISSING
    block_out_channels: list[int] = field(default_factory=lambda: [16, 32, 64])
    layers_per_block: int = 1
    latent_channels: int = 4
    norm_num_groups: int = 8
    gradient_checkpointing: bool = False


# ---------------------------------------------------------------- sampling scheduler


@dataclass
class SchedulerConfig:
    name: str = "ddim"
    num_inference_steps: int = 50
    guidance_scale: float = 2.0
    options: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- trainer / checkpoint / paths


@dataclass
class TrainerConfig:
    _target_: str = "lightning.pytorch.Trainer"
    accelerator: str = "cpu"
    devices: Any = 1
    num_nodes: int = 1
    strategy: Any = "auto"
    precision: Any = "32-true"
    max_steps: int = 3000
    max_epochs: int = -1
    max_time: str | None = None
    val_check_interval: Any = 500
    check_val_every_n_epoch: int | None = None
    limit_train_batches: Any = None
    limit_val_batches: Any = None
    num_sanity_val_steps: int = 0
    log_every_n_steps: int = 25
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = 1.0
    deterministic: Any = False
    benchmark: bool | None = None
    fast_dev_run: Any = False
    enable_progress_bar: bool = True
    enable_model_summary: bool = True
    use_distributed_sampler: bool = False  # the data modules shard per rank themselves (resumable order)
    default_root_dir: str | None = None


@dataclass
class CheckpointConfig:
    _target_: str = "lightning.pytorch.callbacks.ModelCheckpoint"
    dirpath: str = MISSING
    filename: str = "step_{step:07d}"
    every_n_train_steps: int = 500
    save_last: bool = True
    save_top_k: int = 3
    monitor: str = "step"
    mode: str = "max"
    auto_insert_metric_name: bool = False


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
    metrics: list[str] = field(default_factory=lambda: ["fid", "kid", "clip_score", "prompt_accuracy", "fid_pixels",
                                                        "kid_pixels", "fid_clip", "kid_clip"])
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
    ckpt_path: str | None = None
    export: bool = True
    sample_grid_seeds: int = 8
    tags: list[str] = field(default_factory=list)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)


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
    guidance_scale: float | None = None  # default: the pipeline's distill.json, else 1.0
    upscale: int = 4


EVALUATE_NFE = (1, 2, 4, 8, 25, 50)  # distill.evaluate's sweep for a pipeline without an intended step count


@dataclass
class EvaluateConfig:
    pipeline: str = MISSING  # a diffusers pipeline folder or hub id
    model_name: str | None = None  # label in tables and plots; default: the folder name
    data: Any = None  # the data group, which the evaluation set follows by default (eval: ${data})
    eval: Any = MISSING  # the evaluation set (conf/eval): prompts, reference, feature network, CLIP model
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    schedulers: list[str] | None = None  # several scheduler names in one sweep (overrides `scheduler`)
    nfe: list[int] | None = None  # steps per row; null: EVALUATE_NFE plus the export's intended count (distill.json)
    num_per_class: int = 50  # samples of each prompt of the evaluation set
    seed: int = 0
    guidance_scale: float | None = None  # default: the pipeline's distill.json, else 1.0
    grids: bool = True
    grid_seeds: int = 4
    cost_repeats: int = 3
    sanity: bool = False  # instead of a sweep: the metric sensitivity suite on the eval set (distill.metrics.sanity)
    sanity_images: int | None = None  # held-out images it uses (half reference, half degraded); null: all
    # +sanity_strengths.<degradation>=[...] replaces its default strengths (distill.metrics.sanity); [] skips it
    sanity_strengths: dict[str, Any] = field(default_factory=dict)  # lists of numbers, checked by the suite


SCHEMAS: dict[str, dict[str, type]] = {
    "data": {"digits": DigitsDataConfig, "imagefolder": ImageFolderDataConfig, "webdataset": WebDatasetDataConfig},
    "method": {"clip": CLIPMethodConfig, "diffusion": DiffusionMethodConfig, "classifier": ClassifierMethodConfig,
               "vae": VAEMethodConfig, "consistency": ConsistencyMethodConfig,
               "progressive": ProgressiveMethodConfig},
    "teacher": {"teacher": TeacherConfig},
    "student": {"copy": CopyStudentConfig, "lora": LoraStudentConfig, "moe_timestep": TimestepMoEStudentConfig,
                "moe_token": TokenMoEStudentConfig, "clip": CLIPStudentConfig, "text_unet": TextUNetConfig, "class_unet": ClassUNetConfig,
                "digit_classifier": DigitClassifierConfig, "vae": VAEStudentConfig},
    "scheduler": {"scheduler": SchedulerConfig},
    "eval": {"eval": EvalConfig},
    "trainer": {"trainer": TrainerConfig},
    "checkpoint": {"checkpoint": CheckpointConfig},
    "paths": {"paths": PathsConfig},
}


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="base_train", node=TrainConfig)
    cs.store(name="base_sample", node=SampleConfig)
    cs.store(name="base_evaluate", node=EvaluateConfig)
    for group, nodes in SCHEMAS.items():
        for name, node in nodes.items():
            cs.store(group=group, name=f"base_{name}", node=node)
