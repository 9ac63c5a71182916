"""Latent consistency distillation: the math against diffusers' own formulas, a short run, exports, bad input."""

import csv
import math
import re

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, LCMScheduler, StableDiffusionPipeline

from distill.diffusion import alpha_sigma, ddim_step, guidance_scale_embedding, to_x0_eps
from distill.diffusion.consistency import (
    boundary_scalings,
    check_consistency_loss,
    consistency_loss,
    consistency_output,
    ddim_timesteps,
    ict_huber_c,
)
from tests.conftest import run_train
from tests.sd_tiny import write_tiny_sd


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory):
    return write_tiny_sd(tmp_path_factory.mktemp("sd") / "pipe")


def test_boundary_scalings_match_lcm_scheduler():
    sched = LCMScheduler(timestep_scaling=10.0)
    for t in [0, 1, 19, 499, 999]:
        c_skip, c_out = boundary_scalings(torch.tensor([t]), sigma_data=0.5, timestep_scaling=10.0)
        ref_skip, ref_out = sched.get_scalings_for_boundary_condition_discrete(t)
        assert c_skip.item() == pytest.approx(float(ref_skip), rel=1e-6)
        assert c_out.item() == pytest.approx(float(ref_out), rel=1e-6)
    c_skip, c_out = boundary_scalings(torch.tensor([0]))
    assert c_skip.item() == 1.0 and c_out.item() == 0.0  # f(x, 0) = x: the boundary condition
    x, x0 = torch.randn(2, 4, 2, 2), torch.randn(2, 4, 2, 2)
    torch.testing.assert_close(consistency_output(x, x0, torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])),
                               torch.stack([x[0], x0[1]]))


def test_ddim_solver_step_matches_diffusers_ddim():
    sched = DDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, clip_sample=False,
                          set_alpha_to_one=False, prediction_type="epsilon")
    sched.set_timesteps(50)  # step 20 apart, as the solver's skip k = 1000 / 50
    g = torch.Generator().manual_seed(0)
    x_t, eps = torch.randn(3, 4, 8, 8, generator=g), torch.randn(3, 4, 8, 8, generator=g)
    t = int(sched.timesteps[10])
    ref = sched.step(eps, t, x_t).prev_sample
    tt = torch.full((3,), t)
    alpha, sigma = alpha_sigma(sched.alphas_cumprod, tt)
    x0, eps_hat = to_x0_eps("epsilon", eps, x_t, alpha, sigma)
    alpha_prev, sigma_prev = alpha_sigma(sched.alphas_cumprod, tt - 20)
    torch.testing.assert_close(ddim_step(x0, eps_hat, alpha_prev, sigma_prev), ref, rtol=1e-4, atol=1e-5)


def test_solver_grid():
    grid = ddim_timesteps(1000, 50)
    assert grid[0].item() == 19 and grid[-1].item() == 999 and (grid.diff() == 20).all()
    with pytest.raises(ValueError, match="must divide"):
        ddim_timesteps(1000, 30)


def test_w_embedding_matches_the_pipeline():
    w = torch.tensor([0.0, 1.5, 4.0])
    ref = StableDiffusionPipeline.get_guidance_scale_embedding(None, w, embedding_dim=64)
    torch.testing.assert_close(guidance_scale_embedding(w, 64), ref)
    assert guidance_scale_embedding(w, 33).shape == (3, 33)


def test_losses_golden_values():
    # two examples of two elements: d = (3, 4) and (0.0005, 0)
    pred, target = torch.zeros(2, 1, 1, 2), torch.tensor([[3.0, 4.0], [0.0005, 0.0]]).reshape(2, 1, 1, 2)
    # iCT pseudo-Huber on each example's L2 norm (5 and 0.0005), c = 0.5
    ict = ((25 + 0.25) ** 0.5 - 0.5 + (0.0005**2 + 0.25) ** 0.5 - 0.5) / 2
    assert consistency_loss(pred, target, "pseudo_huber", 0.5).item() == pytest.approx(ict, rel=1e-6)
    # diffusers' LCM scripts: sqrt(d^2 + c^2) - c on each element, c = 0.001
    lcm = sum((d * d + 1e-6) ** 0.5 - 0.001 for d in (3.0, 4.0, 0.0005, 0.0)) / 4
    assert consistency_loss(pred, target, "pseudo_huber_elementwise", 0.001).item() == pytest.approx(lcm, rel=1e-6)
    # Huber / delta: |d| - delta/2 above delta = 0.001, d^2 / (2 delta) below
    huber = (3 - 0.0005 + 4 - 0.0005 + 0.0005**2 / 0.002 + 0) / 4
    assert consistency_loss(pred, target, "huber", 0.001).item() == pytest.approx(huber, rel=1e-6)
    l1 = (3 + 4 + 0.0005) / 4
    assert consistency_loss(pred, target, "huber", 1e-6).item() == pytest.approx(l1, rel=1e-5)  # L1 as delta -> 0
    assert consistency_loss(pred, target, "l2", None).item() == pytest.approx((9 + 16 + 0.0005**2) / 4, rel=1e-6)


def _reference(kind: str, x: np.ndarray, y: np.ndarray, c: float) -> float:
    """The four distances in float64 numpy, straight from their sources' formulas."""
    d = (x - y).reshape(len(x), -1)
    if kind == "pseudo_huber":
        return float(np.mean(np.sqrt(np.sum(d**2, axis=1) + c**2) - c))
    if kind == "pseudo_huber_elementwise":
        return float(np.mean(np.sqrt(d**2 + c**2) - c))
    if kind == "huber":
        a = np.abs(d)
        return float(np.mean(np.where(a <= c, 0.5 * d**2, c * (a - 0.5 * c))) / c)
    return float(np.mean(d**2))


@pytest.mark.parametrize("kind, c", [("pseudo_huber", 0.001), ("pseudo_huber", None), ("pseudo_huber_elementwise", 0.001),
                                     ("huber", 0.001), ("huber", 0.1), ("l2", None)])
def test_losses_match_reference_formulas_on_latents(kind, c):
    g = torch.Generator().manual_seed(0)
    pred, target = torch.randn(3, 4, 8, 8, generator=g), torch.randn(3, 4, 8, 8, generator=g)
    target[0] = pred[0] + 1e-3 * torch.randn(4, 8, 8, generator=g)  # one example near the quadratic region
    ref = _reference(kind, pred.double().numpy(), target.double().numpy(), 0.00054 * math.sqrt(256) if c is None else c)
    assert consistency_loss(pred, target, kind, c).item() == pytest.approx(ref, rel=1e-5)


def test_ict_huber_c_of_a_4x8x8_latent():
    assert ict_huber_c(4 * 8 * 8) == pytest.approx(0.00864, rel=1e-12)  # 0.00054 * sqrt(256)
    assert ict_huber_c(3 * 32 * 32) == pytest.approx(0.03, rel=0.01)  # iCT's CIFAR-10 value


@pytest.mark.parametrize(
    "kind, c, needle",
    [("l1", 0.001, "method.loss_type='l1' is not supported"),
     ("huber", None, "method.huber_c=null (iCT's c = 0.00054 sqrt(d)) is defined only for method.loss_type=pseudo_huber"),
     ("pseudo_huber_elementwise", None, "set method.huber_c to a number"),
     ("pseudo_huber", 0.0, "method.huber_c=0.0 must be > 0")],
)
def test_bad_loss_settings_are_rejected(kind, c, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        check_consistency_loss(kind, c)
    with pytest.raises(ValueError, match=re.escape(needle)):
        consistency_loss(torch.zeros(1, 2), torch.ones(1, 2), kind, c)


def test_target_moves_once_per_optimizer_step_and_not_on_a_skipped_one(tiny_sd):
    """The EMA target update belongs to the optimizer step: a step whose gradients the non-finite guard dropped
    moves neither the student nor the target; a real step moves the target by (1 - ema_decay) towards the student."""
    from distill.families import load_teacher
    from distill.methods.consistency import LatentConsistencyDistillation
    from distill.students.copies import copy_student

    method = LatentConsistencyDistillation(load_teacher(str(tiny_sd)), lambda unet: copy_student(unet, 32),
                                           optimizer=lambda params: torch.optim.SGD(params, lr=0.1), ema_decay=0.75)
    optimizer = torch.optim.SGD(method.student.parameters(), lr=0.1)
    with torch.no_grad():
        for p in method.target.parameters():  # a target apart from the student, so that an update shows
            p.add_(1.0)
    student, target = ({k: v.clone() for k, v in m.named_parameters()} for m in (method.student, method.target))
    method.optimizer_step(0, 0, optimizer, None)  # no gradients: what the guard leaves of a bad step
    for name, p in method.target.named_parameters():
        assert torch.equal(p, target[name]) and torch.equal(method.student.get_parameter(name), student[name]), name
    for p in method.student.parameters():
        p.grad = torch.ones_like(p)
    method.optimizer_step(0, 1, optimizer, None)
    for name, p in method.target.named_parameters():
        moved = student[name] - 0.1  # SGD on a gradient of ones
        torch.testing.assert_close(method.student.get_parameter(name), moved)
        torch.testing.assert_close(p, 0.75 * target[name] + 0.25 * moved)


LCM_FAST = ["callbacks.quality_cost=null", "student.time_cond_proj_dim=32", "data.batch_size=16", "trainer.log_every_n_steps=5",
            "trainer.limit_val_batches=1", "callbacks.samples.num_seeds=1", "sample_grid_seeds=1", "logger=csv"]


@pytest.mark.slow  # ~55 s of training
def test_digits_teacher_short_distillation_lowers_consistency_loss(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train("+exp=consistency", "data.batch_size=32", "trainer.max_steps=60", "trainer.val_check_interval=20",
                     "trainer.limit_val_batches=2", "method.optimizer.lr=3e-4", "method.lr_scheduler.warmup_steps=5",
                     "checkpoint.every_n_train_steps=60", "callbacks.samples=null", "callbacks.quality_cost=null", "sample_grid_seeds=0",
                     "logger=csv", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(run_dir / "csv" / "metrics.csv")))
    val = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    assert len(val) == 3 and val[-1] < val[0], val
    pipe = StableDiffusionPipeline.from_pretrained(run_dir / "export")
    assert isinstance(pipe.scheduler, LCMScheduler) and pipe.unet.config.time_cond_proj_dim == 256


def test_generic_sd_teacher_path_exports_a_pipeline(tiny_sd, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train("+exp=consistency", f"teacher.pretrained_model_name_or_path={tiny_sd}", *LCM_FAST,
                     "trainer.max_steps=6", "trainer.val_check_interval=3", "checkpoint.every_n_train_steps=6",
                     f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    val = [float(r["val/loss"]) for r in csv.DictReader(open(run_dir / "csv" / "metrics.csv")) if r.get("val/loss")]
    assert len(val) == 2 and all(v == v and v > 0 for v in val)
    pipe = StableDiffusionPipeline.from_pretrained(run_dir / "export")
    assert isinstance(pipe.scheduler, LCMScheduler) and pipe.unet.config.time_cond_proj_dim == 32
    images = pipe("a handwritten digit three", num_inference_steps=2, guidance_scale=3.0, height=32, width=32,
                  output_type="pt", generator=torch.Generator().manual_seed(0)).images
    assert images.shape == (1, 1, 32, 32) and torch.isfinite(images).all()
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    assert {k.split(".")[0] for k in state} == {"student", "target"}  # the frozen teacher is not stored


def test_lora_student_exports_weights_that_load_into_the_teacher(tiny_sd, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train("+exp=consistency", f"teacher.pretrained_model_name_or_path={tiny_sd}", "student=lora",
                     "student.rank=4", "method.ema_decay=0", *[o for o in LCM_FAST if "time_cond" not in o], "trainer.max_steps=4",
                     "trainer.val_check_interval=4", "checkpoint.every_n_train_steps=4", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run_dir / "export" / "lora" / "pytorch_lora_weights.safetensors").is_file()
    teacher = StableDiffusionPipeline.from_pretrained(tiny_sd)
    base = {k: v.clone() for k, v in teacher.unet.state_dict().items()}
    teacher.load_lora_weights(run_dir / "export" / "lora")
    teacher.fuse_lora()
    teacher.unload_lora_weights()  # keeps the fused weights, drops the adapter modules
    fused = StableDiffusionPipeline.from_pretrained(run_dir / "export")
    changed = [k for k, v in fused.unet.state_dict().items() if k in base and not torch.equal(v, base[k])]
    assert changed  # the adapters trained
    for key in changed:
        torch.testing.assert_close(teacher.unet.state_dict()[key], fused.unet.state_dict()[key], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["teacher.pretrained_model_name_or_path=/tmp"], "not a diffusers pipeline folder"),
        pytest.param(["method.guidance_scale_min=8", "method.guidance_scale_max=4"],
                     "guidance_scale_min=8.0 > method.guidance_scale_max=4.0", marks=pytest.mark.slow),
        pytest.param(["data.resolution=30"], "not divisible by the teacher's VAE factor 4", marks=pytest.mark.slow),
        (["method.loss_type=huber", "method.huber_c=null"], "method.huber_c=null"),
    ],
)
def test_bad_input_fails_before_training(tiny_sd, tmp_path, overrides, needle):
    run_dir = tmp_path / "run"
    proc = run_train("+exp=consistency", f"teacher.pretrained_model_name_or_path={tiny_sd}", *overrides,
                     "logger=csv", f"hydra.run.dir={run_dir}", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert needle in proc.stderr and not run_dir.exists()


def test_unsupported_prediction_type_is_rejected(tiny_sd, tmp_path):
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_sd, bad)
    cfg_file = bad / "scheduler" / "scheduler_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["prediction_type"] = "flow_prediction"
    cfg_file.write_text(json.dumps(cfg))
    proc = run_train("+exp=consistency", f"teacher.pretrained_model_name_or_path={bad}", "logger=csv",
                     f"hydra.run.dir={tmp_path / 'run'}", timeout=120)
    # refused up front with the other flow-matching teachers (distill.models.teacher.check_family)
    assert proc.returncode == 2 and "(flow matching), which distill does not support yet" in proc.stderr
