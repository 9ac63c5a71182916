"""DMD2 on flow-matching teachers (the SD3 and Flux stand-ins of tests/sd3_tiny.py and tests/flux_tiny.py): the
generator's flow times against FlowMatchLCMScheduler and FluxPipeline's sigmas, its x0 = x_t - t v, the real score's
CFG in velocity form (FLUX.1-dev: its guidance embedding), the fake score's flow-matching loss, backward simulation
against FlowMatchLCMScheduler's own steps, the DMD gradient at flow times on a Gaussian toy, the discriminator on the
middle block's tokens, an export that from_pretrained and the stock class sample alike, refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler, FlowMatchLCMScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

import distill.inference.pipelines  # noqa: F401  (registers distill's export classes, as a user loading an export does)
from distill.families import load_teacher
from distill.families.base import trailing_sigmas
from tests.conftest import run_train
from tests.flux_tiny import FLUX_SCHEDULER, write_tiny_flux
from tests.sd3_tiny import SD3_SHIFT, write_tiny_sd3
from tests.test_consistency_flow import _transformer, stock_sd3
from tests.test_consistency_flux import _transformer as _flux_transformer
from tests.test_dmd2 import assert_dmd_gradient_is_reverse_kl_gradient

PROMPTS = ["a handwritten digit three", "a handwritten digit seven"]
GUIDANCE = 2.0
FLUX_RESOLUTION = 24  # the Flux stand-in's VAE factor is 1: 24x24 latents, 144 packed tokens


def shift(u, s: float = SD3_SHIFT):
    """SD3's time shift s u / (1 + (s - 1) u) (FlowMatchEulerDiscreteScheduler's)."""
    return s * u / (1 + (s - 1) * u)


def _method(folder, steps: int = 4, **options):
    from distill.methods.dmd2 import DistributionMatchingDistillation
    from distill.students.copies import copy_student

    adam = lambda params: torch.optim.Adam(params, lr=1e-4)  # noqa: E731
    return DistributionMatchingDistillation(
        load_teacher(str(folder)), copy_student, optimizer=adam, critic_optimizer=adam,
        **{"real_guidance_scale": GUIDANCE, "critic_updates": 2,
           "sampling": {"name": "flow_lcm", "num_inference_steps": steps, "guidance_scale": 1.0}, **options})


def _apart(method, seed: int):
    """Student and fake score moved apart from the teacher (and each other), so that each network's own call shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for net in (method.student, method.critic.score):
            for p in net.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return method.eval()


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    return write_tiny_sd3(tmp_path_factory.mktemp("sd3") / "pipe")


@pytest.fixture(scope="module")
def method(sd3_dir):
    return _apart(_method(sd3_dir), 0)


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    folder = write_tiny_flux(tmp_path_factory.mktemp("flux") / "pipe")
    return _apart(_method(folder, resolution=FLUX_RESOLUTION, real_guidance_scale=3.5), 1)


def _batch(resolution: int = 32):
    return {"pixel_values": torch.linspace(-1, 1, 2 * resolution ** 2).reshape(2, 1, resolution, resolution),
            "caption": PROMPTS}


def _cond(m):
    return m.text_conditions({"caption": PROMPTS}, 2, "cpu")


def _without_gan(m, weight: str, loss, seed: int) -> torch.Tensor:
    """``loss(_batch())`` from ``seed`` with the GAN term's ``weight`` at 0 meanwhile."""
    kept = getattr(m, weight)
    setattr(m, weight, 0.0)
    try:
        return loss(_batch(), torch.Generator().manual_seed(seed))
    finally:
        setattr(m, weight, kept)


def _replay(m, seed: int):
    """The first draws of a loss on ``_batch()`` from ``seed``: (the generator's samples x, cond, uncond, the
    generator at the loss's next draw)."""
    g = torch.Generator().manual_seed(seed)
    x_real = m.latents(_batch(), g)
    cond, uncond = _cond(m)
    with torch.no_grad():
        return m.generator_sample(x_real, cond, g), cond, uncond, g


B = (-1, 1, 1, 1)


def test_the_generator_times_are_the_flow_lcm_schedulers_trailing_sigmas(sd3_dir, method):
    """1 step: t = 1; 4 steps: FlowMatchLCMScheduler (the export's, from the teacher's config: shift 3) given the
    trailing sigmas linspace(1, 1/4, 4), as DistillSD3Pipeline's call gives them, bit for bit: 1, 0.9, 0.75, 0.5."""
    scheduler = FlowMatchLCMScheduler.from_config(method.sampling_scheduler().config)
    assert type(method.sampling_scheduler()) is FlowMatchLCMScheduler and scheduler.config.shift == SD3_SHIFT
    scheduler.set_timesteps(sigmas=trailing_sigmas(4))
    assert torch.equal(method.generator_timesteps, scheduler.sigmas[:-1])
    torch.testing.assert_close(method.generator_timesteps, torch.tensor([shift(1.0), shift(0.75), shift(0.5),
                                                                         shift(0.25)]))
    assert _method(sd3_dir, steps=1).generator_timesteps.tolist() == [1.0]
    assert method.call_defaults() == {"default_num_inference_steps": 4, "default_guidance_scale": 1.0,
                                      "guidance_distilled": True, "sigma_spacing": "trailing"}


def test_the_generator_x0_is_x_t_minus_t_times_the_students_velocity(method):
    g = torch.Generator().manual_seed(0)
    x_t = torch.randn(2, 4, 8, 8, generator=g)
    cond, _ = _cond(method)
    t = method.generator_timesteps[[0, 2]]
    with torch.no_grad():
        ours = method.generator_x0(x_t, t, cond)
        hand = x_t - t.view(B) * _transformer(method.student, x_t, t, cond)
        teacher = x_t - t.view(B) * _transformer(method.teacher_unet, x_t, t, cond)
    torch.testing.assert_close(ours, hand, rtol=1e-5, atol=1e-6)
    assert (ours - teacher).abs().max() > 1e-3  # the student's own velocity


def test_the_fake_score_loss_is_the_flow_matching_loss_on_generator_samples(method):
    """GAN term off: the critic's loss is mean (v_fake(x_t, t) - (eps - x))^2 at x_t = (1 - t) x + t eps of the
    generator's samples x, t = shift(u), u ~ U[0, 1] (all of the teacher's training times), by hand from the same
    draws."""
    got = _without_gan(method, "gan_critic_weight", method.critic_loss, 3)
    x, cond, _, g = _replay(method, 3)
    with torch.no_grad():
        t = shift(torch.rand(2, generator=g, dtype=torch.float64)).float()
        eps = torch.randn(x.shape, generator=g)
        v = _transformer(method.critic.score, (1 - t.view(B)) * x + t.view(B) * eps, t, cond)
    torch.testing.assert_close(got, ((v - (eps - x)) ** 2).mean(), rtol=1e-5, atol=1e-7)


def test_backward_simulation_feeds_the_generator_flow_match_lcm_scheduler_states(method):
    """Step k = 2 of the 4-step generator: the state FlowMatchLCMScheduler.step reaches after 2 steps of the student
    (x0 = x_t - sigma v, then (1 - sigma') x0 + sigma' noise) from the same initial noise and re-noising draws."""
    x_real = method.latents(_batch(), torch.Generator().manual_seed(0))
    cond, _ = _cond(method)
    x_t, t = method.generator_inputs(x_real, cond, torch.Generator().manual_seed(7), step=2)
    assert t.tolist() == [0.75, 0.75]
    scheduler = method.sampling_scheduler()
    scheduler.set_timesteps(sigmas=trailing_sigmas(4))
    g = torch.Generator().manual_seed(7)
    sample = torch.randn(x_real.shape, generator=g)
    with torch.no_grad():
        for step in scheduler.timesteps[:2]:
            v = method.student(hidden_states=sample, timestep=step.expand(2), **cond).sample
            sample = scheduler.step(v, step, sample, generator=g).prev_sample
    torch.testing.assert_close(x_t, sample, rtol=1e-5, atol=1e-5)


def test_the_dmd_loss_uses_cfg_in_velocity_form_at_shifted_times(method):
    """GAN term off: the generator's loss is 0.5 mean(grad^2), grad = (fake x0 - real x0) / mean|x - real x0| per
    example, real x0 = x_t - t (v_u + s (v_c - v_u)) of the teacher (SD3's CFG), fake x0 = x_t - t v_fake, at
    t = shift(u), u ~ U[0.02, 0.98], all by hand from the same draws; the times of many draws fill [shift(0.02),
    shift(0.98)] = [0.0577, 0.9933]."""
    got = _without_gan(method, "gan_generator_weight", method.loss, 5)
    x, cond, uncond, g = _replay(method, 5)
    with torch.no_grad():
        t = shift(0.02 + 0.96 * torch.rand(2, generator=g, dtype=torch.float64)).float()
        x_t = (1 - t.view(B)) * x + t.view(B) * torch.randn(x.shape, generator=g)
        v_c, v_u = (_transformer(method.teacher_unet, x_t, t, c) for c in (cond, uncond))
        real = x_t - t.view(B) * (v_u + GUIDANCE * (v_c - v_u))
        fake = x_t - t.view(B) * _transformer(method.critic.score, x_t, t, cond)
        grad = (fake - real) / (x - real).abs().flatten(1).mean(1).view(B)
    torch.testing.assert_close(got, 0.5 * grad.pow(2).mean(), rtol=1e-4, atol=1e-8)
    times = method.draw_times(20000, 0.02, 0.98, "cpu", torch.Generator().manual_seed(0))
    assert shift(0.02) <= times.min() < shift(0.03) and shift(0.97) < times.max() <= shift(0.98)


@pytest.mark.parametrize("t", [0.1, 0.5, 0.9])
def test_the_dmd_gradient_at_a_flow_time_is_the_reverse_kl_gradient(t):
    """On the flow path x_t = (1 - t) x + t eps (alpha = 1 - t, sigma = t) the DMD gradient is d KL(q_t || p_t) /
    d(m, s) for Gaussian data and generator, the x0s their exact posterior means, by quadrature
    (``assert_dmd_gradient_is_reverse_kl_gradient``)."""
    assert_dmd_gradient_is_reverse_kl_gradient(1 - t, t)


def test_the_discriminator_reads_the_middle_blocks_image_tokens(method):
    """The head reads the fake score's (N, T, D) image tokens at the output of joint block (L - 1) // 2 (block 0 of
    the stand-in's 2), captured here by a hook of our own; its logit is the token MLP's mean over tokens."""
    from distill.methods.dmd2 import TokenDiscriminatorHead

    score = method.critic.score
    assert method.critic.block == f"transformer_blocks.{(len(score.transformer_blocks) - 1) // 2}"
    seen = []
    hook = score.transformer_blocks[0].register_forward_hook(lambda mod, args, out: seen.append(out[1]))
    try:
        logits = method.discriminator_logits(torch.randn(2, 4, 8, 8), _cond(method)[0],
                                             torch.Generator().manual_seed(0))
    finally:
        hook.remove()
    head = method.critic.head
    assert isinstance(head, TokenDiscriminatorHead) and seen[0].shape == (2, 16, 16)  # 4x4 patches, width 16
    torch.testing.assert_close(logits, head.out(head.body(seen[0]).mean(1)).squeeze(1))


def test_flux_dev_real_score_takes_its_guidance_embedding_the_fake_score_guidance_1(flux):
    """FLUX.1-dev's layout: the generator times are FluxPipeline's 4-step sigmas at mu of the 24x24 training latents;
    the real x0 is x_t - t v_teacher(guidance = s), one call without an unconditional row; the generator is called
    at guidance s (and the export's default call passes s), the fake score at 1."""
    mu = calculate_shift((FLUX_RESOLUTION // 2) ** 2, 256, 4096, 0.5, 1.15)
    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER)
    retrieve_timesteps(scheduler, 4, sigmas=np.linspace(1.0, 1 / 4, 4), mu=mu)
    assert flux.mu == mu and torch.equal(flux.generator_timesteps, scheduler.sigmas[:-1])
    g = torch.Generator().manual_seed(2)
    x_t = torch.randn(2, 4, FLUX_RESOLUTION, FLUX_RESOLUTION, generator=g)
    cond, uncond = _cond(flux)
    t = flux.generator_timesteps[[1, 3]]
    s = torch.full((2,), 3.5)
    with torch.no_grad():
        for ours, net, guidance in ((flux.real_x0(x_t, t, cond, uncond), flux.teacher_unet, s),
                                    (flux.generator_x0(x_t, t, cond), flux.student, s),
                                    (flux.fake_x0(x_t, t, cond), flux.critic.score, torch.ones(2))):
            hand = x_t - t.view(B) * _flux_transformer(net, x_t, t, cond, guidance)
            torch.testing.assert_close(ours, hand, rtol=1e-5, atol=1e-5)
    assert flux.call_defaults()["default_guidance_scale"] == 3.5 and not flux.call_defaults()["guidance_distilled"]
    loss = flux.loss(_batch(FLUX_RESOLUTION), torch.Generator().manual_seed(0))
    critic = flux.critic_loss(_batch(FLUX_RESOLUTION), torch.Generator().manual_seed(0))
    assert torch.isfinite(loss) and torch.isfinite(critic) and critic > 0


def _sample(export, **call):
    """``DiffusionPipeline.from_pretrained(export)(prompt)`` with diffusers' defaults, the global RNG seeded as the
    stock scripts seed it (the flow pipelines step FlowMatchLCMScheduler without the call's generator): (the
    pipeline, its images, (transformer calls, rows))."""
    from distill.metrics.cost import NFECounter

    pipe = DiffusionPipeline.from_pretrained(export)
    pipe.set_progress_bar_config(disable=True)
    torch.manual_seed(0)
    with NFECounter(pipe.transformer) as counter:
        images = pipe(PROMPTS[0], generator=torch.Generator().manual_seed(0), output_type="pt", **call).images
    assert torch.isfinite(images).all() and images.std() > 0
    return pipe, images, (counter.calls, counter.examples)


def test_the_export_samples_on_the_generator_times_and_the_stock_class_alike(sd3_dir, tmp_path):
    """The exported 2-step generator: DistillSD3Pipeline on FlowMatchLCMScheduler; from_pretrained(export)(prompt)
    runs 2 transformer calls of 1 row (no CFG pass) at 1000 t_k of the generator's times, and the stock
    StableDiffusion3Pipeline, in a process that does not import distill, called with the card's arguments, gives the
    same images."""
    method = _apart(_method(sd3_dir, steps=2), 3)
    export = method.export(tmp_path / "export")
    index = json.loads((export / "model_index.json").read_text())
    assert index["_class_name"] == "DistillSD3Pipeline" and index["scheduler"] == ["diffusers", "FlowMatchLCMScheduler"]
    info = json.loads((export / "distill.json").read_text())
    assert info["method"] == "dmd2" and info["generator_timesteps"] == [1.0, pytest.approx(0.75)]
    assert info["stock"]["call"]["sigmas"] == [1.0, 0.5] and info["sampling"]["nfe_per_step"] == 1
    seen = []
    _, ours, counted = _sample(export, callback_on_step_end=lambda p, i, t, kw: seen.append(float(t)) or kw)
    assert counted == (2, 2) and seen == pytest.approx([1000 * x for x in info["generator_timesteps"]])
    call = {"num_inference_steps": 2, "guidance_scale": 1.0, **info["stock"]["call"]}
    classes, theirs = stock_sd3(tmp_path, export, info["stock"]["load"], call, PROMPTS[0])
    assert classes == ["StableDiffusion3Pipeline", "FlowMatchLCMScheduler"] and torch.equal(ours, theirs)


def test_what_cannot_work_on_a_flow_teacher_is_refused(sd3_dir, compose):
    """At the config (exit 2 on the command line): DMD2's VP preset on the flow teacher, the flow preset on a VP
    teacher, the regression loss on a flow teacher, the VP preset's quality-cost rows; at construction a VP scheduler and the regression loss."""
    from distill.config.validate import ConfigError, validate

    flow = f"teacher.pretrained_model_name_or_path={sd3_dir}"
    for overrides, message in ((["+exp=dmd2", flow], r"scheduler.name='lcm' on the flow-matching teacher .*use "
                                                     r"\+exp=dmd2_flow"),
                               (["+exp=dmd2_flow", "teacher=digits"], r"scheduler.name='flow_lcm' on the discrete VP "
                                                                      r"teacher .*use \+exp=dmd2 "),
                               (["+exp=dmd2_flow", flow, "method.regression_weight=1"],
                                "method.regression_weight=1.0 on a flow-matching teacher"),
                               # the method's scheduler right, the quality-cost sweep's VP rows of +exp=dmd2 left
                               (["+exp=dmd2", flow, "scheduler=flow_lcm"],
                                r"callbacks.quality_cost.schedulers: 'lcm' steps a discrete VP")):
        with pytest.raises(ConfigError, match=message):
            validate(compose(*overrides))
    # without teacher rows (quality_cost.teacher null) the sweep's teacher schedulers are not read
    validate(compose("+exp=dmd2_flow", flow, "callbacks.quality_cost.teacher=null",
                     "callbacks.quality_cost.teacher_schedulers=[ddim]"))
    with pytest.raises(ValueError, match="scheduler.name: 'lcm' steps a discrete VP"):
        _method(sd3_dir, sampling={"name": "lcm", "num_inference_steps": 1, "guidance_scale": 1.0})
    with pytest.raises(ValueError, match="method.regression_weight=0.5 on the flow-matching teacher"):
        _method(sd3_dir, regression_weight=0.5)


FAST = ["callbacks.quality_cost=null", "data.batch_size=2", "method.critic_updates=1", "trainer.max_steps=2",
        "trainer.limit_val_batches=0", "checkpoint.every_n_train_steps=2", "callbacks.samples=null",
        "sample_grid_seeds=0", "logger=csv", "scheduler.num_inference_steps=2"]


@pytest.mark.slow  # a CLI training run (~1 min on 2 loaded cores); test_the_export_samples_... is its fast equivalent
def test_two_cli_steps_of_dmd2_flow_export_a_generator_the_stock_class_reproduces(sd3_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train("+exp=dmd2_flow", f"teacher.pretrained_model_name_or_path={sd3_dir}", *FAST,
                     f"hydra.run.dir={run_dir}", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    export = run_dir / "export"
    info = json.loads((export / "distill.json").read_text())
    assert info["method"] == "dmd2" and info["generator_timesteps"] == [1.0, pytest.approx(0.75)]
    _, ours, counted = _sample(export)
    assert counted == (2, 2)
    call = {"num_inference_steps": 2, "guidance_scale": 1.0, **info["stock"]["call"]}
    classes, theirs = stock_sd3(tmp_path, export, info["stock"]["load"], call, PROMPTS[0])
    assert classes == ["StableDiffusion3Pipeline", "FlowMatchLCMScheduler"] and torch.equal(ours, theirs)
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert {k.split(".")[0] for k in state["state_dict"]} == {"student", "critic"}


@pytest.mark.slow  # a CLI training run on the Flux stand-in (~1 min on 2 loaded cores); the flux fixture's test is its fast part
def test_two_cli_steps_of_dmd2_flux_export_a_generator_the_stock_flux_pipeline_reproduces(tmp_path):
    """+exp=dmd2_flux on the Flux stand-in (FLUX.1-dev's guidance embedding, 24x24 training latents): the export's
    default call samples 2 steps of 1 row at guidance 3.5 through the embedding, on FluxPipeline's sigmas at the
    training mu, and the stock FluxPipeline with the card's arguments in a process without distill gives the same
    images."""
    from tests.test_consistency_flux import stock_flux, train_flux

    folder = write_tiny_flux(tmp_path / "flux")
    run_dir, proc = train_flux(tmp_path, "dmd2_flux", folder, *FAST, f"data.resolution={FLUX_RESOLUTION}",
                               "data.num_workers=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    index = json.loads((run_dir / "export" / "model_index.json").read_text())
    keys = ("_class_name", "scheduler", "default_num_inference_steps", "default_guidance_scale", "guidance_distilled",
            "default_sample_size")
    assert {k: index[k] for k in keys} == dict(zip(keys, ("DistillFluxPipeline", ["diffusers", "FlowMatchLCMScheduler"],
                                                          2, 3.5, False, FLUX_RESOLUTION)))
    info = json.loads((run_dir / "export" / "distill.json").read_text())
    pipe, ours, counted = _sample(run_dir / "export")
    assert counted == (2, 2) and ours.shape == (1, 1, FLUX_RESOLUTION, FLUX_RESOLUTION)
    torch.testing.assert_close(pipe.scheduler.sigmas[:-1], torch.tensor(info["generator_timesteps"]))
    call = {"num_inference_steps": 2, "guidance_scale": 3.5, **info["stock"]["call"]}
    classes, theirs = stock_flux(tmp_path, run_dir / "export", call, PROMPTS[0])
    assert classes == ["FluxPipeline", "FlowMatchLCMScheduler"] and torch.equal(ours, theirs["images"])
