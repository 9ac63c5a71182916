"""Distribution matching distillation as pure functions: the DMD gradient and its loss (Yin et al. 2024, "One-step
Diffusion with Distribution Matching Distillation", eq. 7-8; "Improved Distribution Matching Distillation for Fast
Image Synthesis" (DMD2), sec. 4), the generator's timestep list, the non-saturating GAN losses (sec. 4.3)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dmd_gradient(x: torch.Tensor, real_x0: torch.Tensor, fake_x0: torch.Tensor,
                 normalize: bool = True) -> torch.Tensor:
    """The distribution matching gradient of the reverse KL w.r.t. the generator output x (DMD eq. 7-8):
    s_fake(x_t) - s_real(x_t) = alpha_t (fake_x0 - real_x0) / sigma_t^2, taken as fake_x0 - real_x0 (the weight
    w_t = sigma_t^2 / alpha_t of eq. 8 times alpha_t), divided per example by mean_{c,h,w} |x - real_x0|
    (``normalize``, eq. 8's 1 / ||mu_base(x_t, t) - x||_1 with a mean). (N, ...) -> (N, ...); a non-finite entry
    (a zero normaliser) is 0, as DMD2's ``nan_to_num``."""
    grad = fake_x0.float() - real_x0.float()
    if normalize:
        scale = (x.float() - real_x0.float()).abs().flatten(1).mean(1)  # (N,)
        grad = grad / scale.view((-1,) + (1,) * (x.ndim - 1))
    return torch.nan_to_num(grad, nan=0.0, posinf=0.0, neginf=0.0)


def dmd_loss(x: torch.Tensor, grad: torch.Tensor, reduce: bool = True) -> torch.Tensor:
    """0.5 ||x - stopgrad(x - grad)||^2 averaged over the elements (DMD2's implementation of eq. 8): its gradient
    w.r.t. x is grad / (number of elements), so backpropagating it applies the DMD gradient through the generator.
    ``reduce=False``: the (N,) per-example means."""
    per_example = 0.5 * (x.float() - (x.float() - grad).detach()).pow(2).flatten(1).mean(1)
    return per_example.mean() if reduce else per_example


def generator_timesteps(num_train_timesteps: int, num_steps: int) -> torch.Tensor:
    """The multi-step generator's timesteps (descending), t_k = (N - k) floor(T / N) - 1: DMD2's 4-step list
    999, 749, 499, 249 for T = 1000 (sec. 4.4), [T - 1] for one step; the timesteps diffusers' LCMScheduler samples
    N steps on with ``original_inference_steps=N``."""
    if not 1 <= num_steps <= num_train_timesteps:
        raise ValueError(f"num_inference_steps={num_steps} must be in [1, {num_train_timesteps}] (the generator's steps)")
    stride = num_train_timesteps // num_steps
    return torch.arange(num_steps, 0, -1) * stride - 1


def gan_generator_loss(fake_logits: torch.Tensor) -> torch.Tensor:
    """The generator's non-saturating GAN loss (Goodfellow et al. 2014; DMD2 eq. 4's generator side):
    E[-log sigmoid(D(G(z)))] = E[softplus(-D(G(z)))]."""
    return F.softplus(-fake_logits.float()).mean()


def gan_discriminator_loss(real_logits: torch.Tensor, fake_logits: torch.Tensor) -> torch.Tensor:
    """The discriminator's loss (DMD2 eq. 4): E[-log sigmoid(D(x))] + E[-log(1 - sigmoid(D(G(z))))]
    = E[softplus(-D(x))] + E[softplus(D(G(z)))]."""
    return F.softplus(-real_logits.float()).mean() + F.softplus(fake_logits.float()).mean()
