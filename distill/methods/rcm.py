"""rCM (Zheng et al. 2025, "Large Scale Diffusion Distillation via Score-Regularized Continuous-Time Consistency",
arXiv 2510.08431): sCD plus DMD2's distribution-matching term as a regulariser, with DMD2's fake-score critic.

The student loss is sCM's (``ContinuousTimeConsistencyDistillation``) plus ``dmd_weight`` times the DMD loss of the
student's own samples; the critic (a trainable copy of the teacher, DMD2's fake score) is trained with the teacher's
denoising loss on those samples, ``critic_updates`` times per student update (the base's roles). The DMD pieces are
DMD2's own, not copies: ``distill.methods.dmd2``'s fake-score builder, real and fake x0, time draw and critic loss are
this class's methods too (``DistributionMatchingDistillation.<name>``), on the attributes they read (``critic``,
``real_guidance_scale``, ``gan_critic_weight`` = 0: rCM has no GAN head in its loss); ``distill.diffusion.dmd`` gives
the gradient and the loss.

The student's samples (``generator_sample``): its own sampler from noise, the export's (f at t_max, re-noised to the
intermediate times), at a step k drawn from its N steps with the k earlier steps without gradient (DMD2's backward
simulation on sCM's times).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from distill.diffusion import trigflow as tf
from distill.diffusion.dmd import dmd_gradient, dmd_loss
from distill.diffusion.jvp import JVP_MODES
from distill.methods import METHODS
from distill.methods.dmd2 import DistributionMatchingDistillation as DMD2
from distill.methods.scm import ContinuousTimeConsistencyDistillation, _check_scm_config
from distill.models.teacher import Teacher


@METHODS.register("rcm", choices={"jvp": JVP_MODES},
                  kwargs_of="distill.methods.scm.ContinuousTimeConsistencyDistillation")
class ScoreRegularizedConsistencyDistillation(ContinuousTimeConsistencyDistillation):
    """rCM: sCD + ``dmd_weight`` x DMD2's distribution-matching loss, DMD2's fake score as the critic."""

    method_name = "rcm"

    def __init__(
        self,
        teacher: Teacher,
        student: nn.Module | Callable[[nn.Module], nn.Module],
        optimizer: Callable,
        critic_optimizer: Callable,
        lr_scheduler: Callable | None = None,
        critic_lr_scheduler: Callable | None = None,
        # the DMD term's weight against sCM's loss, per element (rCM's code: sCM's squared error x 100, DMD's x 1)
        dmd_weight: float = 0.01,
        critic_updates: int = 4,  # fake-score updates per student update (rCM's student_update_freq 5: 4 critic steps)
        dmd_time_min: float = 0.02,  # the DMD loss's times as fractions of the teacher's T (DMD2's 0.02, 0.98)
        dmd_time_max: float = 0.98,
        **scm,  # ContinuousTimeConsistencyDistillation's options
    ):
        if dmd_weight < 0:
            raise ValueError(f"method.dmd_weight={dmd_weight} must be >= 0 (0: sCD, method=scm)")
        if not 0.0 <= dmd_time_min < dmd_time_max <= 1.0:
            raise ValueError(f"method.dmd_time_min={dmd_time_min}, method.dmd_time_max={dmd_time_max}: fractions of T "
                             "with 0 <= min < max <= 1 (DMD2: 0.02, 0.98)")
        fake_score = copy.deepcopy(teacher.denoiser).float().requires_grad_(True)  # trained in float32
        super().__init__(teacher, student, optimizer, lr_scheduler, **scm)
        self.dmd_weight, self.dmd_time_min, self.dmd_time_max = dmd_weight, dmd_time_min, dmd_time_max
        self.real_guidance_scale, self.gan_critic_weight, self.critic_updates = self.guidance_scale, 0.0, critic_updates
        self.critic = self._fake_score(fake_score.train())
        self.add_role("critic", critic_optimizer, critic_lr_scheduler, updates_per_step=critic_updates)
        self._parts: dict[str, torch.Tensor] = {}

    # DMD2's pieces, reused as they are
    _fake_score = DMD2._fake_score
    _guidance = DMD2._guidance
    _fake_kwargs = DMD2._fake_kwargs
    draw_times = DMD2.draw_times
    real_x0 = DMD2.real_x0
    fake_x0 = DMD2.fake_x0
    critic_loss = DMD2.critic_loss

    def frozen_networks(self) -> list[nn.Module]:
        return super().frozen_networks() + [self.critic.score]

    def generator_sample(self, x_real: torch.Tensor, cond: dict, generator: torch.Generator | None = None,
                         step: int | None = None) -> torch.Tensor:
        """The student's sample x0 at step k (drawn; ``step``: that one) of its own N-step sampler from noise, the
        k earlier steps without gradient (the TrigFlow sample at t_0 is the export's initial noise, c(t_0) x = z)."""
        times = torch.tensor(self.sampling_times(), dtype=torch.float64, device=x_real.device)
        n = len(x_real)
        k = int(torch.randint(len(times), (1,), generator=generator)) if step is None else step
        at = lambda j: times[j].expand(n)  # noqa: E731
        z = torch.randn(x_real.shape, generator=generator).to(x_real)
        x = z / self._scale(at(0), z)
        with torch.no_grad():
            for j in range(k):
                x0 = self.consistency(self.student, x, at(j), cond)
                eps = torch.randn(x.shape, generator=generator).to(x)
                x = tf.trigflow_sample(x0, self.sigma_data * eps, at(j + 1))
        return self.consistency(self.student, x, at(k), cond)

    def _scale(self, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """c(t) of the teacher-space sample c x_t, shaped against ``like``."""
        c = tf.flow_view(t, self.sigma_data)[0] if self.flow else tf.vp_view(t, self.sigma_data)[0]
        return c.to(like).view((-1,) + (1,) * (like.ndim - 1))

    def dmd_term(self, x_real: torch.Tensor, cond: dict, uncond: dict,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """DMD2's generator loss on the student's sample (``dmd_gradient``, ``dmd_loss``) at the teacher's times
        [dmd_time_min, dmd_time_max] of T."""
        x = self.generator_sample(x_real, cond, generator)
        t = self.draw_times(len(x), self.dmd_time_min, self.dmd_time_max, x.device, generator)
        x_t = self.schedule.add_noise(x.detach(), torch.randn(x.shape, generator=generator).to(x), t)
        return dmd_loss(x, dmd_gradient(x, self.real_x0(x_t, t, cond, uncond), self.fake_x0(x_t, t, cond)))

    def dmd_active(self) -> bool:
        """Whether this step adds the DMD term: after the tangent warm-up, as rCM's code (iteration >
        tangent_warmup), so that the consistency training is stable before the distribution matching pulls."""
        return self.dmd_weight > 0 and self.global_step >= self.tangent_warmup_steps

    def loss(self, batch: dict, generator: torch.Generator | None = None) -> torch.Tensor:
        """sCM's loss plus ``dmd_weight`` x 2 e^{w(t)} x the DMD loss. rCM's code adds the two as plain squared errors
        at 100 : 1 per element; here sCM's term carries the learned weighting e^{w(t)} / D (whose optimum makes it
        about D / ||g||^2) and DMD2's loss is 0.5 x an element mean, so the DMD term is scaled by 2 e^{w} (the batch
        mean of the sCM times' weights, detached): the per-element gradient ratio of the two terms is then rCM's
        ``dmd_weight`` whatever w has learned (unscaled, the DMD term faded as e^{w} grew towards D)."""
        terms = self.scm_terms(batch, generator)
        parts = {"scm_loss": self.scm_loss(terms)}
        if self.dmd_active():
            scale = 2 * self.weighting(terms["t"]).detach().exp().mean()
            parts["dmd_loss"] = self.dmd_weight * scale * self.dmd_term(terms["x0"], terms["cond"], terms["uncond"],
                                                                        generator)
        self._parts = {k: v.detach() for k, v in parts.items()}
        return sum(parts.values())

    def student_loss(self, batch: dict) -> torch.Tensor:
        loss = self.loss(batch)
        self.log_dict({f"train/{k}": v for k, v in self._parts.items()}, batch_size=len(batch["caption"]))
        return loss

    def export_info(self) -> dict:
        return {**super().export_info(), "dmd_weight": self.dmd_weight, "critic_updates": self.critic_updates,
                "real_guidance_scale": self.real_guidance_scale}

    @classmethod
    def check_config(cls, cfg) -> None:
        _check_scm_config(cfg)
