"""Mixture-of-experts students of diffusion transformers (distill/models/moe_transformer.py, built by
distill/students/moe.py) on the SD3 stand-in (SD3.5's attn2, a context_pre_only last block) and the Flux stand-in (2
double- and 2 single-stream blocks): one expert computes the dense transformer (SD3 bit for bit; Flux within float
rounding, its single-stream proj_out split in two matmuls); copies of the dense FFN under any top-2 routing compute it
too; a top-2 layer against a hand computation (Flux's split proj_out included); FLOPs counted with the repo's counter:
top-1 adds exactly the routers' 2 T D E, top-2 one more dense FFN per token, a timestep-routed call exactly the dense
one's; hand-over timesteps on flow time; the export in a fresh process; two CLI steps; refusals before compute."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
import torch

import distill.inference.pipelines  # noqa: F401  (registers distill's export classes, as a user loading an export does)
from distill.compress.prune_transformer import transformer_example_inputs
from distill.metrics.cost import NFECounter
from distill.models.moe import MoEFeedForward, expert_boundaries, moe_aux_and_stats
from distill.models.moe_transformer import (
    TimestepMoEFluxTransformer2DModel,
    TimestepMoESD3Transformer2DModel,
    TokenMoEFluxTransformer2DModel,
    TokenMoESD3Transformer2DModel,
    flow_alphas_cumprod,
)
from distill.students.moe import timestep_moe_student, token_moe_student
from distill.utils.flops import count_flops
from tests.conftest import ROOT, run_train
from tests.flux_tiny import tiny_flux_pipeline
from tests.sd3_tiny import tiny_sd3_pipeline

TEXT_LEN = 3
FLUX_LATENT = 8  # the Flux stand-in on an 8x8 latent: 16 packed image tokens


@pytest.fixture(scope="module")
def pipes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vocab")
    return {"sd3": tiny_sd3_pipeline(folder / "sd3"),
            "flux": tiny_flux_pipeline(folder / "flux", num_layers=2, num_single_layers=2)}


@pytest.fixture(scope="module")
def networks(pipes):
    """name -> (dense transformer, example inputs of a batch of 2)."""
    sd3, flux = pipes["sd3"].transformer, pipes["flux"].transformer
    return {"sd3": (sd3, transformer_example_inputs(sd3, batch_size=2, text_len=TEXT_LEN)),
            "flux": (flux, transformer_example_inputs(flux, batch_size=2, text_len=TEXT_LEN, latent_size=FLUX_LATENT))}


def _out(net, inputs) -> torch.Tensor:
    with torch.no_grad():
        return net(**inputs).sample


def _randomise_routers(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.moe_layers():
            layer.router.weight.copy_(torch.randn(layer.router.weight.shape, generator=g))


@pytest.mark.parametrize("name", ["sd3", "flux"])
def test_one_expert_computes_the_dense_transformer(name, networks):
    """One token expert (its gate softmax(one logit) = 1) and one timestep expert are the dense network: SD3 bit for
    bit; Flux's single-stream proj_out W [a; m] + b becomes W_a a + b + W_m m, equal within float rounding."""
    net, inputs = networks[name]
    dense = _out(net, inputs)
    token = token_moe_student(net, num_experts=1).eval()
    timestep = timestep_moe_student(net, num_experts=1).eval()
    assert torch.equal(_out(timestep, inputs), dense)
    if name == "sd3":
        assert torch.equal(_out(token, inputs), dense)
    else:
        assert torch.allclose(_out(token, inputs), dense, rtol=0, atol=1e-6)
    layers = {"sd3": 2 + 1, "flux": 2 * 2 + 2}[name]  # SD3's last block has no ff_context
    assert len(token.moe_layers()) == layers
    # what the method adds and logs: one expert is perfectly balanced (E sum f P = 1), weight 0.01 per layer
    aux, stats = moe_aux_and_stats(token)
    assert abs(float(aux) - 0.01 * layers) < 1e-6 and stats["router/load_balance_loss"] == 1.0
    assert stats["router/load/e0"] == stats["router/load_t500-749/e0"] == 1.0  # t = 0.5 on the 1000 t scale
    assert moe_aux_and_stats(timestep) == (None, {"router/load/e0": 1.0, "router/load_t500-749/e0": 1.0})
    for model in (token, timestep):  # the cost meter reads the first named input, hidden_states
        with NFECounter(model) as counter:
            _out(model, inputs)
        assert (counter.calls, counter.examples) == (1, 2)


@pytest.mark.parametrize("name", ["sd3", "flux"])
def test_copies_under_any_routing_compute_the_dense_transformer(name, networks):
    """Four exact copies of each FFN, top-2 gates that sum to one, random routers (three draws): the dense output;
    timestep experts that are copies, on a batch split between two experts: the dense output too."""
    net, inputs = networks[name]
    dense = _out(net, inputs)
    moe = token_moe_student(net, num_experts=4, top_k=2, init_noise=0.0, capacity_factor=None).eval()
    for seed in range(3):
        _randomise_routers(moe, seed)
        assert torch.allclose(_out(moe, inputs), dense, rtol=0, atol=1e-5)
    scale = 1000.0 if name == "flux" else 1.0  # Flux's transformer takes t, SD3's 1000 t
    mixed = {**inputs, "timestep": torch.tensor([100.0, 900.0]) / scale}
    experts = timestep_moe_student(net, num_experts=2, boundaries=[500]).eval()
    assert experts.expert_of(torch.tensor([100.0, 900.0])).tolist() == [0, 1]
    assert torch.allclose(_out(experts, mixed), _out(net, mixed), rtol=0, atol=1e-6)


def _capture(module):
    seen = {}

    def hook(_, args, output):
        seen["in"], seen["out"] = args[0].detach(), output.detach()

    return seen, module.register_forward_hook(hook)


def test_top_2_routing_against_a_hand_computation(networks):
    """SD3's ff and a Flux single-stream block with 3 distinct experts, top 2: each token's output is
    sum_j p_j / (p_1 + p_2) E_j(x) over its two most probable experts (GShard / Mixtral), and the single-stream
    proj_out adds it to the dense proj_out's attention columns: W_a a + b + y."""
    torch.manual_seed(0)
    for name, block_of in (("sd3", lambda m: m.transformer_blocks[0].ff),
                           ("flux", lambda m: m.single_transformer_blocks[1])):
        net, inputs = networks[name]
        moe = token_moe_student(net, num_experts=3, top_k=2, init_noise=0.2, capacity_factor=None).eval()
        _randomise_routers(moe, 1)
        target = block_of(moe)
        layer = target if isinstance(target, MoEFeedForward) else target.proj_mlp
        seen, handle = _capture(layer)
        outs = None
        if name == "flux":
            outs, handle2 = _capture(target.proj_out)
        _out(moe, inputs)
        handle.remove()
        x = seen["in"].reshape(-1, seen["in"].shape[-1])
        probs = (x @ layer.router.weight.T).softmax(-1)
        expected = torch.zeros(x.shape[0], seen["out"].shape[-1])
        for i in range(x.shape[0]):
            top = sorted(range(3), key=lambda e: -probs[i, e])[:2]
            norm = probs[i, top].sum()
            for e in top:
                expected[i] += probs[i, e] / norm * layer.experts[e](x[i:i + 1])[0]
        y = seen["out"].reshape(-1, expected.shape[-1])
        assert torch.allclose(y, expected, rtol=0, atol=1e-5), name
        if name == "flux":
            handle2.remove()
            dense_out = net.single_transformer_blocks[1].proj_out
            attention = outs["in"][..., :dense_out.in_features - net.single_transformer_blocks[1].mlp_hidden_dim]
            hand = attention @ dense_out.weight[:, :attention.shape[-1]].T + dense_out.bias + outs["in"][..., -y.shape[-1]:]
            assert torch.allclose(outs["out"], hand, rtol=0, atol=1e-5)
            assert torch.equal(outs["in"][..., -y.shape[-1]:].reshape(y.shape), y)


@pytest.mark.parametrize("name", ["sd3", "flux"])
def test_active_flops_are_counted_equal_to_the_dense_transformers(name, networks):
    """At sampling time (no capacity) every token runs top_k experts: top-1 costs the dense FLOPs plus each router's
    2 D E per token; top-2 one dense FFN more per token; a timestep-routed call exactly the dense one's. Active
    parameters: the dense ones plus the routers (top-1)."""
    net, inputs = networks[name]
    dense = count_flops(lambda: _out(net, inputs))
    tokens, ffn = {}, {}
    top1 = token_moe_student(net, num_experts=4, top_k=1).eval()
    for layer in top1.moe_layers():
        layer.register_forward_pre_hook(lambda m, a: tokens.__setitem__(m, a[0].shape[:-1].numel()))
    moe1 = count_flops(lambda: _out(top1, inputs))
    routers = sum(2 * tokens[m] * m.router.in_features * m.num_experts for m in top1.moe_layers())
    assert moe1 - dense == routers > 0
    for m in top1.moe_layers():  # one dense FFN per token: its two matmuls
        linears = [p for p in m.experts[0].modules() if isinstance(p, torch.nn.Linear)]
        ffn[m] = sum(2 * tokens[m] * lin.in_features * lin.out_features for lin in linears)
    top2 = token_moe_student(net, num_experts=4, top_k=2).eval()
    assert count_flops(lambda: _out(top2, inputs)) - dense == routers + sum(ffn.values())
    n_dense = sum(p.numel() for p in net.parameters())
    assert top1.active_parameters() == n_dense + sum(m.router.weight.numel() for m in top1.moe_layers())
    experts = timestep_moe_student(net, num_experts=3).eval()
    assert count_flops(lambda: _out(experts, inputs)) == dense
    assert experts.active_parameters() == n_dense


def test_hand_over_timesteps_split_flow_time_or_its_log_snr():
    """equal_step: equal spans of 1000 t; equal_snr: equal spans of the flow's log-SNR 2 log((1 - t) / t) between
    t = 1/1000 and 1 - 1/1000, symmetric about t = 1/2."""
    T = 1000
    abar = flow_alphas_cumprod(T)
    assert expert_boundaries(4, "equal_step", abar, T) == [250, 500, 750]
    b = expert_boundaries(4, "equal_snr", abar, T)
    t = torch.arange(T, dtype=torch.float64).clamp(1, T - 1) / T
    logsnr = 2 * torch.log((1 - t) / t)
    assert torch.allclose(torch.log(abar / (1 - abar)), logsnr)
    span = float(logsnr[0] - logsnr[-1])
    for k, step in enumerate(b, start=1):  # the first timestep past k/4 of the span (to float rounding: t = 1/2)
        assert float(logsnr[0] - logsnr[step]) + 1e-9 >= k * span / 4 > float(logsnr[0] - logsnr[step - 1]) - 1e-9
    assert b[0] == 31 and abs(b[0] + b[2] - T) <= 1  # (1 - t) / t = 999^(1/2) at t = 0.0307


def test_exports_load_in_a_fresh_process_and_compute_the_same(pipes, networks, tmp_path):
    """Each pipeline saved with a token- and a timestep-routed student: model_index.json names the distill class,
    DiffusionPipeline.from_pretrained in a new process gives the weights bit for bit and the same outputs."""
    students, inputs = {}, {}
    for name, pipe in pipes.items():
        net, inputs[name] = networks[name]
        for kind, build in (("token", token_moe_student), ("timestep", timestep_moe_student)):
            student = build(net, num_experts=2).eval()
            if kind == "token":
                _randomise_routers(student, 3)
            folder = tmp_path / f"{name}_{kind}"
            pipe.register_modules(transformer=student)
            pipe.save_pretrained(folder)
            students[f"{name}_{kind}"] = student
        pipe.register_modules(transformer=net)
    index = json.loads((tmp_path / "sd3_token" / "model_index.json").read_text())
    assert index["transformer"] == ["distill.models.moe_transformer", "TokenMoESD3Transformer2DModel"]
    torch.save(inputs, tmp_path / "inputs.pt")
    script = f"""
import torch, distill.inference.pipelines
from diffusers import DiffusionPipeline
inputs, out = torch.load({str(tmp_path / 'inputs.pt')!r}), {{}}
for key in {sorted(students)!r}:
    absent = {{"text_encoder_3": None, "tokenizer_3": None}} if key.startswith("sd3") else {{}}  # the stand-in: no T5
    pipe = DiffusionPipeline.from_pretrained({str(tmp_path)!r} + "/" + key, **absent)
    out[key + "_class"] = type(pipe.transformer).__name__
    out[key + "_state"] = pipe.transformer.state_dict()
    with torch.no_grad():
        out[key] = pipe.transformer(**inputs[key.split("_")[0]]).sample
torch.save(out, {str(tmp_path / 'out.pt')!r})
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    classes = {"sd3_token": TokenMoESD3Transformer2DModel, "sd3_timestep": TimestepMoESD3Transformer2DModel,
               "flux_token": TokenMoEFluxTransformer2DModel, "flux_timestep": TimestepMoEFluxTransformer2DModel}
    for key, student in students.items():
        assert out[key + "_class"] == classes[key].__name__ and isinstance(student, classes[key])
        state = student.state_dict()
        assert state.keys() == out[key + "_state"].keys()
        assert all(torch.equal(state[k], out[key + "_state"][k]) for k in state)
        # bit-identical weights; safetensors maps some at addresses that are not 64-byte aligned, where CPU matmul
        # kernels sum in another order (tests/test_prune_transformer.py)
        assert torch.allclose(out[key], _out(student, inputs[key.split("_")[0]]), rtol=0, atol=1e-6), key


@pytest.mark.slow  # ~15 s; the loss and statistics it logs: test_one_expert_computes_the_dense_transformer
def test_two_cli_steps_of_consistency_flow_log_router_stats_and_export(tmp_path):
    """+exp=consistency_flow student=moe_token on the SD3 stand-in: the load-balancing loss joins the loss, router
    statistics per noise quarter are logged, and the export loads as the token-routed class."""
    from diffusers import DiffusionPipeline

    from tests.sd3_tiny import write_tiny_sd3
    from tests.test_consistency_flow import FLOW_FAST

    sd3_dir = write_tiny_sd3(tmp_path / "sd3")
    run_dir = tmp_path / "run"
    proc = run_train("+exp=consistency_flow", "student=moe_token", f"teacher.pretrained_model_name_or_path={sd3_dir}",
                     *FLOW_FAST, f"hydra.run.dir={run_dir}", env={"OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in csv.DictReader(open(run_dir / "csv" / "metrics.csv")) if r.get("train/loss")]
    assert len(rows) == 2 and all(float(r["train/aux_loss"]) > 0 for r in rows)
    loads = [float(rows[0][f"router/load/e{e}"]) for e in range(4)]
    assert abs(sum(loads) - 1) < 1e-5 and float(rows[0]["router/dropped_fraction"]) >= 0
    pipe = DiffusionPipeline.from_pretrained(run_dir / "export")
    assert isinstance(pipe.transformer, TokenMoESD3Transformer2DModel) and pipe.transformer.config.num_experts == 4


@pytest.mark.parametrize("student, overrides, words", [
    ("moe_token", ["student.top_k=5"], ["student.top_k=5", "between 1 and student.num_experts=4"]),
    ("moe_token", ["student.time_cond_proj_dim=256"],
     ["student.time_cond_proj_dim=256", "set student.time_cond_proj_dim=null"]),
    ("moe_timestep", ["student.shared_layers=[pos_embed]"],
     ["student.shared_layers=['pos_embed']", "set student.shared_layers=[]"]),
])
def test_bad_input_is_refused_at_validation_naming_value_and_fix(student, overrides, words, compose):
    from distill.config.validate import ConfigError, validate

    with pytest.raises(ConfigError) as err:
        validate(compose("+exp=consistency_flow", "teacher=digits_flow", f"student={student}", *overrides))
    assert all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.slow  # ~11 s; the check itself: test_bad_input_is_refused_at_validation_naming_value_and_fix
def test_a_guidance_input_on_a_transformer_exits_2_before_compute(tmp_path):
    proc = run_train("+exp=consistency", "teacher=digits_flow", "student=moe_token", f"hydra.run.dir={tmp_path / 'run'}",
                     timeout=300)
    assert proc.returncode == 2 and "student.time_cond_proj_dim=256" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run" / "export").exists()
