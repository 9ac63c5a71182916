"""A scheduler built from another scheduler's config (a PNDM or Euler teacher sampled with DDIM/DDPM) does not
clip the latent x0 to the pixel range [-1, 1] unless that config itself asks for it."""

import pytest
import torch
from diffusers import DDIMScheduler, EulerDiscreteScheduler, PNDMScheduler, StableDiffusionPipeline

from distill.inference.schedulers import make_scheduler
from distill.metrics.quality_cost import PipelineSampler
from tests.sd_tiny import write_tiny_sd

SD_BETAS = {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012, "steps_offset": 1}


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory):
    return write_tiny_sd(tmp_path_factory.mktemp("sd") / "pipe")


def _with_scheduler(tiny_sd, folder, scheduler):
    """The stand-in saved with another scheduler, loaded back as users load it (diffusers' own files)."""
    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd, safety_checker=None, requires_safety_checker=False)
    pipe.scheduler = scheduler
    pipe.save_pretrained(folder)
    return StableDiffusionPipeline.from_pretrained(folder, safety_checker=None, requires_safety_checker=False)


def _x0_of_one_step(scheduler) -> float:
    """pred_original_sample of one step from x_t = 3 with eps = 0: x0 = 3 / sqrt(abar_t), about 3.1 at t = 999."""
    scheduler.set_timesteps(4)
    t = int(scheduler.timesteps[0])
    sample = torch.full((1, 4, 2, 2), 3.0)
    out = scheduler.step(torch.zeros_like(sample), t, sample)
    return float(out.pred_original_sample.max()), float(3.0 / scheduler.alphas_cumprod[t].sqrt())


@pytest.mark.parametrize("teacher", ["pndm", "euler"])
@pytest.mark.parametrize("name", ["ddim", "ddpm"])
def test_a_scheduler_swapped_into_a_sweep_keeps_latent_x0_unclipped(tiny_sd, tmp_path, teacher, name):
    own = (PNDMScheduler(skip_prk_steps=True, set_alpha_to_one=False, **SD_BETAS) if teacher == "pndm"
           else EulerDiscreteScheduler(**SD_BETAS))
    pipe = _with_scheduler(tiny_sd, tmp_path / teacher, own)
    assert "clip_sample" not in pipe.scheduler.config  # neither class has the option
    swapped = PipelineSampler(pipe).scheduler(name)  # what distill.evaluate and the quality-cost callback sample with
    assert swapped.config.clip_sample is False and swapped.config.thresholding is False
    x0, expected = _x0_of_one_step(swapped)
    assert x0 == pytest.approx(expected, rel=1e-5) and expected > 3.0  # was 1.0: clipped


def test_a_config_that_states_clipping_keeps_it(tmp_path):
    DDIMScheduler(clip_sample=True, **SD_BETAS).save_pretrained(tmp_path)
    stated = DDIMScheduler.from_config(DDIMScheduler.load_config(tmp_path))  # stated in the file
    assert make_scheduler("ddpm", stated.config).config.clip_sample is True
    assert _x0_of_one_step(make_scheduler("ddpm", stated.config))[0] == pytest.approx(1.0)
    defaulted = DDIMScheduler.from_config(EulerDiscreteScheduler(**SD_BETAS).config)  # diffusers filled it in
    assert defaulted.config.clip_sample is True
    assert make_scheduler("ddim", defaulted.config).config.clip_sample is False
    assert make_scheduler("ddim", defaulted.config, clip_sample=True).config.clip_sample is True  # an option wins

