"""First-Block Cache and TeaCache (distill.accelerate.blockcache) on the digits flow DiT and a Flux stand-in:
threshold 0 is plain sampling bit for bit, each skip decision and each skipped output equals a hand computation
from the blocks' own tensors, TeaCache's calibration fits what it records, and a UNet or a missing polynomial is
refused before any sampling."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import distill.inference.pipelines  # noqa: F401  (registers DistillSD3Pipeline)
from distill.accelerate import accelerated, make_accelerator, preset
from distill.accelerate.blockcache import (
    TEACACHE_FILE,
    FirstBlockCache,
    TeaCache,
    fit_rescale,
    relative_l1,
    stack_blocks,
)
from distill.worlds.digits import asset_path
from tests.conftest import run_cli

PROMPTS = ["a handwritten digit three", "a handwritten digit seven"]
STEPS = 8


@pytest.fixture(scope="module")
def pipe():
    from diffusers import DiffusionPipeline

    p = DiffusionPipeline.from_pretrained(asset_path("flow_teacher"))
    p.set_progress_bar_config(disable=True)
    return p


def sample(pipe, accelerator=None, steps: int = STEPS, prompts=PROMPTS, **call):
    call = {"guidance_scale": 3.0, **call}
    with accelerated(pipe, accelerator):
        return pipe(prompts, num_inference_steps=steps, generator=torch.Generator().manual_seed(0),
                    output_type="latent", **call).images


class Recorder:
    """Every call of the transformer, recorded by forward hooks with no accelerator attached: the first block's input
    ``h0``, output ``h1`` and modulated input ``m`` (its ``norm1``), the last block's output ``hL`` and the
    transformer's output ``out``. ``replace``: at call ``k``, the last block's image tokens are replaced by
    ``fn(calls)`` (the hand computation of a skipped call, through the transformer's own head)."""

    def __init__(self, net, replace: tuple[int, object] | None = None):
        self.calls, self.replace = [], replace
        blocks = stack_blocks(net)  # SD3: the joint blocks; Flux: the double- then the single-stream blocks
        first, last = blocks[0], blocks[-1]
        self.handles = [first.register_forward_hook(self.first, with_kwargs=True),
                        last.register_forward_hook(self.last, with_kwargs=True),
                        net.register_forward_hook(lambda m, a, kw, out: self.calls[-1].update(out=out[0]),
                                                  with_kwargs=True)]

    def first(self, module, args, kwargs, out):
        hidden, temb = kwargs["hidden_states"], kwargs["temb"]
        self.calls.append({"h0": hidden, "h1": out[1], "m": module.norm1(hidden, emb=temb)[0]})

    def last(self, module, args, kwargs, out):
        self.calls[-1]["hL"] = out[1]
        if self.replace is not None and len(self.calls) - 1 == self.replace[0]:
            return out[0], self.replace[1](self.calls)
        return out

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def transformer_outputs_of(pipe, accelerator, steps: int = STEPS, prompts=("a handwritten digit three",),
                           **call) -> list[torch.Tensor]:
    outs = []
    hook = pipe.transformer.register_forward_hook(lambda m, a, kw, out: outs.append(out[0]), with_kwargs=True)
    try:
        sample(pipe, accelerator, steps, prompts=list(prompts), **call)
    finally:
        hook.remove()
    return outs


def transformer_outputs(pipe, accelerator, steps: int = STEPS) -> list[torch.Tensor]:
    return transformer_outputs_of(pipe, accelerator, steps, PROMPTS)


@pytest.mark.parametrize("kind, options", [("fbcache", {"threshold": 0.0}),
                                           ("teacache", {"threshold": 0.0, "rescale": False})])
def test_threshold_zero_is_plain_sampling_bit_for_bit(pipe, kind, options):
    plain = sample(pipe)
    cache = make_accelerator(kind, options)
    assert torch.equal(sample(pipe, cache), plain)
    assert [d for _, d in cache.decisions] == [True] * STEPS


def test_first_block_cache_skips_where_the_first_blocks_residual_changed_less_and_reuses_the_rest(pipe):
    with Recorder(pipe.transformer) as rec:
        sample(pipe)
    r1 = [c["h1"] - c["h0"] for c in rec.calls]
    changes = [relative_l1(r1[k], r1[k - 1]) for k in range(1, STEPS)]
    threshold = float(np.median(changes))
    # until the first skip every call runs the blocks and the trajectory is the plain one: the first skip is the
    # first call whose residual changed by less than the threshold since the previous call's
    k = 1 + next(i for i, c in enumerate(changes) if c < threshold)
    cache = FirstBlockCache(threshold=threshold)
    outs = transformer_outputs(pipe, cache)
    assert [d for _, d in cache.decisions][:k + 1] == [True] * k + [False], (changes, threshold)
    # by hand: the stack's output at call k is its first block's new output plus the rest's residual at call k - 1
    with Recorder(pipe.transformer, replace=(k, lambda calls: calls[k]["h1"] + calls[k - 1]["hL"] - calls[k - 1]["h1"])
                  ) as hand:
        sample(pipe)
    torch.testing.assert_close(outs[k], hand.calls[k]["out"], rtol=1e-5, atol=1e-6)
    assert not torch.equal(outs[k], rec.calls[k]["out"])  # and it is not the plain call's output


def test_teacache_accumulates_the_rescaled_change_of_the_modulated_input_and_skips_below_threshold(pipe):
    with Recorder(pipe.transformer) as rec:
        sample(pipe)
    m = [c["m"] for c in rec.calls]
    coefficients = [2.0, 0.5, 0.01]  # any polynomial: 2 x^2 + 0.5 x + 0.01
    poly = np.poly1d(coefficients)
    changes = [relative_l1(m[k], m[k - 1]) for k in range(1, STEPS)]
    threshold = float(poly(changes[1]) + poly(changes[2])) * 1.01  # the second and third changes add up under it
    cache = TeaCache(threshold=threshold, coefficients=coefficients)
    sample(pipe, cache)
    # by hand over the plain trajectory, valid until the first skip changes the trajectory after it
    expected, accumulated = [True], 0.0
    for k in range(1, STEPS):
        accumulated += poly(changes[k - 1])
        compute = accumulated >= threshold or k == STEPS - 1
        expected.append(compute)
        accumulated = 0.0 if compute else accumulated
        if not compute:
            break
    decisions = [d for _, d in cache.decisions]
    assert decisions[:len(expected)] == expected and expected[-1] is False
    assert cache.changes[:len(expected) - 1] == pytest.approx(changes[:len(expected) - 1], rel=1e-6)
    assert decisions[-1] is True  # the last step always runs
    assert TeaCache(coefficients=[1.0, -1.0]).rescaled(0.5) == 0.0  # x - 1 < 0 at 0.5: counted as no change


def test_teacache_skips_the_whole_stack_with_the_cached_residual_on_its_input(pipe):
    cache = TeaCache(threshold=1e9, rescale=False)  # every call between the first and the last step skipped
    outs = transformer_outputs(pipe, cache, steps=4)
    assert [d for _, d in cache.decisions] == [True, False, False, True]
    # by hand: at call 1 the stack's output is its input plus the whole stack's residual at call 0
    with Recorder(pipe.transformer, replace=(1, lambda calls: calls[1]["h0"] + calls[0]["hL"] - calls[0]["h0"])
                  ) as hand:
        sample(pipe, steps=4)
    torch.testing.assert_close(outs[1], hand.calls[1]["out"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["fbcache", "teacache"])
def test_a_skip_on_flux_reuses_the_residual_through_its_single_stream_blocks(tmp_path, kind):
    from tests.flux_tiny import tiny_flux_pipeline

    pipe = tiny_flux_pipeline(tmp_path, num_layers=2, num_single_layers=2)
    pipe.set_progress_bar_config(disable=True)
    call = dict(height=32, width=32, max_sequence_length=8, guidance_scale=3.5)
    cache = (FirstBlockCache(threshold=1e9) if kind == "fbcache" else TeaCache(threshold=1e9, rescale=False))
    outs = transformer_outputs_of(pipe, cache, 4, **call)
    assert [d for _, d in cache.decisions] == ([True, False, False, False] if kind == "fbcache"
                                               else [True, False, False, True])
    # the skipped call 1 by hand: the last single-stream block's image tokens replaced by the cached residual
    # (FBC: on the new first-block output; TeaCache: on the stack's input)
    start = "h1" if kind == "fbcache" else "h0"
    with Recorder(pipe.transformer, replace=(1, lambda c: c[1][start] + c[0]["hL"] - c[0][start])) as hand:
        sample(pipe, None, 4, prompts=["a handwritten digit three"], **call)
    torch.testing.assert_close(outs[1], hand.calls[1]["out"], rtol=1e-5, atol=1e-6)


def test_guidance_passes_made_separately_keep_separate_states(tmp_path):
    from tests.flux_tiny import tiny_flux_pipeline

    pipe = tiny_flux_pipeline(tmp_path, guidance_embeds=False)
    pipe.set_progress_bar_config(disable=True)

    def run(acc):
        with accelerated(pipe, acc):
            return pipe(["a handwritten digit three"], negative_prompt="", true_cfg_scale=3.0, height=32, width=32,
                        num_inference_steps=4, max_sequence_length=8, generator=torch.Generator().manual_seed(0),
                        output_type="latent").images

    plain = run(None)
    cache = FirstBlockCache(threshold=0.0)
    assert torch.equal(run(cache), plain)
    # FluxPipeline's true CFG calls the transformer twice a step, conditional then unconditional: branches 0, 1
    assert [b for b, _ in cache.decisions] == [0, 1] * 4
    assert isinstance(stack_blocks(pipe.transformer)[-1], type(pipe.transformer.single_transformer_blocks[0]))


def test_calibration_fits_the_recorded_changes(pipe, tmp_path):
    from distill.fit_forecaster import record_changes

    x, y = record_changes(pipe, PROMPTS, STEPS, 3.0, seed=5, batch_size=2)
    assert len(x) == len(y) == STEPS - 1
    # the pairs by hand from the recorded plain trajectory of the same prompts and seed
    with Recorder(pipe.transformer) as rec:
        with torch.no_grad():
            pipe(PROMPTS, num_inference_steps=STEPS, guidance_scale=3.0, generator=torch.Generator().manual_seed(5),
                 output_type="latent")
    c = rec.calls
    assert x == pytest.approx([relative_l1(c[k]["m"], c[k - 1]["m"]) for k in range(1, STEPS)], rel=1e-6)
    assert y == pytest.approx([relative_l1(c[k]["out"], c[k - 1]["out"]) for k in range(1, STEPS)], rel=1e-6)
    np.testing.assert_allclose(fit_rescale(x, y, degree=2), np.polyfit(x, y, 2), rtol=1e-10)
    with pytest.raises(ValueError, match="cannot fit a polynomial of degree 4"):
        fit_rescale(x[:4], y[:4], degree=4)


def test_fit_forecaster_writes_teacache_json_and_the_preset_reads_it(tmp_path):
    import shutil
    import sys

    folder = tmp_path / "flow_teacher"
    shutil.copytree(asset_path("flow_teacher"), folder)
    proc = run_cli([sys.executable, "-m", "distill.fit_forecaster", "accelerate=teacache", f"pipeline={folder}",
                           "scheduler=flow_euler", "steps=[6]", "num_per_class=1", "batch_size=10", "degree=2",
                           "guidance_scale=3.0", f"hydra.run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    saved = json.loads((folder / TEACACHE_FILE).read_text())
    assert saved["pairs"] == 5 and len(saved["coefficients"]) == 3 and saved["scheduler"] == "flow_euler"
    cache = preset("teacache", path=str(folder))
    assert isinstance(cache, TeaCache) and cache.coefficients is None
    cache.check()
    assert cache.coefficients == saved["coefficients"]


def test_bad_input_is_refused_before_sampling(tmp_path):
    from diffusers import UNet2DConditionModel

    with pytest.raises(ValueError, match="threshold=-0.1 must be a number >= 0"):
        FirstBlockCache(threshold=-0.1)
    with pytest.raises(ValueError, match=r"does not exist: fit it with python -m distill.fit_forecaster "
                                         r"accelerate=teacache"):
        TeaCache(path=str(tmp_path)).check()
    unet = UNet2DConditionModel(block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4,
                                cross_attention_dim=8, attention_head_dim=2, sample_size=8,
                                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"))
    with pytest.raises(ValueError, match="the denoiser is a UNet2DConditionModel .*use accelerate=deepcache"):
        stack_blocks(unet)


def test_evaluate_refuses_teacache_without_its_polynomial_with_exit_2(tmp_path):
    import shutil
    import sys

    folder = tmp_path / "flow_teacher"
    shutil.copytree(asset_path("flow_teacher"), folder)
    proc = run_cli([sys.executable, "-m", "distill.evaluate", f"pipeline={folder}", "accelerate=teacache",
                           "schedulers=[flow_euler]", "steps=[4]", "num_per_class=1", f"hydra.run.dir={tmp_path}/e"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and f"{folder / TEACACHE_FILE}, which does not exist" in proc.stderr
    assert not (tmp_path / "e" / "quality_cost.csv").exists()
