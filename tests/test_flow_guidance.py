"""Classifier guidance in velocity form (distill.diffusion.flow, distill.accelerate.guidance) on a Gaussian toy
where everything is known in closed form, and on the digits flow DiT through its pipeline: the velocity <-> score
conversion equals autograd of the flow marginal's log density; at scale 1 the guided velocity of a two-class
Gaussian mixture is the exact velocity of the chosen class; the accelerator adds v - s t / (1 - t) grad on the
pipeline's calls, nothing at t = 1, and refuses noisy-latent guides and packed (Flux) latents before sampling."""

from __future__ import annotations

import pytest
import torch

from distill.diffusion import flow
from tests.test_blockcache import pipe  # noqa: F401  (the flow teacher fixture)

S = 0.7  # the data's standard deviation around each class mean
MEANS = torch.tensor([[1.5, -0.5, 0.3], [-1.0, 0.8, -0.4]], dtype=torch.float64)


def marginal(x: torch.Tensor, mu: torch.Tensor, t: float) -> torch.Tensor:
    """log N(x; (1 - t) mu, ((1 - t)^2 S^2 + t^2) I): x_t of x0 ~ N(mu, S^2 I), summed over dimensions."""
    var = (1 - t) ** 2 * S**2 + t**2
    return torch.distributions.Normal((1 - t) * mu, var**0.5).log_prob(x).sum(-1)


def class_velocity(x: torch.Tensor, mu: torch.Tensor, t: float) -> torch.Tensor:
    """E[eps - x0 | x_t] for x0 ~ N(mu, S^2 I) by Gaussian conditioning (cov(x0, x_t) = (1 - t) S^2,
    cov(eps, x_t) = t, var(x_t) = (1 - t)^2 S^2 + t^2), no score involved."""
    var = (1 - t) ** 2 * S**2 + t**2
    centred = x - (1 - t) * mu
    return t / var * centred - (mu + (1 - t) * S**2 / var * centred)


@pytest.mark.parametrize("t", [0.1, 0.5, 0.93])
def test_velocity_and_score_convert_exactly_on_a_gaussian(t):
    x = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    score = torch.autograd.grad(marginal(x, MEANS[0], t).sum(), x)[0]
    v = class_velocity(x.detach(), MEANS[0], t)
    torch.testing.assert_close(flow.score_from_velocity(v, x.detach(), t), score, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(flow.velocity_from_score(score, x.detach(), t), v, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("t", [0.2, 0.6, 0.9])
def test_guidance_by_the_exact_classifier_gives_the_class_velocity(t):
    """p(x0) = (N(mu_0, S^2) + N(mu_1, S^2)) / 2; the exact velocity of the mixture is the posterior mean of the
    class velocities; guiding it at scale 1 with grad log p_t(y | x_t) gives class y's velocity exactly."""
    x = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 1.3
    logs = torch.stack([marginal(x, mu, t) for mu in MEANS], -1)  # (6, 2)
    posterior = torch.softmax(logs, -1)
    v = sum(posterior[:, y, None] * class_velocity(x, MEANS[y], t) for y in range(2))
    for y in range(2):
        xg = x.clone().requires_grad_(True)
        log_p_y = torch.log_softmax(torch.stack([marginal(xg, mu, t) for mu in MEANS], -1), -1)[:, y]
        grad = torch.autograd.grad(log_p_y.sum(), xg)[0]
        guided = flow.classifier_guided_velocity(v, grad, t, scale=1.0)
        torch.testing.assert_close(guided, class_velocity(x, MEANS[y], t), rtol=1e-10, atol=1e-10)
        assert not torch.allclose(v, guided)


def test_the_accelerator_guides_the_flow_teachers_velocity(pipe):  # noqa: F811
    from distill.accelerate import ClassifierGuidance, accelerated
    from distill.worlds.digits import asset_path

    net, generator = pipe.transformer, torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 8, 8, generator=generator)
    inputs = dict(encoder_hidden_states=torch.randn(2, 2, 128, generator=generator),
                  pooled_projections=torch.randn(2, 128, generator=generator))
    labels = torch.tensor([3, 8])
    guidance = ClassifierGuidance(scale=0.1, mode="x0", classifier=str(asset_path("classifier")))
    for timestep in (600.0, 1000.0):
        step = torch.tensor([timestep] * 2)
        with torch.no_grad():
            plain = net(hidden_states=x, timestep=step, **inputs).sample
        with accelerated(pipe, guidance, labels=labels, guidance_scale=1.0), torch.no_grad():
            guided = net(hidden_states=x, timestep=step, **inputs).sample
        t = timestep / 1000
        if t == 1.0:  # x_t = eps: nothing added
            assert torch.equal(guided, plain)
            continue
        # the clean-image classifier's gradient through x0 = x_t - t v, carried to x_t with eps fixed: / (1 - t)
        x0 = flow.x0_from_velocity(plain, x, t).requires_grad_(True)
        with torch.enable_grad():
            images = pipe.vae.decode(pipe.vae.config.shift_factor + x0 / pipe.vae.config.scaling_factor).sample
            logp = torch.log_softmax(guidance.classifier(images), 1).gather(1, labels.view(-1, 1)).sum()
            grad = torch.autograd.grad(logp, x0)[0] / (1 - t)
        torch.testing.assert_close(guided, flow.classifier_guided_velocity(plain, grad, t, 0.1), rtol=1e-4,
                                   atol=1e-5)
        assert (guided - plain).abs().max() > 1e-3


def test_noisy_latent_guides_and_packed_latents_are_refused_before_sampling(pipe, tmp_path):  # noqa: F811
    from distill.accelerate import ClassifierGuidance, accelerated
    from distill.worlds.digits import asset_path
    from tests.flux_tiny import tiny_flux_pipeline

    with pytest.raises(ValueError, match="mode=noisy guides with a classifier of a VP schedule's noisy latents; "
                                         "DistillSD3Pipeline is of the 'sd3' family .* use mode=x0 or mode=clip"):
        with accelerated(pipe, ClassifierGuidance(classifier=str(asset_path("noisy_classifier")))):
            pass
    flux = tiny_flux_pipeline(tmp_path)
    with pytest.raises(ValueError, match="this FluxTransformer2DModel takes 16 channels for the VAE's 4 .*packs"):
        with accelerated(flux, ClassifierGuidance(mode="x0", classifier=str(asset_path("classifier")))):
            pass
