"""The Flux family (distill.families.flux) against FluxPipeline on a tiny random-weight stand-in (tests/flux_tiny.py:
double- and single-stream blocks, FLUX.1-dev's guidance embedding, a CLIPTextModel and a T5EncoderModel with a
locally built T5 tokenizer, a VAE with FLUX.1's shift_factor, the resolution-dependent shift): detection and
loading, conditioning bit for bit as encode_prompt, denoise as the transformer call the pipeline makes, a loop
through the family equal to FluxPipeline.__call__'s latents and images, the export through
DiffusionPipeline.from_pretrained and through the stock class in a process that does not import distill,
distill.evaluate and distill.sample end to end, and the refusals (a Flux folder without its T5, a training method
other than consistency distillation, progressive distillation, ECT and feature distillation on a Flux teacher:
tests/test_consistency_flux.py, tests/test_progressive_flux.py, tests/test_consistency_training_flux.py and
tests/test_feature_distillation_flux.py train it)."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from diffusers import DiffusionPipeline, FluxPipeline
from diffusers.utils.torch_utils import randn_tensor

from distill.diffusion import FlowMatchingSchedule
from distill.diffusion.flow import euler_step, resolution_shift_mu
from distill.diffusion.packing import latent_image_ids, pack_latents
from distill.families import FAMILIES, denoiser_of, family_of, load_teacher, native_size
from distill.families.base import check_method_serves, detect_family
from distill.families.flux import (
    FLUX_GUIDANCE_SCALE,
    FLUX_MAX_SEQUENCE_LENGTH,
    DistillFluxPipeline,
    FluxConditioner,
    FluxFamily,
)
from distill.inference.loading import load_pipeline
from distill.metrics.cost import NFECounter
from distill.models.teacher import pipeline_configs
from tests.conftest import ROOT, hub_from_folder, run_cli, run_train
from tests.flux_tiny import (
    CLIP_DIM,
    FLUX_SCALING_FACTOR,
    FLUX_SHIFT_FACTOR,
    T5_DIM,
    write_tiny_flux,
)

PROMPTS = ["a handwritten digit three", "a handwritten digit seven"]
T5_TOKENS = 8  # max_sequence_length of the calls here (FluxPipeline's default 512 is checked once)


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory):
    return write_tiny_flux(tmp_path_factory.mktemp("flux") / "pipe")


@pytest.fixture(scope="module")
def pipe(flux_dir):
    pipe = FluxPipeline.from_pretrained(flux_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def teacher(flux_dir):
    return load_teacher(str(flux_dir))


def _family(teacher, max_sequence_length: int = T5_TOKENS) -> FluxFamily:
    c = teacher.family.conditioner
    conditioner = FluxConditioner(c.text_encoder, c.tokenizer, c.text_encoder_2, c.tokenizer_2, max_sequence_length)
    return FluxFamily(teacher.scheduler, teacher.vae, conditioner)


def test_detect_and_load_give_the_flux_family_on_its_resolution_shifted_schedule(flux_dir, teacher, pipe):
    configs = pipeline_configs(flux_dir)
    assert configs["transformer"]["_class_name"] == "FluxTransformer2DModel" and configs["unet"] == {}
    assert FAMILIES.get("flux") is FluxFamily and detect_family(flux_dir, configs) is FluxFamily
    family = teacher.family
    assert type(family) is FluxFamily and type(teacher.denoiser).__name__ == "FluxTransformer2DModel"
    assert isinstance(family.schedule, FlowMatchingSchedule) and family.schedule.use_dynamic_shifting
    assert family.prediction_type == "flow_prediction"
    assert family.schedule.mu(4096) == pytest.approx(1.15) and family.schedule.mu(256) == pytest.approx(0.5)
    c = family.conditioner
    assert type(c.tokenizer_2).__name__ == "T5Tokenizer" and c.max_sequence_length == FLUX_MAX_SEQUENCE_LENGTH == 512
    assert not any(p.requires_grad for p in teacher.denoiser.parameters())
    assert family_of(pipe) is FluxFamily and denoiser_of(pipe) is pipe.transformer
    assert native_size(pipe) == 128 * 1 == 128  # FluxPipeline's default_sample_size 128, the stand-in VAE's factor 1
    assert list(family.feature_blocks(teacher.denoiser)) == ["transformer_blocks.0", "single_transformer_blocks.0"]
    copy = family.copy(cache_prompts=False)
    assert copy.conditioner is not c and copy.conditioner.text_encoder_2 is c.text_encoder_2
    assert not copy.conditioner.cache_enabled and copy.conditioner.max_sequence_length == 512


@pytest.mark.parametrize("max_sequence_length", [T5_TOKENS, FLUX_MAX_SEQUENCE_LENGTH])
def test_conditioning_equals_encode_prompt_bit_for_bit(teacher, pipe, max_sequence_length):
    """encoder_hidden_states: T5's states over max_sequence_length tokens; pooled_projections: CLIP's pooled output;
    the null condition is "" as encode_prompt encodes it; cached per prompt."""
    family = _family(teacher, max_sequence_length)
    with torch.no_grad():
        embeds, pooled, text_ids = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=max_sequence_length)
        empty, empty_pooled, _ = pipe.encode_prompt([""], device="cpu", max_sequence_length=max_sequence_length)
    cond = family.condition({"caption": PROMPTS})
    assert torch.equal(cond["encoder_hidden_states"], embeds) and torch.equal(cond["pooled_projections"], pooled)
    assert embeds.shape == (2, max_sequence_length, T5_DIM) and pooled.shape == (2, CLIP_DIM)
    assert text_ids.shape == (max_sequence_length, 3) and not text_ids.any()  # what denoise builds itself
    assert embeds.abs().mean() > 0.1 and not torch.equal(embeds[0], embeds[1])
    null = family.null_condition(2)
    assert torch.equal(null["encoder_hidden_states"], empty.expand(2, -1, -1))
    assert torch.equal(null["pooled_projections"], empty_pooled.expand(2, -1))
    dropped = family.condition({"caption": PROMPTS}, drop=torch.tensor([True, False]))
    assert torch.equal(dropped["encoder_hidden_states"][0], empty[0]) and torch.equal(dropped["pooled_projections"][1], pooled[1])
    assert family.conditioner.encoder_calls == 3  # two prompts and "", each encoded once (cached)
    assert family.pipeline_call_inputs(cond, null).keys() == {"prompt_embeds", "pooled_prompt_embeds",
                                                              "negative_prompt_embeds", "negative_pooled_prompt_embeds"}
    with pytest.raises(ValueError, match="max_sequence_length=0 must be >= 1"):
        _family(teacher, 0)


def test_denoise_is_the_transformer_call_the_pipeline_makes(teacher):
    """denoise(transformer, x, t, cond, guidance=g) on unpacked (N, C, H, W) latents equals the transformer called as
    FluxPipeline calls it (packed latents, img_ids, zero txt_ids, timestep = scheduler.timesteps[i] / 1000, guidance
    g over the batch), unpacked, bit for bit; the default guidance is FluxPipeline's 3.5; per-example t too."""
    family = _family(teacher)
    sigmas, timesteps = family.inference_sigmas(4, 8, 12)
    x = torch.randn(2, 4, 8, 12, generator=torch.Generator().manual_seed(0))
    cond = family.condition({"caption": PROMPTS})
    net = teacher.denoiser

    def theirs(i, guidance):
        out = net(hidden_states=pack_latents(x), timestep=timesteps[i].expand(2) / 1000,
                  guidance=torch.full([1], guidance).expand(2), pooled_projections=cond["pooled_projections"],
                  encoder_hidden_states=cond["encoder_hidden_states"], txt_ids=torch.zeros(T5_TOKENS, 3),
                  img_ids=latent_image_ids(8, 12), return_dict=False)[0]
        return out

    with torch.no_grad():
        for i in range(4):
            ours = family.denoise(net, x, sigmas[i], cond, guidance=5.0)
            assert torch.equal(pack_latents(ours), theirs(i, 5.0)), i
        assert torch.equal(pack_latents(family.denoise(net, x, sigmas[0], cond)), theirs(0, FLUX_GUIDANCE_SCALE))
        at_1, at_5 = (family.denoise(net, x, sigmas[0], cond, guidance=g) for g in (1.0, 5.0))
        assert (at_1 - at_5).abs().max() > 1e-4  # the guidance input is read
        both = family.denoise(net, x, sigmas[:2], cond, guidance=torch.tensor([5.0, 5.0]))
        assert torch.equal(pack_latents(both)[1], theirs(1, 5.0)[1])
    assert ours.shape == x.shape and float(ours.abs().mean()) > 0.01
    x0, t0, c0 = family.example_inputs(net, n=1)
    with torch.no_grad():
        assert family.denoise(net, x0, t0, c0).shape == (1, 4, 128, 128)


def _family_loop(family, net, cond: dict, steps: int, height: int, width: int, guidance: float, generator):
    """FluxPipeline.__call__'s loop through the family: the pipeline's noise (drawn unpacked, then packed there), the
    resolution-shifted sigmas, denoise and an Euler step per sigma, decode."""
    n = len(cond["pooled_projections"])
    x = randn_tensor((n, net.config.in_channels // 4, height, width), generator=generator, dtype=torch.float32)
    sigmas, _ = family.inference_sigmas(steps, height, width)
    with NFECounter(net) as counter:
        for i in range(steps):
            x = euler_step(family.denoise(net, x, sigmas[i], cond, guidance=guidance), x, sigmas[i], sigmas[i + 1])
    return x, family.decode(x), counter


@pytest.mark.parametrize(("height", "width", "guidance"), [(32, 32, 4.0), (48, 32, FLUX_GUIDANCE_SCALE)])
def test_a_loop_through_the_family_reproduces_the_pipelines_latents_and_images(teacher, pipe, height, width, guidance):
    """3 steps at 32x32 (256 packed tokens: mu = 0.5) and 48x32 (384 tokens): the family's loop gives
    FluxPipeline.__call__'s latents (output_type="latent", packed) and images bit for bit, in 3 transformer calls."""
    family = _family(teacher)
    cond = family.condition({"caption": PROMPTS})
    call = dict(num_inference_steps=3, height=height, width=width, guidance_scale=guidance, max_sequence_length=T5_TOKENS)
    with torch.no_grad():
        latents = pipe(PROMPTS, generator=torch.Generator().manual_seed(0), output_type="latent", **call).images
        images = pipe(PROMPTS, generator=torch.Generator().manual_seed(0), output_type="pt", **call).images
        x, decoded, counter = _family_loop(family, teacher.denoiser, cond, 3, height, width, guidance,
                                           torch.Generator().manual_seed(0))
    assert (counter.calls, counter.examples) == (3, 6)
    assert latents.shape == (2, height * width // 4, 16) and torch.equal(pack_latents(x), latents)
    assert torch.equal(pipe.image_processor.postprocess(decoded, output_type="pt"), images)
    assert images.shape == (2, 1, height, width) and images.std() > 0.01
    assert family.schedule.mu(height * width // 4) == resolution_shift_mu(height * width // 4)


def test_a_transformer_without_guidance_embedding_ignores_guidance(tmp_path):
    """FLUX.1-schnell's layout (guidance_embeds=False): denoise passes no guidance, as FluxPipeline, whatever the
    value; its loop still equals the pipeline's images."""
    folder = write_tiny_flux(tmp_path / "schnell", guidance_embeds=False)
    teacher = load_teacher(str(folder))
    pipe = FluxPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    family = _family(teacher)
    cond = family.condition({"caption": PROMPTS[:1]})
    with torch.no_grad():
        images = pipe(PROMPTS[:1], num_inference_steps=2, height=32, width=32, max_sequence_length=T5_TOKENS,
                      generator=torch.Generator().manual_seed(1), output_type="pt").images
        _, decoded, _ = _family_loop(family, teacher.denoiser, cond, 2, 32, 32, 9.0, torch.Generator().manual_seed(1))
        x = torch.randn(1, 4, 8, 8)
        assert torch.equal(family.denoise(teacher.denoiser, x, 0.5, cond, guidance=1.0),
                           family.denoise(teacher.denoiser, x, 0.5, cond, guidance=9.0))
    assert torch.equal(pipe.image_processor.postprocess(decoded, output_type="pt"), images)


def test_latents_follow_the_pipelines_decode_path_with_shift_factor(teacher, pipe):
    """decode(latents) = vae.decode(latents / scaling_factor + shift_factor), as FluxPipeline decodes after unpacking;
    scale_latents is its inverse on a posterior sample."""
    family = teacher.family
    sf, shift = pipe.vae.config.scaling_factor, pipe.vae.config.shift_factor
    assert (sf, shift) == (FLUX_SCALING_FACTOR, FLUX_SHIFT_FACTOR) == (0.3611, 0.1159)
    latents = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(family.decode(latents), pipe.vae.decode(latents / sf + shift).sample)
    assert torch.allclose(family.scale_latents(latents / sf + shift), latents, atol=1e-5)
    images = torch.rand(2, 1, 16, 16, generator=torch.Generator().manual_seed(2)) * 2 - 1
    assert family.encode(images, torch.Generator().manual_seed(0)).shape == (2, 4, 16, 16)  # the VAE's factor 1


# The stock class in a process that does not import distill, with the export's call arguments
STOCK_FLUX = """
import sys
import torch
from diffusers import FluxPipeline

pipe = FluxPipeline.from_pretrained(sys.argv[1])
pipe.set_progress_bar_config(disable=True)
images = pipe(sys.argv[3], num_inference_steps=2, guidance_scale=5.0, max_sequence_length=8, height=32, width=32,
              generator=torch.Generator().manual_seed(0), output_type="pt").images
torch.save(images, sys.argv[2])
assert not any(name == "distill" or name.startswith("distill.") for name in sys.modules), "distill was imported"
print(type(pipe).__name__, type(pipe.scheduler).__name__)
"""


def test_export_samples_as_the_stock_flux_pipeline_in_a_fresh_process(teacher, tmp_path):
    """family.pipeline(...) saved -> model_index.json names DistillFluxPipeline with its call defaults (2 steps,
    guidance 5, 8 T5 tokens, 32 latent pixels: 32 px through the factor-1 VAE); DiffusionPipeline.from_pretrained(export)(prompt) samples
    with 2 transformer passes of 1 example; the stock FluxPipeline, given those arguments in a process that does not
    import distill, gives the same images bit for bit."""
    family = teacher.family
    export = family.pipeline(teacher.denoiser, family.default_scheduler(), default_num_inference_steps=2,
                             default_guidance_scale=5.0, default_max_sequence_length=8, default_sample_size=32)
    export.save_pretrained(tmp_path / "export")
    index = json.loads((tmp_path / "export" / "model_index.json").read_text())
    assert index["_class_name"] == "DistillFluxPipeline" and index["text_encoder_2"] == ["transformers", "T5EncoderModel"]
    assert (index["default_num_inference_steps"], index["default_guidance_scale"], index["default_max_sequence_length"],
            index["default_sample_size"]) == (2, 5.0, 8, 32)
    loaded = DiffusionPipeline.from_pretrained(tmp_path / "export")
    assert type(loaded) is DistillFluxPipeline and native_size(loaded) == 32 and family_of(loaded) is FluxFamily
    loaded.set_progress_bar_config(disable=True)
    with NFECounter(loaded.transformer) as counter:
        ours = loaded(PROMPTS[0], generator=torch.Generator().manual_seed(0), output_type="pt").images
    assert (counter.calls, counter.examples) == (2, 2) and ours.shape == (1, 1, 32, 32)
    (tmp_path / "stock.py").write_text(STOCK_FLUX)
    proc = subprocess.run([sys.executable, str(tmp_path / "stock.py"), str(tmp_path / "export"), str(tmp_path / "x.pt"),
                           PROMPTS[0]], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["FluxPipeline", "FlowMatchEulerDiscreteScheduler"]
    theirs = torch.load(tmp_path / "x.pt")
    assert torch.equal(ours, theirs) and ours.std() > 0.01


def _without_t5(flux_dir, tmp_path):
    folder = tmp_path / "no_t5"
    shutil.copytree(flux_dir, folder)
    shutil.rmtree(folder / "text_encoder_2")
    shutil.rmtree(folder / "tokenizer_2")
    return folder


def test_a_flux_folder_without_t5_is_refused_before_any_weights(flux_dir, tmp_path, monkeypatch):
    """load_teacher and load_pipeline (distill.evaluate, distill.sample) name text_encoder_2/ and tokenizer_2/, T5,
    and what to do, without calling from_pretrained; a model_index.json that records T5 as absent too."""
    folder = _without_t5(flux_dir, tmp_path)
    monkeypatch.setattr(FluxPipeline, "from_pretrained",
                        classmethod(lambda *a, **k: pytest.fail("weights loaded before the component check")))
    monkeypatch.setattr(DiffusionPipeline, "from_pretrained",
                        classmethod(lambda *a, **k: pytest.fail("weights loaded before the component check")))
    what = r"is a 'flux' pipeline without text_encoder_2/, tokenizer_2/ \(T5, whose token states .*\); copy those"
    with pytest.raises(FileNotFoundError, match="teacher.pretrained_model_name_or_path=.*" + what):
        load_teacher(str(folder))
    with pytest.raises(FileNotFoundError, match="pipeline=.*" + what):
        load_pipeline(str(folder))
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "text_encoder_2": [None, None]}))
    with pytest.raises(FileNotFoundError, match=r"without text_encoder_2/, tokenizer_2/"):
        load_pipeline(str(folder))


@pytest.mark.slow
def test_evaluate_refuses_a_flux_folder_without_t5_with_exit_2(flux_dir, tmp_path):
    folder, out = _without_t5(flux_dir, tmp_path), tmp_path / "eval"
    proc = run_cli([sys.executable, "-m", "distill.evaluate", f"pipeline={folder}", "schedulers=[flow_euler]",
                           "steps=[1]", f"hydra.run.dir={out}"], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}, cwd=ROOT, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "pipeline=" in proc.stderr and "is a 'flux' pipeline without text_encoder_2/, tokenizer_2/ (T5" in proc.stderr
    assert "Loading pipeline components" not in proc.stderr and not (out / "quality_cost.csv").exists()


def test_a_training_method_on_a_flux_teacher_is_refused_from_its_configs(flux_dir):
    """Consistency distillation, progressive distillation, ECT and feature distillation serve Flux; another method is
    refused before anything loads, naming the family, the methods that can and what runs on it."""
    assert FluxFamily.methods == ("consistency", "progressive", "consistency_training", "feature_distillation", "dmd2",
                                  "scm", "rcm", "meanflow")
    for method in FluxFamily.methods:
        check_method_serves(flux_dir, pipeline_configs(flux_dir), method)
    with pytest.raises(ValueError, match=r"is a 'flux' teacher \(FluxFamily, flow matching\), which "
                                         r"method='diffusion' cannot train; the methods that can: "
                                         + re.escape(str(list(FluxFamily.methods)))):
        check_method_serves(flux_dir, pipeline_configs(flux_dir), "diffusion")


@pytest.mark.slow
def test_training_on_a_flux_teacher_exits_2_before_any_compute(flux_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train("+exp=consistency_training", "method=diffusion", f"teacher.pretrained_model_name_or_path={flux_dir}",
                     f"hydra.run.dir={run_dir}", "logger=csv", timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert ("is a 'flux' teacher (FluxFamily, flow matching), which method='diffusion' cannot train; the methods "
            f"that can: {list(FluxFamily.methods)}") in proc.stderr
    assert "python -m distill.evaluate pipeline=" in proc.stderr and not run_dir.exists()


def _env(tmp_path) -> dict:
    return {**os.environ, "HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_evaluate_runs_on_the_flux_folder(flux_dir, tmp_path):
    """distill.evaluate pipeline=<flux dir> schedulers=[flow_euler] steps=[2]: the table's row, 2 transformer passes
    per image (Flux's guidance is an input, not a CFG pass) at its native 128 px and 512 T5 tokens."""
    out = tmp_path / "eval"
    proc = run_cli(
        [sys.executable, "-m", "distill.evaluate", f"pipeline={flux_dir}", "schedulers=[flow_euler]", "steps=[2]",
         "num_per_class=1", "cost_repeats=1", "model_name=flux", f"hydra.run.dir={out}"],
        capture_output=True, text=True, env=_env(tmp_path), cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = list(csv.DictReader(open(out / "quality_cost.csv")))
    assert (row["scheduler"], row["steps"], float(row["nfe"])) == ("flow_euler", "2", 2.0)
    assert float(row["guidance_scale"]) == FLUX_GUIDANCE_SCALE  # FluxPipeline's own default
    assert float(row["fid"]) > 0 and float(row["gflops_per_image"]) > 0 and 0 <= float(row["prompt_accuracy"]) <= 1


@pytest.mark.slow
def test_sample_writes_a_grid_from_the_flux_folder(flux_dir, tmp_path):
    out = tmp_path / "grid.png"
    proc = run_cli(
        [sys.executable, "-m", "distill.sample", f"pipeline={flux_dir}", f"out={out}", "sampler=flow_euler",
         "num_inference_steps=2", "num_seeds=2", f"prompts=[{PROMPTS[0]},{PROMPTS[1]}]"],
        capture_output=True, text=True, env=_env(tmp_path), cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "4 images, 2 steps, guidance 3.5" in proc.stdout and out.stat().st_size > 100


def test_teacher_flux_names_flux1_dev_and_is_refused_from_its_configs_before_its_weights(flux_dir, compose,
                                                                                          monkeypatch):
    """teacher=flux composes black-forest-labs/FLUX.1-dev; train checks a hub teacher from its downloaded JSON files
    (here the stand-in's) and refuses the method before any weights are fetched."""
    from distill.train import _check_method_serves_teacher

    fetched = hub_from_folder(monkeypatch, flux_dir)  # Flux has no unet/
    monkeypatch.setattr(FluxPipeline, "from_pretrained",
                        classmethod(lambda *a, **k: pytest.fail("weights loaded before the family check")))
    cfg = compose("+exp=consistency_training", "method=diffusion", "teacher=flux")
    assert cfg.teacher.pretrained_model_name_or_path == "black-forest-labs/FLUX.1-dev"
    with pytest.raises(ValueError, match=r"'black-forest-labs/FLUX.1-dev' is a 'flux' teacher .*method='diffusion' "
                                         r"cannot train; the methods that can: " + re.escape(str(list(FluxFamily.methods)))):
        _check_method_serves_teacher(cfg)
    for exp in ("consistency_flux", "progressive_flux", "consistency_training_flux"):
        assert compose(f"+exp={exp}").teacher.pretrained_model_name_or_path == "black-forest-labs/FLUX.1-dev"
    assert fetched == ["model_index.json", "scheduler/scheduler_config.json", "unet/config.json",
                       "transformer/config.json"]


def test_the_training_table_samples_a_flux_teacher_at_the_students_size(tmp_path):
    """The quality-cost callback's teacher rows: a stock FluxPipeline samples at its native size (128 latent pixels x
    the VAE factor here; 1024 px for FLUX.1) and that size's mu, while a student trained at latent side 8 samples at
    8 x the factor: the teacher is sampled at the student's size (review finding: speed-ups compared across sizes).
    A family without a resolution shift keeps the teacher's own size."""
    from types import SimpleNamespace

    from diffusers import FlowMatchLCMScheduler

    from distill.callbacks.quality_cost import teacher_sample_size
    from tests.flux_tiny import tiny_flux_pipeline

    pipe = tiny_flux_pipeline(tmp_path)
    family = FluxFamily.from_pipeline(pipe)
    student = family.pipeline(pipe.transformer, FlowMatchLCMScheduler.from_config(pipe.scheduler.config),
                              **family.resolution_defaults(8, 8))
    assert native_size(pipe) != native_size(student) == 8 * pipe.vae_scale_factor
    module = SimpleNamespace(latent_size=8, pipeline=lambda scheduler=None: student)
    assert teacher_sample_size(native_size(pipe), module) == 8 * pipe.vae_scale_factor
    assert teacher_sample_size(native_size(pipe), SimpleNamespace(latent_size=None)) == native_size(pipe)
