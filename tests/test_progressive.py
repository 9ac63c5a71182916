"""Progressive distillation: round hand-over, resume inside a round, bad input."""

import json
import shutil

import pytest
import torch

from distill.methods.progressive import ProgressiveDistillation
from distill.models.students import copy_student
from distill.models.teacher import load_teacher
from tests.conftest import run_train
from tests.sd_tiny import write_tiny_sd


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory):
    return write_tiny_sd(tmp_path_factory.mktemp("sd") / "pipe")


def test_round_hand_over(tiny_sd):
    method = ProgressiveDistillation(load_teacher(str(tiny_sd)), lambda u: copy_student(u), torch.optim.AdamW,
                                     start_steps=8, final_steps=2, steps_per_round=5)
    assert method.rounds == [4, 2] and method.student_steps == 4 and method.guidance_scale == 3.0
    assert method.round_of(4) == 0 and method.round_of(5) == 1 and method.round_of(99) == 1
    with torch.no_grad():
        next(method.student.parameters()).add_(1.0)  # the student has moved away from the first teacher
    method.finish_round()
    assert method.round_index == 1 and method.student_steps == 2
    assert method.teacher_unet is not method.student and method.guidance_scale == 1.0
    assert method.teacher_prediction_type == "v_prediction"
    for a, b in zip(method.teacher_unet.parameters(), method.student.parameters()):
        assert torch.equal(a, b) and not a.requires_grad


def test_resume_inside_a_round_continues_that_round(tiny_sd, tmp_path):
    common = ["+exp=progressive", f"teacher.pretrained_model_name_or_path={tiny_sd}", "data.batch_size=8",
              "method.start_steps=8", "method.final_steps=2", "method.steps_per_round=3", "trainer.limit_val_batches=1",
              "trainer.val_check_interval=100", "checkpoint.every_n_train_steps=4", "logger=csv", "export=false"]
    run_dir = tmp_path / "run"
    first = run_train(*common, "trainer.max_steps=4", f"hydra.run.dir={run_dir}")
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["progressive"]["round_index"] == 1 and ckpt["global_step"] == 4
    assert any(k.startswith("teacher_unet.") for k in ckpt["state_dict"])  # round 2's teacher is a trained student
    second = run_train(*common, "trainer.max_steps=5", "ckpt_path=last", f"hydra.run.dir={run_dir}")
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert resumed["global_step"] == 5 and resumed["progressive"]["round_index"] == 1
    for key, value in ckpt["state_dict"].items():
        if key.startswith("teacher_unet."):  # the round's teacher came back unchanged
            torch.testing.assert_close(resumed["state_dict"][key], value)
    assert sorted(p.name for p in (run_dir / "rounds").iterdir()) == ["002-steps", "004-steps"]


@pytest.mark.parametrize("overrides, needle", [
    (["method.start_steps=48", "method.final_steps=4"], "not powers of two apart"),
    (["method.start_steps=4", "method.final_steps=8"], "must be below the start"),
])
def test_bad_step_counts(tiny_sd, tmp_path, overrides, needle):
    proc = run_train("+exp=progressive", f"teacher.pretrained_model_name_or_path={tiny_sd}", *overrides,
                     "logger=csv", f"hydra.run.dir={tmp_path / 'run'}", timeout=120)
    assert proc.returncode == 2 and needle in proc.stderr and not (tmp_path / "run").exists()


def test_teacher_without_ddim_schedule_is_rejected(tiny_sd, tmp_path):
    bad = tmp_path / "flow"
    shutil.copytree(tiny_sd, bad)
    cfg_file = bad / "scheduler" / "scheduler_config.json"
    cfg = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}
    cfg_file.write_text(json.dumps(cfg))
    proc = run_train("+exp=progressive", f"teacher.pretrained_model_name_or_path={bad}", "logger=csv",
                     f"hydra.run.dir={tmp_path / 'run'}", timeout=120)
    assert proc.returncode == 2 and "DDIM-compatible" in proc.stderr
