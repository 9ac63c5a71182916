"""DMD2 (method=dmd2): the DMD gradient against the reverse KL's closed form on Gaussians, generator steps toward the
data, the fake score's loss against the teacher's denoising loss, backward simulation against the export's sampler,
two CLI steps whose export samples one evaluation per step on the generator's timesteps, refusals."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from diffusers import DDPMScheduler, LCMScheduler

from distill.diffusion.dmd import (
    dmd_gradient,
    dmd_loss,
    gan_discriminator_loss,
    gan_generator_loss,
    generator_timesteps,
)
from tests.conftest import ROOT, run_train
from tests.sd_tiny import write_tiny_sd

# ---------------------------------------------------------------- a Gaussian toy with closed-form scores

def gaussian_x0(x_t, alpha, sigma, mean, var):
    """E[x0 | x_t] for x0 ~ N(mean, var), x_t = alpha x0 + sigma eps (Tweedie): the ideal x0-prediction."""
    return mean + alpha * var / (alpha ** 2 * var + sigma ** 2) * (x_t - alpha * mean)


def gaussian_kl(mean_q, var_q, mean_p, var_p):
    """KL(N(mean_q, var_q) || N(mean_p, var_p)), per dimension."""
    return 0.5 * (torch.log(var_p / var_q) + (var_q + (mean_q - mean_p) ** 2) / var_p - 1.0)


def assert_dmd_gradient_is_reverse_kl_gradient(alpha: float, sigma: float) -> None:
    """Data N(mu, v), generator x = m + s z, noised as x_t = alpha x + sigma eps: d KL(q_t || p_t) / d(m, s) of the
    noised marginals (closed form) equals (alpha^2 / sigma^2) E[(fake x0 - real x0) dx/d(m, s)] (the DMD gradient
    back-propagated by ``dmd_loss``), the expectation exact by Gauss-Hermite quadrature over (z, eps) (the integrand
    is a polynomial of degree 2)."""
    mu, v = torch.tensor(1.5, dtype=torch.float64), torch.tensor(0.3, dtype=torch.float64)
    m = torch.tensor(-0.4, dtype=torch.float64, requires_grad=True)
    s = torch.tensor(1.2, dtype=torch.float64, requires_grad=True)
    kl = gaussian_kl(alpha * m, alpha ** 2 * s ** 2 + sigma ** 2, alpha * mu, alpha ** 2 * v + sigma ** 2)
    expected = torch.stack(torch.autograd.grad(kl, (m, s)))

    nodes, weights = np.polynomial.hermite_e.hermegauss(8)
    z, eps = (torch.tensor(a, dtype=torch.float64).reshape(-1, 1) for a in np.meshgrid(nodes, nodes, indexing="ij"))
    w = torch.tensor(np.outer(weights, weights).ravel() / (2 * math.pi), dtype=torch.float64)
    x = m + s * z  # (64, 1): one 1-D example per quadrature node
    x_t = (alpha * x + sigma * eps).detach()
    real = gaussian_x0(x_t, alpha, sigma, mu, v)
    fake = gaussian_x0(x_t, alpha, sigma, m.detach(), s.detach() ** 2)
    per_node = dmd_loss(x, dmd_gradient(x, real, fake, normalize=False), reduce=False)  # d/dx = fake - real
    got = torch.stack(torch.autograd.grad((w * per_node).sum(), (m, s))) * alpha ** 2 / sigma ** 2
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("alpha", [0.9, 0.6, 0.2])
def test_dmd_gradient_is_the_reverse_kl_gradient_before_normalisation(alpha):
    """On the VP path (sigma = sqrt(1 - alpha^2)): ``assert_dmd_gradient_is_reverse_kl_gradient``."""
    assert_dmd_gradient_is_reverse_kl_gradient(alpha, math.sqrt(1 - alpha ** 2))


def test_the_normalised_gradient_is_parallel_per_example():
    """After the per-example normalisation each example's gradient is the unnormalised one divided by its
    mean |x - real x0| (hand computed): parallel, cosine 1, same direction."""
    g = torch.Generator().manual_seed(0)
    x, real, fake = (torch.randn(3, 4, 2, 2, generator=g) for _ in range(3))
    raw = dmd_gradient(x, real, fake, normalize=False)
    torch.testing.assert_close(raw, fake - real)
    normalised = dmd_gradient(x, real, fake)
    scale = torch.tensor([(x[i] - real[i]).abs().sum().item() / 16 for i in range(3)])
    torch.testing.assert_close(normalised, raw / scale.view(3, 1, 1, 1))
    cosine = torch.nn.functional.cosine_similarity(normalised.flatten(1), raw.flatten(1))
    torch.testing.assert_close(cosine, torch.ones(3))
    assert torch.equal(dmd_gradient(x, x, fake), torch.zeros_like(x))  # a zero normaliser: DMD2's nan_to_num


def test_gan_losses_are_the_non_saturating_ones():
    real, fake = torch.tensor([2.0, -1.0]), torch.tensor([0.5, -3.0])
    expected_g = -torch.log(torch.sigmoid(fake)).mean()
    expected_d = -torch.log(torch.sigmoid(real)).mean() - torch.log(1 - torch.sigmoid(fake)).mean()
    torch.testing.assert_close(gan_generator_loss(fake), expected_g)
    torch.testing.assert_close(gan_discriminator_loss(real, fake), expected_d)


def test_generator_steps_move_a_gaussian_generator_toward_the_data():
    """Gradient steps on ``dmd_loss`` with the normalised DMD gradient, the real score the data's and the fake score
    the current generator's (an ideal critic), t ~ U{20, ..., 980} of SD's schedule: the generator's mean and standard
    deviation move from (0, 1) to the data's (2, 0.5), each gap shrinking to under 2% (SGD, learning rate 0.1: the
    normalised gradient does not shrink near the optimum, so a larger rate oscillates)."""
    abar = DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012).alphas_cumprod.double()
    g = torch.Generator().manual_seed(0)
    mu, sd = 2.0, 0.5
    m = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    log_s = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.SGD([m, log_s], lr=0.1)
    for _ in range(200):
        z = torch.randn(256, 1, generator=g, dtype=torch.float64)
        x = m + log_s.exp() * z
        t = torch.randint(20, 981, (256, 1), generator=g)
        alpha, sigma = abar[t].sqrt(), (1 - abar[t]).sqrt()
        x_t = (alpha * x + sigma * torch.randn(256, 1, generator=g, dtype=torch.float64)).detach()
        real = gaussian_x0(x_t, alpha, sigma, mu, sd ** 2)
        fake = gaussian_x0(x_t, alpha, sigma, m.detach(), log_s.detach().exp() ** 2)
        optimizer.zero_grad()
        dmd_loss(x, dmd_gradient(x, real, fake)).backward()
        optimizer.step()
    assert abs(m.item() - mu) < 0.02 * mu, m.item()  # from a gap of 2
    assert abs(log_s.exp().item() - sd) < 0.02 * (1 - sd), log_s.exp().item()  # from a gap of 0.5


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_generator_timesteps_are_the_lcm_schedulers(steps):
    """DMD2's list (999, 749, 499, 249 for 4 steps) is what LCMScheduler samples with original_inference_steps=N."""
    scheduler = LCMScheduler(original_inference_steps=steps)
    scheduler.set_timesteps(steps)
    assert scheduler.timesteps.tolist() == generator_timesteps(1000, steps).tolist()
    assert generator_timesteps(1000, 4).tolist() == [999, 749, 499, 249]


# ---------------------------------------------------------------- the method on a tiny SD teacher

@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory):
    return write_tiny_sd(tmp_path_factory.mktemp("sd") / "pipe")


def make_method(tiny_sd, **options):
    from distill.families import load_teacher
    from distill.methods.dmd2 import DistributionMatchingDistillation
    from distill.students.copies import copy_student

    adam = lambda params: torch.optim.Adam(params, lr=1e-4)  # noqa: E731
    return DistributionMatchingDistillation(load_teacher(str(tiny_sd)), copy_student, optimizer=adam,
                                            critic_optimizer=adam, **options)


BATCH = {"pixel_values": torch.linspace(-1, 1, 3 * 32 * 32).reshape(3, 1, 32, 32),
         "caption": ["a handwritten digit one", "a handwritten digit two", "a handwritten digit nine"]}


def test_the_fake_score_loss_is_the_teachers_denoising_loss_on_generator_samples(tiny_sd):
    """With the GAN term off, the critic's loss at initialisation (fake score = the teacher) is the teacher's own
    epsilon-prediction loss at x_t = DDPMScheduler.add_noise(x, eps, t) of the generator's samples x, hand computed
    with the teacher network and the same draws."""
    method = make_method(tiny_sd, gan_critic_weight=0.0, sampling={"name": "lcm", "num_inference_steps": 2,
                                                                   "guidance_scale": 1.0})
    got = method.critic_loss(BATCH, torch.Generator().manual_seed(3))

    g = torch.Generator().manual_seed(3)
    x_real = method.latents(BATCH, g)
    cond, _ = method.text_conditions(BATCH, 3, x_real.device)
    with torch.no_grad():
        x = method.generator_sample(x_real, cond, g)
        t = torch.randint(0, 1000, (3,), generator=g)
        eps = torch.randn(x.shape, generator=g)
        scheduler = DDPMScheduler.from_pretrained(tiny_sd, subfolder="scheduler")
        x_t = scheduler.add_noise(x, eps, t)
        pred = method.teacher_unet(x_t, t, encoder_hidden_states=cond["encoder_hidden_states"]).sample
    assert scheduler.config.prediction_type == "epsilon"
    torch.testing.assert_close(got, ((pred - eps) ** 2).mean(), rtol=1e-5, atol=1e-7)


def test_backward_simulation_feeds_the_generator_its_own_sampler_states(tiny_sd):
    """The input at step k of a 4-step generator is the state the export's LCMScheduler reaches after k steps of the
    generator from the same noise and the same re-noising draws: x0 = G(x_t), then fresh noise to the next t."""
    from distill.diffusion.dmd import generator_timesteps as grid

    method = make_method(tiny_sd, sampling={"name": "lcm", "num_inference_steps": 4, "guidance_scale": 1.0})
    x_real = method.latents(BATCH, torch.Generator().manual_seed(0))
    cond, _ = method.text_conditions(BATCH, 3, x_real.device)
    x_t, t = method.generator_inputs(x_real, cond, torch.Generator().manual_seed(7), step=2)
    assert t.tolist() == [499] * 3

    scheduler = method.sampling_scheduler()
    scheduler.set_timesteps(4)
    assert scheduler.timesteps.tolist() == grid(1000, 4).tolist()
    g = torch.Generator().manual_seed(7)
    sample = torch.randn(x_real.shape, generator=g)
    with torch.no_grad():
        for step in scheduler.timesteps[:2]:
            out = method.student(sample, step, encoder_hidden_states=cond["encoder_hidden_states"]).sample
            sample = scheduler.step(out, step, sample, generator=g).prev_sample
    torch.testing.assert_close(x_t, sample, rtol=1e-5, atol=1e-5)
    no_simulation = make_method(tiny_sd, backward_simulation=False,
                                sampling={"name": "lcm", "num_inference_steps": 4, "guidance_scale": 1.0})
    noised, _ = no_simulation.generator_inputs(x_real, cond, torch.Generator().manual_seed(7), step=2)
    noise = torch.randn(x_real.shape, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(noised, scheduler.add_noise(x_real, noise, torch.tensor([499])))


def test_each_role_loss_reaches_only_its_own_network(tiny_sd):
    """The critic's loss gives the generator no gradient (its samples are detached); the generator's loss reaches
    the critic's parameters only through what the base's toggling turns off (here: their gradient flag)."""
    method = make_method(tiny_sd)
    method.critic_loss(BATCH).backward()
    assert all(p.grad is None for p in method.student.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in method.critic.head.parameters())
    method.zero_grad(set_to_none=True)
    method.critic.requires_grad_(False)  # what the base's toggled optimizer does during the generator's update
    method.loss(BATCH).backward()
    assert all(p.grad is None for p in method.critic.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in method.student.parameters())


def test_a_lora_fake_score_is_adapters_on_the_teachers_own_network(tiny_sd):
    """method.fake_score=lora: the critic's score is the teacher's network (no second copy) with peft adapters that
    start at B = 0 (fake x0 = the teacher's unguided x0 exactly); with the adapters moved the fake score moves while
    the real score stays the teacher loaded from disk, bit for bit; only the adapters and the head train, and the
    critic's loss reaches only them; the checkpoint keeps the adapters and head, not the teacher's base weights,
    and restores the fake score exactly."""
    from diffusers import UNet2DConditionModel

    method = make_method(tiny_sd, fake_score="lora", fake_score_rank=4)
    assert method.critic.score is method.teacher_unet and method.fake_score_is_lora
    trained = {n for n, p in method.critic.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A.fake_score." in n or ".lora_B.fake_score." in n or n.startswith("head.")
                           for n in trained)
    assert any(n.startswith("head.") for n in trained)
    assert method.teacher_unet not in method.frozen_networks()[1:]  # not listed twice

    g = torch.Generator().manual_seed(0)
    x_t, t = torch.randn(3, 4, 8, 8, generator=g), torch.tensor([900, 500, 100])
    cond, _ = method.text_conditions(BATCH, 3, x_t.device)
    teacher_x0 = lambda: method.schedule.to_x0_eps(method.teacher_forward(x_t, t, cond), x_t, t)[0]  # noqa: E731
    torch.testing.assert_close(method.fake_x0(x_t, t, cond), teacher_x0(), rtol=0, atol=0)

    plain = UNet2DConditionModel.from_pretrained(tiny_sd, subfolder="unet").eval()
    with torch.no_grad():
        disk = plain(x_t, t, encoder_hidden_states=cond["encoder_hidden_states"]).sample
        for name, p in method.critic.score.named_parameters():
            if ".lora_B.fake_score." in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    moved = method.fake_x0(x_t, t, cond)
    assert (moved - teacher_x0()).abs().max() > 1e-3
    torch.testing.assert_close(method.teacher_forward(x_t, t, cond), disk, rtol=0, atol=0)

    method.critic_loss(BATCH, torch.Generator().manual_seed(1)).backward()
    got = {n for n, p in method.critic.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert got and got <= trained
    assert all(p.grad is None for p in method.student.parameters())

    checkpoint = {"state_dict": method.state_dict()}
    method.on_save_checkpoint(checkpoint)
    critic_keys = [k for k in checkpoint["state_dict"] if k.startswith("critic.")]
    assert critic_keys and all("lora_" in k or k.startswith("critic.head.") for k in critic_keys)
    assert not any(k.startswith("teacher_unet.") for k in checkpoint["state_dict"])
    fresh = make_method(tiny_sd, fake_score="lora", fake_score_rank=4)
    fresh.load_state_dict(checkpoint["state_dict"], strict=False)
    torch.testing.assert_close(fresh.fake_x0(x_t, t, cond), moved, rtol=0, atol=0)
    torch.testing.assert_close(fresh.teacher_forward(x_t, t, cond), disk, rtol=0, atol=0)


def test_a_checkpoint_of_another_fake_score_is_refused_on_resume(tiny_sd):
    """Loading is not strict (the frozen teacher is not stored): a checkpoint whose critic weights do not fit this
    fake score (a full copy's, into a LoRA fake score) is refused naming the setting, not loaded with B = 0."""
    copy_method = make_method(tiny_sd)
    checkpoint = {"state_dict": copy_method.state_dict()}
    copy_method.on_save_checkpoint(checkpoint)
    lora = make_method(tiny_sd, fake_score="lora", fake_score_rank=4)
    with pytest.raises(ValueError, match=r"another method.fake_score \('lora' now\)"):
        lora.on_load_checkpoint(checkpoint)
    own = {"state_dict": lora.state_dict()}
    lora.on_save_checkpoint(own)
    lora.on_load_checkpoint(own)  # its own checkpoint passes


def test_a_lora_fake_score_beside_a_lora_student_is_refused(tiny_sd):
    import functools

    from distill.families import load_teacher
    from distill.methods.dmd2 import DistributionMatchingDistillation
    from distill.students.copies import lora_student

    adam = lambda params: torch.optim.Adam(params, lr=1e-4)  # noqa: E731
    with pytest.raises(ValueError, match="method.fake_score=lora with student=lora"):
        DistributionMatchingDistillation(load_teacher(str(tiny_sd)), functools.partial(lora_student, rank=4),
                                         optimizer=adam, critic_optimizer=adam, fake_score="lora")


# ---------------------------------------------------------------- the command line

SAMPLE = r"""
import json, sys, torch
import distill.inference.pipelines  # registers distill's pipeline classes with diffusers
from diffusers import DiffusionPipeline
pipe = DiffusionPipeline.from_pretrained(sys.argv[1])
calls = []
pipe.unet.register_forward_pre_hook(lambda m, args, kwargs: calls.append([int(args[1]), len(args[0])]), with_kwargs=True)
image = pipe("a handwritten digit seven", output_type="pt", generator=torch.Generator().manual_seed(0)).images
print(json.dumps({"calls": calls, "shape": list(image.shape), "finite": bool(torch.isfinite(image).all()),
                  "pipeline": type(pipe).__name__, "scheduler": type(pipe.scheduler).__name__}))
"""


@pytest.mark.slow  # ~2-3 min on 2 loaded cores
def test_two_cli_steps_export_a_generator_that_samples_on_its_own_timesteps(tmp_path):
    """Two DMD2 steps of a 2-step generator on the default teacher; in a fresh process the export's default call
    runs one UNet evaluation per step (batch 1: no CFG pass) at the generator's timesteps 999 and 499."""
    run_dir = tmp_path / "run"
    proc = run_train("+exp=dmd2", "scheduler.num_inference_steps=2", "data.batch_size=4", "method.critic_updates=2",
                     "trainer.max_steps=2", "trainer.limit_val_batches=0", "checkpoint.every_n_train_steps=2",
                     "callbacks.quality_cost=null", "callbacks.samples=null", "sample_grid_seeds=0", "logger=csv",
                     f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    export = run_dir / "export"
    info = json.loads((export / "distill.json").read_text())
    assert info["method"] == "dmd2" and info["generator_timesteps"] == [999, 499]
    script = tmp_path / "sample.py"
    script.write_text(SAMPLE)
    out = subprocess.run([sys.executable, str(script), str(export)], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["calls"] == [[999, 1], [499, 1]], result
    assert result["scheduler"] == "LCMScheduler" and result["finite"] and result["shape"] == [1, 1, 32, 32]
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert {k.split(".")[0] for k in state["state_dict"]} == {"student", "critic"}
    assert len(state["optimizer_states"]) == 2


@pytest.mark.parametrize("overrides, needle", [
    (["scheduler=ddim"], "scheduler.name='ddim': a DMD2 generator samples on its own timesteps"),
    (["method.critic_updates=0"], "method.critic_updates=0 must be an integer >= 1"),
    (["student.time_cond_proj_dim=256"], "student.time_cond_proj_dim=256: a DMD2 generator takes no guidance input"),
    (["method.real_guidance_scale=0.5"], "method.real_guidance_scale=0.5 must be >= 1"),
    (["method.dmd_time_min=0.9", "method.dmd_time_max=0.5"], "0 <= min < max <= 1"),
    (["method.gan_critic_weight=-1"], "method.gan_critic_weight=-1.0 must be >= 0"),
    (["method.fake_score=full"], "method.fake_score='full': use copy"),
    (["method.fake_score=lora", "method.fake_score_rank=0"], "method.fake_score_rank=0 must be an integer >= 1"),
    (["method.fake_score=lora", "student=lora", "student.time_cond_proj_dim=null"],
     "method.fake_score=lora with student=lora"),
])
def test_bad_options_are_refused_by_the_config_check(compose, overrides, needle):
    from distill.config.validate import ConfigError, validate

    cfg = compose("+exp=dmd2", *overrides)
    with pytest.raises((ConfigError, ValueError), match=None) as err:
        validate(cfg)
    assert needle in str(err.value)


def test_bad_input_exits_2_before_any_model_is_built(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train("+exp=dmd2", "method.critic_updates=0", f"hydra.run.dir={run_dir}", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "method.critic_updates=0" in proc.stderr and not run_dir.exists()


@pytest.mark.slow  # a second CLI start (~40 s on a loaded machine); tests/test_dmd2_flow.py checks it in-process
def test_the_vp_preset_on_a_flow_teacher_is_refused_before_compute(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train("+exp=dmd2", "teacher=digits_flow", f"hydra.run.dir={run_dir}", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "use +exp=dmd2_flow" in proc.stderr and not run_dir.exists()
