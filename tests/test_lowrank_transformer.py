"""Low rank and fusion of diffusion transformers (distill/compress/lowrank_transformer.py, distill/compress/fusion.py)
on the embedded digits flow DiT (SD3Transformer2DModel with qk_norm) and the SD3 (SD3.5's second attention, a
context_pre_only last block) and Flux (2 double- and 2 single-stream blocks) stand-ins: full rank reproduces the
network; a truncated layer is torch.linalg.svd's rank-r matrix; the energy rule's ranks by hand; a FLOPs budget's
greedy fill by hand and its FLOPs against the counter; fused QKV equals the unfused network; the export loads in a
fresh process with DiffusionPipeline.from_pretrained and computes the same; bad input refused before compute."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import distill.inference.pipelines  # noqa: F401  (registers distill's export classes, as a user loading an export does)
from distill.compress.fusion import fuse_denoiser, fuse_transformer
from distill.compress.lowrank import LowRankLinear, call_flops, choose_ranks, layer_rows
from distill.compress.lowrank_transformer import lowrank_transformer
from distill.compress.prune_transformer import transformer_blocks, transformer_example_inputs
from distill.families import load_teacher
from distill.worlds import asset_path
from tests.conftest import ROOT
from tests.flux_tiny import tiny_flux_pipeline
from tests.sd3_tiny import tiny_sd3_pipeline

# autouse, module scope: LAPACK's SVD of small matrices on two threads of a busy 2-core machine spins (0.27 s for a
# 96 x 96 one, 7 ms on one thread)
from tests.test_gradient_checkpointing import one_thread  # noqa: F401

PROMPT = "a handwritten digit three"
TEXT_LEN = 3


@pytest.fixture(scope="module")
def networks(tmp_path_factory):
    """name -> (transformer, its example inputs)."""
    folder = tmp_path_factory.mktemp("vocab")
    digits = load_teacher(str(asset_path("flow_teacher"))).denoiser
    sd3 = tiny_sd3_pipeline(folder / "sd3").transformer
    flux = tiny_flux_pipeline(folder / "flux", num_layers=2, num_single_layers=2).transformer
    return {"digits": (digits, transformer_example_inputs(digits, text_len=TEXT_LEN)),
            "sd3": (sd3, transformer_example_inputs(sd3, text_len=TEXT_LEN)),
            "flux": (flux, transformer_example_inputs(flux, text_len=TEXT_LEN, latent_size=8))}


def _out(net, inputs) -> torch.Tensor:
    with torch.no_grad():
        return net(**inputs).sample


def _copy(net: nn.Module) -> nn.Module:
    copy = type(net).from_config(net.config)
    copy.load_state_dict(net.state_dict())
    return copy.eval()


def _block_linears(net: nn.Module) -> set[str]:
    """The linears a transformer's low rank factorises by default: every block's, but its adaLN modulation."""
    return {f"{b}.{n}" for b, block in transformer_blocks(net).items() for n, m in block.named_modules()
            if isinstance(m, nn.Linear) and not n.startswith("norm")}


@pytest.mark.parametrize("name", ["digits", "sd3", "flux"])
def test_full_rank_reproduces_the_network_and_factorises_the_block_linears(name, networks):
    """Energy 1 at any size factorises every attention projection of both streams, every MLP and Flux's single-block
    proj_mlp / proj_out at full rank: the output is the original's within float rounding."""
    net, inputs = networks[name]
    export, report = lowrank_transformer(net, energy=1.0, only_if_smaller=False, example_inputs=inputs)
    assert set(report.ranks) == _block_linears(net)
    if name == "flux":
        assert {"single_transformer_blocks.1.proj_mlp", "single_transformer_blocks.1.proj_out",
                "transformer_blocks.0.attn.add_k_proj", "transformer_blocks.0.ff_context.net.2"} <= set(report.ranks)
    if name == "sd3":
        assert {"transformer_blocks.0.attn2.to_q", "transformer_blocks.1.attn.add_v_proj"} <= set(report.ranks)
    assert all(isinstance(export.get_submodule(n), LowRankLinear) for n in report.ranks)
    ref = _out(net, inputs)
    assert torch.allclose(_out(export, inputs), ref, atol=2e-5 * float(ref.abs().max()), rtol=0)
    assert report.flops == call_flops(net, inputs) and report.flops_after == call_flops(export, inputs)


def test_a_truncated_linear_is_the_hand_svd_and_nothing_else_changes(networks):
    """rank {layer: 5}: up @ down is U_5 S_5 V_5^T of torch.linalg.svd, the bias kept, the predicted error
    sqrt(sum_{i>5} s_i^2 / sum s_i^2); every other weight is the original's."""
    net, inputs = networks["digits"]
    name = "transformer_blocks.1.attn.to_k"
    export, report = lowrank_transformer(net, rank={name: 5}, example_inputs=inputs)
    assert report.ranks == {name: 5}
    w = net.get_submodule(name).weight.detach().double()
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    low = export.get_submodule(name)
    hand = u[:, :5] @ torch.diag(s[:5]) @ vh[:5]
    assert torch.allclose((low.up.weight.double() @ low.down.weight.double()), hand, atol=1e-6)
    assert torch.equal(low.up.bias, net.get_submodule(name).bias)
    x = torch.randn(7, w.shape[1])
    with torch.no_grad():
        assert torch.allclose(low(x).double(), x.double() @ hand.T + low.up.bias.double(), atol=1e-5)
    layer = next(lr for lr in report.layers if lr.name == name)
    assert layer.predicted_error == pytest.approx(float((s[5:].square().sum() / s.square().sum()).sqrt()), rel=1e-9)
    dense = {k: v for k, v in net.state_dict().items() if not k.startswith(name + ".")}
    state = export.state_dict()
    assert all(torch.equal(state[k], v) for k, v in dense.items())


def test_energy_picks_the_smallest_rank_keeping_that_share_where_it_saves_parameters(networks):
    net, inputs = networks["digits"]
    _, report = lowrank_transformer(net, energy=0.85, example_inputs=inputs)
    for name in _block_linears(net):
        s2 = torch.linalg.svdvals(net.get_submodule(name).weight.detach().double()).square()
        r = int((s2.cumsum(0) / s2.sum() < 0.85).sum()) + 1
        out, inner = net.get_submodule(name).weight.shape
        assert report.ranks.get(name) == (r if r * (out + inner) < out * inner else None), name


class TwoLinears(nn.Module):
    """Two 32 x 32 linears with singular values 2 ... 1, one on one row per call, the other on 64."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.once, self.often = nn.Linear(32, 32), nn.Linear(32, 32)
        for layer in (self.once, self.often):
            u, _ = torch.linalg.qr(torch.randn(32, 32, generator=g))
            v, _ = torch.linalg.qr(torch.randn(32, 32, generator=g))
            layer.weight.data = u @ torch.diag(torch.linspace(2, 1, 32)) @ v.T

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.once(a), self.often(b)


def test_a_flops_budget_fills_the_cheap_layer_first_by_hand_and_counts_as_the_flop_counter():
    """FLOPs of a call: 2 (1 + 64) 32 32 = 133120; half of it allows 33280 multiply-adds. A parameter of ``once``
    costs 1 row, one of ``often`` 64: with spectra this flat ``once`` goes dense first (1024), leaving ``often``
    floor((33280 - 1024) / (64 * 64)) = 7 ranks, 2 (1024 + 7 * 64 * 64) = 59392 FLOPs."""
    model, inputs = TwoLinears(), {"a": torch.randn(1, 32), "b": torch.randn(64, 32)}
    assert layer_rows(model, inputs) == {"once": 1, "often": 64}
    report = choose_ranks(model, budget=0.5, target="flops", example_inputs=inputs)
    assert report.flops == call_flops(model, inputs) == 133120
    assert report.ranks == {"often": 7} and report.flops_after == 59392
    by_params = choose_ranks(model, budget=0.5)  # the same layers alike by parameters
    assert by_params.ranks == {"once": 8, "often": 8}  # 1024 of 2048 weights: 8 ranks of 64 each


def test_a_flops_budget_on_the_dit_is_met_within_one_rank_step_and_counted_exactly(networks):
    """On the digits DiT the predicted FLOPs are the counter's on the export, at or under the budget by less than
    the largest rank step; attention and the dense layers count, and a budget under their floor is refused."""
    net, inputs = networks["digits"]
    rows = layer_rows(net, inputs)
    assert rows["transformer_blocks.0.attn.to_q"] == 64 and rows["transformer_blocks.0.attn.add_q_proj"] == TEXT_LEN
    assert rows["transformer_blocks.0.norm1.linear"] == 1  # adaLN: one row per sample
    export, report = lowrank_transformer(net, budget=0.5, target="flops", example_inputs=inputs)
    measured = call_flops(export, inputs)
    assert report.flops_after == measured
    step = max(2 * rows[n] * sum(net.get_submodule(n).weight.shape) for n in report.ranks)
    assert 0.5 * report.flops - step < measured <= 0.5 * report.flops
    with pytest.raises(ValueError, match=r"budget=0.05 of the FLOPs is below .* raise budget to >= 0\.\d+"):
        lowrank_transformer(net, budget=0.05, target="flops", example_inputs=inputs)


@pytest.mark.parametrize("name", ["digits", "sd3", "flux"])
def test_fused_qkv_equals_the_unfused_network_and_is_what_runs(name, networks):
    """One to_qkv / to_added_qkv matmul per stream, qk_norm applied (SD3's processor here, Flux's own): the output is
    the unfused one's; zeroing the unfused to_q weights afterwards changes nothing (the fused projection runs)."""
    net, inputs = networks[name]
    fused = _copy(net)
    _, applied = fuse_transformer(fused)
    assert applied and applied[0].startswith("qkv: to_qkv in")
    ref = _out(net, inputs)
    assert torch.allclose(_out(fused, inputs), ref, atol=1e-5 * float(ref.abs().max()), rtol=0)
    with torch.no_grad():
        for m in fused.modules():
            if getattr(m, "fused_projections", False):
                m.to_q.weight.zero_()
    assert torch.allclose(_out(fused, inputs), ref, atol=1e-5 * float(ref.abs().max()), rtol=0)


def test_diffusers_fused_joint_processor_skips_qk_norm_which_is_why_sd3_fuses_here(networks):
    """diffusers 0.42's fuse_qkv_projections on an SD3 transformer with qk_norm (the digits DiT) changes its output:
    FusedJointAttnProcessor2_0 skips the RMSNorm of q and k. When this fails, diffusers fixed it."""
    net, inputs = networks["digits"]
    stock = _copy(net)
    stock.fuse_qkv_projections()
    assert (_out(stock, inputs) - _out(net, inputs)).abs().max() > 0.1


def test_fusion_skips_factorised_projections_and_refuses_channels_last(networks):
    net, inputs = networks["digits"]
    low, _ = lowrank_transformer(net, rank=8, example_inputs=inputs)
    before = _out(low, inputs)
    _, applied = fuse_transformer(low)
    assert applied == ["qkv: skipped, 4 attention layers have factorised (low-rank) projections that cannot be "
                       "concatenated"]
    assert torch.equal(_out(low, inputs), before)
    with pytest.raises(ValueError, match="channels_last=true .* a transformer.*set channels_last=false"):
        fuse_denoiser(_copy(net), channels_last=True)


def test_the_export_loads_in_a_fresh_process_and_computes_the_same(networks, tmp_path):
    """The digits teacher's pipeline with its transformer at half its FLOPs: model_index.json names the distill class,
    its config the ranks, and DiffusionPipeline.from_pretrained in a new process (after importing
    distill.inference.pipelines, as for every distill export: diffusers imports no library a model_index.json names)
    gives the in-memory network's weights and outputs, and the pipeline's images."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(asset_path("flow_teacher"))
    inputs = networks["digits"][1]
    low, report = lowrank_transformer(pipe.transformer, budget=0.5, target="flops", example_inputs=inputs)
    pipe.register_modules(transformer=low.eval())
    pipe.save_pretrained(tmp_path / "sd3")
    index = json.loads((tmp_path / "sd3" / "model_index.json").read_text())
    assert index["transformer"] == ["distill.compress.lowrank_transformer", "LowRankSD3Transformer2DModel"]
    config = json.loads((tmp_path / "sd3" / "transformer" / "config.json").read_text())
    assert config["lowrank_ranks"] == report.ranks and config["pruned_blocks"] == {}
    torch.save(inputs, tmp_path / "inputs.pt")
    pipe.set_progress_bar_config(disable=True)
    images = pipe(PROMPT, num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="pt").images
    script = f"""
import torch, distill.inference.pipelines
from diffusers import DiffusionPipeline
pipe = DiffusionPipeline.from_pretrained({str(tmp_path / 'sd3')!r})
pipe.set_progress_bar_config(disable=True)
with torch.no_grad():
    out = pipe.transformer(**torch.load({str(tmp_path / 'inputs.pt')!r})).sample
images = pipe({PROMPT!r}, num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="pt").images
torch.save({{"class": type(pipe.transformer).__name__, "state": pipe.transformer.state_dict(), "out": out,
            "images": images}}, {str(tmp_path / 'out.pt')!r})
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    assert out["class"] == "LowRankSD3Transformer2DModel"
    state = low.state_dict()
    assert state.keys() == out["state"].keys() and all(torch.equal(state[k], out["state"][k]) for k in state)
    # bit-identical weights; safetensors may map them unaligned, where CPU kernels sum in another order
    assert torch.allclose(out["out"], _out(low, inputs), rtol=0, atol=1e-6)
    assert torch.allclose(out["images"], images, rtol=0, atol=1e-5)


def test_a_flux_export_round_trips_through_save_pretrained(networks, tmp_path):
    from distill.compress.lowrank_transformer import LowRankFluxTransformer2DModel

    net, inputs = networks["flux"]
    low, report = lowrank_transformer(net, energy=0.9, example_inputs=inputs)
    assert any(n.startswith("single_transformer_blocks.") for n in report.ranks)
    low.save_pretrained(tmp_path / "transformer")
    loaded = LowRankFluxTransformer2DModel.from_pretrained(tmp_path / "transformer").eval()
    assert loaded.config.lowrank_ranks == report.ranks
    state = low.state_dict()
    assert all(torch.equal(state[k], v) for k, v in loaded.state_dict().items()) and state.keys() == loaded.state_dict().keys()
    assert torch.allclose(_out(loaded, inputs), _out(low.eval(), inputs), rtol=0, atol=1e-6)


def test_a_pruned_transformer_factorised_keeps_its_blocks(networks):
    from distill.compress.prune_transformer import prune_transformer

    net, inputs = networks["sd3"]
    pruned, _ = prune_transformer(net, 0.5, example_inputs=inputs)
    low, report = lowrank_transformer(pruned, energy=1.0, only_if_smaller=False, example_inputs=inputs)
    assert low.config.pruned_blocks == pruned.config.pruned_blocks and low.config.lowrank_ranks == report.ranks
    rebuilt = type(low).from_config(low.config)
    rebuilt.load_state_dict(low.state_dict())
    ref = _out(pruned, inputs)
    assert torch.allclose(_out(rebuilt.eval(), inputs), ref, atol=2e-5 * float(ref.abs().max()), rtol=0)


def test_bad_input_is_refused_naming_it(networks):
    net, inputs = networks["digits"]
    with pytest.raises(ValueError, match="factorises SD3 and Flux transformers; got a Linear"):
        lowrank_transformer(nn.Linear(2, 2))
    fused = _copy(net)
    fused.fuse_qkv_projections()
    with pytest.raises(ValueError, match="fused QKV projections; factorise the unfused transformer"):
        lowrank_transformer(fused, rank=4, example_inputs=inputs)
    low, _ = lowrank_transformer(net, rank=4, example_inputs=inputs)
    with pytest.raises(ValueError, match="is factorised already"):
        lowrank_transformer(low, rank=4, example_inputs=inputs)
    with pytest.raises(ValueError, match="target='bytes' is not one of"):
        lowrank_transformer(net, budget=0.5, target="bytes", example_inputs=inputs)


@pytest.mark.parametrize("overrides, words", [
    (["student.budget=null"], ["exactly one of student.rank, student.energy, student.budget", "none"]),
    (["student.budget=1.5"], ["student.budget=1.5 must be a fraction in (0, 1]"]),
    (["student.target=bytes"], ["student.target='bytes' is not one of ['params', 'flops']"]),
    (["student.time_cond_proj_dim=8"], ["student.time_cond_proj_dim=8", "SD3Transformer2DModel",
                                        "student.time_cond_proj_dim=null"]),
])
def test_bad_student_options_are_refused_at_validation(overrides, words, compose):
    """The student's config check (distill.train exits 2 on it, before any model is built)."""
    from distill.config.validate import ConfigError, validate

    with pytest.raises(ConfigError) as err:
        validate(compose("+exp=compress_flow", "teacher=digits_flow", "student=lowrank", *overrides))
    assert all(w in str(err.value) for w in words), str(err.value)


def test_evaluate_refuses_channels_last_on_a_transformer_before_loading(monkeypatch, tmp_path):
    """distill.evaluate's sweep (whose ValueError the command turns into exit 2) refuses channels_last on the flow
    teacher from its model_index.json: the pipeline is never loaded."""
    from hydra import compose, initialize_config_dir

    import distill.evaluate as evaluate
    import distill.inference.loading as loading
    from distill.config.resolvers import register_resolvers
    from distill.config.schema import register_configs

    register_configs()
    register_resolvers()
    monkeypatch.setattr(loading, "load_pipeline", lambda *_: pytest.fail("the pipeline was loaded"))
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="evaluate", overrides=[f"pipeline={asset_path('flow_teacher')}",
                                                         "schedulers=[flow_euler]", "channels_last=true"])
    with pytest.raises(ValueError, match="channels_last=true .* transformer.*set channels_last=false"):
        evaluate.sweep(cfg, tmp_path)


@pytest.mark.slow  # ~35 s; the student's parts are tested above
def test_two_cli_steps_of_compress_flow_with_a_low_rank_student_at_half_the_flops(tmp_path):
    from tests.conftest import run_train

    run_dir = tmp_path / "run"
    proc = run_train("+exp=compress_flow", "teacher=digits_flow", "student=lowrank", "student.budget=0.5",
                     "student.target=flops", "callbacks.quality_cost=null", "data.batch_size=4", "trainer.max_steps=2",
                     "trainer.limit_val_batches=1", "trainer.val_check_interval=2", "sample_grid_seeds=1", "logger=csv",
                     f"hydra.run.dir={run_dir}", env={"OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "budget=0.5 of the FLOPs" in proc.stderr + proc.stdout and "50.0% of the FLOPs" in proc.stderr + proc.stdout
    config = json.loads((run_dir / "export" / "transformer" / "config.json").read_text())
    assert config["_class_name"] == "LowRankSD3Transformer2DModel" and len(config["lowrank_ranks"]) == 30
