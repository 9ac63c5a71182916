"""A method sampling with a scheduler other than its own uses that scheduler's conf options, as the
teacher's rows of the same sweep do (so same-named rows visit the same timesteps)."""

import torch
from diffusers import DDPMScheduler

from distill.families import load_teacher
from distill.inference.schedulers import scheduler_options
from distill.methods.consistency import LatentConsistencyDistillation
from distill.methods.diffusion import DiffusionTraining
from distill.models.conditioning import ClassConditioner
from distill.students.copies import copy_student
from distill.students.sized import build_class_unet
from tests.sd_tiny import write_tiny_sd


def _leading(scheduler) -> list[int]:
    scheduler.set_timesteps(4)
    return scheduler.timesteps.tolist()


def test_other_schedulers_of_a_method_take_their_conf_options(tmp_path):
    assert scheduler_options("ddim") == {"timestep_spacing": "trailing"}
    teacher = load_teacher(str(write_tiny_sd(tmp_path / "pipe")))
    teacher.scheduler.register_to_config(timestep_spacing="leading", steps_offset=1)  # a hub SD teacher's
    lcm = LatentConsistencyDistillation(teacher, lambda u: copy_student(u, time_cond_proj_dim=8), torch.optim.AdamW,
                                        num_ddim_timesteps=20)
    assert _leading(lcm.pipeline("ddim").scheduler) == [999, 749, 499, 249]  # trailing, not 751/501/251/1

    noise = DDPMScheduler(timestep_spacing="leading", steps_offset=1)
    diffusion = DiffusionTraining(build_class_unet(8, 1, size="debug"), noise, ClassConditioner(10), torch.optim.AdamW,
                                  sampling={"name": "ddpm", "num_inference_steps": 4, "guidance_scale": 1.0})
    assert _leading(diffusion.sampling_scheduler("ddim")) == [999, 749, 499, 249]


def test_an_exports_own_scheduler_is_kept_by_sweeps(tmp_path):
    """distill.evaluate on a progressive export: "ddim" keeps its GridDDIMScheduler (training grid)."""
    from distill.callbacks.quality_cost import MethodSampler
    from distill.inference.schedulers import GridDDIMScheduler
    from distill.methods.progressive import ProgressiveDistillation
    from distill.metrics.quality_cost import PipelineSampler

    teacher = load_teacher(str(write_tiny_sd(tmp_path / "pipe")))
    method = ProgressiveDistillation(teacher, lambda u: copy_student(u), torch.optim.AdamW, start_steps=64,
                                     final_steps=16)
    pipe = method.pipeline()
    from distill.inference.loading import pipeline_defaults

    own = pipeline_defaults(method.export(tmp_path / "export"))["name"]  # what distill.evaluate passes
    assert own == "ddim"
    assert isinstance(PipelineSampler(pipe, own=own).scheduler("ddim"), GridDDIMScheduler)
    off_grid = PipelineSampler(pipe).scheduler("ddim")  # what a sweep used to build: diffusers' DDIM
    off_grid.set_timesteps(32)
    ours = PipelineSampler(pipe, own="ddim").scheduler("ddim")
    ours.set_timesteps(32)
    assert off_grid.timesteps.tolist() != ours.timesteps.tolist()

    lora_like = LatentConsistencyDistillation(teacher, lambda u: u, torch.optim.AdamW, ema_decay=0.0)
    assert lora_like.sampling["guidance_scale"] == 3.0
    assert MethodSampler(lora_like).default_guidance_scale == 1.0  # a student without a w input distilled it
