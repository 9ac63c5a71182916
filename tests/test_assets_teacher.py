"""The shipped digits teacher: a StableDiffusionPipeline that diffusers loads offline and that draws the prompted digit."""

import torch
from diffusers import DDIMScheduler, StableDiffusionPipeline

from distill.models.classifier import ImageClassifier
from distill.students.copies import copy_student
from distill.worlds.digits import asset_path
from distill.worlds.digits.data import caption_for
from distill.worlds.digits.metrics import prompted_digit_accuracy


def test_shipped_teacher_generates_the_prompted_digits():
    pipe = StableDiffusionPipeline.from_pretrained(asset_path("teacher"))
    assert isinstance(pipe.scheduler, DDIMScheduler) and pipe.safety_checker is None
    assert pipe.vae_scale_factor == 4 and pipe.unet.config.sample_size == 8
    pipe.set_progress_bar_config(disable=True)
    labels = torch.arange(10).repeat(2)
    images = pipe([caption_for(int(i)) for i in labels], num_inference_steps=10, guidance_scale=3.0, height=32,
                  width=32, generator=torch.Generator().manual_seed(0), output_type="pt").images
    assert images.shape == (20, 1, 32, 32)
    classifier = ImageClassifier.from_pretrained(asset_path("classifier")).eval()
    assert prompted_digit_accuracy(images * 2 - 1, labels, classifier) >= 0.9


def test_copy_student_starts_as_the_teacher_and_can_checkpoint():
    teacher = StableDiffusionPipeline.from_pretrained(asset_path("teacher")).unet
    student = copy_student(teacher, time_cond_proj_dim=16, gradient_checkpointing=True)
    assert student.is_gradient_checkpointing and student.config.time_cond_proj_dim == 16
    x, t = torch.randn(2, 4, 8, 8), torch.tensor([10, 500])
    hidden = torch.randn(2, 16, teacher.config.cross_attention_dim)
    with torch.no_grad():
        expected = teacher(x, t, encoder_hidden_states=hidden).sample
        got = student.eval()(x, t, encoder_hidden_states=hidden, timestep_cond=torch.randn(2, 16)).sample
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)  # zero-initialised w projection


def test_shipped_flow_teacher_samples_the_prompted_digits_through_the_stock_sd3_pipeline():
    """The flow-matching teacher (+exp=flow_teacher) loads with diffusers' own StableDiffusion3Pipeline as its model
    card says (distill.json "stock": T5 None, max_sequence_length), gives DistillSD3Pipeline's images, and draws the
    prompted digits."""
    import json

    from diffusers import (
        DiffusionPipeline,
        FlowMatchEulerDiscreteScheduler,
        StableDiffusion3Pipeline,
    )

    import distill.inference.pipelines  # noqa: F401  (registers DistillSD3Pipeline)

    folder = asset_path("flow_teacher")
    stock_entry = json.loads((folder / "distill.json").read_text())["stock"]
    stock = StableDiffusion3Pipeline.from_pretrained(folder, **{name: None for name in stock_entry["load"]})
    ours = DiffusionPipeline.from_pretrained(folder)
    assert isinstance(stock.scheduler, FlowMatchEulerDiscreteScheduler) and type(ours).__name__ == "DistillSD3Pipeline"
    labels = torch.arange(10).repeat(2)
    prompts = [caption_for(int(i)) for i in labels]
    images = []
    for pipe, call in ((stock, stock_entry["call"]), (ours, {})):
        pipe.set_progress_bar_config(disable=True)
        images.append(pipe(prompts, num_inference_steps=10, guidance_scale=3.0, height=32, width=32,
                           generator=torch.Generator().manual_seed(0), output_type="pt", **call).images)
    assert images[0].shape == (20, 1, 32, 32) and torch.equal(images[0], images[1])
    classifier = ImageClassifier.from_pretrained(asset_path("classifier")).eval()
    assert prompted_digit_accuracy(images[0] * 2 - 1, labels, classifier) >= 0.9


def test_the_shipped_assets_stay_within_25_mib():
    from distill.worlds.digits import ASSET_ROOT

    total = sum(f.stat().st_size for f in ASSET_ROOT.rglob("*") if f.is_file())
    assert total <= 25 * 2**20, f"{total / 2**20:.1f} MiB"


def test_the_flow_teacher_loads_with_the_context_it_samples_with():
    """load_teacher keeps the export's own T5 token count (its default_max_sequence_length, 1), not
    StableDiffusion3Pipeline's 256: a consistency run on the flow teacher distilled a teacher fed 255 zero tokens
    it never saw (1-step student FID 67.7, prompt accuracy 55%) before this."""
    from distill.families import load_teacher

    teacher = load_teacher(str(asset_path("flow_teacher")))
    assert teacher.family.conditioner.max_sequence_length == 1
    states, _ = teacher.family.conditioner.encode(["a handwritten digit seven"])
    assert states.shape == (1, 17, 128)
