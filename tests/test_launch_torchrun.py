"""launch/torchrun.sh as users run it, with 2 CPU processes (gloo): a SIGTERM to torchrun (Kubernetes' eviction of the
pod in launch/k8s-job.yaml) reaches both workers, which save last.ckpt at a step boundary and stop; the same command
again resumes from last.ckpt and finishes, the CSV log continuing where it stopped."""

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distill.utils.checkpoint import safe_load
from tests.conftest import ROOT

N = 8  # steps; the signal comes after step 2
TINY = ["+exp=debug", "trainer=cpu_ddp", "data.batch_size=64", "logger=csv", f"trainer.max_steps={N}",
        "trainer.limit_val_batches=0", "callbacks.samples=null", "callbacks.progress=null", "export=false",
        "sample_grid_seeds=0", "checkpoint.every_n_train_steps=1", "trainer.log_every_n_steps=1"]
TORCHRUN = Path(sys.executable).parent / "torchrun"


def _env(run_dir: Path) -> dict:
    # torchrun from this interpreter's environment (the venv need not be activated); --standalone picks its own port
    return {**os.environ, "PATH": f"{TORCHRUN.parent}{os.pathsep}{os.environ['PATH']}", "NPROC": "2",
            "RUN_DIR": str(run_dir), "WANDB_MODE": "offline", "WANDB_SILENT": "true"}


@pytest.mark.slow  # about 60 s: in `make test-all`, out of the 15-minute default suite
@pytest.mark.skipif(not TORCHRUN.exists(), reason=f"no torchrun next to {sys.executable}")
def test_torchrun_sh_two_cpu_processes_preempted_then_the_same_command_resumes(tmp_path):
    run_dir = tmp_path / "run"
    command = ["bash", str(ROOT / "launch" / "torchrun.sh"), *TINY]
    log = open(tmp_path / "first.log", "w+")
    proc = subprocess.Popen(command, env=_env(run_dir), stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    start = time.time()
    while not (run_dir / "checkpoints" / "step_0000002.ckpt").exists():
        assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert time.time() - start < 240, "no checkpoint after 240 s"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)  # to torchrun itself (torchrun.sh execs it), as Kubernetes signals PID 1
    proc.wait(timeout=120)
    first = (tmp_path / "first.log").read_text()
    if proc.returncode == 0:
        pytest.skip("the signal arrived after the final step")
    assert "received SIGTERM" in first, first[-3000:]  # distill's preemption, on the workers
    saved = safe_load(run_dir / "checkpoints" / "last.ckpt")
    assert 2 <= saved["global_step"] < N and len(saved["callbacks"]["RNGState"]["per_rank"]) == 2  # both ranks

    again = subprocess.run(command, env=_env(run_dir), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    said = again.stdout + again.stderr
    assert again.returncode == 0, said[-3000:]
    assert f"resuming from {run_dir / 'checkpoints' / 'last.ckpt'} (step {saved['global_step']})" in said, said[-3000:]
    assert safe_load(run_dir / "checkpoints" / "last.ckpt")["global_step"] == N
    rows = list(csv.DictReader(open(run_dir / "csv" / "metrics.csv")))
    steps = sorted({int(r["step"]) for r in rows if r.get("train/loss")})
    assert steps == list(range(N)), steps  # one curve (steps 0..N-1) across the two runs: no gap, nothing past N
