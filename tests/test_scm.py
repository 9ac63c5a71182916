"""Continuous-time consistency distillation (method=scm, sCD of Lu & Song 2024): the JVP through each family's
denoiser against a central difference, the refusal of an attention processor without forward-mode AD, TrigFlow's
conversions round trip, the boundary f(x, 0) = x, the tangent on a Gaussian toy whose consistency function is known,
an exact resume (the weighting network included), and two CLI steps whose export samples as intended from a fresh
process on both embedded teachers."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from distill.diffusion import to_x0_eps
from distill.diffusion import trigflow as tf
from distill.diffusion.flow import flow_to_x0_eps
from distill.diffusion.jvp import time_derivative
from distill.diffusion.parametrization import prediction_target
from distill.families import load_teacher
from distill.utils.checkpoint import safe_load
from tests.conftest import ROOT, run_train
from tests.sd3_tiny import write_tiny_sd3
from tests.sd_tiny import write_tiny_sd

PROMPTS = ["a handwritten digit three", "a handwritten digit seven"]


@pytest.fixture(scope="module")
def sd_dir(tmp_path_factory):
    return write_tiny_sd(tmp_path_factory.mktemp("sd") / "pipe")


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    return write_tiny_sd3(tmp_path_factory.mktemp("sd3") / "pipe")


def _method(folder, **options):
    from distill.methods.scm import ContinuousTimeConsistencyDistillation
    from distill.students.copies import copy_student

    return ContinuousTimeConsistencyDistillation(load_teacher(str(folder)), copy_student,
                                                 lambda params: torch.optim.Adam(params, lr=1e-4), **options)


def _batch():
    return {"pixel_values": torch.linspace(-1, 1, 2 * 32 * 32).reshape(2, 1, 32, 32), "caption": PROMPTS}


def _inputs(family, network, seed: int = 0):
    """Random float64 (x, cond) of the network's native shapes, and a random tangent of x."""
    g = torch.Generator().manual_seed(seed)
    x, _, cond = family.example_inputs(network, 2)
    x = torch.randn(x.shape, generator=g, dtype=torch.float64)
    cond = {k: torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in cond.items()}
    return x, cond, torch.randn(x.shape, generator=g, dtype=torch.float64)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# ---------------------------------------------------------------- the JVP through each family's denoiser


@pytest.mark.parametrize("which", ["sd", "sd3"])
def test_jvp_through_each_familys_denoiser_equals_a_central_difference(which, sd_dir, sd3_dir):
    """torch.func.jvp (math SDPA backend) through the UNet with cross-attention and the SD3 joint transformer, in
    float64, against (F(p + h d) - F(p - h d)) / 2h: along x alone (h = 1e-3) within 1e-4 relative; along (x, time)
    (h = 1e-4 timesteps) within 1e-2, the bound set by diffusers' time embedding, which runs in float32 (measured:
    2.3e-3 on the UNet, 1.1e-3 on SD3; 1e-8 / 2e-6 along x)."""
    teacher = load_teacher(str(sd_dir if which == "sd" else sd3_dir))
    family, net = teacher.family, teacher.denoiser.double()
    x, cond, dx = _inputs(family, net)
    time = torch.tensor([0.3, 0.6], dtype=torch.float64) * (1.0 if family.flow_matching else 1000.0)
    fn = lambda x, s: family.denoise(net, x, s, cond)  # noqa: E731
    with torch.no_grad():
        for dt, h, rtol in ((0.0, 1e-3, 1e-4), (1.0, 1e-4, 1e-2)):
            tangents = (dx, torch.full_like(time, dt))
            out, jvp = time_derivative(fn, (x, time), tangents, networks=[net])
            ref, fd = time_derivative(fn, (x, time), tangents, "finite_difference", h)
            torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)  # the math backend's attention, the same
            assert jvp.norm() > 0
            assert _relative(jvp, fd) < rtol, (which, dt, _relative(jvp, fd))


class FlashKernelProcessor:
    """An attention processor pinned to PyTorch's fused CPU flash kernel (as an xFormers processor pins its own):
    attention without a forward-mode AD rule."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        n, heads = hidden_states.shape[0], attn.heads
        q, k, v = (y.view(n, -1, heads, y.shape[-1] // heads).transpose(1, 2)
                   for y in (attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context)))
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)[0]
        return attn.to_out[1](attn.to_out[0](out.transpose(1, 2).reshape(n, -1, heads * out.shape[-1])))


def test_a_processor_without_forward_ad_is_refused_naming_the_fix_and_finite_difference_runs(sd_dir):
    """The student's attention through a fused kernel: method.jvp=autograd refuses, naming the processor, the
    JVP-capable one and method.jvp=finite_difference; the finite difference trains on the same processor."""
    method = _method(sd_dir, tangent_warmup_steps=0)
    method.student.set_attn_processor(FlashKernelProcessor())
    with pytest.raises(ValueError, match=r"forward-mode AD.*_scaled_dot_product_flash_attention_for_cpu.*"
                                         r"FlashKernelProcessor.*AttnProcessor2_0.*method.jvp=finite_difference"):
        method.loss(_batch(), torch.Generator().manual_seed(0))
    method.jvp = "finite_difference"
    loss = method.loss(_batch(), torch.Generator().manual_seed(0))
    loss.backward()
    assert torch.isfinite(loss) and method.student.conv_in.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------- TrigFlow


@pytest.mark.parametrize("sigma_d", [0.5, 1.0])
@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "flow_prediction"])
def test_a_teachers_prediction_converted_to_trigflow_and_back_is_the_identity(prediction_type, sigma_d):
    """pred -> (x0, eps) at the teacher-space sample c x_t -> F -> (x0, eps) -> pred, float64, within 1e-12; and the
    teacher-space sample is the TrigFlow one: c x_t = a x0 + b eps with the teacher's own (a, b)."""
    g = torch.Generator().manual_seed(0)
    t = torch.tensor([1e-3, 0.4, 1.0, 1.5], dtype=torch.float64)
    x0, eps, pred = (torch.randn(4, 3, 5, generator=g, dtype=torch.float64) for _ in range(3))
    x_t = tf.trigflow_sample(x0, sigma_d * eps, t)
    b = lambda v: v.view(-1, 1, 1)  # noqa: E731
    if prediction_type == "flow_prediction":
        c, s = tf.flow_view(t, sigma_d)
        torch.testing.assert_close(b(c) * x_t, (1 - b(s)) * x0 + b(s) * eps, rtol=0, atol=1e-12)
        to = lambda p: flow_to_x0_eps(prediction_type, p, b(c) * x_t, b(s))  # noqa: E731
        back = lambda x0, eps: eps - x0  # noqa: E731
    else:
        c, alpha, sigma = tf.vp_view(t, sigma_d)
        torch.testing.assert_close(b(c) * x_t, b(alpha) * x0 + b(sigma) * eps, rtol=0, atol=1e-12)
        torch.testing.assert_close(alpha ** 2 + sigma ** 2, torch.ones_like(t), rtol=0, atol=1e-14)
        to = lambda p: to_x0_eps(prediction_type, p, b(c) * x_t, b(alpha), b(sigma))  # noqa: E731
        back = lambda x0, eps: prediction_target(prediction_type, x0, eps, b(alpha), b(sigma))  # noqa: E731
    F = tf.trigflow_from_x0_eps(*to(pred), t, sigma_d)
    torch.testing.assert_close(back(*tf.x0_eps_from_trigflow(F, x_t, t, sigma_d)), pred, rtol=0, atol=1e-12)
    # the true (x0, eps) give the path's own velocity: sigma_d F = cos t z - sin t x0
    F_true = tf.trigflow_from_x0_eps(x0, eps, t, sigma_d)
    torch.testing.assert_close(sigma_d * F_true, tf.trigflow_velocity(x0, sigma_d * eps, t), rtol=0, atol=1e-12)
    torch.testing.assert_close(tf.consistency_function(x_t, F_true, t, sigma_d), x0, rtol=0, atol=1e-12)


@pytest.mark.parametrize("which", ["sd", "sd3"])
def test_the_consistency_function_is_the_identity_at_t_0_exactly(which, sd_dir, sd3_dir):
    """f(x, 0) = x bit for bit through the student (its output multiplied by sin 0 = 0), for any x."""
    method = _method(sd_dir if which == "sd" else sd3_dir)
    cond, _ = method.text_conditions({"caption": PROMPTS}, 2, "cpu")
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0)) * 3
    with torch.no_grad():
        f0 = method.consistency(method.student, x, torch.zeros(2, dtype=torch.float64), cond)
        f1 = method.consistency(method.student, x, torch.full((2,), 0.5, dtype=torch.float64), cond)
    assert torch.equal(f0, x) and not torch.allclose(f1, x)


# ---------------------------------------------------------------- a Gaussian toy with a known consistency function


def test_the_scd_tangent_on_a_gaussian_toy_is_the_analytic_derivative_and_vanishes_on_the_exact_model():
    """Data N(0, s^2): the PF-ODE carries x_t = m(t) u with m^2 = cos^2 t s^2 + sin^2 t sigma_d^2, the teacher's F* is
    Tweedie's, and the exact consistency function is f = s x / m(t). With F of that f as the student: the JVP of F
    along (sigma_d F*, 1) equals the closed-form d/dt of F(m(t) u, t) = u (cos t m - s) / (sigma_d sin t), and sCM's
    tangent g = cos(t) df/dt (r = 1, unnormalised) is 0, both to 1e-12 in float64."""
    s, sigma_d = 0.7, 0.5
    t = torch.tensor([0.05, 0.3, 0.8, 1.2, 1.5], dtype=torch.float64)
    u = torch.randn(5, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    m = lambda t: (t.cos() ** 2 * s ** 2 + t.sin() ** 2 * sigma_d ** 2).sqrt()  # noqa: E731
    bt = lambda v: v.view(-1, 1)  # noqa: E731

    def teacher_F(x, t):  # Tweedie: E[x0 | x_t], E[eps | x_t] of the Gaussian
        x0 = bt(t.cos() * s ** 2 / m(t) ** 2) * x
        eps = bt(sigma_d * t.sin() / m(t) ** 2) * x
        return tf.trigflow_from_x0_eps(x0, eps, t, sigma_d)

    def student_F(x, t):  # F of the exact consistency function f = s x / m(t)
        return (bt(t.cos()) * x - bt(s / m(t)) * x) / (sigma_d * bt(t.sin()))

    x_t = bt(m(t)) * u
    dx_dt = sigma_d * teacher_F(x_t, t)
    m_dot = t.sin() * t.cos() * (sigma_d ** 2 - s ** 2) / m(t)
    torch.testing.assert_close(dx_dt, bt(m_dot) * u, rtol=0, atol=1e-12)  # the teacher's F* is the PF-ODE's
    F, dF = time_derivative(student_F, (x_t, t), (dx_dt, torch.ones_like(t)))
    sin, cos = t.sin(), t.cos()
    analytic = ((-sin * m(t) + cos * m_dot) * sin - (cos * m(t) - s) * cos) / (sigma_d * sin ** 2)
    torch.testing.assert_close(dF, bt(analytic) * u, rtol=1e-12, atol=1e-12)
    g = tf.scm_tangent(F, dF, x_t, dx_dt, t, sigma_d, r=1.0)
    torch.testing.assert_close(g, torch.zeros_like(g), rtol=0, atol=1e-12)
    # a student off the consistency function (f = 0.9 s x / m) gets a tangent that does not vanish
    _, dF_off = time_derivative(lambda x, t: student_F(x, t) + bt(0.1 * s / m(t) / (sigma_d * t.sin())) * x,
                                (x_t, t), (dx_dt, torch.ones_like(t)))
    assert tf.scm_tangent(F, dF_off, x_t, dx_dt, t, sigma_d).abs().max() > 1e-3


@pytest.mark.parametrize("sigma_d", [0.5, 1.0])
def test_the_time_proposal_draws_the_papers_noise_to_signal_ratios_at_any_sigma_d(sd_dir, sigma_d):
    """sCM states P_mean = -0.8, P_std = 1.6 for data of std sigma_d = 0.5: the median sigma / sigma_d is
    e^-0.8 / 0.5 = 0.90. On SD-format latents (sigma_d = 1) the same ratios need log sigma's mean at -0.8 + log 2 (it
    was -0.8: median ratio 0.45, half the paper's noise). The draws' median of tan t = sigma / sigma_d is the
    truncated lognormal's, truncated to the teacher's noise range, computed here from the paper's own numbers."""
    import math

    from scipy.stats import norm

    method = _method(sd_dir, sigma_data=sigma_d)
    assert method.proposal_mean == pytest.approx(-0.8 + math.log(sigma_d / 0.5), abs=1e-12)
    ratio = method.draw_trigflow_times(40_000, torch.Generator().manual_seed(0)).tan()
    lo, hi = (v / sigma_d for v in method.noise_range())  # the range as ratios sigma / sigma_d
    paper = (math.log(0.5 * lo) + 0.8) / 1.6, (math.log(0.5 * hi) + 0.8) / 1.6  # the paper's z of the two ends
    median = math.exp(-0.8 + 1.6 * norm.ppf((norm.cdf(paper[0]) + norm.cdf(paper[1])) / 2)) / 0.5
    assert float(ratio.median()) == pytest.approx(median, rel=0.03)
    assert 0.7 < median < 1.0  # about the paper's untruncated 0.90


def test_the_tangent_stabilisers_and_the_adaptive_weighting_are_the_papers():
    """Warm-up r = min(1, step / H); g / (||g|| + c) per example; loss e^w / D ||F - F- - g||^2 - w, whose minimum in
    w is at e^w = D / ||.||^2 (the weighting learns the inverse loss scale); w(t) starts at 0."""
    assert [tf.tangent_warmup(k, 4) for k in (0, 1, 4, 9)] == [0.0, 0.25, 1.0, 1.0] and tf.tangent_warmup(0, 0) == 1.0
    g = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    torch.testing.assert_close(tf.normalize_tangent(g, 0.1), torch.tensor([[3 / 5.1, 4 / 5.1], [0.0, 0.0]]))
    F, F_minus = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.0, 0.0]])
    w = torch.tensor([0.3], requires_grad=True)
    loss = tf.scm_loss(F, F_minus, torch.zeros_like(F), w)
    torch.testing.assert_close(loss, torch.tensor([math.exp(0.3) * 5 / 2 - 0.3]))
    (grad,) = torch.autograd.grad(loss.sum(), w)
    torch.testing.assert_close(grad, torch.tensor([math.exp(0.3) * 5 / 2 - 1]))
    weighting = tf.AdaptiveWeighting(16, 0.5)
    assert torch.equal(weighting(torch.tensor([0.1, 1.0])), torch.zeros(2))


def test_the_export_samples_one_call_per_step_at_the_trigflow_times(sd_dir, tmp_path):
    """The 2-step export of a VP student: TrigFlowScheduler in model_index.json; from_pretrained(export)(prompt) runs
    2 UNet calls of 1 row at the VP timesteps of t_max = arctan(sigma_max / sigma_d) and 1.1; the stock
    StableDiffusionPipeline with the card's call gives the same images; a scheduler step is the method's own f."""
    from diffusers import DiffusionPipeline

    from distill.diffusion.schedules import vp_timestep
    from distill.metrics.cost import NFECounter

    method = _method(sd_dir).eval()
    export = method.export(tmp_path / "export")
    index = json.loads((export / "model_index.json").read_text())
    assert index["scheduler"] == ["distill.inference.trigflow_schedulers", "TrigFlowScheduler"]
    assert index["default_num_inference_steps"] == 2 and index["guidance_distilled"] is True
    info = json.loads((export / "distill.json").read_text())
    t_max = math.atan(float(method.schedule.ve_sigmas[-1]))
    assert info["trigflow_times"] == [pytest.approx(t_max), 1.1] and info["sampling"]["nfe_per_step"] == 1
    pipe = DiffusionPipeline.from_pretrained(export)
    pipe.set_progress_bar_config(disable=True)
    seen = []
    with NFECounter(pipe.unet) as counter:
        pipe(PROMPTS[0], generator=torch.Generator().manual_seed(0), output_type="latent",
             callback_on_step_end=lambda p, i, t, kw: seen.append(float(t)) or kw)
    expected = vp_timestep(torch.tensor([t_max, 1.1], dtype=torch.float64).tan(), method.schedule.ve_sigmas)
    assert (counter.calls, counter.examples) == (2, 2) and seen == pytest.approx(expected.tolist(), rel=1e-6)
    # the card's stock call: diffusers' StableDiffusionPipeline on the same folder samples the same images
    from diffusers import StableDiffusionPipeline

    ours = pipe(PROMPTS[0], generator=torch.Generator().manual_seed(0), output_type="pt").images
    stock = StableDiffusionPipeline.from_pretrained(export)
    stock.set_progress_bar_config(disable=True)
    assert "num_inference_steps=2, guidance_scale=1.0" in (export / "README.md").read_text()
    theirs = stock(PROMPTS[0], num_inference_steps=2, guidance_scale=1.0, generator=torch.Generator().manual_seed(0),
                   output_type="pt").images
    assert type(stock.scheduler).__name__ == "TrigFlowScheduler" and torch.equal(ours, theirs)
    # one step of the scheduler is the method's f (sigma_d = 1: the VP sample at t is the TrigFlow sample)
    scheduler = method.sampling_scheduler()
    cond, _ = method.text_conditions({"caption": PROMPTS[:1]}, 1, "cpu")
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = method.family.denoise(method.student, x, scheduler.timesteps[:1], cond)
        f = method.consistency(method.student, x, torch.tensor([t_max], dtype=torch.float64), cond)
    torch.testing.assert_close(scheduler.step(out, scheduler.timesteps[0], x).denoised, f, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the command line


FAST = ["callbacks.quality_cost=null", "data.batch_size=2", "trainer.max_steps=2", "trainer.limit_val_batches=0",
        "checkpoint.every_n_train_steps=2", "callbacks.samples=null", "sample_grid_seeds=0", "logger=csv",
        "method.tangent_warmup_steps=1"]

FRESH = """
import json, sys, torch
import distill.inference.pipelines  # noqa: F401  (what loading any distill export needs)
from diffusers import DiffusionPipeline
from distill.metrics.cost import NFECounter
pipe = DiffusionPipeline.from_pretrained(sys.argv[1]); pipe.set_progress_bar_config(disable=True)
net = getattr(pipe, "unet", None) or pipe.transformer
seen = []
torch.manual_seed(0)
with NFECounter(net) as counter:
    images = pipe("a handwritten digit seven", generator=torch.Generator().manual_seed(0), output_type="pt",
                  callback_on_step_end=lambda p, i, t, kw: seen.append(float(t)) or kw).images
print(json.dumps({"calls": counter.calls, "rows": counter.examples, "timesteps": seen,
                  "scheduler": type(pipe.scheduler).__name__, "shape": list(images.shape),
                  "finite": bool(torch.isfinite(images).all()), "std": float(images.std())}))
"""


def _fresh_sample(export) -> dict:
    """``DiffusionPipeline.from_pretrained(export)(prompt)`` in a new interpreter, as a user runs it."""
    proc = subprocess.run([sys.executable, "-c", FRESH, str(export)], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("exp", ["scm", "scm_flow"])
def test_two_cli_steps_export_a_student_that_samples_two_calls_from_a_fresh_process(exp, tmp_path):
    """+exp=scm on the embedded UNet teacher, +exp=scm_flow on teacher=digits_flow: two steps, the weighting network
    in the checkpoint and moved by the steps, an export whose default call in a fresh process runs 2 denoiser calls
    of 1 row at the exported TrigFlow times' network timesteps, with finite, non-constant images."""
    run_dir = tmp_path / "run"
    extra = ["teacher=digits_flow"] if exp == "scm_flow" else []
    proc = run_train(f"+exp={exp}", *extra, *FAST, f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = safe_load(run_dir / "checkpoints" / "last.ckpt")
    assert state["global_step"] == 2
    assert {k.split(".")[0] for k in state["state_dict"]} == {"student", "weighting"}
    assert state["state_dict"]["weighting.linear.weight"].abs().sum() > 0  # w(t) trained (it starts at 0)
    info = json.loads((run_dir / "export" / "distill.json").read_text())
    got = _fresh_sample(run_dir / "export")
    assert got["calls"] == 2 and got["rows"] == 2 and got["finite"] and got["std"] > 0
    assert got["shape"] == [1, 1, 32, 32]
    times = torch.tensor(info["trigflow_times"], dtype=torch.float64)
    if exp == "scm_flow":
        assert got["scheduler"] == "FlowMatchTrigFlowScheduler" and info["t_max_is_pi_over_2"]
        expected = 1000 * tf.flow_view(times, 1.0)[1]  # flow time s(t) = sin t / (cos t + sin t)
    else:
        from distill.diffusion.schedules import vp_timestep
        from distill.inference.trigflow_schedulers import TrigFlowScheduler

        assert got["scheduler"] == "TrigFlowScheduler" and times[1] == 1.1
        scheduler = TrigFlowScheduler.from_pretrained(run_dir / "export", subfolder="scheduler")
        expected = vp_timestep(times.tan(), scheduler.ve_sigmas)  # sigma_d = 1: noise level tan t
    assert got["timesteps"] == pytest.approx(expected.tolist(), rel=1e-5)


RESUME = ["+exp=scm", "callbacks.quality_cost=null", "data.batch_size=4", "trainer.limit_val_batches=0",
          "checkpoint.every_n_train_steps=1", "checkpoint.save_top_k=-1", "callbacks.samples=null",
          "sample_grid_seeds=0", "logger=csv", "export=false", "callbacks.progress=null", "trainer.log_every_n_steps=1",
          "method.tangent_warmup_steps=3", "method.lr_scheduler.total_steps=4", "method.lr_scheduler.warmup_steps=2"]


def test_a_stopped_run_resumed_is_bit_identical_with_its_weighting_network(tmp_path):
    """4 steps straight against 2 steps then ``ckpt_path=last`` to 4 (the tangent warm-up across the stop): the last
    checkpoints hold the same bits for the student, the weighting network w(t), the optimizer (both networks'
    moments), the LR schedule and the EMA."""
    from tests.test_resilience import _assert_same_state

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for run_dir, extra in ((straight, ["trainer.max_steps=4"]), (resumed, ["trainer.max_steps=2"]),
                           (resumed, ["trainer.max_steps=4", "ckpt_path=last"])):
        proc = run_train(*RESUME, *extra, f"hydra.run.dir={run_dir}")
        assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = (safe_load(d / "checkpoints" / "last.ckpt") for d in (straight, resumed))
    assert a["global_step"] == b["global_step"] == 4
    assert any(k.startswith("weighting.") for k in a["state_dict"])
    for key in ("state_dict", "optimizer_states", "lr_schedulers"):
        _assert_same_state(a[key], b[key], key)
    ema = [k for k in a["callbacks"] if k.startswith("EMA")]
    assert ema
    for key in ema:
        _assert_same_state(a["callbacks"][key], b["callbacks"][key], key)


# ---------------------------------------------------------------- rCM: sCD + DMD2's distribution matching


def _rcm(folder, **options):
    from distill.methods.rcm import ScoreRegularizedConsistencyDistillation
    from distill.students.copies import copy_student

    adam = lambda params: torch.optim.Adam(params, lr=1e-4)  # noqa: E731
    return ScoreRegularizedConsistencyDistillation(load_teacher(str(folder)), copy_student, adam, adam, **options)


def test_rcm_reuses_dmd2s_critic_and_its_dmd_term_vanishes_where_the_scores_agree(sd_dir):
    """rCM's fake score, real/fake x0, time draw and critic loss are DMD2's functions themselves; with the fake score a
    copy of the teacher and guidance 1 the DMD loss is 0 (real x0 = fake x0; below 1e-10), at guidance 3 it is not; the
    student loss is sCM's plus dmd_weight times it, and with dmd_weight 0 it is sCM's, draw for draw."""
    from distill.methods.dmd2 import DistributionMatchingDistillation as DMD2
    from distill.methods.rcm import ScoreRegularizedConsistencyDistillation as RCM

    for name in ("_fake_score", "real_x0", "fake_x0", "draw_times", "critic_loss"):
        assert getattr(RCM, name) is getattr(DMD2, name)
    method = _rcm(sd_dir, guidance_scale=1.0, dmd_weight=0.5, tangent_warmup_steps=0)
    assert list(method.roles) == ["student", "critic"] and not method.automatic_optimization
    cond, uncond = method.text_conditions({"caption": PROMPTS}, 2, "cpu")
    x_real = method.latents(_batch(), torch.Generator().manual_seed(0))
    # 0 up to the summation order of a 2-row (cond, uncond) teacher batch against the fake score's 1-row batch
    assert method.dmd_term(x_real, cond, uncond, torch.Generator().manual_seed(1)) < 1e-10
    loss = method.loss(_batch(), torch.Generator().manual_seed(2))
    assert set(method._parts) == {"scm_loss", "dmd_loss"} and float(method._parts["dmd_loss"]) < 1e-10
    method.guidance_scale = method.real_guidance_scale = 3.0
    assert method.dmd_term(x_real, cond, uncond, torch.Generator().manual_seed(1)) > 1e-4
    loss = method.loss(_batch(), torch.Generator().manual_seed(2))
    torch.testing.assert_close(loss, method._parts["scm_loss"] + method._parts["dmd_loss"])
    scm = _method(sd_dir, guidance_scale=3.0, tangent_warmup_steps=0)
    scm.student.load_state_dict(method.student.state_dict())
    method.dmd_weight = 0.0
    torch.testing.assert_close(method.loss(_batch(), torch.Generator().manual_seed(2)),
                               scm.loss(_batch(), torch.Generator().manual_seed(2)), rtol=0, atol=0)
    critic = method.critic_loss(_batch(), torch.Generator().manual_seed(3))
    assert torch.isfinite(critic) and critic > 0


def test_rcms_dmd_term_keeps_its_weight_against_the_learned_weighting_and_waits_for_the_warm_up(sd_dir):
    """The DMD term is dmd_weight x 2 e^{w} x DMD2's loss (the sCM times' mean weight, detached): at w = 0 that is
    2 x, at w = 1 2e x, the same draws; before the tangent warm-up ends there is no DMD term (rCM's code)."""
    method = _rcm(sd_dir, guidance_scale=3.0, dmd_weight=0.5, tangent_warmup_steps=0)

    def dmd_alone(seed):
        g = torch.Generator().manual_seed(seed)
        terms = method.scm_terms(_batch(), g)
        return method.dmd_term(terms["x0"], terms["cond"], terms["uncond"], g)

    for bias, scale in ((0.0, 2.0), (1.0, 2 * math.e)):
        with torch.no_grad():
            method.weighting.linear.bias.fill_(bias)
        method.loss(_batch(), torch.Generator().manual_seed(5))
        torch.testing.assert_close(method._parts["dmd_loss"], 0.5 * scale * dmd_alone(5).detach(), rtol=1e-5, atol=0)
    waiting = _rcm(sd_dir, guidance_scale=3.0, dmd_weight=0.5, tangent_warmup_steps=5)
    waiting.loss(_batch(), torch.Generator().manual_seed(5))
    assert set(waiting._parts) == {"scm_loss"} and not waiting.dmd_active()


def test_rcms_one_step_sample_is_the_exports_one_step_sample(sd_dir):
    """The student's sample at step 0 of its own sampler (what the DMD term scores) is f(z / c(t_max), t_max), the
    latent that the 1-step export's TrigFlowScheduler gives from the same initial noise z."""
    method = _rcm(sd_dir).eval()
    cond, _ = method.text_conditions({"caption": PROMPTS[:1]}, 1, "cpu")
    x_real = torch.zeros(1, 4, 8, 8)
    with torch.no_grad():
        x = method.generator_sample(x_real, cond, torch.Generator().manual_seed(4), step=0)
    z = torch.randn(x_real.shape, generator=torch.Generator().manual_seed(4))
    method.sampling["num_inference_steps"] = 1
    pipe = method.pipeline()
    out = pipe(prompt_embeds=cond["encoder_hidden_states"], latents=z.clone(), output_type="latent").images
    torch.testing.assert_close(out, x, rtol=1e-5, atol=1e-5)


def test_two_cli_steps_of_rcm_train_the_critic_and_export(tmp_path):
    """+exp=rcm on the embedded UNet teacher: two student steps with four critic updates each; the checkpoint holds the
    student, the weighting network and the critic (DMD2's fake score) and the role counts; the export samples."""
    run_dir = tmp_path / "run"
    proc = run_train("+exp=rcm", *FAST, f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = safe_load(run_dir / "checkpoints" / "last.ckpt")
    assert {k.split(".")[0] for k in state["state_dict"]} == {"student", "weighting", "critic"}
    assert state["role_updates"] == {"student": 2, "critic": 8} and len(state["optimizer_states"]) == 2
    assert json.loads((run_dir / "export" / "distill.json").read_text())["method"] == "rcm"
