"""Progressive-distillation target: one student DDIM step on it equals two exact teacher DDIM steps."""

import pytest
import torch
from diffusers import DDPMScheduler

from distill.diffusion import alpha_sigma, ddim_step, prediction_target, to_x0_eps
from distill.diffusion.progressive import progressive_x_target, round_schedule


def test_one_student_step_on_the_target_equals_two_teacher_steps():
    abar = DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012).alphas_cumprod
    g = torch.Generator().manual_seed(0)
    x_t = torch.randn(4, 4, 8, 8, generator=g)
    t, t_mid, t_end = torch.full((4,), 800), torch.full((4,), 600), torch.full((4,), 400)

    def teacher(x, tt):  # any deterministic eps-predictor stands in for the teacher network
        return torch.tanh(x * (1 + tt[:, None, None, None] / 1000))

    a_t, s_t = alpha_sigma(abar, t)
    a_m, s_m = alpha_sigma(abar, t_mid)
    a_e, s_e = alpha_sigma(abar, t_end)
    x0, eps = to_x0_eps("epsilon", teacher(x_t, t), x_t, a_t, s_t)
    x_mid = ddim_step(x0, eps, a_m, s_m)
    x0, eps = to_x0_eps("epsilon", teacher(x_mid, t_mid), x_mid, a_m, s_m)
    x_end = ddim_step(x0, eps, a_e, s_e)

    x_target = progressive_x_target(x_t, x_end, a_t, s_t, a_e, s_e)
    # The student predicts v on the target; one DDIM step from t to t'' with it lands on x_end.
    eps_target = (x_t - a_t * x_target) / s_t
    v = prediction_target("v_prediction", x_target, eps_target, a_t, s_t)
    x0_s, eps_s = to_x0_eps("v_prediction", v, x_t, a_t, s_t)
    torch.testing.assert_close(ddim_step(x0_s, eps_s, a_e, s_e), x_end, rtol=1e-5, atol=1e-5)  # float32 precision


def test_round_schedule_halves_down_to_the_final_count():
    assert round_schedule(64, 2) == [32, 16, 8, 4, 2]
    assert round_schedule(8, 1) == [4, 2, 1]
    with pytest.raises(ValueError, match="not powers of two apart"):
        round_schedule(48, 4)
    with pytest.raises(ValueError, match="must be below the start"):
        round_schedule(4, 8)


# ---------------------------------------------------------------- the sampler on the training grid


SCHEDULE = {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012}


@pytest.mark.parametrize("prediction_type", ["epsilon", "sample", "v_prediction"])
@pytest.mark.parametrize("steps", [1, 2, 4, 8, 10, 20, 25, 40, 50])
def test_grid_ddim_equals_diffusers_ddim_where_the_grids_agree(prediction_type, steps):
    """N dividing T: diffusers' DDIM with trailing spacing and alpha_prev = 1 at the end is the same sampler."""
    from diffusers import DDIMScheduler

    from distill.inference.schedulers import GridDDIMScheduler

    ours = GridDDIMScheduler(prediction_type=prediction_type, **SCHEDULE)
    ref = DDIMScheduler(prediction_type=prediction_type, timestep_spacing="trailing", set_alpha_to_one=True,
                        clip_sample=False, **SCHEDULE)
    ours.set_timesteps(steps)
    ref.set_timesteps(steps)
    assert ours.timesteps.tolist() == ref.timesteps.tolist()
    g = torch.Generator().manual_seed(0)
    x = y = torch.randn(2, 4, 8, 8, generator=g)
    for t in ours.timesteps:
        out = torch.tanh(x * (1 + t / 1000))  # any deterministic network stands in for the student
        x = ours.step(out, t, x).prev_sample
        y = ref.step(torch.tanh(y * (1 + t / 1000)), t, y).prev_sample
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_grid_ddim_config_round_trips(tmp_path):
    from distill.inference.schedulers import GridDDIMScheduler

    sched = GridDDIMScheduler(prediction_type="v_prediction", num_train_timesteps=500, **SCHEDULE)
    sched.save_pretrained(tmp_path)
    back = GridDDIMScheduler.from_pretrained(tmp_path)
    public = {k: v for k, v in sched.config.items() if not k.startswith("_")}
    assert {k: v for k, v in back.config.items() if not k.startswith("_")} == public
    torch.testing.assert_close(back.alphas_cumprod, sched.alphas_cumprod)
    back.set_timesteps(3)  # floor(i * 500 / 3) - 1
    assert back.timesteps.tolist() == [499, 332, 165] and back.previous_timestep(165) == 500
    with pytest.raises(ValueError, match="not on the 3-step grid"):
        back.previous_timestep(166)


def test_grid_scheduler_keeps_a_zero_snr_teacher_schedule():
    """A teacher trained with rescaled zero-terminal-SNR betas (Lin et al. 2024) keeps that schedule."""
    from diffusers import DDIMScheduler

    from distill.inference.schedulers import GridDDIMScheduler

    teacher = DDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                            rescale_betas_zero_snr=True)
    grid = GridDDIMScheduler.from_config(teacher.config)
    assert float(teacher.alphas_cumprod[-1]) < 1e-6
    torch.testing.assert_close(grid.alphas_cumprod, teacher.alphas_cumprod.float())
