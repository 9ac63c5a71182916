"""Model families (distill.families) against the references they wrap: the sd family's denoise is the UNet call,
its latents are diffusers' VAE path, its conditioning is StableDiffusionPipeline.encode_prompt's; detection from
configs picks the family of each test pipeline and refuses the families distill does not run yet."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline
from diffusers.image_processor import VaeImageProcessor

from distill.families import FAMILIES, family_for, load_teacher
from distill.families.base import denoiser_of, detect_family, family_of, native_size
from distill.families.class_unet import ClassUNetFamily
from distill.families.sd import StableDiffusionFamily
from distill.models.conditioning import ClassConditioner, TextConditioner
from distill.models.teacher import pipeline_configs
from distill.students.sized import build_class_unet
from distill.worlds.digits import asset_path
from tests.sd_tiny import write_tiny_sd
from tests.test_teacher_checks import SDXL_INDEX, SDXL_UNET, configs_only, flow_matching

PROMPTS = ["a handwritten digit three", "a handwritten digit seven"]  # two of the tiny tokenizer's captions


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory):
    return write_tiny_sd(tmp_path_factory.mktemp("sd") / "pipe")


@pytest.fixture(scope="module")
def teacher(tiny_sd):
    return load_teacher(str(tiny_sd))


@pytest.fixture(scope="module")
def pipe(tiny_sd):
    return StableDiffusionPipeline.from_pretrained(tiny_sd, safety_checker=None, requires_safety_checker=False)


def _class_family(vae=None) -> ClassUNetFamily:
    return family_for(DDPMScheduler(num_train_timesteps=100), vae, ClassConditioner(10))


def test_the_registry_lists_both_families():
    assert {"sd", "sdxl", "class_unet"} <= set(FAMILIES.names())
    assert FAMILIES.get("sd") is StableDiffusionFamily and FAMILIES.get("class_unet") is ClassUNetFamily


def test_detect_picks_the_family_of_each_test_pipeline(tiny_sd, tmp_path):
    assert detect_family(tiny_sd, pipeline_configs(tiny_sd)) is StableDiffusionFamily
    assert detect_family("teacher", pipeline_configs(asset_path("teacher"))) is StableDiffusionFamily
    # a class-conditional export: its configs, not the sd family's
    family = _class_family()
    family.pipeline(build_class_unet(8, 1, size="debug"), family.default_scheduler()).save_pretrained(tmp_path / "cls")
    configs = pipeline_configs(tmp_path / "cls")
    assert not StableDiffusionFamily.detect(configs) and ClassUNetFamily.detect(configs)
    assert detect_family(tmp_path / "cls", configs) is ClassUNetFamily
    with pytest.raises(ValueError, match="cannot be loaded as a teacher"):
        load_teacher(str(tmp_path / "cls"))


def test_detect_refuses_flow_matching_with_its_message(tmp_path):
    folder = flow_matching(tmp_path / "f")
    with pytest.raises(ValueError, match="FlowMatchEulerDiscreteScheduler \\(flow matching\\)"):
        detect_family(folder, pipeline_configs(folder))
    assert not StableDiffusionFamily.detect(pipeline_configs(folder))  # and the sd family would not claim it


@pytest.mark.parametrize("kind", ["sdxl_index", "sdxl_unet"])
def test_each_sign_of_sdxl_is_detected_as_the_sdxl_family_and_not_as_sd(tmp_path, kind):
    from distill.families.sdxl import StableDiffusionXLFamily

    folder = configs_only(tmp_path / "x", **({"pipeline": SDXL_INDEX} if kind == "sdxl_index" else {"unet": SDXL_UNET}))
    assert detect_family(folder, pipeline_configs(folder)) is StableDiffusionXLFamily  # was: refused
    assert not StableDiffusionFamily.detect(pipeline_configs(folder))


def test_an_unknown_pipeline_names_the_registered_families(tmp_path):
    folder = configs_only(tmp_path / "odd", pipeline={"_class_name": "OddPipeline"}, unet={"_class_name": "OddNet"})
    configs = pipeline_configs(folder)
    for key in ("text_encoder", "tokenizer"):
        configs["pipeline"].pop(key)
    with pytest.raises(ValueError, match=r"\(OddPipeline\) is recognised by no registered model family; registered: "):
        detect_family(folder, configs)


def test_load_teacher_gives_the_teacher_its_family(teacher):
    family = teacher.family
    assert isinstance(family, StableDiffusionFamily) and family.vae is teacher.vae
    assert family.conditioner.text_encoder is teacher.text_encoder and type(teacher.denoiser).__name__ == "UNet2DConditionModel"
    assert family.prediction_type == teacher.scheduler.config.prediction_type == "epsilon"
    assert torch.equal(family.schedule.abar[:-1], teacher.scheduler.alphas_cumprod)  # the teacher's own table
    t = torch.tensor([0, 10, 999])
    alpha, sigma = family.schedule.alpha_sigma(t)
    torch.testing.assert_close(alpha, teacher.scheduler.alphas_cumprod[t].sqrt(), rtol=0, atol=0)
    torch.testing.assert_close(sigma, (1 - teacher.scheduler.alphas_cumprod[t]).sqrt(), rtol=0, atol=0)


def test_sd_denoise_is_the_direct_unet_call_bit_for_bit(teacher):
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(2, 4, 8, 8, generator=g), torch.tensor([999, 250])
    cond = teacher.family.condition({"caption": PROMPTS})
    with torch.no_grad():
        direct = teacher.denoiser(x, t, encoder_hidden_states=cond["encoder_hidden_states"]).sample
        assert torch.equal(teacher.family.denoise(teacher.denoiser, x, t, cond), direct)
        w = {"timestep_cond": torch.randn(2, 8, generator=g)}  # extra keywords pass through
        student = teacher.denoiser.__class__.from_config({**teacher.denoiser.config, "time_cond_proj_dim": 8}).eval()
        direct = student(x, t, encoder_hidden_states=cond["encoder_hidden_states"], **w).sample
        assert torch.equal(teacher.family.denoise(student, x, t, cond, **w), direct)


def test_sd_conditioning_equals_encode_prompt(teacher, pipe):
    embeds, negative = pipe.encode_prompt(PROMPTS, "cpu", 1, True)
    family = teacher.family.copy(cache_prompts=False)
    cond = family.condition({"caption": PROMPTS})["encoder_hidden_states"]
    assert cond.shape == embeds.shape == (2, 8, 32)
    torch.testing.assert_close(cond, embeds, rtol=0, atol=0)
    torch.testing.assert_close(family.null_condition(2)["encoder_hidden_states"], negative, rtol=0, atol=0)
    dropped = family.condition({"caption": PROMPTS}, drop=torch.tensor([False, True]))["encoder_hidden_states"]
    torch.testing.assert_close(dropped, torch.stack([embeds[0], negative[1]]), rtol=0, atol=0)


def test_copy_keeps_the_frozen_parts_and_gives_its_own_prompt_cache(teacher):
    family = teacher.family.copy(cache_prompts=False)
    assert family.vae is teacher.family.vae and family.conditioner is not teacher.family.conditioner
    assert family.conditioner.text_encoder is teacher.text_encoder and not family.conditioner.cache_enabled
    assert family.schedule is not teacher.family.schedule  # a module each method registers as its own


def test_sd_latents_round_trip_equals_diffusers_vae_path(teacher):
    processor = VaeImageProcessor(vae_scale_factor=4, do_resize=False)
    images = torch.rand(2, 1, 32, 32, generator=torch.Generator().manual_seed(1))  # [0, 1], as a user's images
    pixels = processor.preprocess(images)  # [-1, 1]
    vae, factor = teacher.vae, teacher.vae.config.scaling_factor
    with torch.no_grad():
        want = vae.encode(pixels).latent_dist.sample(torch.Generator().manual_seed(2)) * factor
        latents = teacher.family.encode(pixels, torch.Generator().manual_seed(2))
        assert torch.equal(latents, want)
        decoded = processor.postprocess(vae.decode(latents / factor, return_dict=False)[0], output_type="pt")
        assert torch.equal(processor.postprocess(teacher.family.decode(latents), output_type="pt"), decoded)


def test_shift_factor_is_applied_where_the_vae_config_has_one():
    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=1, out_channels=1, block_out_channels=(8,), latent_channels=4, norm_num_groups=4,
                        sample_size=8, scaling_factor=1.5, shift_factor=0.25)
    family = _class_family(vae)
    pixels = torch.rand(2, 1, 8, 8) * 2 - 1
    with torch.no_grad():
        want = (vae.encode(pixels).latent_dist.sample(torch.Generator().manual_seed(3)) - 0.25) * 1.5  # SD3's path
        latents = family.encode(pixels, torch.Generator().manual_seed(3))
        assert torch.equal(latents, want)
        assert torch.equal(family.decode(latents), vae.decode(latents / 1.5 + 0.25).sample)


def test_class_family_conditions_with_labels_and_a_null_class():
    family = _class_family()
    assert family.vae is None and isinstance(family, ClassUNetFamily)
    cond = family.condition({"label": [3, -1, 7]}, drop=torch.tensor([False, False, True]))
    assert cond["class_labels"].tolist() == [3, 10, 10]
    assert family.null_condition(2)["class_labels"].tolist() == [10, 10]
    pixels = torch.randn(2, 1, 8, 8)
    assert family.encode(pixels) is pixels and family.decode(pixels) is pixels  # pixel space
    unet = build_class_unet(8, 1, size="debug").eval()
    x, t, null = family.example_inputs(unet, 2)
    with torch.no_grad():
        assert torch.equal(family.denoise(unet, x, t, null), unet(x, t, class_labels=null["class_labels"]).sample)


def test_family_for_picks_the_family_of_the_conditioner(teacher):
    text = TextConditioner(teacher.text_encoder, teacher.tokenizer)
    assert type(family_for(teacher.scheduler, teacher.vae, text)) is StableDiffusionFamily
    assert type(_class_family()) is ClassUNetFamily
    with pytest.raises(ValueError, match="no registered model family conditions with a Identity"):
        family_for(teacher.scheduler, None, torch.nn.Identity())
    with pytest.raises(TypeError, match="conditions with a TextConditioner; got ClassConditioner"):
        StableDiffusionFamily(teacher.scheduler, teacher.vae, ClassConditioner(10))


def test_pipeline_level_lookups(teacher, pipe):
    assert family_of(pipe) is StableDiffusionFamily and denoiser_of(pipe) is pipe.unet and native_size(pipe) == 32
    export = teacher.family.pipeline(teacher.denoiser, teacher.family.default_scheduler(), default_num_inference_steps=4)
    assert family_of(export) is StableDiffusionFamily and denoiser_of(export) is teacher.denoiser
    assert export.config.default_num_inference_steps == 4 and type(export.scheduler) is type(teacher.scheduler)
    family = _class_family()
    cls_pipe = family.pipeline(build_class_unet(8, 1, size="debug"), family.default_scheduler())
    assert family_of(cls_pipe) is ClassUNetFamily and native_size(cls_pipe) == 8
    with pytest.raises(ValueError, match="of no registered model family"):
        family_of(object())


def test_set_denoiser_replaces_the_denoiser_a_saved_pipeline_names(teacher, tmp_path):
    """``set_denoiser`` puts another network in the family's denoiser component, and ``model_index.json`` names its
    class; a family class that names no component says so."""
    from distill.families import ModelFamily, set_denoiser
    from distill.students.moe import timestep_moe_student

    export = teacher.family.pipeline(teacher.denoiser, teacher.family.default_scheduler())
    moe = timestep_moe_student(teacher.denoiser, num_experts=2).eval()
    set_denoiser(export, moe)
    assert denoiser_of(export) is moe and export.unet is moe
    export.save_pretrained(tmp_path / "moe")
    assert json.loads((tmp_path / "moe" / "model_index.json").read_text())["unet"] == ["distill.models.moe",
                                                                                       "TimestepMoEUNet"]
    family = _class_family()
    cls_pipe = family.pipeline(build_class_unet(8, 1, size="debug"), family.default_scheduler())
    other = build_class_unet(8, 1, size="debug")
    set_denoiser(cls_pipe, other)
    assert denoiser_of(cls_pipe) is other

    class Unnamed(ModelFamily):
        pass

    with pytest.raises(NotImplementedError, match="Unnamed names no denoiser_component"):
        Unnamed.denoiser_of(export)


def test_feature_blocks_and_example_inputs_of_the_sd_unet(teacher):
    blocks = teacher.family.feature_blocks(teacher.denoiser, mid_block=True)
    n = len(teacher.denoiser.down_blocks)
    assert list(blocks) == [f"down_blocks.{i}" for i in range(n)] + ["mid_block"] + [
        f"up_blocks.{i}" for i in range(len(teacher.denoiser.up_blocks))]
    assert blocks["mid_block"] is teacher.denoiser.mid_block
    x, t, cond = teacher.family.example_inputs(teacher.denoiser)
    assert x.shape == (1, 4, 8, 8) and cond["encoder_hidden_states"].shape == (1, 1, 32)
    with torch.no_grad():
        assert teacher.family.denoise(teacher.denoiser, x, t, cond).shape == x.shape
    with pytest.raises(ValueError, match="has no down_blocks/up_blocks"):
        teacher.family.feature_blocks(torch.nn.Linear(2, 2))


def test_a_method_refuses_a_teacher_without_a_family(teacher):
    import dataclasses

    from distill.methods.consistency import LatentConsistencyDistillation
    from distill.students.copies import copy_student

    with pytest.raises(ValueError, match="has no model family: load it with distill.families.load_teacher"):
        LatentConsistencyDistillation(dataclasses.replace(teacher, family=None), copy_student, torch.optim.AdamW)


def test_a_method_holds_its_own_family_on_the_teachers_parts(teacher):
    from distill.methods.consistency import LatentConsistencyDistillation
    from distill.students.copies import copy_student

    method = LatentConsistencyDistillation(teacher, copy_student, torch.optim.AdamW, cache_prompts=False)
    family = method.family
    assert isinstance(family, StableDiffusionFamily) and family is not teacher.family
    # the family's parts are the method's registered modules (they move with it; checkpoint keys unchanged)
    assert method.vae is family.vae is teacher.vae and method.conditioner is family.conditioner
    assert method.schedule is family.schedule and not family.conditioner.cache_enabled
    assert not any(k.startswith("family.") for k in method.state_dict())
