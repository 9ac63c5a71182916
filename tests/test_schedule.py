"""The one noise schedule (distill.diffusion.DiscreteVPSchedule): bit for bit against diffusers' own DDPM and DDIM
schedulers, its noise-level view, bad input, and every method noising and converting through it alone."""

from __future__ import annotations

import pytest
import torch
from diffusers import DDIMScheduler, DDPMScheduler, FlowMatchEulerDiscreteScheduler

from distill.diffusion import DiscreteVPSchedule, ddim_step

SD = dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)  # Stable Diffusion's betas
TABLES = {"sd": SD, "linear": {}, "cosine": dict(beta_schedule="squaredcos_cap_v2"),
          "zero_snr": dict(SD, rescale_betas_zero_snr=True)}
T_PROBE = torch.tensor([0, 1, 10, 250, 500, 777, 998, 999])


def _pair(n: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, 8, 8, generator=g), torch.randn(n, 4, 8, 8, generator=g)


@pytest.mark.parametrize("table", list(TABLES))
def test_alpha_and_sigma_index_the_schedulers_float32_table(table):
    """alpha(t) and sigma(t) are the scheduler's own float32 alphas_cumprod at t, square-rooted as diffusers' add_noise
    does (nothing interpolated or recomputed); index T is the clean sample (alpha 1, sigma 0)."""
    ddpm = DDPMScheduler(**TABLES[table])
    schedule = DiscreteVPSchedule.from_scheduler(ddpm)
    abar = ddpm.alphas_cumprod[T_PROBE]
    alpha, sigma = schedule.alpha_sigma(T_PROBE)
    assert alpha.dtype == sigma.dtype == torch.float32 and ddpm.alphas_cumprod.dtype == torch.float32
    assert torch.equal(alpha, abar ** 0.5) and torch.equal(sigma, (1 - abar) ** 0.5)
    assert torch.equal(schedule.alpha(T_PROBE), alpha) and torch.equal(schedule.sigma(T_PROBE), sigma)
    assert schedule.alpha_sigma(T_PROBE, 4)[0].shape == (8, 1, 1, 1)
    assert torch.equal(schedule.snr(T_PROBE), alpha ** 2 / sigma ** 2)
    end = torch.tensor([schedule.num_train_timesteps])
    assert schedule.num_train_timesteps == 1000 and schedule.alpha(end).item() == 1.0 and schedule.sigma(end).item() == 0.0


@pytest.mark.parametrize("table", list(TABLES))
def test_add_noise_and_velocity_equal_ddpms(table):
    ddpm = DDPMScheduler(**TABLES[table])
    schedule = DiscreteVPSchedule.from_scheduler(ddpm)
    x0, eps = _pair()
    assert torch.equal(schedule.add_noise(x0, eps, T_PROBE), ddpm.add_noise(x0, eps, T_PROBE))
    assert torch.equal(schedule.prediction_target(x0, eps, T_PROBE, "v_prediction"), ddpm.get_velocity(x0, eps, T_PROBE))
    assert torch.equal(schedule.prediction_target(x0, eps, T_PROBE, "epsilon"), eps)
    assert torch.equal(schedule.prediction_target(x0, eps, T_PROBE, "sample"), x0)


@pytest.mark.parametrize("prediction_type", ["epsilon", "sample", "v_prediction"])
@pytest.mark.parametrize("table", ["sd", "zero_snr"])
def test_x0_eps_conversion_and_a_ddim_step_equal_ddims(prediction_type, table):
    """DDIMScheduler.step (eta 0) at 50 steps: its x0 is the schedule's to_x0_eps, its previous sample a DDIM step
    to t - 20 (from t = 0 to the clean sample, set_alpha_to_one), bit for bit, for each prediction type."""
    ddim = DDIMScheduler(**TABLES[table], prediction_type=prediction_type, clip_sample=False, set_alpha_to_one=True)
    ddim.set_timesteps(50)
    schedule = DiscreteVPSchedule.from_scheduler(ddim)
    assert schedule.prediction_type == prediction_type  # the family's: the default of every conversion
    out, x_t = _pair(1, seed=1)
    for t in (980, 500, 0):
        ref = ddim.step(out, t, x_t)
        tt = torch.tensor([t])
        x0, eps = schedule.to_x0_eps(out, x_t, tt)
        assert torch.equal(x0, ref.pred_original_sample)
        t_prev = torch.tensor([t - 20 if t >= 20 else schedule.num_train_timesteps])
        assert torch.equal(ddim_step(x0, eps, *schedule.alpha_sigma(t_prev, 4)), ref.prev_sample)
        torch.testing.assert_close(schedule.prediction_target(x0, eps, tt), out, rtol=1e-4, atol=1e-4)  # round trip


def test_the_noise_level_view_of_the_same_table():
    """VE levels sigma = sqrt((1 - abar) / abar) in float64; the timestep of a table level is its index; the VP
    (alpha, sigma) at a level makes alpha (x0 + sigma_ve eps) the VP sample of that timestep."""
    ddpm = DDPMScheduler(**SD)
    schedule = DiscreteVPSchedule.from_scheduler(ddpm)
    a = ddpm.alphas_cumprod.double()
    assert schedule.ve_sigmas.dtype == torch.float64 and torch.equal(schedule.ve_sigmas, ((1 - a) / a).sqrt())
    levels = schedule.ve_sigmas[T_PROBE]
    torch.testing.assert_close(schedule.timestep_at(levels), T_PROBE.double(), rtol=0, atol=1e-9)
    x0, eps = _pair()
    alpha, sigma = schedule.alpha_sigma_at(levels, x0)
    assert alpha.shape == (8, 1, 1, 1) and alpha.dtype == torch.float32
    want_alpha, want_sigma = schedule.alpha_sigma(T_PROBE, 4)
    torch.testing.assert_close(alpha, want_alpha, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(sigma, want_sigma, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(alpha * (x0 + levels.float().view(-1, 1, 1, 1) * eps),
                               schedule.add_noise(x0, eps, T_PROBE), rtol=1e-4, atol=1e-5)


def test_tables_move_with_the_module_and_stay_out_of_checkpoints():
    schedule = DiscreteVPSchedule.from_scheduler(DDPMScheduler(**SD))
    assert schedule.state_dict() == {}
    assert {name for name, _ in schedule.named_buffers()} == {"abar", "ve_sigmas"}
    assert schedule.to(torch.float64).abar.dtype == torch.float64  # a buffer: .to() takes it along


def test_bad_input_fails_naming_the_value():
    schedule = DiscreteVPSchedule.from_scheduler(DDPMScheduler(**SD))
    with pytest.raises(ValueError, match="t has dtype torch.float32.*integer timesteps 0..1000.*timestep_at"):
        schedule.alpha_sigma(torch.tensor([0.5]))
    with pytest.raises(ValueError, match="prediction_type='flow'"):
        DiscreteVPSchedule(DDPMScheduler().alphas_cumprod, "flow")
    with pytest.raises(ValueError, match="FlowMatchEulerDiscreteScheduler has no alphas_cumprod"):
        DiscreteVPSchedule.from_scheduler(FlowMatchEulerDiscreteScheduler())


# ---------------------------------------------------------------- every method through the one schedule


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory):
    from tests.sd_tiny import write_tiny_sd

    return write_tiny_sd(tmp_path_factory.mktemp("sd") / "pipe")


def _methods():
    from distill.methods.consistency import LatentConsistencyDistillation
    from distill.methods.consistency_training import ConsistencyTraining
    from distill.methods.diffusion import DiffusionTraining
    from distill.methods.feature_distillation import FeatureDistillation
    from distill.methods.progressive import ProgressiveDistillation
    from distill.models.conditioning import TextConditioner
    from distill.students.copies import copy_student
    from distill.students.sized import build_text_unet

    opt = torch.optim.AdamW
    return {
        "diffusion": lambda t: DiffusionTraining(build_text_unet(8, 4, size="debug", cross_attention_dim=32),
                                                 DDPMScheduler(**SD), TextConditioner(t.text_encoder, t.tokenizer),
                                                 opt, vae=t.vae),
        "consistency": lambda t: LatentConsistencyDistillation(t, copy_student, opt, num_ddim_timesteps=10,
                                                               guidance_scale_min=2.0, guidance_scale_max=6.0),
        "consistency_training": lambda t: ConsistencyTraining(t, copy_student, opt, variant="ect", curriculum_steps=100),
        "feature_distillation": lambda t: FeatureDistillation(t, copy_student, opt),
        "progressive": lambda t: ProgressiveDistillation(t, copy_student, opt, start_steps=8, final_steps=2),
    }


@pytest.mark.parametrize("name", list(_methods()))
def test_each_method_noises_and_converts_with_its_one_schedule(tiny_sd, name):
    """The method's schedule is the teacher scheduler's table and no other buffer of the method holds a copy of it
    (nor of its noise levels); the loss reads the schedule only through ``method.schedule``: a schedule rebuilt from
    the same scheduler gives the same loss bit for bit, one from another table changes it."""
    from distill.diffusion.schedules import vp_sigmas
    from distill.families import load_teacher

    teacher = load_teacher(str(tiny_sd))
    torch.manual_seed(0)
    method = _methods()[name](teacher).train()
    scheduler = teacher.scheduler if name != "diffusion" else method.noise_scheduler
    table = scheduler.alphas_cumprod
    assert isinstance(method.schedule, DiscreteVPSchedule) and torch.equal(method.schedule.abar[:-1], table)
    copies = [n for n, b in method.named_buffers() if not n.startswith("schedule.") and b.is_floating_point()
              and b.numel() >= len(table) and any(torch.equal(b.flatten()[:len(table)].to(c), c)
                                                  for c in (table, vp_sigmas(table), vp_sigmas(table).float()))]
    assert copies == []
    batch = {"pixel_values": torch.rand(4, 1, 32, 32, generator=torch.Generator().manual_seed(3)) * 2 - 1,
             "caption": ["a handwritten digit one", "two", "three", ""]}

    def loss() -> torch.Tensor:
        with torch.no_grad():
            return method.loss(batch, torch.Generator().manual_seed(0))

    first = loss()
    method.schedule = DiscreteVPSchedule.from_scheduler(scheduler)
    assert torch.equal(loss(), first)
    method.schedule = DiscreteVPSchedule(DDPMScheduler(beta_schedule="linear").alphas_cumprod, scheduler.config.prediction_type)
    assert abs(loss().item() - first.item()) > 1e-4 * abs(first.item())
