"""Review of issue 12's fixes: what a fresh pass over the current code found still wrong.

A progressive export's own sampler (``GridDDIMScheduler``, the training (t, t_prev) pairs, the last step to the
clean sample) must survive the sweeps that judge the export: ``distill.evaluate`` and the quality-cost
callback's teacher build their ``PipelineSampler`` with ``own=pipeline_defaults(folder).get("name")``
(distill/evaluate.py, distill/callbacks/quality_cost.py), and a sweep row named "ddim" must then sample on
the export's own grid, not with diffusers' ``DDIMScheduler``.
"""

import pytest
import torch

from distill.families import load_teacher
from distill.inference.loading import load_pipeline, pipeline_defaults
from distill.inference.schedulers import grid_timesteps, scheduler_options
from distill.methods.progressive import ProgressiveDistillation
from distill.metrics.quality_cost import PipelineSampler
from distill.students.copies import copy_student
from tests.sd_tiny import write_tiny_sd


@pytest.fixture(scope="module")
def progressive_export(tmp_path_factory):
    root = tmp_path_factory.mktemp("review12")
    teacher = load_teacher(str(write_tiny_sd(root / "pipe")))
    method = ProgressiveDistillation(teacher, lambda u: copy_student(u), torch.optim.AdamW, start_steps=8,
                                     final_steps=2, sampling={"name": "ddim", "guidance_scale": 1.0})
    return method.eval().export(root / "export")


@pytest.mark.parametrize("steps", [4, 16, 32])
def test_evaluate_sweeps_a_progressive_export_on_its_training_grid(progressive_export, steps):
    """The sampler exactly as distill.evaluate builds it (scheduler group ddim with its conf options, the export's
    distill.json for ``own``): "ddim" visits t_i = floor(i T / N) - 1 and its last step returns the clean sample.
    distill.json used to record the class name ("GridDDIMScheduler"), which never equals the sweep's "ddim", so the
    sweep fell back to diffusers' DDIM: off by one at 16 and 32 steps, and with this SD-style config
    (set_alpha_to_one=False) the last step stopped at alphas_cumprod[0] (sigma ~0.03) at every step count."""
    assert pipeline_defaults(progressive_export)["class"] == "GridDDIMScheduler"
    pipe = load_pipeline(str(progressive_export))
    sampler = PipelineSampler(pipe, {"ddim": scheduler_options("ddim")},
                              own=pipeline_defaults(progressive_export).get("name"))
    scheduler = sampler.scheduler("ddim")
    scheduler.set_timesteps(steps)
    T = pipe.scheduler.config.num_train_timesteps
    assert scheduler.timesteps.tolist() == grid_timesteps(torch.arange(steps, 0, -1), steps, T).tolist()

    g = torch.Generator().manual_seed(0)
    x, out = torch.randn(1, 4, 8, 8, generator=g), torch.randn(1, 4, 8, 8, generator=g)
    last = scheduler.step(out, scheduler.timesteps[-1], x)
    torch.testing.assert_close(last.prev_sample, last.pred_original_sample, rtol=0, atol=1e-6)


def test_sample_command_sampler_takes_its_conf_options(tmp_path, monkeypatch):
    """``distill.sample sampler=ddim`` names a conf/scheduler entry (schema: "a scheduler name (conf/scheduler)"),
    so the scheduler gets conf/scheduler/ddim.yaml's options, as every sweep row does (issue 12 item 7): trailing
    spacing. Today distill/sample.py builds ``make_scheduler(cfg.sampler, pipe.scheduler.config)`` without them,
    so a teacher whose config says "leading" with steps_offset=1 (Stable Diffusion's) samples 4 steps at
    751/501/251/1 instead of 999/749/499/249."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    import distill.inference.loading as loading
    import distill.sample as sample_cmd
    from distill.config.resolvers import register_resolvers
    from distill.config.schema import register_configs

    folder = write_tiny_sd(tmp_path / "pipe")
    loaded = {}

    def load(name_or_path):
        loaded["pipe"] = pipe = load_pipeline(name_or_path)
        pipe.scheduler.register_to_config(timestep_spacing="leading", steps_offset=1)  # a hub SD teacher's
        return pipe

    monkeypatch.setattr(loading, "load_pipeline", load)
    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=str(Path(sample_cmd.__file__).parent / "conf"), version_base="1.3"):
        cfg = compose(config_name="sample", overrides=[
            f"pipeline={folder}", f"out={tmp_path / 'grid.png'}", "prompts=[a handwritten digit three]",
            "num_seeds=1", "upscale=1", "sampler=ddim", "num_inference_steps=4"])
    sample_cmd.main(cfg)
    assert scheduler_options("ddim") == {"timestep_spacing": "trailing"}
    assert loaded["pipe"].scheduler.timesteps.tolist() == [999, 749, 499, 249]
