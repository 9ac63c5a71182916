"""Progressive distillation on a flow-matching teacher (the SD3 stand-in, tests/sd3_tiny.py): the student grid
against FlowMatchEulerDiscreteScheduler given the trailing sigmas, the target against a hand computation from the
transformer's own calls (two guided Euler steps, the velocity of the straight line to where they land), the SNR
weighting of a velocity loss against its x0 form, and two rounds through the CLI whose exports sample through
DiffusionPipeline.from_pretrained and the stock StableDiffusion3Pipeline with the model card's sigmas."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler

import distill.inference.pipelines  # noqa: F401  (registers distill's export classes, as a user loading an export does)
from distill.diffusion import snr_weight
from distill.families import load_teacher
from distill.families.base import trailing_sigmas
from tests.conftest import run_train
from tests.sd3_tiny import SD3_SHIFT, write_tiny_sd3
from tests.test_consistency_flow import _transformer, stock_sd3

PROMPTS = ["a handwritten digit three", "a handwritten digit seven"]
GUIDANCE = 2.5


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    return write_tiny_sd3(tmp_path_factory.mktemp("sd3") / "pipe")


def _method(folder, **options):
    from distill.methods.progressive import ProgressiveDistillation
    from distill.students.copies import copy_student

    return ProgressiveDistillation(load_teacher(str(folder)), copy_student,
                                   optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                                   **{"start_steps": 8, "final_steps": 2, "guidance_scale": GUIDANCE, **options})


@pytest.fixture(scope="module")
def method(sd3_dir):
    return _method(sd3_dir).eval()


def test_the_student_grid_is_the_euler_schedulers_on_the_trailing_sigmas(method):
    """t_i = shift(i / N): FlowMatchEulerDiscreteScheduler(shift 3).set_timesteps(sigmas=linspace(1, 1/N, N)) gives
    t_N..t_1 and the final 0 bit for bit; the 2N-step teacher grid holds every student point."""
    for n in (1, 2, 4, 8):
        sched = FlowMatchEulerDiscreteScheduler(shift=SD3_SHIFT)
        sched.set_timesteps(sigmas=trailing_sigmas(n))
        ours = method._times(torch.arange(n, -1, -1), n)
        assert torch.equal(ours, sched.sigmas), n
        assert ours[0].item() == 1.0 and ours[-1].item() == 0.0
        assert torch.equal(method._times(2 * torch.arange(n + 1), 2 * n), method._times(torch.arange(n + 1), n))
    assert trailing_sigmas(4) == [1.0, 0.75, 0.5, 0.25]


def test_the_target_is_the_velocity_to_where_two_guided_teacher_euler_steps_land(method):
    """Round 0, student steps 4 (teacher 8): at student point i, x_t = (1 - t) x0 + t eps; the teacher's guided
    velocity v_u + s (v_c - v_u) (StableDiffusion3Pipeline's CFG) takes two Euler steps t -> t_mid -> t_end, and the
    student's velocity target is (x_end - x_t) / (t_end - t): its one Euler step lands there too."""
    method.round_index, steps = 0, 4
    assert method.student_steps == steps
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    cond, uncond = method.text_conditions({"caption": PROMPTS}, 2, "cpu")
    i = torch.tensor([4, 2])  # the first student step (from pure noise) and one in the middle
    scale = torch.full((2,), GUIDANCE)
    with torch.no_grad():
        x_t, t, target = method.student_target(x0, eps, i, cond, uncond, scale, {})
        grid = torch.tensor([SD3_SHIFT * u / (1 + (SD3_SHIFT - 1) * u) for u in np.arange(9) / 8], dtype=torch.float32)
        t_h, t_mid, t_end = grid[2 * i], grid[2 * i - 1], grid[2 * i - 2]
        torch.testing.assert_close(t, t_h, rtol=0, atol=2e-7)
        b = (-1, 1, 1, 1)
        x = (1 - t_h.view(b)) * x0 + t_h.view(b) * eps
        torch.testing.assert_close(x_t, x, rtol=1e-6, atol=1e-6)

        def guided(x, t):
            v_c = _transformer(method.teacher_unet, x, t, cond)
            v_u = _transformer(method.teacher_unet, x, t, uncond)
            return v_u + GUIDANCE * (v_c - v_u)

        x_mid = x + (t_mid - t_h).view(b) * guided(x, t_h)
        x_end = x_mid + (t_end - t_mid).view(b) * guided(x_mid, t_mid)
        expected = (x_end - x) / (t_end - t_h).view(b)
    torch.testing.assert_close(target, expected, rtol=1e-4, atol=1e-5)
    assert (target - (eps - x0)).abs().mean() > 1e-3  # the teacher's path, not the data's own velocity


def test_the_truncated_snr_weight_of_a_velocity_loss_is_the_x0_loss():
    """Salimans & Ho's max(SNR, 1) ||x0 - x0_hat||^2 expressed on a velocity v = eps - x0 at x_t = (1 - t) x0 + t eps:
    x0_hat = x_t - t v_hat, so the weight on ||v - v_hat||^2 is max(SNR, 1) t^2; checked on random predictions."""
    g = torch.Generator().manual_seed(0)
    t = torch.tensor([0.05, 0.3, 0.5, 0.9, 1.0])
    v, v_hat, x_t = (torch.randn(5, 4, 8, 8, generator=g) for _ in range(3))
    snr = (1 - t) ** 2 / t ** 2
    x0_err = ((x_t - t.view(-1, 1, 1, 1) * v) - (x_t - t.view(-1, 1, 1, 1) * v_hat)).pow(2).flatten(1).mean(1)
    v_err = (v - v_hat).pow(2).flatten(1).mean(1)
    for weighting, w_x0 in (("truncated_snr", snr.clamp(min=1)), ("min_snr", snr.clamp(max=5.0)),
                            ("none", None)):
        weighted = snr_weight(snr, "flow_prediction", weighting) * v_err
        if w_x0 is not None:
            torch.testing.assert_close(weighted, w_x0 * x0_err, rtol=1e-5, atol=1e-6)
        else:
            torch.testing.assert_close(weighted, v_err)


def test_what_a_flow_student_cannot_do_is_refused_before_compute(sd3_dir, compose, tmp_path):
    """+exp=progressive (scheduler=ddim) on the SD3 folder, a w-conditioned stage and min-SNR weighting: refused at
    validation, naming the setting and the fix; on the command line exit 2 before a run directory exists (the export
    used to fail only after a round of training)."""
    from distill.config.validate import ConfigError, validate

    teacher = f"teacher.pretrained_model_name_or_path={sd3_dir}"
    for override, message in (("scheduler=ddim", "scheduler.name='ddim' on the flow-matching teacher .*use "
                                                 "scheduler=flow_euler"),
                              ("method.guided_stage_steps=10", "method.guided_stage_steps=10 on the flow-matching "
                                                               "teacher .*set method.guided_stage_steps=0"),
                              ("method.loss_weighting=min_snr", "the SNR is 0 at t = 1, so the student's first step")):
        with pytest.raises(ConfigError, match=message):
            validate(compose("+exp=progressive_flow", teacher, override))
    run_dir = tmp_path / "run"
    proc = run_train("+exp=progressive_flow", teacher, "scheduler=ddim", f"hydra.run.dir={run_dir}", "logger=csv",
                     timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "use scheduler=flow_euler" in proc.stderr, proc.stderr[-2000:]
    assert not run_dir.exists()


def test_a_vp_student_prediction_on_a_flow_teacher_and_a_resolution_shifted_teacher_are_refused(sd3_dir, tmp_path):
    with pytest.raises(ValueError, match="student_prediction_type='v_prediction' on the flow-matching teacher .*"
                                         "set method.student_prediction_type=flow_prediction"):
        _method(sd3_dir, student_prediction_type="v_prediction")
    folder = write_tiny_sd3(tmp_path / "dynamic")
    FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True).save_pretrained(folder / "scheduler")
    with pytest.raises(ValueError, match="shifts the sigmas by the image's resolution .*use_dynamic_shifting=false"):
        _method(folder)


FAST = ["callbacks.quality_cost=null", "data.batch_size=4", "method.start_steps=8", "method.final_steps=2",
        "method.steps_per_round=1", "trainer.max_steps=2", "trainer.log_every_n_steps=1",
        "trainer.limit_val_batches=1", "trainer.val_check_interval=2", "checkpoint.every_n_train_steps=1",
        "sample_grid_seeds=1", "logger=csv"]


def test_two_cli_rounds_on_the_sd3_teacher_export_students_that_sample_on_their_grid(sd3_dir, tmp_path):
    """+exp=progressive_flow on the SD3 folder, start 8 -> 4 -> 2 steps, one step a round (the second round's teacher
    is the first round's velocity student): each round exports a
    DistillSD3Pipeline on FlowMatchEulerDiscreteScheduler with sigma_spacing "trailing"; from_pretrained samples the
    2-step student with 2 transformer passes of 1 example (guidance distilled) at sigmas shift(1), shift(1/2), and the
    stock StableDiffusion3Pipeline, called with the card's arguments (sigmas included) in a process that does not
    import distill, gives the same images."""
    from distill.metrics.cost import NFECounter

    run_dir = tmp_path / "run"
    proc = run_train("+exp=progressive_flow", f"teacher.pretrained_model_name_or_path={sd3_dir}", *FAST,
                     f"hydra.run.dir={run_dir}", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (run_dir / "rounds").iterdir()) == ["002-steps", "004-steps"]
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    assert state["progressive"] == {"round_index": 1, "guidance_scale": 1.0, "teacher_prediction_type": "flow_prediction"}
    export = run_dir / "export"
    index = json.loads((export / "model_index.json").read_text())
    assert index["_class_name"] == "DistillSD3Pipeline"
    assert index["scheduler"] == ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    assert (index["default_num_inference_steps"], index["guidance_distilled"], index["sigma_spacing"]) == \
        (2, True, "trailing")
    info = json.loads((export / "distill.json").read_text())
    assert info["method"] == "progressive" and info["prediction_type"] == "flow_prediction"
    assert info["stock"]["call"] == {"max_sequence_length": index["default_max_sequence_length"], "sigmas": [1.0, 0.5]}
    pipe = DiffusionPipeline.from_pretrained(export)
    pipe.set_progress_bar_config(disable=True)
    seen = []
    with NFECounter(pipe.transformer) as counter:
        ours = pipe(PROMPTS[0], generator=torch.Generator().manual_seed(0), output_type="pt",
                    callback_on_step_end=lambda p, i, t, kw: seen.append(float(t)) or kw).images
    assert (counter.calls, counter.examples) == (2, 2) and ours.shape == (1, 1, 32, 32)
    assert seen == pytest.approx([1000.0, 1000.0 * SD3_SHIFT * 0.5 / (1 + (SD3_SHIFT - 1) * 0.5)])
    card = (export / "README.md").read_text()
    assert "num_inference_steps=2, guidance_scale=1.0, max_sequence_length=" in card and "sigmas=[1.0, 0.5]" in card
    assert "for M steps pass `num_inference_steps=M, sigmas=numpy.linspace(1, 1 / M, M).tolist()`" in card
    call = {"num_inference_steps": 2, "guidance_scale": 1.0, **info["stock"]["call"]}
    classes, theirs = stock_sd3(tmp_path, export, info["stock"]["load"], call, PROMPTS[0])
    assert classes == ["StableDiffusion3Pipeline", "FlowMatchEulerDiscreteScheduler"] and torch.equal(ours, theirs)
    # without the card's sigmas the stock scheduler's own 2 points (1 and its smallest sigma) give other images
    call.pop("sigmas")
    _, other = stock_sd3(tmp_path, export, info["stock"]["load"], call, PROMPTS[0], name="y")
    assert not torch.allclose(ours, other, atol=1e-3)


def test_the_server_steps_a_trailing_export_on_its_grid(sd3_dir):
    """The serving engine sets the scheduler through the family bound to the pipeline (``set_timesteps``): a
    pipeline registered with sigma_spacing "trailing" gets the sigmas its call would use, the stock spacing
    otherwise; a copy of the family keeps it."""
    from distill.families.sd3 import StableDiffusion3Family

    teacher = load_teacher(str(sd3_dir))
    expected = {}
    for spacing in ("trailing", "scheduler"):
        pipe = teacher.family.pipeline(teacher.denoiser, FlowMatchEulerDiscreteScheduler(shift=SD3_SHIFT),
                                       default_num_inference_steps=2, default_guidance_scale=1.0,
                                       guidance_distilled=True, sigma_spacing=spacing)
        family = StableDiffusion3Family.from_pipeline(pipe).copy()
        sched = FlowMatchEulerDiscreteScheduler(shift=SD3_SHIFT)
        family.set_timesteps(sched, 2, 8, 8)
        expected[spacing] = sched.sigmas
    reference = FlowMatchEulerDiscreteScheduler(shift=SD3_SHIFT)
    reference.set_timesteps(sigmas=[1.0, 0.5])
    assert torch.equal(expected["trailing"], reference.sigmas) and expected["trailing"][1].item() == pytest.approx(0.75)
    reference.set_timesteps(2)
    assert torch.equal(expected["scheduler"], reference.sigmas) and expected["scheduler"][1].item() < 0.01
    with pytest.raises(ValueError, match="sigma_spacing='leading'; use one of"):
        teacher.family.pipeline(teacher.denoiser, FlowMatchEulerDiscreteScheduler(), sigma_spacing="leading")
