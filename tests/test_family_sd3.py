"""The SD3 family (distill.families.sd3) against StableDiffusion3Pipeline on a tiny random-weight stand-in
(tests/sd3_tiny.py: SD3.5's qk_norm and a dual-attention layer, two CLIPTextModelWithProjection, no T5, a VAE with a
shift_factor): detection and loading, conditioning bit for bit as encode_prompt (with and without T5), denoise as
the transformer call the pipeline makes, the latents of the pipeline's decode path, the export through
DiffusionPipeline.from_pretrained, distill.evaluate and distill.sample end to end, and the refusals (a VP scheduler
on the flow teacher, a training method that does not serve it)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest
import torch
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

from distill.diffusion import FlowMatchingSchedule
from distill.families import FAMILIES, denoiser_of, family_of, load_teacher, native_size
from distill.families.base import check_method_serves, detect_family
from distill.families.sd3 import (
    SD3_MAX_SEQUENCE_LENGTH,
    DistillSD3Pipeline,
    SD3Conditioner,
    StableDiffusion3Family,
)
from distill.inference.schedulers import FLOW_SCHEDULERS, make_scheduler
from distill.models.teacher import pipeline_configs
from tests.conftest import ROOT, hub_from_folder, run_cli, run_train
from tests.sd3_tiny import JOINT_DIM, SD3_SHIFT, write_tiny_sd3

PROMPTS = ["a handwritten digit three", "a handwritten digit seven"]


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    return write_tiny_sd3(tmp_path_factory.mktemp("sd3") / "pipe")


@pytest.fixture(scope="module")
def pipe(sd3_dir):
    """The stock pipeline on the same folder (T5 passed as None, as SD3 allows)."""
    pipe = StableDiffusion3Pipeline.from_pretrained(sd3_dir, text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def teacher(sd3_dir):
    return load_teacher(str(sd3_dir))


def _family(teacher, max_sequence_length: int, text_encoder_3=None, tokenizer_3=None) -> StableDiffusion3Family:
    c = teacher.family.conditioner
    conditioner = SD3Conditioner(c.text_encoder, c.tokenizer, c.text_encoder_2, c.tokenizer_2, JOINT_DIM,
                                 text_encoder_3, tokenizer_3, max_sequence_length)
    return StableDiffusion3Family(teacher.scheduler, teacher.vae, conditioner)


def test_detect_and_load_give_the_sd3_family_on_its_flow_schedule(sd3_dir, teacher, pipe):
    configs = pipeline_configs(sd3_dir)
    assert configs["transformer"]["_class_name"] == "SD3Transformer2DModel" and configs["unet"] == {}
    assert FAMILIES.get("sd3") is StableDiffusion3Family and detect_family(sd3_dir, configs) is StableDiffusion3Family
    family = teacher.family
    assert type(family) is StableDiffusion3Family and type(teacher.denoiser).__name__ == "SD3Transformer2DModel"
    assert isinstance(family.schedule, FlowMatchingSchedule) and family.schedule.shift == SD3_SHIFT
    assert family.prediction_type == "flow_prediction"
    c = family.conditioner
    assert c.text_encoder_3 is None and c.tokenizer_3 is None and c.max_sequence_length == SD3_MAX_SEQUENCE_LENGTH == 256
    assert not any(p.requires_grad for p in teacher.denoiser.parameters())
    # pipeline-level lookups on the stock class
    assert family_of(pipe) is StableDiffusion3Family and denoiser_of(pipe) is pipe.transformer
    assert native_size(pipe) == 8 * 4 == 32  # the transformer's sample_size 8 latents, the VAE's factor 4
    assert list(family.feature_blocks(teacher.denoiser)) == ["transformer_blocks.0", "transformer_blocks.1"]
    copy = family.copy(cache_prompts=False)
    assert copy.conditioner is not c and copy.conditioner.text_encoder is c.text_encoder and not copy.conditioner.cache_enabled


@pytest.mark.parametrize("max_sequence_length", [4, SD3_MAX_SEQUENCE_LENGTH])
def test_conditioning_equals_encode_prompt_bit_for_bit(teacher, pipe, max_sequence_length):
    """prompt_embeds: both CLIPs' penultimate states concatenated, padded to the joint width, then the zero T5 tokens;
    pooled: both projections; the null condition is the negative prompt "" of encode_prompt."""
    family = _family(teacher, max_sequence_length)
    with torch.no_grad():
        embeds, neg, pooled, neg_pooled = pipe.encode_prompt(PROMPTS, None, None, device="cpu",
                                                             do_classifier_free_guidance=True,
                                                             max_sequence_length=max_sequence_length)
    cond = family.condition({"caption": PROMPTS})
    assert torch.equal(cond["encoder_hidden_states"], embeds) and torch.equal(cond["pooled_projections"], pooled)
    null = family.null_condition(2)  # "" encoded once (cached), as encode_prompt([""]) encodes it
    with torch.no_grad():
        empty, _, empty_pooled, _ = pipe.encode_prompt([""], None, None, device="cpu", do_classifier_free_guidance=False,
                                                       max_sequence_length=max_sequence_length)
    assert torch.equal(null["encoder_hidden_states"], empty.expand(2, -1, -1))
    assert torch.equal(null["pooled_projections"], empty_pooled.expand(2, -1))
    # encode_prompt's negatives run "" as a batch of 2: the projection's kernel differs from a batch of 1 in the ulps
    assert torch.equal(null["encoder_hidden_states"], neg)
    assert torch.allclose(null["pooled_projections"], neg_pooled, atol=1e-6, rtol=0)
    assert embeds.shape == (2, 8 + max_sequence_length, JOINT_DIM) and pooled.shape == (2, 16)
    assert not embeds[:, 8:].any() and not embeds[:, :8, 16 + 24:].any()  # T5 zeros, the padded CLIP features
    assert embeds[:, :8, :40].abs().mean() > 0.1
    dropped = family.condition({"caption": PROMPTS}, drop=torch.tensor([True, False]))
    assert torch.equal(dropped["encoder_hidden_states"][0], neg[0]) and torch.equal(dropped["pooled_projections"][1], pooled[1])
    assert family.conditioner.encoder_calls == 3  # two prompts and "", each encoded once (cached)


def test_conditioning_with_t5_equals_encode_prompt(teacher, pipe):
    """A T5 encoder present: its max_sequence_length token states follow the CLIP tokens, as encode_prompt puts them
    (a tiny T5EncoderModel at the joint width; the CLIP tokenizer stands in for T5's)."""
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(3)
    t5 = T5EncoderModel(T5Config(vocab_size=len(pipe.tokenizer), d_model=JOINT_DIM, d_kv=8, d_ff=32, num_layers=1,
                                 num_heads=2)).eval()
    with_t5 = StableDiffusion3Pipeline(**{**pipe.components, "text_encoder_3": t5, "tokenizer_3": pipe.tokenizer})
    with torch.no_grad():
        embeds, neg, pooled, _ = with_t5.encode_prompt(PROMPTS, None, None, device="cpu", max_sequence_length=6)
    family = _family(teacher, 6, t5, pipe.tokenizer)
    cond, null = family.condition({"caption": PROMPTS}), family.null_condition(2)
    assert torch.equal(cond["encoder_hidden_states"], embeds) and torch.equal(cond["pooled_projections"], pooled)
    assert torch.allclose(null["encoder_hidden_states"], neg, atol=1e-6, rtol=0)  # "" as 1 row, theirs as 2
    assert embeds.shape == (2, 8 + 6, JOINT_DIM) and embeds[:, 8:].abs().mean() > 0.1  # T5 states, not zeros
    with pytest.raises(ValueError, match="text_encoder_3 and tokenizer_3"):
        _family(teacher, 6, t5, None)
    with pytest.raises(ValueError, match="max_sequence_length=0 must be >= 1"):
        _family(teacher, 0)


def test_denoise_is_the_transformer_call_the_pipeline_makes(teacher):
    """denoise(transformer, x, t, cond) at flow time t = the pipeline's sigma equals the transformer called with
    timestep = scheduler.timesteps[i] (1000 t) expanded over the batch, bit for bit; per-example t too."""
    family = _family(teacher, 4)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=SD3_SHIFT)
    scheduler.set_timesteps(4)
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    cond = family.condition({"caption": PROMPTS})
    net = teacher.denoiser
    with torch.no_grad():
        for i in range(4):
            ours = family.denoise(net, x, scheduler.sigmas[i], cond)
            theirs = net(hidden_states=x, timestep=scheduler.timesteps[i].expand(2), **cond).sample
            assert torch.equal(ours, theirs), i
        t = scheduler.sigmas[:2]
        both = family.denoise(net, x, t, cond)
        assert torch.equal(both[1], net(hidden_states=x, timestep=scheduler.timesteps[:2], **cond).sample[1])
    assert ours.shape == x.shape and float(ours.abs().mean()) > 0.01
    x0, t0, c0 = family.example_inputs(net, n=3)
    with torch.no_grad():
        assert family.denoise(net, x0, t0, c0).shape == (3, 4, 8, 8)


def test_latents_follow_the_pipelines_decode_path_with_shift_factor(teacher, pipe):
    """decode(latents) = vae.decode(latents / scaling_factor + shift_factor), as StableDiffusion3Pipeline decodes;
    scale_latents is its inverse on a posterior sample."""
    family = teacher.family
    sf, shift = pipe.vae.config.scaling_factor, pipe.vae.config.shift_factor
    assert (sf, shift) == (1.5305, 0.0609)
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(family.decode(latents), pipe.vae.decode(latents / sf + shift).sample)
    z = latents / sf + shift
    assert torch.allclose(family.scale_latents(z), latents, atol=1e-6)
    images = torch.rand(2, 1, 32, 32, generator=torch.Generator().manual_seed(2)) * 2 - 1
    encoded = family.encode(images, torch.Generator().manual_seed(0))
    assert encoded.shape == (2, 4, 8, 8)


def test_export_loads_through_diffusion_pipeline_and_samples_as_the_stock_class(teacher, tmp_path):
    """family.pipeline(...) saved -> model_index.json names DistillSD3Pipeline with its call defaults;
    DiffusionPipeline.from_pretrained(export)(prompt) samples 2 steps at guidance 1 with 4 T5 tokens, the stock
    StableDiffusion3Pipeline gives the same images with those call arguments."""
    from distill.inference.pipelines import DistillTextToImagePipeline  # noqa: F401  (registers the classes)
    from distill.metrics.cost import NFECounter

    family = teacher.family
    export = family.pipeline(teacher.denoiser, family.default_scheduler(), default_num_inference_steps=2,
                             default_guidance_scale=1.0, default_max_sequence_length=4)
    export.save_pretrained(tmp_path / "export")
    index = json.loads((tmp_path / "export" / "model_index.json").read_text())
    assert index["_class_name"] == "DistillSD3Pipeline" and index["text_encoder_3"] == [None, None]
    assert (index["default_num_inference_steps"], index["default_guidance_scale"],
            index["default_max_sequence_length"], index["guidance_distilled"]) == (2, 1.0, 4, False)
    loaded = DiffusionPipeline.from_pretrained(tmp_path / "export")
    assert type(loaded) is DistillSD3Pipeline and loaded.text_encoder_3 is None
    loaded.set_progress_bar_config(disable=True)
    with NFECounter(loaded.transformer) as counter:
        ours = loaded(PROMPTS[0], generator=torch.Generator().manual_seed(0), output_type="pt").images
    assert counter.calls == 2 and counter.examples == 2  # 2 steps, one pass each (no CFG at guidance 1)
    stock = StableDiffusion3Pipeline.from_pretrained(tmp_path / "export", text_encoder_3=None, tokenizer_3=None)
    stock.set_progress_bar_config(disable=True)
    theirs = stock(PROMPTS[0], num_inference_steps=2, guidance_scale=1.0, max_sequence_length=4,
                   generator=torch.Generator().manual_seed(0), output_type="pt").images
    assert ours.shape == (1, 1, 32, 32) and torch.equal(ours, theirs)
    distilled = family.pipeline(teacher.denoiser, family.default_scheduler(), default_num_inference_steps=1,
                                default_guidance_scale=5.0, guidance_distilled=True, default_max_sequence_length=4)
    with NFECounter(distilled.transformer) as counter:
        distilled(PROMPTS[0], output_type="pt")
    assert counter.examples == 1  # guidance distilled: no unconditional pass at guidance 5


def test_schedulers_of_the_other_kind_are_refused(teacher):
    assert FLOW_SCHEDULERS == ("flow_euler", "flow_lcm", "flow_trigflow", "flow_meanflow")
    flow = make_scheduler("flow_euler", teacher.scheduler.config)
    assert type(flow) is FlowMatchEulerDiscreteScheduler and flow.config.shift == SD3_SHIFT
    with pytest.raises(ValueError, match=r"'ddim' steps a discrete VP .* use one of \['flow_euler', 'flow_lcm', 'flow_trigflow', 'flow_meanflow'\]"):
        make_scheduler("ddim", teacher.scheduler.config)
    from diffusers import DDIMScheduler

    with pytest.raises(ValueError, match="'flow_euler' is a flow-matching scheduler, but the model has a discrete VP"):
        make_scheduler("flow_euler", DDIMScheduler().config)


def _env(tmp_path) -> dict:
    return {**os.environ, "HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}


def test_evaluate_runs_on_the_sd3_folder(sd3_dir, tmp_path):
    """distill.evaluate pipeline=<sd3 dir> schedulers=[flow_euler] steps=[2]: the table's row, 2 transformer passes
    per image at guidance 1 (SD3's 256 zero T5 tokens: the stock pipeline's default)."""
    out, env = tmp_path / "eval", _env(tmp_path)
    proc = run_cli(
        [sys.executable, "-m", "distill.evaluate", f"pipeline={sd3_dir}", "schedulers=[flow_euler]", "steps=[2]",
         "num_per_class=2", "cost_repeats=1", "model_name=sd3", "guidance_scale=1", f"hydra.run.dir={out}"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = list(csv.DictReader(open(out / "quality_cost.csv")))
    assert (row["scheduler"], row["steps"], float(row["nfe"])) == ("flow_euler", "2", 2.0)
    assert float(row["fid"]) > 0 and float(row["gflops_per_image"]) > 0 and 0 <= float(row["prompt_accuracy"]) <= 1


def test_evaluate_refuses_a_vp_scheduler_on_the_flow_teacher(sd3_dir, tmp_path):
    """schedulers=[ddim] exits 2 before any weights load, naming the flow schedulers."""
    env = _env(tmp_path)
    bad = run_cli(
        [sys.executable, "-m", "distill.evaluate", f"pipeline={sd3_dir}", "schedulers=[ddim]", "steps=[2]",
         f"hydra.run.dir={tmp_path / 'bad'}"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert "schedulers: 'ddim' steps a discrete VP" in bad.stderr and "['flow_euler', 'flow_lcm', 'flow_trigflow', 'flow_meanflow']" in bad.stderr
    assert not (tmp_path / "bad" / "quality_cost.csv").exists()


def test_sample_writes_a_grid_from_the_sd3_folder(sd3_dir, tmp_path):
    out = tmp_path / "grid.png"
    proc = run_cli(
        [sys.executable, "-m", "distill.sample", f"pipeline={sd3_dir}", f"out={out}", "sampler=flow_euler",
         "num_inference_steps=2", "guidance_scale=1", "num_seeds=2", f"prompts=[{PROMPTS[0]},{PROMPTS[1]}]"],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "4 images, 2 steps, guidance 1.0" in proc.stdout and out.stat().st_size > 100


def test_training_on_an_sd3_teacher_is_refused_before_any_compute(sd3_dir, tmp_path):
    """method=diffusion (the plain VP diffusion objective) on the SD3 folder: exit 2 at validation (no run
    directory), naming the family, the methods that serve it (consistency, progressive, consistency_training,
    feature_distillation, dmd2, scm, meanflow and rcm; tests/test_consistency_flow.py, tests/test_progressive_flow.py,
    tests/test_consistency_training_flow.py, tests/test_feature_distillation_flow.py, tests/test_dmd2_flow.py,
    tests/test_scm.py, tests/test_meanflow.py run them) and what else runs."""
    for served in ("consistency", "progressive", "consistency_training", "feature_distillation", "dmd2", "scm",
                   "meanflow", "rcm"):
        check_method_serves(sd3_dir, pipeline_configs(sd3_dir), served)
    with pytest.raises(ValueError, match=r"'sd3' teacher .*method='diffusion' cannot train; the methods "
                                         r"that can: \['consistency', 'progressive', 'consistency_training', "
                                         r"'feature_distillation', 'dmd2', 'scm', 'meanflow', 'rcm'\]"):
        check_method_serves(sd3_dir, pipeline_configs(sd3_dir), "diffusion")
    run_dir = tmp_path / "run"
    proc = run_train("+exp=consistency_training", "method=diffusion", f"teacher.pretrained_model_name_or_path={sd3_dir}",
                     f"hydra.run.dir={run_dir}", "logger=csv", timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert ("is a 'sd3' teacher (StableDiffusion3Family, flow matching), which method='diffusion' cannot "
            "train; the methods that can: ['consistency', 'progressive', 'consistency_training', "
            "'feature_distillation', 'dmd2', 'scm', 'meanflow', 'rcm']") in proc.stderr
    assert "python -m distill.evaluate pipeline=" in proc.stderr and "python -m distill.sample" in proc.stderr
    assert not run_dir.exists()


def test_a_hub_sd3_teacher_is_refused_from_its_configs_before_its_weights(sd3_dir, compose, monkeypatch):
    """A hub id is not checked at validation (no network there); train checks it from the downloaded JSON files
    before load_teacher fetches any weights."""
    from distill.train import _check_method_serves_teacher

    fetched = hub_from_folder(monkeypatch, sd3_dir)  # SD3 has no unet/
    monkeypatch.setattr(StableDiffusion3Pipeline, "from_pretrained",
                        classmethod(lambda *a, **k: pytest.fail("weights loaded before the family check")))
    cfg = compose("+exp=consistency_training", "method=diffusion",
                  "teacher.pretrained_model_name_or_path=someone/sd3-medium")
    with pytest.raises(ValueError, match="'someone/sd3-medium' is a 'sd3' teacher .*method='diffusion' cannot"):
        _check_method_serves_teacher(cfg)
    assert fetched == ["model_index.json", "scheduler/scheduler_config.json", "unet/config.json",
                       "transformer/config.json"]


def test_the_documented_import_registers_every_familys_export_class():
    """`import distill.inference.pipelines` (README: what loading any distill export needs) registers the SD3 and
    Flux families' DistillSD3Pipeline and DistillFluxPipeline with diffusers too, in a fresh process that imports
    nothing else of distill."""
    code = ("import sys, diffusers, distill.inference.pipelines; "
            "print(diffusers.DistillSD3Pipeline.__module__, diffusers.DistillFluxPipeline.__module__, "
            "'distill.families.sd3' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["distill.families.sd3", "distill.families.flux", "True"]


def test_an_sd3_folder_without_a_clip_tower_is_refused_before_any_weights(sd3_dir, tmp_path, monkeypatch):
    """load_teacher and load_pipeline (distill.evaluate, distill.sample) name the missing text_encoder_2/ from the
    family's components (ModelFamily.check_components) without calling from_pretrained; T5 stays optional."""
    import shutil

    from distill.inference.loading import load_pipeline

    folder = tmp_path / "no_clip_g"
    shutil.copytree(sd3_dir, folder)
    shutil.rmtree(folder / "text_encoder_2")
    for cls in (StableDiffusion3Pipeline, DiffusionPipeline):
        monkeypatch.setattr(cls, "from_pretrained", classmethod(lambda *a, **k: pytest.fail("weights loaded")))
    with pytest.raises(FileNotFoundError, match=r"teacher.pretrained_model_name_or_path=.* is a 'sd3' pipeline "
                                                r"without text_encoder_2/; copy those folders"):
        load_teacher(str(folder))
    with pytest.raises(FileNotFoundError, match=r"pipeline=.* is a 'sd3' pipeline without text_encoder_2/;"):
        load_pipeline(str(folder))
    StableDiffusion3Family.check_components(sd3_dir, pipeline_configs(sd3_dir))  # no T5: complete
