"""MeanFlow (method=meanflow, Geng et al. 2025): the target on a Gaussian toy whose average velocity is known in closed
form, the (r, t) sampler and the adaptive weight against the paper's settings, the JVP through the two-time SD3
transformer against a central difference, the student's start as the teacher's velocity, an export that passes both
times to the denoiser (one call per step), refusals, an exact resume, and two CLI steps sampled from a fresh process
on the embedded flow teacher."""

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


def _method(folder, **options):
    from distill.methods.meanflow import MeanFlowDistillation
    from distill.students.copies import copy_student

    return MeanFlowDistillation(load_teacher(str(folder)), copy_student,
                                lambda params: torch.optim.Adam(params, lr=1e-4), **options)


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


def test_the_student_starts_as_the_teachers_velocity_and_the_jvp_equals_a_central_difference(sd3_dir):
    """At initialisation u(z, r, t) is the teacher's velocity v(z, t) bit for bit for any r (the interval embedding's
    output layer is zero). After moving it, the JVP through the two-time transformer along (v, 0, 1) and along r alone
    equals a central difference in float64 (h = 1e-4; within 1e-2 relative, diffusers' float32 time embedding's bound),
    and r changes the output (the second time enters)."""
    method = _method(sd3_dir)
    cond, _ = method.text_conditions({"caption": PROMPTS}, 2, "cpu")
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 4, 8, 8, generator=g)
    t, r = torch.tensor([0.8, 0.5], dtype=torch.float64), torch.tensor([0.2, 0.5], dtype=torch.float64)
    with torch.no_grad():
        u = method.average_velocity(method.student, z, r, t, cond)
        v = method.teacher_forward(z, t.float(), cond)
        assert torch.equal(u, v)
        for p in method.student.interval_embedder.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    student = method.student.double()
    cond = {k: v.double() for k, v in cond.items()}
    z = z.double()
    fn = lambda z, r, t: method.family.denoise(student, z, t, cond, interval=1000 * (t - r))  # noqa: E731
    dz = torch.randn(z.shape, generator=g, dtype=torch.float64)
    with torch.no_grad():
        assert not torch.allclose(fn(z, r, t), fn(z, r - 0.1, t))
        for tangents in ((dz, torch.zeros_like(r), torch.ones_like(t)), (torch.zeros_like(z), torch.ones_like(r),
                                                                           torch.zeros_like(t))):
            _, jvp = time_derivative(fn, (z, r, t), tangents, networks=[student])
            _, fd = time_derivative(fn, (z, r, t), tangents, "finite_difference", 1e-4)
            assert jvp.norm() > 0 and _relative(jvp, fd) < 1e-2, _relative(jvp, fd)


def test_a_training_step_moves_the_interval_embedding_and_the_loss_is_the_weighted_residual(sd3_dir):
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


def test_the_export_passes_both_times_one_call_per_step(sd3_dir, tmp_path):
    """model_index.json names DistillMeanFlowSD3Pipeline, FlowMatchMeanFlowScheduler and MeanFlowSD3Transformer2DModel;
    from_pretrained(export)(prompt, 2 steps) calls the transformer twice with 1 row, at timesteps (1000, 500) and
    intervals (500, 500), and returns z_0 = z_1 - 0.5 u(z_1, 0.5, 1) - 0.5 u(z_.5, 0, .5) recomputed by hand."""
    from diffusers import DiffusionPipeline

    import distill.inference.pipelines  # noqa: F401

    method = _method(sd3_dir)
    with torch.no_grad():
        for p in method.student.interval_embedder.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    export = method.export(tmp_path / "export")
    index = json.loads((export / "model_index.json").read_text())
    assert index["_class_name"] == "DistillMeanFlowSD3Pipeline" and index["default_num_inference_steps"] == 1
    assert index["scheduler"] == ["distill.inference.meanflow", "FlowMatchMeanFlowScheduler"]
    assert index["transformer"] == ["distill.models.meanflow", "MeanFlowSD3Transformer2DModel"]
    pipe = DiffusionPipeline.from_pretrained(export)
    pipe.set_progress_bar_config(disable=True)
    calls = []
    pipe.transformer.register_forward_hook(
        lambda m, a, kw, out: calls.append((len(kw["hidden_states"]), float(kw["timestep"][0]),
                                            float(kw["interval"][0]))), with_kwargs=True)
    z1 = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    out = pipe(PROMPTS[0], num_inference_steps=2, latents=z1, output_type="latent").images
    assert calls == [(1, 1000.0, 500.0), (1, 500.0, 500.0)]
    cond, _ = method.text_conditions({"caption": PROMPTS[:1]}, 1, "cpu")
    one = torch.ones(1, dtype=torch.float64)
    with torch.no_grad():
        z = z1 - 0.5 * method.average_velocity(method.student, z1, 0.5 * one, one, cond)
        z = z - 0.5 * method.average_velocity(method.student, z, 0 * one, 0.5 * one, cond)
    torch.testing.assert_close(out, z, rtol=1e-5, atol=1e-5)


def test_what_cannot_work_is_refused(sd_dir_vp, compose):
    """A VP teacher (at the config, naming teacher=digits_flow, and at construction), another scheduler."""
    from distill.config.validate import ConfigError, validate

    with pytest.raises(ConfigError, match=r"method=meanflow on the discrete VP teacher .*teacher=digits_flow"):
        validate(compose("+exp=meanflow", "teacher=digits"))
    with pytest.raises(ConfigError, match=r"scheduler.name='flow_lcm'.*use scheduler=flow_meanflow"):
        validate(compose("+exp=meanflow", "scheduler=flow_lcm"))
    with pytest.raises(ValueError, match=r"not flow matching.*teacher=digits_flow"):
        _method(sd_dir_vp)


@pytest.fixture(scope="module")
def sd_dir_vp(tmp_path_factory):
    from tests.sd_tiny import write_tiny_sd

    return write_tiny_sd(tmp_path_factory.mktemp("sd") / "pipe")


# ---------------------------------------------------------------- the command line


FAST = ["callbacks.quality_cost=null", "data.batch_size=2", "trainer.max_steps=2", "trainer.limit_val_batches=0",
        "checkpoint.every_n_train_steps=2", "callbacks.samples=null", "sample_grid_seeds=0", "logger=csv",
        "scheduler.num_inference_steps=2"]


def test_two_cli_steps_of_meanflow_export_a_student_sampled_from_a_fresh_process(tmp_path):
    """+exp=meanflow on the embedded flow teacher: two steps (the interval embedding in the checkpoint, moved from
    zero), an export whose default call in a fresh process runs 2 transformer calls of 1 row at timesteps 1000, 500."""
    run_dir = tmp_path / "run"
    proc = run_train("+exp=meanflow", *FAST, f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = safe_load(run_dir / "checkpoints" / "last.ckpt")
    assert state["state_dict"]["student.interval_embedder.linear_2.weight"].abs().sum() > 0
    got = _fresh_sample(run_dir / "export")
    assert got["scheduler"] == "FlowMatchMeanFlowScheduler" and (got["calls"], got["rows"]) == (2, 2)
    assert got["timesteps"] == [1000.0, 500.0] and got["finite"] and got["std"] > 0 and got["shape"] == [1, 1, 32, 32]


def test_a_stopped_meanflow_run_resumed_matches_the_straight_run(tmp_path):
    """4 steps straight against 2 then ``ckpt_path=last`` to 4: the same steps and, within 1e-6, the same loss curve,
    student (its interval embedding included), optimizer moments and LR schedule. Not bit for bit: on this CPU a resumed
    SD3-transformer run drifts by 1 ulp from step 3 on, with or without the JVP, the teacher or the EMA, and so does
    +exp=consistency_training_flow teacher=digits_flow (found here, not caused by MeanFlow; the UNet's sCM run resumes
    bit for bit: tests/test_scm.py)."""
    from tests.test_scm import RESUME

    common = ["+exp=meanflow", *[o for o in RESUME[1:] if not o.startswith("method.tangent")]]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for run_dir, extra in ((straight, ["trainer.max_steps=4"]), (resumed, ["trainer.max_steps=2"]),
                           (resumed, ["trainer.max_steps=4", "ckpt_path=last"])):
        proc = run_train(*common, *extra, f"hydra.run.dir={run_dir}")
        assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = (safe_load(d / "checkpoints" / "last.ckpt") for d in (straight, resumed))
    assert a["global_step"] == b["global_step"] == 4 and a["lr_schedulers"] == b["lr_schedulers"]
    assert any(k.startswith("student.interval_embedder.") for k in a["state_dict"])
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for k in a["state_dict"]:
        torch.testing.assert_close(a["state_dict"][k], b["state_dict"][k], rtol=0, atol=1e-6, msg=k)
    for sa, sb in zip(a["optimizer_states"][0]["state"].values(), b["optimizer_states"][0]["state"].values()):
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=1e-6)
    curves = [{int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(open(d / "csv" / "metrics.csv"))
               if r.get("train/loss")} for d in (straight, resumed)]
    assert sorted(curves[0]) == sorted(curves[1]) == [0, 1, 2, 3]
    assert all(abs(curves[0][k] - curves[1][k]) < 1e-6 for k in curves[0])
