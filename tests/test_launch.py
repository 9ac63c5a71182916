"""Launch files that have run: the SLURM scripts driven with fake srun/sbatch/scontrol on the PATH (what they run,
and the requeue on exit code 75), the submitit SLURM launcher's config as launch/slurm.sh composes it, and the batch
script submitit writes from it. Every path SLURM opens before the job starts already exists on a fresh clone.

torchrun and submitit's local executor run real trainings: tests/test_launch_torchrun.py, tests/test_launch_submitit.py.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

try:
    import hydra_plugins.hydra_submitit_launcher  # noqa: F401
    SUBMITIT = None
except ImportError:
    SUBMITIT = "needs Hydra's submitit launcher: pip install -e '.[slurm]'"
needs_submitit = pytest.mark.skipif(SUBMITIT is not None, reason=str(SUBMITIT))

PREEMPTED = 75  # distill.callbacks.resilience.PREEMPTED_EXIT_CODE
# a fake command: its arguments, one per line, in $CALLS/<name>.<n> (n counts the calls)
RECORD = """n=$(ls "$CALLS" | grep -c "^$(basename "$0")\\." || true)
printf '%s\\n' "$@" > "$CALLS/$(basename "$0").$n"
"""


def fake_commands(tmp_path: Path, **bodies: str) -> tuple[Path, dict]:
    """A bin folder of fake commands (bash), first on the PATH of the returned environment; each records its call."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    calls.mkdir()
    for name, body in bodies.items():
        path = bin_dir / name
        path.write_text("#!/usr/bin/env bash\n" + RECORD + body)
        path.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "CALLS": str(calls)}
    for key in [k for k in env if k.startswith("SLURM_")]:  # as if outside any job, whatever runs the tests
        del env[key]
    return calls, env


def calls_of(calls: Path, name: str) -> list[list[str]]:
    files = sorted(calls.glob(f"{name}.*"), key=lambda p: int(p.suffix[1:]))
    return [p.read_text().splitlines() for p in files]


def _exists_in_a_fresh_clone(folder) -> bool:
    """The submit directory (the repository root), or a folder holding files that git tracks."""
    if folder == ROOT:
        return True
    tracked = subprocess.run(["git", "ls-files", str(folder)], cwd=ROOT, capture_output=True, text=True).stdout
    return bool(tracked.strip())


def test_slurm_logs_go_to_a_folder_that_exists_before_the_job_runs():
    scripts = list((ROOT / "launch").glob("*.sbatch"))
    assert scripts
    for script in scripts:
        paths = re.findall(r"^#SBATCH --(output|error)=(\S+)", script.read_text(), re.M)
        assert paths, script.name
        for key, path in paths:  # SLURM does not create folders
            assert _exists_in_a_fresh_clone((ROOT / path).parent), f"{script.name}: --{key}={path}"


# ---------------------------------------------------------------- launch/slurm_requeue.sbatch


def _sbatch_flags(text: str) -> dict[str, str]:
    return {k: v for k, v in re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", text, re.M)}


def test_requeue_script_warns_with_a_signal_distill_catches():
    from distill.config.schema import ResilienceConfig

    flags = _sbatch_flags((ROOT / "launch" / "slurm_requeue.sbatch").read_text())
    sig, delay = flags["signal"].split("@")
    assert f"SIG{sig}" in ResilienceConfig().preemption_signals and int(delay) >= 60
    assert "requeue" in flags and flags["open-mode"] == "append"  # requeueable; the requeued run appends to the log


@pytest.mark.parametrize("code, requeued", [(PREEMPTED, True), (0, False), (3, False)])
def test_requeue_script_requeues_its_job_on_exit_code_75_only(tmp_path, code, requeued):
    calls, env = fake_commands(tmp_path, srun=f"exit {code}\n", scontrol="")
    env.update(SLURM_JOB_ID="4242", SLURM_SUBMIT_DIR=str(tmp_path), SLURM_NTASKS_PER_NODE="4", SLURM_JOB_NUM_NODES="2")
    proc = subprocess.run(["bash", str(ROOT / "launch" / "slurm_requeue.sbatch"), "+exp=consistency", "seed=3"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == (0 if requeued else code), proc.stderr
    assert calls_of(calls, "srun") == [["python", "-m", "distill.train", "trainer=ddp", "trainer.devices=4",
                                        "trainer.num_nodes=2", "hydra.run.dir=outputs/slurm-4242", "ckpt_path=last",
                                        "+exp=consistency", "seed=3"]]
    assert calls_of(calls, "scontrol") == ([["requeue", "4242"]] if requeued else [])
    assert ("preempted: requeueing job 4242" in proc.stdout) == requeued


# srun of the fake SLURM: run the task itself; on the first call, send SIGUSR1 (SLURM's warning) once the training
# has written its second checkpoint, as SLURM does 120 s before the time limit
SRUN_PREEMPTING_ONCE = """"$@" &
task=$!
if [ "$n" -eq 0 ]; then
  while [ ! -e "$SLURM_SUBMIT_DIR/outputs/slurm-$SLURM_JOB_ID/checkpoints/step_0000002.ckpt" ]; do
    kill -0 "$task" 2>/dev/null || break
    sleep 0.05
  done
  kill -USR1 "$task" 2>/dev/null
fi
wait "$task"
"""


@pytest.mark.slow  # two trainings (30-50 s on 2 cores); the requeue itself is checked above with a fake srun
def test_requeue_script_end_to_end_preempted_training_requeues_and_resumes(tmp_path):
    """The script runs a real (tiny, single-process) training through a fake srun that sends SIGUSR1 mid-run: distill
    saves last.ckpt and exits 75, the script requeues; the requeued job (the same script, the same SLURM_JOB_ID) resumes
    in the same run directory and finishes."""
    from distill.utils.checkpoint import safe_load

    calls, env = fake_commands(tmp_path, srun=SRUN_PREEMPTING_ONCE, scontrol="",
                               python=f'exec {sys.executable} "$@"\n')
    env.update(SLURM_JOB_ID="77", SLURM_SUBMIT_DIR=str(tmp_path), SLURM_NTASKS_PER_NODE="1", WANDB_MODE="offline")
    tiny = ["+exp=debug", "trainer=default", "logger=csv", "trainer.max_steps=8", "data.batch_size=64",
            "trainer.limit_val_batches=0", "callbacks.samples=null", "callbacks.progress=null", "export=false",
            "sample_grid_seeds=0", "checkpoint.every_n_train_steps=1", "trainer.log_every_n_steps=1"]
    script = ["bash", str(ROOT / "launch" / "slurm_requeue.sbatch"), *tiny]
    first = subprocess.run(script, env=env, capture_output=True, text=True, timeout=300)
    run_dir = tmp_path / "outputs" / "slurm-77"
    last = run_dir / "checkpoints" / "last.ckpt"
    if not calls_of(calls, "scontrol"):  # the training ended before the signal came (slow start, fast steps)
        assert first.returncode == 0, first.stderr[-3000:]
        pytest.skip("the signal arrived after the final step")
    assert first.returncode == 0 and calls_of(calls, "scontrol") == [["requeue", "77"]], first.stderr[-3000:]
    assert "received SIGUSR1" in first.stdout + first.stderr and 2 <= safe_load(last)["global_step"] < 8
    again = subprocess.run(script, env=env, capture_output=True, text=True, timeout=300)  # SLURM starts it again
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stdout + again.stderr and calls_of(calls, "scontrol") == [["requeue", "77"]]
    assert safe_load(last)["global_step"] == 8


# ---------------------------------------------------------------- launch/slurm.sh and the submitit SLURM launcher

SLURM_ENV = {"NODES": "2", "GPUS_PER_NODE": "4", "PARTITION": "preempt", "TIMEOUT_MIN": "90"}


@pytest.fixture
def slurm_sh_overrides(tmp_path):
    """The overrides launch/slurm.sh passes to ``python -m distill.train -m`` (a fake python records them)."""
    (tmp_path / "slurm_sh").mkdir()
    calls, env = fake_commands(tmp_path / "slurm_sh", python="")
    env.update(SLURM_ENV)
    proc = subprocess.run(["bash", str(ROOT / "launch" / "slurm.sh"), "+exp=debug"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    [argv] = calls_of(calls, "python")
    assert argv[:3] == ["-m", "distill.train", "-m"]  # a multirun: the launcher is used even for one job
    return argv[3:]


@needs_submitit
def test_slurm_sh_composes_the_launcher_and_trainer_it_promises(compose, slurm_sh_overrides, tmp_path):
    from distill.config.schema import ResilienceConfig

    cfg = compose(*slurm_sh_overrides, f"hydra.sweep.dir={tmp_path / 'sweep'}")
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (launcher.partition, launcher.timeout_min, launcher.nodes) == ("preempt", 90, 2)
    assert launcher.gpus_per_node == launcher.tasks_per_node == 4  # one task per GPU: Lightning's SLURM ranks
    assert (cfg.trainer.num_nodes, cfg.trainer.devices, cfg.trainer.strategy) == (2, 4, "ddp")
    assert cfg.ckpt_path == "last" and cfg.exp_name == "debug"  # a requeued job resumes in its run directory
    # the warning signal is distill's (submitit's own default, USR2, would pass unseen), and the job is requeueable
    assert launcher.additional_parameters.signal == f"USR1@{launcher.signal_delay_s}" and launcher.signal_delay_s == 120
    assert "SIGUSR1" in ResilienceConfig().preemption_signals and launcher.additional_parameters.requeue is True


class _Submitted(Exception):
    pass


@needs_submitit
def test_slurm_launcher_submits_a_batch_script_that_warns_with_usr1_and_requeues_on_75(
        compose, slurm_sh_overrides, tmp_path, monkeypatch):
    """The launcher's own code path (submitit's SlurmExecutor) writes the batch script and calls a fake sbatch; the
    script, run with a fake srun that exits 75, calls scontrol requeue with its job id (with 0, it does not)."""
    import submitit
    from hydra.utils import instantiate

    submitted = tmp_path / "submitted.sh"
    calls, env = fake_commands(tmp_path, sbatch=f'cp "$1" {submitted}\necho "Submitted batch job 4242"\n',
                               srun='exit "${FAKE_SRUN_EXIT:-0}"\n', scontrol="")
    monkeypatch.setenv("PATH", env["PATH"])  # submitit looks for srun (a SLURM cluster) and calls sbatch
    monkeypatch.setenv("CALLS", env["CALLS"])
    real_map_array = submitit.AutoExecutor.map_array

    def map_array(self, fn, *iterable):  # submit as the launcher does, then stop before waiting for the results
        raise _Submitted(real_map_array(self, fn, *iterable))

    monkeypatch.setattr(submitit.AutoExecutor, "map_array", map_array)
    sweep = tmp_path / "sweep"
    cfg = compose(*slurm_sh_overrides, f"hydra.sweep.dir={sweep}")
    launcher = instantiate(cfg.hydra.launcher)
    launcher.setup(hydra_context=None, task_function=None, config=cfg)
    with pytest.raises(_Submitted) as got:
        launcher.launch([["seed=1"], ["seed=2"]], initial_job_idx=0)
    assert [job.job_id for job in got.value.args[0]] == ["4242_0", "4242_1"]  # a job array, one task per sweep job

    text = submitted.read_text()
    flags = _sbatch_flags(text)
    assert {k: flags.get(k) for k in ("partition", "time", "nodes", "ntasks-per-node", "gpus-per-node", "signal")} == {
        "partition": "preempt", "time": "90", "nodes": "2", "ntasks-per-node": "4", "gpus-per-node": "4",
        "signal": "USR1@120"}
    assert "requeue" in flags and flags["array"] == "0-1%2" and flags["open-mode"] == "append"
    assert str(sweep / ".submitit") in flags["output"]

    for code, requeued in [(PREEMPTED, True), (0, False), (1, False)]:
        for old in calls.iterdir():
            old.unlink()
        run = subprocess.run(["bash", str(submitted)], env={**env, "SLURM_JOB_ID": "4243", "FAKE_SRUN_EXIT": str(code)},
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == (0 if requeued else code), run.stderr
        [srun] = calls_of(calls, "srun")
        at = srun.index("submitit.core._submit")  # srun <its options> <python> -u -m submitit.core._submit <folder>
        assert srun[at - 3:at] == [sys.executable, "-u", "-m"] and srun[0] == "--unbuffered", srun
        assert calls_of(calls, "scontrol") == ([["requeue", "4243"]] if requeued else []), code
