"""ECT (Geng et al. 2024) on a flow-matching teacher (the SD3 stand-in, tests/sd3_tiny.py): the pair (t, r) against
ECT's mapping in noise levels sigma written out and converted to flow time sigma / (1 + sigma), the network's inputs
on the straight path with one eps for both points, the loss and its gradient against a hand computation (f = x_t - t v,
stop-gradient at r, the weight (1 - t)(1 - r) / (t - r) in flow times), the boundary f(x0, 0) = x0 bit for bit,
FlowMatchLCMScheduler's step as the trained f, and two training steps through the CLI whose export samples through
DiffusionPipeline.from_pretrained and the stock StableDiffusion3Pipeline."""

from __future__ import annotations

import csv
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline, FlowMatchLCMScheduler
from scipy.stats import norm

import distill.inference.pipelines  # noqa: F401  (registers distill's export classes, as a user loading an export does)
from distill.families import load_teacher
from tests.conftest import run_train
from tests.sd3_tiny import SD3_SHIFT, write_tiny_sd3
from tests.test_consistency_flow import _transformer, stock_sd3

PROMPT = "a handwritten digit three"
T = 1000  # the stand-in scheduler's num_train_timesteps


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    return write_tiny_sd3(tmp_path_factory.mktemp("sd3") / "pipe")


def _method(folder, build=None, **options):
    from distill.methods.consistency_training import ConsistencyTraining
    from distill.students.copies import copy_student

    return ConsistencyTraining(load_teacher(str(folder)), build or copy_student,
                               optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                               **{"curriculum_steps": 100, **options})


@pytest.fixture(scope="module")
def method(sd3_dir):
    return _method(sd3_dir).eval()


def _by_hand_sigmas(u: np.ndarray, lo: float = 1 / (T - 1), hi: float = T - 1.0) -> np.ndarray:
    """ECT's lognormal(-1.1, 2) conditioned on [lo, hi] at the unit points u (inverse CDF in log sigma)."""
    a, b = (norm.cdf((np.log(v) + 1.1) / 2.0) for v in (lo, hi))
    return np.exp(-1.1 + 2.0 * norm.ppf(a + (b - a) * u))


def _by_hand_r(sigma: np.ndarray, stage: int) -> np.ndarray:
    """ECT's r = t (1 - (1 + 8 sigmoid(-t)) / 2^(stage + 1)) in noise levels, clamped at 0 (q 2, k 8, b 1)."""
    return np.clip(sigma * (1 - (1 + 8 / (1 + np.exp(sigma))) / 2 ** (stage + 1)), 0, None)


def test_the_pair_is_ects_mapping_in_sigma_converted_to_flow_time(method):
    """Step 25 of a 100-step curriculum in 8 stages (stage 2): t is ECT's lognormal noise level truncated to the
    levels of flow times 1/T and 1 - 1/T (1/999 and 999), r its mapping; as flow times sigma / (1 + sigma) both lie in
    [1/T, 1 - 1/T], 0 < r < t, and 1 / (sigma_t - sigma_r) = (1 - t)(1 - r) / (t - r)."""
    assert method.flow and method.noise_range() == pytest.approx((1 / (T - 1), T - 1.0), rel=1e-12)
    r, t, bins, iw = method.ect_pairs(4096, 25, torch.Generator().manual_seed(0))
    assert bins is None and iw is None and t.dtype == r.dtype == torch.float64
    u = torch.rand(4096, generator=torch.Generator().manual_seed(0), dtype=torch.float64).numpy()
    sigma = _by_hand_sigmas(u)
    np.testing.assert_allclose(t.numpy(), sigma, rtol=1e-9)
    np.testing.assert_allclose(r.numpy(), _by_hand_r(sigma, 2), rtol=1e-9, atol=1e-12)
    assert bool((r > 0).all())  # stage 2: n(t) / 2^3 <= 5 / 8, no pair reaches the data (step 0's do: next test)
    t_f, r_f = t / (1 + t), r / (1 + r)
    assert t_f.min() >= 1 / T - 1e-12 and t_f.max() <= 1 - 1 / T + 1e-12 and bool((r_f < t_f).all())
    torch.testing.assert_close(1 / (t - r), (1 - t_f) * (1 - r_f) / (t_f - r_f), rtol=1e-9, atol=0)


class _Linear(torch.nn.Module):
    """A two-parameter stand-in for the transformer that records its inputs: velocity = w x + b (timestep / 1000)
    mean(pooled_projections), so f depends on the input, the time and the prompt."""

    def __init__(self):
        super().__init__()
        self.w, self.b = torch.nn.Parameter(torch.tensor(0.7)), torch.nn.Parameter(torch.tensor(0.3))
        self.calls = []

    def forward(self, hidden_states, timestep, encoder_hidden_states=None, pooled_projections=None):
        self.calls.append((hidden_states.detach().clone(), timestep.detach().clone()))
        cond = pooled_projections.float().mean(1).view(-1, 1, 1, 1)
        return SimpleNamespace(sample=self.w * hidden_states + self.b * (timestep.float() / 1000).view(-1, 1, 1, 1) * cond)


@pytest.mark.parametrize("step, max_steps", [(0, 1_000), (600, 1_000)])
def test_the_loss_and_its_gradient_against_a_hand_computation(sd3_dir, step, max_steps):
    """ConsistencyTraining.loss on the flow teacher against ECT written out in flow terms: x0 from the batch's
    latents ((mean - shift_factor) scaling_factor); sigma_t and r as above, at flow times t = sigma / (1 + sigma);
    one eps, the network's inputs x_t = (1 - t) x0 + t eps and x_r = (1 - r) x0 + r eps at timesteps 1000 t and
    1000 r; f = x - t v; f_r = x0 where r = 0 (the network is not run there), else f at r under stop-gradient; loss =
    mean ||f_t - f_r|| (1 - t)(1 - r) / (t - r). The gradient is that of f_t alone (one through f_r differs)."""
    method = _method(sd3_dir, curriculum_steps=None)  # the stages from trainer.max_steps, the default
    method.student = student = _Linear()
    method._trainer = SimpleNamespace(global_step=step, max_steps=max_steps)  # what loss reads of the Trainer
    n, seed = 8, 3
    mean = torch.randn(n, 4, 8, 8, generator=torch.Generator().manual_seed(7))
    batch = {"latent_mean": mean, "latent_std": torch.zeros_like(mean), "caption": [PROMPT] * n}
    loss = method.loss(batch, torch.Generator().manual_seed(seed))
    loss.backward()
    got_grad = torch.stack([student.w.grad, student.b.grad])

    # by hand, drawing in the loss's order: the latent posterior's noise, sigma_t, then eps
    g = torch.Generator().manual_seed(seed)
    torch.randn(mean.shape, generator=g)  # the posterior draw (std 0: x0 is the mean)
    vae = method.vae.config
    x0 = (mean - vae.shift_factor) * vae.scaling_factor
    sigma_t = _by_hand_sigmas(torch.rand(n, generator=g, dtype=torch.float64).numpy())
    sigma_r = _by_hand_r(sigma_t, 8 * step // max_steps)
    eps = torch.randn(x0.shape, generator=g)
    live = sigma_r > 0
    assert live.any() and (step > 0 or not live.all())  # step 0: both branches in the batch
    t, r = sigma_t / (1 + sigma_t), sigma_r / (1 + sigma_r)
    pooled = method.conditioner(batch)["pooled_projections"].float().mean(1).view(-1, 1, 1, 1)
    b = (-1, 1, 1, 1)

    def on_path(time):  # the straight path's point at flow time ``time`` (numpy (m,)) of the shared eps
        s = torch.tensor(time, dtype=torch.float32).view(b)
        return (1 - s) * x0 + s * eps

    def f(net, time, x):
        s = torch.tensor(time, dtype=torch.float32).view(b)
        return x - s * (net.w * x + net.b * s * pooled)

    # what the network was given: f_t's call, then f_r's on the rows with r > 0 only
    assert len(student.calls) == 2
    (x_t_in, tau_t), (x_r_in, tau_r) = student.calls
    torch.testing.assert_close(x_t_in, on_path(t), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x_r_in, on_path(r)[torch.from_numpy(live)], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tau_t.double(), torch.from_numpy(1000 * t), rtol=1e-6, atol=0)
    torch.testing.assert_close(tau_r.double(), torch.from_numpy(1000 * r[live]), rtol=1e-6, atol=0)

    ref = _Linear()
    f_t = f(ref, t, on_path(t))
    with torch.no_grad():
        f_r = torch.where(torch.from_numpy(live).view(b), f(ref, r, on_path(r)), x0)
    weight = torch.tensor((1 - t) * (1 - r) / (t - r), dtype=torch.float32)
    want = ((f_t - f_r).flatten(1).norm(dim=1) * weight).mean()
    want.backward()
    want_grad = torch.stack([ref.w.grad, ref.b.grad])
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-7)

    ref2 = _Linear()  # the same loss with a gradient through f_r: another gradient, so the check above can fail
    f_r2 = torch.where(torch.from_numpy(live).view(b), f(ref2, r, on_path(r)), x0)
    (((f(ref2, t, on_path(t)) - f_r2).flatten(1).norm(dim=1) * weight).mean()).backward()
    assert not torch.allclose(torch.stack([ref2.w.grad, ref2.b.grad]), want_grad, rtol=1e-3)


def test_the_boundary_is_the_data_bit_for_bit(method):
    """At sigma = 0 (flow time 0) the transformer's f is x itself, exactly: f(x0, 0) = x0 - 0 v; at a small level it
    is close to x and not equal (the network's output is in it)."""
    x0 = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    cond, _ = method.text_conditions({"caption": [PROMPT, "a handwritten digit seven"]}, 2, "cpu")
    with torch.no_grad():
        assert torch.equal(method._consistency_fn(method.student, x0, torch.zeros(2, dtype=torch.float64), cond), x0)
        near = method._consistency_fn(method.student, x0, torch.full((2,), 1e-3, dtype=torch.float64), cond)
    assert 0 < (near - x0 / (1 + 1e-3)).abs().max() < 1e-2


def test_flow_match_lcm_scheduler_samples_with_the_trained_consistency_function(method):
    """The student's scheduler is FlowMatchLCMScheduler with the teacher's shift, called at the trailing sigmas: 2
    steps at t = 1, shift(1/2) = 0.75 (noise level 3, inside the trained range) and 0, not the scheduler's own 1 and
    0.009; one step of the in-memory pipeline from latents z returns z - 1 v(z, t=1), the trained f at t = 1, and
    near t = 1 the trained f tends to it."""
    sched = method.sampling_scheduler()
    assert type(sched) is FlowMatchLCMScheduler and sched.config.shift == SD3_SHIFT
    pipe = method.pipeline()
    pipe.set_progress_bar_config(disable=True)
    seen = []
    pipe(PROMPT, output_type="latent", callback_on_step_end=lambda p, i, t, kw: seen.append(float(t)) or kw)
    assert pipe.config.sigma_spacing == "trailing" and seen == pytest.approx([1000.0, 750.0])
    sched.set_timesteps(2)
    assert sched.sigmas[1] < 0.01  # the stock spacing's second point
    z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    got = pipe(PROMPT, num_inference_steps=1, latents=z.clone(), output_type="latent").images
    cond, _ = method.text_conditions({"caption": [PROMPT]}, 1, "cpu")
    with torch.no_grad():
        v = _transformer(method.student, z, torch.ones(1), cond)
        near = method._consistency_fn(method.student, z * 1e6, torch.full((1,), 1e6, dtype=torch.float64), cond)
    torch.testing.assert_close(got, z - v, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(near, z - v, rtol=1e-3, atol=1e-3)


def test_ict_and_a_vp_scheduler_on_the_flow_teacher_are_refused(sd3_dir):
    from distill.students.copies import fresh_student

    with pytest.raises(ValueError, match="method.variant=ict on the flow-matching teacher .*use method.variant=ect"):
        _method(sd3_dir, variant="ict", build=fresh_student)
    with pytest.raises(ValueError, match=r"'lcm' steps a discrete VP .* \['flow_euler', 'flow_lcm', 'flow_trigflow', 'flow_meanflow'\]"):
        _method(sd3_dir, sampling={"name": "lcm", "num_inference_steps": 2, "guidance_scale": 1.0})


FAST = ["callbacks.quality_cost=null", "data.batch_size=4", "trainer.max_steps=2", "trainer.log_every_n_steps=1",
        "trainer.limit_val_batches=1", "callbacks.samples.num_seeds=1", "sample_grid_seeds=1", "logger=csv"]


def test_two_cli_steps_on_the_sd3_teacher_export_a_flow_lcm_pipeline(sd3_dir, tmp_path):
    """+exp=consistency_training_flow on the SD3 folder: 2 steps, finite losses, an export on FlowMatchLCMScheduler
    (the teacher's shift) whose default call is 2 steps at guidance 1; DiffusionPipeline.from_pretrained(export)
    (prompt) runs 2 transformer passes of 1 example, and the stock StableDiffusion3Pipeline called with the card's
    arguments in a process without distill gives the same images (FlowMatchLCMScheduler re-noises from the global
    RNG: seeded alike)."""
    from distill.metrics.cost import NFECounter

    run_dir = tmp_path / "run"
    proc = run_train("+exp=consistency_training_flow", f"teacher.pretrained_model_name_or_path={sd3_dir}", *FAST,
                     f"hydra.run.dir={run_dir}", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(r["train/loss"]) for r in csv.DictReader(open(run_dir / "csv" / "metrics.csv")) if r.get("train/loss")]
    assert len(losses) == 2 and all(0 < loss < 1e4 for loss in losses), losses
    export = run_dir / "export"
    index = json.loads((export / "model_index.json").read_text())
    assert index["_class_name"] == "DistillSD3Pipeline" and index["scheduler"] == ["diffusers", "FlowMatchLCMScheduler"]
    assert (index["default_num_inference_steps"], index["default_guidance_scale"], index["sigma_spacing"]) == \
        (2, 1.0, "trailing")
    assert json.loads((export / "scheduler" / "scheduler_config.json").read_text())["shift"] == SD3_SHIFT
    info = json.loads((export / "distill.json").read_text())
    assert info["method"] == "consistency_training" and info["variant"] == "ect"
    assert info["sampling"]["class"] == "FlowMatchLCMScheduler"
    assert info["consistency_function"].startswith("f(x_t, t) = x_t - t v")
    pipe = DiffusionPipeline.from_pretrained(export)
    pipe.set_progress_bar_config(disable=True)
    torch.manual_seed(0)
    seen = []
    with NFECounter(pipe.transformer) as counter:
        ours = pipe(PROMPT, generator=torch.Generator().manual_seed(0), output_type="pt",
                    callback_on_step_end=lambda p, i, t, kw: seen.append(float(t)) or kw).images
    assert (counter.calls, counter.examples) == (2, 2) and ours.shape == (1, 1, 32, 32)
    assert seen == pytest.approx([1000.0, 750.0]) and torch.isfinite(ours).all() and ours.std() > 0
    assert info["stock"]["call"] == {"max_sequence_length": index["default_max_sequence_length"], "sigmas": [1.0, 0.5]}
    card = (export / "README.md").read_text()
    assert "num_inference_steps=2, guidance_scale=1.0, max_sequence_length=" in card and "sigmas=[1.0, 0.5]" in card
    call = {"num_inference_steps": 2, "guidance_scale": 1.0, **info["stock"]["call"]}
    classes, theirs = stock_sd3(tmp_path, export, info["stock"]["load"], call, PROMPT)
    assert classes == ["StableDiffusion3Pipeline", "FlowMatchLCMScheduler"] and torch.equal(ours, theirs)
