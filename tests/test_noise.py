"""method.noise building blocks: antithetic pairs, stratified points, lognormal bins, importance-sampled times
(unbiased by Monte Carlo, with a tolerance from the sample count)."""

import csv
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import norm

from distill.diffusion.noise import (
    TimeSampler,
    antithetic_noise,
    lognormal_bin_probabilities,
    pair_rows,
    stratified_unit,
)


def test_antithetic_pairs_are_exact_negatives():
    eps = antithetic_noise((7, 3, 2), torch.Generator().manual_seed(0))
    assert eps.shape == (7, 3, 2)
    assert torch.equal(eps[4:], -eps[:3])  # rows i and i + 4; row 3 (the odd one) has no partner
    assert pair_rows(list("abcdefg")) == list("abcdabc")  # the rows that share everything but the noise
    assert torch.equal(pair_rows(torch.arange(4), 7), torch.tensor([0, 1, 2, 3, 0, 1, 2]))
    with pytest.raises(ValueError, match="at least 4 drawn rows"):
        pair_rows(torch.arange(3), 7)


def test_stratified_points_fill_every_stratum_once():
    u = stratified_unit(16, torch.Generator().manual_seed(3))
    assert sorted((u * 16).floor().long().tolist()) == list(range(16))


def test_lognormal_bin_probabilities_are_the_mass_between_midpoints_within_the_grid():
    """Edges halfway between levels in log sigma, the outer ones half a step beyond the ends: the mass outside the
    grid is not piled onto its end bins (a lognormal far outside the grid would send most draws there)."""
    sigmas = torch.tensor([0.01, 0.1, 1.0, 10.0], dtype=torch.float64)
    p = lognormal_bin_probabilities(sigmas, -1.1, 2.0)
    logs = np.log(sigmas.numpy())
    step = np.log(10)
    edges = np.concatenate([[logs[0] - step / 2], (logs[1:] + logs[:-1]) / 2, [logs[-1] + step / 2]])
    ref = np.diff(norm.cdf((edges + 1.1) / 2.0))
    assert np.allclose(p.numpy(), ref / ref.sum(), atol=1e-12)
    far = lognormal_bin_probabilities(sigmas, 30.0, 0.1)  # all the mass far above the grid: the top bin
    assert far.tolist() == [0.0, 0.0, 0.0, 1.0]


def test_non_finite_losses_do_not_poison_the_adaptive_proposal():
    sampler = TimeSampler(4, "adaptive", history=1)
    sampler.update(torch.tensor([0, 1, 2, 3, 3]), torch.tensor([1.0, 2.0, 3.0, 4.0, float("inf")]))
    q = sampler.probabilities()
    assert torch.isfinite(q).all() and torch.allclose(q.sum(), torch.tensor(1.0, dtype=torch.float64))
    bins, w = sampler.sample(1000, torch.Generator().manual_seed(0))
    assert set(bins.tolist()) == {0, 1, 2, 3} and torch.isfinite(w).all()


def test_adaptive_bins_without_a_full_history_take_the_mean_of_the_full_ones():
    """iCT's rarest pairs may never fill a history: they take the p-weighted mean second moment of the full bins,
    so the proposal adapts as soon as one bin is full."""
    sampler = TimeSampler(3, "adaptive", history=2, uniform_mix=0.5)
    assert torch.equal(sampler.probabilities(), torch.full((3,), 1 / 3, dtype=torch.float64))
    sampler.update(torch.tensor([0, 0, 1, 1]), torch.tensor([1.0, 1.0, 3.0, 3.0]))
    m = torch.tensor([1.0, 9.0, 5.0], dtype=torch.float64)  # bin 2: (1 + 9) / 2
    q = m.sqrt() / m.sqrt().sum()
    assert torch.allclose(sampler.probabilities(), 0.5 * q + 0.5 / 3)


ROOT = Path(__file__).resolve().parents[1]


def _f(bins: torch.Tensor) -> torch.Tensor:  # a per-time loss that varies by two orders of magnitude
    return 0.05 + (bins.double() / 49) ** 3 * 5


@pytest.mark.parametrize("proposal", ["default", "lognormal", "adaptive"])
@pytest.mark.parametrize("stratified", [False, True])
def test_importance_weighted_loss_is_unbiased(proposal, stratified):
    k, n = 50, 20_000
    probs = lognormal_bin_probabilities(torch.logspace(-2, 1.5, k, dtype=torch.float64)) if proposal == "lognormal" else None
    sampler = TimeSampler(k, proposal, stratified, probs=probs, history=5)
    g = torch.Generator().manual_seed(0)
    if proposal == "adaptive":  # warm up the history on the toy losses
        for _ in range(20):
            bins, _ = sampler.sample(100, g)
            sampler.update(bins, _f(bins))
        assert not torch.allclose(sampler.probabilities(), torch.full((k,), 1 / k, dtype=torch.float64))
    truth = _f(torch.arange(k)).mean().item()
    estimates = []
    for _ in range(20):  # batches of n/20: independent estimates, so that the tolerance holds for stratified too
        bins, w = sampler.sample(n // 20, g)
        estimates.append((w * _f(bins)).mean().item())
    mean, sd = float(np.mean(estimates)), float(np.std(estimates, ddof=1))
    assert abs(mean - truth) < 4 * sd / math.sqrt(len(estimates)) + 1e-12, (mean, truth, sd)


def test_adaptive_proposal_tracks_sqrt_of_the_mean_square_loss_and_lowers_variance():
    k = 50
    sampler = TimeSampler(k, "adaptive", history=4, uniform_mix=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(40):
        bins, _ = sampler.sample(200, g)
        sampler.update(bins, _f(bins))
    want = _f(torch.arange(k))
    want = 0.9 * want / want.sum() + 0.1 / k
    assert torch.allclose(sampler.probabilities(), want, rtol=1e-9)
    uniform = TimeSampler(k)
    var = {}
    for name, s in (("uniform", uniform), ("adaptive", sampler)):
        bins, w = s.sample(50_000, g)
        var[name] = (w * _f(bins)).var().item()
    assert var["adaptive"] < 0.5 * var["uniform"], var


def test_state_round_trip_and_bad_settings():
    a = TimeSampler(5, "adaptive", history=2)
    a.update(torch.tensor([0, 1, 1]), torch.tensor([1.0, 2.0, 3.0]))
    b = TimeSampler(5, "adaptive", history=2)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.losses, b.losses) and torch.equal(a.counts, b.counts)
    with pytest.raises(ValueError, match="method.noise.timesteps='foo'"):
        TimeSampler(5, "foo")
    with pytest.raises(ValueError, match="uniform_mix=0"):
        TimeSampler(5, "adaptive", uniform_mix=0)
    with pytest.raises(ValueError, match="lognormal proposal needs"):
        TimeSampler(5, "lognormal")


@pytest.mark.parametrize("proposal", ["default", "lognormal", "adaptive"])
def test_importance_weights_are_unbiased_for_a_method_with_its_own_non_uniform_distribution(proposal):
    """iCT's pairs are lognormal, not uniform: the weights p / q keep E[w f] = sum_k p_k f_k for any proposal."""
    k, n = 40, 20_000
    target = lognormal_bin_probabilities(torch.logspace(-2, 1.5, k, dtype=torch.float64), 0.5, 1.0)
    probs = lognormal_bin_probabilities(torch.logspace(-2, 1.5, k, dtype=torch.float64)) if proposal == "lognormal" else None
    sampler = TimeSampler(k, proposal, True, probs=probs, history=5, target=target)
    g = torch.Generator().manual_seed(0)
    if proposal == "adaptive":
        for _ in range(40):
            bins, _ = sampler.sample(200, g)
            sampler.update(bins, _f(bins))
    truth = float((target * _f(torch.arange(k))).sum())
    estimates = []
    for _ in range(20):
        bins, w = sampler.sample(n // 20, g)
        estimates.append((w * _f(bins)).mean().item())
    mean, sd = float(np.mean(estimates)), float(np.std(estimates, ddof=1))
    assert abs(mean - truth) < 4 * sd / math.sqrt(len(estimates)) + 1e-12, (mean, truth, sd)


def test_default_draws_are_the_methods_own_random_streams():
    """No options: the bins are torch.randint (uniform) or torch.multinomial (a target), the draws the methods made
    before method.noise, so that seeded runs train exactly as before."""
    g = lambda: torch.Generator().manual_seed(7)  # noqa: E731
    bins, w = TimeSampler(50).sample(64, g())
    assert torch.equal(bins, torch.randint(0, 50, (64,), generator=g())) and bool((w == 1).all())
    p = torch.linspace(1, 2, 10, dtype=torch.float64)
    bins, _ = TimeSampler(10, target=p).sample(64, g())
    assert torch.equal(bins, torch.multinomial(p / p.sum(), 64, replacement=True, generator=g()))


# ---------------------------------------------------------------- EDM preconditioning


def test_edm_scalings_are_karras_table_1_and_round_trip():
    from distill.models.precondition import edm_denoised, edm_raw_target, edm_scalings

    sd, sigma = 0.5, torch.tensor([0.002, 0.3, 5.0, 80.0], dtype=torch.float64)
    c_skip, c_out, c_in, c_noise = edm_scalings(sigma, sd)
    assert torch.allclose(c_skip, sd ** 2 / (sigma ** 2 + sd ** 2))
    assert torch.allclose(c_out, sigma * sd / (sigma ** 2 + sd ** 2).sqrt())
    assert torch.allclose(c_in, 1 / (sigma ** 2 + sd ** 2).sqrt()) and torch.allclose(c_noise, 1000 * sigma.log() / 4)
    # the network's input c_in (x0 + sigma eps) has unit variance for data of std sigma_data
    g = torch.Generator().manual_seed(0)
    x0 = sd * torch.randn(4, 100_000, generator=g, dtype=torch.float64)
    x = x0 + sigma.view(-1, 1) * torch.randn(4, 100_000, generator=g, dtype=torch.float64)
    assert torch.allclose((c_in.view(-1, 1) * x).std(1), torch.ones(4, dtype=torch.float64), atol=0.01)
    # round trip: the raw target F* makes the denoiser exactly x0; its variance is 1 too (EDM's effective target)
    raw = edm_raw_target(x, sigma, x0, sd)
    assert torch.allclose(edm_denoised(x, sigma, raw, sd), x0, atol=1e-9)
    assert torch.allclose(raw.std(1), torch.ones(4, dtype=torch.float64), atol=0.01)


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory):
    from tests.sd_tiny import write_tiny_sd

    return write_tiny_sd(tmp_path_factory.mktemp("sd") / "pipe")


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
def test_edm_wrapper_presents_the_vp_interface_of_its_prediction_type(tiny_sd, monkeypatch, prediction_type):
    """An inner network that answers EDM's raw target F* for a known (x0, eps) makes the wrapper return exactly the
    epsilon / v / x0 of the VP sample x_t = alpha x0 + sigma eps at integer and fractional timesteps: the input
    scaling c_in, c_noise, the combination c_skip x + c_out F and the conversion are each checked."""
    from diffusers import DDIMScheduler, UNet2DConditionModel

    from distill.models.precondition import (
        EDMPreconditionedUNet2DConditionModel,
        edm_raw_target,
        edm_scalings,
    )

    unet = UNet2DConditionModel.from_pretrained(tiny_sd / "unet")
    schedule = DDIMScheduler.from_pretrained(tiny_sd / "scheduler").config
    model = EDMPreconditionedUNet2DConditionModel.wrap(unet, schedule, prediction_type, 0.5)
    g = torch.Generator().manual_seed(3)
    x0, eps = torch.randn(3, 4, 8, 8, generator=g), torch.randn(3, 4, 8, 8, generator=g)
    t = torch.tensor([10.0, 500.0, 998.5])
    abar = torch.tensor(DDIMScheduler.from_config(schedule).alphas_cumprod)
    log_s = ((1 - abar) / abar).sqrt().log()
    sigma = torch.stack([torch.lerp(log_s[int(v)], log_s[min(int(v) + 1, 999)], v - int(v)) for v in t]).exp()
    alpha, s_vp = (1 / (1 + sigma ** 2).sqrt()).view(-1, 1, 1, 1), (sigma / (1 + sigma ** 2).sqrt()).view(-1, 1, 1, 1)
    x_t = alpha * x0 + s_vp * eps
    seen = {}

    def oracle(self, sample, timestep, encoder_hidden_states, *args, **kwargs):
        sig = (timestep.double() / 250).exp()  # c_noise = 250 ln sigma
        _, _, c_in, _ = edm_scalings(sig, 0.5)
        x = sample.double() / c_in.view(-1, 1, 1, 1)  # undo c_in: the VE sample x0 + sigma eps
        seen["sigma"], seen["x"] = sig, x
        raw = edm_raw_target(x, sig, x0.double(), 0.5).float()
        return type("Out", (), {"sample": raw})()

    monkeypatch.setattr(UNet2DConditionModel, "forward", oracle)
    out = model(x_t, t, torch.zeros(3, 8, 32)).sample
    torch.testing.assert_close(seen["sigma"].float(), sigma, rtol=1e-5, atol=0)
    torch.testing.assert_close(seen["x"].float(), x0 + sigma.view(-1, 1, 1, 1) * eps, rtol=1e-4, atol=1e-4)
    want = {"epsilon": eps, "v_prediction": alpha * eps - s_vp * x0, "sample": x0}[prediction_type]
    torch.testing.assert_close(out, want, rtol=1e-3, atol=1e-3)


def test_edm_diffusion_training_is_a_unit_weight_mse_on_the_network_target(tiny_sd, monkeypatch):
    """Plain diffusion with EDM's preconditioning and ``loss_weighting=edm``: the training loss is exactly
    mean ||F - F*||^2 of the inner network's output F, F* = (x0 - c_skip x) / c_out (EDM's effective target, weight 1
    at every sigma: Karras et al. 2022, eq. 8 with table 1's lambda), and its timesteps come from EDM's lognormal."""
    from diffusers import DDPMScheduler, UNet2DConditionModel

    from distill.families import load_teacher
    from distill.methods.diffusion import DiffusionTraining
    from distill.models.conditioning import TextConditioner
    from distill.students.sized import build_text_unet

    teacher = load_teacher(str(tiny_sd))
    torch.manual_seed(0)
    method = DiffusionTraining(
        build_text_unet(8, 4, size="debug", cross_attention_dim=32),
        DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, clip_sample=False),
        TextConditioner(teacher.text_encoder, teacher.tokenizer), torch.optim.AdamW, vae=teacher.vae,
        loss_weighting="edm", noise={"preconditioning": "edm", "sigma_data": 0.5})
    seen = {}
    raw = torch.randn(6, 4, 8, 8, generator=torch.Generator().manual_seed(5))  # the inner network's answer F

    def inner(self, sample, timestep, encoder_hidden_states, *args, **kwargs):
        seen["sigma"] = (timestep.double() / 250).exp()  # c_noise = 1000 ln(sigma) / 4
        return type("Out", (), {"sample": raw})()

    latents, draw = method.latents, method.draw_noise
    monkeypatch.setattr(UNet2DConditionModel, "forward", inner)
    monkeypatch.setattr(method, "latents", lambda b, g=None: seen.setdefault("x0", latents(b, g)))
    monkeypatch.setattr(method, "draw_noise", lambda like, g=None: seen.setdefault("eps", draw(like, g)))
    batch = {"pixel_values": torch.rand(6, 1, 32, 32) * 2 - 1, "caption": ["a handwritten digit two"] * 6}
    loss = method.loss(batch, torch.Generator().manual_seed(1), drop_conditions=False)
    sigma, x0 = seen["sigma"].view(-1, 1, 1, 1), seen["x0"].double()
    x = x0 + sigma * seen["eps"].double()
    c_skip, c_out = 0.25 / (sigma ** 2 + 0.25), sigma * 0.5 / (sigma ** 2 + 0.25).sqrt()
    want = (raw.double() - (x0 - c_skip * x) / c_out).pow(2).mean()
    assert float(loss) == pytest.approx(float(want), rel=1e-4)
    assert float(method.time_target[:200].sum()) > 0.5  # most of ln sigma ~ N(-1.2, 1.2^2) lies below t = 200


def test_edm_student_exports_and_samples_through_diffusers_default_call(tiny_sd, tmp_path):
    """An EDM-preconditioned student saved in a pipeline folder loads back as the same function and samples with
    DiffusionPipeline.from_pretrained(folder)(prompt), no other argument."""
    from diffusers import DDIMScheduler, DiffusionPipeline, UNet2DConditionModel

    import distill.inference.pipelines  # noqa: F401
    from distill.models.precondition import EDMPreconditionedUNet2DConditionModel

    pipe = DiffusionPipeline.from_pretrained(tiny_sd)
    schedule = DDIMScheduler.from_pretrained(tiny_sd / "scheduler").config
    torch.manual_seed(0)
    fresh = UNet2DConditionModel.from_config(pipe.unet.config)
    pipe.unet = EDMPreconditionedUNet2DConditionModel.wrap(fresh, schedule, "epsilon", 1.0).eval()
    pipe.save_pretrained(tmp_path / "export")
    loaded = DiffusionPipeline.from_pretrained(tmp_path / "export")
    assert type(loaded.unet) is EDMPreconditionedUNet2DConditionModel and loaded.unet.config.edm_sigma_data == 1.0
    x = torch.randn(2, 4, 8, 8)
    cond = torch.randn(2, 8, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded.unet(x, torch.tensor([3, 700]), cond).sample,
                                   pipe.unet(x, torch.tensor([3, 700]), cond).sample)
    images = loaded("a handwritten digit three").images  # as a user calls it
    assert len(images) == 1 and images[0].size == (32, 32) and np.asarray(images[0]).std() > 0
    with pytest.raises(ValueError, match="wraps a UNet2DConditionModel"):
        EDMPreconditionedUNet2DConditionModel.wrap(loaded.unet, schedule, "epsilon", 1.0)


# ---------------------------------------------------------------- the options in the methods


def test_methods_draw_with_the_options_and_feed_the_adaptive_history(tiny_sd):
    """LCM with antithetic noise, stratified adaptive times: the noise comes in exact pairs, the pairs' distinct
    rows cover the grid's strata and their partners repeat the bins, each training loss records its examples, and a
    validation loss draws plainly (no weights, no pairs)."""
    from distill.families import load_teacher
    from distill.methods.consistency import LatentConsistencyDistillation
    from distill.students.copies import copy_student

    method = LatentConsistencyDistillation(
        load_teacher(str(tiny_sd)), copy_student, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), num_ddim_timesteps=10,
        noise={"antithetic": True, "stratified": True, "timesteps": "adaptive", "history": 2})
    g = torch.Generator().manual_seed(0)
    eps = method.draw_noise(torch.zeros(6, 4, 8, 8), g)
    assert torch.equal(eps[3:], -eps[:3])
    bins, w = method.draw_time_bins(20, method.schedule.ve_sigmas[method.solver_timesteps], g)
    assert sorted(bins[:10].tolist()) == list(range(10)) and torch.equal(bins[10:], bins[:10]) and w is not None
    batch = {"pixel_values": torch.rand(20, 1, 32, 32) * 2 - 1, "caption": ["a handwritten digit one"] * 20}
    assert torch.isfinite(method.loss(batch, g))
    assert bool((method._time_sampler.counts == 2).all())  # 10 stratified distinct rows, each twice
    q = method._time_sampler.probabilities()  # warmed up (history 2): now the adaptive proposal
    assert not torch.allclose(q, torch.full_like(q, 0.1))  # mixed with 0.1 of p: q >= 0.01
    assert float(q.min()) >= 0.01 - 1e-12
    assert torch.isfinite(method.loss(batch, g)) and int(method._time_sampler.counts.sum()) == 40
    method.eval()
    bins, w = method.draw_time_bins(10, method.schedule.ve_sigmas[method.solver_timesteps], g)
    assert w is None and sorted(bins.tolist()) == list(range(10))
    eps = method.draw_noise(torch.zeros(6, 4, 8, 8), g)
    assert not torch.allclose(eps[3:], -eps[:3])


# ---------------------------------------------------------------- antithetic pairs in every method


def _antithetic_methods():
    from diffusers import DDPMScheduler

    from distill.methods.consistency import LatentConsistencyDistillation
    from distill.methods.consistency_training import ConsistencyTraining
    from distill.methods.diffusion import DiffusionTraining
    from distill.methods.feature_distillation import FeatureDistillation
    from distill.methods.progressive import ProgressiveDistillation
    from distill.models.conditioning import TextConditioner
    from distill.students.copies import copy_student, fresh_student
    from distill.students.sized import build_text_unet

    def w_student(u):
        return copy_student(u, time_cond_proj_dim=8)

    opt = torch.optim.AdamW
    return {
        "diffusion": lambda t, noise: DiffusionTraining(
            build_text_unet(8, 4, size="debug", cross_attention_dim=32),
            DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, clip_sample=False),
            TextConditioner(t.text_encoder, t.tokenizer), opt, cond_dropout=0.5, vae=t.vae, noise=noise),
        "lcm": lambda t, noise: LatentConsistencyDistillation(t, w_student, opt, num_ddim_timesteps=10, noise=noise),
        "progressive": lambda t, noise: ProgressiveDistillation(t, w_student, opt, start_steps=8, final_steps=2, guided_stage_steps=3,
                                                                noise=noise),
        "feature": lambda t, noise: FeatureDistillation(t, copy_student, opt, cond_dropout=0.5, noise=noise),
        "ect": lambda t, noise: ConsistencyTraining(t, copy_student, opt, variant="ect", curriculum_steps=100,
                                                    noise=noise),
        "ict": lambda t, noise: ConsistencyTraining(t, fresh_student, opt, variant="ict", curriculum_steps=100,
                                                    noise=noise),
    }


@pytest.mark.parametrize("name", ["diffusion", "lcm", "progressive", "feature", "ect", "ict"])
def test_antithetic_pairs_differ_only_in_the_sign_of_the_noise(tiny_sd, monkeypatch, name):
    """Rows i and i + N/2 of a training loss are one example (image, caption, posterior draw), one t, one guidance
    scale and one dropout decision with noise eps and -eps: the student's input with the noise zeroed is the same for
    both rows, and its noise part is odd. Issue 30 item 4: the pairs had different x0, t and w (pair correlation of
    the ECT loss -0.006), so nothing cancelled."""
    from distill.families import load_teacher

    torch.manual_seed(0)
    method = _antithetic_methods()[name](load_teacher(str(tiny_sd)), {"antithetic": True, "stratified": True})
    method.train()
    calls = []

    def record(module, args, kwargs):
        named = dict(zip(["sample", "timestep", "encoder_hidden_states"], args), **kwargs)
        calls.append({k: named.get(k) for k in ("sample", "timestep", "encoder_hidden_states", "timestep_cond")})

    method.student.register_forward_pre_hook(record, with_kwargs=True)
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven"]
    batch = {"pixel_values": torch.rand(8, 1, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1,
             "caption": [f"a handwritten digit {w}" for w in words]}
    inputs, draw = [], method.draw_noise
    for zero_noise in (False, True):  # the same draws twice; the second time the noise is multiplied by 0
        if zero_noise:
            monkeypatch.setattr(method, "draw_noise", lambda like, g=None: draw(like, g) * 0)
        calls.clear()
        with torch.no_grad():
            method.loss(batch, torch.Generator().manual_seed(7))
        inputs.append(calls[0])  # the student's own (trained) pass
    noisy, clean = inputs
    for key in ("timestep", "encoder_hidden_states", "timestep_cond"):
        value = torch.as_tensor(clean[key]) if clean[key] is not None else None
        if value is not None and value.ndim > 0:
            assert torch.allclose(value[:4].float(), value[4:].float(), atol=1e-6), key
            assert torch.equal(value, torch.as_tensor(noisy[key])), key
    x = clean["sample"]
    assert torch.allclose(x[:4], x[4:], atol=1e-6)  # same x0 and t: the same noiseless input
    assert not torch.allclose(x[0], x[1], atol=1e-3)  # four distinct examples
    noise_part = noisy["sample"] - x
    assert torch.allclose(noise_part[:4], -noise_part[4:], atol=1e-5) and float(noise_part.abs().max()) > 0.1


def test_antithetic_pairs_cancel_the_odd_part_of_a_quadratic_loss():
    """Toy: per-row loss L = (c x0 + d eps)^2 = A + B + C (A = c^2 x0^2, B = 2 c d x0 eps, C = d^2 eps^2) on a
    two-point data set x0 = +-1. Pairs sharing x0 (``pair_rows``, ``antithetic_noise``) average to A + C, the odd B
    cancelled: an N-row batch mean has 2 Var C / (Var B + Var C) = 0.086 of the i.i.d. variance. Pairs that do not
    share x0 (issue 30 item 4's bug) keep c d eps (x0_a - x0_b): 1 + 2 d^2 / (4 c^2 + 2 d^2) = 1.043, nothing gained."""
    c, d, n, reps = 1.0, 0.3, 16, 20000
    g = torch.Generator().manual_seed(0)
    var_b, var_c = 4 * c ** 2 * d ** 2, 2 * d ** 4  # Var A = 0: x0^2 = 1
    shared_expected, unshared_expected = 2 * var_c / (var_b + var_c), 1 + var_c / (var_b + var_c)

    def batch_mean_variance(x0, eps):
        return float(((c * x0 + d * eps) ** 2).mean(1).var())

    x0 = torch.randint(0, 2, (reps, n), generator=g).double() * 2 - 1
    iid = batch_mean_variance(x0, torch.randn(reps, n, generator=g, dtype=torch.float64))
    pairs = antithetic_noise((n, reps), g, dtype=torch.float64).T  # (reps, n): columns i, i + n/2 opposite
    shared = batch_mean_variance(pair_rows(x0.T).T, pairs)
    unshared = batch_mean_variance(x0, pairs)
    assert (shared_expected, unshared_expected) == pytest.approx((0.0861, 1.0431), abs=1e-4)
    # a variance from 20,000 batch means errs by ~sqrt(2 / 20,000) = 1%: 5% is 5 standard errors
    assert shared / iid == pytest.approx(shared_expected, rel=0.05)
    assert unshared / iid == pytest.approx(unshared_expected, rel=0.05)


def test_cli_noise_options_and_edm_student_train_checkpoint_and_export(tiny_sd, tmp_path):
    """One LCM run with every option (EDM-preconditioned fresh student, antithetic, stratified, adaptive): the
    checkpoint holds the adaptive history, and the export samples through diffusers' default call."""
    from diffusers import DiffusionPipeline

    import distill.inference.pipelines  # noqa: F401
    from distill.models.precondition import EDMPreconditionedUNet2DConditionModel
    from tests.conftest import run_train
    from tests.test_consistency import LCM_FAST

    run_dir = tmp_path / "run"
    proc = run_train("+exp=consistency", f"teacher.pretrained_model_name_or_path={tiny_sd}", *LCM_FAST, "student=fresh",
                     "method.noise.preconditioning=edm", "method.noise.antithetic=true", "method.noise.stratified=true",
                     "method.noise.timesteps=adaptive", "method.noise.history=1", "trainer.max_steps=3",
                     "trainer.val_check_interval=3", "checkpoint.every_n_train_steps=3", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert int(ckpt["time_sampler"]["counts"].sum()) == 3 * 16
    assert ckpt["hyper_parameters"]["noise"]["preconditioning"] == "edm"
    pipe = DiffusionPipeline.from_pretrained(run_dir / "export")
    assert type(pipe.unet) is EDMPreconditionedUNet2DConditionModel
    images = pipe("a handwritten digit seven").images
    assert len(images) == 1 and np.asarray(images[0]).std() > 0


def test_bad_noise_options_exit_2_before_training(tiny_sd, tmp_path):
    """On the command line (exit 2, nothing written) and each check of the options' values."""
    from distill.diffusion.noise import NoiseOptions
    from tests.conftest import run_train

    run_dir = tmp_path / "run"
    proc = run_train("+exp=consistency", f"teacher.pretrained_model_name_or_path={tiny_sd}",
                     "method.noise.preconditioning=edm", "logger=csv", f"hydra.run.dir={run_dir}", timeout=120)
    assert proc.returncode == 2 and "applies to a freshly initialised student (student=fresh)" in proc.stderr, \
        proc.stderr[-2000:]
    assert not (run_dir / "checkpoints").exists()
    for options, needle in [({"timesteps": "sobol"}, "method.noise.timesteps='sobol'; use one of ['default', 'lognormal'"),
                            ({"preconditioning": "vp"}, "method.noise.preconditioning='vp'"),
                            ({"uniform_mix": 0.0}, "method.noise.uniform_mix=0.0 must be in (0, 1]"),
                            ({"history": 0}, "method.noise.history=0 must be >= 1"),
                            ({"p_std": -1.0}, "method.noise.p_std=-1.0"),
                            ({"antithetc": True}, "method.noise has no option(s) ['antithetc']")]:
        with pytest.raises(ValueError, match=re.escape(needle)):
            NoiseOptions.of(options)


# ---------------------------------------------------------------- the benchmarks' arithmetic


def test_grad_variance_bench_on_a_tiny_teacher(tiny_sd, tmp_path, monkeypatch):
    """bench/grad_variance.py end to end (4 batches): the table's variance is the unbiased total variance of the
    per-batch gradients, the default's ratio is 1, and identical options give identical gradients (same seed)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("grad_variance", ROOT / "bench" / "grad_variance.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    g = np.random.default_rng(0).normal(size=(6, 5))
    assert bench.trace_var(g) == pytest.approx(np.var(g, axis=0, ddof=1).sum())
    idx = np.array([0, 2, 2, 5])
    assert bench.trace_var_gram(g @ g.T, idx) == pytest.approx(bench.trace_var(g[idx]))
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    (tmp_path / "conf").symlink_to(ROOT / "conf")
    bench.main(["--batches", "4", "--batch-size", "4", "--options", "default", "default", "antithetic", "--out", "gv",
                "--bootstrap", "20", "--", f"teacher.pretrained_model_name_or_path={tiny_sd}",
                "student.time_cond_proj_dim=32", "callbacks.quality_cost=null"])
    rows = list(csv.DictReader(open(tmp_path / "gv" / "consistency.csv")))
    assert [r["option"] for r in rows] == ["default", "default", "antithetic"]
    assert float(rows[0]["ratio"]) == 1.0 and float(rows[1]["trace_var"]) == float(rows[0]["trace_var"])
    assert float(rows[2]["trace_var"]) > 0 and float(rows[2]["trace_var"]) != float(rows[0]["trace_var"])
    # --draws: the noise's own variance at fixed batches, streamed; the same option twice gives the same numbers
    assert bench.streamed_trace_var(torch.from_numpy(g.sum(0)), float((g ** 2).sum()), 6) == pytest.approx(
        bench.trace_var(g))
    bench.main(["--batches", "4", "--batch-size", "4", "--draws", "3", "--options", "default", "default", "--out", "gv",
                "--bootstrap", "20", "--", f"teacher.pretrained_model_name_or_path={tiny_sd}",
                "student.time_cond_proj_dim=32", "callbacks.quality_cost=null"])
    rows = list(csv.DictReader(open(tmp_path / "gv" / "consistency.csv")))
    assert float(rows[0]["noise_var"]) > 0 and float(rows[1]["noise_var"]) == float(rows[0]["noise_var"])
    assert float(rows[1]["noise_ratio"]) == 1.0 and float(rows[1]["noise_ratio_se"]) == 0.0
    assert "--draws 3" in (tmp_path / "gv" / "consistency.md").read_text()


def test_quality_curve_reads_runs_and_finds_the_first_step_at_a_target(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("quality_curve", ROOT / "bench" / "quality_curve.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("data:\n  batch_size: 128\n")
    rows = [("teacher", "ddim", 50, 3.8, 0), ("student", "lcm", 1, 9.0, 250), ("student", "lcm", 2, 7.0, 250),
            ("student", "lcm", 1, 6.0, 500), ("student", "lcm", 2, 4.5, 500)]
    with open(run / "quality_cost.csv", "w") as f:
        f.write("model,scheduler,steps,fid,fid_std,step\n")
        f.writelines(f"{m},{s},{n},{fid},0.3,{step}\n" for m, s, n, fid, step in rows)
    bench.main([str(run), "--target", "5", "--out", str(tmp_path / "curve.md")])
    text = (tmp_path / "curve.md").read_text()
    assert "| run | 500 | 64000 | 6.00 ± 0.30 | 4.50 ± 0.30 |" in text
    assert "first at step 500 (64000 images)" in text and "teacher (ddim)" in text


def test_edm_wrapper_keeps_exact_noise_levels_in_half_precision_and_refuses_zero_terminal_snr(tiny_sd):
    from diffusers import DDIMScheduler, UNet2DConditionModel

    from distill.models.precondition import EDMPreconditionedUNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(tiny_sd / "unet")
    schedule = dict(DDIMScheduler.from_pretrained(tiny_sd / "scheduler").config)
    model = EDMPreconditionedUNet2DConditionModel.wrap(unet, schedule, "epsilon", 1.0).to(torch.bfloat16)
    abar = DDIMScheduler.from_config(schedule).alphas_cumprod.double()
    t = torch.tensor([0, 10, 500, 999])
    assert torch.allclose(model.edm_sigma(t), ((1 - abar[t]) / abar[t]).sqrt(), rtol=1e-12)
    with pytest.raises(ValueError, match="zero terminal SNR"):
        EDMPreconditionedUNet2DConditionModel.wrap(unet, {**schedule, "rescale_betas_zero_snr": True}, "epsilon", 1.0)
