"""The teacher-student base and the guidance math every distillation method shares.

The golden numbers were recorded with the methods as they stood before the base existed (commit 2441079, each
method with its own copy of the plumbing): the refactoring onto one base kept every loss and image.
``tests/characterise_methods.py`` checks the same bit for bit on full ``distill.train`` runs.
"""

import pytest
import torch

from distill.diffusion import cfg, guidance_condition, guidance_scale_embedding
from distill.families import load_teacher
from distill.methods.consistency import LatentConsistencyDistillation
from distill.methods.distillation import TeacherStudentDistillation
from distill.methods.progressive import ProgressiveDistillation
from distill.students.copies import copy_student, lora_student
from tests.sd_tiny import write_tiny_sd

CAPTIONS = ["a handwritten digit three", "a handwritten digit seven", "a handwritten digit one"]


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory):
    return write_tiny_sd(tmp_path_factory.mktemp("sd") / "pipe")


def _batch() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"pixel_values": torch.rand(3, 1, 32, 32, generator=g) * 2 - 1, "caption": CAPTIONS}


def _randomise(module: torch.nn.Module, names: tuple[str, ...]) -> None:
    """Give zero-initialised inputs (the w projection, LoRA up-projections) weights, so that they matter."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if any(n in name for n in names):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


def consistency_w(tiny_sd):
    method = LatentConsistencyDistillation(load_teacher(str(tiny_sd)), lambda u: copy_student(u, time_cond_proj_dim=8),
                                           torch.optim.AdamW, num_ddim_timesteps=20,
                                           guidance_scale_min=2.0, guidance_scale_max=6.0,  # as recorded
                                           sampling={"name": "lcm", "num_inference_steps": 2, "guidance_scale": 3.0})
    _randomise(method.student, ("cond_proj",))
    return method


def consistency_lora(tiny_sd):
    torch.manual_seed(0)
    method = LatentConsistencyDistillation(load_teacher(str(tiny_sd)), lambda u: lora_student(u, rank=4),
                                           torch.optim.AdamW, ema_decay=0.0, num_ddim_timesteps=20,
                                           guidance_scale_min=2.0, guidance_scale_max=6.0,  # as recorded
                                           sampling={"name": "lcm", "num_inference_steps": 2, "guidance_scale": 3.0})
    _randomise(method.student, ("lora_B",))
    return method


def progressive_fixed(tiny_sd):
    return ProgressiveDistillation(load_teacher(str(tiny_sd)), lambda u: copy_student(u), torch.optim.AdamW,
                                   start_steps=8, final_steps=2, sampling={"name": "ddim", "guidance_scale": 1.0})


def progressive_second_round(tiny_sd):
    method = progressive_fixed(tiny_sd)
    with torch.no_grad():
        for p in method.student.parameters():  # the round-1 student, now the teacher, differs from the original
            p.mul_(1.01)
    method.finish_round()
    return method


def progressive_guided_stage(tiny_sd):
    method = ProgressiveDistillation(load_teacher(str(tiny_sd)), lambda u: copy_student(u, time_cond_proj_dim=8),
                                     torch.optim.AdamW, start_steps=8, final_steps=2, guided_stage_steps=3,
                                     guidance_scale_min=2.0, guidance_scale_max=4.0,
                                     sampling={"name": "ddim", "guidance_scale": 3.0})
    _randomise(method.student, ("cond_proj",))
    return method


# (training loss on _batch() with generator seed 7, sum and sum of squares of the two images generate() gives with
# seed 0 and the default call), recorded at commit 2441079 (float32, CPU, one thread). The tolerance absorbs other
# CPUs' and thread counts' rounding; the bit-for-bit comparison is tests/characterise_methods.py's.
GOLDEN = {
    "consistency_w": (4.4757914543151855, -232.4569091796875, 286.9601135253906),
    "consistency_lora": (6.196557521820068, -223.613037109375, 292.5188293457031),
    "progressive_fixed": (6.2406005859375, -207.76156616210938, 227.0758514404297),
    "progressive_second_round": (0.03384042903780937, -203.12850952148438, 230.2957763671875),
    "progressive_guided_stage": (17.016653060913086, -209.38223266601562, 227.23135375976562),
}
BUILDERS = [consistency_w, consistency_lora, progressive_fixed, progressive_second_round, progressive_guided_stage]


def measure(method) -> tuple[float, float, float]:
    loss = method.loss(_batch(), torch.Generator().manual_seed(7))
    images = method.generate({"caption": CAPTIONS[:2]}, torch.Generator().manual_seed(0))
    return loss.item(), images.sum().item(), images.pow(2).sum().item()


@pytest.mark.parametrize("build", BUILDERS, ids=lambda f: f.__name__)
def test_losses_and_images_are_those_of_the_methods_before_the_base(tiny_sd, build):
    loss, total, energy = measure(build(tiny_sd).eval())
    golden = GOLDEN[build.__name__]
    assert loss == pytest.approx(golden[0], rel=1e-4)
    assert total == pytest.approx(golden[1], rel=1e-4)
    assert energy == pytest.approx(golden[2], rel=1e-4)


def test_cfg_conventions_agree_with_the_formula():
    g = torch.Generator().manual_seed(0)
    cond, uncond = torch.randn(3, 4, 2, 2, generator=g), torch.randn(3, 4, 2, 2, generator=g)
    scale = torch.tensor([1.0, 2.5, 7.5])
    expected = torch.stack([(1 + w) * c - w * u for c, u, w in zip(cond, uncond, scale - 1)])  # Ho & Salimans eq. 6
    torch.testing.assert_close(cfg(cond, uncond, scale), expected)
    torch.testing.assert_close(cfg(cond, uncond, w=scale - 1), expected)
    assert torch.equal(cfg(cond, uncond, 1.0), uncond + (cond - uncond))
    assert torch.equal(cfg(cond, uncond, w=0.0), cond)
    with pytest.raises(ValueError, match="exactly one of guidance_scale and w"):
        cfg(cond, uncond, 2.0, w=1.0)
    with pytest.raises(ValueError, match="exactly one of guidance_scale and w"):
        cfg(cond, uncond)


def test_guidance_condition_is_the_w_embedding_or_nothing():
    w, like = torch.tensor([0.5, 2.0]), torch.zeros(1, dtype=torch.float64)
    kwargs = guidance_condition(w, 16, like)
    assert list(kwargs) == ["timestep_cond"] and kwargs["timestep_cond"].dtype == torch.float64
    torch.testing.assert_close(kwargs["timestep_cond"], guidance_scale_embedding(w, 16).double())
    assert guidance_condition(w, None, like) == {}


@pytest.mark.parametrize("build", [consistency_w, progressive_fixed, progressive_second_round], ids=lambda f: f.__name__)
def test_the_teacher_stays_frozen_in_eval_mode(tiny_sd, build):
    """Lightning calls ``train()`` on the whole module after every validation: the frozen teacher, VAE and text
    encoder stay in eval mode (a later progressive teacher, a former student, included) and outside the optimizer."""
    method = build(tiny_sd).train()
    assert method.student.training
    for frozen in (method.teacher_unet, method.vae, method.conditioner.text_encoder):
        assert not frozen.training and not any(p.requires_grad for p in frozen.parameters())
    optimized = {id(p) for group in method.configure_optimizers().param_groups for p in group["params"]}
    assert optimized == {id(p) for p in method.student.parameters()}


def test_lora_teacher_is_the_base_unet_without_adapters(tiny_sd):
    method = consistency_lora(tiny_sd).eval()
    plain = load_teacher(str(tiny_sd)).denoiser
    g = torch.Generator().manual_seed(0)
    x, t, cond = torch.randn(2, 4, 8, 8, generator=g), torch.tensor([999, 250]), torch.randn(2, 7, 32, generator=g)
    with torch.no_grad():
        expected = plain(x, t, encoder_hidden_states=cond).sample
        student = method.student(x, t, encoder_hidden_states=cond).sample
    torch.testing.assert_close(method.teacher_forward(x, t, {"encoder_hidden_states": cond}), expected)
    assert not torch.allclose(student, expected)  # the adapters matter, and are back on afterwards
    with torch.no_grad():
        torch.testing.assert_close(method.student(x, t, encoder_hidden_states=cond).sample, student)


def _saved_keys(method) -> list[str]:
    checkpoint = {"state_dict": method.state_dict()}
    method.on_save_checkpoint(checkpoint)
    return list(checkpoint["state_dict"])


def test_checkpoints_leave_out_what_reloads_from_the_teacher(tiny_sd):
    def prefixes(keys):
        return {key.split(".")[0] for key in keys}

    assert prefixes(_saved_keys(consistency_w(tiny_sd))) == {"student", "target"}
    assert prefixes(_saved_keys(progressive_fixed(tiny_sd))) == {"student"}
    assert prefixes(_saved_keys(progressive_second_round(tiny_sd))) == {"student", "teacher_unet"}  # a trained teacher
    lora = _saved_keys(consistency_lora(tiny_sd))  # the adapters (in both names of the one UNet), not the base weights
    assert prefixes(lora) == {"student", "teacher_unet"}
    assert all("lora" in k for k in lora if k.startswith("teacher_unet."))


def test_methods_write_only_their_algorithm():
    """Sampling, export, validation and the teacher plumbing live in the base; a method defines none of them."""
    shared = {"export", "generate", "pipeline", "call_defaults", "validation_step", "encode", "save_pipeline",
              "teacher_forward", "teacher_cond_uncond", "text_conditions"}
    for cls in (LatentConsistencyDistillation, ProgressiveDistillation):
        assert issubclass(cls, TeacherStudentDistillation)
        assert not shared & set(vars(cls)), cls.__name__
