"""Low-rank factorisation: exact at full rank, Eckart-Young errors at rank r, rank rules, the diffusers export."""

import math
from fnmatch import fnmatch

import pytest
import torch
import torch.nn.functional as F
from diffusers import DiffusionPipeline, StableDiffusionPipeline, UNet2DConditionModel
from torch import nn

from distill.compress.lowrank import (
    UNET_KEEP_DENSE,
    LowRankConv2d,
    LowRankLinear,
    LowRankUNet2DConditionModel,
    choose_ranks,
    factorise,
    lowrank_unet,
    weight_matrix,
)
from distill.worlds.digits import asset_path

PROMPT = "a handwritten digit seven"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def teacher_unet():
    return UNet2DConditionModel.from_pretrained(asset_path("teacher") / "unet").eval()


@pytest.fixture(scope="module")
def unet_inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 4, 8, 8, generator=g), torch.tensor([10, 700]), torch.randn(2, 8, 64, generator=g))


def _linear_with_spectrum(singular_values: list[float], in_features: int, seed: int = 0) -> nn.Linear:
    """An nn.Linear(in_features, len(singular_values)) whose weight has exactly these singular values."""
    g = torch.Generator().manual_seed(seed)
    out = len(singular_values)
    u, _ = torch.linalg.qr(torch.randn(out, out, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(in_features, out, generator=g, dtype=torch.float64))
    layer = nn.Linear(in_features, out)
    with torch.no_grad():
        layer.weight.copy_(u @ torch.diag(torch.tensor(singular_values, dtype=torch.float64)) @ v.T)
    return layer


@pytest.mark.parametrize("dense", [
    nn.Linear(24, 40),
    nn.Conv2d(6, 10, 3, stride=2, padding=1),
    nn.Conv2d(5, 16, 3, stride=1, padding=2, dilation=2),
    nn.Conv2d(8, 12, 1, bias=False),
], ids=["linear", "conv3x3_stride2_pad1", "conv3x3_dilation2_pad2", "conv1x1_nobias"])
def test_full_rank_factorisation_reproduces_the_layer(dense):
    torch.manual_seed(0)
    full = min(weight_matrix(dense.weight).shape)
    low = (LowRankLinear if isinstance(dense, nn.Linear) else LowRankConv2d).from_dense(dense, full)
    x = torch.randn(3, 24) if isinstance(dense, nn.Linear) else torch.randn(3, dense.in_channels, 11, 9)
    with torch.no_grad():
        y, y_low = dense(x), low(x)
    assert y_low.shape == y.shape
    assert _rel(y_low, y) < 1e-5


@pytest.mark.parametrize("rank", [1, 4, 9])
def test_rank_r_weight_error_is_the_discarded_energy_and_bounds_the_output_error(rank):
    """Eckart-Young: ||W - W_r||_F^2 = sum_{i>r} s_i^2 and ||W - W_r||_2 = s_{r+1}; the output error of any input
    is at most s_{r+1} ||x||, and for x ~ N(0, I) its mean square is ||W - W_r||_F^2."""
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(32, 20), nn.Conv2d(4, 12, 3, stride=2, padding=1))
    report = choose_ranks(model, rank=rank, only_if_smaller=False)
    s = {name: torch.linalg.svdvals(weight_matrix(m.weight).double()) for name, m in model.named_modules()
         if name in report.ranks}
    dense = {name: m.weight.detach().clone() for name, m in model.named_modules() if name in report.ranks}
    x_lin = torch.randn(20000, 32, dtype=torch.float64)
    x_conv = torch.randn(8, 4, 10, 10)
    with torch.no_grad():
        y_lin, y_conv = model[0](x_lin.float()), model[1](x_conv)
        factorise(model, report.ranks)
        dy_lin, dy_conv = model[0](x_lin.float()) - y_lin, model[1](x_conv) - y_conv
    for layer in report.layers:
        low = model.get_submodule(layer.name)
        w_r = weight_matrix(low.up.weight).double() @ weight_matrix(low.down.weight).double()
        diff = weight_matrix(dense[layer.name]).double() - w_r
        predicted = math.sqrt(float(s[layer.name][rank:].square().sum() / s[layer.name].square().sum()))
        assert layer.predicted_error == pytest.approx(predicted, rel=1e-9)
        assert float(diff.norm() / weight_matrix(dense[layer.name]).double().norm()) == pytest.approx(predicted, rel=1e-4)
        assert float(torch.linalg.matrix_norm(diff, 2)) == pytest.approx(float(s[layer.name][rank]), rel=1e-4)
        # the singular values are split evenly: row i of down and column i of up both have norm sqrt(s_i)
        root = s[layer.name][:rank].sqrt()
        torch.testing.assert_close(weight_matrix(low.down.weight).double().norm(dim=1), root, rtol=1e-5, atol=0)
        torch.testing.assert_close(weight_matrix(low.up.weight).double().norm(dim=0), root, rtol=1e-5, atol=0)
    s_lin, s_conv = float(s["0"][rank]), float(s["1"][rank])
    # hard bound per input: ||dW x|| <= s_{r+1} ||x||; a convolution acts on its unfolded patches
    assert bool((dy_lin.double().norm(dim=1) <= s_lin * x_lin.norm(dim=1) * (1 + 1e-5)).all())
    patches = F.unfold(x_conv, 3, padding=1, stride=2)  # (N, in*k*k, L)
    assert float(dy_conv.norm()) <= s_conv * float(patches.norm()) * (1 + 1e-5)
    # Gaussian inputs: mean ||dW x||^2 = ||dW||_F^2, so the relative output error is the predicted weight error
    w0 = weight_matrix(dense["0"]).double()
    measured = float(dy_lin.double().norm() / (x_lin @ w0.T).norm())
    assert measured == pytest.approx(report.layers[0].predicted_error, rel=0.03)


def test_energy_threshold_picks_the_rank_of_the_formula():
    singular_values = [2.0 ** -i for i in range(12)]
    model = nn.Sequential(_linear_with_spectrum(singular_values, 40))
    energies = [v * v for v in singular_values]
    total = sum(energies)
    for energy in (0.5, 0.75, 0.76, 0.9, 0.95, 0.99, 0.999, 0.99999, 1.0):
        expected = next(r for r in range(1, 13) if sum(energies[:r]) >= energy * total - 1e-12)
        layer = choose_ranks(model, energy=energy, only_if_smaller=False).layers[0]
        assert layer.rank == expected, energy
        assert layer.retained_energy == pytest.approx(sum(energies[:expected]) / total, rel=1e-6)  # float32 weight
    # 0.75 of the energy needs rank 1 (s_1^2 = 0.7500...); a hair more needs rank 2
    assert choose_ranks(model, energy=0.7502, only_if_smaller=False).ranks == {"0": 2}


def test_rules_by_layer_kind_and_name_pattern_first_match_wins():
    singular_values = [2.0 ** -i for i in range(12)]  # energy 0.5 -> rank 1, 0.99 -> rank 4
    model = nn.Sequential(_linear_with_spectrum(singular_values, 40), _linear_with_spectrum(singular_values, 40, 1),
                          nn.Conv2d(12, 16, 3))
    report = choose_ranks(model, energy={"1": 0.99, "linear": 0.5}, only_if_smaller=False)
    assert report.ranks == {"0": 1, "1": 4}
    assert report.layers[2].rank is None and report.layers[2].note == "no energy rule matches"
    report = choose_ranks(model, rank=2, layer_kinds=("conv",))
    assert report.ranks == {"2": 2} and report.layers[0].note == "linear not in layer_kinds"


def test_a_layer_stays_dense_where_the_factors_would_not_be_smaller():
    # Linear(40, 12): r * (40 + 12) < 480 holds up to r = 9
    model = nn.Sequential(_linear_with_spectrum([1.0] * 12, 40))
    assert choose_ranks(model, rank=9).ranks == {"0": 9}
    layer = choose_ranks(model, rank=10).layers[0]
    assert layer.rank is None and layer.params == 12 * 40 + 12 and "saves no parameters" in layer.note
    assert choose_ranks(model, rank=10, only_if_smaller=False).ranks == {"0": 10}


def _weights_after(layer) -> int:
    out, inner = layer.shape
    return layer.rank * (out + inner) if layer.rank is not None else out * inner


@pytest.mark.parametrize("budget", [0.25, 0.5, 0.8])
def test_parameter_budget_is_met_within_one_layer_step(teacher_unet, budget):
    report = choose_ranks(teacher_unet, budget=budget, keep_dense=UNET_KEEP_DENSE)
    pool = [lr for lr in report.layers
            if not lr.note.startswith("keep_dense") and sum(lr.shape) < lr.shape[0] * lr.shape[1]]
    total = sum(lr.shape[0] * lr.shape[1] for lr in pool)
    used = sum(_weights_after(lr) for lr in pool)
    assert report.budget_params == int(budget * total)
    assert used <= report.budget_params
    assert report.budget_params - used < max(sum(lr.shape) for lr in pool)  # one rank of the widest layer
    assert 0 < len(report.ranks) < len(pool)


def test_keep_dense_layers_are_left_alone(teacher_unet):
    low, report = lowrank_unet(teacher_unet, energy=0.5)
    for name in ("conv_in", "conv_out", "time_embedding.linear_1", "time_embedding.linear_2"):
        assert type(low.get_submodule(name)) is type(teacher_unet.get_submodule(name))
        assert name not in report.ranks
    _, report = lowrank_unet(teacher_unet, energy=0.5, keep_dense=("*.attn2.*", "*resnets*"))
    assert not any(".attn2." in name or "resnets" in name for name in report.ranks)
    assert any(".attn1." in name for name in report.ranks)


def test_digits_teacher_at_full_energy_gives_the_same_output(teacher_unet, unet_inputs):
    low, report = lowrank_unet(teacher_unet, energy=1.0, only_if_smaller=False)
    assert len(report.ranks) == 128 and all(lr.predicted_error < 1e-6 for lr in report.layers)
    with torch.no_grad():
        assert _rel(low(*unet_inputs).sample, teacher_unet(*unet_inputs).sample) < 1e-5


def test_digits_teacher_parameter_count_and_error_at_energy_0_9(teacher_unet, unet_inputs):
    low, report = lowrank_unet(teacher_unet, energy=0.9)
    assert sum(p.numel() for p in teacher_unet.parameters()) == report.model_params == 1_489_028
    assert sum(p.numel() for p in low.parameters()) == report.model_params_after == 1_338_596
    assert len(report.ranks) == 63
    with torch.no_grad():
        error = _rel(low(*unet_inputs).sample, teacher_unet(*unet_inputs).sample)
    # each factorised layer loses at most sqrt(0.1) of its weight; the whole network stays below that
    assert 0.01 < error < math.sqrt(0.1)
    # at energy 0.99 the small trained teacher's layers are too close to full rank to save anything
    assert lowrank_unet(teacher_unet, energy=0.99)[1].ranks == {}


def test_save_pretrained_round_trip_is_exact(teacher_unet, unet_inputs, tmp_path):
    low, report = lowrank_unet(teacher_unet, energy=0.9)
    low.save_pretrained(tmp_path)
    back = LowRankUNet2DConditionModel.from_pretrained(tmp_path)
    assert back.config.lowrank_ranks == report.ranks
    assert isinstance(back.get_submodule(next(iter(report.ranks))), (LowRankLinear, LowRankConv2d))
    state, state_back = low.state_dict(), back.state_dict()
    assert state.keys() == state_back.keys()
    assert all(torch.equal(state[k], state_back[k]) for k in state)
    with torch.no_grad():
        assert torch.equal(back(*unet_inputs).sample, low(*unet_inputs).sample)


def test_a_pruned_unet_factorised_saves_and_loads_as_the_same_network(teacher_unet, unet_inputs, tmp_path):
    """Pruning then low rank compose: the factorised export keeps the pruned layers' shapes (it dropped them, so
    the factors did not fit the unpruned layout that from_config rebuilt), and saves and loads as itself."""
    from distill.compress.prune import prune_unet, unet_example_inputs
    from distill.students.pretrained import pretrained_student

    pruned, _ = prune_unet(teacher_unet, 0.5, target="params", example_inputs=unet_example_inputs(teacher_unet))
    with torch.no_grad():
        reference = pruned(*unet_inputs).sample
    ranks = {name: min(weight_matrix(m.weight).shape) for name, m in pruned.named_modules()
             if isinstance(m, (nn.Linear, nn.Conv2d)) and not any(fnmatch(name, k) for k in UNET_KEEP_DENSE)}
    exact = LowRankUNet2DConditionModel.from_unet(pruned, ranks)  # full rank: the pruned network itself
    with torch.no_grad():
        assert _rel(exact(*unet_inputs).sample, reference) < 1e-5
    low, report = lowrank_unet(pruned, energy=0.9)
    assert low.config.layer_shapes == pruned.config.layer_shapes and len(low.config.layer_shapes) > 100
    shape = pruned.config.layer_shapes["down_blocks.0.resnets.0.conv1"]
    factor = low.get_submodule("down_blocks.0.resnets.0.conv1")
    assert isinstance(factor, LowRankConv2d) and (factor.in_channels, factor.out_channels) == (
        shape["in_channels"], shape["out_channels"]) != (32, 32)
    low.save_pretrained(tmp_path)
    with torch.no_grad():
        out = low(*unet_inputs).sample
        for back in (LowRankUNet2DConditionModel.from_pretrained(tmp_path), pretrained_student(teacher_unet, str(tmp_path))):
            assert back.config.lowrank_ranks == report.ranks and back.config.layer_shapes == low.config.layer_shapes
            assert torch.equal(back.eval()(*unet_inputs).sample, out)


def assert_unet_export_samples(pipe: StableDiffusionPipeline, unet: UNet2DConditionModel, folder) -> None:
    """``pipe`` saved with ``unet`` loads with ``DiffusionPipeline.from_pretrained``, with ``unet``'s class, samples
    what the in-memory pipeline samples, and runs diffusers' default call."""
    pipe.register_modules(unet=unet)
    pipe.save_pretrained(folder)
    loaded = DiffusionPipeline.from_pretrained(folder)
    assert type(loaded.unet) is type(unet)
    for p in (pipe, loaded):
        p.set_progress_bar_config(disable=True)
    images = [p(PROMPT, num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="pt").images
              for p in (pipe, loaded)]
    assert torch.equal(images[0], images[1])
    assert loaded(PROMPT).images[0].size == (32, 32)


def test_pipeline_export_loads_with_diffusers_and_samples(tmp_path):
    pipe = StableDiffusionPipeline.from_pretrained(asset_path("teacher"))
    low, _ = lowrank_unet(pipe.unet, energy=0.9)
    assert type(low) is LowRankUNet2DConditionModel
    assert_unet_export_samples(pipe, low, tmp_path)


@pytest.mark.parametrize("kwargs, words", [
    ({"rank": 0}, ["rank=0", "positive integer"]),
    ({"rank": -2}, ["rank=-2"]),
    ({"rank": 2.5}, ["rank=2.5"]),
    ({"rank": 64}, ["rank=64", "full rank 32 of 0 (linear", "lower it"]),
    ({"rank": {"conv": 3, "linear": 0}}, ["rank['linear']=0"]),
    ({"energy": 0.0}, ["energy=0.0", "(0, 1]"]),
    ({"energy": 1.5}, ["energy=1.5", "(0, 1]"]),
    ({"energy": {"conv": 1.01}}, ["energy['conv']=1.01"]),
    ({"energy": {"nope.*": 0.9}}, ["'nope.*'", "match no factorisable layer"]),
    ({"budget": 0}, ["budget=0", "(0, 1]"]),
    ({"budget": 1.2}, ["budget=1.2"]),
    ({"budget": 0.01}, ["budget=0.01", "below rank 1", "raise budget"]),
    ({"energy": 0.9, "budget": 0.5}, ["exactly one of rank, energy, budget"]),
    ({}, ["exactly one of rank, energy, budget"]),
])
def test_bad_ranks_energies_and_budgets_raise_naming_the_key(kwargs, words):
    model = nn.Sequential(nn.Linear(32, 48), nn.Conv2d(48, 8, 3))
    with pytest.raises(ValueError) as err:
        choose_ranks(model, **kwargs)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_factorise_rejects_a_rank_above_the_full_rank():
    model = nn.Sequential(nn.Linear(32, 16))
    with pytest.raises(ValueError, match=r"ranks\['0'\]=17 exceeds the full rank 16"):
        factorise(model, {"0": 17})
    with pytest.raises(ValueError, match=r"ranks\['1'\]: no such module"):
        factorise(model, {"1": 2})
