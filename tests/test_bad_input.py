"""Mistakes a tired user makes that used to end in a traceback, a minutes-long hang or a run that trains nothing:
each is refused before any model is built, with exit code 2, naming the key and the fix, leaving no run
directory (issue 30, item 18). The cases are composed in-process; the command line checks exit code and folders."""

import errno
import socket
import time

import numpy as np
import pytest
from PIL import Image

from distill.config.validate import ConfigError, validate, writable_folder_error
from tests.conftest import run_train
from tests.test_config import run_in_process


@pytest.mark.parametrize("overrides, needle", [
    (["resilience.preemption_signals=[SIGFOO]"], "resilience.preemption_signals: 'SIGFOO' is not a signal"),
    (["resilience.preemption_signals=[SIGUSR1,SIGKILL]"], "'SIGKILL' is not a signal a process can catch"),
    (["trainer.val_check_interval=0"], "trainer.val_check_interval=0 must be a number of training steps >= 1"),
    (["trainer.val_check_interval=1.5"], "trainer.val_check_interval=1.5 must be"),
    (["data.num_workers=-1"], r"data.num_workers=-1 must be >= 0"),
    (["method.optimizer.lr=-1e-4"], r"method.optimizer.lr=-0.0001 must be > 0"),
    (["+exp=consistency", "method.optimizer.lr=0"], r"method.optimizer.lr=0 must be > 0"),
    # the method's own checks, the same rule as its constructor's (a rate of 1 passed here, then failed at build)
    (["+exp=compress", "method.cond_dropout=1.0"], r"method.cond_dropout=1.0 must be in \[0, 1\)"),
    (["+exp=compress", "method.task_weight=0", "method.output_weight=0", "method.feature_weight=0"],
     "nothing to train"),
    # the student's size against the data's: in pixels, or through the VAE the method builds (found by its target)
    (["student.sample_size=12"], "student.sample_size=12 differs from data.resolution=16"),
    (["method=latent_diffusion", "student=text_unet", "student.sample_size=12", "student.cross_attention_dim=64"],
     "student.sample_size=12 does not match data.resolution=16 / VAE factor 4; set student.sample_size=4"),
    # a sharded trainer (one test of it, distill.methods.checks.is_sharded) with a method or student that cannot shard
    (["+exp=progressive", "trainer=cpu_fsdp"], "trainer=fsdp does not run progressive distillation"),
    (["+exp=consistency", "student=moe_timestep", "trainer=cpu_fsdp"], "trainer=fsdp with student .* each rank runs"),
])
def test_bad_values_are_refused_at_validation_naming_the_key(compose, overrides, needle):
    cfg = compose(*overrides)
    with pytest.raises(ConfigError, match=needle):
        validate(cfg)


@pytest.mark.parametrize("overrides", [["trainer.val_check_interval=7"], ["trainer.val_check_interval=0.5"],
                                       ["resilience.preemption_signals=[SIGUSR2]"], ["data.num_workers=0"]])
def test_good_values_pass(compose, overrides):
    validate(compose(*overrides))


def test_an_unwritable_folder_is_named_with_the_reason(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert writable_folder_error("checkpoint.dirpath", str(blocker / "ckpt")) == (
        f"checkpoint.dirpath='{blocker / 'ckpt'}' cannot be created: {blocker} is a file; choose a folder path")
    assert writable_folder_error("checkpoint.dirpath", str(tmp_path / "new" / "ckpt")) is None
    assert writable_folder_error("checkpoint.dirpath", "memory://bucket/ckpt") is None  # not probed

    import tempfile

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)  # what a read-only mount answers (root ignores modes)
    message = writable_folder_error("checkpoint.dirpath", str(tmp_path / "new" / "ckpt"))
    assert message.startswith(f"checkpoint.dirpath='{tmp_path / 'new' / 'ckpt'}' cannot be written (at {tmp_path}, ")
    assert "Read-only file system; choose a writable folder" in message


def test_an_unwritable_checkpoint_folder_is_refused_at_validation(compose, tmp_path):
    (tmp_path / "a_file").write_text("")
    cfg = compose(f"checkpoint.dirpath={tmp_path / 'a_file' / 'checkpoints'}")
    with pytest.raises(ConfigError, match="checkpoint.dirpath=.* cannot be created"):
        validate(cfg)


def _truncated_jpeg(root, n=6):
    root.mkdir()
    rng = np.random.default_rng(0)
    for i in range(n):  # noise: most of the file is entropy-coded data, which the cut falls in
        Image.fromarray(rng.integers(0, 255, (64, 64), dtype=np.uint8)).save(root / f"{i}.jpg", quality=95)
    whole = (root / "3.jpg").read_bytes()
    (root / "3.jpg").write_bytes(whole[: len(whole) // 2])  # passes Image.verify(), fails to decode
    return root / "3.jpg"


def test_a_truncated_image_is_found_before_training(tmp_path):
    from distill.data import ImageFolderDataModule

    bad = _truncated_jpeg(tmp_path / "images")
    with Image.open(bad) as image:
        image.verify()  # what the check used to do: no error
    strict = ImageFolderDataModule(str(tmp_path / "images"), resolution=16, channels=1, skip_unreadable=False)
    with pytest.raises(ValueError, match=rf"unreadable image {bad}: .*truncated.*set data.skip_unreadable=true"):
        strict.setup("fit")
    lenient = ImageFolderDataModule(str(tmp_path / "images"), resolution=16, channels=1)
    lenient.setup("fit")
    assert lenient.num_skipped == 1 and len(lenient.train_set) == 5 and bad not in lenient.train_set.files


def test_a_batch_larger_than_the_data_set_is_refused_before_any_model(compose, tmp_path, capsys, monkeypatch):
    """The digits' training split has 1,437 images; with whole batches only, 2,000 gave no batch at all, and the
    run exported an untrained student with exit 0."""
    import hydra.utils

    built = []
    real = hydra.utils.instantiate
    monkeypatch.setattr(hydra.utils, "instantiate", lambda node, *a, **k: built.append(
        node.get("_target_") if hasattr(node, "get") else None) or real(node, *a, **k))
    cfg = compose("data.batch_size=2000", "logger=csv")
    models = {cfg.student._target_, cfg.method._target_}
    with pytest.raises(SystemExit) as info:
        run_in_process(cfg, tmp_path)
    assert info.value.code == 2
    assert "data.batch_size=2000 is larger than the training set (1437 images at data.heldout_fraction=0.2); " \
           "set data.batch_size <= 1437" in capsys.readouterr().err
    assert built and not models & set(built)  # neither the student nor the method was built
    assert not (tmp_path / "run").exists()


def test_wandb_with_a_key_and_no_server_logs_offline_within_seconds(monkeypatch, caplog):
    from distill.utils import loggers

    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens there: what an unreachable host answers, without the network
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    start = time.perf_counter()
    assert loggers.wandb_offline() is True  # was: online, a traceback after 120 s
    assert time.perf_counter() - start < loggers.PROBE_TIMEOUT_S + 1
    assert f"127.0.0.1:{port} does not answer" in caplog.text and "logging offline" in caplog.text
    import os

    assert os.environ["WANDB_MODE"] == "offline"

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
    try:
        assert loggers.wandb_offline() is False  # a server that answers: online, as configured
    finally:
        server.close()


def test_an_unwritable_run_directory_fails_before_hydra_creates_it(tmp_path):
    (tmp_path / "a_file").write_text("")
    run_dir = tmp_path / "a_file" / "run"
    proc = run_train(f"hydra.run.dir={run_dir}", "logger=csv", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]  # was 1, with Hydra's traceback (OSError)
    assert f"error: hydra.run.dir='{run_dir}' cannot be created: {tmp_path / 'a_file'} is a file" in proc.stderr
    assert "Traceback" not in proc.stderr
