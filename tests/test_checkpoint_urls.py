"""Checkpoint folders given as fsspec URLs (object stores, ``file://``, ``memory://``), not only local paths."""

import time

import fsspec
import pytest
import torch

from distill.utils.checkpoint import AtomicCheckpointIO, CheckpointError, resolve_resume, safe_load
from tests.conftest import run_train


@pytest.fixture
def memory_folder():
    fs = fsspec.filesystem("memory")
    folder = f"memory:///ckpts-{time.monotonic_ns()}"
    yield folder
    if fs.exists(folder):
        fs.rm(folder, recursive=True)


def test_memory_folder_saves_loads_and_resumes_from_the_newest_readable(memory_folder):
    io = AtomicCheckpointIO()
    io.save_checkpoint({"global_step": 1, "w": torch.arange(4.0)}, f"{memory_folder}/step_0000001.ckpt")
    time.sleep(0.01)
    io.save_checkpoint({"global_step": 2, "w": torch.ones(1000)}, f"{memory_folder}/last.ckpt")
    loaded = io.load_checkpoint(f"{memory_folder}/step_0000001.ckpt")
    assert loaded["global_step"] == 1 and torch.equal(loaded["w"], torch.arange(4.0))
    found, ckpt = resolve_resume(memory_folder)
    assert found == f"{memory_folder}/last.ckpt" and ckpt["global_step"] == 2
    fs = fsspec.filesystem("memory")
    last = f"{memory_folder}/last.ckpt"
    fs.pipe_file(last, fs.cat_file(last)[:500])  # truncated newest file: fall back to the previous
    with pytest.raises(CheckpointError, match=r"last.ckpt \(500 bytes\) is unreadable"):
        safe_load(f"{memory_folder}/last.ckpt")
    found, ckpt = resolve_resume(memory_folder)
    assert found == f"{memory_folder}/step_0000001.ckpt" and ckpt["global_step"] == 1


def test_empty_or_missing_url_folder_is_a_fresh_start(memory_folder):
    assert resolve_resume(memory_folder) == (None, None)


@pytest.mark.slow  # ~40 s; resume itself is covered by tests/test_resilience.py
def test_training_with_a_file_url_checkpoint_folder_resumes(tmp_path):
    folder = f"file://{tmp_path}/ckpts"
    common = ["+exp=debug", "data.batch_size=256", "method.lr_scheduler.total_steps=6", "logger=csv", "export=false",
              "sample_grid_seeds=0", "callbacks.progress=null", f"checkpoint.dirpath={folder}",
              "checkpoint.every_n_train_steps=2", f"hydra.run.dir={tmp_path / 'run'}"]
    first = run_train(*common, "trainer.max_steps=4")
    assert first.returncode == 0, first.stderr[-3000:]
    assert safe_load(f"{folder}/last.ckpt")["global_step"] == 4
    assert safe_load(tmp_path / "ckpts" / "last.ckpt")["global_step"] == 4  # the same file as a local path
    second = run_train(*common, "trainer.max_steps=6", "ckpt_path=last")
    assert second.returncode == 0, second.stderr[-3000:]
    log = (tmp_path / "run" / "train.log").read_text()
    assert f"resuming from {tmp_path}/ckpts/last.ckpt (step 4)" in log
    assert safe_load(f"{folder}/last.ckpt")["global_step"] == 6
    assert not list((tmp_path / "ckpts").glob("*.tmp-*"))
