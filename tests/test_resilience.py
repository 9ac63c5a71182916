"""No lost work: exact resume after SIGKILL, preemption, atomic checkpoints, non-finite guard, bad resumes."""

import csv
import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distill.callbacks.resilience import Preempted
from distill.utils.checkpoint import CheckpointError, atomic_torch_save, resolve_resume, safe_load
from tests.conftest import ROOT, run_train

N = 8  # steps; the digits train split at batch 256 has 5 batches per epoch, so step 5 ends epoch 0
SHRINK = ["trainer.limit_val_batches=0", "callbacks.samples=null", "checkpoint.every_n_train_steps=1",
          "checkpoint.save_top_k=-1", "trainer.log_every_n_steps=1", "callbacks.progress=null", "export=false",
          "sample_grid_seeds=0"]
COMMON = ["+exp=debug", "data.batch_size=256", "trainer.max_steps=8", "method.lr_scheduler.total_steps=8",
          "method.lr_scheduler.warmup_steps=2", *SHRINK]
N_LCM = 5  # the default LCM experiment (EMA target in the module, no EMA callback), shrunk
LCM = ["+exp=consistency", "data.batch_size=8", f"trainer.max_steps={N_LCM}", f"method.lr_scheduler.total_steps={N_LCM}",
       "method.lr_scheduler.warmup_steps=2", "callbacks.quality_cost=null", *SHRINK]
RUNS = {"debug": (COMMON, N), "lcm": (LCM, N_LCM), "lcm_accumulate": ([*LCM, "trainer.accumulate_grad_batches=2"], N_LCM)}


def _losses(run_dir: Path) -> dict[int, str]:
    rows = csv.DictReader(open(run_dir / "csv" / "metrics.csv"))
    return {int(r["step"]): r["train/loss"] for r in rows if r.get("train/loss")}


def _assert_same_state(a: dict, b: dict, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{path} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{path}: keys differ"
        for k in a:
            _assert_same_state(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_state(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _assert_same_run(straight: Path, resumed: Path, n: int = N) -> None:
    a, b = (safe_load(d / "checkpoints" / "last.ckpt") for d in (straight, resumed))
    assert a["global_step"] == b["global_step"] == n
    _assert_same_state(a["state_dict"], b["state_dict"], "state_dict")  # student, and the LCM's EMA target
    _assert_same_state(a["optimizer_states"], b["optimizer_states"], "optimizer")
    _assert_same_state(a["lr_schedulers"], b["lr_schedulers"], "lr_schedulers")
    ema = [k for k in a["callbacks"] if k.startswith("EMA")]
    assert ema or any(k.startswith("target.") for k in a["state_dict"])  # an EMA callback or an EMA target
    for key in ema:
        _assert_same_state(a["callbacks"][key], b["callbacks"][key], "ema")
    la, lb = _losses(straight), _losses(resumed)
    assert len(la) == n and la == {k: lb[k] for k in la}  # the whole loss curve, to the last printed digit


@pytest.fixture(scope="module")
def straight_runs(tmp_path_factory):
    """The unbroken run of each of RUNS, trained once per module on first use."""
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            run_dir = tmp_path_factory.mktemp(f"straight_{name}") / "run"
            proc = run_train(*RUNS[name][0], "logger=csv", f"hydra.run.dir={run_dir}")
            assert proc.returncode == 0, proc.stderr[-3000:]
            done[name] = run_dir
        return done[name]

    return get


@pytest.fixture(scope="module")
def straight(straight_runs):
    return straight_runs("debug")


def _popen(run_dir: Path, *extra: str, base: list[str] = COMMON) -> subprocess.Popen:
    env = {**os.environ, "WANDB_MODE": "offline"}  # the same threads as run_train: bit-identity needs them
    return subprocess.Popen([sys.executable, "-m", "distill.train", *base, "logger=csv", *extra,
                             f"hydra.run.dir={run_dir}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 180) -> None:
    start = time.time()
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() - start < timeout
        time.sleep(0.005)


def test_resume_mid_epoch_and_at_an_epoch_boundary_is_bit_identical(straight, tmp_path):
    run_dir = tmp_path / "run"
    first = run_train(*COMMON, "trainer.max_steps=3", "logger=csv", f"hydra.run.dir={run_dir}")  # stops mid-epoch
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_train(*COMMON, "trainer.max_steps=5", "ckpt_path=last", "logger=csv", f"hydra.run.dir={run_dir}")
    assert second.returncode == 0, second.stderr[-3000:]  # resumed mid-epoch, stops at the end of epoch 0
    assert safe_load(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 5
    third = run_train(*COMMON, "ckpt_path=last", "logger=csv", f"hydra.run.dir={run_dir}")  # resumed at the boundary
    assert third.returncode == 0, third.stderr[-3000:]
    _assert_same_run(straight, run_dir)


# slow (about 3 minutes for the three runs): the default suite covers resume by the mid-epoch / epoch-boundary and
# preemption tests
@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_sigkill_in_the_middle_of_a_step_then_resume(straight_runs, tmp_path, name):
    """debug: the EMA callback; lcm: the module's EMA target (updated after each optimizer step, so a checkpoint
    holds the target of its own step); lcm_accumulate: the same with 2 micro-batches per optimizer step."""
    overrides, n = RUNS[name]
    straight, run_dir = straight_runs(name), tmp_path / "run"
    proc = _popen(run_dir, base=overrides)
    _wait_for(run_dir / "checkpoints" / "step_0000003.ckpt", proc)
    proc.send_signal(signal.SIGKILL)  # wherever it is: inside step 4, or writing its checkpoint
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    second = run_train(*overrides, "ckpt_path=last", "logger=csv", f"hydra.run.dir={run_dir}")
    assert second.returncode == 0, second.stderr[-3000:]
    _assert_same_run(straight, run_dir, n)


def test_preemption_signal_saves_exits_and_the_same_command_resumes(straight, tmp_path):
    run_dir = tmp_path / "run"
    proc = _popen(run_dir, "ckpt_path=last")
    _wait_for(run_dir / "checkpoints" / "step_0000002.ckpt", proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=180)
    if proc.returncode == 0:  # the run was already finishing its last step when the signal came
        pytest.skip("signal arrived after the final step")
    assert proc.returncode == 75, err[-3000:]
    saved = safe_load(run_dir / "checkpoints" / "last.ckpt")
    assert 2 <= saved["global_step"] < N and "relaunch the same command with ckpt_path=last" in out + err
    again = run_train(*COMMON, "ckpt_path=last", "logger=csv", f"hydra.run.dir={run_dir}")  # the same command
    assert again.returncode == 0, again.stderr[-3000:]
    _assert_same_run(straight, run_dir)


# ---------------------------------------------------------------- atomic checkpoints


def test_full_disk_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    atomic_torch_save({"w": torch.ones(3)}, path)

    def full_disk(obj, f):
        f.write(b"PK\x03\x04partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointError, match="the disk is full; the previous file there is unchanged"):
        atomic_torch_save({"w": torch.zeros(3)}, path)
    monkeypatch.undo()
    assert torch.equal(safe_load(path)["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary file left behind


def test_kill_during_a_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "last.ckpt"
    atomic_torch_save({"step": 1, "w": torch.ones(3)}, path)
    code = ("import os, time, torch; from distill.utils import checkpoint as c;"
            "os.replace = lambda *a: time.sleep(60);"
            f"c.atomic_torch_save({{'step': 2, 'w': torch.zeros(1000000)}}, {str(path)!r})")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    start = time.time()
    while not list(tmp_path.glob("last.ckpt.tmp-*")) or list(tmp_path.glob("*.tmp-*"))[0].stat().st_size < 4000000:
        assert time.time() - start < 60 and proc.poll() is None
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    assert safe_load(path)["step"] == 1
    found, ckpt = resolve_resume(tmp_path)
    assert found == path and ckpt["step"] == 1 and not list(tmp_path.glob("*.tmp-*"))


def test_truncated_newest_checkpoint_falls_back_to_the_previous(tmp_path, caplog):
    old, new = tmp_path / "step_0000001.ckpt", tmp_path / "last.ckpt"
    atomic_torch_save({"global_step": 1}, old)
    time.sleep(0.01)
    atomic_torch_save({"global_step": 2, "w": torch.ones(1000)}, new)
    new.write_bytes(new.read_bytes()[:500])  # truncated
    with pytest.raises(CheckpointError, match=r"last.ckpt \(500 bytes\) is unreadable"):
        safe_load(new)
    found, ckpt = resolve_resume(tmp_path)
    assert found == old and ckpt["global_step"] == 1
    assert "last.ckpt" in caplog.text and "instead of the unreadable" in caplog.text


def test_resume_takes_the_highest_stored_step_not_the_newest_file(tmp_path):
    """A run directory copied with cp -r (no -p) has file times in the order cp copied the files: here the step-20
    checkpoint is the newest file, last.ckpt the oldest."""
    for name, step, age in (("last.ckpt", 30, 3), ("step_0000030.ckpt", 30, 2), ("step_0000020.ckpt", 20, 1)):
        atomic_torch_save({"global_step": step, "w": torch.full((3,), float(step))}, tmp_path / name)
        os.utime(tmp_path / name, (1e9 - age, 1e9 - age))
    (tmp_path / "step_0000010.ckpt").write_bytes(b"garbage")  # unreadable: skipped, whatever its time
    found, ckpt = resolve_resume(tmp_path)
    assert found == tmp_path / "step_0000030.ckpt"  # of the two at step 30, the newer file
    assert ckpt["global_step"] == 30 and torch.equal(ckpt["w"], torch.full((3,), 30.0))


def test_the_final_step_is_checkpointed_when_the_interval_does_not_divide_it(tmp_path):
    """max_steps=5 with a checkpoint every 2 steps: periodic checkpoints at 2 and 4, and last.ckpt at 5."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from distill.callbacks.resilience import FinalCheckpoint

    class Toy(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.student = torch.nn.Linear(1, 1)

        def training_step(self, batch, batch_idx):
            return self.student(batch).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(max_steps: int, folder: Path) -> None:
        checkpoint = ModelCheckpoint(dirpath=folder, filename="step_{step:07d}", every_n_train_steps=2,
                                     save_last=True, save_top_k=-1, auto_insert_metric_name=False)
        loader = torch.utils.data.DataLoader([torch.ones(2, 1)] * 8, batch_size=None)
        trainer = L.Trainer(max_steps=max_steps, callbacks=[FinalCheckpoint(), checkpoint], logger=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=folder)
        trainer.fit(Toy(), loader)

    fit(5, tmp_path / "five")
    assert sorted(p.name for p in (tmp_path / "five").iterdir()) == ["last.ckpt", "step_0000002.ckpt",
                                                                    "step_0000004.ckpt"]
    assert safe_load(tmp_path / "five" / "last.ckpt")["global_step"] == 5
    fit(4, tmp_path / "four")  # the interval divides max_steps: last.ckpt is the periodic save's, left as it was
    assert safe_load(tmp_path / "four" / "last.ckpt")["global_step"] == 4


def test_a_refused_relaunch_leaves_the_run_directory_as_it_was(tmp_path):
    """Hydra writes .hydra/ before the task runs; distill.train writes it only once the config has passed its
    checks, so the record of the launch that made the run stays."""
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (run_dir / ".hydra" / name).write_text(f"# the original {name}\n")
    atomic_torch_save({"global_step": 2}, run_dir / "checkpoints" / "last.ckpt")
    (run_dir / "train.log").write_text("the original log\n")
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    proc = run_train(*COMMON, "ckpt_path=last", "data.batch_size=-1", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 2 and "data.batch_size=-1" in proc.stderr, proc.stderr[-3000:]
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


@pytest.mark.slow  # ~35 s; resolve_resume skipping a damaged file is unit-tested
def test_resume_skips_a_corrupted_last_checkpoint_end_to_end(straight, tmp_path):
    run_dir = tmp_path / "run"
    first = run_train(*COMMON, "trainer.max_steps=4", "logger=csv", f"hydra.run.dir={run_dir}")
    assert first.returncode == 0, first.stderr[-3000:]
    last = run_dir / "checkpoints" / "last.ckpt"
    last.write_bytes(b"garbage" * 10)
    os.utime(last)  # the newest file
    proc = run_train(*COMMON, "ckpt_path=last", "logger=csv", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert "last.ckpt (70 bytes) is unreadable" in said and "resuming from" in said and "step_0000004.ckpt" in said
    _assert_same_run(straight, run_dir)


def test_pickled_code_is_not_executed(tmp_path):
    class Boom:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "x": Boom()}, path)
    with pytest.raises(CheckpointError, match="not a weights-only checkpoint"):
        safe_load(path)
    assert not (tmp_path / "pwned").exists()


# ---------------------------------------------------------------- non-finite guard and bad resumes


# fused AdamW (the default) takes AMP's found_inf: the guard skips on the device, without a host sync per step
SKIP_WAYS = {"host": ["method.optimizer.fused=false"], "device": []}


@pytest.mark.parametrize("way", SKIP_WAYS)
def test_nonfinite_steps_are_skipped_and_counted(tmp_path, way):
    run_dir = tmp_path / "run"
    proc = run_train(*COMMON, *SKIP_WAYS[way], "resilience.inject_nonfinite_at_steps=[2,3]", "logger=csv",
                     f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"non-finite guard: skips bad steps on the {way}" in (run_dir / "train.log").read_text()
    rows = list(csv.DictReader(open(run_dir / "csv" / "metrics.csv")))
    assert max(float(r["train/nonfinite_skipped"]) for r in rows if r.get("train/nonfinite_skipped")) == 2.0
    ckpt2, ckpt4 = (safe_load(run_dir / "checkpoints" / f"step_000000{s}.ckpt") for s in (2, 4))
    for k, v in ckpt4["state_dict"].items():  # the 3rd and 4th steps changed nothing
        assert torch.isfinite(v).all()
        if k.startswith("student."):
            assert torch.equal(v, ckpt2["state_dict"][k]), k


@pytest.mark.parametrize("way", SKIP_WAYS)
def test_consecutive_nonfinite_steps_abort_and_keep_good_checkpoints(tmp_path, way):
    run_dir = tmp_path / "run"
    # on the device the counters are read on logging steps (here every 10) and before each checkpoint (every step)
    proc = run_train(*COMMON, *SKIP_WAYS[way], "resilience.inject_nonfinite_at_steps=[3,4,5]",
                     "resilience.max_consecutive_nonfinite=3", "trainer.log_every_n_steps=10", "logger=csv",
                     f"hydra.run.dir={run_dir}")
    assert proc.returncode == 3 and "3 consecutive steps had a non-finite loss or gradient" in proc.stderr
    for ckpt in (run_dir / "checkpoints").glob("*.ckpt"):
        assert all(torch.isfinite(v).all() for v in safe_load(ckpt)["state_dict"].values())
    assert safe_load(run_dir / "checkpoints" / "last.ckpt")["global_step"] <= 5


def test_device_side_skip_leaves_lcm_student_target_and_adam_state_unchanged(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(*LCM, "resilience.inject_nonfinite_at_steps=[2]", "logger=csv",
                     f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (run_dir / "train.log").read_text()
    assert "skips bad steps on the device" in log and "1 optimizer step(s) skipped since step 2" in log
    ckpt2, ckpt3, ckpt4 = (safe_load(run_dir / "checkpoints" / f"step_000000{s}.ckpt") for s in (2, 3, 4))
    targets = [k for k in ckpt2["state_dict"] if k.startswith("target.")]
    assert targets  # the EMA target is in the module's state
    for k, v in ckpt3["state_dict"].items():  # the 3rd step moved neither the student nor the target
        if k.startswith(("student.", "target.")):
            assert torch.equal(v, ckpt2["state_dict"][k]), k
    moved = [k for k in targets if not torch.equal(ckpt4["state_dict"][k], ckpt3["state_dict"][k])]
    assert moved  # the 4th step ran and moved the target
    state2, state3 = (c["optimizer_states"][0]["state"] for c in (ckpt2, ckpt3))
    for i, s in state3.items():  # AdamW's moments and step count as they were: found_inf skipped the update
        assert float(s["step"]) == float(state2[i]["step"]) == 2.0
        assert torch.equal(s["exp_avg"], state2[i]["exp_avg"]) and torch.equal(s["exp_avg_sq"], state2[i]["exp_avg_sq"])


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_clips_a_fused_optimizer_and_skips_on_the_device(tmp_path, precision):
    """Lightning's mixed-precision plugin refuses to clip a fused optimizer; without a gradient scaler (bf16, and
    16-mixed on CPU) distill clips as in full precision, and the guard still skips on the device."""
    run_dir = tmp_path / "run"
    proc = run_train(*COMMON, f"trainer.precision={precision}", "trainer.gradient_clip_val=1.0",
                     "resilience.inject_nonfinite_at_steps=[2]", "trainer.max_steps=4", "logger=csv",
                     f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (run_dir / "train.log").read_text()
    assert "skips bad steps on the device" in log and "1 optimizer step(s) skipped" in log
    ckpt2, ckpt3, ckpt4 = (safe_load(run_dir / "checkpoints" / f"step_000000{s}.ckpt") for s in (2, 3, 4))
    student = [k for k in ckpt2["state_dict"] if k.startswith("student.")]
    assert all(torch.equal(ckpt3["state_dict"][k], ckpt2["state_dict"][k]) for k in student)
    assert not all(torch.equal(ckpt4["state_dict"][k], ckpt3["state_dict"][k]) for k in student)


@pytest.mark.slow  # the refusal is unit-tested (test_checkpoint_of_another_method_is_refused); end to end: ~30 s
def test_checkpoint_of_another_architecture_is_refused_before_compute(tmp_path):
    run_dir = tmp_path / "run"
    first = run_train(*COMMON, "trainer.max_steps=2", "logger=csv", f"hydra.run.dir={run_dir}")
    assert first.returncode == 0, first.stderr[-3000:]
    before = (run_dir / "checkpoints" / "last.ckpt").read_bytes()
    proc = run_train(*COMMON, "student.size=tiny", "ckpt_path=last", "logger=csv", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 2 and "does not fit this student" in proc.stderr
    assert (run_dir / "checkpoints" / "last.ckpt").read_bytes() == before


# ---------------------------------------------------------------- the same with 2 CPU processes (DDP, gloo)

DDP = ["trainer=cpu_ddp", "data.batch_size=128"]  # 718 images per rank: 5 batches per rank per epoch


@pytest.fixture(scope="module")
def straight_ddp(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight_ddp") / "run"
    proc = run_train(*COMMON, *DDP, "logger=csv", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.mark.slow  # ~100 s with its straight run; trainer=cpu_fsdp vs cpu_ddp runs DDP in the default suite
def test_ddp_resume_and_preemption(straight_ddp, tmp_path):
    run_dir = tmp_path / "run"
    first = run_train(*COMMON, *DDP, "trainer.max_steps=3", "logger=csv", f"hydra.run.dir={run_dir}")
    assert first.returncode == 0, first.stderr[-3000:]
    saved = safe_load(run_dir / "checkpoints" / "last.ckpt")
    assert len(saved["callbacks"]["RNGState"]["per_rank"]) == 2  # both ranks' generators are in the file
    proc = _popen(run_dir, *DDP, "ckpt_path=last")  # resumes at step 3, then gets preempted
    _wait_for(run_dir / "checkpoints" / "step_0000004.ckpt", proc)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=300)
    if proc.returncode != 0:
        assert proc.returncode == 75, err[-3000:]
        assert safe_load(run_dir / "checkpoints" / "last.ckpt")["global_step"] < N
        again = run_train(*COMMON, *DDP, "ckpt_path=last", "logger=csv", f"hydra.run.dir={run_dir}")
        assert again.returncode == 0, again.stderr[-3000:]
    _assert_same_run(straight_ddp, run_dir)


def test_checkpoint_of_another_method_is_refused():
    from distill.callbacks.resilience import describe_run
    from distill.train import _check_compatible

    class Method(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.student = torch.nn.Linear(2, 2)

    method = Method()
    here = describe_run(method)
    ok = {"distill": here, "state_dict": method.state_dict()}
    _check_compatible(ok, "ok.ckpt", method)
    other = {**ok, "distill": {**here, "method": "distill.methods.progressive.ProgressiveDistillation"}}
    with pytest.raises(ValueError, match="other.ckpt was written by method distill.methods.progressive"):
        _check_compatible(other, "other.ckpt", method)
    wider = {**ok, "state_dict": {**ok["state_dict"], "student.weight": torch.zeros(3, 2)}}
    with pytest.raises(ValueError, match=r"wider.ckpt does not fit this student: student.weight has shape \(3, 2\)"):
        _check_compatible(wider, "wider.ckpt", method)


# ---------------------------------------------------------------- EMA: once per optimizer step


def test_ema_callback_updates_once_per_optimizer_step_with_its_images():
    """5 batches of 2 images per epoch, 2 micro-batches per step: Lightning steps after batches 2, 4 and 5 of each
    epoch, so 6 steps in 2 epochs of 4, 4 and 2 images; the EMA must follow exactly those steps."""
    import lightning as L

    from distill.callbacks.ema import EMA

    class Toy(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.student = torch.nn.Linear(1, 1, bias=False)
            torch.nn.init.zeros_(self.student.weight)
            self.after_step: list[float] = []

        def training_step(self, batch, batch_idx):
            return (self.student(batch["pixel_values"]) - 1).pow(2).mean()

        def optimizer_step(self, *args, **kwargs):
            super().optimizer_step(*args, **kwargs)
            self.after_step.append(self.student.weight.item())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    loader = torch.utils.data.DataLoader([{"pixel_values": torch.ones(2, 1)}] * 5, batch_size=None)
    toy, ema = Toy(), EMA(half_life_images=4, rampup_ratio=None)
    trainer = L.Trainer(max_epochs=2, accumulate_grad_batches=2, callbacks=[ema], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(toy, loader)
    assert trainer.global_step == len(toy.after_step) == 6 and ema.seen_images == 20
    expected = 0.0
    for weight, images in zip(toy.after_step, [4, 4, 2, 4, 4, 2]):  # EDM: beta = 0.5 ** (images / half-life)
        beta = 0.5 ** (images / 4)
        expected = beta * expected + (1 - beta) * weight
    assert ema.ema.weight.item() == pytest.approx(expected, rel=1e-6)


def test_preemption_under_accumulation_saves_at_the_step_boundary(tmp_path):
    """A signal during the first micro-batch of a window: the checkpoint waits for the window's optimizer step (a
    checkpoint inside the window would lose the micro-batch gradients accumulated so far)."""
    import lightning as L

    from distill.callbacks.resilience import Preemption

    preemption = Preemption()

    class Toy(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.student = torch.nn.Linear(1, 1)

        def training_step(self, batch, batch_idx):
            if batch_idx == 2:  # the first micro-batch of the second optimizer step
                preemption.received = signal.SIGTERM
            return self.student(batch).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    loader = torch.utils.data.DataLoader([torch.ones(2, 1)] * 8, batch_size=None)
    trainer = L.Trainer(max_epochs=1, accumulate_grad_batches=2, callbacks=[preemption], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path)
    with pytest.raises(Preempted, match="preempted at step 2"):
        trainer.fit(Toy(), loader)
    saved = safe_load(tmp_path / "last.ckpt")
    assert trainer.global_step == saved["global_step"] == 2  # after batch 4 of 8


def test_after_a_preemption_signal_only_the_checkpoint_runs(tmp_path):
    """The step that sees the signal saves last.ckpt and the fit ends there: no validation pass (Lightning runs one
    after should_stop is set), no on_train_end hook (the quality-cost callback's final sweep, a method's export)."""
    import lightning as L

    from distill.callbacks.resilience import Preemption

    preemption, events = Preemption(), []

    class Recorder(L.Callback):
        def on_validation_start(self, trainer, pl_module):
            events.append(("validation", trainer.global_step))

        def on_train_end(self, trainer, pl_module):
            events.append(("train_end", trainer.global_step))

    class Toy(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.student = torch.nn.Linear(1, 1)

        def training_step(self, batch, batch_idx):
            if batch_idx == 2:  # the third step
                preemption.received = signal.SIGTERM
            return self.student(batch).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            return self.student(batch).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    loader = torch.utils.data.DataLoader([torch.ones(2, 1)] * 8, batch_size=None)
    trainer = L.Trainer(max_steps=8, val_check_interval=1, num_sanity_val_steps=0, callbacks=[Recorder(), preemption],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    with pytest.raises(Preempted, match="preempted at step 3"):
        trainer.fit(Toy(), loader, loader)
    assert safe_load(tmp_path / "last.ckpt")["global_step"] == 3
    assert events == [("validation", 1), ("validation", 2)]  # nothing after the save at step 3


def test_a_fresh_start_never_overwrites_the_checkpoints_of_a_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    first = run_train(*COMMON, "trainer.max_steps=2", "logger=csv", f"hydra.run.dir={run_dir}")
    assert first.returncode == 0, first.stderr[-3000:]
    overrides = (run_dir / ".hydra" / "overrides.yaml").read_text()  # written once the launch passed its checks
    assert "trainer.max_steps=2" in overrides and "exp_name: debug" in (run_dir / ".hydra" / "config.yaml").read_text()
    before = {p: p.read_bytes() for p in [*(run_dir / "checkpoints").iterdir(), *(run_dir / ".hydra").iterdir()]}
    again = run_train(*COMMON, "trainer.max_steps=2", "seed=1", "logger=csv", f"hydra.run.dir={run_dir}")  # no ckpt_path
    assert again.returncode == 2
    assert "ckpt_path=last" in again.stderr and "hydra.run.dir" in again.stderr
    assert {p: p.read_bytes() for p in [*(run_dir / "checkpoints").iterdir(), *(run_dir / ".hydra").iterdir()]} == before


# ---------------------------------------------------------------- validation on a checkpoint step


def test_evaluation_loaders_leave_the_global_rng_alone(tmp_path):
    """A pass over a DataLoader without a generator of its own draws its base seed from the global torch RNG; a
    validation pass right after a checkpoint would then move the RNG past the state the checkpoint holds."""
    from distill.data import ImageFolderDataModule, WebDatasetDataModule
    from distill.worlds.digits.data import DigitsDataModule
    from tests.test_data import _png_bytes, _write_shard

    for i in range(4):
        (tmp_path / f"img{i}.png").write_bytes(_png_bytes(50 * i))
    _write_shard(tmp_path / "shard-000.tar", 0, 4)
    modules = [DigitsDataModule(resolution=8, eval_batch_size=256),
               ImageFolderDataModule(root=str(tmp_path), resolution=8, heldout_fraction=0.5, eval_batch_size=1),
               WebDatasetDataModule(urls=str(tmp_path / "shard-000.tar"), resolution=8, channels=1, eval_batch_size=2)]
    for module in modules:
        module.setup("fit")
        before = torch.manual_seed(0).get_state()
        batches = sum(1 for _ in module.val_dataloader())
        assert batches == 2 and torch.equal(torch.get_rng_state(), before), type(module).__name__


# the default experiment (+exp=consistency) with its callbacks on (sample grids, learning-rate monitor, quality-cost
# sweep), shrunk; validation and checkpoints on the same steps, as in every shipped experiment
N_DEMO = 5  # not a multiple of the checkpoint interval: the final step is checkpointed on its own
DEMO = ["+exp=consistency", "data.batch_size=8", f"trainer.max_steps={N_DEMO}",
        f"method.lr_scheduler.total_steps={N_DEMO}", "method.lr_scheduler.warmup_steps=2",
        "trainer.val_check_interval=2", "checkpoint.every_n_train_steps=2", "checkpoint.save_top_k=-1",
        "trainer.limit_val_batches=1", "data.eval_batch_size=8", "callbacks.samples.num_seeds=1",
        "callbacks.quality_cost.num_per_class=1", "callbacks.quality_cost.steps=[1]",
        "callbacks.quality_cost.teacher_steps=[1]", "callbacks.quality_cost.teacher_schedulers=[ddim]",
        "callbacks.progress=null", "trainer.log_every_n_steps=1", "export=false", "sample_grid_seeds=0"]


@pytest.fixture(scope="module")
def straight_demo(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight_demo") / "run"
    proc = run_train(*DEMO, "logger=csv", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.mark.slow  # ~2 min for its three runs; the loaders' own generators are tested above in seconds
def test_sigkill_after_a_checkpoint_with_validation_on_its_step_then_resume(straight_demo, tmp_path):
    """Killed after the step-2 checkpoint (validation runs right after it, at the same step): the resumed run
    ends bit-identical to the unbroken one, its final step 5 checkpointed."""
    run_dir = tmp_path / "run"
    proc = _popen(run_dir, base=DEMO)
    _wait_for(run_dir / "checkpoints" / "step_0000002.ckpt", proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert not (run_dir / "checkpoints" / "step_0000004.ckpt").exists()  # killed before step 4
    again = run_train(*DEMO, "ckpt_path=last", "logger=csv", f"hydra.run.dir={run_dir}")
    assert again.returncode == 0, again.stderr[-3000:]
    _assert_same_run(straight_demo, run_dir, N_DEMO)


@pytest.mark.slow  # ~40 s; test_after_a_preemption_signal_only_the_checkpoint_runs covers it in-process
def test_a_preempted_default_run_saves_and_exits_without_evaluating_or_exporting(tmp_path):
    run_dir = tmp_path / "run"
    proc = _popen(run_dir, base=[o for o in DEMO if o != "export=false"])
    _wait_for(run_dir / "checkpoints" / "step_0000002.ckpt", proc)
    proc.send_signal(signal.SIGTERM)
    start = time.time()
    while not (run_dir / "checkpoints" / "last.ckpt").exists() or safe_load(
            run_dir / "checkpoints" / "last.ckpt")["global_step"] < 3:  # the preemption save, at step 3 or later
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() - start < 120
        time.sleep(0.05)
    saved_at = time.time()
    out, err = proc.communicate(timeout=120)
    exit_s = time.time() - saved_at
    if proc.returncode == 0:
        pytest.skip("signal arrived after the final step")
    assert proc.returncode == 75, err[-3000:]
    assert exit_s < 15, f"{exit_s:.1f} s from the save to the exit"
    # no final quality-cost sweep (it would write quality_cost.csv and load the teacher), no export
    assert not (run_dir / "quality_cost.csv").exists() and not (run_dir / "export").exists()
    step = safe_load(run_dir / "checkpoints" / "last.ckpt")["global_step"]
    assert not (run_dir / "samples" / f"step_{step:07d}.png").exists()  # no validation pass after the save
