"""ECT (Geng et al. 2024) on a Flux teacher (the stand-in of tests/flux_tiny.py: FLUX.1-dev's guidance embedding and
resolution shift; FLUX.1-schnell's layout without the embedding): the loss against ECT written out by hand with the
transformer called as FluxPipeline calls it (flow time t = sigma / (1 + sigma), one eps, f = x_t - t v, guidance 1),
FlowMatchLCMScheduler through FluxPipeline at the training resolution's mu (the sigmas diffusers' set_timesteps(sigmas,
mu) gives, one step = the trained f at t = 1), the refusals, and two training steps through the CLI whose export samples
through DiffusionPipeline.from_pretrained and the stock FluxPipeline in a process that does not import distill."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline, FlowMatchLCMScheduler, FluxPipeline
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

import distill.inference.pipelines  # noqa: F401  (registers distill's export classes, as a user loading an export does)
from distill.families import load_teacher
from distill.metrics.cost import NFECounter
from tests.flux_tiny import FLUX_SCHEDULER, write_tiny_flux
from tests.test_consistency_flux import (
    _flux_sigmas,
    _transformer,
    stock_flux,
    train_flux,
    train_losses,
)
from tests.test_consistency_training_flow import _by_hand_r, _by_hand_sigmas

PROMPT = "a handwritten digit three"
RESOLUTION = 24  # the training images' side (the stand-in's VAE factor is 1)
MU = calculate_shift((RESOLUTION // 2) ** 2, 256, 4096, 0.5, 1.15)  # 144 packed tokens: 0.4810
B = (-1, 1, 1, 1)


def _method(folder, **options):
    from distill.methods.consistency_training import ConsistencyTraining
    from distill.students.copies import copy_student

    return ConsistencyTraining(load_teacher(str(folder)), copy_student,
                               optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                               **{"curriculum_steps": 100, "resolution": RESOLUTION, **options})


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory):
    return write_tiny_flux(tmp_path_factory.mktemp("flux") / "pipe")


@pytest.fixture(scope="module")
def method(flux_dir):
    return _method(flux_dir).eval()


def test_the_loss_against_ect_by_hand_with_the_transformer_at_guidance_1(method):
    """Step 60 of a 100-step curriculum (stage 4): x0 from the batch's latents; sigma_t ECT's truncated lognormal and sigma_r its
    mapping, at flow times t = sigma / (1 + sigma); one eps; f(x, s) = x - s v(x, s) with x on the straight path
    (1 - s) x0 + s eps and v the transformer called as FluxPipeline calls it at guidance 1 (its embedding's input:
    no guidance); loss = mean ||f_t - f_r|| (1 - t)(1 - r) / (t - r). At guidance 3.5 the same sum differs."""
    method._trainer = SimpleNamespace(global_step=60, max_steps=1_000)  # the curriculum: 100 steps
    try:
        n, seed = 4, 3
        mean = torch.randn(n, 4, RESOLUTION, RESOLUTION, generator=torch.Generator().manual_seed(7))
        batch = {"latent_mean": mean, "latent_std": torch.zeros_like(mean), "caption": [PROMPT] * n}
        with torch.no_grad():
            loss = method.loss(batch, torch.Generator().manual_seed(seed))
    finally:
        method._trainer = None
    g = torch.Generator().manual_seed(seed)
    torch.randn(mean.shape, generator=g)  # the posterior draw (std 0: x0 is the mean)
    vae = method.vae.config
    x0 = (mean - vae.shift_factor) * vae.scaling_factor
    sigma_t = _by_hand_sigmas(torch.rand(n, generator=g, dtype=torch.float64).numpy())
    sigma_r = _by_hand_r(sigma_t, 8 * 60 // 100)
    assert (sigma_r > 0).all()  # stage 4: every r is a network call
    eps = torch.randn(x0.shape, generator=g)
    t, r = (torch.tensor(s / (1 + s), dtype=torch.float32) for s in (sigma_t, sigma_r))
    cond, _ = method.text_conditions(batch, n, "cpu")

    def f(time, guidance):
        x = (1 - time.view(B)) * x0 + time.view(B) * eps
        return x - time.view(B) * _transformer(method.student, x, time, cond, torch.full((n,), guidance))

    weight = torch.from_numpy((1 - t.double().numpy()) * (1 - r.double().numpy()) / (t - r).double().numpy())
    with torch.no_grad():
        by_hand = ((f(t, 1.0) - f(r, 1.0)).flatten(1).norm(dim=1) * weight.float()).mean()
        at_default = ((f(t, 3.5) - f(r, 3.5)).flatten(1).norm(dim=1) * weight.float()).mean()
    torch.testing.assert_close(loss, by_hand, rtol=1e-4, atol=0)
    assert not torch.allclose(at_default, by_hand, rtol=1e-4, atol=0)


def test_flow_lcm_samples_through_flux_pipeline_at_the_training_mu(method):
    """FluxPipeline gives FlowMatchLCMScheduler (the teacher's dynamic-shift config) sigmas linspace(1, 1/N, N) and
    mu of the image's tokens; the in-memory export's default call (24 latent pixels) samples 2 steps at the sigmas
    diffusers' set_timesteps(sigmas, mu=0.4810) gives, t = 1 and e^mu / (e^mu + 1) (noise level e^mu, inside ECT's
    trained range), bit for bit; one step from latents z returns z - v(z, 1) at guidance 1, the trained f at t = 1."""
    pipe = method.pipeline()
    assert type(pipe.scheduler) is FlowMatchLCMScheduler and pipe.scheduler.config.use_dynamic_shifting
    seen = []
    torch.manual_seed(0)
    pipe(PROMPT, output_type="latent", callback_on_step_end=lambda p, i, t, kw: seen.append(float(t)) or kw)
    expected = _flux_sigmas(FlowMatchLCMScheduler.from_config(pipe.scheduler.config), 2, MU)
    assert torch.equal(pipe.scheduler.sigmas, expected)
    assert seen == pytest.approx([1000.0, 1000.0 * math.exp(MU) / (math.exp(MU) + 1)], rel=1e-6)
    z = torch.randn(1, 4, RESOLUTION, RESOLUTION, generator=torch.Generator().manual_seed(0))
    packed = FluxPipeline._pack_latents(z, 1, 4, RESOLUTION, RESOLUTION)
    out = pipe(PROMPT, num_inference_steps=1, latents=packed, output_type="latent").images
    cond, _ = method.text_conditions({"caption": [PROMPT]}, 1, "cpu")
    with torch.no_grad():
        v = _transformer(method.student, z, torch.ones(1), cond, torch.ones(1))
    torch.testing.assert_close(FluxPipeline._unpack_latents(out, RESOLUTION, RESOLUTION, 1), z - v, rtol=1e-5,
                               atol=1e-5)


def test_the_exports_call_and_a_teacher_without_guidance_embedding(method, tmp_path):
    """The export's call: 2 steps at guidance 1 (the embedding's trained input), no CFG pass, at the training size,
    no sigma_spacing (FluxPipeline's own sigmas are the trailing ones); distill.json's resolution and mu. On
    FLUX.1-schnell's layout the student has no guidance input and the loss runs without one."""
    defaults = method.call_defaults()
    assert defaults == {"default_num_inference_steps": 2, "default_guidance_scale": 1.0, "guidance_distilled": False,
                        "default_sample_size": RESOLUTION}
    assert not method.cfg_pass(defaults) and "guidance embedding's input, trained at 1" in method.guidance_note()
    info = method.export_info()
    assert (info["resolution"], info["latent_size"], info["mu"], info["variant"]) == (RESOLUTION, RESOLUTION, MU, "ect")
    schnell = _method(write_tiny_flux(tmp_path / "schnell", guidance_embeds=False)).eval()
    assert not schnell.student_guidance_embedded and schnell._no_guidance(torch.zeros(2)) == {}
    batch = {"caption": [PROMPT] * 2, "pixel_values": torch.rand(2, 1, RESOLUTION, RESOLUTION) * 2 - 1}
    with torch.no_grad():
        assert torch.isfinite(schnell.loss(batch, torch.Generator().manual_seed(0)))
    assert schnell.call_defaults() == defaults


def test_what_cannot_be_honoured_is_refused_before_compute(flux_dir, method, compose):
    from distill.methods.consistency_training import ConsistencyTraining

    with pytest.raises(ValueError, match=r"method.resolution=None .*use_dynamic_shifting.*set method.resolution="
                                         r"\$\{data.resolution\} \(conf/method/consistency_training.yaml does\)"):
        _method(flux_dir, resolution=None)
    batch = {"caption": [PROMPT] * 2, "pixel_values": torch.rand(2, 1, 32, 32) * 2 - 1}
    with pytest.raises(ValueError, match=r"training latents are \(32, 32\), but the export's sampling grid is built at "
                                         r"mu=0.4810 of method.resolution=24 \(24x24 latents\)"):
        method.loss(batch, torch.Generator().manual_seed(0))
    cfg = compose("+exp=consistency_training_flux", f"data.resolution={RESOLUTION}")
    assert cfg.method.resolution == RESOLUTION and cfg.scheduler.name == "flow_lcm"
    ConsistencyTraining.check_config(cfg)


FAST = ["callbacks.quality_cost=null", "data.batch_size=4", "trainer.max_steps=2", "trainer.log_every_n_steps=1",
        "trainer.limit_val_batches=1", "callbacks.samples.num_seeds=1", "sample_grid_seeds=1", "logger=csv",
        f"data.resolution={RESOLUTION}", "data.num_workers=0"]


def test_two_cli_steps_export_a_pipeline_the_stock_flux_pipeline_samples_alike(flux_dir, tmp_path):
    """+exp=consistency_training_flux on the Flux folder: 2 steps, finite losses; the export (DistillFluxPipeline on
    FlowMatchLCMScheduler, 2 steps at guidance 1, 24 latent pixels) records the resolution and mu;
    from_pretrained(export)(prompt) runs 2 transformer passes of 1 row at the training mu's sigmas, and the stock
    FluxPipeline given the card's arguments in a fresh process without distill gives the same images and sigmas."""
    run_dir, proc = train_flux(tmp_path, "consistency_training_flux", flux_dir, *FAST)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = train_losses(run_dir)
    assert len(losses) == 2 and all(np.isfinite(losses)), losses
    export = run_dir / "export"
    index = json.loads((export / "model_index.json").read_text())
    assert index["_class_name"] == "DistillFluxPipeline" and index["scheduler"] == ["diffusers", "FlowMatchLCMScheduler"]
    assert (index["default_num_inference_steps"], index["default_guidance_scale"], index["guidance_distilled"],
            index["default_sample_size"]) == (2, 1.0, False, RESOLUTION) and "sigma_spacing" not in index
    info = json.loads((export / "distill.json").read_text())
    assert (info["method"], info["variant"], info["resolution"], info["latent_size"], info["mu"]) == \
        ("consistency_training", "ect", RESOLUTION, RESOLUTION, MU)
    assert info["stock"]["call"] == {"max_sequence_length": 512, "height": RESOLUTION, "width": RESOLUTION}
    pipe = DiffusionPipeline.from_pretrained(export)
    pipe.set_progress_bar_config(disable=True)
    torch.manual_seed(0)
    with NFECounter(pipe.transformer) as counter:
        ours = pipe(PROMPT, generator=torch.Generator().manual_seed(0), output_type="pt").images
    assert (counter.calls, counter.examples) == (2, 2) and ours.shape == (1, 1, RESOLUTION, RESOLUTION)
    assert torch.isfinite(ours).all() and ours.std() > 0
    assert torch.equal(pipe.scheduler.sigmas, _flux_sigmas(FlowMatchLCMScheduler(**FLUX_SCHEDULER), 2, MU))
    call = {"num_inference_steps": 2, "guidance_scale": 1.0, **info["stock"]["call"]}
    classes, theirs = stock_flux(tmp_path, export, call, PROMPT)
    assert classes == ["FluxPipeline", "FlowMatchLCMScheduler"]
    assert torch.equal(theirs["sigmas"], pipe.scheduler.sigmas) and torch.equal(ours, theirs["images"])


def test_a_method_resolution_apart_from_the_data_exits_2_before_compute(flux_dir, tmp_path):
    run_dir, proc = train_flux(tmp_path, "consistency_training_flux", flux_dir, *FAST, "method.resolution=32",
                               timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "method.resolution=32 differs from data.resolution=24" in proc.stderr
    assert "leave method.resolution=${data.resolution}" in proc.stderr and not run_dir.exists()
