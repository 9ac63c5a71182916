"""Progressive distillation on a Flux teacher (the stand-in of tests/flux_tiny.py: FLUX.1-dev's guidance embedding
and resolution shift; FLUX.1-schnell's layout without the embedding): each round's grids against the sigmas
FluxPipeline sets (diffusers' calculate_shift and set_timesteps(sigmas, mu)), the teacher grid nesting the student's
bit for bit, the target against two Euler steps by hand from the transformer called as FluxPipeline calls it
(embedded guidance; true CFG without the embedding), the guidance each network gets, the refusals, and two rounds
through the CLI whose exports sample through DiffusionPipeline.from_pretrained and the stock FluxPipeline with the
model card's arguments in a process that does not import distill."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler
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

PROMPTS = ["a handwritten digit three", "a handwritten digit seven"]
RESOLUTION, GUIDANCE = 24, 3.5  # the training images' side (the stand-in's VAE factor is 1); FluxPipeline's guidance
MU = calculate_shift((RESOLUTION // 2) ** 2, 256, 4096, 0.5, 1.15)  # 144 packed tokens: 0.4810
B = (-1, 1, 1, 1)


def _method(folder, **options):
    from distill.methods.progressive import ProgressiveDistillation
    from distill.students.copies import copy_student

    return ProgressiveDistillation(load_teacher(str(folder)), copy_student,
                                   optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                                   **{"start_steps": 8, "final_steps": 2, "guidance_scale": GUIDANCE,
                                      "resolution": RESOLUTION, **options})


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory):
    return write_tiny_flux(tmp_path_factory.mktemp("flux") / "pipe")


@pytest.fixture(scope="module")
def schnell_dir(tmp_path_factory):
    return write_tiny_flux(tmp_path_factory.mktemp("schnell") / "pipe", guidance_embeds=False)


@pytest.fixture(scope="module")
def method(flux_dir):
    return _method(flux_dir).eval()


def _inputs(method, steps: int = 4):
    """The round of ``steps`` student steps; x0, eps (2, 4, 24, 24) and the captions' conditions."""
    method.round_index = method.rounds.index(steps)
    g = torch.Generator().manual_seed(0)
    x0, eps = (torch.randn(2, 4, RESOLUTION, RESOLUTION, generator=g) for _ in range(2))
    cond, uncond = method.text_conditions({"caption": PROMPTS}, 2, "cpu")
    return x0, eps, cond, uncond


def test_each_rounds_grid_is_flux_pipelines_sigmas_at_the_training_mu_and_nests_in_the_teachers(method):
    """mu is calculate_shift of the 24x24 latent's 144 packed tokens; the N-step student grid t_N..t_1, 0 is what
    FlowMatchEulerDiscreteScheduler gets from FluxPipeline's set_timesteps(N, sigmas=linspace(1, 1/N, N), mu) bit
    for bit, for every round's N and its teacher's 2N; the 2N-step grid's even points are the N-step grid bit for
    bit; another resolution's mu gives other points."""
    assert method.mu == MU and method.latent_size == RESOLUTION and method.rounds == [4, 2]
    for n in (1, 2, 3, 4, 8, 16, 32, 64):
        ours = method._times(torch.arange(n, -1, -1), n)
        assert torch.equal(ours, _flux_sigmas(FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER), n, MU)), n
        assert ours[0].item() == 1.0 and ours[-1].item() == 0.0
        assert torch.equal(method._times(2 * torch.arange(n + 1), 2 * n), method._times(torch.arange(n + 1), n)), n
    other = _flux_sigmas(FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER), 4, calculate_shift(256, 256, 4096, 0.5, 1.15))
    assert (other[1:-1] - method._times(torch.arange(3, 0, -1), 4)).abs().min() > 1e-3
    info = method.export_info()
    assert (info["resolution"], info["latent_size"], info["mu"]) == (RESOLUTION, RESOLUTION, MU)


def _by_hand_grid(k: torch.Tensor, n: int) -> torch.Tensor:
    """Point k of the n-step grid: u = k / n shifted by Flux's exponential time shift, e^mu / (e^mu + 1 / u - 1)."""
    u = k.double() / n
    return torch.where(u > 0, math.exp(MU) / (math.exp(MU) + 1 / u - 1), torch.zeros_like(u)).float()


def test_the_target_is_two_euler_steps_of_the_teacher_at_its_embedded_guidance_by_hand(method):
    """Round 0 (student 4 steps, teacher 8), FLUX.1-dev's layout: at student point i the student's velocity target
    is (x_end - x_t) / (t_end - t), x_end two Euler steps of the teacher called once per row at guidance 3.5 through
    its embedding, as FluxPipeline calls it (no CFG pass); the grid points by hand. Another guidance gives another
    target."""
    x0, eps, cond, uncond = _inputs(method)
    i = torch.tensor([4, 2])  # the first student step (from pure noise) and one in the middle
    scale = torch.full((2,), GUIDANCE)
    with torch.no_grad():
        x_t, t, target = method.student_target(x0, eps, i, cond, uncond, scale, {"guidance": scale})
        t_h, t_mid, t_end = (_by_hand_grid(k, 8) for k in (2 * i, 2 * i - 1, 2 * i - 2))
        torch.testing.assert_close(t, t_h, rtol=0, atol=1e-6)
        t_h, t_mid, t_end = t, method._times(2 * i - 1, 8), method._times(2 * i - 2, 8)  # the float32 grid itself
        x = (1 - t_h.view(B)) * x0 + t_h.view(B) * eps
        torch.testing.assert_close(x_t, x, rtol=1e-6, atol=1e-6)
        x_mid = x + (t_mid - t_h).view(B) * _transformer(method.teacher_unet, x, t_h, cond, scale)
        x_end = x_mid + (t_end - t_mid).view(B) * _transformer(method.teacher_unet, x_mid, t_mid, cond, scale)
        expected = (x_end - x) / (t_end - t_h).view(B)
        torch.testing.assert_close(target, expected, rtol=1e-4, atol=1e-5)
        assert (target - (eps - x0)).abs().mean() > 1e-3  # the teacher's path, not the data's own velocity
        other = method.student_target(x0, eps, i, cond, uncond, scale + 2, {"guidance": scale + 2})[2]
    assert (other - target).abs().max() > 1e-5


def test_every_network_takes_the_guidance_through_its_embedding_in_every_round(flux_dir, monkeypatch):
    """In loss, round 0: the teacher runs twice (two Euler steps) and the student once, each on the batch's 2 rows
    (no unconditional rows) at guidance 3.5; round 1 (the teacher now the round-0 student): the same, at 3.5 still.
    The export's call: guidance 3.5 through the embedding, no CFG pass, at the training size."""
    method = _method(flux_dir).eval()
    calls = []
    denoise = method.family.denoise

    def spy(network, x, t, cond, **extra):
        role = "teacher" if network is method.teacher_unet else "student" if network is method.student else "?"
        calls.append((role, x.shape[0], extra["guidance"].tolist()))
        return denoise(network, x, t, cond, **extra)

    monkeypatch.setattr(method.family, "denoise", spy)
    batch = {"caption": PROMPTS, "pixel_values": torch.rand(2, 1, RESOLUTION, RESOLUTION) * 2 - 1}
    for round_index in (0, 1):
        if round_index == 1:
            method.finish_round()  # the student becomes the teacher
        calls.clear()
        assert torch.isfinite(method.loss(batch, torch.Generator().manual_seed(0)))
        assert calls == [("teacher", 2, [GUIDANCE] * 2)] * 2 + [("student", 2, [GUIDANCE] * 2)], round_index
    defaults = method.call_defaults()
    assert defaults == {"default_num_inference_steps": 2, "default_guidance_scale": GUIDANCE,
                        "guidance_distilled": False, "default_sample_size": RESOLUTION}
    assert not method.cfg_pass(defaults) and "guidance embedding" in method.guidance_note()
    assert "embedded guidance (its guidance input) at scale 3.5" in method.guidance_source()


def test_a_teacher_without_guidance_embedding_is_guided_by_true_cfg_in_velocity_form(schnell_dir):
    """FLUX.1-schnell's layout: each teacher Euler step is FluxPipeline's true CFG at true_cfg_scale 3.5 against
    the empty prompt, neg + s (cond - neg), in velocity; the student has no guidance input (distilled in): the
    export's call is guidance 1, guidance-distilled, one pass a step."""
    method = _method(schnell_dir).eval()
    x0, eps, cond, uncond = _inputs(method)
    i = torch.tensor([3, 1])
    scale = torch.full((2,), GUIDANCE)
    with torch.no_grad():
        x_t, t, target = method.student_target(x0, eps, i, cond, uncond, scale, {})
        t_mid, t_end = method._times(2 * i - 1, 8), method._times(2 * i - 2, 8)

        def guided(x, s):
            v_c, v_neg = (_transformer(method.teacher_unet, x, s, c, None) for c in (cond, uncond))
            return v_neg + GUIDANCE * (v_c - v_neg)

        x_mid = x_t + (t_mid - t).view(B) * guided(x_t, t)
        x_end = x_mid + (t_end - t_mid).view(B) * guided(x_mid, t_mid)
    torch.testing.assert_close(target, (x_end - x_t) / (t_end - t).view(B), rtol=1e-4, atol=1e-5)
    assert not method.teacher_guidance_embedded and not method.student_guidance_embedded
    defaults = method.call_defaults()
    assert defaults == {"default_num_inference_steps": 4, "default_guidance_scale": 1.0, "guidance_distilled": True,
                        "default_sample_size": RESOLUTION}
    assert not method.cfg_pass(defaults)


def test_what_cannot_be_honoured_is_refused_before_compute(flux_dir, method, compose):
    """No resolution; an odd latent; latents of another size at the first batch, before any network runs; a
    method.resolution apart from data.resolution at config validation."""
    from distill.methods.progressive import ProgressiveDistillation

    with pytest.raises(ValueError, match=r"method.resolution=None .*use_dynamic_shifting.*set method.resolution="
                                         r"\$\{data.resolution\} \(conf/method/progressive.yaml does\)"):
        _method(flux_dir, resolution=None)
    with pytest.raises(ValueError, match="FluxPipeline packs 2x2 patches"):
        _method(flux_dir, resolution=25)
    batch = {"caption": PROMPTS, "pixel_values": torch.rand(2, 1, 32, 32) * 2 - 1}
    with pytest.raises(ValueError, match=r"training latents are \(32, 32\), but the student grid is built at mu="
                                         r"0.4810 of method.resolution=24 \(24x24 latents\)"):
        method.loss(batch, torch.Generator().manual_seed(0))
    cfg = compose("+exp=progressive_flux", f"data.resolution={RESOLUTION}")
    assert cfg.method.resolution == RESOLUTION and cfg.method.guidance_scale == GUIDANCE
    ProgressiveDistillation.check_config(cfg)
    with pytest.raises(ValueError, match=r"method.resolution=32 differs from data.resolution=24"):
        ProgressiveDistillation.check_config(compose("+exp=progressive_flux", "data.resolution=24",
                                                     "method.resolution=32"))


FAST = ["callbacks.quality_cost=null", "data.batch_size=4", "method.start_steps=8", "method.final_steps=2",
        "method.steps_per_round=1", "trainer.max_steps=2", "trainer.log_every_n_steps=1",
        "trainer.limit_val_batches=1", "trainer.val_check_interval=2", "checkpoint.every_n_train_steps=1",
        "sample_grid_seeds=1", "logger=csv", f"data.resolution={RESOLUTION}", "data.num_workers=0"]


def test_two_cli_rounds_export_students_that_the_stock_flux_pipeline_samples_alike(flux_dir, tmp_path):
    """+exp=progressive_flux on the Flux folder, 8 -> 4 -> 2 steps, one step a round (round 1's teacher the round-0
    velocity student): finite losses; each round exports a DistillFluxPipeline on FlowMatchEulerDiscreteScheduler
    whose default call is its steps at guidance 3.5 and 24 latent pixels (no sigma_spacing: FluxPipeline's own
    sigmas are the grid); from_pretrained samples it with one transformer pass of 1 row a step on that round's grid,
    and the stock FluxPipeline given the card's arguments in a fresh process that does not import distill gives the
    same images and sigmas bit for bit."""
    run_dir, proc = train_flux(tmp_path, "progressive_flux", flux_dir, *FAST)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = train_losses(run_dir)
    assert len(losses) == 2 and all(np.isfinite(losses)), losses
    assert sorted(p.name for p in (run_dir / "rounds").iterdir()) == ["002-steps", "004-steps"]
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    assert state["progressive"] == {"round_index": 1, "guidance_scale": 1.0, "teacher_prediction_type": "flow_prediction"}
    for steps in (4, 2):
        export = run_dir / "rounds" / f"{steps:03d}-steps"
        index = json.loads((export / "model_index.json").read_text())
        assert index["_class_name"] == "DistillFluxPipeline"
        assert index["scheduler"] == ["diffusers", "FlowMatchEulerDiscreteScheduler"] and "sigma_spacing" not in index
        assert (index["default_num_inference_steps"], index["default_guidance_scale"], index["guidance_distilled"],
                index["default_sample_size"]) == (steps, GUIDANCE, False, RESOLUTION)
        info = json.loads((export / "distill.json").read_text())
        assert (info["method"], info["resolution"], info["latent_size"], info["mu"]) == ("progressive", RESOLUTION,
                                                                                         RESOLUTION, MU)
        assert info["stock"]["call"] == {"max_sequence_length": 512, "height": RESOLUTION, "width": RESOLUTION}
        assert "guidance embedding" in info["guidance"] and info["sampling"]["nfe_per_step"] == 1
        pipe = DiffusionPipeline.from_pretrained(export)
        pipe.set_progress_bar_config(disable=True)
        with NFECounter(pipe.transformer) as counter:
            ours = pipe(PROMPTS[0], generator=torch.Generator().manual_seed(0), output_type="pt").images
        assert (counter.calls, counter.examples) == (steps, steps) and ours.shape == (1, 1, RESOLUTION, RESOLUTION)
        assert torch.isfinite(ours).all() and ours.std() > 0
        assert torch.equal(pipe.scheduler.sigmas, _flux_sigmas(FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER),
                                                               steps, MU))
        call = {"num_inference_steps": steps, "guidance_scale": GUIDANCE, **info["stock"]["call"]}
        classes, theirs = stock_flux(tmp_path, export, call, PROMPTS[0], name=f"x{steps}")
        assert classes == ["FluxPipeline", "FlowMatchEulerDiscreteScheduler"]
        assert torch.equal(theirs["sigmas"], pipe.scheduler.sigmas) and torch.equal(ours, theirs["images"])
    assert (run_dir / "export" / "model_index.json").read_text() == (run_dir / "rounds" / "002-steps" /
                                                                     "model_index.json").read_text()


def test_an_odd_latent_size_exits_2_before_compute(flux_dir, tmp_path):
    """data.resolution=25 (a 25x25 latent, which FluxPipeline cannot sample by default): exit 2 naming the size and
    the fix, before any step (no run directory left)."""
    run_dir, proc = train_flux(tmp_path, "progressive_flux", flux_dir,
                               *[o for o in FAST if not o.startswith("data.resolution")], "data.resolution=25",
                               timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "a 25x25 latent: FluxPipeline packs 2x2 patches" in proc.stderr and "train at a resolution of an even" \
        in proc.stderr
    assert "train/loss" not in proc.stderr and not run_dir.exists()
