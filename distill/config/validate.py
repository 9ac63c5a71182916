"""Checks that a schema cannot express (ranges, cross-key rules, files), run before any object is built.

Unknown keys, wrong types and values outside a fixed set of choices are Hydra's to reject, at composition
(distill.config.schema); the errors here exit with code 2. The checks here are generic; the chosen method and
student check their own settings (``check_config``: distill.methods, distill.students), so that a method
is never checked by the names of its keys.
"""

from __future__ import annotations

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, ListConfig, OmegaConf

from distill.methods.checks import is_sharded
from distill.students import STUDENTS


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key and the fix."""


def missing_keys(node, prefix: str = "") -> list[str]:
    """Keys still at ``???``, found without resolving interpolations (the hydra node is skipped)."""
    found = []
    if isinstance(node, DictConfig):
        items = [(k, f"{prefix}{k}") for k in node.keys() if not (prefix == "" and k == "hydra")]
    elif isinstance(node, ListConfig):
        items = [(i, f"{prefix[:-1]}[{i}].") for i in range(len(node))]
    else:
        return found
    for key, full in items:
        if OmegaConf.is_missing(node, key):
            found.append(full.rstrip("."))
        elif not OmegaConf.is_interpolation(node, key):
            child = node._get_node(key)
            if isinstance(child, (DictConfig, ListConfig)):
                found += missing_keys(child, f"{full}.")
    return found


def vae_factor(vae_cfg, key: str) -> int | None:
    """Spatial down-sampling factor of a VAE config node (at ``key``), read from a local config.json (None if
    unknown)."""
    import json
    from pathlib import Path

    path = vae_cfg.get("pretrained_model_name_or_path")
    if path is None:
        return None
    config = Path(str(path)) / (vae_cfg.get("subfolder") or "") / "config.json"
    if not config.is_file():
        if Path(str(path)).exists():
            raise ConfigError(f"{key}.pretrained_model_name_or_path={str(path)!r} has no VAE config.json; point it at an AutoencoderKL folder")
        return None
    return 2 ** (len(json.loads(config.read_text())["block_out_channels"]) - 1)


# a config node whose _target_ starts so builds the latent space's VAE
VAE_TARGET = ("diffusers.AutoencoderKL", "distill.models.vae.load_vae")


def method_vae(method: DictConfig) -> tuple[str, DictConfig] | None:
    """The method's setting that builds a VAE (its ``_target_`` is diffusers' AutoencoderKL, whatever the key is
    called) and its key, or None: a method is recognised by what its settings build, not by their names."""
    for key in method.keys() if isinstance(method, DictConfig) else ():
        if OmegaConf.is_interpolation(method, key) or OmegaConf.is_missing(method, key):
            continue
        node = method[key]
        if isinstance(node, DictConfig) and str(node.get("_target_", "")).startswith(VAE_TARGET):
            return f"method.{key}", node
    return None


def _check_sizes(cfg: DictConfig) -> None:
    resolution, sample_size = cfg.data.resolution, cfg.student.sample_size
    found = method_vae(cfg.method)
    if found is None:
        if sample_size != resolution:
            raise ConfigError(
                f"student.sample_size={sample_size} differs from data.resolution={resolution}; "
                "a pixel-space model samples at the data resolution"
            )
        return
    factor = vae_factor(found[1], found[0])
    if factor is None:
        return
    if resolution % factor:
        raise ConfigError(f"data.resolution={resolution} is not divisible by the VAE factor {factor}; use a multiple of {factor}")
    if sample_size * factor != resolution:
        raise ConfigError(
            f"student.sample_size={sample_size} does not match data.resolution={resolution} / VAE factor {factor}; "
            f"set student.sample_size={resolution // factor}"
        )


def _check_teacher(cfg: DictConfig) -> None:
    """A local teacher must be of a family the chosen method serves (``check_method_serves``), a SD-format
    pipeline with a supported prediction type, and the data resolution must fit its VAE; hub ids are checked when
    loaded."""
    from pathlib import Path

    from distill.families.base import FAMILIES, check_method_serves, check_supported
    from distill.methods import METHODS
    from distill.models.teacher import check_pipeline_folder, is_flow_matching, pipeline_configs

    path = Path(str(cfg.teacher.pretrained_model_name_or_path))
    if not path.exists():
        if str(path).startswith(("/", ".", "~")) or str(path).count("/") != 1:
            raise ConfigError(
                f"teacher.pretrained_model_name_or_path={str(path)!r} is neither a local folder nor a hub id (owner/name)"
            )
        return
    try:
        configs = pipeline_configs(path)
        check_method_serves(path, configs, METHODS.name_of(_part(cfg.method, "method")))
        found = [family for _, family in FAMILIES.items() if family.detect(configs)]
        if len(found) == 1:  # the family's own check of its folder (components, prediction type)
            found[0].check_components(path, configs)
        elif is_flow_matching(configs["scheduler"]):
            check_supported(path, configs)
        else:  # no family recognises it: what a Stable-Diffusion-format folder lacks
            check_pipeline_folder(path)
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(str(err)) from err
    factor = vae_factor({"pretrained_model_name_or_path": str(path), "subfolder": "vae"}, "teacher")
    resolution = cfg.data.get("resolution")
    if factor and resolution and resolution % factor:
        raise ConfigError(
            f"data.resolution={resolution} is not divisible by the teacher's VAE factor {factor}; use a multiple of {factor}"
        )


def _check_quality_cost_schedulers(cfg: DictConfig) -> None:
    """The quality-cost callback's student schedulers are of a local teacher's kind (flow matching or discrete VP,
    ``check_scheduler_kind``), and its teacher schedulers of the kind of the teacher pipeline it samples
    (``callbacks.quality_cost.teacher``, when that is set and local): a sweep of the other kind would fail at the
    first evaluation, after training had run (e.g. ``+exp=dmd2 scheduler=flow_lcm`` on a flow teacher keeps dmd2's
    VP rows). Checked after the method's own check, whose message names the method's flow preset."""
    from pathlib import Path

    from distill.inference.schedulers import check_scheduler_kind
    from distill.models.teacher import pipeline_configs

    callback = (cfg.get("callbacks") or {}).get("quality_cost")
    if callback is None:
        return
    for key, source in (("schedulers", (cfg.get("teacher") or {}).get("pretrained_model_name_or_path")),
                        ("teacher_schedulers", callback.get("teacher"))):
        if source is None or not Path(str(source)).exists():
            continue  # no teacher rows, or a hub id (checked when loaded)
        scheduler_config = pipeline_configs(Path(str(source)))["scheduler"]
        for name in callback.get(key) or ():
            try:
                check_scheduler_kind(str(getattr(name, "value", name)), scheduler_config,
                                     key=f"callbacks.quality_cost.{key}")
            except ValueError as err:
                raise ConfigError(str(err)) from err


def _part(node, key: str):
    """The class or function that ``node._target_`` names (None without one)."""
    from hydra.utils import get_object

    target = node.get("_target_") if isinstance(node, DictConfig) else None
    if target is None:
        return None
    try:
        return get_object(str(target))
    except ImportError as err:
        raise ConfigError(f"{key}._target_={target!r} cannot be imported: {err}") from err


def _registration(registry, node) -> dict:
    """What the part that ``node._target_`` names was registered with (``{}``: not a registered part)."""
    part = _part(node, registry.kind)
    name = registry.name_of(part) if part is not None else None
    return registry.meta(name) if name else {}


def _check_parts(cfg: DictConfig) -> None:
    """The chosen method and student check their own settings, beyond their schemas: a method class's classmethod
    ``check_config(cfg)`` (distill.methods), a student builder's registered ``check_config``
    (distill.students); their ValueError (or a missing file) is reported as a ConfigError."""
    checks = (getattr(_part(cfg.method, "method"), "check_config", None),
              _registration(STUDENTS, cfg.student).get("check_config"))
    for check in checks:
        try:
            if check is not None:
                check(cfg)
        except (ValueError, FileNotFoundError) as err:
            raise ConfigError(str(err)) from err


# Packages of the optional extras (pyproject.toml), by the _target_ that needs them.
OPTIONAL_PACKAGES = {
    "lightning.pytorch.loggers.TensorBoardLogger": (("tensorboard", "tensorboardX"), "tensorboard"),
    "distill.data.WebDatasetDataModule": (("webdataset",), "webdataset"),
}


def _check_extras(cfg: DictConfig) -> None:
    """A chosen option whose package is an optional extra that is not installed fails here, not mid-run."""
    from importlib.util import find_spec

    nodes = [("data", cfg.get("data"))]
    nodes += [(f"logger.{name}", node) for name, node in (cfg.get("logger") or {}).items()]
    for key, node in nodes:
        target = node.get("_target_") if node is not None else None
        if target in OPTIONAL_PACKAGES:
            packages, extra = OPTIONAL_PACKAGES[target]
            if not any(find_spec(package) for package in packages):
                raise ConfigError(
                    f"{key} ({target}) needs the {packages[0]!r} package, which is not installed; "
                    f"pip install 'distill[{extra}]' or choose another option"
                )


def _check_eval(cfg: DictConfig) -> None:
    """The evaluation set's sources exist (nothing is loaded); a quality-cost sweep needs its feature network."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        instantiate(cfg.eval).check(needs_fid=(cfg.get("callbacks") or {}).get("quality_cost") is not None)
    except InstantiationException as err:
        raise ConfigError(str(err.__cause__ or err)) from err
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(str(err)) from err


def writable_folder_error(key: str, path: str) -> str | None:
    """Why a local output folder ``path`` cannot be created and written (None when it can): the nearest folder
    that exists on the way to it is probed with a temporary file, which a read-only file system, missing
    permissions or a file in the way refuse. Other file systems (s3://, gs://) are not probed."""
    import tempfile
    from pathlib import Path

    from distill.utils.checkpoint import local_path

    try:
        folder = local_path(path)
    except ImportError:  # a remote file system whose package is missing: reported where it is opened
        return None
    if folder is None:
        return None
    existing = next(p for p in (folder.absolute(), *folder.absolute().parents) if p.exists())
    if not existing.is_dir():
        return f"{key}={str(path)!r} cannot be created: {existing} is a file; choose a folder path"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        where = "" if existing == folder.absolute() else f" (at {existing}, the nearest folder that exists)"
        return (f"{key}={str(path)!r} cannot be written{where}: {err.strerror or err}; choose a writable folder, "
                f"e.g. {key}={Path.home() / 'runs'}")
    return None


class WritableOutputDir(Callback):
    """A Hydra callback (conf/hydra): a run or sweep directory that cannot be written is refused, exit 2, before
    Hydra creates it (Hydra's own failure there is a traceback, before any check of the task runs)."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        self._check("hydra.run.dir", config.hydra.run.dir)

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self._check("hydra.sweep.dir", config.hydra.sweep.dir)

    @staticmethod
    def _check(key: str, path: str) -> None:
        import sys

        error = writable_folder_error(key, str(path))
        if error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(2)


def _check_outputs(cfg: DictConfig) -> None:
    """The checkpoint folder can be written: a read-only one would fail at the first save, after training started.
    (A path that resolves only inside a Hydra run, as a composed config outside one, is not probed.)"""
    dirpath = OmegaConf.select(cfg, "checkpoint.dirpath", throw_on_resolution_failure=False)
    error = writable_folder_error("checkpoint.dirpath", str(dirpath)) if dirpath is not None else None
    if error:
        raise ConfigError(error)


def method_roles(method: DictConfig) -> list[str]:
    """The networks a method's config trains by role: the student (``method.optimizer``) and each role whose
    ``method.<role>_optimizer`` is set (``DistillMethod.add_role`` names a role's constructor arguments so)."""
    return ["student"] + [key[: -len("_optimizer")] for key in method if key.endswith("_optimizer")
                          and not OmegaConf.is_missing(method, key) and method[key] is not None]


def _check_optimizers(node, prefix: str = "method") -> None:
    """Every learning rate under the method (the optimizer of each role) is positive."""
    for key in node.keys() if isinstance(node, DictConfig) else ():
        if OmegaConf.is_interpolation(node, key) or OmegaConf.is_missing(node, key):
            continue
        value = node[key]
        if isinstance(value, DictConfig):
            _check_optimizers(value, f"{prefix}.{key}")
        elif key == "lr" and isinstance(value, int | float) and not value > 0:
            raise ConfigError(f"{prefix}.lr={value} must be > 0 (the optimizer's learning rate, e.g. {prefix}.lr=1e-4)")


def _check_trainer_and_resilience(cfg: DictConfig) -> None:
    import signal

    interval = cfg.trainer.get("val_check_interval")
    if isinstance(interval, bool) or (isinstance(interval, int) and interval < 1) or (
            isinstance(interval, float) and not 0.0 < interval <= 1.0):
        raise ConfigError(f"trainer.val_check_interval={interval} must be a number of training steps >= 1 or a "
                          "fraction of an epoch in (0, 1]; to skip validation set trainer.limit_val_batches=0")
    uncatchable = (signal.SIGKILL, signal.SIGSTOP)
    for name in cfg.resilience.preemption_signals:
        sig = getattr(signal, str(name), None)
        if not str(name).startswith("SIG") or not isinstance(sig, signal.Signals) or sig in uncatchable:
            raise ConfigError(f"resilience.preemption_signals: {name!r} is not a signal a process can catch; use "
                              "names such as SIGUSR1 (SLURM's --signal) or SIGTERM (Kubernetes, SLURM), e.g. "
                              "resilience.preemption_signals=[SIGUSR1,SIGTERM]")


def is_xla(accelerator) -> bool:
    """Whether a trainer config's ``accelerator`` is an XLA device (``tpu`` or ``distill.utils.xla.PJRTAccelerator``)."""
    target = accelerator.get("_target_", "") if isinstance(accelerator, DictConfig) else ""
    return accelerator == "tpu" or str(target).endswith(".PJRTAccelerator")


def validate(cfg: DictConfig) -> None:
    missing = missing_keys(cfg)
    if missing:
        raise ConfigError(f"required value(s) missing: {', '.join(missing)}; set them on the command line, e.g. {missing[0]}=...")
    if cfg.scheduler.num_inference_steps < 1:
        raise ConfigError(f"scheduler.num_inference_steps={cfg.scheduler.num_inference_steps} must be >= 1")
    if cfg.scheduler.guidance_scale < 0:
        raise ConfigError(f"scheduler.guidance_scale={cfg.scheduler.guidance_scale} must be >= 0 (1 = no guidance)")
    if cfg.trainer.max_steps == 0 or cfg.trainer.max_steps < -1:
        raise ConfigError(f"trainer.max_steps={cfg.trainer.max_steps} must be positive (or -1 with max_epochs)")
    if cfg.checkpoint.every_n_train_steps is not None and cfg.checkpoint.every_n_train_steps < 1:
        raise ConfigError(f"checkpoint.every_n_train_steps={cfg.checkpoint.every_n_train_steps} must be >= 1")
    if cfg.checkpoint.save_top_k < -1:
        raise ConfigError(f"checkpoint.save_top_k={cfg.checkpoint.save_top_k} must be >= -1 (-1 keeps all)")
    if "batch_size" in cfg.data and cfg.data.batch_size < 1:
        raise ConfigError(f"data.batch_size={cfg.data.batch_size} must be >= 1")
    if "num_workers" in cfg.data and cfg.data.num_workers < 0:
        raise ConfigError(f"data.num_workers={cfg.data.num_workers} must be >= 0 (0 loads in the main process)")
    _check_trainer_and_resilience(cfg)
    _check_optimizers(cfg.method)
    if "resolution" in cfg.data and "sample_size" in cfg.student:
        _check_sizes(cfg)
    if cfg.teacher and "pretrained_model_name_or_path" in cfg.teacher:
        _check_teacher(cfg)
    sharded = is_sharded(cfg)
    xla = is_xla(cfg.trainer.get("accelerator"))
    routed = _registration(STUDENTS, cfg.student).get("routed", False)
    if xla and routed:
        raise ConfigError(f"trainer=tpu with student {cfg.student._target_}: a mixture of experts routes samples to "
                          "experts with data-dependent shapes, which XLA recompiles for every batch; use a dense, copy "
                          "or LoRA student on XLA, or trainer=gpu/ddp for the mixture")
    roles = method_roles(cfg.method)
    if len(roles) > 1 and sharded:
        raise ConfigError(f"trainer=fsdp with method {cfg.method._target_}, which trains several roles "
                          f"({', '.join(roles)}), one backward each per step: that runs on one device or under data "
                          "parallelism, not sharded; use trainer=ddp (or one device: trainer=gpu)")
    if sharded and routed:
        raise ConfigError(f"trainer=fsdp with student {cfg.student._target_}: each rank runs only the experts its own "
                          "samples or tokens are routed to, while FSDP needs every rank to gather and reduce every "
                          "block in the same order; use trainer=ddp for a mixture of experts")
    _check_parts(cfg)
    _check_quality_cost_schedulers(cfg)
    for group in ("callbacks", "logger"):
        for name, node in (cfg.get(group) or {}).items():
            if node is not None and "_target_" not in node:
                raise ConfigError(
                    f"{group}.{name} has settings but no _target_: the chosen {group} option does not include "
                    f"{name!r}; add it to the list ({group}=[...,{name}]) or drop it with {group}.{name}=null"
                )
    _check_extras(cfg)
    _check_outputs(cfg)
    if cfg.get("eval") is not None:
        _check_eval(cfg)
    if cfg.ckpt_path not in (None, "last"):
        from fsspec.core import url_to_fs

        fs, inner = url_to_fs(str(cfg.ckpt_path))
        if not fs.isfile(inner) and not (sharded and fs.isfile(f"{inner}/meta.pt")):
            raise ConfigError(f"ckpt_path={cfg.ckpt_path!r} is not a file; give a .ckpt file (trainer=fsdp: a "
                              "sharded checkpoint folder) or 'last'")
