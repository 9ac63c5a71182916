"""sCM, rCM and MeanFlow on a Flux teacher (the stand-in of tests/flux_tiny.py, with FLUX.1-dev's guidance embedding
and without it, FLUX.1-schnell's layout): the JVP through the Flux denoiser (packed 2x2 latents) against a central
difference, f(x, 0) = x, the teacher's tangent at its embedded guidance (one pass) or by true CFG in velocity form, the
student called at the same guidance input, the export's one-step sample through FluxPipeline equal to the method's f,
and two CLI steps of each preset whose export a fresh process loads and samples with one call per step."""

from __future__ import annotations

import json

import pytest
import torch

from distill.diffusion import trigflow as tf
from distill.diffusion.jvp import time_derivative
from distill.families import load_teacher
from distill.utils.checkpoint import safe_load
from tests.conftest import run_train
from tests.flux_tiny import write_tiny_flux
from tests.test_scm import PROMPTS, _fresh_sample, _relative

RESOLUTION = 16  # the training images' side (the stand-in's VAE factor is 1: 16x16 latents, 64 packed tokens)
GUIDANCE = 3.5  # +exp=scm_flux's method.guidance_scale


@pytest.fixture(scope="module")
def dev_dir(tmp_path_factory):
    return write_tiny_flux(tmp_path_factory.mktemp("dev") / "pipe")


@pytest.fixture(scope="module")
def schnell_dir(tmp_path_factory):
    return write_tiny_flux(tmp_path_factory.mktemp("schnell") / "pipe", guidance_embeds=False)


@pytest.fixture(scope="module")
def folders(dev_dir, schnell_dir):
    return {"dev": dev_dir, "schnell": schnell_dir}


def _scm(folder, method: str = "scm", **options):
    from distill.methods.rcm import ScoreRegularizedConsistencyDistillation
    from distill.methods.scm import ContinuousTimeConsistencyDistillation
    from distill.students.copies import copy_student

    adam = lambda params: torch.optim.Adam(params, lr=1e-4)  # noqa: E731
    options = {"resolution": RESOLUTION, "guidance_scale": GUIDANCE, "tangent_warmup_steps": 0, **options}
    if method == "rcm":
        return ScoreRegularizedConsistencyDistillation(load_teacher(str(folder)), copy_student, adam, adam, **options)
    return ContinuousTimeConsistencyDistillation(load_teacher(str(folder)), copy_student, adam, **options)


def _batch():
    return {"pixel_values": torch.linspace(-1, 1, 2 * RESOLUTION ** 2).reshape(2, 1, RESOLUTION, RESOLUTION),
            "caption": PROMPTS}


def _spy(method, monkeypatch) -> list[tuple[str, int, object]]:
    """Every ``family.denoise`` call of the method as (role, rows, guidance input or None)."""
    calls, denoise = [], method.family.denoise
    roles = {id(method.teacher_unet): "teacher", id(method.student): "student"}
    if hasattr(method, "critic"):
        roles[id(method.critic.score)] = "critic"

    def spy(network, x, t, cond, **extra):
        guidance = extra.get("guidance")
        calls.append((roles[id(network)], len(x), None if guidance is None else sorted(set(guidance.tolist()))))
        return denoise(network, x, t, cond, **extra)

    monkeypatch.setattr(method.family, "denoise", spy)
    return calls


# ---------------------------------------------------------------- the JVP through the Flux denoiser


@pytest.mark.parametrize("which", ["dev", "schnell"])
def test_jvp_through_the_flux_denoiser_equals_a_central_difference(which, folders):
    """torch.func.jvp through FluxTransformer2DModel called as FluxPipeline calls it (2x2 packing, img_ids, the guidance
    input 3.5 on dev), float64, against (F(p + h d) - F(p - h d)) / 2h: along x alone (h = 1e-3) within 1e-4 relative,
    along (x, flow time) (h = 1e-4) within 1e-2, the bound of diffusers' float32 time embedding (measured: 2e-6 along
    x, 1.7e-3 along time on dev)."""
    teacher = load_teacher(str(folders[which]))
    family, net = teacher.family, teacher.denoiser.double()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 8, 8, generator=g, dtype=torch.float64)
    cond = {"encoder_hidden_states": torch.randn(2, 3, 16, generator=g, dtype=torch.float64),
            "pooled_projections": torch.randn(2, 16, generator=g, dtype=torch.float64)}
    dx = torch.randn(x.shape, generator=g, dtype=torch.float64)
    time = torch.tensor([0.3, 0.6], dtype=torch.float64)
    fn = lambda x, s: family.denoise(net, x, s, cond, **family.guidance_input(torch.full((2,), GUIDANCE)))  # noqa: E731
    with torch.no_grad():
        for dt, h, rtol in ((0.0, 1e-3, 1e-4), (1.0, 1e-4, 1e-2)):
            tangents = (dx, torch.full_like(time, dt))
            out, jvp = time_derivative(fn, (x, time), tangents, networks=[net])
            ref, fd = time_derivative(fn, (x, time), tangents, "finite_difference", h)
            torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
            assert jvp.norm() > 0 and _relative(jvp, fd) < rtol, (which, dt, _relative(jvp, fd))


@pytest.mark.parametrize("which", ["dev", "schnell"])
def test_the_consistency_function_is_the_identity_at_t_0_exactly_on_flux(which, folders):
    method = _scm(folders[which])
    cond, _ = method.text_conditions({"caption": PROMPTS}, 2, "cpu")
    x = torch.randn(2, 4, RESOLUTION, RESOLUTION, generator=torch.Generator().manual_seed(0)) * 3
    with torch.no_grad():
        f0 = method.consistency(method.student, x, torch.zeros(2, dtype=torch.float64), cond)
        f1 = method.consistency(method.student, x, torch.full((2,), 0.5, dtype=torch.float64), cond)
    assert torch.equal(f0, x) and not torch.allclose(f1, x)


# ---------------------------------------------------------------- guidance: embedded (dev) or true CFG (schnell)


def _teacher_velocity(method, x, s, cond, guidance):
    return method.family.denoise(method.teacher_unet, x, s, cond,
                                 **({"guidance": torch.full((len(x),), guidance)} if guidance else {}))


def test_the_dev_teachers_tangent_is_one_pass_at_its_embedded_guidance(dev_dir, monkeypatch):
    """FLUX.1-dev: F_teacher is the velocity at guidance input 3.5 (one pass of 2 rows, no unconditional rows) read as
    TrigFlow's F, equal to a hand conversion; guidance 1.5 gives another F. In the loss the student is called at 3.5
    too (its F- under the JVP and its F), and the export's call passes 3.5 (not guidance-distilled)."""
    method = _scm(dev_dir)
    cond, uncond = method.text_conditions({"caption": PROMPTS}, 2, "cpu")
    x_t = torch.randn(2, 4, RESOLUTION, RESOLUTION, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([0.4, 1.2], dtype=torch.float64)
    c, s = tf.flow_view(t, 1.0)
    x = x_t * c.float().view(-1, 1, 1, 1)
    with torch.no_grad():
        ours = method.teacher_F(x_t, t, cond, uncond)
        v = _teacher_velocity(method, x, s.float(), cond, GUIDANCE)
        x0, eps = x - s.float().view(-1, 1, 1, 1) * v, x + (1 - s.float()).view(-1, 1, 1, 1) * v
        hand = tf.trigflow_from_x0_eps(x0, eps, t, 1.0)
        method.embedded_guidance = 1.5
        other = method.teacher_F(x_t, t, cond, uncond)
        method.embedded_guidance = GUIDANCE
    torch.testing.assert_close(ours, hand, rtol=1e-5, atol=1e-5)
    assert (other - ours).abs().max() > 1e-4
    calls = _spy(method, monkeypatch)
    loss = method.loss(_batch(), torch.Generator().manual_seed(0))
    assert calls == [("teacher", 2, [GUIDANCE]), ("student", 2, [GUIDANCE]), ("student", 2, [GUIDANCE])]
    assert torch.isfinite(loss)
    defaults = method.call_defaults()
    assert (defaults["default_guidance_scale"], defaults["guidance_distilled"],
            defaults["default_sample_size"]) == (GUIDANCE, False, RESOLUTION)
    assert "embedded guidance at scale 3.5" in method.guidance_note() and not method.cfg_pass(defaults)


def test_the_schnell_teacher_is_guided_by_true_cfg_in_velocity_form(schnell_dir, monkeypatch):
    """FLUX.1-schnell (no embedding): F_teacher is TrigFlow's F of v_neg + 3.5 (v_c - v_neg), the empty prompt's
    velocity as the negative (FluxPipeline's true CFG), from one 4-row pass; the student has no guidance input and the
    export samples guidance-distilled at scale 1."""
    method = _scm(schnell_dir)
    cond, uncond = method.text_conditions({"caption": PROMPTS}, 2, "cpu")
    x_t = torch.randn(2, 4, RESOLUTION, RESOLUTION, generator=torch.Generator().manual_seed(2))
    t = torch.tensor([0.3, 1.0], dtype=torch.float64)
    c, s = tf.flow_view(t, 1.0)
    x, sv = x_t * c.float().view(-1, 1, 1, 1), s.float().view(-1, 1, 1, 1)
    with torch.no_grad():
        ours = method.teacher_F(x_t, t, cond, uncond)
        v_c, v_neg = (_teacher_velocity(method, x, s.float(), k, None) for k in (cond, uncond))
        v = v_neg + GUIDANCE * (v_c - v_neg)
        hand = tf.trigflow_from_x0_eps(x - sv * v, x + (1 - sv) * v, t, 1.0)
    torch.testing.assert_close(ours, hand, rtol=1e-5, atol=1e-5)
    assert (ours - tf.trigflow_from_x0_eps(x - sv * v_c, x + (1 - sv) * v_c, t, 1.0)).abs().max() > 1e-4
    calls = _spy(method, monkeypatch)
    method.loss(_batch(), torch.Generator().manual_seed(0))
    assert calls == [("teacher", 4, None), ("student", 2, None), ("student", 2, None)]
    defaults = method.call_defaults()
    assert (defaults["default_guidance_scale"], defaults["guidance_distilled"]) == (1.0, True)


@pytest.mark.parametrize("which", ["dev", "schnell"])
def test_the_flux_export_samples_the_methods_consistency_function_one_call_per_step(which, folders, tmp_path):
    """The in-memory DistillFluxPipeline with FlowMatchTrigFlowScheduler (FluxPipeline passes it sigmas and mu; only
    their count is read): 2 steps run 2 transformer calls at timesteps 1000 s(pi/2) = 1000 and 1000 s(1.1); its 1-step
    latent is the method's f(z, pi/2) of the same noise (packed and unpacked)."""
    from distill.diffusion.packing import unpack_latents

    method = _scm(folders[which]).eval()
    pipe = method.pipeline()
    assert type(pipe.scheduler).__name__ == "FlowMatchTrigFlowScheduler" and pipe.default_sample_size == RESOLUTION
    seen = []
    pipe(PROMPTS[0], generator=torch.Generator().manual_seed(0), output_type="latent",
         callback_on_step_end=lambda p, i, t, kw: seen.append(float(t)) or kw)
    assert seen == pytest.approx([1000.0, 1000 * float(tf.flow_view(torch.tensor([1.1]), 1.0)[1])], rel=1e-6)
    latents = pipe(PROMPTS[0], num_inference_steps=1, generator=torch.Generator().manual_seed(3),
                   output_type="latent").images
    z = pipe.prepare_latents(1, 4, RESOLUTION, RESOLUTION, torch.float32, "cpu", torch.Generator().manual_seed(3))[0]
    cond, _ = method.text_conditions({"caption": PROMPTS[:1]}, 1, "cpu")
    with torch.no_grad():
        f = method.consistency(method.student, unpack_latents(z, RESOLUTION, RESOLUTION),
                               torch.tensor([torch.pi / 2], dtype=torch.float64), cond)
    torch.testing.assert_close(unpack_latents(latents, RESOLUTION, RESOLUTION), f, rtol=1e-5, atol=1e-5)


def test_what_flux_cannot_honour_is_refused_before_compute(dev_dir):
    """No training resolution on Flux's resolution shift (the export's default size), and an odd latent side."""
    with pytest.raises(ValueError, match=r"method.resolution=None .*use_dynamic_shifting.*method.resolution=\$\{data"):
        _scm(dev_dir, resolution=None)
    with pytest.raises(ValueError, match="FluxPipeline packs 2x2 patches"):
        _scm(dev_dir, resolution=RESOLUTION + 1)


# ---------------------------------------------------------------- rCM


def test_rcm_on_flux_calls_the_real_score_at_the_embedded_guidance_and_the_fake_score_at_1(dev_dir, monkeypatch):
    """rCM on FLUX.1-dev: the student loss is sCM's plus the DMD term; the student's own sample and its F are at
    guidance input 3.5, the real score (the teacher) at 3.5 with no CFG pass, the fake score at 1 (DMD2's); the critic
    loss trains the fake score at 1. Its DMD times are shifted by mu of the training resolution."""
    method = _rcm_dev(dev_dir)
    assert method.mu is not None
    calls = _spy(method, monkeypatch)
    loss = method.loss(_batch(), torch.Generator().manual_seed(0))
    assert set(method._parts) == {"scm_loss", "dmd_loss"} and float(method._parts["dmd_loss"]) > 0
    torch.testing.assert_close(loss, method._parts["scm_loss"] + method._parts["dmd_loss"])
    assert {(role, tuple(g)) for role, _, g in calls} == {("teacher", (GUIDANCE,)), ("student", (GUIDANCE,)),
                                                         ("critic", (1.0,))}
    assert [role for role, n, _ in calls if role == "teacher"] == ["teacher", "teacher"]  # tangent, real score
    loss.backward()
    assert method.student.x_embedder.weight.grad.abs().sum() > 0
    calls.clear()
    critic = method.critic_loss(_batch(), torch.Generator().manual_seed(1))
    assert torch.isfinite(critic) and critic > 0 and calls[-1][0] == "critic" and calls[-1][2] == [1.0]


def _rcm_dev(folder):
    return _scm(folder, "rcm", dmd_weight=0.5, intermediate_times=[1.3, 1.0, 0.6])


# ---------------------------------------------------------------- the command line


FAST = ["callbacks.quality_cost=null", "data.batch_size=2", "trainer.max_steps=2", "trainer.limit_val_batches=0",
        "checkpoint.every_n_train_steps=2", "callbacks.samples=null", "sample_grid_seeds=0", "logger=csv",
        f"data.resolution={RESOLUTION}", "data.num_workers=0"]


def _train(tmp_path, exp: str, folder, *extra: str):
    run_dir = tmp_path / "run"
    proc = run_train(f"+exp={exp}", f"teacher.pretrained_model_name_or_path={folder}", *FAST, *extra,
                     f"hydra.run.dir={run_dir}", env={"OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("exp,which", [("scm_flux", "dev"), ("scm_flux", "schnell"), ("rcm_flux", "dev")])
def test_two_cli_steps_on_flux_export_a_student_sampled_from_a_fresh_process(exp, which, folders, tmp_path):
    """+exp=scm_flux / rcm_flux on the Flux stand-ins: two steps (w(t) trained; rCM's critic 4 updates a step), an
    export (DistillFluxPipeline, FlowMatchTrigFlowScheduler, the training side, guidance 3.5 on dev / distilled on
    schnell) whose default call in a fresh process runs one transformer call of 1 row per step at 1000 s(t) of the
    exported TrigFlow times, with finite, non-constant images of the training side."""
    run_dir = _train(tmp_path, exp, folders[which], "method.tangent_warmup_steps=1")
    state = safe_load(run_dir / "checkpoints" / "last.ckpt")
    assert state["global_step"] == 2 and state["state_dict"]["weighting.linear.weight"].abs().sum() > 0
    if exp == "rcm_flux":
        assert state["role_updates"] == {"student": 2, "critic": 8}
    export = run_dir / "export"
    index = json.loads((export / "model_index.json").read_text())
    assert index["_class_name"] == "DistillFluxPipeline"
    assert index["scheduler"] == ["distill.inference.trigflow_schedulers", "FlowMatchTrigFlowScheduler"]
    assert (index["default_guidance_scale"], index["guidance_distilled"], index["default_sample_size"]) == (
        (GUIDANCE, False, RESOLUTION) if which == "dev" else (1.0, True, RESOLUTION))
    info = json.loads((export / "distill.json").read_text())
    steps = index["default_num_inference_steps"]
    assert info["method"] == exp.split("_")[0] and len(info["trigflow_times"]) == steps
    got = _fresh_sample(export)
    assert (got["calls"], got["rows"]) == (steps, steps) and got["finite"] and got["std"] > 0
    assert got["shape"] == [1, 1, RESOLUTION, RESOLUTION] and got["scheduler"] == "FlowMatchTrigFlowScheduler"
    expected = 1000 * tf.flow_view(torch.tensor(info["trigflow_times"], dtype=torch.float64), 1.0)[1]
    assert got["timesteps"] == pytest.approx(expected.tolist(), rel=1e-5)


# ---------------------------------------------------------------- MeanFlow


def _meanflow(folder, **options):
    from distill.methods.meanflow import MeanFlowDistillation
    from distill.students.copies import copy_student

    options = {"resolution": RESOLUTION, "guidance_scale": GUIDANCE, **options}
    return MeanFlowDistillation(load_teacher(str(folder)), copy_student,
                                lambda params: torch.optim.Adam(params, lr=1e-4), **options)


@pytest.mark.parametrize("which", ["dev", "schnell"])
def test_the_meanflow_flux_student_starts_as_the_teachers_velocity_and_its_jvp_is_a_central_difference(which, folders):
    """MeanFlowFluxTransformer2DModel at init: u(z, r, t) equals the teacher's velocity v(z, t) bit for bit for any r
    (the interval embedding starts at zero), at the guidance input 3.5 on dev (where v is also the teacher's target
    velocity, one pass). After moving the interval embedder, r changes u, and the JVP of u along (dz, 0, 1) and along r
    alone equals a central difference in float64 (h = 1e-4, within 1e-2 relative)."""
    method = _meanflow(folders[which])
    assert type(method.student).__name__ == "MeanFlowFluxTransformer2DModel"
    cond, uncond = method.text_conditions({"caption": PROMPTS}, 2, "cpu")
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 4, RESOLUTION, RESOLUTION, generator=g)
    t, r = torch.tensor([0.8, 0.5], dtype=torch.float64), torch.tensor([0.2, 0.5], dtype=torch.float64)
    extra = method.guidance_kwargs(which == "dev", 2, "cpu")
    with torch.no_grad():
        u = method.average_velocity(method.student, z, r, t, cond)
        v = method.teacher_forward(z, t.float(), cond, **extra)
        assert torch.equal(u, v) and u.abs().max() > 0
        if which == "dev":
            assert torch.equal(method.teacher_velocity(z, t, cond, uncond), v)
        for p in method.student.interval_embedder.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    student = method.student.double()
    cond = {k: c.double() for k, c in cond.items()}
    z = z.double()
    fn = lambda z, r, t: method.average_velocity(student, z, r, t, cond)  # noqa: E731
    dz = torch.randn(z.shape, generator=g, dtype=torch.float64)
    with torch.no_grad():
        assert (fn(z, r, t) - fn(z, r - 0.1, t)).abs().max() > 1e-6
        for tangents in ((dz, torch.zeros_like(r), torch.ones_like(t)),
                         (torch.zeros_like(z), torch.ones_like(r), torch.zeros_like(t))):
            _, jvp = time_derivative(fn, (z, r, t), tangents, networks=[student])
            _, fd = time_derivative(fn, (z, r, t), tangents, "finite_difference", 1e-4)
            assert jvp.norm() > 0 and _relative(jvp, fd) < 1e-2, _relative(jvp, fd)


@pytest.mark.parametrize("which", ["dev", "schnell"])
def test_the_meanflow_loss_on_flux_is_the_weighted_residual_at_the_teachers_guidance(which, folders, monkeypatch):
    """The loss is the mean of sg(w) ||u - sg(v - (t - r) du/dt)||^2 recomputed from the method's terms; its gradient
    reaches the interval embedder; dev: the teacher is one 2-row pass at guidance 3.5 and the student runs at 3.5;
    schnell: the teacher is one 4-row (cond, empty prompt) pass for true CFG, no guidance input anywhere."""
    from distill.diffusion import meanflow as mf

    method = _meanflow(folders[which], ratio_r_neq_t=1.0)
    calls = _spy(method, monkeypatch)
    loss = method.loss(_batch(), torch.Generator().manual_seed(0))
    if which == "dev":
        assert calls == [("teacher", 2, [GUIDANCE]), ("student", 2, [GUIDANCE]), ("student", 2, [GUIDANCE])]
    else:
        assert calls == [("teacher", 4, None), ("student", 2, None), ("student", 2, None)]
    terms = method.meanflow_terms(_batch(), torch.Generator().manual_seed(0))
    with torch.no_grad():
        u = method.average_velocity(method.student, terms["z"], terms["r"], terms["t"], terms["cond"])
    torch.testing.assert_close(loss.detach(), mf.meanflow_loss(u, terms["target"]).mean())
    loss.backward()
    assert method.student.interval_embedder.linear_2.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("which", ["dev", "schnell"])
def test_the_meanflow_flux_export_passes_both_times_one_call_per_step(which, folders, tmp_path):
    """model_index.json names DistillMeanFlowFluxPipeline, MeanFlowFluxTransformer2DModel and
    FlowMatchMeanFlowScheduler, with the training side and (dev) guidance 3.5 as the call's defaults;
    from_pretrained(export)(prompt, 2 steps) calls the transformer twice with 1 row at timestep 1 and 0.5 (FluxPipeline's
    t / 1000 of 1000 t), intervals 500, 500 and the guidance input 3.5 (dev) or none, and returns the packed
    z_0 = z_1 - 0.5 u(z_1, 0.5, 1) - 0.5 u(z', 0, 0.5) recomputed by hand."""
    from diffusers import DiffusionPipeline

    import distill.inference.pipelines  # noqa: F401
    from distill.diffusion.packing import pack_latents, unpack_latents

    method = _meanflow(folders[which])
    with torch.no_grad():
        for p in method.student.interval_embedder.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    export = method.export(tmp_path / "export")
    index = json.loads((export / "model_index.json").read_text())
    assert index["_class_name"] == "DistillMeanFlowFluxPipeline"
    assert index["transformer"] == ["distill.models.meanflow", "MeanFlowFluxTransformer2DModel"]
    assert index["scheduler"] == ["distill.inference.meanflow", "FlowMatchMeanFlowScheduler"]
    dev = which == "dev"
    assert (index["default_num_inference_steps"], index["default_guidance_scale"], index["guidance_distilled"],
            index["default_sample_size"]) == (1, GUIDANCE if dev else 1.0, not dev, RESOLUTION)
    assert "DistillMeanFlowFluxPipeline" in (export / "README.md").read_text()
    pipe = DiffusionPipeline.from_pretrained(export)
    pipe.set_progress_bar_config(disable=True)
    calls = []
    pipe.transformer.register_forward_hook(lambda m, a, kw, out: calls.append(
        (len(kw["hidden_states"]), float(kw["timestep"][0]), float(kw["interval"][0]),
         None if kw["guidance"] is None else float(kw["guidance"][0]))), with_kwargs=True)
    z1 = torch.randn(1, 4, RESOLUTION, RESOLUTION, generator=torch.Generator().manual_seed(3))
    out = pipe(PROMPTS[0], num_inference_steps=2, latents=pack_latents(z1), output_type="latent").images
    guidance = GUIDANCE if dev else None
    assert calls == [(1, 1.0, 500.0, guidance), (1, 0.5, 500.0, guidance)]
    cond, _ = method.text_conditions({"caption": PROMPTS[:1]}, 1, "cpu")
    at = lambda v: torch.full((1,), v, dtype=torch.float64)  # noqa: E731
    with torch.no_grad():
        z = z1 - 0.5 * method.average_velocity(method.student, z1, at(0.5), at(1.0), cond)
        z = z - 0.5 * method.average_velocity(method.student, z, at(0.0), at(0.5), cond)
    torch.testing.assert_close(unpack_latents(out, RESOLUTION, RESOLUTION), z, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["dev", "schnell"])
def test_two_cli_steps_of_meanflow_flux_export_a_student_sampled_from_a_fresh_process(which, folders, tmp_path):
    """+exp=meanflow_flux on the Flux stand-ins: two steps move the interval embedder from zero; the export's default
    call in a fresh process runs one transformer call of 1 row (1 step, timestep 1000) with finite, non-constant
    images of the training side."""
    run_dir = _train(tmp_path, "meanflow_flux", folders[which], "method.ratio_r_neq_t=1.0")
    state = safe_load(run_dir / "checkpoints" / "last.ckpt")
    assert state["global_step"] == 2 and state["state_dict"]["student.interval_embedder.linear_2.weight"].abs().sum() > 0
    got = _fresh_sample(run_dir / "export")
    assert (got["calls"], got["rows"], got["timesteps"]) == (1, 1, [1000.0]) and got["finite"] and got["std"] > 0
    assert got["shape"] == [1, 1, RESOLUTION, RESOLUTION] and got["scheduler"] == "FlowMatchMeanFlowScheduler"
