"""The SDXL family on a random-weight SDXL stand-in (two CLIP towers, the second with a projection; a text_time
UNet; saved by StableDiffusionXLPipeline.save_pretrained): its conditioning equals the pipeline's own encode_prompt
and _get_add_time_ids, its denoise the pipeline's UNet call, its exports sample as the stock pipeline does in a
process without distill, and the commands users call run on it."""

import csv
import json
import os
import subprocess
import sys

import pytest
import torch
from diffusers import DiffusionPipeline, StableDiffusionXLPipeline, UNet2DConditionModel

from distill.families import FAMILIES, denoiser_of, family_of, load_teacher, native_size
from distill.families.sdxl import SDXLConditioner, StableDiffusionXLFamily
from distill.inference.pipelines import DistillStableDiffusionXLPipeline
from distill.models.conditioning import concat_conditions, take_conditions
from distill.models.teacher import pipeline_configs
from tests.conftest import ROOT, run_cli, run_train
from tests.sd_tiny import write_tiny_sdxl

PROMPTS = ["a handwritten digit three", "a handwritten digit seven"]


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    return write_tiny_sdxl(tmp_path_factory.mktemp("sdxl") / "pipe")


@pytest.fixture(scope="module")
def teacher(sdxl):
    return load_teacher(str(sdxl))


@pytest.fixture(scope="module")
def stock(sdxl):
    """The stock pipeline, its networks frozen as the teacher's are: on CPU, torch picks another convolution kernel
    for weights that require grad, even under no_grad (outputs 9e-7 apart on this stand-in)."""
    pipe = StableDiffusionXLPipeline.from_pretrained(sdxl)
    pipe.set_progress_bar_config(disable=True)
    for module in (pipe.unet, pipe.vae, pipe.text_encoder, pipe.text_encoder_2):
        module.requires_grad_(False)
    return pipe


def batch_of(prompts, size=32):
    return {"caption": list(prompts), "pixel_values": torch.zeros(len(prompts), 1, size, size)}


def test_the_stand_in_has_sdxls_layout_and_is_detected_as_sdxl(sdxl, teacher):
    index = json.loads((sdxl / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionXLPipeline"
    assert index["text_encoder"][1] == "CLIPTextModel" and index["text_encoder_2"][1] == "CLIPTextModelWithProjection"
    unet = teacher.denoiser.config
    assert unet.addition_embed_type == "text_time"
    assert unet.projection_class_embeddings_input_dim == 6 * unet.addition_time_embed_dim + 24
    assert unet.cross_attention_dim == 16 + 32  # CLIP-L stand-in's width + CLIP-G stand-in's
    assert FAMILIES.get("sdxl") is StableDiffusionXLFamily
    assert isinstance(teacher.family, StableDiffusionXLFamily)
    assert isinstance(teacher.family.conditioner, SDXLConditioner)
    assert isinstance(teacher.denoiser, UNet2DConditionModel) and not any(p.requires_grad for p in teacher.denoiser.parameters())


def test_the_sd_family_does_not_claim_an_sdxl_pipeline(sdxl):
    from distill.families import detect_family
    from distill.families.sd import StableDiffusionFamily

    assert detect_family(sdxl, pipeline_configs(sdxl)) is StableDiffusionXLFamily
    assert not StableDiffusionFamily.detect(pipeline_configs(sdxl))


def test_teacher_sdxl_names_sdxl_base_on_the_hub(compose):
    cfg = compose("+exp=consistency", "teacher=sdxl")
    assert cfg.teacher.pretrained_model_name_or_path == "stabilityai/stable-diffusion-xl-base-1.0"
    assert cfg.teacher._target_ == "distill.families.load_teacher"


def test_the_condition_is_encode_prompts_embeddings_and_the_pipelines_time_ids_bit_for_bit(teacher, stock):
    cond = teacher.family.condition(batch_of(PROMPTS))
    embeds, negative, pooled, negative_pooled = stock.encode_prompt(PROMPTS, device="cpu",
                                                                    do_classifier_free_guidance=True)
    assert torch.equal(cond["encoder_hidden_states"], embeds) and cond["encoder_hidden_states"].shape == (2, 8, 48)
    assert torch.equal(cond["text_embeds"], pooled) and pooled.shape == (2, 24)
    ids = stock._get_add_time_ids((32, 32), (0, 0), (32, 32), dtype=embeds.dtype, text_encoder_projection_dim=24)
    assert torch.equal(cond["time_ids"], ids.repeat(2, 1)) and ids.tolist() == [[32.0, 32.0, 0.0, 0.0, 32.0, 32.0]]
    # the null condition is the pipeline's negative: force_zeros_for_empty_prompt (SDXL-base's) gives zeros
    null = teacher.family.null_condition(2)
    assert stock.config.force_zeros_for_empty_prompt
    assert torch.equal(null["encoder_hidden_states"], negative) and torch.equal(null["text_embeds"], negative_pooled)
    assert negative.abs().sum() == 0 and torch.equal(null["time_ids"], cond["time_ids"])


def test_time_ids_follow_the_batch_images_or_cached_latents_size(teacher):
    conditioner = teacher.family.conditioner
    assert conditioner.time_ids(*conditioner.image_size(batch_of(PROMPTS, 64)), 1).tolist() == [[64, 64, 0, 0, 64, 64]]
    latents = {"caption": PROMPTS, "latent_mean": torch.zeros(2, 4, 12, 8)}
    assert teacher.family.condition(latents)["time_ids"][0].tolist() == [48, 32, 0, 0, 48, 32]
    # CFG's null rows keep the size ids of the rows they pair with, as the pipeline's negative rows do
    cond = teacher.family.condition(batch_of(PROMPTS, 64))
    null = teacher.family.null_condition(2, like=cond)
    assert torch.equal(null["time_ids"], cond["time_ids"]) and null["time_ids"][0, 0] == 64
    assert teacher.family.null_condition(2)["time_ids"][0].tolist() == [32, 32, 0, 0, 32, 32]  # the native size
    with pytest.raises(ValueError, match="needs 'pixel_values', 'latent_mean' or 'image_size'"):
        teacher.family.condition({"caption": PROMPTS})


def test_without_force_zeros_the_null_condition_is_the_empty_prompts(tmp_path):
    folder = write_tiny_sdxl(tmp_path / "pipe", force_zeros_for_empty_prompt=False)
    family = load_teacher(str(folder)).family
    stock = StableDiffusionXLPipeline.from_pretrained(folder)
    # the empty prompt is encoded once (cached) and repeated: compared with the pipeline's one-row negative, as
    # a batch of two rows of the projection can differ in the last bit from one
    _, negative, _, negative_pooled = stock.encode_prompt(PROMPTS[:1], device="cpu", do_classifier_free_guidance=True)
    null = family.null_condition(2)
    assert negative.abs().sum() > 0
    assert torch.equal(null["encoder_hidden_states"], negative.repeat(2, 1, 1))
    assert torch.equal(null["text_embeds"], negative_pooled.repeat(2, 1))
    # CFG dropout: dropped rows get the null condition, the others keep theirs
    cond = family.condition(batch_of(PROMPTS), drop=torch.tensor([True, False]))
    full = family.condition(batch_of(PROMPTS))
    for key in ("encoder_hidden_states", "text_embeds"):
        assert torch.equal(cond[key][0], null[key][0]) and torch.equal(cond[key][1], full[key][1])


def test_denoise_is_the_pipelines_unet_call_and_conditions_stack_and_index(teacher):
    family = teacher.family
    cond, null = family.condition(batch_of(PROMPTS)), family.null_condition(2)
    x, t = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([999, 400])
    direct = teacher.denoiser(x, t, encoder_hidden_states=cond["encoder_hidden_states"],
                          added_cond_kwargs={"text_embeds": cond["text_embeds"], "time_ids": cond["time_ids"]}).sample
    assert torch.equal(family.denoise(teacher.denoiser, x, t, cond), direct)
    both = family.denoise(teacher.denoiser, torch.cat([x, x]), torch.cat([t, t]), concat_conditions(cond, null))
    assert torch.allclose(both[:2], direct, atol=1e-5)
    assert not torch.allclose(both[2:], direct, atol=1e-3)  # the null condition changes the output
    row = family.denoise(teacher.denoiser, x[1:], t[1:], take_conditions(cond, torch.tensor([1])))
    assert torch.allclose(row, direct[1:], atol=1e-5)
    x0, t0, c0 = family.example_inputs(teacher.denoiser, 3)
    assert family.denoise(teacher.denoiser, x0, t0, c0).shape == (3, 4, 8, 8)


def test_the_family_pipeline_samples_as_the_stock_pipeline(teacher, stock):
    pipe = teacher.family.pipeline(teacher.denoiser, teacher.family.default_scheduler(), default_num_inference_steps=3,
                                   default_guidance_scale=2.0)
    assert isinstance(pipe, DistillStableDiffusionXLPipeline) and family_of(pipe) is StableDiffusionXLFamily
    assert family_of(stock) is StableDiffusionXLFamily and denoiser_of(pipe) is teacher.denoiser
    assert native_size(pipe) == 32
    ours = pipe(PROMPTS, generator=torch.Generator().manual_seed(0), output_type="pt").images
    theirs = stock(PROMPTS, num_inference_steps=3, guidance_scale=2.0, height=32, width=32,
                   generator=torch.Generator().manual_seed(0), output_type="pt").images
    assert ours.shape == (2, 1, 32, 32) and torch.equal(ours, theirs)


def test_a_v_prediction_teacher_samples_as_the_stock_pipeline(tmp_path):
    folder = write_tiny_sdxl(tmp_path / "pipe", prediction_type="v_prediction")
    family = load_teacher(str(folder)).family
    assert family.prediction_type == "v_prediction" == family.schedule.prediction_type
    pipe = family.pipeline(denoiser_of(StableDiffusionXLPipeline.from_pretrained(folder)), family.default_scheduler(),
                           default_num_inference_steps=2, default_guidance_scale=3.0)
    stock = StableDiffusionXLPipeline.from_pretrained(folder)
    stock.set_progress_bar_config(disable=True)
    ours = pipe(PROMPTS[:1], generator=torch.Generator().manual_seed(1), output_type="pt").images
    theirs = stock(PROMPTS[:1], num_inference_steps=2, guidance_scale=3.0, height=32, width=32,
                   generator=torch.Generator().manual_seed(1), output_type="pt").images
    assert torch.equal(ours, theirs)


# ---------------------------------------------------------------------- the commands, end to end

SHORT = ["data.batch_size=4", "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1", "logger=csv",
         "callbacks.samples=null", "callbacks.progress=null", "callbacks.lr_monitor=null", "callbacks.quality_cost=null",
         "sample_grid_seeds=1", "trainer.max_steps=2", "trainer.val_check_interval=2", "checkpoint.every_n_train_steps=2"]


@pytest.fixture(scope="module")
def trained(sdxl, tmp_path_factory):
    """Two steps of latent consistency distillation of the stand-in (``teacher=sdxl`` with the folder; data.resolution
    32: its native size)."""
    run_dir = tmp_path_factory.mktemp("run") / "run"
    proc = run_train("+exp=consistency", "teacher=sdxl", f"teacher.pretrained_model_name_or_path={sdxl}",
                     "data.resolution=32", *SHORT,
                     f"hydra.run.dir={run_dir}", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def test_two_consistency_steps_export_an_sdxl_pipeline_that_from_pretrained_samples(trained):
    export = trained / "export"
    assert json.loads((export / "model_index.json").read_text())["_class_name"] == "DistillStableDiffusionXLPipeline"
    info = json.loads((export / "distill.json").read_text())
    assert info["pipeline"] == "DistillStableDiffusionXLPipeline" and info["safety_checker"] is None
    assert info["sampling"]["class"] == "LCMScheduler" and info["sampling"]["num_inference_steps"] == 4
    card = (export / "README.md").read_text()
    assert "stock `StableDiffusionXLPipeline`" in card and "(50 steps, guidance 5.0)" in card
    checkpoint = torch.load(trained / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert {k.split(".")[0] for k in checkpoint["state_dict"]} == {"student", "target"}  # no frozen text towers
    pipe = DiffusionPipeline.from_pretrained(export)
    assert type(pipe) is DistillStableDiffusionXLPipeline and pipe.unet.config.time_cond_proj_dim == 256
    assert pipe.config.default_num_inference_steps == 4 and pipe.config.default_guidance_scale == 3.0
    pipe.set_progress_bar_config(disable=True)
    image = pipe("a handwritten digit seven", generator=torch.Generator().manual_seed(0), output_type="pt").images
    assert image.shape == (1, 1, 32, 32) and torch.isfinite(image).all()


STOCK = """
import sys
import numpy as np
import torch
from diffusers import StableDiffusionXLPipeline

pipe = StableDiffusionXLPipeline.from_pretrained(sys.argv[1])
pipe.set_progress_bar_config(disable=True)
images = pipe(["a handwritten digit seven", "a handwritten digit two"], num_inference_steps=4, guidance_scale=3.0,
              generator=torch.Generator().manual_seed(0), output_type="np").images
np.save(sys.argv[2], images)
assert not any(name == "distill" or name.startswith("distill.") for name in sys.modules), "distill was imported"
print(type(pipe).__name__, type(pipe.scheduler).__name__)
"""


def test_the_stock_sdxl_pipeline_without_distill_gives_the_exports_images(trained, tmp_path):
    import numpy as np

    (tmp_path / "stock.py").write_text(STOCK)
    proc = subprocess.run([sys.executable, str(tmp_path / "stock.py"), str(trained / "export"), str(tmp_path / "x.npy")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["StableDiffusionXLPipeline", "LCMScheduler"]
    pipe = DiffusionPipeline.from_pretrained(trained / "export")
    pipe.set_progress_bar_config(disable=True)
    ours = pipe(["a handwritten digit seven", "a handwritten digit two"], generator=torch.Generator().manual_seed(0),
                output_type="np").images  # the registered call: 4 steps, guidance 3.0 as the w input
    theirs = np.load(tmp_path / "x.npy")
    assert ours.shape == theirs.shape == (2, 32, 32, 1)
    np.testing.assert_array_equal(ours, theirs)


def test_evaluate_runs_on_the_sdxl_stand_in(sdxl, tmp_path):
    """A plain SDXL folder (no distill.json): sampled at StableDiffusionXLPipeline's own guidance 5.0 with CFG."""
    proc = run_cli([sys.executable, "-m", "distill.evaluate", f"pipeline={sdxl}", "schedulers=[euler]",
                           "steps=[2]", "num_per_class=1", "cost_repeats=1", "grids=false", "eval.num_prompts=2",
                           f"hydra.run.dir={tmp_path / 'eval'}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    protocol = json.loads((tmp_path / "eval" / "protocol.json").read_text())
    assert protocol["guidance_scale"] == 5.0
    (row,) = list(csv.DictReader(open(tmp_path / "eval" / "quality_cost.csv")))
    assert row["scheduler"] == "euler" and float(row["nfe"]) == 4  # 2 steps, each a CFG pair
    assert float(row["fid"]) > 0 and float(row["params_m"]) == pytest.approx(0.53, abs=0.01)


OTHER_METHODS = {
    "progressive": ["+exp=progressive", "method.start_steps=4", "method.final_steps=2", "method.steps_per_round=2"],
    "consistency_lora": ["+exp=consistency", "student=lora", "student.rank=4", "method.ema_decay=0"],
    "feature_distillation": ["+exp=compress", "student=copy", "student.time_cond_proj_dim=null",
                             "scheduler.num_inference_steps=2"],
    "consistency_training": ["+exp=consistency_training"],
    # the fake score on the SDXL UNet's mid block (its added_cond_kwargs), a LoRA one on the teacher's own network
    "dmd2_lora_fake_score": ["+exp=dmd2", "method.critic_updates=1", "method.fake_score=lora",
                             "method.fake_score_rank=4", "scheduler.num_inference_steps=2"],
}


@pytest.mark.slow  # five trainings (~25-40 s each); the consistency run above covers the family in the default suite
@pytest.mark.parametrize("run", sorted(OTHER_METHODS))
def test_two_steps_of_every_other_method_export_a_pipeline_that_samples(sdxl, tmp_path, run):
    """Progressive distillation, a LoRA consistency student (its adapters alone load into the stock teacher with
    load_lora_weights and give the merged export's UNet), output + feature distillation, consistency training, DMD2
    with a LoRA fake score (two generator steps of a 2-step generator)."""
    proc = run_train(*OTHER_METHODS[run], "teacher=sdxl", f"teacher.pretrained_model_name_or_path={sdxl}",
                     "data.resolution=32", *SHORT, f"hydra.run.dir={tmp_path / 'run'}", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pipe = DiffusionPipeline.from_pretrained(tmp_path / "run" / "export")
    assert type(pipe) is DistillStableDiffusionXLPipeline
    pipe.set_progress_bar_config(disable=True)
    image = pipe("a handwritten digit four", generator=torch.Generator().manual_seed(0), output_type="pt").images
    assert image.shape == (1, 1, 32, 32) and torch.isfinite(image).all()
    if run == "consistency_lora":
        stock = StableDiffusionXLPipeline.from_pretrained(sdxl)
        stock.load_lora_weights(tmp_path / "run" / "export" / "lora")
        family = load_teacher(str(sdxl)).family
        x, t, cond = family.example_inputs(pipe.unet, 2)
        x = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
        cond["encoder_hidden_states"] = torch.randn(2, 8, 48, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            merged, adapters = (family.denoise(unet, x, t + 500, cond) for unet in (pipe.unet, stock.unet))
        torch.testing.assert_close(adapters, merged, rtol=0, atol=1e-5)
