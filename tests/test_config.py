"""Every config group option and experiment composes, and runs one fast_dev_run step on CPU."""

import csv
import dataclasses
import io
import tarfile
import time
from collections.abc import Callable
from typing import Literal

import numpy as np
import pytest
import yaml
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict
from PIL import Image

from distill.config.validate import missing_keys
from tests.conftest import CONF

GROUPS = ["data", "method", "teacher", "student", "scheduler", "trainer", "callbacks", "logger", "checkpoint", "paths"]
EXPERIMENTS = sorted(p.stem for p in (CONF / "exp").glob("*.yaml"))
FAST = ["trainer.fast_dev_run=true", "scheduler.num_inference_steps=2", "student.size=debug", "data.batch_size=8",
        "data.eval_batch_size=8", "callbacks.samples.num_seeds=1"]


def options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.fixture
def image_root(tmp_path):
    root = tmp_path / "images"
    root.mkdir()
    for i in range(12):
        Image.fromarray(np.full((20, 20), 20 * i, dtype=np.uint8)).save(root / f"{i}.png")
        (root / f"{i}.txt").write_text(f"grey level {i}")
    return root


@pytest.fixture
def shard_pattern(tmp_path):
    path = tmp_path / "shard-000.tar"
    with tarfile.open(path, "w") as tar:
        for i in range(12):
            buf = io.BytesIO()
            Image.fromarray(np.full((20, 20), 20 * i, dtype=np.uint8)).save(buf, format="PNG")
            for ext, data in (("png", buf.getvalue()), ("txt", f"grey {i}".encode())):
                info = tarfile.TarInfo(f"{i:04d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)


def data_overrides(option, image_root, shard_pattern):
    if option == "imagefolder":
        return [f"data.root={image_root}", "data.channels=1", "data.resolution=16"]
    if option == "webdataset":
        return [f"data.urls={shard_pattern}", "data.channels=1", "data.resolution=16", "data.shuffle_buffer=4"]
    return []


def run_in_process(cfg, tmp_path):
    from distill.train import run

    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(tmp_path / "run")
    (tmp_path / "run").mkdir(exist_ok=True)
    HydraConfig.instance().set_config(cfg)
    try:
        return run(cfg)
    finally:
        HydraConfig.instance().cfg = None


@pytest.mark.parametrize("group", GROUPS)
def test_every_option_of_every_group_composes(compose, group, image_root, shard_pattern):
    required = {"text_unet": ["student.sample_size=8", "student.cross_attention_dim=64"],  # ??? by design
                "sd3_transformer": ["student.sample_size=8", "student.joint_attention_dim=128",
                                    "student.pooled_projection_dim=128"],
                "pretrained": ["student.path=some/export"]}
    for option in options(group):
        extra = data_overrides(option, image_root, shard_pattern) if group == "data" else required.get(option, [])
        cfg = compose(f"{group}={option}", *extra)
        assert missing_keys(cfg) == [], (group, option)


def applicable(cfg, overrides):
    """The overrides whose key exists in ``cfg`` (experiments differ in students and callbacks)."""
    from omegaconf import OmegaConf

    keep = []
    for o in overrides:
        key = o.split("=", 1)[0]
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        if node is not None and leaf in node:
            keep.append(o)
    return keep


def stand_in_teacher(cfg, tmp_path) -> list[str]:
    """An experiment whose teacher is a hub model (e.g. +exp=consistency_flow on SD3) runs on that family's random-weight
    stand-in: no network at test time."""
    from pathlib import Path

    from omegaconf import OmegaConf

    teacher = OmegaConf.select(cfg, "teacher.pretrained_model_name_or_path")
    if teacher is None or Path(str(teacher)).exists():
        return []
    if str(teacher).startswith("stabilityai/stable-diffusion-3"):
        from tests.sd3_tiny import write_tiny_sd3

        return [f"teacher.pretrained_model_name_or_path={write_tiny_sd3(tmp_path / 'sd3')}"]
    if str(teacher).startswith("black-forest-labs/FLUX.1"):
        from tests.flux_tiny import write_tiny_flux

        return [f"teacher.pretrained_model_name_or_path={write_tiny_flux(tmp_path / 'flux')}"]
    raise AssertionError(f"experiment teacher {teacher} has no stand-in in tests/test_config.py:stand_in_teacher")


@pytest.mark.parametrize("exp", EXPERIMENTS)
def test_experiment_fast_dev_run(compose, exp, tmp_path):
    base = compose(f"+exp={exp}")
    cfg = compose(f"+exp={exp}", *applicable(base, FAST), *stand_in_teacher(base, tmp_path), "logger=csv")
    assert cfg.exp_name == exp
    metrics = run_in_process(cfg, tmp_path)
    assert np.isfinite(metrics["train/loss"])


@pytest.mark.parametrize("option", ["digits", "imagefolder", "webdataset"])
def test_data_option_fast_dev_run(compose, option, tmp_path, image_root, shard_pattern):
    cfg = compose(f"data={option}", *data_overrides(option, image_root, shard_pattern), *FAST, "logger=none")
    metrics = run_in_process(cfg, tmp_path)
    assert np.isfinite(metrics["train/loss"]) and np.isfinite(metrics["val/loss"])


@pytest.mark.parametrize("option", ["ddim", "dpmsolver", "euler", "unipc", "heun", "ddpm"])
def test_scheduler_option_samples_during_validation(compose, option, tmp_path):
    cfg = compose(f"scheduler={option}", *FAST, "logger=none")
    run_in_process(cfg, tmp_path)
    grids = list((tmp_path / "run" / "samples").glob("*.png"))
    assert len(grids) == 1
    assert Image.open(grids[0]).size == (4 * (16 + 2), 4 * 10 * (16 + 2))  # one seed x 10 prompts, 1-px frames, x4


@pytest.mark.parametrize("loggers", ["csv", "tensorboard", "wandb", "none", "[csv,tensorboard,wandb]"])
def test_logger_options(compose, loggers, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = compose(f"logger={loggers}", *FAST, "trainer.fast_dev_run=false", "trainer.max_steps=2",
                  "trainer.log_every_n_steps=1", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
                  "callbacks.samples=null", "export=false", "sample_grid_seeds=0")
    run_in_process(cfg, tmp_path)
    run = tmp_path / "run"
    names = set(cfg.logger)
    assert (run / "csv" / "metrics.csv").exists() == ("csv" in names)
    assert any((run / "tensorboard").glob("events.out.tfevents.*")) == ("tensorboard" in names)
    assert any((run / "wandb").glob("offline-run-*")) == ("wandb" in names)
    if "csv" in names:
        rows = list(csv.DictReader(open(run / "csv" / "metrics.csv")))
        assert any(r.get("train/loss") for r in rows) and any(r.get("val/loss") for r in rows)
        hparams = yaml.safe_load(open(run / "csv" / "hparams.yaml"))  # the whole composed config
        assert hparams["trainer"]["max_steps"] == 2 and hparams["data"]["_target_"] == cfg.data._target_
        assert hparams["student"]["size"] == cfg.student.size and "hydra" not in hparams
    if "wandb" in names:  # an offline run keeps its config records inside the run's .wandb file
        (records,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
        # wandb's service process writes the file after wandb.finish() returns (seen here: the 7-byte header alone
        # once in a loaded CI run), so give it a few seconds
        deadline = time.monotonic() + 30
        while b"limit_val_batches" not in records.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert b"sample_grid_seeds" in records.read_bytes() and b"limit_val_batches" in records.read_bytes()
    assert (run / "checkpoints" / "last.ckpt").exists()


# ---------------------------------------------------------------- one source for every default

ABSENT = object()


def _same(value, default) -> bool:
    """A YAML value equal to a default (numbers by value, tuples as lists, bools only to bools)."""
    if isinstance(value, list | tuple) and isinstance(default, list | tuple):
        return len(value) == len(default) and all(_same(v, d) for v, d in zip(value, default))
    if isinstance(value, bool) or isinstance(default, bool):
        return type(value) is type(default) and value == default
    if isinstance(value, dict) and isinstance(default, dict):
        return value == default == {}
    if isinstance(value, dict) and dataclasses.is_dataclass(default):  # a nested group of options, whole
        return value == dataclasses.asdict(default)
    return value == default


def _signature_defaults(target: str) -> dict:
    """What the callable ``target`` takes when a key is left out: its defaults (required ones are ???)."""
    import inspect

    from hydra.utils import get_object

    from distill.config.builds import parameters

    return {p.name: "???" if p.default is inspect.Parameter.empty else p.default
            for p in parameters(get_object(target))}


def _restated(body: dict, base, where: str = "") -> list[str]:
    """The keys of ``body`` whose value is the one ``base`` already gives them; a ``_target_`` node that
    ``base`` does not hold is compared with its constructor's signature."""
    found = []
    for key, value in body.items():
        here = f"{where}.{key}" if where else str(key)
        default = base.get(key, ABSENT) if isinstance(base, dict) else ABSENT
        if isinstance(value, dict) and "_target_" in value and not (
                isinstance(default, dict) and default.get("_target_") == value["_target_"]):
            found += _restated(value, _signature_defaults(value["_target_"]), here)
        elif isinstance(value, dict) and value and isinstance(default, dict):
            found += _restated(value, default, here)
        elif default is not ABSENT and _same(value, default):
            found.append(f"{here}: {value!r}")
    return found


def _container(node) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=False, enum_to_str=True)


def _merge(*nodes: dict) -> dict:
    from omegaconf import OmegaConf

    return _container(OmegaConf.merge(*[OmegaConf.create(n) for n in nodes]))


def _read(path):
    body = yaml.safe_load(path.read_text()) or {}
    return body.pop("defaults", []), body


def _option(group: str, name: str) -> dict:
    """An option of a config group as Hydra composes it (its schema, the options it extends, its body)."""
    defaults, body = _read(CONF / group / f"{name}.yaml")
    return _merge(_option_base(group, defaults), body)


def _option_base(group: str | None, defaults: list) -> dict:
    """What a group option (or a primary config, ``group`` None) starts from: its defaults list without
    ``_self_`` and without group selections (the entries that are mappings)."""
    from hydra.core.config_store import ConfigStore

    base = {}
    for entry in defaults:
        if not isinstance(entry, str) or entry == "_self_":
            continue
        name, _, package = entry.partition("@")
        if name.startswith("base_"):
            node = _container(ConfigStore.instance().load(f"{group}/{name}.yaml" if group else f"{name}.yaml").node)
        else:  # another option of the same group
            node = _option(group, name)
        base = _merge(base, {package: node} if package else node)
    return base


def _exp_base_overrides(defaults: list) -> list[str]:
    """The command line that composes what an experiment starts from: its group overrides and parents."""
    overrides = []
    for entry in defaults:
        if entry == "_self_":
            continue
        if isinstance(entry, str):  # another experiment
            overrides.append(f"+exp={entry}")
            continue
        ((key, value),) = entry.items()
        key = key.removeprefix("override").strip().lstrip("/")
        overrides.append(f"{key}=[{','.join(value)}]" if isinstance(value, list) else f"{key}={value}")
    return overrides


@pytest.fixture(scope="module")
def hydra_defaults(tmp_path_factory):
    """Hydra's own config (run and sweep directories, job settings) when a primary config sets none."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    folder = tmp_path_factory.mktemp("empty_conf")
    (folder / "empty.yaml").write_text("{}\n")
    with initialize_config_dir(config_dir=str(folder), version_base="1.3"):
        return _container(hydra_compose(config_name="empty", return_hydra_config=True).hydra)


YAMLS = sorted(str(p.relative_to(CONF)) for p in CONF.rglob("*.yaml"))
# Restatements kept on purpose, each with its reason.
ALLOWED = {
    # Every method's optimizer states its learning rate (AdamW's own 1e-3 here): the key users change and sweep,
    # and an optimizer node has no schema, so a key it lacks could only be added with +method.optimizer.lr=...
    ("method/latent_diffusion.yaml", "optimizer.lr: 0.001"),
}


def _hydra_option(group: str, option: str, tmp_path_factory) -> dict:
    """Hydra's composed node of a plugin's option, e.g. hydra/launcher=submitit_slurm."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    folder = tmp_path_factory.mktemp("empty_conf")
    (folder / "empty.yaml").write_text("{}\n")
    with initialize_config_dir(config_dir=str(folder), version_base="1.3"):
        cfg = hydra_compose(config_name="empty", overrides=[f"{group}={option}"], return_hydra_config=True)
    return _container(cfg.hydra[group.split("/", 1)[1]])


@pytest.mark.parametrize("path", YAMLS)
def test_no_yaml_restates_a_default(compose, hydra_defaults, path, tmp_path_factory):
    """Every YAML holds only deltas: no key repeats the value its schema, the option it extends, the config
    an experiment starts from, Hydra's own config or (for a `_target_` node without a schema) the
    constructor's signature already gives it."""
    defaults, body = _read(CONF / path)
    group = str(CONF.joinpath(path).parent.relative_to(CONF))
    if group == "exp":
        base = _container(compose(*_exp_base_overrides(defaults)))
    elif group == "hydra":
        base = hydra_defaults
    elif group.startswith("hydra/"):  # extends a plugin's option (hydra/launcher=submitit_slurm): Hydra's node of it
        base = _hydra_option(group, [d for d in defaults if d != "_self_"][0], tmp_path_factory)
    else:
        base = _option_base(None if group == "." else group, defaults)
        if "hydra" in body:
            found = _restated(body.pop("hydra"), hydra_defaults, "hydra")
            assert not found, f"conf/{path} restates Hydra's defaults: {found}"
    found = [key for key in _restated(body, base) if (path, key) not in ALLOWED]
    assert not found, f"conf/{path} restates defaults (drop these keys): {found}"


def _schemas():
    """The schemas of objects (a schema without _target_ is itself the only source of its defaults)."""
    import dataclasses

    from distill.config.schema import SCHEMAS

    return [(group, name) for group, nodes in SCHEMAS.items() for name, schema in nodes.items()
            if "_target_" in {f.name for f in dataclasses.fields(schema)}]


@pytest.mark.parametrize("group, name", _schemas())
def test_schema_defaults_are_the_constructors(group, name):
    """Each schema in the ConfigStore takes every default from its `_target_`'s signature (a generated schema
    by construction; this guards a field added or overridden by hand)."""
    import inspect

    from hydra.core.config_store import ConfigStore
    from hydra.utils import get_object
    from omegaconf import OmegaConf

    from distill.config.builds import parameters
    from distill.config.schema import register_configs

    register_configs()
    node = ConfigStore.instance().load(f"{group}/base_{name}.yaml").node
    target, kwargs_of = getattr(OmegaConf.get_type(node), "__builds__", (node._target_, None))
    params = {p.name: p for p in parameters(get_object(target), get_object(kwargs_of) if kwargs_of else None)}
    schema = _container(node)
    for key, value in schema.items():
        if key.startswith("_"):
            continue
        assert key in params, f"{group}.{key} is not an argument of {target}"
        default = params[key].default
        default = "???" if default is inspect.Parameter.empty else default
        assert _same(value, default), f"{group}.{key}: schema {value!r}, {target} {default!r}"


def test_builds_types_defaults_and_choices():
    """A schema from a signature: defaults kept (tuples as lists), required -> ???, objects -> Any, a choice
    and a Literal -> an Enum that OmegaConf checks, naming the allowed values."""
    import dataclasses
    from typing import Any

    from omegaconf import MISSING, OmegaConf
    from omegaconf.errors import ValidationError

    from distill.config.builds import Choice, builds, choice

    schema = builds("ToyConfig", "tests.test_config.toy", exclude=("model",),
                    choices={"size": choice("ToySize", ("tiny", "huge"))}, partial=True)
    fields = {f.name: f for f in dataclasses.fields(schema)}
    assert list(fields) == ["_target_", "_partial_", "size", "steps", "scale", "names", "mode", "table", "optimizer",
                            "need"]
    cfg = OmegaConf.structured(schema)
    assert _container(cfg) == {"_target_": "tests.test_config.toy", "_partial_": True, "size": "tiny", "steps": 3,
                               "scale": None, "names": ["a", "b"], "mode": "x", "table": None, "optimizer": None,
                               "need": MISSING}
    assert fields["steps"].type is int and fields["optimizer"].type is Any and fields["names"].type == list[str]
    assert issubclass(fields["mode"].type, Choice) and [m.value for m in fields["mode"].type] == ["x", "y"]
    cfg.size, cfg.mode, cfg.scale = "huge", "y", 2
    assert cfg.size == "huge" and cfg.mode == "y" and cfg.scale == 2.0
    with pytest.raises(ValidationError, match=r"Invalid value 'giant', expected one of \[tiny, huge\]"):
        cfg.size = "giant"
    with pytest.raises(ValidationError, match="steps"):
        cfg.steps = "many"
    with pytest.raises(ValueError, match=r"no parameter\(s\) \['modle'\]"):
        builds("ToyConfig", "tests.test_config.toy", exclude=("modle",))
    with pytest.raises(TypeError, match="model=...\\) defaults to"):
        builds("ToyConfig", "tests.test_config.toy_with_object_default")


class _Thing:
    pass


def toy(model: _Thing, size: str = "tiny", steps: int = 3, scale: float | None = None,
        names: tuple[str, ...] = ("a", "b"), mode: Literal["x", "y"] = "x", table: dict[str, int] | None = None,
        optimizer: Callable | None = None, *, need: int, **unused):
    """A constructor for test_builds_types_defaults_and_choices."""


def toy_with_object_default(model: _Thing = _Thing()):  # noqa: B008
    """A default no config can hold."""


def test_choices_reach_objects_as_plain_strings(compose):
    """Hydra checks a choice as an Enum; objects, loggers and checkpoints get the plain string (weights-only
    loading reads no Enum), and a composed config pickles with its types (submitit)."""
    import enum
    import io
    import pickle

    import torch

    from distill.config.builds import plain_choices

    cfg = compose("+exp=consistency")
    assert isinstance(cfg.scheduler.name, enum.Enum) and cfg.scheduler.name == "lcm"
    # compared as containers, interpolations unresolved (DictConfig == resolves ${now:...} on each side, which
    # differs when the comparison straddles a second)
    from omegaconf import OmegaConf

    unpickled = pickle.loads(pickle.dumps(cfg))
    assert OmegaConf.to_container(unpickled) == OmegaConf.to_container(cfg)
    assert isinstance(unpickled.scheduler.name, enum.Enum)
    plain = plain_choices(cfg)

    assert OmegaConf.to_container(plain) == OmegaConf.to_container(cfg, enum_to_str=True)
    assert type(plain.scheduler.name) is str and type(plain.method.loss_type) is str
    buffer = io.BytesIO()
    torch.save(_container(plain.method), buffer)
    assert torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)["loss_type"] == "pseudo_huber"
    with pytest.raises(Exception, match="bad_key"):
        plain.method.bad_key  # noqa: B018 (still struct: a typo in code fails)
