"""TaylorSeer per block (distill.accelerate.taylorseer) on the digits flow DiT and on SD3 and Flux stand-ins:
interval 1 is plain sampling bit for bit; every forecast module output equals the finite-difference Taylor series
computed by hand from the outputs recorded at the real steps (order 0: the last one reused); a forecast call's
FLOPs are the full call's less those of the forecast and skipped modules, and the meter counts it as cached; a
UNet and bad options are refused before sampling."""

from __future__ import annotations

import math

import pytest
import torch

import distill.inference.pipelines  # noqa: F401  (registers DistillSD3Pipeline)
from distill.accelerate import accelerated, accelerated_denoiser, preset
from distill.accelerate.blockcache import stack_blocks
from distill.accelerate.forecast import real_steps
from distill.accelerate.taylorseer import TaylorSeer, block_modules
from tests.test_blockcache import STEPS, pipe  # noqa: F401  (the flow teacher fixture)


def sample(pipe, accelerator=None, prompts=("a handwritten digit three", "a handwritten digit seven"), **call):  # noqa: F811  (a parameter, not the fixture)
    call = {"guidance_scale": 3.0, "num_inference_steps": STEPS, **call}
    with accelerated(pipe, accelerator):
        return pipe(list(prompts), generator=torch.Generator().manual_seed(0), output_type="latent", **call).images


class ModuleRecorder:
    """The output of every forecast and skipped module at every call, as the block received it (torch forward
    hooks run after the accelerator's hook has answered): ``calls[k][name]`` a tuple of tensors (Nones dropped)."""

    def __init__(self, net):
        self.calls = []
        self.handles = [net.register_forward_pre_hook(lambda m, a: self.calls.append({}))]
        for i, block in enumerate(stack_blocks(net)):
            forecast, skipped = block_modules(block)
            for name in forecast + skipped:
                self.handles.append(getattr(block, name).register_forward_hook(
                    lambda m, a, out, key=f"{i}.{name}": self.calls[-1].__setitem__(key, tuple(
                        t.detach().clone() for t in (out if isinstance(out, tuple) else (out,)) if t is not None))))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def hand_taylor(outputs: dict[int, torch.Tensor], real: list[int], k: int, order: int) -> torch.Tensor:
    """TaylorSeer's forecast at step k by hand: divided backward differences over the last order + 1 real steps
    r_0 < ... < r_m before k, each factor updated at every real step (F^(i+1)(r_j) = (F^(i)(r_j) - F^(i)(r_j-1))
    / (r_j - r_j-1)), then sum_i F^(i)(r_m) (k - r_m)^i / i!."""
    before = [r for r in real if r < k]
    factors: list[torch.Tensor] = []
    for j, r in enumerate(before):
        new = [outputs[r].double()]
        for i in range(min(order, len(factors))):
            new.append((new[i] - factors[i]) / (r - before[j - 1]))
        factors = new
    return sum(f * (k - before[-1]) ** i / math.factorial(i) for i, f in enumerate(factors))


def test_interval_1_is_plain_sampling_bit_for_bit_and_the_hooks_go_away(pipe):  # noqa: F811  (the fixture imported above)
    plain = sample(pipe)
    seer = TaylorSeer(interval=1)
    assert torch.equal(sample(pipe, seer), plain)
    assert seer.decisions == [True] * STEPS
    assert all("forward" not in b.attn.__dict__ for b in pipe.transformer.transformer_blocks)


def check_forecasts(rec: ModuleRecorder, seer: TaylorSeer, real: list[int], order: int, calls_per_step: int = 1):
    assert seer.decisions == [k // calls_per_step in real for k in range(len(rec.calls))]
    forecast, skipped = [], []
    for name, _, kind in seer.modules:
        (forecast if kind else skipped).append(name)
    for branch in range(calls_per_step):
        calls = rec.calls[branch::calls_per_step]
        for k in range(STEPS):
            if k in real:
                continue
            for name in forecast:
                for i, got in enumerate(calls[k][name]):
                    expected = hand_taylor({r: calls[r][name][i] for r in real}, real, k, order)
                    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
            for name in skipped:  # a single-stream block's attention and MLP: zeros, proj_out forecast
                assert all(not t.any() for t in calls[k][name])
    return forecast, skipped


@pytest.mark.parametrize("order", [0, 2])
def test_each_forecast_is_the_finite_difference_taylor_series_of_the_real_steps_on_an_sd3_stand_in(tmp_path, order):
    from tests.sd3_tiny import tiny_sd3_pipeline

    sd3 = tiny_sd3_pipeline(tmp_path)
    sd3.set_progress_bar_config(disable=True)
    seer = TaylorSeer(interval=3, warmup=3, order=order)
    real = real_steps(STEPS, 3, 3, 1)
    assert real == [0, 1, 2, 5, 7]  # forecasts 3, 4 (from 0, 1, 2) and 6 (from 5: unequal spacing)
    with ModuleRecorder(sd3.transformer) as rec:
        images = sample(sd3, seer, prompts=["a handwritten digit three"], height=32, width=32)
    forecast, skipped = check_forecasts(rec, seer, real, order)
    # SD3.5's dual-attention block 0: attn, attn2, ff, ff_context; the last block has no ff_context
    assert forecast == ["0.attn", "0.attn2", "0.ff", "0.ff_context", "1.attn", "1.ff"] and skipped == []
    assert not torch.equal(images, sample(sd3, prompts=["a handwritten digit three"], height=32, width=32))
    if order == 0:  # reuse: the forecast is the last real output itself
        assert torch.equal(rec.calls[4]["0.ff"][0], rec.calls[2]["0.ff"][0])


def test_flux_forecasts_double_blocks_and_single_blocks_proj_out_per_true_cfg_pass(tmp_path):
    from tests.flux_tiny import tiny_flux_pipeline

    flux = tiny_flux_pipeline(tmp_path, guidance_embeds=False, num_layers=2, num_single_layers=2)
    flux.set_progress_bar_config(disable=True)
    seer = TaylorSeer(interval=3, warmup=3, order=2)
    call = dict(height=32, width=32, max_sequence_length=8, negative_prompt="", true_cfg_scale=3.0)
    with ModuleRecorder(flux.transformer) as rec:
        sample(flux, seer, prompts=["a handwritten digit three"], **call)
    # FluxPipeline's true CFG: two calls a step, each pass its own factors
    forecast, skipped = check_forecasts(rec, seer, real_steps(STEPS, 3, 3, 1), 2, calls_per_step=2)
    assert forecast == ["0.attn", "0.ff", "0.ff_context", "1.attn", "1.ff", "1.ff_context", "2.proj_out",
                        "3.proj_out"] and skipped == ["2.attn", "2.proj_mlp", "3.attn", "3.proj_mlp"]


def test_a_forecast_call_costs_the_cheap_parts_only_and_is_metered_as_cached(pipe):  # noqa: F811
    from torch.utils.flop_counter import FlopCounterMode

    from distill.metrics.cost import NFECounter
    from distill.utils.flops import _cpu_attention_formulas

    net, generator = pipe.transformer, torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(2, 4, 8, 8, generator=generator), timestep=torch.tensor([700.0] * 2),
                  encoder_hidden_states=torch.randn(2, 2, 128, generator=generator),
                  pooled_projections=torch.randn(2, 128, generator=generator))
    seer = TaylorSeer(steps=[0])

    def flops(timestep: float) -> FlopCounterMode:
        with FlopCounterMode(display=False, custom_mapping=_cpu_attention_formulas()) as counter, torch.no_grad():
            net(**{**inputs, "timestep": torch.tensor([timestep] * 2)})
        return counter

    with NFECounter(net) as meter, accelerated_denoiser(net, seer, 2):
        full, forecast = flops(700.0), flops(650.0)
    assert seer.decisions == [True, False] and (meter.calls, meter.cached, meter.examples) == (2, 1, 4)
    counts = full.get_flop_counts()
    saved = sum(sum(counts[f"SD3Transformer2DModel.transformer_blocks.{name}"].values()) for name, _, _ in seer.modules)
    assert forecast.get_total_flops() == full.get_total_flops() - saved
    assert forecast.get_total_flops() < 0.2 * full.get_total_flops()  # embedding, modulation and head only


def test_the_preset_and_bad_input_are_refused_before_sampling(pipe):  # noqa: F811
    from diffusers import UNet2DConditionModel

    seer = preset("taylorseer")
    assert isinstance(seer, TaylorSeer) and seer.describe() == "taylorseer(O=1,N=3)"
    with pytest.raises(ValueError, match="accelerate.options.interval=0 must be an integer >= 1"):
        TaylorSeer(interval=0)
    with pytest.raises(ValueError, match="warmup=2 is below order \\+ 1 = 3"):
        TaylorSeer(order=2)
    unet = UNet2DConditionModel(block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4,
                                cross_attention_dim=8, attention_head_dim=2, sample_size=8,
                                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"))
    with pytest.raises(ValueError, match="the denoiser is a UNet2DConditionModel .*use accelerate=deepcache"):
        with accelerated_denoiser(unet, TaylorSeer(), 4):
            pass
    with pytest.raises(ValueError, match="accelerate=forecast predicts UNet calls one after another, but "
                                         "FlowMatchHeunDiscreteScheduler is of order 2"):
        from diffusers import FlowMatchHeunDiscreteScheduler

        TaylorSeer().check_scheduler(FlowMatchHeunDiscreteScheduler)
