"""Hydra's submitit launcher, run: a -m sweep of two tiny trainings through submitit's local executor (the same
launcher code as on SLURM: the job pickled, run in its own process, its result pickled back), each job in its own
run directory of the sweep. The SLURM side (launch/slurm.sh, the batch script) is in tests/test_launch.py."""

import os
import pickle
import subprocess
import sys

import pytest
from hydra.core.utils import JobStatus
from omegaconf import OmegaConf

from distill.utils.checkpoint import safe_load
from tests.conftest import ROOT

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install -e '.[slurm]' (hydra-submitit-launcher)")

STEPS = 2
TINY = ["+exp=debug", "logger=csv", f"trainer.max_steps={STEPS}", "data.batch_size=64", "trainer.limit_val_batches=0",
        "callbacks.samples=null", "callbacks.progress=null", "export=false", "sample_grid_seeds=0"]


@pytest.mark.slow  # about 60 s: in `make test-all`, out of the 15-minute default suite
def test_submitit_local_sweep_runs_both_jobs_in_their_own_run_directories(tmp_path):
    sweep = tmp_path / "sweep"
    # the two jobs run at once: one thread each (more, on 2 cores, and each waits on the other's threads)
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "distill.train", "-m", "hydra/launcher=submitit_local", "seed=1,2",
                           *TINY, f"hydra.sweep.dir={sweep}", "hydra.launcher.timeout_min=10"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-3000:]
    assert "Submitit 'local' sweep output dir" in said and "#0 : seed=1" in said and "#1 : seed=2" in said

    for job, seed in ((0, 1), (1, 2)):
        run_dir = sweep / str(job)
        assert OmegaConf.load(run_dir / "config.yaml").seed == seed  # distill's own record of the job's config
        assert f"seed={seed}" in OmegaConf.load(run_dir / ".hydra" / "overrides.yaml")
        assert safe_load(run_dir / "checkpoints" / "last.ckpt")["global_step"] == STEPS
        assert (run_dir / "csv" / "metrics.csv").exists() and (run_dir / "train.log").exists()

    # each job ran in its own submitit process and sent its result back (what the launcher waited for)
    results = sorted((sweep / ".submitit").glob("*/*_result.pkl"))
    assert len(results) == 2, sorted(p.name for p in (sweep / ".submitit").rglob("*"))
    seeds = []
    for path in results:
        status, job_return = pickle.loads(path.read_bytes())
        assert status == "success" and job_return.status == JobStatus.COMPLETED, job_return
        seeds.append(job_return.overrides[0])
    assert sorted(seeds) == ["seed=1", "seed=2"]
