"""A method sampling with a scheduler other than its own uses that scheduler's conf options, as the
teacher's rows of the same sweep do (so same-named rows visit the same timesteps)."""

import torch
from diffusers import DDPMScheduler

from distill.inference.schedulers import scheduler_options
from distill.methods.consistency import LatentConsistencyDistillation
from distill.methods.diffusion import DiffusionTraining
from distill.models.conditioning import ClassConditioner
from distill.models.students import copy_student
from distill.models.teacher import load_teacher
from distill.models.unet import build_class_unet
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
