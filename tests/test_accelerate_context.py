"""The sampling context accelerators receive, and an accelerator added from one file
(``tests/examples/toy_accelerator.py``): every pipeline call is a trajectory of its own (also after one stopped
early), the step callback and the call count are the pipeline's, the cost meter learns from the context what ran
(the toy's reused calls halve the NFE and the FLOPs), interval 1 is plain sampling bit for bit, and the toy is
selectable by kind from the command line as a plugin."""

import csv
import os
import sys
from pathlib import Path

import pytest
import torch

from distill.accelerate import (
    ACCELERATORS,
    SamplingContext,
    accelerated,
    accelerated_denoiser,
    context_of,
    make_accelerator,
)
from distill.metrics.cost import NFECounter, measure_cost
from distill.utils.flops import count_flops
from distill.worlds.digits import asset_path
from tests.conftest import run_cli
from tests.examples.toy_accelerator import ReuseOutput

PROMPTS = ["a handwritten digit 3", "a handwritten digit 7"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pipe():
    from diffusers import DDIMScheduler

    from distill.inference.loading import load_pipeline

    pipe = load_pipeline(str(asset_path("teacher")))
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _images(pipe, steps=8, **kw):
    return pipe(PROMPTS, num_inference_steps=steps, guidance_scale=3.0, generator=torch.Generator().manual_seed(0),
                output_type="pt", **kw).images


def test_the_toy_is_registered_and_built_by_kind():
    assert ACCELERATORS.get("reuse") is ReuseOutput
    toy = make_accelerator("reuse", {"interval": 3}, path="ignored")  # an option it does not take is not passed
    assert isinstance(toy, ReuseOutput) and toy.describe() == "reuse(N=3)"
    with pytest.raises(ValueError, match=r"accelerate\.options\.interval=0"):
        make_accelerator("reuse", {"interval": 0})


def test_interval_1_equals_plain_sampling_bit_for_bit(pipe):
    with NFECounter(pipe.unet) as plain_count:
        plain = _images(pipe)
    with accelerated(pipe, ReuseOutput(interval=1)) as context, NFECounter(pipe.unet) as counter:
        same = _images(pipe, callback_on_step_end=context.step_end)
    assert torch.equal(same, plain)
    assert counter.calls == plain_count.calls == 8 and counter.predicted == 0
    assert (context.num_calls, context.call, context.step) == (8, 7, 8)
    assert context_of(pipe.unet) is None and "forward" not in pipe.unet.__dict__


def test_reused_calls_halve_the_nfe_and_flops_the_cost_meter_measures(pipe):
    """Batch of 2 prompts under CFG (one network call of 4 rows a step): 8 steps are 16 evaluations per image
    plainly, 8 with every other call reused; the FLOPs drop by exactly the 4 calls not run."""
    def cost(accelerator):
        with accelerated(pipe, accelerator), NFECounter(pipe.unet) as counter:
            # several pipeline calls in one block: each is a trajectory of its own
            return measure_cost(lambda: _images(pipe), counter, len(PROMPTS), params=1, repeats=1), counter

    plain, _ = cost(None)
    toy, counter = cost(ReuseOutput(interval=2))
    assert plain.nfe == 16 and toy.nfe == 8
    # since the meter's reset: the counted, the timed and the FLOP-counted call, each 4 calls run and 4 reused
    assert (counter.calls, counter.predicted, counter.cached) == (12, 12, 0)
    # the FLOPs saved are those of the 4 network calls not run (the text encoder and VAE run as before)
    unet, size = pipe.unet, pipe.unet.config.sample_size
    x = torch.zeros(2 * len(PROMPTS), unet.config.in_channels, size, size)
    text = torch.cat(pipe.encode_prompt(PROMPTS, "cpu", 1, True))  # the CFG batch's 4 rows
    call = count_flops(lambda: unet(x, torch.tensor(500), encoder_hidden_states=text))
    saved = (plain.gflops_per_image - toy.gflops_per_image) * len(PROMPTS) * 1e9
    assert saved == pytest.approx(4 * call, rel=1e-6)


def test_the_context_records_what_ran_on_each_call():
    """A loop of one's own (``accelerated_denoiser``): interval 3 computes calls 0, 3, 6 and repeats their outputs."""
    class Net(torch.nn.Module):
        def forward(self, k):
            return k.float() * torch.ones(2)

    net, ran = Net(), []
    with accelerated_denoiser(net, ReuseOutput(interval=3), 7), NFECounter(net) as counter:
        context = context_of(net)
        outs = []
        for k in range(7):
            outs.append(float(net(torch.tensor([k]))[0]))
            ran.append(context.ran)
    assert outs == [0, 0, 0, 3, 3, 3, 6]
    assert ran == ["full", "predicted", "predicted", "full", "predicted", "predicted", "full"]
    assert (counter.calls, counter.predicted) == (3, 4)


def test_the_cost_meter_counts_a_transformer_called_by_keyword():
    """SD3's and Flux's pipelines call their transformer with keywords only (``hidden_states=latents, ...``): the
    meter counts the examples of the network's first input, whatever it is named, positional or keyword."""
    class Transformer(torch.nn.Module):
        def forward(self, hidden_states, timestep=None, encoder_hidden_states=None):
            return hidden_states * 2

    net = Transformer()
    with NFECounter(net) as counter:
        net(hidden_states=torch.zeros(3, 4), timestep=torch.zeros(3), encoder_hidden_states=torch.zeros(3, 5, 8))
        net(torch.zeros(2, 4), torch.zeros(2))
    assert (counter.calls, counter.examples) == (2, 5)


def test_a_call_that_stopped_early_does_not_leak_into_the_next(pipe):
    """The trajectory begins at the scheduler's new timesteps, not at a progress bar: after a call interrupted
    at its 3rd step (as the server's cancel does), the next call is sampled as if it came first."""
    toy = ReuseOutput(interval=3)
    with accelerated(pipe, toy):
        fresh = _images(pipe)

    def stop_after_3(p, i, t, tensors):
        p._interrupt = i >= 2
        return tensors

    with accelerated(pipe, toy) as context:
        _images(pipe, callback_on_step_end=stop_after_3)
        assert context.call == 2 and context.num_calls == 8  # 3 of 8 calls ran
        again = _images(pipe)
    assert torch.equal(again, fresh)


def test_the_in_house_sampler_calls_the_step_callback_too():
    """``DistillClassPipeline`` (``distill.inference.sampling.sample``) takes diffusers' step callback: under CFG
    (one batched call a step) 6 steps are 6 calls, and the toy reuses 3 of them."""
    from diffusers import DDIMScheduler, UNet2DModel

    from distill.inference.pipelines import DistillClassPipeline

    torch.manual_seed(0)
    unet = UNet2DModel(sample_size=8, in_channels=1, out_channels=1, block_out_channels=(8, 8), layers_per_block=1,
                       down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
                       norm_num_groups=4, num_class_embeds=11).eval()
    pipe = DistillClassPipeline(unet, DDIMScheduler())
    pipe.set_progress_bar_config(disable=True)

    def images(**kw):
        return pipe([3, 7], num_inference_steps=6, guidance_scale=2.0, generator=torch.Generator().manual_seed(0),
                    output_type="pt", **kw).images

    plain = images()
    with accelerated(pipe, ReuseOutput(interval=1)) as context:
        same = images(callback_on_step_end=context.step_end)
    assert torch.equal(same, plain) and (context.num_calls, context.call, context.step) == (6, 5, 6)
    with accelerated(pipe, ReuseOutput(interval=2)), NFECounter(unet) as counter:
        reused = images()
    assert (counter.calls, counter.predicted) == (3, 3) and not torch.equal(reused, plain)


def test_one_session_per_denoiser_and_callers_set_only_their_fields(pipe):
    with accelerated(pipe, ReuseOutput()) as context:
        with pytest.raises(RuntimeError, match="already samples with an accelerator"):
            with accelerated_denoiser(pipe.unet, ReuseOutput(), 4):
                pass
        with pytest.raises(TypeError, match=r"update\(call=...\).*'prompts'"):
            context.update(call=3)
        assert context.update(prompts=["x"]).prompts == ["x"]
    assert context_of(pipe.unet) is None
    assert SamplingContext().scheduler is None


def test_the_toy_is_selectable_from_the_command_line(tmp_path):
    """``DISTILL_PLUGINS=tests.examples.toy_accelerator python -m distill.evaluate accelerate.kind=reuse``: the
    row is the toy's, and its NFE (CFG: 2 evaluations a computed call) is half of 4 steps' 8."""
    env = {**os.environ, "DISTILL_PLUGINS": "tests.examples.toy_accelerator", "OMP_NUM_THREADS": "1"}
    proc = run_cli([sys.executable, "-m", "distill.evaluate", "accelerate.kind=reuse",
                           "+accelerate.options.interval=2", "steps=[4]", "num_per_class=1", "cost_repeats=1",
                           "grids=false", "guidance_scale=3", f"hydra.run.dir={tmp_path}"],
                          capture_output=True, text=True, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = csv.DictReader(open(tmp_path / "quality_cost.csv"))
    assert row["accelerate"] == "reuse(N=2)" and row["model"].endswith("+reuse(N=2)")
    assert float(row["nfe"]) == 4.0
