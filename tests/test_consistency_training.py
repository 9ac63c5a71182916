"""iCT / ECT schedules, weightings and losses against the papers' formulas and diffusers' consistency-model
scheduler (the parametrisation an export samples with)."""

import math

import numpy as np
import pytest
import torch
from diffusers import CMStochasticIterativeScheduler, DDPMScheduler
from scipy.stats import norm

from distill.diffusion import consistency_training as ct
from distill.diffusion.schedules import vp_sigmas, vp_timestep


def test_karras_sigmas_formula_and_endpoints():
    s = ct.karras_sigmas(3, 0.002, 80.0, 7.0)
    lo, hi = 0.002 ** (1 / 7), 80.0 ** (1 / 7)
    assert torch.allclose(s, torch.tensor([lo ** 7, ((lo + hi) / 2) ** 7, hi ** 7], dtype=torch.float64))
    assert torch.all(s[1:] > s[:-1])


def test_bad_sigma_settings_are_refused():
    with pytest.raises(ValueError, match="need 0 < sigma_min < sigma_max"):
        ct.karras_sigmas(10, 80.0, 0.002)
    with pytest.raises(ValueError, match="N >= 2"):
        ct.karras_sigmas(1)


def test_ict_curriculum_doubles_at_even_steps():
    # iCT's CIFAR-10 setting: K = 400,000, s0 = 10, s1 = 1280: K' = floor(400000 / 8) = 50,000
    assert ct.ict_num_scales(0, 400_000) == 11
    assert ct.ict_num_scales(49_999, 400_000) == 11
    assert ct.ict_num_scales(50_000, 400_000) == 21
    assert ct.ict_num_scales(100_000, 400_000) == 41
    assert ct.ict_num_scales(350_000, 400_000) == 1281
    assert ct.ict_num_scales(399_999, 400_000) == 1281


def test_lognormal_pair_probabilities_are_the_lognormal_mass_between_levels():
    sigmas = ct.karras_sigmas(11)
    p = ct.lognormal_pair_probabilities(sigmas, -1.1, 2.0)
    cdf = norm.cdf((np.log(sigmas.numpy()) + 1.1) / 2.0)
    ref = np.diff(cdf) / np.diff(cdf).sum()
    assert p.shape == (10,) and np.allclose(p.numpy(), ref, atol=1e-12)


def test_ict_weight():
    assert torch.allclose(ct.ict_weight(torch.tensor([1.0, 2.0]), torch.tensor([1.5, 4.0])), torch.tensor([2.0, 0.5]))


def test_ect_mapping_follows_the_paper():
    t = torch.tensor([0.01, 0.5, 2.0, 80.0], dtype=torch.float64)
    for stage in (0, 1, 3):
        decay = 1 / 2 ** (stage + 1)
        ref = torch.clamp(t * (1 - decay * (1 + 8 * torch.sigmoid(-t))), min=0)
        assert torch.allclose(ct.ect_r(t, stage), ref)
    # stage 0 at small t: r = 0 (the target is the data); large t: r -> t / 2; later stages: r -> t
    assert ct.ect_r(torch.tensor([0.01]), 0).item() == 0
    assert abs(ct.ect_r(torch.tensor([80.0]), 0).item() - 40.0) < 1e-6
    assert ct.ect_r(torch.tensor([2.0]), 8).item() > 0.99 * 2.0 * (1 - 9 / 2 ** 9)


def test_boundary_condition_and_input_scalings_match_diffusers_consistency_scheduler():
    sched = CMStochasticIterativeScheduler(sigma_min=0.002, sigma_max=80.0, sigma_data=0.5)
    sigma = torch.tensor([0.002, 0.1, 1.0, 10.0, 80.0], dtype=torch.float64)
    c_skip, c_out = ct.edm_boundary_scalings(sigma, 0.5, 0.002)
    ref_skip, ref_out = sched.get_scalings_for_boundary_condition(sigma)
    assert torch.allclose(c_skip, ref_skip) and torch.allclose(c_out, ref_out)
    assert c_skip[0].item() == 1.0 and c_out[0].item() == 0.0  # f(x, sigma_min) = x
    c_in, c_noise = ct.edm_input_scalings(sigma, 0.5)
    assert torch.allclose(c_in, 1 / (sigma ** 2 + 0.25).sqrt())
    assert np.allclose(c_noise.numpy(), sched.sigma_to_t(sigma.numpy()))


def test_ect_loss_is_the_weighted_l2_norm_and_pseudo_huber():
    pred, target = torch.zeros(2, 3), torch.tensor([[3.0, 4.0, 0.0], [0.0, 0.0, 1.0]])
    t, r = torch.tensor([2.0, 1.0]), torch.tensor([1.5, 0.0])
    assert torch.allclose(ct.ect_loss(pred, target, t, r), torch.tensor([5.0 / 0.5, 1.0 / 1.0]))
    c = 0.1
    assert torch.allclose(ct.ect_loss(pred, target, t, r, c),
                          torch.tensor([(math.sqrt(25 + c * c) - c) / 0.5, math.sqrt(1 + c * c) - c]))


def test_vp_schedule_in_the_ve_view():
    sched = DDPMScheduler(num_train_timesteps=1000)
    sigmas = vp_sigmas(sched.alphas_cumprod)
    a = sched.alphas_cumprod.double()
    # x_t = sqrt(a) x0 + sqrt(1-a) eps  ->  x_t / sqrt(a) = x0 + sigma eps
    assert torch.allclose(sigmas, ((1 - a) / a).sqrt())
    t = vp_timestep(sigmas[[0, 10, 500, 999]], sigmas)
    assert torch.allclose(t, torch.tensor([0.0, 10.0, 500.0, 999.0], dtype=torch.float64))
    mid = vp_timestep((sigmas[10] * sigmas[11]).sqrt().unsqueeze(0), sigmas)  # halfway in log sigma
    assert abs(mid.item() - 10.5) < 1e-9


# ---------------------------------------------------------------- the method against its export


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory):
    from tests.sd_tiny import write_tiny_sd

    return write_tiny_sd(tmp_path_factory.mktemp("sd") / "pipe")


def _method(tiny_sd, variant, prediction_type="epsilon"):
    from distill.families import load_teacher
    from distill.methods.consistency_training import ConsistencyTraining
    from distill.students.copies import copy_student, fresh_student

    teacher = load_teacher(str(tiny_sd))
    teacher.scheduler.register_to_config(prediction_type=prediction_type)
    build = fresh_student if variant == "ict" else copy_student
    return ConsistencyTraining(teacher, build, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), variant=variant,
                               curriculum_steps=100)


@pytest.mark.parametrize("variant", ["ict", "ect"])
def test_export_samples_one_step_with_exactly_the_training_parametrisation(tiny_sd, tmp_path, variant):
    """One step of the exported pipeline, called as a user calls it (only the prompt, the latents fixed to compare),
    equals the training consistency function f(x_T, sigma_max) on the same noise, in latent space."""
    from diffusers import DiffusionPipeline

    import distill.inference.pipelines  # noqa: F401

    method = _method(tiny_sd, variant).eval()
    out = method.export(tmp_path / "export")
    pipe = DiffusionPipeline.from_pretrained(out)
    z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    got = pipe("a handwritten digit three", num_inference_steps=1, latents=z.clone(), output_type="latent").images
    cond, _ = method.text_conditions({"caption": ["a handwritten digit three"]}, 1, torch.device("cpu"))
    with torch.no_grad():
        if variant == "ict":
            sigma = torch.tensor([method.sigma_max], dtype=torch.float64)
            x = z * method.sigma_max  # the scheduler's init_noise_sigma
        else:
            sigma = method.schedule.ve_sigmas[-1:].clone()  # LCMScheduler's single step is at t = T - 1
            x = z * (1 + sigma.float() ** 2).sqrt()  # the VP sample z in the VE view
        want = method._consistency_fn(method.student, x, sigma, cond)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
def test_ect_consistency_function_converts_each_prediction_type_to_x0(tiny_sd, prediction_type):
    """The ECT parametrisation takes the teacher's output as its prediction type says: a network whose output is
    built from a known x0 gives f = c_skip x + c_out x0 for all three types."""
    method = _method(tiny_sd, "ect", prediction_type)
    x0 = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    eps = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    sigma = torch.tensor([0.5, 3.0], dtype=torch.float64)

    class Oracle(torch.nn.Module):  # answers with the exact epsilon / v / x0 of (x0, eps)
        def forward(self, x_vp, tau, encoder_hidden_states=None):
            a = (1 / (1 + sigma ** 2).sqrt()).float().view(-1, 1, 1, 1)
            s = (1 - a ** 2).sqrt()
            out = {"epsilon": eps, "v_prediction": a * eps - s * x0, "sample": x0}[prediction_type]
            return type("Out", (), {"sample": out})()

    x = x0 + sigma.float().view(-1, 1, 1, 1) * eps
    f = method._consistency_fn(Oracle(), x, sigma, {})
    tau = vp_timestep(sigma, method.schedule.ve_sigmas)
    from distill.diffusion.consistency import boundary_scalings

    c_skip, c_out = boundary_scalings(tau.float(), 0.5, 10.0)
    x_vp = x / (1 + sigma.float() ** 2).sqrt().view(-1, 1, 1, 1)
    torch.testing.assert_close(f, c_skip.view(-1, 1, 1, 1) * x_vp + c_out.view(-1, 1, 1, 1) * x0, rtol=1e-4, atol=1e-5)


def test_ict_boundary_makes_f_the_identity_at_sigma_min(tiny_sd):
    method = _method(tiny_sd, "ict")
    x = torch.randn(2, 4, 8, 8)
    cond, _ = method.text_conditions({"caption": ["a", "b"]}, 2, torch.device("cpu"))
    with torch.no_grad():
        f = method._consistency_fn(method.student, x, torch.full((2,), method.sigma_min, dtype=torch.float64), cond)
    torch.testing.assert_close(f, x)


def test_ect_pairs_follow_the_mapping_and_ict_pairs_the_curriculum(tiny_sd):
    method = _method(tiny_sd, "ect")
    g = torch.Generator().manual_seed(0)
    r, t, _, _ = method.ect_pairs(4096, 25, g)  # step 25 of curriculum_steps=100 in 8 stages: stage floor(2.0) = 2
    assert torch.all(t >= method.schedule.ve_sigmas[1]) and torch.all(t <= method.schedule.ve_sigmas[-1])
    assert torch.allclose(r, ct.ect_r(t, 2))
    method = _method(tiny_sd, "ict")
    lo, hi, _, _ = method.ict_pairs(4096, 0, g)
    sigmas = ct.karras_sigmas(11)  # N(0) = 11 levels
    assert set(lo.tolist()) <= set(sigmas[:-1].tolist()) and torch.all(hi > lo)
    assert torch.allclose(hi, sigmas[torch.searchsorted(sigmas, lo) + 1])


@pytest.mark.parametrize("overrides, needle", [
    (["method.sigma_min=80", "method.sigma_max=1"], "need 0 < sigma_min < sigma_max"),
    pytest.param(["method.s0=0"], "the curriculum needs 1 <= s0 <= s1", marks=pytest.mark.slow),
    pytest.param(["method.stages=0"], "method.stages=0 must be >= 1", marks=pytest.mark.slow),
    (["method.variant=foo"], "Invalid value 'foo', expected one of [ict, ect]"),  # Hydra's own check: exit 1
])
def test_bad_settings_exit_2_before_training(tmp_path, overrides, needle):
    from tests.conftest import run_train

    proc = run_train("+exp=consistency_training", "trainer.max_steps=2", *overrides, f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == (1 if "variant" in overrides[0] else 2) and needle in proc.stderr, proc.stderr[-2000:]


def test_truncated_lognormal_is_the_conditioned_distribution():
    lo, hi = 0.03, 15.0
    t = ct.truncated_lognormal_sigmas(200_000, lo, hi, -1.1, 2.0, torch.Generator().manual_seed(0))
    assert t.min() >= lo and t.max() <= hi
    a, b = norm.cdf((np.log(lo) + 1.1) / 2), norm.cdf((np.log(hi) + 1.1) / 2)
    for q in (0.1, 0.5, 0.9):  # quantiles of log t against the truncated normal's
        want = -1.1 + 2 * norm.ppf(a + q * (b - a))
        assert abs(np.quantile(np.log(t.numpy()), q) - want) < 0.02
    with pytest.raises(ValueError, match="need 0 < lo < hi"):
        ct.truncated_lognormal_sigmas(4, 1.0, 0.5)


@pytest.mark.parametrize("variant, overrides, scheduler", [
    ("ect", ["method.noise.antithetic=true", "method.noise.stratified=true"], "LCMScheduler"),
    ("ict", ["student=fresh", "scheduler=cm", "method.noise.timesteps=adaptive", "method.noise.history=1"],
     "CMStochasticIterativeScheduler"),
])
def test_short_cli_run_exports_a_pipeline_that_samples_through_diffusers_default_call(tiny_sd, tmp_path, variant,
                                                                                       overrides, scheduler):
    """``+exp=consistency_training`` for 3 steps on a tiny teacher (with method.noise options), then the export
    called as a user calls it: only the prompt; it samples with the training parametrisation's scheduler at the
    configured 2 steps without a guidance pass."""
    from diffusers import DiffusionPipeline

    import distill.inference.pipelines  # noqa: F401
    from tests.conftest import run_train

    run_dir = tmp_path / "run"
    proc = run_train("+exp=consistency_training", f"teacher.pretrained_model_name_or_path={tiny_sd}",
                     f"method.variant={variant}", *overrides, "callbacks.quality_cost=null", "data.batch_size=8",
                     "trainer.max_steps=3", "trainer.val_check_interval=3", "trainer.limit_val_batches=1",
                     "checkpoint.every_n_train_steps=3", "callbacks.samples.num_seeds=1", "sample_grid_seeds=1",
                     "logger=csv", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    pipe = DiffusionPipeline.from_pretrained(run_dir / "export")
    assert type(pipe.scheduler).__name__ == scheduler
    assert pipe.config.default_num_inference_steps == 2 and pipe.config.default_guidance_scale == 1.0
    calls = []
    pipe.unet.register_forward_hook(lambda m, a, k: calls.append(a[0].shape[0]))
    images = pipe("a handwritten digit four").images
    assert len(images) == 1 and calls == [1, 1]  # two steps, one conditional evaluation each
    assert np.asarray(images[0]).std() > 0


@pytest.mark.parametrize("student", ["lora", "moe_timestep", "lowrank"])
def test_ect_trains_lora_moe_and_compressed_students_and_exports_them(tiny_sd, tmp_path, compose, student):
    """ECT works with the other students: one loss and backward step changes trainable weights, and the export
    samples through diffusers' default call (LoRA: adapter weights that load into the teacher)."""
    from diffusers import DiffusionPipeline
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    import distill.inference.pipelines  # noqa: F401
    from distill.config.builds import plain_choices

    extra = {"lora": ["student.rank=4"], "moe_timestep": ["student.num_experts=2"], "lowrank": []}[student]
    cfg = plain_choices(compose("+exp=consistency_training", f"student={student}", *extra,
                                f"teacher.pretrained_model_name_or_path={tiny_sd}"))
    torch.manual_seed(0)
    method = instantiate(cfg.method, _partial_=True, _convert_="all")(
        student=instantiate(cfg.student), teacher=instantiate(cfg.teacher),
        sampling=OmegaConf.to_container(cfg.scheduler, resolve=True))
    params = [p for p in method.trainable_parameters()]
    before = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params, lr=0.1)
    batch = {"pixel_values": torch.rand(4, 1, 32, 32) * 2 - 1, "caption": ["a handwritten digit two"] * 4}
    method.train()
    loss = method.loss(batch, torch.Generator().manual_seed(0))
    loss.backward()
    opt.step()
    assert torch.isfinite(loss) and any(not torch.equal(a, p.detach()) for a, p in zip(before, params))
    out = method.eval().export(tmp_path / "export")
    if student == "lora":
        assert (out / "lora" / "pytorch_lora_weights.safetensors").is_file()
        return
    pipe = DiffusionPipeline.from_pretrained(out)
    images = pipe("a handwritten digit two").images
    assert len(images) == 1 and np.asarray(images[0]).std() > 0


def test_ect_stages_split_the_run_as_the_paper():
    """ECT's CIFAR-10 run (run_ecm.sh: 25.6 Mimg of batch 128 = 200k steps, t - r halved every 250 of its 2,000
    ticks): 8 stages of 25k steps; a 1,000-step run keeps the same 8 stages (125 steps each), so its last
    stage's decay is the paper's 1/2^8, not the 1/2^10 of a fixed 100-step halving."""
    assert [ct.ect_stage(s, 200_000, 8) for s in (0, 24_999, 25_000, 175_000, 199_999, 200_000)] == [0, 0, 1, 7, 7, 7]
    assert [ct.ect_stage(s, 1_000, 8) for s in (124, 125, 600, 999, 1_000)] == [0, 1, 4, 7, 7]
    with pytest.raises(ValueError, match="stages=0"):
        ct.ect_stage(5, 100, 0)


class _Linear(torch.nn.Module):
    """A tiny deterministic stand-in for the UNet: sample = w x + b (tau / 1000) mean(cond), so f depends on the
    input, the timestep and the condition through two scalars."""

    def __init__(self):
        super().__init__()
        self.w, self.b = torch.nn.Parameter(torch.tensor(0.7)), torch.nn.Parameter(torch.tensor(0.3))

    def forward(self, x, tau, encoder_hidden_states=None):
        cond = encoder_hidden_states.float().mean(dim=(1, 2)).view(-1, 1, 1, 1)
        return type("Out", (), {"sample": self.w * x + self.b * (tau.float() / 1000).view(-1, 1, 1, 1) * cond})()


def _loss_and_gradient(method, n: int, digit: str, seed: int):
    """The method's loss on n copies of one caption (latents (n, 4, 8, 8) seeded 7, posterior std 0) and the
    gradient of the two-parameter student: (latent means, batch, loss, (2, ...) gradient)."""
    mean = torch.randn(n, 4, 8, 8, generator=torch.Generator().manual_seed(7))
    batch = {"latent_mean": mean, "latent_std": torch.zeros_like(mean), "caption": [f"a handwritten digit {digit}"] * n}
    loss = method.loss(batch, torch.Generator().manual_seed(seed))
    loss.backward()
    return mean, batch, loss, torch.stack([method.student.w.grad, method.student.b.grad])


@pytest.mark.parametrize("step, max_steps", [(0, 1_000), (600, 1_000)])
def test_ect_loss_value_and_gradient_computed_by_hand(tiny_sd, step, max_steps):
    """ConsistencyTraining.loss (ECT, epsilon teacher) against Geng et al. 2024 written out: x0 from the batch;
    t ~ lognormal(-1.1, 2) truncated to the teacher's range; r = t (1 - (1 + 8 sigmoid(-t)) / 2^(stage+1)) with
    stage = floor(8 step / max_steps), clamped at 0; one eps for both points; f(x, sigma) = c_skip x_vp + c_out
    x0_hat at the teacher's timestep of sigma (LCM's c_skip, c_out, sigma_data 0.5, timestep_scaling 10);
    f_r = x0 where r = 0, else f at r under stop-gradient; loss = mean ||f_t - f_r|| / (t - r). The gradient is
    the one of f_t alone (a gradient through f_r would differ)."""
    from types import SimpleNamespace

    method = _method(tiny_sd, "ect")
    method.student, method.curriculum_steps = _Linear(), None  # the stages from trainer.max_steps, the default
    method._trainer = SimpleNamespace(global_step=step, max_steps=max_steps)  # what loss reads of the Trainer
    n, seed = 8, 3
    mean, batch, loss, got_grad = _loss_and_gradient(method, n, "three", seed)

    # by hand, drawing in the loss's order: the latent posterior's noise, t, then eps
    g = torch.Generator().manual_seed(seed)
    torch.randn(mean.shape, generator=g)  # the posterior draw (std 0: x0 is the mean)
    x0 = mean * method.vae.config.scaling_factor
    abar = DDPMScheduler.from_config(method.noise_scheduler_config).alphas_cumprod.double()  # the teacher's table
    sigmas = ((1 - abar) / abar).sqrt().numpy()
    lo, hi = sigmas[1], sigmas[-1]
    a, b = (norm.cdf((np.log(v) + 1.1) / 2.0) for v in (lo, hi))
    u = torch.rand(n, generator=g, dtype=torch.float64).numpy()
    t = np.exp(-1.1 + 2.0 * norm.ppf(a + (b - a) * u))
    stage = 8 * step // max_steps
    r = np.clip(t * (1 - (1 + 8 / (1 + np.exp(t))) / 2 ** (stage + 1)), 0, None)
    eps = torch.randn(x0.shape, generator=g)
    if step == 0:
        assert (r == 0).any() and (r > 0).any()  # both branches in the batch
    else:
        assert (r > 0).all()
    cond = method.conditioner(batch)["encoder_hidden_states"]

    def f(net, sigma):  # sigma: (n,) numpy; the sample x0 + sigma eps in the VP view the teacher takes
        tau = np.interp(np.log(sigma), np.log(sigmas), np.arange(len(sigmas)))  # linear in log sigma
        s = torch.tensor(sigma, dtype=torch.float32).view(-1, 1, 1, 1)
        alpha, sd = 1 / (1 + s ** 2).sqrt(), s / (1 + s ** 2).sqrt()
        x_vp = (x0 + s * eps) * alpha
        eps_hat = net(x_vp, torch.tensor(tau), encoder_hidden_states=cond).sample
        x0_hat = (x_vp - sd * eps_hat) / alpha
        scaled = torch.tensor(10.0 * tau, dtype=torch.float32).view(-1, 1, 1, 1)
        c_skip, c_out = 0.25 / (scaled ** 2 + 0.25), scaled / (scaled ** 2 + 0.25).sqrt()
        return c_skip * x_vp + c_out * x0_hat

    ref = _Linear()
    f_t = f(ref, t)
    live = r > 0
    with torch.no_grad():
        f_r = x0.clone()
        f_r[torch.from_numpy(live)] = f(ref, np.where(live, r, 1.0))[torch.from_numpy(live)]
    weight = torch.tensor(1 / (t - r), dtype=torch.float32)
    want = ((f_t - f_r).flatten(1).norm(dim=1) * weight).mean()
    want.backward()
    want_grad = torch.stack([ref.w.grad, ref.b.grad])
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-7)

    if live.any():  # the same loss with a gradient through f_r: a different gradient, so the check above can fail
        ref2 = _Linear()
        f_r2 = torch.where(torch.from_numpy(live).view(-1, 1, 1, 1), f(ref2, np.where(live, r, 1.0)), x0)
        (((f(ref2, t) - f_r2).flatten(1).norm(dim=1) * weight).mean()).backward()
        assert not torch.allclose(torch.stack([ref2.w.grad, ref2.b.grad]), want_grad, rtol=1e-3)


def test_ict_loss_value_and_gradient_computed_by_hand(tiny_sd):
    """ConsistencyTraining.loss (iCT) against Song & Dhariwal 2023 written out: adjacent Karras levels
    (sigma_i, sigma_{i+1}) of N(0) = 11; one eps for both points; EDM's parametrisation f = c_skip x + c_out
    F(c_in x, 250 ln sigma) with sigma_data 1 and the boundary at sigma_min; f at sigma_i under stop-gradient;
    loss = mean (sqrt(||f_{i+1} - f_i||^2 + c^2) - c) / (sigma_{i+1} - sigma_i), c = 0.00054 sqrt(d)."""
    method = _method(tiny_sd, "ict")
    method.student = _Linear()
    drawn, pairs = [], method.ict_pairs

    def recorded(n, step, generator):  # the real draw, and the generator's state after it (eps is drawn next)
        drawn.append((pairs(n, step, generator), generator.get_state()))
        return drawn[-1][0]

    method.ict_pairs = recorded
    n, seed = 8, 5
    mean, batch, loss, got_grad = _loss_and_gradient(method, n, "five", seed)

    (lo, hi, _, _), state = drawn[0]
    lo, hi = lo.numpy(), hi.numpy()
    levels = (0.002 ** (1 / 7) + np.arange(11) / 10 * (80.0 ** (1 / 7) - 0.002 ** (1 / 7))) ** 7
    i = np.searchsorted(levels, lo - 1e-12)
    assert np.allclose(lo, levels[i]) and np.allclose(hi, levels[i + 1])  # adjacent levels of N(0) = 11
    x0 = mean * method.vae.config.scaling_factor  # latent_std 0: the posterior draw is the mean
    eps = torch.randn(x0.shape, generator=torch.Generator().set_state(state))
    cond = method.conditioner(batch)["encoder_hidden_states"]

    def f(net, sigma):
        s = torch.tensor(sigma, dtype=torch.float32).view(-1, 1, 1, 1)
        c_skip, c_out = 1 / ((s - 0.002) ** 2 + 1), (s - 0.002) / (s ** 2 + 1).sqrt()
        x = x0 + s * eps
        return c_skip * x + c_out * net(x / (s ** 2 + 1).sqrt(), torch.tensor(250 * np.log(sigma)),
                                        encoder_hidden_states=cond).sample

    ref = _Linear()
    with torch.no_grad():
        f_lo = f(ref, lo)
    c = 0.00054 * math.sqrt(4 * 8 * 8)
    sq = (f(ref, hi) - f_lo).pow(2).flatten(1).sum(1)
    want = (((sq + c * c).sqrt() - c) / torch.tensor(hi - lo, dtype=torch.float32)).mean()
    want.backward()
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(got_grad, torch.stack([ref.w.grad, ref.b.grad]), rtol=1e-4, atol=1e-7)
