"""Networks and optimizers by role (``DistillMethod.add_role``), shown by the two-optimizer example method through
the real Trainer and callbacks: one step is one student update, whatever the critic's ratio; resume after SIGKILL
is bit-identical for every role; a non-finite critic update skips the critic only; the EMA follows the student."""

from __future__ import annotations

import csv
import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from distill.methods.base import DistillMethod, warmup_cosine
from distill.utils.checkpoint import safe_load
from tests.conftest import ROOT
from tests.examples.two_optimizer_method import (
    TwoOptimizerMethod,
    fit,
    method_from_config,
    tiny_generator,
)
from tests.test_resilience import _assert_same_state

BATCH = 16  # the example's digits batch


def _metrics(run_dir: Path) -> list[dict]:
    return list(csv.DictReader(open(run_dir / "csv" / "metrics.csv")))


class Recorder(L.Callback):
    """Each role's weights after each of its optimizer steps (skipped or not), and the student's at the start."""

    def __init__(self):
        self.after: dict[str, list] = {"student": [], "critic": []}
        self.initial: list[torch.Tensor] = []

    def on_train_start(self, trainer, pl_module):
        self.initial = [p.detach().clone() for p in pl_module.student.parameters()]
        for name, optimizer in zip(pl_module.roles, trainer.optimizers):
            network, into = getattr(pl_module, name), self.after[name]
            optimizer.register_step_post_hook(
                lambda *_, network=network, into=into: into.append([p.detach().clone() for p in network.parameters()]))


def _fit_recorded(tmp_path: Path, steps: int, k: int, *callbacks: L.Callback, **options):
    recorder = Recorder()
    method, trainer = fit(tmp_path / "run", steps, k, callbacks=(recorder, *callbacks), **options)
    return method, trainer, recorder


def _callback(trainer, kind: str):
    return next(c for c in trainer.callbacks if type(c).__name__ == kind)


def test_the_method_registered_from_one_file_trains_from_the_command_line(tmp_path):
    """``DISTILL_PLUGINS=tests.examples.two_optimizer_method python -m distill.train method=two_optimizer
    student=tiny_generator``: the example file registers the method and its student, and ``distill.train`` runs both
    roles with their own optimizers: 5 steps at 2 critic updates a step are 5 student and 10 critic updates."""
    adam = "{_target_:torch.optim.Adam,_partial_:true,lr:0.001}"
    args = ["method=two_optimizer", "student=tiny_generator", "teacher=none", "data.resolution=8", f"data.batch_size={BATCH}",
            "trainer.max_steps=5", f"method.optimizer={adam}", f"method.critic_optimizer={adam}",
            "method.critic_updates_per_step=2", "export=false", "sample_grid_seeds=0", "logger=csv",
            f"hydra.run.dir={tmp_path}"]
    env = {**os.environ, "DISTILL_PLUGINS": "tests.examples.two_optimizer_method", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "distill.train", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert state["global_step"] == 5 and state["role_updates"] == {"student": 5, "critic": 10}
    assert [float(o["state"][0]["step"]) for o in state["optimizer_states"]] == [5.0, 10.0]
    assert any(k.startswith("critic.") for k in state["state_dict"])


def test_reduce_lr_on_plateau_steps_on_each_roles_own_loss(tmp_path):
    """A ``ReduceLROnPlateau`` schedule (which needs a metric) per role: each steps once per training step on its
    role's loss, so replaying the logged losses through fresh schedules gives the trained optimizers' LRs."""
    plateau = {"_target_": "torch.optim.lr_scheduler.ReduceLROnPlateau", "_partial_": True, "patience": 0,
               "factor": 0.5, "threshold": 0.0}
    method, trainer = fit(tmp_path / "run", 6, 1, lr_scheduler=plateau, critic_lr_scheduler={**plateau, "mode": "max"})
    rows = [r for r in _metrics(tmp_path / "run") if r.get("train/loss")]
    for key, optimizer, mode in (("train/loss", trainer.optimizers[0], "min"),
                                 ("train/critic_loss", trainer.optimizers[1], "max")):
        replay = torch.optim.lr_scheduler.ReduceLROnPlateau(
            torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3), mode=mode, patience=0, factor=0.5,
            threshold=0.0)
        losses = [float(r[key]) for r in rows]
        assert len(losses) == 6
        for loss in losses:
            replay.step(loss)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(replay.get_last_lr()[0], rel=1e-12), key
    assert trainer.optimizers[1].param_groups[0]["lr"] < 1e-3 / 2  # the critic's falling loss cut it (mode max)


@pytest.mark.slow
def test_several_roles_train_data_parallel_from_the_command_line(tmp_path):
    """``trainer=cpu_ddp`` (2 gloo processes, each its own half of the data): every role's gradients are averaged
    over the ranks at each update, so both ranks end with the same weights bit for bit, although they saw
    different batches; 3 steps at 2 critic updates a step are 3 student and 6 critic updates on each rank."""
    adam = "{_target_:torch.optim.Adam,_partial_:true,lr:0.001}"
    args = ["method=two_optimizer", "student=tiny_generator", "teacher=none", "data.resolution=8", f"data.batch_size={BATCH}",
            "trainer=cpu_ddp", "trainer.max_steps=3", f"method.optimizer={adam}", f"method.critic_optimizer={adam}",
            "method.critic_updates_per_step=2", "export=false", "sample_grid_seeds=0", "logger=csv",
            "callbacks.samples=null", f"hydra.run.dir={tmp_path}"]
    env = {**os.environ, "DISTILL_PLUGINS": "tests.examples.two_optimizer_method", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "distill.train", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert state["global_step"] == 3 and state["role_updates"] == {"student": 3, "critic": 6}
    # the example as a script saves each rank's final weights: equal across ranks with different data
    run = tmp_path / "script"
    run.mkdir()
    proc = subprocess.run([sys.executable, "-m", "tests.examples.two_optimizer_method", str(run), "3", "2", "ddp:2:split"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0, rank1 = (torch.load(run / f"state_rank{r}.pt") for r in (0, 1))
    assert rank0.pop("role_updates") == rank1.pop("role_updates") == {"student": 3, "critic": 6}
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)
    single, _ = fit(tmp_path / "single", 3, 2)  # one process on the whole batches: other data, other weights
    assert not torch.equal(single.student[0].weight, rank0["student.0.weight"])


def test_a_critic_ratio_of_k_steps_the_critic_k_times_per_student_update_and_max_steps_counts_students(tmp_path):
    steps, k = 5, 3
    from lightning.pytorch.callbacks import LearningRateMonitor

    method, trainer, recorder = _fit_recorded(tmp_path, steps, k, LearningRateMonitor("step"))
    assert trainer.global_step == steps and method.role_updates == {"student": steps, "critic": k * steps}
    assert len(recorder.after["student"]) == steps and len(recorder.after["critic"]) == k * steps
    student_opt, critic_opt = trainer.optimizers
    assert {int(s["step"]) for s in student_opt.state.values()} == {steps}  # Adam's own count of its updates
    assert {int(s["step"]) for s in critic_opt.state.values()} == {k * steps}
    # each LR schedule steps once per student update: StepLR(3, 0.5) after 5 steps, warm-up + cosine at step 5
    assert critic_opt.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.5)
    factor = warmup_cosine(torch.optim.SGD([torch.zeros(1)], lr=1.0), 2, 10).lr_lambdas[0](steps)
    assert student_opt.param_groups[0]["lr"] == pytest.approx(1e-3 * factor)
    # checkpoint names and the loggers' steps count student updates
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*.ckpt"))
    assert names == [f"step_{i:07d}.ckpt" for i in range(1, steps + 1)]
    rows = [r for r in _metrics(tmp_path / "run") if r.get("train/critic_loss")]
    assert [int(r["step"]) for r in rows] == list(range(steps)) and all(r["train/loss"] for r in rows)
    lrs = {int(r["step"]): float(r["lr-critic"]) for r in _metrics(tmp_path / "run") if r.get("lr-critic")}
    assert lrs == {0: 1e-3, 1: 1e-3, 2: 1e-3, 3: 5e-4, 4: 5e-4}  # the LR monitor logs each role's by its name
    assert safe_load(tmp_path / "run" / "checkpoints" / "last.ckpt")["role_updates"] == {"student": 5, "critic": 15}


def test_the_ema_follows_the_student_updates_only(tmp_path):
    steps, k, half_life = 4, 3, 64
    method, trainer, recorder = _fit_recorded(tmp_path, steps, k, ema_half_life_images=half_life)
    ema = _callback(trainer, "EMA")
    assert ema.updates == steps == trainer.global_step and ema.seen_images == steps * BATCH
    beta = 0.5 ** (BATCH / half_life)  # EDM: 0.5 ** (images / half-life), no ramp-up
    expected = [p.double() for p in recorder.initial]
    for weights in recorder.after["student"]:
        expected = [beta * e + (1 - beta) * w.double() for e, w in zip(expected, weights)]
    for e, got in zip(expected, ema.ema.parameters()):
        torch.testing.assert_close(got.double(), e, rtol=0, atol=1e-6)
    # and not the live weights (4 updates at beta ~0.84 leave the EMA well behind them)
    assert max((a - b).abs().max().item() for a, b in zip(ema.ema.parameters(), method.student.parameters())) > 1e-3


def test_a_nonfinite_critic_update_skips_the_critic_step_only(tmp_path, caplog):
    steps, k = 3, 3
    with caplog.at_level("WARNING", logger="distill.callbacks.resilience"):
        method, trainer, recorder = _fit_recorded(tmp_path, steps, k, nonfinite_critic_at_updates=(4,))
    critic, student = recorder.after["critic"], recorder.after["student"]
    same = [all(torch.equal(a, b) for a, b in zip(critic[i - 1], critic[i])) for i in range(1, k * steps)]
    assert same == [i == 4 for i in range(1, k * steps)]  # update 4 (step 1's second) left the critic as it was
    assert not any(all(torch.equal(a, b) for a, b in zip(x, y)) for x, y in zip(student, student[1:]))
    critic_opt = trainer.optimizers[1]
    assert {int(s["step"]) for s in critic_opt.state.values()} == {k * steps - 1}  # Adam's moments skipped it too
    guard = _callback(trainer, "NonFiniteGuard")
    assert guard.skipped == 0 and guard.role_skipped == {"critic": 1} and guard.role_consecutive == {"critic": 0}
    assert "non-finite critic loss or gradient at step 1: that critic update skipped" in caplog.text
    logged = {int(r["step"]): float(r["train/nonfinite_skipped_critic"]) for r in _metrics(tmp_path / "run")
              if r.get("train/nonfinite_skipped_critic")}
    assert min(logged) == 1 and set(logged.values()) == {1.0}  # the running count, from the step it happened
    state = safe_load(tmp_path / "run" / "checkpoints" / "last.ckpt")["callbacks"]
    assert next(v for key, v in state.items() if key.startswith("NonFiniteGuard"))["roles"]["skipped"] == {"critic": 1}


def test_each_roles_update_is_clipped_at_the_trainers_gradient_clip_val():
    """Norms of the gradients each optimizer steps with, read where Lightning's own clipping would have run."""
    norms: list[tuple[str, float]] = []

    class Clipped(TwoOptimizerMethod):
        def on_before_optimizer_step(self, optimizer):
            super().on_before_optimizer_step(optimizer)  # clips
            grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
            norms.append((self.role_of(optimizer), torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(g) for g in grads])).item()))

    adam = functools.partial(torch.optim.Adam, lr=1e-3)
    method = Clipped(tiny_generator(), adam, adam, critic_updates_per_step=2)
    assert method.adopt_trainer_settings(1e-4, "norm") == {"gradient_clip_val": None, "gradient_clip_algorithm": None}
    loader = torch.utils.data.DataLoader([{"pixel_values": torch.randn(BATCH, 1, 8, 8)}] * 3, batch_size=None)
    trainer = L.Trainer(max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(method, loader)
    assert [role for role, _ in norms] == ["critic", "critic", "student"] * 3
    assert all(norm == pytest.approx(1e-4, rel=1e-3) for _, norm in norms)  # every update clipped to norm 1e-4


def test_bad_role_settings_name_the_key_and_the_fix():
    with pytest.raises(ValueError, match=r"method.critic_updates_per_step=0 must be an integer >= 1"):
        method_from_config(0)
    with pytest.raises(ValueError, match=r"trainer.accumulate_grad_batches=2: TwoOptimizerMethod trains several roles "
                                         r"\(student, critic\).*set trainer.accumulate_grad_batches=1"):
        method_from_config(1).adopt_trainer_settings(1.0, None, 2)

    class NoLoss(TwoOptimizerMethod):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.add_role("discriminator", self.optimizer_factory)

    with pytest.raises(TypeError, match="declares the role 'discriminator' but defines no discriminator_loss"):
        NoLoss(tiny_generator(), torch.optim.Adam, torch.optim.Adam)
    with pytest.raises(ValueError, match="role 'critic' is already declared"):
        method_from_config(1).add_role("critic", torch.optim.Adam)
    from lightning.pytorch.strategies import DDPStrategy

    method = method_from_config(1)
    method._trainer = type("DataParallel", (), {"world_size": 2, "strategy": DDPStrategy()})()
    with pytest.raises(ValueError, match=r"over 2 processes with DDPStrategy.*use "
                                         r"trainer.strategy=ddp_find_unused_parameters_true"):
        method.configure_optimizers()
    method._trainer.strategy = DDPStrategy(find_unused_parameters=True)
    optimizers, _ = method.configure_optimizers()
    assert len(optimizers) == 2


def test_several_roles_adopt_ddp_that_finds_unused_parameters_and_refuse_sharding(compose):
    """``trainer=ddp`` becomes DDP that finds unused parameters (each role's backward reaches only its network);
    ``trainer=fsdp`` is refused at validation, before any model is built, naming the roles and the fix."""
    from distill.config.validate import ConfigError, method_roles, validate

    method = method_from_config(1)
    assert method.adopt_trainer_settings(1.0, None, 1, "ddp")["strategy"] == "ddp_find_unused_parameters_true"
    assert "strategy" not in method.adopt_trainer_settings(1.0, None, 1, "auto")
    adam = "{_target_:torch.optim.Adam,_partial_:true,lr:0.001}"
    args = ["method=two_optimizer", "student=tiny_generator", "teacher=none", "data.resolution=8",
            f"method.optimizer={adam}", f"method.critic_optimizer={adam}"]
    assert method_roles(compose(*args).method) == ["student", "critic"]
    assert method_roles(compose().method) == ["student"]
    with pytest.raises(ConfigError, match=r"trainer=fsdp with method .*TwoOptimizerMethod, which trains several roles "
                                          r"\(student, critic\).*use trainer=ddp"):
        validate(compose(*args, "trainer=cpu_fsdp"))


def test_a_student_alone_keeps_lightnings_automatic_optimization():
    class StudentOnly(DistillMethod):
        def __init__(self):
            super().__init__(functools.partial(torch.optim.SGD, lr=0.1))
            self.student = torch.nn.Linear(2, 2)

    method = StudentOnly()
    assert method.automatic_optimization and list(method.roles) == ["student"]
    assert isinstance(method.configure_optimizers(), torch.optim.SGD)  # one optimizer, as before roles existed
    assert method.adopt_trainer_settings(1.0, None, 4) == {} and method.gradient_clip_val is None
    method.lr_scheduler_factory = functools.partial(torch.optim.lr_scheduler.ReduceLROnPlateau, patience=0)
    assert method.configure_optimizers()["lr_scheduler"]["monitor"] == "train/loss"  # Lightning steps it on the loss
    two = method_from_config(1)
    assert not two.automatic_optimization and list(two.roles) == ["student", "critic"]


def _popen(run_dir: Path, steps: int, k: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "tests.examples.two_optimizer_method", str(run_dir), str(steps),
                             str(k), *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _assert_same_run(straight: Path, resumed: Path, steps: int, k: int) -> None:
    """The last checkpoints of both runs hold the same bits for every role, and the logs the same loss curves."""
    a, b = (safe_load(d / "checkpoints" / "last.ckpt") for d in (straight, resumed))
    assert a["global_step"] == b["global_step"] == steps
    assert a["role_updates"] == b["role_updates"] == {"student": steps, "critic": k * steps}
    assert any(key.startswith("critic.") for key in a["state_dict"]) and len(a["optimizer_states"]) == 2
    for key in ("state_dict", "optimizer_states", "lr_schedulers", "role_updates"):
        _assert_same_state(a[key], b[key], key)
    for name in [key for key in a["callbacks"] if key.startswith(("EMA", "NonFiniteGuard"))]:
        _assert_same_state(a["callbacks"][name], b["callbacks"][name], name)
    # the whole loss curve of both roles, to the last printed digit (a resumed step logged again overwrites)
    curves = [{int(r["step"]): (r["train/loss"], r["train/critic_loss"]) for r in _metrics(d) if r.get("train/loss")}
              for d in (straight, resumed)]
    assert len(curves[0]) == steps and curves[0] == curves[1]


def test_a_stopped_run_resumed_mid_epoch_is_bit_identical_for_every_role(tmp_path):
    steps, k = 6, 2
    fit(tmp_path / "straight", steps, k)
    fit(tmp_path / "resumed", 3, k)
    fit(tmp_path / "resumed", steps, k, resume=True)
    _assert_same_run(tmp_path / "straight", tmp_path / "resumed", steps, k)


@pytest.mark.slow  # about 45 s: three processes; the default suite resumes a stopped run (above)
def test_resume_after_sigkill_is_bit_identical_for_every_role(tmp_path):
    steps, k = 30, 2
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    proc = _popen(straight, steps, k)
    victim = _popen(killed, steps, k)
    start = time.time()
    while not (killed / "checkpoints" / "step_0000005.ckpt").exists():
        assert victim.poll() is None, victim.communicate()[1][-3000:]
        assert time.time() - start < 180
        time.sleep(0.005)
    victim.send_signal(signal.SIGKILL)  # wherever it is: inside step 6 or after, or writing its checkpoint
    victim.communicate()
    assert victim.returncode == -signal.SIGKILL
    assert proc.wait(timeout=300) == 0, proc.communicate()[1][-3000:]
    resumed = _popen(killed, steps, k, "resume")
    assert resumed.wait(timeout=300) == 0, resumed.communicate()[1][-3000:]
    _assert_same_run(straight, killed, steps, k)
