"""Every export samples as intended under diffusers' default call (issue 12, items 3 and 5).

For each method/student: ``DiffusionPipeline.from_pretrained(folder)`` then the default call with a seeded
generator runs one UNet forward per step at the intended step count (one evaluation per image per step for
every student; a CFG pass only where the model did not distil guidance), never raises, and the documented call
gives the images of the method's own sampler (``method.generate``).
"""

import json

import pytest
import torch
from diffusers import DDPMScheduler, DiffusionPipeline, StableDiffusionPipeline

from distill.diffusion.consistency import ddim_timesteps
from distill.families import load_teacher
from distill.methods.consistency import LatentConsistencyDistillation
from distill.methods.diffusion import DiffusionTraining
from distill.methods.progressive import ProgressiveDistillation
from distill.metrics.cost import NFECounter
from distill.models.conditioning import ClassConditioner, TextConditioner
from distill.students.copies import copy_student, lora_student
from distill.students.moe import timestep_moe_student, token_moe_student
from distill.students.sized import build_class_unet, build_text_unet
from tests.conftest import run_cli
from tests.sd_tiny import write_tiny_sd

CAPTIONS = ["a handwritten digit three", "a handwritten digit seven"]


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory):
    return write_tiny_sd(tmp_path_factory.mktemp("sd") / "pipe")


def _noise_schedule():
    return DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, clip_sample=False)


def _randomise(module: torch.nn.Module, names: tuple[str, ...], seed: int = 0) -> None:
    """Give zero-initialised inputs (the w projection, LoRA up-projections) weights, so that they matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if any(n in name for n in names):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


def diffusion_class(tiny_sd):
    torch.manual_seed(0)
    return DiffusionTraining(build_class_unet(8, 1, size="debug"), _noise_schedule(), ClassConditioner(10),
                             torch.optim.AdamW, sampling={"name": "ddim", "num_inference_steps": 3, "guidance_scale": 2.0,
                                                          "options": {"timestep_spacing": "trailing"}})


def diffusion_text(tiny_sd):
    torch.manual_seed(0)
    teacher = load_teacher(str(tiny_sd))
    return DiffusionTraining(build_text_unet(8, 4, size="debug", cross_attention_dim=32), _noise_schedule(),
                             TextConditioner(teacher.text_encoder, teacher.tokenizer), torch.optim.AdamW,
                             sampling={"name": "ddim", "num_inference_steps": 3, "guidance_scale": 2.0}, vae=teacher.vae)


def consistency_copy(tiny_sd):
    method = LatentConsistencyDistillation(load_teacher(str(tiny_sd)), lambda u: copy_student(u, time_cond_proj_dim=8),
                                           torch.optim.AdamW, num_ddim_timesteps=20,
                                           sampling={"name": "lcm", "num_inference_steps": 4, "guidance_scale": 3.0})
    _randomise(method.student, ("cond_proj",))
    return method


def consistency_lora(tiny_sd):
    torch.manual_seed(0)
    method = LatentConsistencyDistillation(load_teacher(str(tiny_sd)), lambda u: lora_student(u, rank=4),
                                           torch.optim.AdamW, ema_decay=0.0, num_ddim_timesteps=25,
                                           sampling={"name": "lcm", "num_inference_steps": 4, "guidance_scale": 3.0})
    _randomise(method.student, ("lora_B",))
    return method


def consistency_moe_token(tiny_sd):
    torch.manual_seed(0)
    method = LatentConsistencyDistillation(
        load_teacher(str(tiny_sd)), lambda u: token_moe_student(u, num_experts=2, time_cond_proj_dim=8),
        torch.optim.AdamW, sampling={"name": "lcm", "num_inference_steps": 2, "guidance_scale": 3.0})
    _randomise(method.student, ("cond_proj",))
    return method


def progressive_fixed(tiny_sd):
    return ProgressiveDistillation(load_teacher(str(tiny_sd)), lambda u: copy_student(u), torch.optim.AdamW,
                                   start_steps=8, final_steps=2, sampling={"name": "ddim", "guidance_scale": 1.0})


def progressive_w(tiny_sd):
    method = ProgressiveDistillation(load_teacher(str(tiny_sd)), lambda u: copy_student(u, time_cond_proj_dim=8),
                                     torch.optim.AdamW, start_steps=8, final_steps=2, guided_stage_steps=3,
                                     sampling={"name": "ddim", "guidance_scale": 3.0})
    _randomise(method.student, ("cond_proj",))
    return method


def progressive_moe_timestep(tiny_sd):
    torch.manual_seed(0)
    return ProgressiveDistillation(load_teacher(str(tiny_sd)), timestep_moe_student, torch.optim.AdamW,
                                   start_steps=16, final_steps=4, sampling={"name": "ddim", "guidance_scale": 1.0})


EXPORTS = [diffusion_class, diffusion_text, consistency_copy, consistency_lora, consistency_moe_token,
           progressive_fixed, progressive_w, progressive_moe_timestep]


@pytest.fixture(scope="module", params=EXPORTS, ids=lambda f: f.__name__)
def exported(request, tiny_sd, tmp_path_factory):
    """(method in eval mode, export folder, its distill.json), built once per student kind."""
    method = request.param(tiny_sd).eval()
    out = method.export(tmp_path_factory.mktemp("export") / request.param.__name__)
    return method, out, json.loads((out / "distill.json").read_text())


def _load(folder):
    pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# What each builder above configured, written out independently of the export code: (steps, guidance,
# UNet evaluations per step). Progressive exports take the current round's step count (start / 2), or the
# start count during the guided stage; a LoRA student distilled the guidance (no w input): guidance 1.
INTENDED = {"diffusion_class": (3, 2.0, 2), "diffusion_text": (3, 2.0, 2), "consistency_copy": (4, 3.0, 1),
            "consistency_lora": (4, 1.0, 1), "consistency_moe_token": (2, 3.0, 1), "progressive_fixed": (4, 1.0, 1),
            "progressive_w": (8, 3.0, 1), "progressive_moe_timestep": (8, 1.0, 1)}


def test_default_call_runs_the_intended_steps_with_one_evaluation_each(exported):
    method, out, info = exported
    pipe = _load(out)
    g = torch.Generator().manual_seed(0)
    with NFECounter(pipe.unet) as counter:
        images = (pipe(generator=g) if info.get("conditioning") == "class" else pipe(CAPTIONS[0], generator=g)).images
    steps, guidance, nfe = INTENDED[out.name]
    assert info["sampling"]["num_inference_steps"] == steps and info["sampling"]["guidance_scale"] == guidance
    assert len(images) == 1
    assert counter.calls == steps  # one UNet forward a step, at the intended count
    assert counter.examples == steps * nfe
    assert info["sampling"]["nfe_per_step"] == nfe and type(pipe).__name__ == info["pipeline"]
    assert getattr(pipe, "safety_checker", None) is None and not info.get("safety_checker")  # the teacher has none
    card = (out / "README.md").read_text()
    assert f"num_inference_steps={steps}" in card and info["pipeline"] in card


def test_documented_call_gives_the_method_samplers_images(exported):
    method, out, info = exported
    batch = {"caption": CAPTIONS, "label": torch.tensor([3, 7])}
    expected = method.generate(batch, torch.Generator().manual_seed(0))
    prompts = [3, 7] if info.get("conditioning") == "class" else CAPTIONS
    got = _load(out)(prompts, generator=torch.Generator().manual_seed(0), output_type="pt").images * 2 - 1
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _with_safety_checker(folder, out):
    """``folder``'s pipeline plus a random-weight StableDiffusionSafetyChecker and its CLIP image processor (the two
    components SD-1.5 ships beside the model), saved to ``out``."""
    from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker
    from transformers import CLIPConfig, CLIPImageProcessor

    torch.manual_seed(0)
    tower = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    checker = StableDiffusionSafetyChecker(CLIPConfig(
        text_config={**tower, "vocab_size": 64, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1},
        vision_config={**tower, "image_size": 32, "patch_size": 8}, projection_dim=8))
    extractor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    StableDiffusionPipeline.from_pretrained(folder, safety_checker=checker, feature_extractor=extractor).save_pretrained(out)
    return out


def test_export_keeps_the_teachers_safety_checker(tiny_sd, tmp_path):
    """A teacher with a safety checker gives an export that runs the same checker on its images, and says so."""
    folder = _with_safety_checker(tiny_sd, tmp_path / "teacher")
    teacher = StableDiffusionPipeline.from_pretrained(folder)
    out = progressive_fixed(folder).export(tmp_path / "export")
    pipe = _load(out)
    assert type(pipe.safety_checker) is type(teacher.safety_checker)
    theirs = teacher.safety_checker.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in pipe.safety_checker.state_dict().items())
    assert pipe.feature_extractor.to_dict() == teacher.feature_extractor.to_dict()
    result = pipe(CAPTIONS[0], generator=torch.Generator().manual_seed(0), output_type="pt")
    assert result.nsfw_content_detected == [False]  # the checker ran on the image (None without one)
    info = json.loads((out / "distill.json").read_text())
    assert info["safety_checker"] == "StableDiffusionSafetyChecker"
    assert "safety checker (`StableDiffusionSafetyChecker`" in (out / "README.md").read_text()
    assert DiffusionPipeline.from_pretrained(out, safety_checker=None).safety_checker is None  # the card's opt-out


def test_class_conditional_export_draws_labels_and_takes_indices(tiny_sd, tmp_path):
    pipe = _load(diffusion_class(tiny_sd).export(tmp_path / "export"))
    a = pipe(batch_size=2, generator=torch.Generator().manual_seed(5), output_type="pt").images
    # without labels the generator draws them first, then the noise: the same as passing those labels
    g = torch.Generator().manual_seed(5)
    drawn = torch.randint(10, (2,), generator=g)
    torch.testing.assert_close(pipe([str(v) for v in drawn.tolist()], generator=g, output_type="pt").images, a)
    for bad in (["seven"], [11], [-1]):
        with pytest.raises(ValueError, match=r"must be integers in \[0, 10\]"):
            pipe(bad)


def test_distilled_guidance_is_never_a_second_pass(tiny_sd, tmp_path):
    """A student that distilled CFG without a guidance input ignores guidance_scale (one pass); loaded as a
    stock StableDiffusionPipeline the folder still loads (diffusers' own class and defaults)."""
    out = progressive_fixed(tiny_sd).export(tmp_path / "export")
    pipe = _load(out)
    with NFECounter(pipe.unet) as counter:
        pipe(CAPTIONS, guidance_scale=7.5, num_inference_steps=2, generator=torch.Generator().manual_seed(0))
    assert counter.calls == 2 and counter.examples == 4
    from distill.inference.pipelines import DistillTextToImagePipeline

    stock = StableDiffusionPipeline.from_pretrained(out)
    assert type(stock) is StableDiffusionPipeline and isinstance(pipe, DistillTextToImagePipeline)


@pytest.mark.parametrize("num_ddim_timesteps", [10, 20, 25, 40, 50, 100])
def test_lcm_inference_timesteps_lie_on_the_training_grid(tiny_sd, num_ddim_timesteps):
    method = LatentConsistencyDistillation(load_teacher(str(tiny_sd)), lambda u: copy_student(u, time_cond_proj_dim=8),
                                           torch.optim.AdamW, num_ddim_timesteps=num_ddim_timesteps,
                                           sampling={"name": "lcm", "num_inference_steps": 4, "guidance_scale": 3.0})
    grid = set(ddim_timesteps(1000, num_ddim_timesteps).tolist())
    assert grid == set(method.solver_timesteps.tolist())
    scheduler = method.pipeline().scheduler
    for steps in (1, 2, 4, 8):
        scheduler.set_timesteps(steps)
        assert len(scheduler.timesteps) == steps and set(scheduler.timesteps.tolist()) <= grid, (steps, scheduler.timesteps)


@pytest.mark.parametrize("overrides, needle", [
    (["method.sigma_data=0.7"], "method.sigma_data=0.7 cannot be exported"),
    (["method.num_ddim_timesteps=2"], "scheduler.num_inference_steps=4 exceeds method.num_ddim_timesteps=2"),
])
def test_consistency_sampling_that_lcm_cannot_represent_is_rejected(compose, overrides, needle):
    from distill.config.validate import ConfigError, validate

    cfg = compose("+exp=consistency", *overrides)
    with pytest.raises(ConfigError, match=needle):
        validate(cfg)


def test_quality_cost_rows_of_training_go_into_each_exports_card(tiny_sd, tmp_path):
    """train.py after fit: every export (final, progressive rounds) gets the rows of the latest evaluation at its
    own step count, in distill.json and as a table in README.md."""
    from types import SimpleNamespace

    from distill.callbacks.quality_cost import QualityCostCallback
    from distill.train import _attach_quality_cost

    method = progressive_fixed(tiny_sd)  # a 4-step student; its 2-step round exported as well
    method.export(tmp_path / "export")
    method.export(tmp_path / "rounds" / "004-steps")
    method.round_index = 1
    method.export(tmp_path / "rounds" / "002-steps")
    row = {"model": "student", "scheduler": "ddim", "guidance_scale": 1.0, "nfe": 4.0, "fid": 9.0, "latency_s": 0.01}
    callback = QualityCostCallback(None, teacher=None)  # no evaluation set: only its history is read
    callback.history = [dict(row, steps=4, step=300, fid=7.5), dict(row, steps=4, step=200), dict(row, steps=2, step=600,
                                                                                                  fid=8.25)]
    _attach_quality_cost(SimpleNamespace(callbacks=[callback]), tmp_path)
    for folder, fid in (("export", 7.5), ("rounds/004-steps", 7.5), ("rounds/002-steps", 8.25)):
        info = json.loads((tmp_path / folder / "distill.json").read_text())
        assert [r["fid"] for r in info["quality_cost"]] == [fid]
        assert f"| {fid:g} |" in (tmp_path / folder / "README.md").read_text()  # the card's table


def test_sample_command_reads_the_intended_call(tiny_sd, tmp_path):
    """distill.sample without steps/guidance takes them from distill.json; a class export's rows are its classes."""
    import sys

    from PIL import Image

    out = diffusion_class(tiny_sd).export(tmp_path / "export")
    grid = tmp_path / "grid.png"
    proc = run_cli([sys.executable, "-m", "distill.sample", f"pipeline={out}", f"out={grid}", "num_seeds=2",
                           "upscale=1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "20 images, 3 steps, guidance 2.0" in proc.stdout
    assert Image.open(grid).size[1] > Image.open(grid).size[0]  # 10 class rows, 2 seed columns


def test_model_card_snippet_loads_every_component_in_a_fresh_process(tiny_sd, tmp_path):
    """The card's two lines are all a new process needs, for distill's own scheduler and MoE UNet classes."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    folders = [build(tiny_sd).eval().export(tmp_path / build.__name__)
               for build in (progressive_fixed, consistency_moe_token, progressive_moe_timestep)]
    script = "\n".join([
        "import sys, torch",
        "import distill.inference.pipelines",
        "from diffusers import DiffusionPipeline",
        "for folder in sys.argv[1:]:",
        "    pipe = DiffusionPipeline.from_pretrained(folder)",
        "    pipe.set_progress_bar_config(disable=True)",
        "    image = pipe('a test prompt', generator=torch.Generator().manual_seed(0), output_type='np').images",
        "    print(type(pipe).__name__, type(pipe.scheduler).__name__, type(pipe.unet).__name__, image.shape)",
    ])
    proc = subprocess.run([sys.executable, "-c", script, *map(str, folders)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert [line.split()[:3] for line in lines] == [
        ["DistillTextToImagePipeline", "GridDDIMScheduler", "UNet2DConditionModel"],
        ["DistillTextToImagePipeline", "LCMScheduler", "TokenMoEUNet"],
        ["DistillTextToImagePipeline", "GridDDIMScheduler", "TimestepMoEUNet"],
    ]


def test_class_pipeline_with_a_stochastic_scheduler_repeats_under_a_seed(tiny_sd, tmp_path):
    """The generator reaches the scheduler's step: DDPM's per-step noise repeats with the seed."""
    from diffusers import DDPMScheduler as Stochastic

    pipe = _load(diffusion_class(tiny_sd).eval().export(tmp_path / "class"))
    pipe.scheduler = Stochastic.from_config(pipe.scheduler.config)
    torch.manual_seed(1)
    a = pipe([3], generator=torch.Generator().manual_seed(0), output_type="pt").images
    torch.manual_seed(2)  # the global RNG must not matter
    b = pipe([3], generator=torch.Generator().manual_seed(0), output_type="pt").images
    c = pipe([3], generator=torch.Generator().manual_seed(1), output_type="pt").images
    assert torch.equal(a, b) and not torch.equal(a, c)
