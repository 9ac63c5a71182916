"""The command line as users meet it: help, --cfg, and a clear early error for each kind of bad config."""

import pytest

from tests.conftest import run_train


def test_help_lists_groups():
    proc = run_train("--help")
    assert proc.returncode == 0
    for group in ("data", "method", "teacher", "student", "scheduler", "trainer", "callbacks", "logger", "checkpoint", "exp"):
        assert f"{group}:" in proc.stdout, group


def test_cfg_job_prints_composed_config():
    proc = run_train("--cfg", "job", "+exp=debug")
    assert proc.returncode == 0
    assert "exp_name: debug" in proc.stdout and "max_steps: 4" in proc.stdout


# Exit code 1: what Hydra rejects at composition (unknown key, wrong type, a value outside a fixed set of
# choices); 2: what distill checks (distill.config.validate and the checks before any model is built).
# Every composition error is checked in-process (test_composition_rejects_...); a few of them, and each of distill's
# own checks, through the command line as users meet them.
COMPOSITION_ERRORS = [
    (["trainer.max_step=3"], ["trainer.max_step"]),  # typo: unknown key
    (["data.batch_size=abc"], ["data.batch_size"]),  # wrong type
    (["method.cond_dropout=often"], ["method.cond_dropout"]),
    (["callbacks.samples.num_seed=2"], ["callbacks.samples.num_seed"]),  # typo in a callback's settings
    (["method.prediction_type=flow"],
     ["full_key: method.prediction_type", "Invalid value 'flow', expected one of [epsilon, sample, v_prediction]"]),
    (["scheduler.name=plms"],
     ["full_key: scheduler.name", "'plms', expected one of [ddpm, ddim, dpmsolver, unipc, euler, heun, lcm, tcd, cm, flow_euler, flow_lcm, trigflow, flow_trigflow, meanflow, flow_meanflow]"]),
    (["student.size=huge"], ["full_key: student.size", "'huge', expected one of [debug, tiny, small, base]"]),
    (["+exp=consistency", "method.loss_type=l1"],
     ["full_key: method.loss_type", "'l1', expected one of [l2, huber, pseudo_huber, pseudo_huber_elementwise]"]),
    (["+exp=nonexistent"], ["nonexistent"]),
]


@pytest.mark.parametrize("overrides, needles", COMPOSITION_ERRORS)
def test_composition_rejects_bad_values_naming_the_key(compose, overrides, needles):
    with pytest.raises(Exception) as info:  # noqa: PT011 - Hydra's and OmegaConf's own error types
        compose(*overrides)
    err, text = info.value, ""
    while err is not None:
        text += f"{err}\n"
        err = err.__cause__ or err.__context__
    for needle in needles:
        assert needle in text, text


_SLOW = pytest.mark.slow  # each CLI case is a process start (~15-20 s on 2 cores); these repeat a covered path


@pytest.mark.parametrize(
    "overrides, code, needles",
    [
        (["trainer.max_step=3"], 1, ["trainer.max_step"]),
        pytest.param(["data.batch_size=abc"], 1, ["data.batch_size"], marks=_SLOW),
        pytest.param(["method.cond_dropout=often"], 1, ["method.cond_dropout"], marks=_SLOW),
        pytest.param(["callbacks.samples.num_seed=2"], 1, ["callbacks.samples.num_seed"], marks=_SLOW),
        (["data=imagefolder"], 2, ["data.root"]),  # required value missing
        (["method.prediction_type=flow"], 1,
         ["full_key: method.prediction_type", "Invalid value 'flow', expected one of [epsilon, sample, v_prediction]"]),
        pytest.param(["scheduler.name=plms"], 1, ["full_key: scheduler.name", "'plms', expected one of"], marks=_SLOW),
        pytest.param(["student.size=huge"], 1, ["full_key: student.size"], marks=_SLOW),
        pytest.param(["+exp=consistency", "method.loss_type=l1"], 1, ["full_key: method.loss_type"], marks=_SLOW),
        (["method.cond_dropout=1.5"], 2, ["method.cond_dropout=1.5"]),
        pytest.param(["data.resolution=18"], 2, ["not divisible"], marks=_SLOW),
        (["ckpt_path=/nonexistent/x.ckpt"], 2, ["ckpt_path='/nonexistent/x.ckpt'"]),
        (["+exp=nonexistent"], 1, ["nonexistent"]),
        (["+exp=consistency", "callbacks=none"], 2, ["callbacks.quality_cost has settings but no _target_"]),
        (["+exp=consistency", "teacher.pretrained_model_name_or_path=/no/such/teacher"], 2, ["/no/such/teacher"]),
        (["+exp=progressive_w", "student.time_cond_proj_dim=null"], 2, ["time_cond_proj_dim"]),
    ],
)
def test_bad_config_fails_early_and_writes_nothing(tmp_path, overrides, code, needles):
    run_dir = tmp_path / "run"
    proc = run_train(*overrides, f"hydra.run.dir={run_dir}", "logger=csv", timeout=120)
    assert proc.returncode == code, proc.stderr[-2000:]
    for needle in needles:
        assert needle in proc.stderr, proc.stderr[-2000:]
    assert not run_dir.exists()


@pytest.mark.parametrize("content", [pytest.param("empty", marks=pytest.mark.slow), "broken"])
def test_data_folder_without_usable_images_fails_before_training(tmp_path, content):
    root = tmp_path / "images"
    root.mkdir()
    if content == "broken":
        (root / "a.png").write_bytes(b"not a png")
    run_dir = tmp_path / "run"
    proc = run_train("data=imagefolder", f"data.root={root}", "data.resolution=16", "data.channels=1",
                     "data.skip_unreadable=false" if content == "broken" else "data.skip_unreadable=true",
                     f"hydra.run.dir={run_dir}", "logger=csv", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert ("a.png" if content == "broken" else "holds no readable image") in proc.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize(
    "node, package, extra",
    [
        ({"logger": {"tensorboard": {"_target_": "lightning.pytorch.loggers.TensorBoardLogger"}}}, "tensorboard", "tensorboard"),
        ({"data": {"_target_": "distill.data.WebDatasetDataModule"}}, "webdataset", "webdataset"),
    ],
)
def test_an_option_whose_optional_extra_is_missing_names_the_extra(monkeypatch, node, package, extra):
    import importlib.util

    from omegaconf import OmegaConf

    from distill.config.validate import ConfigError, _check_extras

    cfg = OmegaConf.create({"data": None, "logger": None, **node})
    _check_extras(cfg)  # installed here: passes
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith(package) else real(name, *a))
    with pytest.raises(ConfigError, match=rf"pip install 'distill\[{extra}\]'"):
        _check_extras(cfg)


@pytest.mark.parametrize("script, needle", [("distill-train", "exp_name: debug"), ("distill-evaluate", "pipeline:"),
                                            ("distill-sample", "pipeline:")])
def test_console_scripts_find_their_configs_from_any_directory(tmp_path, script, needle):
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).parent / script
    assert exe.is_file(), f"{exe} missing: install the package (pip install -e .)"
    args = ["--cfg", "job"] + (["+exp=debug"] if script == "distill-train" else [])
    proc = subprocess.run([str(exe), *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert needle in proc.stdout


def test_close_loggers_ends_the_wandb_run_so_the_next_sweep_job_starts_its_own(tmp_path, monkeypatch):
    import wandb
    from lightning.pytorch.loggers import WandbLogger

    from distill.train import _close_loggers

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="t")
    logger.log_hyperparams({"a": 1})  # starts the run
    assert wandb.run is not None
    _close_loggers(type("T", (), {"loggers": [logger]})())
    assert wandb.run is None
    _close_loggers(type("T", (), {"loggers": [logger]})())  # nothing to end: no error, no new run
    assert wandb.run is None
