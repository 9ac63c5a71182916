"""Progressive distillation: round hand-over, resume inside a round, bad input."""

import json
import shutil

import pytest
import torch

from distill.diffusion import guidance_condition
from distill.families import load_teacher
from distill.methods.progressive import ProgressiveDistillation
from distill.students.copies import copy_student
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


@pytest.mark.slow  # over 30 s: in `make test-all`, out of the 15-minute default suite (stop 26)
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
    assert proc.returncode == 2 and "FlowMatchEulerDiscreteScheduler (flow matching)" in proc.stderr


def _w_method(tiny_sd, **kw):
    return ProgressiveDistillation(load_teacher(str(tiny_sd)), lambda u: copy_student(u, time_cond_proj_dim=8),
                                   torch.optim.AdamW, start_steps=8, final_steps=2, steps_per_round=5,
                                   guided_stage_steps=3, guidance_scale_min=2.0, guidance_scale_max=4.0, **kw)


def test_guided_stage_comes_first_then_rounds_keep_w_as_input(tiny_sd):
    method = _w_method(tiny_sd)
    assert method.round_index == -1 and method.student_steps == 8  # the stage runs at the teacher's step count
    assert [method.round_of(s) for s in (0, 2, 3, 7, 8, 99)] == [-1, -1, 0, 0, 1, 1]
    teacher = method.teacher_unet
    method.finish_round()
    assert method.round_index == 0 and method.student_steps == 4 and method.guidance_scale == 1.0
    assert method.teacher_unet is not teacher and method.teacher_unet.config.time_cond_proj_dim == 8


def test_guided_stage_target_is_the_per_sample_cfg_of_the_teacher(tiny_sd):
    method = _w_method(tiny_sd)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 8, 8, generator=g)
    t = torch.tensor([999, 499, 124])
    cond, uncond = torch.randn(3, 7, 32, generator=g), torch.randn(3, 7, 32, generator=g)
    scale = torch.tensor([2.0, 3.0, 4.0])
    x0, eps = method._teacher_x0_eps(x, t, {"encoder_hidden_states": cond}, {"encoder_hidden_states": uncond}, scale, {})
    a, s = method.schedule.alpha_sigma(t, 4)
    for k in range(3):  # CFG computed directly, one sample at a time, in the teacher's eps space
        with torch.no_grad():
            e_c = method.teacher_unet(x[k:k + 1], t[k:k + 1], encoder_hidden_states=cond[k:k + 1]).sample
            e_u = method.teacher_unet(x[k:k + 1], t[k:k + 1], encoder_hidden_states=uncond[k:k + 1]).sample
        e = e_u + scale[k] * (e_c - e_u)
        torch.testing.assert_close(eps[k:k + 1], e, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x0[k:k + 1], (x[k:k + 1] - s[k] * e) / a[k], rtol=1e-4, atol=1e-4)


def test_w_embedding_is_what_the_exported_pipeline_feeds(tiny_sd, tmp_path):
    from diffusers import StableDiffusionPipeline

    method = _w_method(tiny_sd)
    with torch.no_grad():
        method.student.time_embedding.cond_proj.weight.normal_()  # make w matter
    out = method.export(tmp_path / "w")
    info = json.loads((out / "distill.json").read_text())
    assert info["w_conditioned"] and info["sampling"]["guidance_scale"] == 3.0
    pipe = StableDiffusionPipeline.from_pretrained(out, safety_checker=None)
    pipe.set_progress_bar_config(disable=True)
    seen = []
    pipe.unet.register_forward_hook(lambda m, a, kw, o: seen.append((a[0].shape[0], kw["timestep_cond"])),
                                    with_kwargs=True)
    pipe(["a", "b"], num_inference_steps=2, guidance_scale=3.0, height=16, width=16, output_type="pt",
         generator=torch.Generator().manual_seed(0))
    assert len(seen) == 2 and all(n == 2 for n, _ in seen)  # one evaluation per step: no CFG batch
    expected = guidance_condition(torch.tensor([3.0, 3.0]) - 1.0, method.w_dim, seen[0][1])["timestep_cond"]
    torch.testing.assert_close(seen[0][1], expected)


def test_guided_stage_run_exports_every_round(tiny_sd, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train("+exp=progressive_w", f"teacher.pretrained_model_name_or_path={tiny_sd}", "data.batch_size=8",
                     "student.time_cond_proj_dim=8", "method.start_steps=8", "method.final_steps=2",
                     "method.steps_per_round=2", "trainer.max_steps=6", "trainer.limit_val_batches=1",
                     "trainer.val_check_interval=100", "callbacks.quality_cost=null", "logger=csv", "export=false",
                     f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (run_dir / "rounds").iterdir()) == ["002-steps", "004-steps", "008-steps"]
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["progressive"]["round_index"] == 1 and ckpt["global_step"] == 6


def test_guided_stage_needs_a_w_conditioned_student(tiny_sd, tmp_path):
    proc = run_train("+exp=progressive_w", f"teacher.pretrained_model_name_or_path={tiny_sd}",
                     "student.time_cond_proj_dim=null", "logger=csv", f"hydra.run.dir={tmp_path / 'run'}", timeout=120)
    assert proc.returncode == 2 and "time_cond_proj_dim" in proc.stderr and not (tmp_path / "run").exists()


def _visited_pair(scheduler, t, abar):
    """(t, t_prev) of one deterministic step, read off the step itself: with v-prediction, probes (x, v) = (1, 0)
    and (0, 1) give a_t a' + s_t s' and a_t s' - s_t a', whence a' = sqrt(abar(t_prev)); T means clean."""
    a, s = abar[t].sqrt(), (1 - abar[t]).sqrt()
    one, zero = torch.ones(1, 1, 1, 1), torch.zeros(1, 1, 1, 1)
    p = scheduler.step(zero, t, one).prev_sample.item()
    q = scheduler.step(one, t, zero).prev_sample.item()
    a_prev = a * p - s * q  # solves [[a, s], [-s, a]] [a', s'] = [p, q]
    t_prev = int((abar - a_prev ** 2).abs().argmin())
    assert abs(abar[t_prev].item() - a_prev.item() ** 2) < 1e-5
    return int(t), t_prev


def test_exported_scheduler_visits_the_training_pairs_for_every_step_count(tiny_sd):
    """Issue 12 item 6: at every N a round can use, the (t, t_prev) pairs the exported pipeline's scheduler steps
    between are the pairs the student is trained on (t_i = floor(i T / N) - 1), and the last lands on the clean
    sample (diffusers' DDIM rounds i T / N and steps t - T // N: off by one at N = 16, 32, 64)."""
    method = ProgressiveDistillation(load_teacher(str(tiny_sd)), lambda u: copy_student(u), torch.optim.AdamW,
                                     start_steps=8, final_steps=2)
    scheduler = method.pipeline().scheduler
    T = method.num_train_timesteps
    for steps in range(1, 65):
        i = torch.arange(steps, 0, -1)
        # student step i -> i - 1 = teacher steps 2i -> 2i - 2 on the grid twice as fine (ProgressiveDistillation.loss)
        trained = list(zip(method._times(2 * i, 2 * steps).tolist(), method._times(2 * i - 2, 2 * steps).tolist()))
        scheduler.set_timesteps(steps)
        visited = [_visited_pair(scheduler, t, method.schedule.abar) for t in scheduler.timesteps]
        assert visited == trained, steps
        assert visited[-1][1] == T  # the last step reaches the clean sample (alpha 1, sigma 0)


def test_a_lora_students_later_round_teacher_keeps_its_adapters(tiny_sd):
    """With student=lora the next round's teacher is the frozen copy of the student, adapters included: its output is
    the student's at the hand-over, not the original teacher's (the adapters that teacher calls switch off are only
    those on the teacher's own network)."""
    import functools

    from distill.students.copies import lora_student

    method = ProgressiveDistillation(load_teacher(str(tiny_sd)), functools.partial(lora_student, rank=4),
                                     torch.optim.AdamW, start_steps=8, final_steps=2, steps_per_round=5)
    assert method.is_lora and method.teacher_carries_other_adapters
    x, t, cond = method.family.example_inputs(method.student, 2)
    original = method.teacher_forward(x, t, cond)
    with torch.no_grad():
        for name, p in method.student.named_parameters():
            if "lora_B" in name:
                p.add_(0.05)  # the student has moved away from the first teacher
        moved = method.family.denoise(method.student, x, t, cond).float()
    assert (moved - original).abs().max() > 1e-3
    torch.testing.assert_close(method.teacher_forward(x, t, cond), original, rtol=0, atol=0)  # adapters off
    method.finish_round()
    assert not method.teacher_carries_other_adapters
    torch.testing.assert_close(method.teacher_forward(x, t, cond), moved, rtol=0, atol=1e-6)
