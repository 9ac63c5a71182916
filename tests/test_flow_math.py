"""The flow-matching math (distill.diffusion.flow, FlowMatchingSchedule, distill.diffusion.packing) against diffusers'
own code, run as the reference: FlowMatchEulerDiscreteScheduler's sigmas and steps, calculate_shift, the SD3 training
utilities, FluxPipeline's latent packing, and the StableDiffusion3Pipeline / FluxPipeline loops on tiny random-weight
stand-ins reproduced step for step from these functions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline
from diffusers.pipelines.flux.pipeline_flux import calculate_shift as flux_calculate_shift
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import (
    calculate_shift as sd3_calculate_shift,
)
from diffusers.training_utils import (
    compute_density_for_timestep_sampling,
    compute_loss_weighting_for_sd3,
)
from scipy import stats

from distill.diffusion import DiscreteVPSchedule, FlowMatchingSchedule, cfg, flow
from distill.diffusion.packing import latent_image_ids, pack_latents, unpack_latents

SD3 = dict(shift=3.0)  # stabilityai/stable-diffusion-3-medium's scheduler config
FLUX = dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15)  # FLUX.1-dev's
STEPS = [1, 2, 4, 28, 50]


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- schedules: sigmas, timesteps, shifts


@pytest.mark.parametrize("steps", STEPS)
@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_static_shift_sigmas_equal_set_timesteps(shift, steps):
    """SD3: set_timesteps(n) on a static shift, bit for bit (the grid between the shifted table's ends, shifted
    again, as diffusers does), and the training table of the constructor."""
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    assert torch.equal(flow.flow_train_sigmas(1000, shift), scheduler.sigmas)
    assert torch.equal(flow.flow_timestep(flow.flow_train_sigmas(1000, shift)), scheduler.timesteps)
    scheduler.set_timesteps(steps)
    sigmas, timesteps = FlowMatchingSchedule.from_scheduler(scheduler).inference_sigmas(steps)
    assert torch.equal(sigmas, scheduler.sigmas) and torch.equal(timesteps, scheduler.timesteps)
    grid = torch.linspace(1.0, 0.05, 20)
    scheduler.set_timesteps(sigmas=grid.numpy())
    assert torch.equal(FlowMatchingSchedule.from_scheduler(scheduler).shift_times(grid), scheduler.sigmas[:-1])
    assert sigmas.shape == (steps + 1,) and sigmas[0] == 1.0 and sigmas[-1] == 0.0
    if shift == 3.0 and steps == 4:  # shifted twice: the grid from 1 to shift(1/1000) = 0.002994, shifted again
        s_min = 3 * 0.001 / (1 + 2 * 0.001)
        grid = [1 + k / 3 * (s_min - 1) for k in range(4)]
        assert sigmas[:-1].tolist() == pytest.approx([3 * u / (1 + 2 * u) for u in grid], abs=1e-6)
        assert sigmas[:-1].tolist() == pytest.approx([1.0, 0.857692, 0.602151, 0.008929], abs=1e-6)


@pytest.mark.parametrize("seq_len", [16, 256, 1024, 4096, 6400])
@pytest.mark.parametrize("steps", STEPS)
def test_flux_resolution_shift_equals_calculate_shift_and_set_timesteps(steps, seq_len):
    """Flux: mu = calculate_shift(seq_len) of both pipelines' modules, then set_timesteps(sigmas=linspace(1, 1/n, n),
    mu) and set_timesteps(n, mu), bit for bit; mu grows with the resolution, so more tokens shift further."""
    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX)
    schedule = FlowMatchingSchedule.from_scheduler(scheduler)
    mu = schedule.mu(seq_len)
    assert mu == flux_calculate_shift(seq_len, 256, 4096, 0.5, 1.15) == sd3_calculate_shift(seq_len, 256, 4096, 0.5, 1.15)
    assert flow.resolution_shift_mu(seq_len, 64, 1024, 0.3, 2.0) == flux_calculate_shift(seq_len, 64, 1024, 0.3, 2.0)
    scheduler.set_timesteps(sigmas=flow.flux_sigmas(steps), mu=mu)
    sigmas, timesteps = schedule.inference_sigmas(sigmas=flow.flux_sigmas(steps), image_seq_len=seq_len)
    assert torch.equal(sigmas, scheduler.sigmas) and torch.equal(timesteps, scheduler.timesteps)
    scheduler.set_timesteps(steps, mu=mu)
    sigmas, timesteps = schedule.inference_sigmas(steps, image_seq_len=seq_len)
    assert torch.equal(sigmas, scheduler.sigmas) and torch.equal(timesteps, scheduler.timesteps)
    grid = torch.linspace(1.0, 0.05, 20)  # training times: the same shift on torch tensors
    scheduler.set_timesteps(sigmas=grid.numpy(), mu=mu)
    assert torch.equal(schedule.shift_times(grid, seq_len), scheduler.sigmas[:-1])
    assert schedule.mu(256) == pytest.approx(0.5) and schedule.mu(4096) == pytest.approx(1.15)


def test_linear_time_shift_and_the_shift_identity():
    """time_shift_type="linear" as diffusers shifts, and SD3's shift s is the exponential shift at mu = ln s."""
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type="linear")
    scheduler.set_timesteps(sigmas=flow.flux_sigmas(8), mu=2.5)
    sigmas, _ = flow.flow_inference_sigmas(sigmas=flow.flux_sigmas(8), mu=2.5, time_shift_type="linear")
    assert torch.equal(sigmas, scheduler.sigmas)
    t = torch.linspace(0.01, 0.99, 99, dtype=torch.float64)
    assert torch.allclose(flow.shift_time(t, 3.0), flow.time_shift_exponential(t, math.log(3.0)), rtol=1e-12)
    assert torch.allclose(flow.shift_time(t, 3.0), flow.time_shift_linear(t, 3.0), rtol=1e-12)
    assert bool((flow.shift_time(t, 3.0) > t).all())  # towards noise


def test_image_seq_len_is_what_the_pipelines_count():
    """SD3 counts (H / p) (W / p) patches of its transformer; Flux the 2x2-packed tokens."""
    assert flow.image_seq_len(128, 96, 2) == 64 * 48
    assert flow.image_seq_len(64, 64, 2) == pack_latents(torch.zeros(1, 16, 64, 64)).shape[1]


# ---------------------------------------------------------------- the path, the conversions, the Euler step


@pytest.mark.parametrize("config", [SD3, FLUX], ids=["sd3", "flux"])
def test_euler_step_equals_the_schedulers_step_over_its_whole_sigma_list(config):
    """x_{t_next} = x_t + (t_next - t) v equals FlowMatchEulerDiscreteScheduler.step on a random velocity at every
    step of a 28-step schedule (SD3's shift 3.0; Flux's mu at 4096 tokens)."""
    scheduler = FlowMatchEulerDiscreteScheduler(**config)
    schedule = FlowMatchingSchedule.from_scheduler(scheduler)
    seq_len = 4096 if schedule.use_dynamic_shifting else None
    sigmas, timesteps = schedule.inference_sigmas(28, image_seq_len=seq_len)
    scheduler.set_timesteps(28, mu=schedule.mu(seq_len))
    ours = theirs = _randn(2, 16, 8, 8)
    for i, t in enumerate(scheduler.timesteps):
        v = _randn(2, 16, 8, 8, seed=i + 1)
        theirs = scheduler.step(v, t, theirs, return_dict=False)[0]
        ours = flow.euler_step(v, ours, sigmas[i], sigmas[i + 1])
        assert torch.equal(ours, theirs), i
    assert torch.equal(timesteps, scheduler.timesteps)


def test_the_path_and_x0_equal_the_schedulers_scale_noise_and_stochastic_step():
    """x_t = (1 - t) x0 + t eps is scale_noise; the x0 of x_t - t v is the one the stochastic step re-noises."""
    scheduler = FlowMatchEulerDiscreteScheduler(**SD3)
    x0, eps = _randn(4, 4, 8, 8), _randn(4, 4, 8, 8, seed=1)
    idx = torch.tensor([0, 100, 500, 999])
    t = scheduler.sigmas[idx]
    schedule = FlowMatchingSchedule.from_scheduler(scheduler)
    assert torch.equal(schedule.add_noise(x0, eps, t), scheduler.scale_noise(x0, scheduler.timesteps[idx], eps))

    stochastic = FlowMatchEulerDiscreteScheduler(**SD3, stochastic_sampling=True)
    stochastic.set_timesteps(4)
    x_t, v = _randn(1, 4, 8, 8, seed=2), _randn(1, 4, 8, 8, seed=3)
    out = stochastic.step(v, stochastic.timesteps[1], x_t, generator=torch.Generator().manual_seed(7))[0]
    sigma, sigma_next = stochastic.sigmas[1], stochastic.sigmas[2]
    renoised = flow.flow_add_noise(flow.x0_from_velocity(v, x_t, sigma), _randn(1, 4, 8, 8, seed=7), sigma_next)
    assert torch.allclose(renoised, out, atol=1e-6)


def test_conversions_between_velocity_x0_and_eps_round_trip():
    x0, eps = _randn(6, 4, 8, 8), _randn(6, 4, 8, 8, seed=1)
    t = torch.tensor([0.02, 0.1, 0.3, 0.5, 0.8, 0.98])
    x_t = flow.flow_add_noise(x0, eps, t)
    v = flow.flow_velocity(x0, eps)
    assert torch.allclose(flow.x0_from_velocity(v, x_t, t), x0, atol=1e-5)
    assert torch.allclose(flow.eps_from_velocity(v, x_t, t), eps, atol=1e-5)
    assert torch.allclose(flow.velocity_from_x0(x0, x_t, t), v, atol=1e-4)
    assert torch.allclose(flow.velocity_from_eps(eps, x_t, t), v, atol=1e-4)
    # x_t - t v moves along the line to its t = 0 end: the straight path's x0 exactly when v is the path's velocity
    assert torch.allclose(x_t - t.view(-1, 1, 1, 1) * v, x0, atol=1e-5)
    schedule = FlowMatchingSchedule()
    for kind in flow.FLOW_PREDICTION_TYPES:
        pred = schedule.prediction_target(x0, eps, t, kind)
        got_x0, got_eps = schedule.to_x0_eps(pred, x_t, t, kind)
        assert torch.allclose(got_x0, x0, atol=1e-4) and torch.allclose(got_eps, eps, atol=1e-4), kind
        assert torch.allclose(schedule.velocity(pred, x_t, t, kind), v, atol=1e-3), kind
    alpha, sigma = schedule.alpha_sigma(t, 4)
    assert alpha.shape == (6, 1, 1, 1) and torch.equal(alpha + sigma, torch.ones_like(alpha))
    assert torch.allclose(schedule.snr(t), ((1 - t) / t) ** 2)
    assert torch.equal(schedule.timestep(t), t * 1000)


def test_existing_schedule_code_works_on_both_schedules():
    """The calls every method makes (add_noise, prediction_target, to_x0_eps) recover x0 on the VP and the flow
    schedule alike, each with its own t (integer timesteps / continuous t)."""
    x0, eps = _randn(3, 4, 8, 8), _randn(3, 4, 8, 8, seed=1)
    for schedule, t in [(DiscreteVPSchedule.from_scheduler(DDPMScheduler()), torch.tensor([10, 500, 990])),
                        (FlowMatchingSchedule(), torch.tensor([0.01, 0.5, 0.99]))]:
        x_t = schedule.add_noise(x0, eps, t)
        got_x0, got_eps = schedule.to_x0_eps(schedule.prediction_target(x0, eps, t), x_t, t)
        assert torch.allclose(got_x0, x0, atol=1e-3) and torch.allclose(got_eps, eps, atol=1e-3), type(schedule)


def test_cfg_in_velocity_form_commutes_with_the_conversions():
    """v = v_u + w (v_c - v_u) is the same guidance as on x0 or eps: the conversions are affine at fixed (x_t, t)."""
    v_c, v_u, x_t = _randn(2, 4, 8, 8), _randn(2, 4, 8, 8, seed=1), _randn(2, 4, 8, 8, seed=2)
    t = torch.tensor([0.3, 0.7])
    guided = cfg(v_c, v_u, 4.5)
    assert torch.equal(guided, v_u + 4.5 * (v_c - v_u))
    x0 = cfg(flow.x0_from_velocity(v_c, x_t, t), flow.x0_from_velocity(v_u, x_t, t), 4.5)
    assert torch.allclose(flow.x0_from_velocity(guided, x_t, t), x0, atol=1e-5)


# ---------------------------------------------------------------- training-time sampling and loss weighting


@pytest.mark.parametrize("kind,scheme", [("logit_normal", "logit_normal"), ("mode", "mode"), ("uniform", "none")])
def test_training_times_equal_compute_density_for_timestep_sampling(kind, scheme):
    """The same generator, the same numbers (logit-normal m = 0, s = 1; mode scale 1.29, the SD3 scripts' defaults)."""
    ours = flow.sample_flow_times(512, kind, generator=torch.Generator().manual_seed(3))
    theirs = compute_density_for_timestep_sampling(scheme, 512, logit_mean=0.0, logit_std=1.0, mode_scale=1.29,
                                                   generator=torch.Generator().manual_seed(3))
    assert torch.equal(ours, theirs)
    shifted = flow.sample_flow_times(512, kind, shift=3.0, generator=torch.Generator().manual_seed(3))
    assert torch.equal(shifted, flow.shift_time(theirs, 3.0))


def test_logit_normal_and_shifted_times_have_their_distributions():
    """Kolmogorov-Smirnov against the logit-normal CDF Phi((logit t - m) / s), before and after SD3's shift 3
    (whose inverse is u = t / (s - (s - 1) t)); the unshifted CDF does not fit the shifted draws."""
    n = 200_000
    g = torch.Generator().manual_seed(0)
    t = flow.sample_flow_times(n, "logit_normal", logit_mean=0.5, logit_std=1.2, generator=g).double().numpy()
    ln_cdf = lambda x: stats.norm.cdf((np.log(x) - np.log1p(-x) - 0.5) / 1.2)  # noqa: E731
    assert stats.kstest(t, ln_cdf).statistic < 1.63 / math.sqrt(n)  # within the 1% critical value
    shifted = flow.shift_time(t, 3.0)
    shifted_cdf = lambda x: ln_cdf(x / (3.0 - 2.0 * x))  # noqa: E731
    assert stats.kstest(shifted, shifted_cdf).statistic < 1.63 / math.sqrt(n)
    assert stats.kstest(shifted, ln_cdf).statistic > 0.15
    assert abs(float(np.mean(flow.shift_time(0.5, 3.0))) - 0.75) < 1e-12


def test_diffusers_scripts_index_the_shifted_table_at_one_minus_u():
    """SD3's training scripts take sigmas[(u T).long()] of the shifted constructor table: shift_time(1 - u) to within
    one table step (the derivative of the shift is at most s), so our continuous t = shift_time(u) draws the same
    distribution where the density is symmetric (m = 0)."""
    scheduler = FlowMatchEulerDiscreteScheduler(**SD3)
    u = compute_density_for_timestep_sampling("logit_normal", 4096, 0.0, 1.0, generator=torch.Generator().manual_seed(1))
    table = scheduler.sigmas[(u * 1000).long()]
    assert float((table - flow.shift_time(1 - u, 3.0)).abs().max()) <= 3.0 / 1000 + 1e-6


@pytest.mark.parametrize("weighting", flow.LOSS_WEIGHTINGS)
def test_loss_weights_equal_compute_loss_weighting_for_sd3(weighting):
    t = flow.sample_flow_times(256, generator=torch.Generator().manual_seed(0)).view(-1, 1, 1, 1)
    assert torch.equal(flow.flow_loss_weight(weighting, t), compute_loss_weighting_for_sd3(weighting, t))
    if weighting == "cosmap":  # the CosMap density's peak at t = 1/2: 4 / pi
        assert float(flow.flow_loss_weight("cosmap", torch.tensor(0.5))) == pytest.approx(4 / math.pi)


# ---------------------------------------------------------------- Flux's packed latents


def test_packing_equals_flux_pipelines_and_round_trips():
    z = _randn(2, 16, 8, 12)
    packed = pack_latents(z)
    assert torch.equal(packed, FluxPipeline._pack_latents(z, 2, 16, 8, 12)) and packed.shape == (2, 24, 64)
    assert torch.equal(unpack_latents(packed, 8, 12), FluxPipeline._unpack_latents(packed, 64, 96, 8))
    assert torch.equal(unpack_latents(packed, 8, 12), z)
    assert torch.equal(latent_image_ids(8, 12), FluxPipeline._prepare_latent_image_ids(2, 4, 6, "cpu", torch.float32))
    assert latent_image_ids(8, 12)[7].tolist() == [0.0, 1.0, 1.0]  # token 7: row 1, column 1 of a 4x6 grid


# ---------------------------------------------------------------- bad input


def test_bad_input_is_refused_naming_the_value():
    schedule = FlowMatchingSchedule()
    with pytest.raises(ValueError, match="prediction_type='v_prediction'.*'flow_prediction'"):
        FlowMatchingSchedule(prediction_type="v_prediction")
    with pytest.raises(ValueError, match="continuous t in \\[0, 1\\]"):
        schedule.alpha_sigma(torch.tensor([500]))
    with pytest.raises(ValueError, match="DDPMScheduler is not a flow-matching scheduler"):
        FlowMatchingSchedule.from_scheduler(DDPMScheduler())
    with pytest.raises(ValueError, match="use_karras_sigmas"):
        FlowMatchingSchedule.from_scheduler(FlowMatchEulerDiscreteScheduler(use_karras_sigmas=True))
    with pytest.raises(ValueError, match="give image_seq_len"):
        FlowMatchingSchedule.from_scheduler(FlowMatchEulerDiscreteScheduler(**FLUX)).inference_sigmas(4)
    with pytest.raises(ValueError, match="time_sampling='cosmap'"):
        flow.sample_flow_times(4, "cosmap")
    with pytest.raises(ValueError, match="loss_weighting='logit_normal'"):
        flow.flow_loss_weight("logit_normal", torch.ones(2))
    with pytest.raises(ValueError, match="mode_scale=3"):
        flow.sample_flow_times(4, "mode", mode_scale=3)
    with pytest.raises(ValueError, match="3 sigmas for num_inference_steps=4"):
        flow.flow_inference_sigmas(4, sigmas=[1.0, 0.5, 0.25])
    with pytest.raises(ValueError, match="7x8 latent cannot be packed"):
        pack_latents(torch.zeros(1, 4, 7, 8))


# ---------------------------------------------------------------- the pipelines' own loops


@pytest.fixture(scope="module")
def tiny_sd3(tmp_path_factory):
    """StableDiffusion3Pipeline at reduced width (tests/sd3_tiny.py): SD3Transformer2DModel with SD3.5's qk_norm and a
    dual-attention layer, CLIP-L and CLIP-G stand-ins with projections, no T5, an AutoencoderKL with a shift_factor."""
    from tests.sd3_tiny import tiny_sd3_pipeline

    return tiny_sd3_pipeline(tmp_path_factory.mktemp("sd3") / "vocab", image_channels=3)


@pytest.mark.parametrize("dynamic", [False, True], ids=["shift3", "resolution_shift"])
def test_sd3_pipeline_loop_reproduced(tiny_sd3, dynamic):
    """3 steps of StableDiffusion3Pipeline (CFG 5, output_type="latent") against a loop of these functions calling
    the same transformer: inference_sigmas, timestep, cfg on the velocities, euler_step; with the static shift 3.0
    and with resolution-dependent shifting (mu of the (8 / 2)^2 patch tokens)."""
    pipe = tiny_sd3
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(**(FLUX if dynamic else SD3))
    pipe.set_progress_bar_config(disable=True)
    prompt, n, w = ["a handwritten digit seven", "two"], 3, 5.0
    latents = _randn(2, 4, 8, 8, seed=5)
    with torch.no_grad():
        expected = pipe(prompt, num_inference_steps=n, guidance_scale=w, latents=latents.clone(),
                        output_type="latent", max_sequence_length=4).images
        embeds, neg_embeds, pooled, neg_pooled = pipe.encode_prompt(
            prompt, None, None, do_classifier_free_guidance=True, max_sequence_length=4, device="cpu")
        schedule = FlowMatchingSchedule.from_scheduler(pipe.scheduler)
        seq_len = flow.image_seq_len(8, 8, pipe.transformer.config.patch_size)
        sigmas, timesteps = schedule.inference_sigmas(n, image_seq_len=seq_len)
        x = latents
        for i in range(n):
            v_u, v_c = pipe.transformer(
                hidden_states=torch.cat([x, x]), timestep=timesteps[i].expand(4),
                encoder_hidden_states=torch.cat([neg_embeds, embeds]),
                pooled_projections=torch.cat([neg_pooled, pooled]), return_dict=False)[0].chunk(2)
            x = flow.euler_step(cfg(v_c, v_u, w), x, sigmas[i], sigmas[i + 1])
    assert embeds.shape == (2, 8 + 4, 48)  # CLIP tokens padded to the joint width, then 4 zero T5 tokens
    assert float((x - latents).abs().mean()) > 0.1  # the loop moved the latents
    assert torch.allclose(x, expected, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def tiny_flux():
    """FluxPipeline on a reduced-width FluxTransformer2DModel with FLUX.1-dev's guidance embedding; no text encoders
    (the loop takes prompt embeddings) and no VAE (the pipeline's vae_scale_factor is then 8)."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, pooled_projection_dim=8, guidance_embeds=True, axes_dims_rope=(2, 2, 4)).eval()
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX), vae=None, text_encoder=None,
                        tokenizer=None, text_encoder_2=None, tokenizer_2=None, transformer=transformer)


def test_flux_pipeline_loop_reproduced(tiny_flux):
    """3 steps of FluxPipeline (64 px: an 8x8 latent, 16 packed tokens; distilled guidance 3.5 and true CFG 2.0)
    against pack_latents, latent_image_ids, the resolution shift, euler_step and cfg on the same transformer."""
    pipe = tiny_flux
    pipe.set_progress_bar_config(disable=True)
    embeds, neg_embeds = _randn(1, 5, 16, seed=1), _randn(1, 5, 16, seed=2)
    pooled, neg_pooled = _randn(1, 8, seed=3), _randn(1, 8, seed=4)
    z, n = _randn(1, 4, 8, 8, seed=5), 3
    with torch.no_grad():
        expected = pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled, negative_prompt_embeds=neg_embeds,
                        negative_pooled_prompt_embeds=neg_pooled, true_cfg_scale=2.0, guidance_scale=3.5,
                        height=64, width=64, num_inference_steps=n, latents=pack_latents(z),
                        output_type="latent").images
        schedule = FlowMatchingSchedule.from_scheduler(pipe.scheduler)
        x = pack_latents(z)
        sigmas, timesteps = schedule.inference_sigmas(sigmas=flow.flux_sigmas(n), image_seq_len=x.shape[1])
        common = dict(guidance=torch.full([1], 3.5), img_ids=latent_image_ids(8, 8), txt_ids=torch.zeros(5, 3),
                      return_dict=False)
        for i in range(n):
            t = timesteps[i].expand(1) / 1000
            v_c = pipe.transformer(hidden_states=x, timestep=t, pooled_projections=pooled,
                                   encoder_hidden_states=embeds, **common)[0]
            v_u = pipe.transformer(hidden_states=x, timestep=t, pooled_projections=neg_pooled,
                                   encoder_hidden_states=neg_embeds, **common)[0]
            x = flow.euler_step(cfg(v_c, v_u, 2.0), x, sigmas[i], sigmas[i + 1])
    assert float((x - pack_latents(z)).abs().mean()) > 0.1
    assert torch.allclose(x, expected, atol=1e-5, rtol=0)
    assert unpack_latents(x, 8, 8).shape == (1, 4, 8, 8)
