"""method.noise building blocks: antithetic pairs, stratified points, lognormal bins, importance-sampled times
(unbiased by Monte Carlo, with a tolerance from the sample count)."""

import math

import numpy as np
import pytest
import torch
from scipy.stats import norm

from distill.diffusion.noise import (
    TimeSampler,
    antithetic_noise,
    lognormal_bin_probabilities,
    stratified_unit,
)


def test_antithetic_pairs_are_exact_negatives():
    eps = antithetic_noise((7, 3, 2), torch.Generator().manual_seed(0))
    assert eps.shape == (7, 3, 2)
    assert torch.equal(eps[4:], -eps[:3])  # rows i and i + 4; row 3 (the odd one) has no partner


def test_stratified_points_fill_every_stratum_once():
    u = stratified_unit(16, torch.Generator().manual_seed(3))
    assert sorted((u * 16).floor().long().tolist()) == list(range(16))


def test_lognormal_bin_probabilities_are_the_mass_between_midpoints():
    sigmas = torch.tensor([0.01, 0.1, 1.0, 10.0], dtype=torch.float64)
    p = lognormal_bin_probabilities(sigmas, -1.1, 2.0)
    logs = np.log(sigmas.numpy())
    edges = np.concatenate([[-np.inf], (logs[1:] + logs[:-1]) / 2, [np.inf]])
    ref = np.diff(norm.cdf((edges + 1.1) / 2.0))
    assert np.allclose(p.numpy(), ref / ref.sum(), atol=1e-12)


def _f(bins: torch.Tensor) -> torch.Tensor:  # a per-time loss that varies by two orders of magnitude
    return 0.05 + (bins.double() / 49) ** 3 * 5


@pytest.mark.parametrize("proposal", ["uniform", "lognormal", "adaptive"])
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
