"""Distribution matching distillation (Yin et al. 2024, "Improved Distribution Matching Distillation for Fast Image
Synthesis", DMD2): a few-step generator trained by the reverse-KL gradient between the frozen teacher's guided
score and a fake score that tracks the generator's own distribution, plus a GAN term on the fake score's features;
on a discrete VP teacher (SD UNets) or a flow-matching one (SD3, Flux transformers)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
from torch import nn

from distill.diffusion import FlowMatchingSchedule, cfg, diffusion_loss
from distill.diffusion import flow as flow_math
from distill.diffusion.dmd import (
    dmd_gradient,
    dmd_loss,
    gan_discriminator_loss,
    gan_generator_loss,
    generator_timesteps,
)
from distill.methods import METHODS
from distill.methods.checks import check_resolution
from distill.methods.distillation import TeacherStudentDistillation
from distill.models.teacher import Teacher

# The LCMScheduler's boundary scalings at the generator's timesteps (t >= T / N - 1 > 0): c_skip = sigma_data^2 /
# ((t s)^2 + sigma_data^2) with s = 1e4 is below 1e-13 and c_out rounds to 1 in float32, so its x0 is the generator's
BOUNDARY_FREE_TIMESTEP_SCALING = 1.0e4
FAKE_SCORE_ADAPTER = "fake_score"  # the peft adapter name of a LoRA fake score (method.fake_score=lora)


class DiscriminatorHead(nn.Module):
    """DMD2's classifier branch (sec. 4.3), small: GroupNorm-SiLU-conv twice on a (N, C, H, W) feature, a spatial
    mean and a linear map to one logit per example; weights in PyTorch's default initialisation."""

    def __init__(self, channels: int):
        super().__init__()
        groups = math.gcd(32, channels)
        self.body = nn.Sequential(nn.GroupNorm(groups, channels), nn.SiLU(), nn.Conv2d(channels, channels, 3, padding=1),
                                  nn.GroupNorm(groups, channels), nn.SiLU(), nn.Conv2d(channels, channels, 3, padding=1))
        self.out = nn.Linear(channels, 1)

    def forward(self, feature: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(feature).mean(dim=(2, 3))).squeeze(1)  # (N,)


class TokenDiscriminatorHead(nn.Module):
    """The same head for a transformer's (N, T, D) token feature: LayerNorm-SiLU-linear twice on each token, a mean
    over the tokens and a linear map to one logit per example (a token MLP: it reads any patch or packing layout and
    any resolution, where a reshape to the latent grid would have to undo each family's patching)."""

    def __init__(self, width: int):
        super().__init__()
        self.body = nn.Sequential(nn.LayerNorm(width), nn.SiLU(), nn.Linear(width, width),
                                  nn.LayerNorm(width), nn.SiLU(), nn.Linear(width, width))
        self.out = nn.Linear(width, 1)

    def forward(self, feature: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(feature).mean(dim=1)).squeeze(1)  # (N, T, D) -> (N,)


def discriminator_head(feature: torch.Tensor, width: int) -> nn.Module:
    """The head for a block feature: convolutional on a UNet's (N, C, H, W), token MLP on a transformer's (N, T, D)."""
    return DiscriminatorHead(width) if feature.ndim == 4 else TokenDiscriminatorHead(width)


class FakeScore(nn.Module):
    """The critic: the fake score network ``score`` (a trainable copy of the teacher's denoiser) and the
    discriminator ``head`` reading its feature at ``block`` (the family's mid block), trained together by one
    optimizer as DMD2's guidance model is."""

    def __init__(self, score: nn.Module, block: str, channels: int, feature: Callable[[object], torch.Tensor]):
        super().__init__()
        self.score, self.block = score, block
        self.head = DiscriminatorHead(channels)
        self._feature, self._captured = feature, None
        score.get_submodule(block).register_forward_hook(self._capture)

    def _capture(self, module, inputs, output) -> None:
        self._captured = self._feature(output)

    def last_feature(self) -> torch.Tensor:
        """The feature block's output of the last forward of ``score``."""
        return self._captured


@METHODS.register("dmd2")
class DistributionMatchingDistillation(TeacherStudentDistillation):
    """DMD2 (Yin et al. 2024). The generator G is the student (a copy of the teacher, or LoRA adapters on it); the
    real score is the frozen teacher guided by classifier-free guidance at ``real_guidance_scale``; the fake score is
    a trainable copy of the teacher (``self.critic.score``) trained with the teacher's denoising loss (its prediction
    type, t uniform, unweighted) on the generator's samples, detached.

    Generator loss: for x = G(z), t ~ U{dmd_time_min T, ..., dmd_time_max T} (DMD2's 0.02 and 0.98) and x_t =
    alpha_t x + sigma_t eps, the DMD gradient (fake x0 - real x0) / mean|x - real x0| (DMD eq. 7-8,
    ``dmd_gradient``) applied as 0.5 ||x - stopgrad(x - grad)||^2 (``dmd_loss``), plus ``gan_generator_weight``
    times the non-saturating GAN loss of the discriminator head on the fake score's mid-block feature of a noised x
    (DMD2 sec. 4.3: t ~ U{0, ..., T - 1}), plus, with ``regression_weight`` > 0, DMD v1's regression loss (its
    eq. 9, an MSE in latent space instead of LPIPS) between G(z) and the guided teacher's ``regression_steps``-step
    DDIM solution from the same z (off by default, as in DMD2, sec. 4.1).

    Critic loss: the fake score's denoising loss plus ``gan_critic_weight`` times the discriminator's loss on noised
    training latents (real) and generator samples (fake). Two time-scale update rule (DMD2 sec. 4.2):
    ``critic_updates`` critic updates per generator update, each on the step's batch with its own noise and its own
    generator samples (``DistillMethod.add_role``).

    Multi-step generator (DMD2 sec. 4.4): G maps x_{t_k} to x0 on the fixed timesteps t_0 > ... > t_{N-1}
    (``generator_timesteps``: 999, 749, 499, 249 for N = 4), N = the sampling scheduler's ``num_inference_steps``.
    A training step draws one k for the batch; with ``backward_simulation`` x_{t_k} comes from the generator's own
    earlier steps from pure noise (x0 = G(x_{t_j}, t_j), re-noised with fresh noise to t_{j+1}), as at inference
    (diffusers' LCMScheduler, which the export samples with); without it, from noised training latents. The
    generator's first input is pure noise at t_0 = T - 1.

    On a flow-matching teacher (``FlowMatchingSchedule``: SD3, Flux; x_t = (1 - t) x0 + t eps, v = eps - x0):

    - G maps x_{t_k} to x0 = x_t - t v_G on the N flow times of the family's few-step grid, the trailing sigmas
      shift(linspace(1, 1 / N, N)) (1 step: t = 1; 4 steps at SD3's shift 3: 1, 0.9, 0.75, 0.5), at Flux's mu of the
      training resolution under a resolution shift (``bind_resolution``); backward simulation re-noises x0 to the next
      time by (1 - t) x0 + t eps, which is ``FlowMatchLCMScheduler.step`` (``scheduler=flow_lcm``), the export's
      sampler, given those sigmas by the pipeline (``sigma_spacing="trailing"``; FluxPipeline's own sigmas).
    - The real score is the teacher's velocity guided in velocity form, v_u + s (v_c - v_u) (SD3's CFG, Flux's true
      CFG), read as x0 = x_t - t v (CFG on x0 is the same, x0 being affine in v at fixed x_t); a teacher with
      FLUX.1-dev's guidance embedding takes s through it instead of a CFG pass. A generator with that embedding is
      called at s too (and the export's default call passes s), the fake score at 1 (DMD2's unguided fake score).
    - The fake score's loss is the teacher's flow-matching loss, mean (v - (eps - x0))^2 on detached samples.
    - Times: DMD2's t are fractions of the teacher's T training timesteps (0.02 T to 0.98 T for the DMD loss, all of
      them for the fake score and the GAN, uniformly). A flow scheduler's training timesteps are shift(i / T), so the
      same fractions are taken here: u ~ U[dmd_time_min, dmd_time_max], t = shift(u) (continuous: a flow teacher is
      trained at continuous times), the teacher's own shift (SD3's 3.0: t in [0.058, 0.993]; Flux's at the training
      mu). This keeps the paper's recipe on the teacher's own time table (at shift 1 it is the paper's [0.02, 0.98])
      and spends the DMD loss where the teacher's sampler spends its steps; applying [0.02, 0.98] to t itself would
      undo the shift the teacher was trained and is sampled with.
    - The discriminator reads the fake score's image tokens (N, T, D) at the output of its middle block (the middle
      of the family's feature blocks in forward order: SD3's joint block (L - 1) // 2, Flux's double/single stack
      likewise) through ``TokenDiscriminatorHead``.
    - DMD v1's regression loss (DDIM targets) is VP-only and refused.

    Defaults: DMD2's Stable Diffusion 1.5 recipe (its train_sd.py settings): real guidance 1.75, 10 critic updates
    per generator update, GAN weights 1e-3 (generator) and 1e-2 (critic), backward simulation.
    """

    method_name = "dmd2"

    def __init__(
        self,
        teacher: Teacher,
        student: nn.Module | Callable[[nn.Module], nn.Module],
        optimizer: Callable,
        critic_optimizer: Callable,
        lr_scheduler: Callable | None = None,
        critic_lr_scheduler: Callable | None = None,
        real_guidance_scale: float = 1.75,  # the real score's CFG scale (DMD2, SD-1.5)
        critic_updates: int = 10,  # fake-score updates per generator update (DMD2's dfake_gen_update_ratio, SD-1.5)
        dmd_time_min: float = 0.02,  # the DMD loss's t range as fractions of T (DMD2's min/max_step_percent)
        dmd_time_max: float = 0.98,
        gan_generator_weight: float = 1.0e-3,  # DMD2's gen_cls_loss_weight (SD-1.5); 0: no GAN term
        gan_critic_weight: float = 1.0e-2,  # DMD2's guidance_cls_loss_weight
        backward_simulation: bool = True,
        regression_weight: float = 0.0,  # DMD v1's regression loss; off, as in DMD2
        regression_steps: int = 25,  # the teacher's DDIM steps for the regression targets
        # the training images' side in pixels (conf/method/dmd2.yaml: data.resolution); read only where the teacher's
        # scheduler shifts by resolution (Flux), whose generator times are built at its mu
        resolution: int | None = None,
        # the fake score: "copy", a trainable full copy of the teacher (DMD2); "lora", peft LoRA adapters of rank
        # fake_score_rank (alpha: fake_score_alpha, default the rank) on the frozen teacher's own network, the real
        # score being that network with the adapters off: no second full copy of the teacher in memory
        fake_score: str = "copy",
        fake_score_rank: int = 64,
        fake_score_alpha: float | None = None,
        cache_prompts: bool = True,
        sampling: dict | None = None,
        **speed,  # DistillMethod's training-speed switches (compile, frozen_dtype, ...)
    ):
        check_options(real_guidance_scale, critic_updates, dmd_time_min, dmd_time_max, gan_generator_weight,
                      gan_critic_weight, regression_weight, regression_steps, fake_score, fake_score_rank)
        # a full copy is taken before a LoRA student adapts the teacher's network in place; trained in float32
        # master weights as the student is (a teacher loaded in bf16 would otherwise train its fake score in bf16)
        fake_copy = (copy.deepcopy(teacher.denoiser).float().requires_grad_(True) if fake_score == "copy"
                     else None)
        super().__init__(teacher, student, optimizer, lr_scheduler, guidance_scale_min=real_guidance_scale,
                         guidance_scale_max=real_guidance_scale, cache_prompts=cache_prompts, **speed)
        self.save_hyperparameters(ignore=["teacher", "student", "optimizer", "critic_optimizer", "lr_scheduler",
                                          "critic_lr_scheduler"])
        self.flow = isinstance(self.schedule, FlowMatchingSchedule)
        if self.w_dim is not None:
            raise ValueError(f"student.time_cond_proj_dim={self.w_dim}: a DMD2 generator takes no guidance input (its "
                             "guidance is the real score's, method.real_guidance_scale); set student.time_cond_proj_dim=null")
        if self.flow and regression_weight > 0:
            raise ValueError(f"method.regression_weight={regression_weight} on the flow-matching teacher "
                             f"{self.teacher_source!r}: DMD v1's regression targets are DDIM solutions of a VP teacher; "
                             "set method.regression_weight=0")
        self.sampling = dict(sampling or {"name": "flow_lcm" if self.flow else "lcm", "num_inference_steps": 1,
                                          "guidance_scale": 1.0})
        from distill.inference.schedulers import check_scheduler_kind

        check_scheduler_kind(self.sampling["name"], self.noise_scheduler_config, key="scheduler.name")
        self.bind_resolution(resolution)  # under a resolution shift (Flux): the generator's times at the training mu
        self.fake_score_kind = fake_score
        self.critic = self._fake_score(fake_copy.train() if fake_copy is not None
                                       else self._lora_fake_score(fake_score_rank, fake_score_alpha))
        self.add_role("critic", critic_optimizer, critic_lr_scheduler, updates_per_step=critic_updates)
        self.real_guidance_scale, self.critic_updates = real_guidance_scale, critic_updates
        self.dmd_time_min, self.dmd_time_max = dmd_time_min, dmd_time_max
        self.gan_generator_weight, self.gan_critic_weight = gan_generator_weight, gan_critic_weight
        self.backward_simulation = backward_simulation
        self.regression_weight, self.regression_steps = regression_weight, regression_steps
        steps = self.sampling["num_inference_steps"]
        times = (self.trailing_flow_sigmas(steps)[:-1] if self.flow
                 else generator_timesteps(self.schedule.num_train_timesteps, steps))
        self.register_buffer("generator_timesteps", times, persistent=False)
        self._parts: dict[str, torch.Tensor] = {}  # the last student loss's terms, logged by student_loss

    def _fake_score(self, score: nn.Module) -> FakeScore:
        """The critic on ``score``: its discriminator head at the family's mid block (a UNet's ``mid_block``; else the
        middle of its feature blocks in forward order, a transformer's middle block), sized by a probe forward."""
        blocks = self.family.feature_blocks(score, mid_block=True)
        module = blocks["mid_block"] if "mid_block" in blocks else list(blocks.values())[(len(blocks) - 1) // 2]
        name = next(n for n, m in score.named_modules() if m is module)
        critic = FakeScore(score, name, 1, self.family.block_feature)
        with torch.no_grad():
            x, t, cond = self.family.example_inputs(score)
            self.family.denoise(score, x, t, cond)
        feature = critic.last_feature()
        critic.head = discriminator_head(feature, feature.shape[self.family.feature_width_dim])
        return critic

    def _lora_fake_score(self, rank: int, alpha: float | None) -> nn.Module:
        """The teacher's own network with LoRA adapters ``fake_score`` (peft, on the family's LoRA target modules,
        B = 0: at initialisation the fake score is the teacher, as DMD2's copy is); the real score runs it with the
        adapters off (``teacher_forward``). The base weights stay frozen; only the adapters (and the head) train."""
        from distill.students.copies import add_lora_adapter

        if self.is_lora:
            raise ValueError("method.fake_score=lora with student=lora: both would be adapters on the teacher's one "
                             "network; use student=copy with a LoRA fake score, or method.fake_score=copy")
        network = add_lora_adapter(self.teacher_unet, rank, alpha, adapter_name=FAKE_SCORE_ADAPTER)
        for name, p in network.named_parameters():  # peft gives adapters the base layer's dtype: train in float32
            if f".{FAKE_SCORE_ADAPTER}." in name:
                p.data = p.data.float()
        return network

    @property
    def fake_score_is_lora(self) -> bool:
        return getattr(self, "critic", None) is not None and self.critic.score is self.teacher_unet

    @property
    def teacher_carries_other_adapters(self) -> bool:  # a LoRA fake score's adapters are off for the real score
        return super().teacher_carries_other_adapters or self.fake_score_is_lora

    def frozen_networks(self) -> list[nn.Module]:  # the fake score runs every step too: compiled as the student is
        return super().frozen_networks() + ([] if self.fake_score_is_lora else [self.critic.score])

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """A LoRA fake score is stored as its adapters and head: the teacher's base weights under ``critic.score``
        are the reloaded teacher's (as ``teacher_unet.`` keys are left out)."""
        super().on_save_checkpoint(checkpoint)
        if self.fake_score_is_lora:
            state = checkpoint["state_dict"]
            for key in [k for k in state if k.startswith("critic.score.") and "lora_" not in k]:
                del state[key]

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Loading is not strict (the teacher's frozen weights are not stored), so the critic's trained weights are
        checked here: a checkpoint without this fake score's adapters (another fake_score, rank or target set)
        would otherwise leave them at B = 0 beside a restored optimizer state."""
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.get("state_dict", {})
        wanted = [k for k in self.state_dict() if k.startswith("critic.head.")
                  or (k.startswith("critic.score.") and (not self.fake_score_is_lora or "lora_" in k))]
        missing = [k for k in wanted if k not in state]
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} of the critic's {len(wanted)} trained tensors (e.g. "
                             f"{missing[0]!r}): it was saved with another method.fake_score ({self.fake_score_kind!r} "
                             "now) or fake_score_rank; resume with the settings it was trained with")

    # ------------------------------------------------------------------ guidance inputs (FLUX.1-dev's embedding)

    def _guidance(self, embedded: bool, scale: float, n: int, device) -> dict:
        """The guidance-input keyword arguments of a network with the family's guidance embedding, at ``scale`` for
        ``n`` rows; none for a network without one."""
        return self.family.guidance_input(torch.full((n,), scale, device=device)) if embedded else {}

    def _fake_kwargs(self, n: int, device) -> dict:
        return self._guidance(self.teacher_guidance_embedded, 1.0, n, device)  # DMD2's fake_guidance_scale = 1

    # ------------------------------------------------------------------ the generator

    def generator_x0(self, x_t: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        """G(x_t, t): the student's x0 at (x_t, t) in the teacher's parametrisation (flow: x_t - t v)."""
        extra = self._guidance(self.student_guidance_embedded, self.real_guidance_scale, len(x_t), x_t.device)
        return self.schedule.to_x0_eps(self.family.denoise(self.student, x_t, t, cond, **extra), x_t, t)[0]

    def generator_inputs(self, x_real: torch.Tensor, cond: dict, generator: torch.Generator | None = None,
                         step: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x_{t_k}, t_k) for a drawn step k (``step``: that one) of the generator's timesteps: pure noise at k = 0;
        else, with backward simulation, the generator's own k earlier steps from pure noise, each x0 re-noised with
        fresh noise to the next timestep (no gradient), or noised training latents without it."""
        n, steps = x_real.shape[0], self.generator_timesteps
        k = int(torch.randint(len(steps), (1,), generator=generator)) if step is None else step
        x = torch.randn(x_real.shape, generator=generator).to(x_real)
        at = lambda j: steps[j].expand(n).to(x_real.device)  # noqa: E731  (the batch's timestep j)
        if k > 0 and not self.backward_simulation:
            return self.schedule.add_noise(x_real, x, at(k)), at(k)
        with torch.no_grad():
            for j in range(k):
                x0 = self.generator_x0(x, at(j), cond)
                x = self.schedule.add_noise(x0, torch.randn(x.shape, generator=generator).to(x), at(j + 1))
        return x, at(k)

    def generator_sample(self, x_real: torch.Tensor, cond: dict, generator: torch.Generator | None = None,
                         step: int | None = None) -> torch.Tensor:
        """G's x0 at its drawn step's input (``generator_inputs``), with the gradient to G's parameters."""
        x_t, t = self.generator_inputs(x_real, cond, generator, step)
        return self.generator_x0(x_t, t, cond)

    # ------------------------------------------------------------------ scores

    def draw_times(self, n: int, low: float, high: float, device, generator=None) -> torch.Tensor:
        """(n,) times at fractions [low, high] of the teacher's T training timesteps: integer timesteps uniform in
        [floor(low T), floor(high T)] (clipped to T - 1) on a VP schedule; on a flow schedule t = shift(u), u ~ U[low,
        high] (the scheduler's training timesteps are shift(i / T); Flux's shift at the training mu)."""
        if not self.flow:
            T = self.schedule.num_train_timesteps
            lo, hi = int(low * T), min(int(high * T), T - 1)
            return torch.randint(lo, hi + 1, (n,), generator=generator).to(device)
        u = low + (high - low) * torch.rand(n, generator=generator, dtype=torch.float64)
        if self.mu is not None:
            t = flow_math.time_shift(u, self.mu, 1.0, self.schedule.time_shift_type)
        else:
            t = self.schedule.shift_times(u)
        return t.float().to(device)

    def real_x0(self, x_t: torch.Tensor, t: torch.Tensor, cond: dict, uncond: dict) -> torch.Tensor:
        """The real score's x0: the frozen teacher's, guided at ``real_guidance_scale`` (classifier-free guidance, or
        a teacher's guidance embedding)."""
        if self.teacher_guidance_embedded:
            extra = self._guidance(True, self.real_guidance_scale, len(x_t), x_t.device)
            return self.schedule.to_x0_eps(self.teacher_forward(x_t, t, cond, **extra), x_t, t)[0]
        out_c, out_u = self.teacher_cond_uncond(x_t, t, cond, uncond)
        x0_c = self.schedule.to_x0_eps(out_c, x_t, t)[0]
        if self.real_guidance_scale == 1.0:
            return x0_c
        return cfg(x0_c, self.schedule.to_x0_eps(out_u, x_t, t)[0], self.real_guidance_scale)

    def fake_x0(self, x_t: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        """The fake score's x0 (unguided, as DMD2's fake_guidance_scale = 1), without gradient."""
        with torch.no_grad():
            out = self.family.denoise(self.critic.score, x_t, t, cond, **self._fake_kwargs(len(x_t), x_t.device))
            return self.schedule.to_x0_eps(out, x_t, t)[0].float()

    def discriminator_logits(self, x0: torch.Tensor, cond: dict, generator: torch.Generator | None = None
                             ) -> torch.Tensor:
        """(N,) the head's logits on the fake score's mid-block feature of x0 noised at t ~ U{0, ..., T - 1}
        (DMD2's diffusion GAN, max timestep T)."""
        t = self.draw_times(x0.shape[0], 0.0, 1.0, x0.device, generator)
        noise = torch.randn(x0.shape, generator=generator).to(x0)
        self.family.denoise(self.critic.score, self.schedule.add_noise(x0, noise, t), t, cond,
                            **self._fake_kwargs(len(x0), x0.device))
        return self.critic.head(self.critic.last_feature())

    # ------------------------------------------------------------------ losses by role

    def loss(self, batch: dict, generator: torch.Generator | None = None) -> torch.Tensor:
        """The generator's loss: the DMD loss, the GAN generator loss and the optional regression loss."""
        x_real = self.latents(batch, generator)  # (N, C, h, w): the GAN's real samples, noised inputs w/o simulation
        self.check_latent_size(x_real, "generator's time list")
        n, device = x_real.shape[0], x_real.device
        cond, uncond = self.text_conditions(batch, n, device)
        x = self.generator_sample(x_real, cond, generator)
        t = self.draw_times(n, self.dmd_time_min, self.dmd_time_max, device, generator)
        x_t = self.schedule.add_noise(x.detach(), torch.randn(x.shape, generator=generator).to(x), t)
        grad = dmd_gradient(x, self.real_x0(x_t, t, cond, uncond), self.fake_x0(x_t, t, cond))
        parts = {"dmd_loss": dmd_loss(x, grad)}
        if self.gan_generator_weight > 0:
            parts["gan_loss"] = self.gan_generator_weight * gan_generator_loss(
                self.discriminator_logits(x, cond, generator))
        if self.regression_weight > 0:
            parts["regression_loss"] = self.regression_weight * self.regression_loss(x_real, cond, uncond, generator)
        self._parts = {k: v.detach() for k, v in parts.items()}
        return sum(parts.values())

    def student_loss(self, batch: dict) -> torch.Tensor:
        loss = self.loss(batch)
        self.log_dict({f"train/{k}": v for k, v in self._parts.items()}, batch_size=len(batch["caption"]))
        return loss

    def critic_loss(self, batch: dict, generator: torch.Generator | None = None) -> torch.Tensor:
        """The fake score's denoising loss on detached generator samples x (the teacher's objective: mean (pred -
        target)^2 of its prediction type at x_t = alpha_t x + sigma_t eps, t drawn over all of the teacher's
        training times: the velocity target eps - x on a flow teacher) plus ``gan_critic_weight`` times the
        discriminator's loss on noised training latents and samples; the three inputs in one forward of the fake
        score."""
        x_real = self.latents(batch, generator)
        n, device = x_real.shape[0], x_real.device
        cond, _ = self.text_conditions(batch, n, device)
        with torch.no_grad():
            x = self.generator_sample(x_real, cond, generator)
        t = self.draw_times(n, 0.0, 1.0, device, generator)
        eps = torch.randn(x.shape, generator=generator).to(x)
        inputs, times, conds = [self.schedule.add_noise(x, eps, t)], [t], [cond]
        gan = self.gan_critic_weight > 0
        if gan:  # DMD2's diffusion GAN: real latents and samples noised at t ~ U{0, ..., T - 1}
            for x0 in (x_real, x):
                t_d = self.draw_times(n, 0.0, 1.0, device, generator)
                inputs.append(self.schedule.add_noise(x0, torch.randn(x0.shape, generator=generator).to(x0), t_d))
                times.append(t_d)
                conds.append(cond)
        rows = n * len(inputs)
        pred = self.family.denoise(self.critic.score, torch.cat(inputs), torch.cat(times),
                                   {k: torch.cat([c[k] for c in conds]) for k in cond},
                                   **self._fake_kwargs(rows, device))
        loss = diffusion_loss(pred[:n], self.schedule.prediction_target(x, eps, t))
        if gan:
            logits = self.critic.head(self.critic.last_feature()[n:])
            loss = loss + self.gan_critic_weight * gan_discriminator_loss(logits[:n], logits[n:])
        return loss

    def regression_loss(self, x_real: torch.Tensor, cond: dict, uncond: dict,
                        generator: torch.Generator | None = None) -> torch.Tensor:
        """DMD v1's regression loss (Yin et al. 2024a, eq. 9, MSE for LPIPS): G(z) at its first timestep against the
        guided teacher's deterministic ``regression_steps``-step DDIM solution from the same z."""
        from distill.diffusion import ddim_step
        from distill.diffusion.consistency import ddim_timesteps

        z = torch.randn(x_real.shape, generator=generator).to(x_real)
        n, T = z.shape[0], self.schedule.num_train_timesteps
        grid = ddim_timesteps(T, self.regression_steps).flip(0).tolist()  # descending
        x = z
        for i, t in enumerate(grid):
            t_now = torch.full((n,), t, device=z.device)
            t_next = torch.full((n,), grid[i + 1] if i + 1 < len(grid) else T, device=z.device)  # T: the clean sample
            out_c, out_u = self.teacher_cond_uncond(x, t_now, cond, uncond)
            x0_c, eps_c = self.schedule.to_x0_eps(out_c, x, t_now)
            x0_u, eps_u = self.schedule.to_x0_eps(out_u, x, t_now)
            g = self.real_guidance_scale
            x = ddim_step(cfg(x0_c, x0_u, g), cfg(eps_c, eps_u, g), *self.schedule.alpha_sigma(t_next, x.ndim))
        first = self.generator_timesteps[0].expand(n).to(z.device)
        return (self.generator_x0(z, first, cond) - x).pow(2).mean()

    # ------------------------------------------------------------------ sampling and export

    @property
    def num_inference_steps(self) -> int:
        return self.sampling["num_inference_steps"]

    def sampling_scheduler(self, name: str | None = None):
        """diffusers' LCMScheduler on the generator's timesteps (``original_inference_steps`` = its step count):
        x0 from the generator, re-noised with fresh noise to the next timestep, as in training; its boundary
        scalings made vanish (``BOUNDARY_FREE_TIMESTEP_SCALING``). On a flow teacher ``FlowMatchLCMScheduler`` from
        the teacher's scheduler config (its shift kept): x0 = x_t - t v, re-noised to the next sigma, on the sigmas
        the pipeline gives it (``extra_call_defaults``). Another ``name``: that scheduler as configured."""
        from distill.inference.schedulers import make_scheduler, scheduler_options

        name = name or self.sampling["name"]
        if name == "flow_lcm":
            return make_scheduler(name, self.noise_scheduler_config)
        if name != "lcm":
            return make_scheduler(name, self.noise_scheduler_config, **scheduler_options(name))
        return make_scheduler("lcm", self.noise_scheduler_config, original_inference_steps=self.num_inference_steps,
                              timestep_scaling=BOUNDARY_FREE_TIMESTEP_SCALING)

    def extra_call_defaults(self) -> dict:
        """On a flow teacher with a static shift, the trailing sigma spacing (the generator's times; under a
        resolution shift FluxPipeline's own sigmas are those); a generator with a guidance embedding is called at
        ``real_guidance_scale``, as trained."""
        defaults = {}
        if self.flow and not self.schedule.use_dynamic_shifting:
            defaults["sigma_spacing"] = "trailing"
        if self.student_guidance_embedded:
            defaults["default_guidance_scale"] = self.real_guidance_scale
        return defaults

    def guidance_source(self) -> str:
        kind = "embedded guidance" if self.teacher_guidance_embedded else "classifier-free guidance"
        return f"the teacher's {kind} at scale {self.real_guidance_scale} (the real score)"

    def export_info(self) -> dict:
        info = {**super().export_info(), "generator_timesteps": self.generator_timesteps.tolist(),
                "real_guidance_scale": self.real_guidance_scale, "critic_updates": self.critic_updates,
                "backward_simulation": self.backward_simulation}
        if self.flow:
            info.update(generator="x0 = x_t - t v at the flow times generator_timesteps, re-noised by "
                                  "(1 - t) x0 + t eps (FlowMatchLCMScheduler)")
        return info

    @classmethod
    def check_config(cls, cfg) -> None:
        """The options (``check_options``), the generator's own sampler (``lcm`` on a VP teacher, ``flow_lcm`` on a
        flow-matching one, read from a local teacher's scheduler config), a student without a guidance input,
        ``method.resolution`` the data's, no regression loss on a flow teacher."""
        m = cfg.method
        check_options(m.real_guidance_scale, m.critic_updates, m.dmd_time_min, m.dmd_time_max, m.gan_generator_weight,
                      m.gan_critic_weight, m.regression_weight, m.regression_steps, m.fake_score, m.fake_score_rank)
        name = str(getattr(cfg.scheduler.name, "value", cfg.scheduler.name))
        if name not in ("lcm", "flow_lcm"):
            raise ValueError(f"scheduler.name={name!r}: a DMD2 generator samples on its own timesteps "
                             "with the LCM scheduler (x0, then re-noise); use scheduler=lcm (scheduler=flow_lcm on a "
                             "flow-matching teacher)")
        flow = _flow_teacher(cfg)
        if flow is not None and flow != (name == "flow_lcm"):
            teacher = cfg.teacher.pretrained_model_name_or_path
            fix = "+exp=dmd2_flow (scheduler=flow_lcm)" if flow else "+exp=dmd2 (scheduler=lcm)"
            raise ValueError(f"scheduler.name={name!r} on the {'flow-matching' if flow else 'discrete VP'} teacher "
                             f"{str(teacher)!r}: the generator samples with its kind of LCM scheduler; use {fix}")
        if flow and m.regression_weight > 0:
            raise ValueError(f"method.regression_weight={m.regression_weight} on a flow-matching teacher: DMD v1's "
                             "regression targets are DDIM solutions of a VP teacher; set method.regression_weight=0")
        if m.fake_score == "lora" and _student_is_lora(cfg):
            raise ValueError("method.fake_score=lora with student=lora: both would be adapters on the teacher's one "
                             "network; use student=copy with a LoRA fake score, or method.fake_score=copy")
        w_dim = cfg.get("student", {}).get("time_cond_proj_dim")
        if w_dim is not None:
            raise ValueError(f"student.time_cond_proj_dim={w_dim}: a DMD2 generator takes no guidance input (its "
                             "guidance is the real score's, method.real_guidance_scale); set student.time_cond_proj_dim=null")
        check_resolution(cfg)


def _student_is_lora(cfg) -> bool:
    """Whether the configured student is ``student=lora`` (adapters on the teacher's own network)."""
    from hydra.utils import get_object

    from distill.students import STUDENTS

    target = (cfg.get("student") or {}).get("_target_")
    try:
        return target is not None and STUDENTS.name_of(get_object(str(target))) == "lora"
    except (ImportError, AttributeError, KeyError, ValueError):
        return False


def _flow_teacher(cfg) -> bool | None:
    """Whether a local teacher folder is flow matching, from its scheduler config alone; None for a hub id (the
    method's constructor checks it once loaded)."""
    from pathlib import Path

    from distill.models.teacher import is_flow_matching, pipeline_configs

    path = Path(str(cfg.teacher.pretrained_model_name_or_path))
    return is_flow_matching(pipeline_configs(path)["scheduler"]) if path.exists() else None


def check_options(real_guidance_scale: float, critic_updates: int, dmd_time_min: float, dmd_time_max: float,
                  gan_generator_weight: float, gan_critic_weight: float, regression_weight: float,
                  regression_steps: int, fake_score: str = "copy", fake_score_rank: int = 64) -> None:
    """DMD2's options, each refused with the key and the fix."""
    if fake_score not in ("copy", "lora"):
        raise ValueError(f"method.fake_score={fake_score!r}: use copy (a full trainable copy of the teacher, DMD2's) "
                         "or lora (adapters on the frozen teacher)")
    if isinstance(fake_score_rank, bool) or not isinstance(fake_score_rank, int) or fake_score_rank < 1:
        raise ValueError(f"method.fake_score_rank={fake_score_rank!r} must be an integer >= 1 (the LoRA fake score's "
                         "rank)")
    if real_guidance_scale < 1.0:
        raise ValueError(f"method.real_guidance_scale={real_guidance_scale} must be >= 1 (1 = the unguided teacher)")
    if isinstance(critic_updates, bool) or not isinstance(critic_updates, int) or critic_updates < 1:
        raise ValueError(f"method.critic_updates={critic_updates!r} must be an integer >= 1 (fake-score updates per "
                         "generator update; DMD2 uses 5-10)")
    if not 0.0 <= dmd_time_min < dmd_time_max <= 1.0:
        raise ValueError(f"method.dmd_time_min={dmd_time_min}, method.dmd_time_max={dmd_time_max}: the DMD loss's "
                         "times are fractions of T with 0 <= min < max <= 1 (DMD2: 0.02, 0.98)")
    for key, value in (("gan_generator_weight", gan_generator_weight), ("gan_critic_weight", gan_critic_weight),
                       ("regression_weight", regression_weight)):
        if value < 0:
            raise ValueError(f"method.{key}={value} must be >= 0 (0 turns the term off)")
    if regression_steps < 1:
        raise ValueError(f"method.regression_steps={regression_steps} must be >= 1")
