"""Students built from the teacher: LoRA targets match diffusers' LCM-LoRA reference script."""

import copy

import torch
from diffusers import UNet2DConditionModel

from distill.students.copies import lora_student
from distill.worlds.digits import asset_path

# The target list of diffusers' examples/consistency_distillation/train_lcm_distill_lora_sd_wds.py.
REFERENCE_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2",
                     "conv1", "conv2", "conv_shortcut", "downsamplers.0.conv", "upsamplers.0.conv", "time_emb_proj")


def _teacher_unet() -> UNet2DConditionModel:
    return UNet2DConditionModel.from_pretrained(asset_path("teacher"), subfolder="unet").eval()


def test_lora_adapts_exactly_the_reference_modules_including_the_samplers():
    teacher = _teacher_unet()
    expected = {name for name, _ in teacher.named_modules()
                if any(name == t or name.endswith("." + t) for t in REFERENCE_TARGETS)}
    student = lora_student(copy.deepcopy(teacher), rank=4)
    adapted = {name.rsplit(".lora_A", 1)[0] for name, _ in student.named_modules() if name.endswith(".lora_A")}
    assert adapted == expected
    samplers = {n for n in adapted if "samplers.0.conv" in n}
    assert samplers == {"down_blocks.0.downsamplers.0.conv", "down_blocks.1.downsamplers.0.conv",
                        "up_blocks.0.upsamplers.0.conv", "up_blocks.1.upsamplers.0.conv"}
    trainable = {n for n, p in student.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


def test_lora_student_starts_as_the_teacher():
    teacher = _teacher_unet()
    student = lora_student(copy.deepcopy(teacher), rank=4).eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 8, 8, generator=g)
    cond = torch.randn(2, 8, teacher.config.cross_attention_dim, generator=g)
    t = torch.tensor([10, 700])
    with torch.no_grad():
        assert torch.equal(student(x, t, cond).sample, teacher(x, t, cond).sample)
