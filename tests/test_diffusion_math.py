import math

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
