"""Training-free accelerators: DeepCache equals plain sampling at interval 1 and the DeepCache package's
``DeepCacheSDHelper`` on a Stable Diffusion layout, and computes only the shallow branch on cached steps; a
forecast that predicts nothing equals plain sampling, the Taylor forecast is TaylorSeer's expansion, the fitted
regressor recovers a known linear trajectory; every accelerator runs with DDIM, DPM-Solver and LCM and with MoE
students; NFE counts only computed calls; bad settings fail naming the key."""

import math
from types import SimpleNamespace

import pytest
import torch
from diffusers import UNet2DConditionModel

from distill.accelerate import (
    ACCELERATE_CONF,
    DeepCache,
    Forecast,
    SamplingContext,
    accelerated,
    accelerated_denoiser,
    context_of,
    preset,
)
from distill.accelerate.deepcache import branch_layers, full_steps
from distill.accelerate.forecast import (
    fit_forecaster,
    load_forecaster,
    real_steps,
    save_forecasters,
)
from distill.metrics.cost import NFECounter
from distill.utils.flops import count_flops
from distill.worlds.digits import asset_path
from tests.conftest import run_cli

PROMPTS = ["a handwritten digit 3", "a handwritten digit 7"]


@pytest.fixture(scope="module")
def pipe():
    from distill.inference.loading import load_pipeline

    pipe = load_pipeline(str(asset_path("teacher")))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _sample(pipe, accelerator=None, steps=8, scheduler=None, **kw):
    from distill.inference.schedulers import make_scheduler, scheduler_options

    if scheduler is not None:
        pipe.scheduler = make_scheduler(scheduler, pipe.scheduler.config, **scheduler_options(scheduler))
    with accelerated(pipe, accelerator), NFECounter(pipe.unet) as counter:
        images = pipe(PROMPTS, num_inference_steps=steps, generator=torch.Generator().manual_seed(0),
                      output_type="pt", **kw).images
    return images, counter.calls


@pytest.mark.parametrize("scheduler", ["ddim", "dpmsolver"])
def test_interval_1_and_no_prediction_equal_plain_sampling_and_hooks_go_away(pipe, scheduler):
    plain, calls = _sample(pipe, None, scheduler=scheduler)
    for accelerator in (DeepCache(interval=1), Forecast(interval=1), Forecast(steps=list(range(8)))):
        images, n = _sample(pipe, accelerator, scheduler=scheduler)
        assert torch.equal(images, plain) and n == calls == 8, accelerator.describe()
    assert not getattr(pipe.unet, "_diffusers_hook", None) or not pipe.unet._diffusers_hook.hooks
    assert "forward" not in pipe.unet.__dict__  # the class's forward again, no wrapper left behind
    assert "progress_bar" not in pipe.__dict__ and context_of(pipe.unet) is None
    again, _ = _sample(pipe, None, scheduler=scheduler)
    assert torch.equal(again, plain)


def sd_layout_unet() -> UNet2DConditionModel:
    """Stable Diffusion 1.5's block layout (4 levels, 2 layers a block, 3 an up block) at a tiny width."""
    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, block_out_channels=(8, 16, 16, 16), layers_per_block=2,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16, attention_head_dim=2, norm_num_groups=4).eval()


def _loop(unet, scheduler, steps, accelerator=None):
    """A denoising loop as a pipeline runs it (positional timestep, as DeepCacheSDHelper reads it), with
    ``accelerator`` on ``unet`` for its ``steps`` calls."""
    scheduler.set_timesteps(steps)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 16, 16, generator=generator)
    text = torch.randn(2, 5, 16, generator=generator)
    outs = []
    with accelerated_denoiser(unet, accelerator, steps), torch.no_grad():
        for t in scheduler.timesteps:
            out = unet(x, t, encoder_hidden_states=text).sample
            outs.append(out)
            x = scheduler.step(out, t, x).prev_sample
    return torch.stack(outs)


@pytest.mark.parametrize("branch", [0, 1, 2, 4, 7])
def test_deepcache_equals_the_deepcache_package_on_a_stable_diffusion_layout(branch):
    from DeepCache.extension.deepcache import DeepCacheSDHelper  # the reference (a dev dependency)
    from diffusers import DDIMScheduler

    unet, scheduler = sd_layout_unet(), DDIMScheduler()
    helper = DeepCacheSDHelper(pipe=SimpleNamespace(unet=unet, scheduler=scheduler))
    helper.set_params(cache_interval=3, cache_branch_id=branch)
    helper.enable()
    reference = _loop(unet, scheduler, 10)
    helper.disable()
    plain = _loop(unet, scheduler, 10)
    mine = _loop(unet, scheduler, 10, DeepCache(interval=3, branch=branch))
    assert torch.equal(mine, reference)
    assert torch.equal(mine[0], plain[0]) and not torch.equal(mine[1], plain[1])  # step 1 is the first cached


def test_cached_steps_run_only_the_shallow_branch_and_save_flops():
    unet = sd_layout_unet()
    layers, skips = branch_layers(unet)
    assert skips == 12  # conv_in + 4 levels x 2 layers + 3 downsamplers, SD's 12 skip connections
    assert [d for n, _, d in layers if n.startswith("up_blocks.3.resnets")] == [2, 1, 0]
    assert [d for n, _, d in layers if n.startswith("down_blocks.0")] == [1, 1, 2, 2, 3]
    calls = {}  # computed calls: a layer's first leaf module runs only when the layer computes
    for name, module, _ in layers:
        next(m for m in module.modules() if not list(m.children())).register_forward_pre_hook(
            lambda m, a, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    accelerator = DeepCache(interval=2, branch=1)
    from diffusers import DDIMScheduler

    _loop(unet, DDIMScheduler(), 4, accelerator)
    deep = {n for n, _, d in layers if d > 1}
    assert all(calls[n] == 2 for n in deep) and all(calls[n] == 4 for n in calls if n not in deep)
    x, t, text = torch.randn(1, 4, 16, 16), torch.tensor(10), torch.randn(1, 5, 16)
    with accelerated_denoiser(unet, accelerator, 2):
        full = count_flops(lambda: unet(x, t, encoder_hidden_states=text))
        cached = count_flops(lambda: unet(x, t, encoder_hidden_states=text))
    assert cached < 0.5 * full


def deepcache_sample_from_quad_center():
    """DeepCache's own non-uniform schedule, read out of the installed package's source (its modules no longer
    import under this diffusers): the function ``sample_from_quad_center`` of ``sd/pipeline_stable_diffusion.py``,
    executed alone with numpy."""
    import ast
    import importlib.util
    from pathlib import Path

    import numpy as np

    spec = importlib.util.find_spec("DeepCache")
    path = Path(spec.submodule_search_locations[0]) / "sd" / "pipeline_stable_diffusion.py"
    tree = ast.parse(path.read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "sample_from_quad_center"]
    namespace = {"np": np}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
    return namespace["sample_from_quad_center"]


@pytest.mark.filterwarnings("ignore::numpy.exceptions.ComplexWarning")  # the reference casts complex to int
def test_nonuniform_schedule_is_deepcaches_sample_from_quad_center():
    reference = deepcache_sample_from_quad_center()
    # T = 50 steps, N = 5 (10 full steps), centre step 25 (center=0.5), the paper's powers 1.2-1.4
    for power in (1.2, 1.3, 1.4):
        expected, _ = reference(50, 10, 25, pow=power)
        assert [int(i) for i in expected] == [0, 6, 11, 16, 21, 25, 29, 34, 39, 44]
        assert full_steps(50, 5, "nonuniform", center=0.5, power=power) == [0, 6, 11, 16, 21, 25, 29, 34, 39, 44]
    # the defaults are DeepCache's own example call (stable_diffusion.py: 50 steps, center=15, pow=1.4)
    expected, _ = reference(50, 10, 15, pow=1.4)
    assert full_steps(50, 5, "nonuniform") == [int(i) for i in expected] == [0, 5, 9, 13, 17, 21, 26, 31, 37, 43]
    for steps, interval, center, power in ((20, 3, 0.5, 1.4), (100, 10, 0.5, 1.2), (25, 4, 0.3, 1.3),
                                           (7, 2, 0.3, 1.4), (36, 3, 0.7, 1.6), (11, 2, 0.3, 1.4)):
        expected, _ = reference(steps, math.ceil(steps / interval), round(center * steps), pow=power)
        assert full_steps(steps, interval, "nonuniform", center, power) == [int(i) for i in expected]
    with pytest.raises(ValueError, match="Cannot find suitable pow"):  # no power places 25 steps among 50 ...
        reference(50, 25, 25, pow=1.4)
    with pytest.raises(ValueError, match="schedule=nonuniform cannot place 25 distinct full steps among 50"):
        full_steps(50, 2, "nonuniform", center=0.5, power=1.4)  # ... and distill says so, naming the options
    assert full_steps(50, 5) == list(range(0, 50, 5))


class Recorded(torch.nn.Module):
    """A stand-in network whose outputs are given: called on step k (as a tensor), it returns ``outputs[k]``."""

    def __init__(self, outputs):
        super().__init__()
        self.outputs, self.calls = list(outputs), 0

    def forward(self, k):
        self.calls += 1
        return self.outputs[int(k)]


def test_the_taylor_forecast_is_taylorseers_expansion():
    """Order 2 from real steps 0, 1, 2, predicting 3 and 4: o2 + f1 s + f2 s^2 / 2 with backward differences."""
    outs = [torch.tensor([1.0, -2.0]), torch.tensor([2.0, 0.5]), torch.tensor([4.0, 1.0])]
    f1 = outs[2] - outs[1]
    f2 = (outs[2] - outs[1]) - (outs[1] - outs[0])
    net, forecast = Recorded(outs), Forecast(order=2, warmup=3, steps=[0, 1, 2])
    with accelerated_denoiser(net, forecast, 5):
        got = [net(torch.tensor(k)) for k in range(5)]
    assert net.calls == 3
    for s, k in ((1, 3), (2, 4)):
        assert torch.allclose(got[k], outs[2] + f1 * s + f2 * s * s / 2)
    # a trajectory linear in the step is forecast exactly at order 1
    net, line = Recorded([torch.full((2,), 3.0 * k + 1) for k in range(10)]), Forecast(order=1, interval=3, last=0)
    with accelerated_denoiser(net, line, 10):
        got = [float(net(torch.tensor(k))[0]) for k in range(10)]
    assert got == [3.0 * k + 1 for k in range(10)] and net.calls == len(real_steps(10, 3, 2, 0)) < 10


def test_fitted_regressor_recovers_a_known_linear_trajectory(tmp_path):
    """Predicted steps follow o_k = 2 o_(r1) - o_(r2) + 0.5 x_k from the last two real steps r2 < r1 < k."""
    generator = torch.Generator().manual_seed(0)
    n, steps, real = 6, 10, [0, 1, 2, 4, 6, 8]
    inputs = torch.randn(n, steps, 3, 4, 4, generator=generator)
    outputs = torch.randn(n, steps, 3, 4, 4, generator=generator)
    for k in range(steps):
        if k not in real:
            r2, r1 = [r for r in real if r < k][-2:]
            outputs[:, k] = 2 * outputs[:, r1] - outputs[:, r2] + 0.5 * inputs[:, k]
    fitted = fit_forecaster(outputs, inputs, "ddim", real, lags=2, ridge=1e-12)
    assert sorted(fitted.steps) == [3, 5, 7, 9] and fitted.steps[5].lags == [2, 4]
    for fit in fitted.steps.values():
        assert fit.a == pytest.approx([-1.0, 2.0], abs=1e-6) and fit.c == pytest.approx(0.5, abs=1e-6)
        assert fit.residual < 1e-6
    save_forecasters(tmp_path, [fitted])
    back = load_forecaster(tmp_path, "ddim", steps, real)
    assert back.steps[5] == fitted.steps[5]
    with pytest.raises(FileNotFoundError, match="distill.fit_forecaster"):
        load_forecaster(tmp_path, "dpmsolver", steps, real)


def test_real_step_patterns():
    assert real_steps(10, interval=2, warmup=2, last=1) == [0, 1, 3, 5, 7, 9]
    assert real_steps(10, interval=1) == list(range(10))
    assert real_steps(4, interval=2, warmup=2, last=1) == [0, 1, 3]
    assert real_steps(10, steps=[5, 2, 11]) == [0, 2, 5]


@pytest.mark.parametrize("scheduler, steps", [("ddim", 8), ("dpmsolver", 8), ("lcm", 4)])
def test_every_accelerator_samples_with_each_scheduler_and_counts_only_computed_calls(pipe, scheduler, steps):
    plain, _ = _sample(pipe, None, steps, scheduler)
    for accelerator in (DeepCache(interval=2), Forecast(interval=2)):
        images, calls = _sample(pipe, accelerator, steps, scheduler)
        assert images.shape == plain.shape and torch.isfinite(images).all()
        expected = steps if isinstance(accelerator, DeepCache) else len(real_steps(steps, 2, 2, 1))
        assert calls == expected, accelerator.describe()
        if scheduler != "lcm":  # (LCM's sampler on a teacher that was not distilled for it: runs, far from exact)
            assert (images - plain).abs().mean() < 0.15  # close to, not equal to, plain sampling


def test_heun_calls_twice_a_step_deepcache_counts_calls_and_forecast_refuses(pipe):
    plain, calls = _sample(pipe, None, 6, "heun")
    assert calls == 11  # 2 x 6 - 1
    images, n = _sample(pipe, DeepCache(interval=2, schedule="nonuniform"), 6, "heun")
    assert n == 11 and torch.isfinite(images).all() and (images - plain).abs().mean() < 0.15
    with pytest.raises(ValueError, match="calls the UNet 11 times for 6 steps"):
        _sample(pipe, Forecast(interval=2), 6, "heun")
    assert context_of(pipe.unet) is None and "forward" not in pipe.unet.__dict__  # disabled after the failure too


@pytest.mark.parametrize("which, shared", [("timestep", ()), ("timestep", ("conv_in", "down_blocks.0", "mid_block")),
                                           ("token", ())])
def test_accelerators_run_on_moe_students(pipe, which, shared):
    from distill.students.moe import timestep_moe_student, token_moe_student

    teacher = pipe.unet
    student = (timestep_moe_student(teacher, num_experts=2, noise_scheduler=pipe.scheduler, shared_layers=shared)
               if which == "timestep" else token_moe_student(teacher, num_experts=2)).eval()
    pipe.unet = student
    try:
        plain, _ = _sample(pipe, None, 8, "ddim")
        for accelerator in (DeepCache(interval=1), DeepCache(interval=2), Forecast(interval=2)):
            images, _ = _sample(pipe, accelerator, 8, "ddim")
            assert torch.isfinite(images).all()
            if accelerator.describe().startswith("deepcache(N=1"):
                assert torch.equal(images, plain)
        cache = DeepCache(interval=2)
        cache.attach(student, SamplingContext())
        assert len(cache.caches) == (2 if which == "timestep" else 1)  # one cache per expert UNet
        cache.detach()
    finally:
        pipe.unet = teacher


@pytest.mark.parametrize("kwargs, needle", [
    ({"interval": 0}, "accelerate.options.interval=0"), ({"branch": -1}, "accelerate.options.branch=-1"),
    ({"schedule": "cosine"}, "accelerate.options.schedule"), ({"power": 0.5}, "accelerate.options.power"),
])
def test_bad_deepcache_settings_raise_naming_the_key(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        DeepCache(**kwargs)


def test_bad_forecast_settings_and_a_branch_beyond_the_unet_raise(pipe):
    for kwargs, needle in (({"interval": 0}, "interval=0"), ({"predictor": "lstm"}, "predictor"),
                           ({"order": 2, "warmup": 2}, "warmup=2")):
        with pytest.raises(ValueError, match=needle):
            Forecast(**kwargs)
    with pytest.raises(ValueError, match="accelerate.options.branch=9"):
        DeepCache(branch=9).attach(pipe.unet, SamplingContext())
    assert not getattr(pipe.unet, "_diffusers_hook", None) or not pipe.unet._diffusers_hook.hooks
    assert preset("none") is None and isinstance(preset("deepcache"), DeepCache)
    with pytest.raises(ValueError, match="accelerator 'warp'"):
        preset("warp")


def _evaluate(tmp_path, *overrides):
    import sys

    return run_cli([sys.executable, "-m", "distill.evaluate", *overrides, f"hydra.run.dir={tmp_path / 'eval'}"],
                          capture_output=True, text=True)


@pytest.mark.slow  # ~40 s; notebook 02 (make notebooks) sweeps accelerators through distill.evaluate too
def test_evaluate_sweeps_accelerators_like_schedulers(tmp_path):
    import csv

    proc = _evaluate(tmp_path, "accelerators=[none,deepcache,forecast]", "steps=[6]", "num_per_class=2",
                     "cost_repeats=1", "grids=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "eval" / "quality_cost.csv")))
    assert [r["accelerate"] for r in rows] == ["none", "deepcache", "forecast"]
    assert [r["model"] for r in rows] == ["teacher", "teacher+deepcache", "teacher+forecast"]
    nfe = [float(r["nfe"]) for r in rows]  # CFG: 2 evaluations a computed step
    assert nfe == [12.0, 12.0, 2.0 * len(real_steps(6, 2, 2, 1))]
    flops = [float(r["gflops_per_image"]) for r in rows]
    assert flops[1] < 0.75 * flops[0] and flops[2] < flops[0]


# each case is a process start of ~20 s; the default suite keeps two (an unknown name, a bad option value)
_SLOW = pytest.mark.slow


@pytest.mark.parametrize("overrides, code, needle", [
    (["accelerate=warp"], 1, "accelerate"),
    pytest.param(["accelerators=[none,warp]"], 2, "accelerator 'warp'", marks=_SLOW),
    (["accelerate=deepcache", "accelerate.options.interval=0"], 2, "accelerate.options.interval=0"),
    pytest.param(["accelerate=forecast", "accelerate.options.order=3"], 2, "accelerate.options.warmup=2", marks=_SLOW),
    pytest.param(["accelerate=deepcache", "+accelerate.options.speed=9"], 2, "speed", marks=_SLOW),
])
def test_bad_accelerator_settings_fail_before_sampling(tmp_path, overrides, code, needle):
    proc = _evaluate(tmp_path, *overrides, "steps=[2]", "num_per_class=1")
    assert proc.returncode == code and needle in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "eval" / "quality_cost.csv").exists()


@pytest.mark.slow  # over 30 s: in `make test-all`, out of the 15-minute default suite (stop 26)
def test_fit_forecaster_cli_then_sampling_with_the_fitted_coefficients(tmp_path):
    import csv
    import json
    import sys

    out = tmp_path / "fit"
    proc = run_cli([sys.executable, "-m", "distill.fit_forecaster", "steps=[6]", "num_per_class=1",
                           f"out={out}", f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "forecaster.json").read_text())
    key = "ddim/6/0,1,3,5/cfg3"  # the teacher's intended guidance scale, 3
    assert list(data) == [key] and sorted(data[key]["steps"]) == ["2", "4"]
    assert data[key]["scheduler_class"] == "DDIMScheduler"
    assert all(s["residual"] < 0.5 for s in data[key]["steps"].values())
    proc = _evaluate(tmp_path, "accelerate=forecast_fitted", f"accelerate.options.path={out}", "steps=[6]",
                     "num_per_class=2", "cost_repeats=1", "grids=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = csv.DictReader(open(tmp_path / "eval" / "quality_cost.csv"))
    assert float(row["nfe"]) == 8.0 and float(row["fid"]) < 50  # 4 computed steps of 6, with CFG
    proc = _evaluate(tmp_path / "b", "accelerate=forecast_fitted", f"accelerate.options.path={out}", "steps=[8]",
                     "num_per_class=1", "cost_repeats=1", "grids=false")
    assert proc.returncode == 2 and "no fitted forecaster for ddim/8/" in proc.stderr, proc.stderr[-2000:]
    assert "quality-cost" not in proc.stderr  # refused before any sampling


# ---------------------------------------------------------------- classifier guidance


@pytest.fixture(scope="module")
def tiny_guide(tmp_path_factory):
    """A randomly initialised noise-aware classifier of the teacher's 4x8x8 latents, saved as a folder."""
    from distill.models.noisy_classifier import NoisyLatentClassifier

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("guide")
    NoisyLatentClassifier(channels=(16, 32), time_dim=32, groups=4).save_pretrained(folder)
    return folder


def _log_prob(guidance, x, t, labels, eps=None):
    from distill.models.clip import encode_images, encode_text

    with torch.no_grad():
        if guidance.mode == "noisy":
            logits = guidance.classifier(x, torch.full((len(x),), t))
        else:
            abar = guidance._abar(t, x)
            x0 = (x - (1 - abar).sqrt() * eps) / abar.sqrt()
            images = guidance.vae.decode(x0 / guidance.vae.config.scaling_factor).sample
            if guidance.mode == "clip":  # the CLIP score, 100 cos(image, prompt)
                model, tokenizer = guidance.classifier
                return 100 * (encode_images(model, images) * encode_text(model, tokenizer, labels)).sum()
            logits = guidance.classifier(images)
        return torch.log_softmax(logits.double(), 1).gather(1, labels.view(-1, 1)).sum()


@pytest.mark.parametrize("mode", ["noisy", "x0", "clip"])
def test_guidance_gradient_equals_a_finite_difference(pipe, tiny_guide, mode):
    import copy

    from distill.accelerate import ClassifierGuidance

    shipped = {"x0": "classifier", "clip": "clip"}  # clean-image guides: the digits assets the presets name
    guidance = ClassifierGuidance(mode=mode, classifier=str(tiny_guide if mode == "noisy" else asset_path(shipped[mode])))
    guidance.attach(pipe.unet, SamplingContext(pipe=pipe))
    guidance.detach()
    (guidance.classifier[0] if mode == "clip" else guidance.classifier).double()  # float64 throughout: the
    guidance.vae = copy.deepcopy(pipe.vae).double()  # finite difference then resolves the gradient
    generator = torch.Generator().manual_seed(0)
    x, eps = torch.randn(2, 4, 8, 8, generator=generator).double(), torch.randn(2, 4, 8, 8, generator=generator).double()
    labels, t = (PROMPTS if mode == "clip" else torch.tensor([3, 7])), 400
    grad = guidance.gradient(x, t, labels, eps)
    for _ in range(3):
        v = torch.randn(x.shape, generator=generator).double()
        h = 1e-5
        # x0 mode holds eps fixed: the finite difference moves x alone, as the gradient assumes
        fd = (_log_prob(guidance, x + h * v, t, labels, eps) - _log_prob(guidance, x - h * v, t, labels, eps)) / (2 * h)
        assert float((grad * v).sum()) == pytest.approx(float(fd), rel=1e-5, abs=1e-8)


def test_guided_noise_prediction_is_the_papers_formula_and_scale_0_is_unguided(pipe, tiny_guide):
    from distill.accelerate import ClassifierGuidance

    unet, generator = pipe.unet, torch.Generator().manual_seed(1)
    x, t = torch.randn(2, 4, 8, 8, generator=generator).repeat(2, 1, 1, 1), torch.tensor(600)  # CFG's two halves
    text = torch.randn(4, 16, unet.config.cross_attention_dim, generator=generator)
    with torch.no_grad():
        plain = unet(x, t, encoder_hidden_states=text).sample
    guidance = ClassifierGuidance(scale=2.5, classifier=str(tiny_guide))
    # two prompts, batch doubled by CFG; the second unlabelled
    with accelerated(pipe, guidance, scheduler_name="ddim", guidance_scale=3.0, labels=torch.tensor([5, -1])), \
            torch.no_grad():
        guided = unet(x, t, encoder_hidden_states=text).sample
    labels = torch.tensor([5, 0, 5, 0])
    grad = guidance.gradient(x, 600, labels)
    abar = pipe.scheduler.alphas_cumprod[600]
    expected = plain - (1 - abar).sqrt() * 2.5 * grad * torch.tensor([1.0, 0, 1, 0]).view(-1, 1, 1, 1)
    assert torch.allclose(guided, expected, atol=1e-6) and torch.equal(guided[1], plain[1])
    zero = ClassifierGuidance(scale=0.0, classifier=str(tiny_guide), labels=[3, 7])
    assert torch.equal(_sample(pipe, zero, 6, "ddim")[0], _sample(pipe, None, 6, "ddim")[0])


@pytest.mark.parametrize("name, mode, asset", [("classifier", "noisy", "noisy_classifier"),
                                              ("classifier_x0", "x0", "classifier"), ("classifier_clip", "clip", "clip")])
def test_the_guide_comes_from_the_preset(name, mode, asset):
    """The generic accelerator names no guide of its own: each preset names the shipped digits asset of its mode."""
    from distill.accelerate import accelerator_options
    from distill.config.resolvers import register_resolvers

    register_resolvers()
    guide = preset(name)
    assert (guide.mode, guide.path) == (mode, str(asset_path(asset)))
    assert accelerator_options(name)["options"]["classifier"] == str(asset_path(asset))


def test_the_commands_resolve_the_presets_guide():
    """``distill.evaluate accelerate=classifier`` (and ``distill.serve``, the same conversion) builds the guide
    of the preset's ``${distill.asset:noisy_classifier}``, not a folder named by the unresolved string."""
    from hydra import compose, initialize_config_dir

    from distill.config.resolvers import register_resolvers
    from distill.config.schema import register_configs
    from distill.evaluate import _accelerators

    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=str(ACCELERATE_CONF.parent), version_base="1.3"):
        cfg = compose(config_name="evaluate", overrides=["accelerate=classifier"])
    [(label, build)] = _accelerators(cfg)
    assert label == "classifier(noisy,s=3)" and build(None).path == str(asset_path("noisy_classifier"))


def test_a_guide_that_does_not_fit_the_latents_is_refused(pipe, tmp_path):
    from distill.accelerate import ClassifierGuidance
    from distill.models.noisy_classifier import NoisyLatentClassifier

    NoisyLatentClassifier(in_channels=3, sample_size=8, channels=(8,), time_dim=8, groups=4).save_pretrained(tmp_path)
    guidance = ClassifierGuidance(classifier=str(tmp_path))
    with pytest.raises(ValueError, match="accelerate.options.classifier: the guide takes 3x8x8"):
        guidance.attach(pipe.unet, SamplingContext(pipe=pipe))
    with pytest.raises(ValueError, match="accelerate.options.scale=-1"):
        ClassifierGuidance(scale=-1)
    with pytest.raises(ValueError, match="accelerate.options.classifier is not set: give the folder of a Noisy"):
        ClassifierGuidance()
    with pytest.raises(FileNotFoundError, match="accelerate.options.classifier="):
        ClassifierGuidance(classifier=str(tmp_path / "none")).attach(pipe.unet, SamplingContext())
    proc = _evaluate(tmp_path / "cli", "accelerate=classifier", f"accelerate.options.classifier={tmp_path}",
                     "steps=[2]", "num_per_class=1")
    assert proc.returncode == 2 and "the guide takes 3x8x8" in proc.stderr, proc.stderr[-2000:]


def test_a_chain_forecasts_steps_and_caches_features_on_the_computed_ones(pipe):
    from distill.accelerate import Chain

    plain, calls = _sample(pipe, None, 8, "ddim")
    same, n = _sample(pipe, Chain([DeepCache(interval=1), Forecast(interval=1)]), 8, "ddim")
    assert torch.equal(same, plain) and n == calls
    chain = preset("deepcache+forecast")
    assert isinstance(chain, Chain) and [type(p) for p in chain.parts] == [DeepCache, Forecast]
    forecast_only, n_forecast = _sample(pipe, Forecast(interval=2), 8, "ddim")
    images, n = _sample(pipe, chain, 8, "ddim")
    assert n == n_forecast == len(real_steps(8, 2, 2, 1)) and torch.isfinite(images).all()
    assert "forward" not in pipe.unet.__dict__  # every hook of the chain removed
    cache = chain.parts[0]
    assert cache.step == n - 1  # the cache counted the computed calls only
    assert not torch.equal(images, forecast_only)


def test_classifier_guidance_alone_steers_null_prompt_samples_to_their_labels(tmp_path):
    """The shipped noise-aware classifier guides the teacher's unconditional (empty prompt) samples: prompt
    accuracy from chance (~10%) to most; counted FLOPs include the guide's forward and backward."""
    import csv

    proc = _evaluate(tmp_path, "accelerators=[none,classifier]", "null_prompts=true",  # the preset: scale 3
                     "guidance_scale=1", "steps=[10]", "num_per_class=4", "cost_repeats=1", "grids=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["accelerate"]: r for r in csv.DictReader(open(tmp_path / "eval" / "quality_cost.csv"))}
    assert rows["none"]["model"] == "teacher(null prompt)"
    assert float(rows["none"]["prompt_accuracy"]) < 0.4 < 0.7 < float(rows["classifier"]["prompt_accuracy"])
    assert float(rows["classifier"]["nfe"]) == float(rows["none"]["nfe"]) == 10
    assert float(rows["classifier"]["gflops_per_image"]) > float(rows["none"]["gflops_per_image"])


def test_x0_guidance_under_cfg_adds_one_term_from_the_guided_prediction(pipe, tiny_guide):
    from distill.accelerate import ClassifierGuidance

    unet, generator = pipe.unet, torch.Generator().manual_seed(2)
    x, t = torch.randn(2, 4, 8, 8, generator=generator).repeat(2, 1, 1, 1), torch.tensor(300)
    text = torch.randn(4, 16, unet.config.cross_attention_dim, generator=generator)
    with torch.no_grad():
        plain = unet(x, t, encoder_hidden_states=text).sample
    guidance = ClassifierGuidance(scale=0.1, mode="x0", classifier=str(asset_path("classifier")))  # on the decoded x0
    # diffusers' CFG batch: [unconditional, conditional]
    with accelerated(pipe, guidance, scheduler_name="ddim", guidance_scale=3.0, labels=torch.tensor([2, 9])), \
            torch.no_grad():
        guided = unet(x, t, encoder_hidden_states=text).sample
    combined = plain[:2] + 3.0 * (plain[2:] - plain[:2])
    grad = guidance.gradient(x[:2], 300, torch.tensor([2, 9]), combined)
    shift = (1 - pipe.scheduler.alphas_cumprod[300]).sqrt() * 0.1 * grad
    assert torch.allclose(guided, plain - shift.repeat(2, 1, 1, 1), atol=1e-5)
    after_cfg = guided[:2] + 3.0 * (guided[2:] - guided[:2])
    assert torch.allclose(after_cfg, combined - shift, atol=1e-4)  # CFG keeps the term once


def test_x0_guidance_runs_in_bfloat16(pipe, tiny_guide):
    import copy

    from distill.accelerate import ClassifierGuidance

    half = copy.deepcopy(pipe).to(dtype=torch.bfloat16)
    half.set_progress_bar_config(disable=True)
    for mode, path in (("x0", str(asset_path("classifier"))), ("noisy", str(tiny_guide))):
        guidance = ClassifierGuidance(scale=0.1, mode=mode, classifier=path, labels=[1, 4])
        with accelerated(half, guidance):
            images = half(PROMPTS, num_inference_steps=3, generator=torch.Generator().manual_seed(0),
                          output_type="pt").images
        assert torch.isfinite(images).all(), mode


def test_clip_guidance_steers_empty_prompts_towards_their_captions(pipe):
    """Guidance by the digits CLIP's score of the decoded x0 lifts the prompt accuracy of empty-prompt samples,
    judged by the digits classifier (a network the guide does not use)."""
    from distill.accelerate import ClassifierGuidance
    from distill.models.classifier import ImageClassifier

    judge = ImageClassifier.from_pretrained(asset_path("classifier")).eval()
    captions = [f"a handwritten digit {d}" for d in range(10)] * 2
    labels = torch.arange(10).repeat(2)

    def accuracy(guidance):
        with accelerated(pipe, guidance, prompts=captions):
            images = pipe([""] * len(captions), num_inference_steps=10, guidance_scale=1.0,
                          generator=torch.Generator().manual_seed(0), output_type="pt").images
        with torch.no_grad():
            return (judge(images * 2 - 1).argmax(1) == labels).float().mean().item()

    assert accuracy(None) < 0.3 < 0.4 < accuracy(ClassifierGuidance(scale=0.03, mode="clip",
                                                                          classifier=str(asset_path("clip"))))


def test_a_chains_nonuniform_cache_schedules_the_calls_the_forecast_computes():
    """Inside ``deepcache+forecast`` the cache sees only the forecast's real calls (11 of 20 here): its
    non-uniform schedule is built over those 11 and indexed by them: the full UNet runs on computed calls
    ``full_steps(11, 3)``, 0, 3, 4, 7 (one built over all 20 calls and indexed by the 11 would run 0, 3, 5, 7, 10)."""
    from diffusers import DDIMScheduler

    from distill.accelerate import Chain

    unet = sd_layout_unet()
    cache, forecast = DeepCache(interval=3, schedule="nonuniform"), Forecast(interval=2)
    chain = Chain([cache, forecast])
    full_calls = []  # the cache's call index whenever the mid block (a cached layer) really computes
    leaf = next(m for m in unet.mid_block.modules() if not list(m.children()))
    handle = leaf.register_forward_pre_hook(lambda m, a: full_calls.append(cache.step))
    with NFECounter(unet) as counter:
        _loop(unet, DDIMScheduler(), 20, chain)
    handle.remove()
    real = len(real_steps(20, 2, 2, 1))
    assert real == counter.calls == cache.step + 1 == 11 and cache.num_calls == 11
    assert full_calls == full_steps(11, 3, "nonuniform") == [0, 3, 4, 7]


def test_img2img_at_strength_half_forecasts_the_calls_it_runs(pipe):
    """img2img at strength 0.5 of 10 DDIM steps runs the last 5: the forecast patterns those 5 calls (real
    0, 1, 3, 4), plainly equal to the pipeline at interval 1; DeepCache's schedule counts 5 calls too."""
    from diffusers import DDIMScheduler, StableDiffusionImg2ImgPipeline

    img2img = StableDiffusionImg2ImgPipeline(**{**pipe.components, "scheduler": DDIMScheduler.from_config(
        pipe.scheduler.config)}, requires_safety_checker=False)
    img2img.set_progress_bar_config(disable=True)
    image = torch.rand(2, 1, 32, 32, generator=torch.Generator().manual_seed(0))

    def run(accelerator):
        with accelerated(img2img, accelerator), NFECounter(img2img.unet) as counter:
            out = img2img(PROMPTS, image=image, strength=0.5, num_inference_steps=10, output_type="pt",
                          generator=torch.Generator().manual_seed(0)).images
        return out, counter.calls

    plain, calls = run(None)
    assert calls == 5
    same, n = run(Forecast(interval=1))
    assert torch.equal(same, plain) and n == 5
    forecast = Forecast(interval=2)
    images, n = run(forecast)
    assert forecast.num_calls == 5 and n == len(real_steps(5, 2, 2, 1)) == 4 and torch.isfinite(images).all()
    assert (images - plain).abs().mean() < 0.15
    cache = DeepCache(interval=2, schedule="nonuniform")
    run(cache)
    assert cache.num_calls == 5 and cache._full == set(full_steps(5, 2, "nonuniform"))


def test_heun_in_the_training_callbacks_path_counts_eleven_calls(pipe):
    """The quality-cost callback samples a method's own pipeline with the accelerator on the UNet
    (``MethodSampler`` -> ``accelerated_denoiser``): Heun's 6 steps are 11 calls there too, so DeepCache's schedule
    covers all 11 and a forecast refuses before the first call, as on a pipeline."""
    from distill.callbacks.quality_cost import MethodSampler
    from distill.inference.schedulers import make_scheduler, scheduler_options

    plain_scheduler = pipe.scheduler
    pipe.scheduler = make_scheduler("heun", plain_scheduler.config, **scheduler_options("heun"))

    def generate(batch, generator, num_inference_steps, guidance_scale, scheduler):
        return pipe(batch["caption"], num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                    generator=generator, output_type="pt").images

    method = SimpleNamespace(student=pipe.unet, sampling={"guidance_scale": 3.0}, pipeline=lambda scheduler: pipe,
                             generate=generate)
    sampler = MethodSampler(method)
    try:
        sampler.accelerator = cache = DeepCache(interval=2, schedule="nonuniform")
        with NFECounter(pipe.unet) as counter:
            images = sampler(PROMPTS, torch.tensor([3, 7]), "heun", 6, 3.0, torch.Generator().manual_seed(0))
        assert counter.calls == 11 and cache.num_calls == 11 and cache.step == 10
        assert cache._full == set(full_steps(11, 2, "nonuniform")) and torch.isfinite(images).all()
        sampler.accelerator = Forecast(interval=2)
        with NFECounter(pipe.unet) as counter, pytest.raises(ValueError, match="calls the UNet 11 times for 6 steps"):
            sampler(PROMPTS, torch.tensor([3, 7]), "heun", 6, 3.0, torch.Generator().manual_seed(0))
        assert counter.calls == 0
    finally:
        pipe.scheduler = plain_scheduler


def test_forecast_on_a_pndm_teacher_patterns_its_eleven_calls(pipe):
    """A stock SD-1.5 folder samples with PNDM (PLMS, ``skip_prk_steps``): 11 UNet calls for 10 steps, the first
    step's warm-up call included. The forecast patterns the 11 calls (real 0, 1, 3, 5, 7, 9, 10), equals plain
    sampling at interval 1, and a fitted forecaster (fitted on one call a step) is refused naming the count."""
    from diffusers import PNDMScheduler

    plain_scheduler = pipe.scheduler
    pipe.scheduler = PNDMScheduler.from_config(plain_scheduler.config, skip_prk_steps=True)
    try:
        plain, calls = _sample(pipe, None, 10)
        assert calls == 11
        same, n = _sample(pipe, Forecast(interval=1), 10)
        assert torch.equal(same, plain) and n == 11
        images, n = _sample(pipe, Forecast(interval=2), 10)
        assert n == len(real_steps(11, 2, 2, 1)) == 7 and (images - plain).abs().mean() < 0.15
        fitted = Forecast(predictor="fitted", path="unused", scheduler="pndm")
        with pytest.raises(ValueError, match="makes 11 UNet calls for 10 steps"):
            _sample(pipe, fitted, 10)
    finally:
        pipe.scheduler = plain_scheduler


def test_a_taylor_forecast_on_pndm_extrapolates_along_its_distinct_timesteps(pipe):
    """PLMS calls the UNet twice at its second timestep (900, 800, 800, 700, ...): the Taylor axis is the distinct
    timestep, not the call. With real calls 0, 1, 3, 5, ... the forecast of call 2 (t = 800 again) is call 1's output
    itself, and call 4 (t = 600) extrapolates calls 1 and 3 (t = 800, 700) one timestep on: 2 e3 - e1. Counted by
    calls, call 2 was e1 + (e1 - e0) and call 4 used half that slope."""
    from diffusers import PNDMScheduler

    plain_scheduler = pipe.scheduler
    pipe.scheduler = PNDMScheduler.from_config(plain_scheduler.config, skip_prk_steps=True)
    seen = []
    handle = pipe.unet.register_forward_hook(
        lambda m, args, kwargs, out: seen.append((float(args[1]), out[0].detach().clone())), with_kwargs=True)
    try:
        _sample(pipe, Forecast(interval=2), 10)
    finally:
        handle.remove()
        pipe.scheduler = plain_scheduler
    timesteps = [t for t, _ in seen]
    assert len(seen) == 11 and timesteps[1] == timesteps[2] and len(set(timesteps)) == 10
    e = [o for _, o in seen]
    assert torch.equal(e[2], e[1])
    torch.testing.assert_close(e[4], 2 * e[3] - e[1], rtol=1e-5, atol=1e-6)


def test_served_forecast_on_a_pndm_teacher_answers_and_a_second_order_scheduler_is_refused_per_request(pipe):
    """``distill.serve accelerate=forecast`` on a stock SD-1.5 folder (PNDM) serves each request with 7 of its 11
    calls computed; a request for heun is refused by the request check, naming the scheduler's order, and a
    quality-cost callback that would sweep forecast with heun fails when it is built."""
    from diffusers import PNDMScheduler

    from distill.callbacks.quality_cost import QualityCostCallback
    from distill.serve.engine import Engine

    plain_scheduler = pipe.scheduler
    pipe.scheduler = PNDMScheduler.from_config(plain_scheduler.config, skip_prk_steps=True)
    engine = Engine(pipe, steps=10, guidance_scale=3.0, mode="sequential", accelerator=Forecast(interval=2))
    try:
        with NFECounter(pipe.unet) as counter:
            result = engine.submit(engine.job([PROMPTS[0]], seed=0)).result(timeout=300)
        assert counter.calls == len(real_steps(11, 2, 2, 1)) == 7 and len(result.png) == 1
        (error,) = engine.check([PROMPTS[0]], 10, None, None, None, "heun", None)
        assert error[0] == "scheduler" and "HeunDiscreteScheduler is of order 2" in error[1]
        assert engine.check([PROMPTS[0]], 10, None, None, None, "ddim", None) == []
    finally:
        engine.close(timeout=60)
        pipe.scheduler = plain_scheduler
    with pytest.raises(ValueError, match="HeunDiscreteScheduler is of order 2"):
        QualityCostCallback(None, schedulers=("ddim", "heun"), accelerators=("none", "deepcache+forecast"))
    with pytest.raises(ValueError, match="HeunDiscreteScheduler is of order 2"):  # a default the service cannot run
        Engine(pipe, scheduler="heun", steps=10, guidance_scale=3.0, mode="sequential", accelerator=Forecast(interval=2))
