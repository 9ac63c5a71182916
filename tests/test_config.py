"""Every config group option and experiment composes, and runs one fast_dev_run step on CPU."""

import csv
import io
import tarfile

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
    required = {"text_unet": ["student.sample_size=8", "student.cross_attention_dim=64"]}  # ??? by design
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


@pytest.mark.parametrize("exp", EXPERIMENTS)
def test_experiment_fast_dev_run(compose, exp, tmp_path):
    cfg = compose(f"+exp={exp}", *applicable(compose(f"+exp={exp}"), FAST), "logger=csv")
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
        assert b"sample_grid_seeds" in records.read_bytes() and b"limit_val_batches" in records.read_bytes()
    assert (run / "checkpoints" / "last.ckpt").exists()
