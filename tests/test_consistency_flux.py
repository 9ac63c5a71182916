"""Consistency distillation on a Flux teacher (the stand-in of tests/flux_tiny.py: FLUX.1-dev's guidance embedding
and resolution shift; FLUX.1-schnell's layout without the embedding): the solver grid against diffusers'
calculate_shift and the sigmas FluxPipeline sets, the consistency target against a hand computation from the
transformer called as FluxPipeline calls it (embedded guidance; true CFG without the embedding), the refusals, and
two training steps through the CLI whose export samples through DiffusionPipeline.from_pretrained and the stock
FluxPipeline with the model card's arguments in a process that does not import distill."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from diffusers import (
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    FlowMatchLCMScheduler,
    FluxPipeline,
)
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

import distill.inference.pipelines  # noqa: F401  (registers distill's export classes, as a user loading an export does)
from distill.families import load_teacher
from distill.metrics.cost import NFECounter
from tests.conftest import run_train
from tests.flux_tiny import FLUX_SCHEDULER, write_tiny_flux

PROMPTS = ["a handwritten digit three", "a handwritten digit seven"]
N, RESOLUTION = 48, 24  # method.num_ddim_timesteps; the training images' side (the stand-in's VAE factor is 1)
SEQ_LEN = (RESOLUTION // 2) ** 2  # FluxPipeline's packed token count of a 24x24 latent: 144


def _method(folder, resolution: int | None = RESOLUTION, num_ddim_timesteps: int = N, steps: int = 4):
    from distill.methods.consistency import LatentConsistencyDistillation
    from distill.students.copies import copy_student

    return LatentConsistencyDistillation(
        load_teacher(str(folder)), copy_student, optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        num_ddim_timesteps=num_ddim_timesteps, resolution=resolution, guidance_scale_min=2.0,
        guidance_scale_max=5.0, sampling={"name": "flow_lcm", "num_inference_steps": steps, "guidance_scale": 3.5})


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory):
    return write_tiny_flux(tmp_path_factory.mktemp("flux") / "pipe")


@pytest.fixture(scope="module")
def schnell_dir(tmp_path_factory):
    return write_tiny_flux(tmp_path_factory.mktemp("schnell") / "pipe", guidance_embeds=False)


def _apart(method):
    """A target apart from the teacher and the student, so that its own call shows."""
    with torch.no_grad():
        for p in method.target.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return method.eval()


@pytest.fixture(scope="module")
def method(flux_dir):
    torch.manual_seed(0)
    return _apart(_method(flux_dir))


@pytest.fixture(scope="module")
def schnell(schnell_dir):
    torch.manual_seed(1)
    return _apart(_method(schnell_dir))


def _transformer(net, x, t, cond, guidance):
    """The transformer call of FluxPipeline.__call__ on unpacked (N, C, H, W) latents, with diffusers' own packing:
    timestep = scheduler.timesteps / 1000, guidance (N,) or None, zero txt_ids, its latent image ids."""
    n, c, h, w = x.shape
    states = cond["encoder_hidden_states"]
    out = net(hidden_states=FluxPipeline._pack_latents(x, n, c, h, w), timestep=(t * 1000) / 1000, guidance=guidance,
              pooled_projections=cond["pooled_projections"], encoder_hidden_states=states,
              txt_ids=torch.zeros(states.shape[1], 3),
              img_ids=FluxPipeline._prepare_latent_image_ids(n, h // 2, w // 2, x.device, x.dtype)).sample
    return FluxPipeline._unpack_latents(out, h, w, 1)


def _inputs(method, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x_t = torch.randn(2, 4, RESOLUTION, RESOLUTION, generator=g)
    cond, uncond = method.text_conditions({"caption": PROMPTS}, 2, "cpu")
    return x_t, cond, uncond


def _flux_sigmas(scheduler, steps: int, mu: float) -> torch.Tensor:
    """The sigmas FluxPipeline.__call__ sets on ``scheduler`` for ``steps`` steps at ``mu``."""
    retrieve_timesteps(scheduler, steps, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    return scheduler.sigmas


def test_the_solver_grid_is_flux_pipelines_sigmas_at_the_training_resolutions_mu(method):
    """mu is diffusers' calculate_shift of the 24x24 latent's 144 packed tokens with the scheduler's base/max shift
    (0.4810, below FLUX.1's 0.5 at 256 tokens); (t_n, t_{n-1}) are consecutive sigmas FlowMatchEulerDiscreteScheduler
    gets from FluxPipeline's set_timesteps(48, sigmas=linspace(1, 1/48, 48), mu=mu), bit for bit; the sigmas
    FlowMatchLCMScheduler gets from the same call at 1, 2, 3, 4, 6, 8 steps lie on that grid, bit for bit; the grid
    of another resolution (32x32: mu 0.5) or of the scheduler's own spacing (no sigmas passed) is another one."""
    config = {k: FLUX_SCHEDULER[k] for k in ("base_image_seq_len", "max_image_seq_len", "base_shift", "max_shift")}
    mu = calculate_shift(SEQ_LEN, *config.values())
    assert method.mu == mu and mu == pytest.approx(0.481041667, abs=1e-9) and method.latent_size == RESOLUTION
    sigmas = _flux_sigmas(FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER), N, mu)
    assert torch.equal(method.solver_timesteps, sigmas[:-1].flip(0))
    assert torch.equal(method.solver_previous, sigmas[1:].flip(0))
    assert method.solver_previous[0].item() == 0.0 and method.solver_timesteps[-1].item() == 1.0
    for steps in (1, 2, 3, 4, 6, 8):
        sampled = _flux_sigmas(FlowMatchLCMScheduler.from_config(method.sampling_scheduler().config), steps, mu)
        assert bool(torch.isin(sampled[:-1], method.solver_timesteps).all()), steps
    other = _flux_sigmas(FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER), N, calculate_shift(256, *config.values()))
    assert (other[1:-1] - sigmas[1:-1]).abs().min() > 1e-4
    own = FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER)
    own.set_timesteps(N, mu=mu)
    assert not torch.isin(own.sigmas[1:-1], method.solver_timesteps).any()
    info = method.export_info()
    assert (info["resolution"], info["latent_size"], info["mu"]) == (RESOLUTION, RESOLUTION, mu)


def test_one_step_consistency_target_with_the_embedded_guidance_against_a_hand_computation(method):
    """FLUX.1-dev's layout: x' = x_t + (t' - t) v_teacher(x_t, t, guidance = 1 + w), the transformer called once
    per row as FluxPipeline calls it (no unconditional pass); f_target = x' - t' v_target(x', t', 1 + w); at t' = 0
    it is x' itself. The guidance input is read: another w gives another target."""
    x_t, cond, uncond = _inputs(method, seed=1)
    bins = torch.tensor([30, 0])
    t, t_prev = method.solver_timesteps[bins], method.solver_previous[bins]
    w = torch.tensor([1.5, 3.0])  # guidance 2.5 and 4.0
    ours = method.consistency_target(x_t, t, t_prev, cond, uncond, w, {"guidance": 1 + w})
    with torch.no_grad():
        v = _transformer(method.teacher_unet, x_t, t, cond, 1 + w)
        x_prev = x_t + (t_prev - t).reshape(-1, 1, 1, 1) * v
        hand = x_prev - t_prev.reshape(-1, 1, 1, 1) * _transformer(method.target, x_prev, t_prev, cond, 1 + w)
    torch.testing.assert_close(ours, hand, rtol=1e-5, atol=1e-6)
    assert torch.equal(hand[1], x_prev[1]) and (ours[0] - x_t[0]).abs().max() > 1e-3
    other = method.consistency_target(x_t, t, t_prev, cond, uncond, w + 2, {"guidance": 3 + w})
    assert (other[0] - ours[0]).abs().max() > 1e-5


def test_the_loss_calls_every_network_at_the_drawn_guidance_and_no_cfg_pass(method, monkeypatch):
    """In loss: the teacher, the student and the target each run once on the batch's 2 rows (no unconditional
    rows), all at the same per-row guidance 1 + w in [2, 5], through the guidance input."""
    calls = []
    denoise = method.family.denoise

    def spy(network, x, t, cond, **extra):
        role = {id(method.teacher_unet): "teacher", id(method.student): "student", id(method.target): "target"}
        calls.append((role[id(network)], x.shape[0], extra["guidance"].clone()))
        return denoise(network, x, t, cond, **extra)

    monkeypatch.setattr(method.family, "denoise", spy)
    batch = {"caption": PROMPTS, "pixel_values": torch.rand(2, 1, RESOLUTION, RESOLUTION) * 2 - 1}
    loss = method.loss(batch, torch.Generator().manual_seed(0))
    assert sorted(c[0] for c in calls) == ["student", "target", "teacher"] and {c[1] for c in calls} == {2}
    guidance = calls[0][2]
    assert all(torch.equal(c[2], guidance) for c in calls) and ((guidance >= 2) & (guidance <= 5)).all()
    assert torch.isfinite(loss) and loss > 0


def test_a_teacher_without_guidance_embedding_is_guided_by_true_cfg_in_velocity_form(schnell):
    """FLUX.1-schnell's layout: the teacher step is FluxPipeline's true CFG at true_cfg_scale = 1 + w against the
    empty prompt, neg + s (cond - neg), in velocity; the student has no guidance input (distilled in), and the
    export's call says so (guidance 1, guidance_distilled, one pass a step)."""
    x_t, cond, uncond = _inputs(schnell, seed=2)
    bins = torch.tensor([20, 0])
    t, t_prev = schnell.solver_timesteps[bins], schnell.solver_previous[bins]
    w = torch.tensor([2.0, 1.0])
    ours = schnell.consistency_target(x_t, t, t_prev, cond, uncond, w, {})
    with torch.no_grad():
        v_c = _transformer(schnell.teacher_unet, x_t, t, cond, None)
        v_neg = _transformer(schnell.teacher_unet, x_t, t, uncond, None)
        v = v_neg + (1 + w).reshape(-1, 1, 1, 1) * (v_c - v_neg)
        x_prev = x_t + (t_prev - t).reshape(-1, 1, 1, 1) * v
        hand = x_prev - t_prev.reshape(-1, 1, 1, 1) * _transformer(schnell.target, x_prev, t_prev, cond, None)
    torch.testing.assert_close(ours, hand, rtol=1e-5, atol=1e-6)
    assert not schnell.teacher_guidance_embedded and not schnell.student_guidance_embedded
    defaults = schnell.call_defaults()
    assert defaults == {"default_num_inference_steps": 4, "default_guidance_scale": 1.0, "guidance_distilled": True,
                        "default_sample_size": RESOLUTION}
    assert not schnell.cfg_pass(defaults) and "classifier-free guidance at scales drawn from [2.0, 5.0]" in \
        schnell.guidance_note()


def test_what_cannot_be_honoured_is_refused_before_compute(flux_dir, method):
    """No resolution; a grid the 4-step sampling sigmas are not on (50 steps); a non-square or odd latent; latents
    of another size than the grid's at the first batch, before any network runs."""
    with pytest.raises(ValueError, match=r"method.resolution=None .*use_dynamic_shifting.*method.resolution=\$\{data"):
        _method(flux_dir, resolution=None)
    with pytest.raises(ValueError, match=r"scheduler.num_inference_steps=4 samples sigmas .* off the method."
                                         r"num_ddim_timesteps=50 grid .*mu=0.4810.*a multiple of 4"):
        _method(flux_dir, num_ddim_timesteps=50)
    with pytest.raises(ValueError, match="FluxPipeline packs 2x2 patches"):
        _method(flux_dir, resolution=25)
    batch = {"caption": PROMPTS, "pixel_values": torch.rand(2, 1, 32, 32) * 2 - 1}
    with pytest.raises(ValueError, match=r"training latents are \(32, 32\), but the solver grid is built at mu=0.4810 "
                                         r"of method.resolution=24 \(24x24 latents\)"):
        method.loss(batch, torch.Generator().manual_seed(0))


def test_a_method_resolution_apart_from_the_data_is_refused_by_the_config(compose):
    from distill.methods.consistency import LatentConsistencyDistillation

    cfg = compose("+exp=consistency_flux", "data.resolution=24")
    assert cfg.method.resolution == 24 and cfg.method.num_ddim_timesteps == N
    LatentConsistencyDistillation.check_config(cfg)
    cfg = compose("+exp=consistency_flux", "data.resolution=24", "method.resolution=32")
    with pytest.raises(ValueError, match=r"method.resolution=32 differs from data.resolution=24"):
        LatentConsistencyDistillation.check_config(cfg)


# the stock pipeline in a process that does not import distill, called with the model card's arguments;
# FlowMatchLCMScheduler re-noises from the global RNG, so it is seeded alike
STOCK_FLUX = """
import json
import sys
import torch
from diffusers import FluxPipeline

call = json.loads(sys.argv[3])
pipe = FluxPipeline.from_pretrained(sys.argv[1])
pipe.set_progress_bar_config(disable=True)
torch.manual_seed(0)
images = pipe(sys.argv[4], **call, generator=torch.Generator().manual_seed(0), output_type="pt").images
torch.save({"images": images, "sigmas": pipe.scheduler.sigmas}, sys.argv[2])
assert not any(name == "distill" or name.startswith("distill.") for name in sys.modules), "distill was imported"
print(type(pipe).__name__, type(pipe.scheduler).__name__)
"""

def stock_flux(tmp_path, export, call: dict, prompt: str, name: str = "x") -> tuple[list[str], dict]:
    """The stock FluxPipeline loading ``export`` and called with ``call`` in a process that does not import distill
    (``STOCK_FLUX``): (its pipeline and scheduler class names, {"images", "sigmas"})."""
    script = tmp_path / "stock.py"
    script.write_text(STOCK_FLUX)
    out = tmp_path / f"{name}.pt"
    proc = subprocess.run([sys.executable, str(script), str(export), str(out), json.dumps(call), prompt], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split(), torch.load(out)


def train_flux(tmp_path, exp: str, flux_dir, *overrides: str, timeout: int = 600):
    """``python -m distill.train +exp=<exp>`` on the Flux folder, one thread, run directory tmp_path/run: (the run
    directory, the CompletedProcess)."""
    run_dir = tmp_path / "run"
    return run_dir, run_train(f"+exp={exp}", f"teacher.pretrained_model_name_or_path={flux_dir}", *overrides,
                              f"hydra.run.dir={run_dir}", env={"OMP_NUM_THREADS": "1"}, timeout=timeout)


def train_losses(run_dir) -> list[float]:
    """The logged train/loss values of a run (its CSV logger's)."""
    return [float(r["train/loss"]) for r in csv.DictReader(open(run_dir / "csv" / "metrics.csv")) if r.get("train/loss")]


FAST = ["callbacks.quality_cost=null", "data.batch_size=4", "trainer.max_steps=2", "trainer.log_every_n_steps=1",
        "trainer.limit_val_batches=1", "callbacks.samples.num_seeds=1", "sample_grid_seeds=1", "logger=csv",
        f"data.resolution={RESOLUTION}", "data.num_workers=0"]


def test_two_cli_steps_on_the_flux_teacher_export_a_pipeline_the_stock_class_samples_alike(flux_dir, tmp_path):
    """+exp=consistency_flux on the Flux folder: 2 steps, finite losses; the export (DistillFluxPipeline on
    FlowMatchLCMScheduler, 4 steps, guidance 3.5 through the embedding, 24 latent pixels) records the resolution and
    mu; DiffusionPipeline.from_pretrained(export)(prompt) samples 24x24 images with 4 transformer passes of 1 row,
    on sigmas of the training grid; the stock FluxPipeline, given the card's arguments in a fresh process that does
    not import distill, gives the same images and sigmas bit for bit."""
    run_dir, proc = train_flux(tmp_path, "consistency_flux", flux_dir, *FAST)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = train_losses(run_dir)
    assert len(losses) == 2 and all(0 < loss < 100 for loss in losses), losses
    export = run_dir / "export"
    index = json.loads((export / "model_index.json").read_text())
    assert index["_class_name"] == "DistillFluxPipeline" and index["scheduler"] == ["diffusers", "FlowMatchLCMScheduler"]
    assert (index["default_num_inference_steps"], index["default_guidance_scale"], index["guidance_distilled"],
            index["default_sample_size"]) == (4, 3.5, False, RESOLUTION)
    info = json.loads((export / "distill.json").read_text())
    mu = calculate_shift(SEQ_LEN, 256, 4096, 0.5, 1.15)
    assert (info["method"], info["resolution"], info["latent_size"], info["mu"]) == ("consistency", RESOLUTION,
                                                                                     RESOLUTION, mu)
    assert info["sampling"]["nfe_per_step"] == 1 and "guidance embedding" in info["guidance"]
    assert info["stock"]["call"] == {"max_sequence_length": 512, "height": RESOLUTION, "width": RESOLUTION}
    card = (export / "README.md").read_text()
    assert f"num_inference_steps=4, guidance_scale=3.5, max_sequence_length=512, height={RESOLUTION}" in card
    pipe = DiffusionPipeline.from_pretrained(export)
    pipe.set_progress_bar_config(disable=True)
    torch.manual_seed(0)
    with NFECounter(pipe.transformer) as counter:
        ours = pipe(PROMPTS[0], generator=torch.Generator().manual_seed(0), output_type="pt").images
    assert (counter.calls, counter.examples) == (4, 4) and ours.shape == (1, 1, RESOLUTION, RESOLUTION)
    assert torch.isfinite(ours).all() and ours.std() > 0
    grid = _flux_sigmas(FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER), N, mu)
    assert bool(torch.isin(pipe.scheduler.sigmas, grid).all())
    call = {"num_inference_steps": 4, "guidance_scale": 3.5, **info["stock"]["call"]}
    classes, theirs = stock_flux(tmp_path, export, call, PROMPTS[0])
    assert classes == ["FluxPipeline", "FlowMatchLCMScheduler"]
    assert torch.equal(theirs["sigmas"], pipe.scheduler.sigmas) and torch.equal(ours, theirs["images"])


def test_a_grid_off_the_sampled_sigmas_exits_2_before_compute(flux_dir, tmp_path):
    """method.num_ddim_timesteps=50: the 4-step sigmas are off that grid; refused with exit 2, naming both values
    and the fix, before any step (no run directory left, no export)."""
    run_dir, proc = train_flux(tmp_path, "consistency_flux", flux_dir, *FAST, "method.num_ddim_timesteps=50",
                               timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "scheduler.num_inference_steps=4 samples sigmas" in proc.stderr
    assert "off the method.num_ddim_timesteps=50 grid" in proc.stderr and not (run_dir / "export").exists()
    assert "train/loss" not in proc.stderr and not run_dir.exists()
