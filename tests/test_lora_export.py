"""A LoRA student's ``lora/pytorch_lora_weights.safetensors`` is read whole by diffusers' own loader (issue 30,
item 1): in a fresh process, the teacher pipeline plus ``load_lora_weights`` adapts every module the student
adapted, at the student's alpha / rank, and gives the merged export's UNet output and images."""

import json
import subprocess
import sys

import torch
from peft.tuners.lora import LoraLayer

from distill.families import load_teacher
from distill.methods.consistency import LatentConsistencyDistillation
from distill.methods.consistency_training import ConsistencyTraining
from distill.students.copies import lora_student
from tests.conftest import ROOT
from tests.sd_tiny import write_tiny_sd
from tests.test_exports import CAPTIONS, _randomise

RANK, ALPHA = 4, 16  # alpha != rank: a loader that drops alpha scales the adapters by 1 instead of 4

# The user's call, in a new process: the teacher, its LoRA loaded by diffusers, the export's scheduler and call.
LOAD = r"""
import json, sys, torch
from peft.tuners.lora import LoraLayer
import distill.inference.pipelines  # noqa: F401  (the export's pipeline class)
from diffusers import DiffusionPipeline


def check(base, export):
    merged = DiffusionPipeline.from_pretrained(export)
    pipe = DiffusionPipeline.from_pretrained(base, scheduler=merged.scheduler)
    g = torch.Generator().manual_seed(0)
    x, cond, t = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 8, 32, generator=g), torch.tensor([10, 700])
    with torch.no_grad():
        teacher_out = pipe.unet(x, t, cond).sample
        pipe.load_lora_weights(export + "/lora")
        loaded_out, merged_out = pipe.unet(x, t, cond).sample, merged.unet(x, t, cond).sample
    call = json.load(open(export + "/distill.json"))["sampling"]
    size = merged.unet.config.sample_size * merged.vae_scale_factor
    kwargs = dict(num_inference_steps=call["num_inference_steps"], guidance_scale=call["guidance_scale"],
                  height=size, width=size, output_type="pt")
    images = [p(CAPTIONS, generator=torch.Generator().manual_seed(0), **kwargs).images for p in (pipe, merged)]
    layers = [m for _, m in pipe.unet.named_modules() if isinstance(m, LoraLayer)]
    return {"adapted": sorted(n for n, m in pipe.unet.named_modules() if isinstance(m, LoraLayer)),
            "scaling": sorted({s for m in layers for s in m.scaling.values()}),
            "effect": (merged_out - teacher_out).abs().max().item(),
            "unet_diff": (loaded_out - merged_out).abs().max().item(),
            "image_diff": (images[0] - images[1]).abs().max().item()}


for export in sys.argv[2:]:
    print(json.dumps(check(sys.argv[1], export)))
""".replace("CAPTIONS", repr(CAPTIONS))


def lcm(teacher, student):
    return LatentConsistencyDistillation(teacher, student, torch.optim.AdamW, ema_decay=0.0, num_ddim_timesteps=25,
                                         sampling={"name": "lcm", "num_inference_steps": 4, "guidance_scale": 3.0})


def ect(teacher, student):  # +exp=consistency_training student=lora
    return ConsistencyTraining(teacher, student, torch.optim.AdamW)


def test_load_lora_weights_on_the_teacher_gives_the_merged_export(tmp_path):
    tiny_sd = write_tiny_sd(tmp_path / "sd")
    exports, adapted = [], []
    for build in (lcm, ect):
        torch.manual_seed(0)
        method = build(load_teacher(str(tiny_sd)), lambda u: lora_student(u, rank=RANK, alpha=ALPHA))
        _randomise(method.student, ("lora_B",))  # trained adapters: up-projections away from their zero start
        adapted.append(sorted(n for n, m in method.student.named_modules() if isinstance(m, LoraLayer)))
        exports.append(str(method.eval().export(tmp_path / build.__name__)))

    proc = subprocess.run([sys.executable, "-c", LOAD, str(tiny_sd), *exports], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # what diffusers (keys it dropped) and peft (targets the file does not fill) warn of a partial load
    for warning in ("unexpected keys", "inconsistency was discovered"):
        assert warning not in proc.stderr, proc.stderr[-3000:]
    for names, line in zip(adapted, proc.stdout.strip().splitlines()[-2:], strict=True):
        got = json.loads(line)
        assert len(names) == 79 and got["adapted"] == names  # attention to_q/k/v/out.0 among them
        assert got["scaling"] == [ALPHA / RANK]
        assert got["effect"] > 0.5  # the adapters matter: dropping some would show
        assert got["unet_diff"] < 1e-5 and got["image_diff"] < 1e-5, got
