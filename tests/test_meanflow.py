"""MeanFlow (method=meanflow, Geng et al. 2025): the target on a Gaussian toy whose average velocity is known in closed
form, the (r, t) sampler and the adaptive weight against the paper's settings, the JVP through the two-time UNet and
SD3 transformer against a central difference, the student's start as the teacher's velocity, exports that pass both
times to the denoiser (one call per step), refusals, an exact resume, and two CLI steps sampled from a fresh process
on both embedded teachers."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch

from distill.diffusion import meanflow as mf
from distill.diffusion.jvp import time_derivative
from distill.families import load_teacher
from distill.utils.checkpoint import safe_load
from tests.conftest import run_train
from tests.sd3_tiny import write_tiny_sd3
from tests.test_scm import PROMPTS, _batch, _fresh_sample, _relative


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    return write_tiny_sd3(tmp_path_factory.mktemp("sd3") / "pipe")


@pytest.fixture(scope="module")
def sd_dir(tmp_path_factory):
    from tests.sd_tiny import write_tiny_sd

    return write_tiny_sd(tmp_path_factory.mktemp("sd") / "pipe")


def _method(folder, time_cond_proj_dim: int | None = 256, **options):
    """MeanFlow on a tiny pipeline; a UNet copy with the interval input (``time_cond_proj_dim``), an SD3 plain copy."""
    import functools

    from distill.methods.meanflow import MeanFlowDistillation
    from distill.students.copies import copy_student

    teacher = load_teacher(str(folder))
    student = copy_student if teacher.family.flow_matching else functools.partial(
        copy_student, time_cond_proj_dim=time_cond_proj_dim)
    return MeanFlowDistillation(teacher, student, lambda params: torch.optim.Adam(params, lr=1e-4), **options)


def _network(method):
    """The student's interval input: the SD3 transformer's interval embedder, or the UNet's cond_proj."""
    net = method.student
    return net.interval_embedder if hasattr(net, "interval_embedder") else net.time_embedding.cond_proj


# ---------------------------------------------------------------- a Gaussian toy with a known average velocity


def test_the_meanflow_target_on_a_gaussian_toy_is_the_analytic_average_velocity():
    """Data N(0, s^2) on the path z_t = (1 - t) x + t eps: trajectories z_t = m(t) w with m^2 = (1 - t)^2 s^2 + t^2, the
    velocity v = m'(t) / m(t) z, the average velocity u(z, r, t) = z (1 - m(r) / m(t)) / (t - r) (v at r = t). With that
    u as the network, v - (t - r) du/dt by torch.func.jvp along (v, 0, 1) is u itself (the MeanFlow identity), to 1e-12,
    and u is (1 / (t - r)) times v integrated along the trajectory (Gauss-Legendre, 1e-10). A network that is the
    instantaneous velocity gets a target off the average velocity where r != t."""
    s = 0.6
    t = torch.tensor([0.9, 0.7, 0.5, 0.3, 0.8], dtype=torch.float64)
    r = torch.tensor([0.1, 0.7, 0.2, 0.0, 0.75], dtype=torch.float64)
    z = torch.randn(5, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    b = lambda v: v.view(-1, 1)  # noqa: E731
    m = lambda t: ((1 - t) ** 2 * s ** 2 + t ** 2).sqrt()  # noqa: E731
    m_dot = lambda t: (-(1 - t) * s ** 2 + t) / m(t)  # noqa: E731
    v = lambda z, t: b(m_dot(t) / m(t)) * z  # noqa: E731

    def average(z, r, t):
        d = t - r
        safe = torch.where(d == 0, torch.ones_like(d), d)
        return torch.where(b(d == 0), v(z, t), z * b((1 - m(r) / m(t)) / safe))

    u, du_dt = time_derivative(average, (z, r, t), (v(z, t), torch.zeros_like(r), torch.ones_like(t)))
    torch.testing.assert_close(mf.meanflow_target(v(z, t), du_dt, r, t), u, rtol=0, atol=1e-12)
    nodes, weights = np.polynomial.legendre.leggauss(20)
    for i in range(5):
        if r[i] == t[i]:
            continue
        taus = r[i] + (t[i] - r[i]) * (torch.tensor(nodes) + 1) / 2
        path = m(taus)[:, None] / m(t[i]) * z[i]  # z_tau on the trajectory through z_t
        integral = (torch.tensor(weights)[:, None] * v(path, taus)).sum(0) * (t[i] - r[i]) / 2
        torch.testing.assert_close(integral / (t[i] - r[i]), u[i], rtol=1e-10, atol=1e-10)
    _, dv_dt = time_derivative(lambda z, r, t: v(z, t), (z, r, t), (v(z, t), torch.zeros_like(r), torch.ones_like(t)))
    off = (mf.meanflow_target(v(z, t), dv_dt, r, t) - u).abs().amax(dim=1)
    assert (off[r != t] > 1e-3).all() and (off[r == t] < 1e-12).all()


def test_the_time_pairs_and_the_adaptive_weight_are_the_papers():
    """(r, t): r <= t, 25% of rows with r != t, logit-normal(-0.4, 1) draws (checked on 40,000 rows); the loss
    sg(w) ||delta||^2 with w = 1 / (||delta||^2 + c)^p, its gradient 2 w delta."""
    r, t = mf.sample_time_pairs(40_000, generator=torch.Generator().manual_seed(0))
    assert (r <= t).all() and abs(float((r != t).double().mean()) - 0.25) < 0.01
    r, t = mf.sample_time_pairs(40_000, ratio_r_neq_t=1.0, generator=torch.Generator().manual_seed(1))
    logits = torch.logit(torch.cat([r, t]))
    assert abs(float(logits.mean()) + 0.4) < 0.02 and abs(float(logits.std()) - 1.0) < 0.02
    u = torch.tensor([[1.0, 2.0], [0.0, 0.5]], requires_grad=True)
    target = torch.zeros(2, 2)
    loss = mf.meanflow_loss(u, target, power=1.0, c=1e-3)
    torch.testing.assert_close(loss, torch.tensor([5 / 5.001, 0.25 / 0.251]))
    (grad,) = torch.autograd.grad(loss.sum(), u)
    torch.testing.assert_close(grad, 2 * u.detach() / torch.tensor([[5.001], [0.251]]))
    torch.testing.assert_close(mf.meanflow_loss(u, target, power=0.0), torch.tensor([5.0, 0.25]))
    z = torch.ones(2, 3)
    torch.testing.assert_close(mf.meanflow_step(z, 2 * z, 0.25, 0.75), torch.zeros(2, 3))


# ---------------------------------------------------------------- the two-time transformer


@pytest.mark.parametrize("which", ["sd", "sd3"])
def test_the_student_starts_as_the_teachers_velocity_and_the_jvp_equals_a_central_difference(which, sd_dir, sd3_dir):
    """At initialisation u(z, r, t) is the teacher's velocity v(z, t) bit for bit for any r (the interval input starts
    at zero): the SD3 transformer's own velocity, the UNet's eps - x0 at its VP view of z_t. After moving it, the JVP of
    u through the two-time network along (v, 0, 1) and along r alone equals a central difference in float64 (h = 1e-4;
    within 1e-2 relative, diffusers' float32 time embedding's bound), and r changes the output (the second time
    enters)."""
    method = _method(sd_dir if which == "sd" else sd3_dir, guidance_scale=1.0)
    cond, uncond = method.text_conditions({"caption": PROMPTS}, 2, "cpu")
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 4, 8, 8, generator=g)
    t, r = torch.tensor([0.8, 0.5], dtype=torch.float64), torch.tensor([0.2, 0.5], dtype=torch.float64)
    with torch.no_grad():
        u = method.average_velocity(method.student, z, r, t, cond)
        x, time, view = method.network_input(z, t)
        v = method.velocity(method.teacher_forward(x, time, cond), x, view)  # the teacher's own velocity, 2 rows
        assert torch.equal(u, v)
        torch.testing.assert_close(method.teacher_velocity(z, t, cond, uncond), v, rtol=1e-5, atol=1e-5)
        for p in _network(method).parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    student = method.student.double()
    cond = {k: v.double() for k, v in cond.items()}
    z = z.double()
    fn = lambda z, r, t: method.average_velocity(student, z, r, t, cond)  # noqa: E731
    dz = torch.randn(z.shape, generator=g, dtype=torch.float64)
    with torch.no_grad():
        assert not torch.allclose(fn(z, r, t), fn(z, r - 0.1, t))
        for tangents in ((dz, torch.zeros_like(r), torch.ones_like(t)), (torch.zeros_like(z), torch.ones_like(r),
                                                                           torch.zeros_like(t))):
            _, jvp = time_derivative(fn, (z, r, t), tangents, networks=[student])
            _, fd = time_derivative(fn, (z, r, t), tangents, "finite_difference", 1e-4)
            assert jvp.norm() > 0 and _relative(jvp, fd) < 1e-2, _relative(jvp, fd)


def test_a_vp_networks_view_of_the_flow_path_gives_the_paths_velocity():
    """The UNet's view of z_t = (1 - t) x + t eps is the VP sample c z_t = alpha x + sigma eps (alpha^2 + sigma^2 = 1),
    and an output that is the exact eps (or v) there gives the path's velocity eps - x (1e-12, float64)."""
    from distill.diffusion.parametrization import prediction_target
    from distill.methods.meanflow import MeanFlowDistillation

    g = torch.Generator().manual_seed(0)
    t = torch.tensor([0.01, 0.3, 0.7, 0.95], dtype=torch.float64)
    x, eps = (torch.randn(4, 3, generator=g, dtype=torch.float64) for _ in range(2))
    z = (1 - t)[:, None] * x + t[:, None] * eps
    c, alpha, sigma = (v[:, None] for v in mf.vp_view(t))
    torch.testing.assert_close(c * z, alpha * x + sigma * eps, rtol=0, atol=1e-12)
    torch.testing.assert_close(alpha ** 2 + sigma ** 2, torch.ones_like(alpha), rtol=0, atol=1e-12)
    for prediction_type in ("epsilon", "v_prediction"):
        method = type("VP", (), {"schedule": type("S", (), {"prediction_type": prediction_type})()})()
        out = prediction_target(prediction_type, x, eps, alpha, sigma)
        got = MeanFlowDistillation.velocity(method, out, c * z, (alpha, sigma))
        torch.testing.assert_close(got, eps - x, rtol=0, atol=1e-12)


def test_a_training_step_moves_the_interval_input_and_the_loss_is_the_weighted_residual(sd3_dir):
    """The loss is the mean of sg(w) ||u - sg(v - (t - r) du/dt)||^2 recomputed from the method's own terms; its
    gradient reaches the interval embedding (rows with r != t)."""
    method = _method(sd3_dir, ratio_r_neq_t=1.0)
    loss = method.loss(_batch(), torch.Generator().manual_seed(0))
    terms = method.meanflow_terms(_batch(), torch.Generator().manual_seed(0))
    with torch.no_grad():
        u = method.average_velocity(method.student, terms["z"], terms["r"], terms["t"], terms["cond"])
    torch.testing.assert_close(loss.detach(), mf.meanflow_loss(u, terms["target"]).mean())
    loss.backward()
    assert method.student.interval_embedder.linear_2.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("which", ["sd", "sd3"])
def test_the_export_passes_both_times_one_call_per_step(which, sd_dir, sd3_dir, tmp_path):
    """model_index.json names the MeanFlow pipeline, scheduler and (SD3) the two-time transformer; from_pretrained
    (export)(prompt, 2 steps) calls the denoiser twice with 1 row at the times t_0 = t_max, t_max / 2 (SD3: timesteps
    1000, 500 with intervals 500, 500; the UNet: its timesteps of noise level t / (1 - t), the interval's embedding as
    timestep_cond), and returns z_0 = z_0' - (t_0 - t_1) u(z_0', t_1, t_0) - t_1 u(z_1', 0, t_1) recomputed by hand."""
    from diffusers import DiffusionPipeline

    import distill.inference.pipelines  # noqa: F401

    method = _method(sd_dir if which == "sd" else sd3_dir)
    with torch.no_grad():
        for p in _network(method).parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    export = method.export(tmp_path / "export")
    index = json.loads((export / "model_index.json").read_text())
    flow = which == "sd3"
    assert index["_class_name"] == ("DistillMeanFlowSD3Pipeline" if flow else "DistillMeanFlowPipeline")
    assert index["scheduler"] == ["distill.inference.meanflow", "FlowMatchMeanFlowScheduler" if flow
                                  else "MeanFlowScheduler"]
    assert index["default_num_inference_steps"] == 1 and index["guidance_distilled"] is True
    if flow:
        assert index["transformer"] == ["distill.models.meanflow", "MeanFlowSD3Transformer2DModel"]
    card = (export / "README.md").read_text()  # no stock class can pass both times: the card says so, not a stock call
    assert "samples only through its own class" in card and "pass the call explicitly" not in card
    pipe = DiffusionPipeline.from_pretrained(export)
    pipe.set_progress_bar_config(disable=True)
    net = pipe.transformer if flow else pipe.unet
    calls = []
    net.register_forward_hook(lambda m, a, kw, out: calls.append(
        (len(kw.get("hidden_states", a[0] if a else None)), float((kw.get("timestep") if flow else a[1])[0]))),
        with_kwargs=True)
    z1 = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    out = pipe(PROMPTS[0], num_inference_steps=2, latents=z1, output_type="latent").images
    t0 = method.t_max
    expected = [1000.0, 500.0] if flow else pipe.scheduler.timesteps.tolist()
    assert [c[0] for c in calls] == [1, 1] and [c[1] for c in calls] == pytest.approx(expected)
    if not flow:
        from distill.diffusion.schedules import vp_timestep

        times = torch.tensor([t0, t0 / 2], dtype=torch.float64)
        assert expected == pytest.approx(vp_timestep(times / (1 - times), method.schedule.ve_sigmas).tolist())
    cond, _ = method.text_conditions({"caption": PROMPTS[:1]}, 1, "cpu")
    at = lambda v: torch.full((1,), v, dtype=torch.float64)  # noqa: E731
    start = z1 * pipe.scheduler.init_noise_sigma  # prepare_latents scales given latents too (UNet: 1 / c(t_max))
    assert pipe.scheduler.init_noise_sigma == 1.0 if flow else pipe.scheduler.init_noise_sigma < 1.0
    with torch.no_grad():
        z = start - t0 / 2 * method.average_velocity(method.student, start, at(t0 / 2), at(t0), cond)
        z = z - t0 / 2 * method.average_velocity(method.student, z, at(0.0), at(t0 / 2), cond)
    torch.testing.assert_close(out, z, rtol=1e-5, atol=1e-5)


def test_what_cannot_work_is_refused(sd_dir, compose):
    """A UNet student without the interval input (at the config and at construction), the other kind's scheduler."""
    from distill.config.validate import ConfigError, validate

    with pytest.raises(ConfigError, match=r"student.time_cond_proj_dim=null: a MeanFlow UNet .*time_cond_proj_dim=256"):
        validate(compose("+exp=meanflow", "student.time_cond_proj_dim=null"))
    with pytest.raises(ConfigError, match=r"scheduler.name='meanflow'.*use scheduler=flow_meanflow \(\+exp=meanflow_flow"):
        validate(compose("+exp=meanflow", "teacher=digits_flow"))
    with pytest.raises(ConfigError, match=r"scheduler.name='flow_lcm'.*use scheduler=meanflow"):
        validate(compose("+exp=meanflow", "scheduler=flow_lcm"))
    with pytest.raises(ValueError, match=r"student.time_cond_proj_dim=null: a MeanFlow UNet"):
        _method(sd_dir, time_cond_proj_dim=None)


# ---------------------------------------------------------------- the command line


FAST = ["callbacks.quality_cost=null", "data.batch_size=2", "trainer.max_steps=2", "trainer.limit_val_batches=0",
        "checkpoint.every_n_train_steps=2", "callbacks.samples=null", "sample_grid_seeds=0", "logger=csv",
        "scheduler.num_inference_steps=2"]


@pytest.mark.parametrize("exp", ["meanflow", "meanflow_flow"])
def test_two_cli_steps_of_meanflow_export_a_student_sampled_from_a_fresh_process(exp, tmp_path):
    """+exp=meanflow on the embedded UNet teacher, +exp=meanflow_flow on teacher=digits_flow: two steps (the interval
    input in the checkpoint, moved from zero), an export whose 2-step call in a fresh process runs 2 denoiser calls of 1
    row at the scheduler's timesteps (flow: 1000, 500), with finite, non-constant images."""
    run_dir = tmp_path / "run"
    extra = ["teacher=digits_flow"] if exp == "meanflow_flow" else []
    proc = run_train(f"+exp={exp}", *extra, *FAST, f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = safe_load(run_dir / "checkpoints" / "last.ckpt")
    key = ("student.interval_embedder.linear_2.weight" if exp == "meanflow_flow"
           else "student.time_embedding.cond_proj.weight")
    assert state["state_dict"][key].abs().sum() > 0
    got = _fresh_sample(run_dir / "export")
    assert (got["calls"], got["rows"]) == (2, 2) and got["finite"] and got["std"] > 0 and got["shape"] == [1, 1, 32, 32]
    if exp == "meanflow_flow":
        assert got["scheduler"] == "FlowMatchMeanFlowScheduler" and got["timesteps"] == [1000.0, 500.0]
    else:
        from distill.inference.meanflow import MeanFlowScheduler

        scheduler = MeanFlowScheduler.from_pretrained(run_dir / "export", subfolder="scheduler")
        scheduler.set_timesteps(2)
        assert got["scheduler"] == "MeanFlowScheduler"
        assert got["timesteps"] == pytest.approx(scheduler.timesteps.tolist())


def test_a_stopped_meanflow_run_resumed_is_bit_identical(tmp_path):
    """+exp=meanflow (UNet): 4 steps straight against 2 then ``ckpt_path=last`` to 4: the same bits in the student (its
    interval projection included), the optimizer, the LR schedule and the EMA, and the same loss curve. (On the SD3
    transformer a resumed run drifts by 1 ulp from the first step after the resume, as +exp=consistency_training_flow
    does: docs/scm.md.)"""
    from tests.test_resilience import _assert_same_state
    from tests.test_scm import RESUME

    common = ["+exp=meanflow", *[o for o in RESUME[1:] if not o.startswith("method.tangent")]]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for run_dir, extra in ((straight, ["trainer.max_steps=4"]), (resumed, ["trainer.max_steps=2"]),
                           (resumed, ["trainer.max_steps=4", "ckpt_path=last"])):
        proc = run_train(*common, *extra, f"hydra.run.dir={run_dir}")
        assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = (safe_load(d / "checkpoints" / "last.ckpt") for d in (straight, resumed))
    assert a["global_step"] == b["global_step"] == 4
    assert "student.time_embedding.cond_proj.weight" in a["state_dict"]
    for key in ("state_dict", "optimizer_states", "lr_schedulers"):
        _assert_same_state(a[key], b[key], key)
    for key in [k for k in a["callbacks"] if k.startswith("EMA")]:
        _assert_same_state(a["callbacks"][key], b["callbacks"][key], key)
    curves = [{int(r["step"]): r["train/loss"] for r in csv.DictReader(open(d / "csv" / "metrics.csv"))
               if r.get("train/loss")} for d in (straight, resumed)]
    assert len(curves[0]) == 4 and curves[0] == curves[1]


def test_the_unet_samplers_first_input_is_unit_variance_noise():
    """MeanFlowScheduler starts from the flow sample at t_max < 1, (1 - t) x + t eps of spread 1 / c(t_max) for
    unit-variance latents: init_noise_sigma is that spread, so the UNet's first input c z is unit-variance noise
    (review finding: it was 1.0, a first input 6.6% too wide on SD's schedule)."""
    from distill.inference.meanflow import MeanFlowScheduler

    scheduler = MeanFlowScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
    scheduler.set_timesteps(2)
    t = scheduler.t_max
    assert 0.9 < t < 1 and scheduler.init_noise_sigma == pytest.approx(((1 - t) ** 2 + t ** 2) ** 0.5, abs=1e-12)
    first = scheduler.scale_model_input(torch.full((1,), scheduler.init_noise_sigma, dtype=torch.float64))
    assert float(first) == pytest.approx(1.0, abs=1e-12)
