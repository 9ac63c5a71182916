import math

import numpy as np
import pytest
import torch
from diffusers import DDPMScheduler

from distill.diffusion import (
    add_noise,
    alpha_sigma,
    diffusion_loss,
    prediction_target,
    snr,
    snr_weight,
    to_x0_eps,
)


@pytest.fixture
def scheduler():
    return DDPMScheduler(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2")


def _draw(seed=0, n=6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 4, 4, generator=g), torch.randn(n, 2, 4, 4, generator=g), torch.tensor([0, 1, 250, 500, 900, 999])


def test_forward_process_matches_diffusers(scheduler):
    x0, eps, t = _draw()
    alpha, sigma = alpha_sigma(scheduler.alphas_cumprod, t)
    ours = add_noise(x0, eps, alpha, sigma)
    torch.testing.assert_close(ours, scheduler.add_noise(x0, eps, t), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(alpha.pow(2) + sigma.pow(2), torch.ones_like(alpha))


def test_v_target_matches_diffusers_velocity(scheduler):
    x0, eps, t = _draw(1)
    alpha, sigma = alpha_sigma(scheduler.alphas_cumprod, t)
    v = prediction_target("v_prediction", x0, eps, alpha, sigma)
    torch.testing.assert_close(v, scheduler.get_velocity(x0, eps, t), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("prediction_type", ["epsilon", "sample", "v_prediction"])
def test_parametrisations_round_trip(scheduler, prediction_type):
    x0, eps, t = _draw(2)
    t = t.clamp(min=1)  # at t=0, sigma is ~0 and eps is not identifiable from an x0 prediction
    alpha, sigma = alpha_sigma(scheduler.alphas_cumprod, t)
    x_t = add_noise(x0, eps, alpha, sigma)
    target = prediction_target(prediction_type, x0, eps, alpha, sigma)
    x0_hat, eps_hat = to_x0_eps(prediction_type, target, x_t, alpha, sigma)
    torch.testing.assert_close(x0_hat, x0, rtol=1e-3, atol=2e-3)
    torch.testing.assert_close(eps_hat, eps, rtol=1e-3, atol=2e-3)


def test_unknown_prediction_type_is_named():
    x = torch.zeros(1, 1, 2, 2)
    with pytest.raises(ValueError, match="prediction_type='flow'"):
        prediction_target("flow", x, x, x, x)


def test_min_snr_weight_formula():
    s = torch.tensor([0.01, 1.0, 5.0, 100.0])
    gamma = 5.0
    torch.testing.assert_close(snr_weight(s, "epsilon", "min_snr", gamma), torch.clamp(s, max=gamma) / s)
    torch.testing.assert_close(snr_weight(s, "v_prediction", "min_snr", gamma), torch.clamp(s, max=gamma) / (s + 1))
    torch.testing.assert_close(snr_weight(s, "sample", "min_snr", gamma), torch.clamp(s, max=gamma))
    # Salimans & Ho truncated SNR: x0-weight max(SNR, 1); for v this is exactly 1 when SNR >= 1.
    torch.testing.assert_close(snr_weight(s, "v_prediction", "truncated_snr"), torch.clamp(s, min=1) / (s + 1))
    assert snr_weight(s, "epsilon").tolist() == [1.0, 1.0, 1.0, 1.0]


def test_weighting_converts_units():
    """Weighted eps-MSE equals the same weighting applied to x0-MSE (MSE_eps = SNR * MSE_x0)."""
    g = torch.Generator().manual_seed(3)
    x0, eps = torch.randn(8, 1, 4, 4, generator=g), torch.randn(8, 1, 4, 4, generator=g)
    alpha, sigma = alpha_sigma(DDPMScheduler().alphas_cumprod, torch.arange(100, 900, 100))
    x_t = add_noise(x0, eps, alpha, sigma)
    eps_pred = eps + 0.1 * torch.randn(eps.shape, generator=g)
    x0_pred, _ = to_x0_eps("epsilon", eps_pred, x_t, alpha, sigma)
    s = snr(alpha, sigma)
    loss_eps = diffusion_loss(eps_pred, eps, snr_weight(s, "epsilon", "min_snr"))
    loss_x0 = diffusion_loss(x0_pred, x0, torch.clamp(s, max=5.0))
    assert loss_eps.item() == pytest.approx(loss_x0.item(), rel=1e-4)


def test_diffusion_loss_is_weighted_mse():
    pred = torch.tensor([[1.0, 2.0], [3.0, 5.0]]).reshape(2, 1, 1, 2)
    target = torch.zeros_like(pred)
    weight = torch.tensor([1.0, 0.5])
    assert diffusion_loss(pred, target, weight).item() == pytest.approx((2.5 * 1.0 + 17.0 * 0.5) / 2)


def test_stratified_timesteps_cover_every_stratum_as_the_sampler_of_kingma_et_al():
    """TimeSampler(stratified): t_i = floor(T ((u + i/N) mod 1)) with one float32 u, the draw the diffusion method made
    before method.noise (the same generator stream gives the same timesteps)."""
    from distill.diffusion.noise import TimeSampler

    n, T = 16, 1000
    t, w = TimeSampler(T, stratified=True).sample(n, torch.Generator().manual_seed(0))
    assert sorted((t * n // T).tolist()) == list(range(n)) and torch.equal(w, torch.ones(n, dtype=torch.float64))
    u = torch.rand((), generator=torch.Generator().manual_seed(0))
    ref = (torch.remainder(u + torch.arange(n) / n, 1.0) * T).long()
    assert torch.equal(t, ref)


def test_uniform_timesteps_are_seeded_randint():
    from distill.diffusion.noise import TimeSampler

    a, _ = TimeSampler(1000).sample(32, torch.Generator().manual_seed(5))
    assert torch.equal(a, torch.randint(0, 1000, (32,), generator=torch.Generator().manual_seed(5)))


def test_snr_of_cosine_schedule_midpoint(scheduler):
    # squaredcos_cap_v2 (Nichol & Dhariwal 2021 eq. 17): abar = f(u) / f(0), f(u) = cos^2(pi/2 (u + s)/(1 + s)),
    # s = 0.008; diffusers' index t holds abar at u = (t + 1) / T.
    alpha, sigma = alpha_sigma(scheduler.alphas_cumprod, torch.tensor([500]))
    f = lambda u: math.cos(math.pi / 2 * (u + 0.008) / 1.008) ** 2  # noqa: E731
    expected = f(501 / 1000) / f(0.0)
    assert alpha.item() ** 2 == pytest.approx(expected, rel=1e-4)


# ---------------------------------------------------------------- EDM's training objective (Karras et al. 2022, table 1)


def _edm_table_1(sigma: torch.Tensor, sd: float) -> dict:
    """Table 1's column "EDM (ours)", written out: the preconditioning and the loss weighting."""
    return {"c_skip": sd ** 2 / (sigma ** 2 + sd ** 2), "c_out": sigma * sd / (sigma ** 2 + sd ** 2).sqrt(),
            "c_in": 1 / (sigma ** 2 + sd ** 2).sqrt(), "c_noise": sigma.log() / 4,
            "lambda": (sigma ** 2 + sd ** 2) / (sigma * sd) ** 2}


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
def test_edm_weighting_is_lambda_of_table_1_and_a_unit_weight_on_the_network_target(prediction_type):
    """``snr_weight(..., "edm")`` times the MSE of any prediction type is lambda(sigma) ||D - x0||^2 with table 1's
    lambda, which is exactly ||F - F*||^2 (lambda c_out^2 = 1) for D = c_skip x + c_out F: issue 30 item 13 found the
    eps-MSE weight on ||F - F*||^2 falling from 1.00 at t = 0 to 0.005 at t = 999."""
    from distill.diffusion.losses import edm_loss_weight
    from distill.models.precondition import edm_scalings

    sd = 0.5
    g = torch.Generator().manual_seed(0)
    sigma = torch.tensor([0.03, 0.3, 1.0, 7.0, 150.0], dtype=torch.float64)
    table = _edm_table_1(sigma, sd)
    torch.testing.assert_close(edm_loss_weight(sigma, sd), table["lambda"])
    torch.testing.assert_close(table["lambda"] * table["c_out"] ** 2, torch.ones(5, dtype=torch.float64))
    c_skip, c_out, c_in, c_noise = edm_scalings(sigma, sd)  # the wrapper's (c_noise in timestep units, x 1000)
    torch.testing.assert_close(torch.stack([c_skip, c_out, c_in, c_noise / 1000]),
                               torch.stack([table[k] for k in ("c_skip", "c_out", "c_in", "c_noise")]))
    shape = (-1, 1, 1, 1)
    x0, eps = sd * torch.randn(5, 2, 4, 4, generator=g, dtype=torch.float64), torch.randn(5, 2, 4, 4, generator=g, dtype=torch.float64)
    raw = torch.randn(5, 2, 4, 4, generator=g, dtype=torch.float64)  # an arbitrary network output F
    x = x0 + sigma.view(shape) * eps  # VE sample; the VP one is alpha x, alpha = 1 / sqrt(1 + sigma^2)
    denoised = table["c_skip"].view(shape) * x + table["c_out"].view(shape) * raw
    raw_target = (x0 - table["c_skip"].view(shape) * x) / table["c_out"].view(shape)
    alpha = (1 / (1 + sigma ** 2).sqrt()).view(shape)
    sigma_vp = sigma.view(shape) * alpha
    eps_hat = (x - denoised) / sigma.view(shape)
    pred = {"epsilon": eps_hat, "sample": denoised, "v_prediction": alpha * eps_hat - sigma_vp * denoised}[prediction_type]
    weight = snr_weight(snr(alpha, sigma_vp).flatten(), prediction_type, "edm", sigma_data=sd)
    loss = diffusion_loss(pred, prediction_target(prediction_type, x0, eps, alpha, sigma_vp), weight, reduce=False)
    torch.testing.assert_close(loss, (raw - raw_target).pow(2).flatten(1).mean(1), rtol=1e-5, atol=1e-6)
    x0_loss = (denoised - x0).pow(2).flatten(1).mean(1)
    torch.testing.assert_close(loss, table["lambda"] * x0_loss, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="needs sigma_data"):
        snr_weight(snr(alpha, sigma_vp), prediction_type, "edm")


def test_edm_noise_distribution_on_the_discrete_schedule_is_the_lognormal_mass_of_each_timestep():
    """ln sigma ~ N(-1.2, 1.2^2) (table 1) mapped onto SD's 1,000 timesteps (sigma_t = sqrt((1 - abar_t) / abar_t)):
    timestep t gets the normal's mass between the log-midpoints to its neighbours, the mass outside the schedule's
    range (1.9% below SD's sigma_0 = 0.029, half a step beyond it) dropped and the rest renormalised. Per timestep
    the mass is largest at t = 1, not at sigma = e^-1.2 (t = 81): ln sigma moves fastest per timestep there."""
    from scipy.stats import norm

    from distill.diffusion.noise import edm_timestep_probabilities

    abar = DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012).alphas_cumprod.double()
    log_s = ((1 - abar) / abar).sqrt().log().numpy()
    edges = np.concatenate([[1.5 * log_s[0] - 0.5 * log_s[1]], (log_s[1:] + log_s[:-1]) / 2,
                            [1.5 * log_s[-1] - 0.5 * log_s[-2]]])
    mass = np.diff(norm.cdf(edges, loc=-1.2, scale=1.2))
    p = edm_timestep_probabilities(torch.from_numpy(np.exp(log_s)))
    np.testing.assert_allclose(p.numpy(), mass / mass.sum(), atol=1e-12)
    assert 1 - mass.sum() == pytest.approx(0.019, abs=0.001) and math.exp(log_s[0]) == pytest.approx(0.0292, abs=1e-4)
    assert int(p.argmax()) == 1 and int(np.abs(log_s + 1.2).argmin()) == 81


def test_diffusion_method_with_edm_weighting_draws_edm_timesteps_and_refuses_zero_terminal_snr():
    from distill.diffusion.noise import edm_timestep_probabilities
    from distill.methods.diffusion import DiffusionTraining
    from distill.models.conditioning import ClassConditioner
    from distill.students.sized import build_class_unet

    schedule = DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
    method = DiffusionTraining(build_class_unet(8, 1, size="debug"), schedule, ClassConditioner(10), torch.optim.AdamW,
                               loss_weighting="edm")
    sigmas = ((1 - schedule.alphas_cumprod.double()) / schedule.alphas_cumprod.double()).sqrt()
    # EDM's P_mean is for sigma_data = 0.5: at the method's sigma_data = 1 the same distribution relative to the data
    assert method.noise.sigma_data == 1.0
    torch.testing.assert_close(edm_timestep_probabilities(sigmas, 1.0), edm_timestep_probabilities(sigmas * 0.5))
    p = edm_timestep_probabilities(sigmas, method.noise.sigma_data)
    torch.testing.assert_close(method.time_target, p)
    torch.testing.assert_close(method.schedule.ve_sigmas, sigmas, rtol=0, atol=0)
    bins, w = method.draw_time_bins(20_000, sigmas, torch.Generator().manual_seed(0), target=method.time_target)
    assert w is None
    log_sigma = sigmas[bins].log()
    # the draws follow the truncated lognormal: mean and std of ln sigma within 4 standard errors of p's own
    mean = float((p * sigmas.log()).sum())
    std = float((p * (sigmas.log() - mean) ** 2).sum().sqrt())
    assert float(log_sigma.mean()) == pytest.approx(mean, abs=4 * std / math.sqrt(20_000))
    # -1.2 + ln 2 and 1.2, cut at sigma_0
    assert mean == pytest.approx(-0.507, abs=0.001) and std == pytest.approx(1.162, abs=0.001)
    p_edm = edm_timestep_probabilities(sigmas)  # sigma_data = 0.5: EDM's own numbers
    mean = float((p_edm * sigmas.log()).sum())
    assert mean == pytest.approx(-1.147, abs=0.001)
    with pytest.raises(ValueError, match="zero terminal SNR"):
        DiffusionTraining(build_class_unet(8, 1, size="debug"),
                          DDPMScheduler(rescale_betas_zero_snr=True), ClassConditioner(10), torch.optim.AdamW,
                          loss_weighting="edm")
