"""FID, cost meter and quality-cost helpers against independent computations."""

import numpy as np
import pytest
import scipy.linalg
import torch
from torch import nn

from distill.metrics.cost import NFECounter, measure_cost
from distill.metrics.fid import FID, FeatureNet, frechet_distance, gaussian_statistics
from distill.metrics.registry import proportion_standard_error, standard_error
from distill.metrics.report import (
    differ_beyond_uncertainty,
    format_table,
    format_uncertain,
    pareto_front,
    write_csv,
)
from distill.utils.flops import count_flops
from distill.worlds.digits.data import DigitsDataModule


class RandomFeatures(nn.Module):
    """A fixed random conv net with ``features`` and ``feature_dim`` (``PenultimateFeatures``), standing in for
    the digit classifier."""

    feature_dim = 12

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Sequential(nn.Conv2d(1, 8, 3, stride=2), nn.ReLU(), nn.Conv2d(8, 16, 3, stride=2), nn.ReLU())
        self.fc = nn.Linear(16 * 7 * 7, 12)

    def features(self, x):
        return self.fc(self.conv(x).flatten(1))


@pytest.fixture(scope="module")
def digits():
    dm = DigitsDataModule(resolution=32)
    dm.setup()
    return dm.train_set.images[:600], dm.heldout_set.images


def frechet_numpy(a: np.ndarray, b: np.ndarray) -> float:
    """||mu_a - mu_b||^2 + Tr(S_a + S_b - 2 (S_a S_b)^(1/2)), Heusel et al. 2017 eq. 6."""
    mu_a, mu_b = a.mean(0), b.mean(0)
    s_a, s_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    covmean = scipy.linalg.sqrtm(s_a @ s_b).real
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(s_a + s_b - 2 * covmean))


def test_fid_equals_independent_frechet_distance(digits, tmp_path):
    train, heldout = digits
    fid = FID(FeatureNet(RandomFeatures(), "random"), cache_dir=tmp_path)
    fid.set_reference(heldout, "heldout")
    value = fid(train)
    expected = frechet_numpy(fid.features(train).numpy(), fid.features(heldout).numpy())
    assert value == pytest.approx(expected, rel=1e-4)


def test_frechet_distance_of_gaussians_with_known_distance():
    # Diagonal covariances: ||mu1 - mu2||^2 + sum (sqrt(a) - sqrt(b))^2 (Heusel et al. 2017 eq. 6).
    a, b = torch.tensor([1.0, 4.0, 9.0], dtype=torch.float64), torch.tensor([4.0, 1.0, 9.0], dtype=torch.float64)
    mu1, mu2 = torch.zeros(3, dtype=torch.float64), torch.tensor([1.0, 2.0, 0.0], dtype=torch.float64)
    assert frechet_distance(mu1, torch.diag(a), mu2, torch.diag(b)) == pytest.approx(5.0 + 1.0 + 1.0 + 0.0, abs=1e-12)
    # A rotated pair: the distance does not depend on the basis.
    q, _ = torch.linalg.qr(torch.randn(3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
    assert frechet_distance(q @ mu1, q @ torch.diag(a) @ q.T, q @ mu2, q @ torch.diag(b) @ q.T) == pytest.approx(7.0, abs=1e-9)
    x = torch.tensor([[0.0, 1.0], [2.0, 3.0], [4.0, 8.0]])
    mu, sigma = gaussian_statistics(x)
    assert torch.allclose(mu, torch.tensor([2.0, 4.0], dtype=torch.float64))
    assert torch.allclose(sigma, torch.from_numpy(np.cov(x.numpy(), rowvar=False)))


def test_fid_equals_torchmetrics_on_the_full_set(digits, tmp_path):
    train, heldout = digits
    fid = FID(FeatureNet(RandomFeatures(), "random"), cache_dir=tmp_path)
    fid.set_reference(heldout, "heldout")
    fid.metric.reset()
    fid.metric.update(train, real=False)
    torchmetrics_value = float(fid.metric.compute())  # rounded to the features' float32
    assert fid(train) == pytest.approx(torchmetrics_value, rel=1e-6)
    assert fid(train) == pytest.approx(fid.from_features(fid.features(train)), rel=1e-12)


def identity_fid(mu: torch.Tensor, sigma: torch.Tensor) -> FID:
    """FID on raw (N, D) features against exact reference statistics N(mu, sigma)."""
    dim = len(mu)
    fid = FID(FeatureNet(nn.Flatten(), "identity", input_shape=(dim, 1, 1)), cache_dir=None)
    fid.set_reference(torch.zeros(2, dim, 1, 1))
    n = 10**9
    fid.metric.real_features_num_samples.fill_(n)
    fid.metric.real_features_sum.copy_(mu.double() * n)
    fid.metric.real_features_cov_sum.copy_((sigma.double() + torch.outer(mu, mu).double()) * n)
    return fid


def test_fid_bootstrap_spread_matches_independent_sets():
    """The bootstrap std of one set's FID estimates the spread of FID over independent sets."""
    g = torch.Generator().manual_seed(0)
    dim, n = 4, 200
    scale = torch.tensor([1.0, 0.5, 2.0, 1.0])
    fid = identity_fid(torch.full((dim,), 0.3), torch.eye(dim))
    sets = [torch.randn(n, dim, generator=g) * scale for _ in range(300)]
    independent = torch.tensor([fid.from_features(x) for x in sets]).std().item()
    bootstrap = [fid.bootstrap_std(x, num_resamples=200, seed=1) for x in sets[:20]]
    assert fid.bootstrap_std(sets[0], 50, seed=3) == fid.bootstrap_std(sets[0], 50, seed=3)  # seeded
    assert 0.7 * independent < float(np.median(bootstrap)) < 1.3 * independent


def test_fid_stratified_bootstrap_matches_independent_stratified_draws():
    """Class clusters drawn a fixed number per class (the evaluator's protocol): the bootstrap resampled
    within classes estimates the spread of FID over independent draws; resampling the pool, which also
    varies the class mix, overstates it several times."""
    g = torch.Generator().manual_seed(0)
    classes, per_class, dim = 10, 20, 8
    centres = 4.0 * torch.randn(classes, dim, generator=g)
    mu, sigma = gaussian_statistics(centres)  # the mixture with equal weights and unit within-class covariance
    # A reference the draws miss (shifted mean, wider spread), as a model misses the data.
    fid = identity_fid(mu + 0.5, 1.5 * (sigma * (classes - 1) / classes + torch.eye(dim, dtype=torch.float64)))
    labels = torch.arange(classes).repeat(per_class)

    def draw() -> torch.Tensor:
        return centres[labels] + torch.randn(len(labels), dim, generator=g)

    independent = torch.tensor([fid.from_features(draw()) for _ in range(300)]).std().item()
    sets = [draw() for _ in range(10)]
    stratified = float(np.median([fid.bootstrap_std(x, 100, seed=1, strata=labels) for x in sets]))
    pooled = float(np.median([fid.bootstrap_std(x, 100, seed=1) for x in sets]))
    assert 0.6 * independent < stratified < 1.6 * independent
    assert pooled > 3 * independent
    with pytest.raises(ValueError, match="strata"):
        fid.bootstrap_std(sets[0], 10, strata=labels[:5])


def test_torchscript_feature_file(digits, tmp_path):
    """A scripted net without a ``features`` method, loaded from a file by FID(feature=<path>)."""
    torch.manual_seed(0)
    net = torch.jit.script(nn.Sequential(nn.Conv2d(1, 6, 3, stride=2), nn.Tanh(), nn.Conv2d(6, 8, 3, stride=2), nn.Tanh(),
                                         nn.AdaptiveAvgPool2d(2), nn.Flatten()))
    path = tmp_path / "features.pt"
    torch.jit.save(net, str(path))
    train, heldout = digits
    fid = FID(str(path), cache_dir=tmp_path)
    assert fid.metric.inception.num_features == 32
    fid.set_reference(heldout, "heldout")
    assert abs(fid(heldout)) < 1e-6
    shifted = (train + 0.3).clamp(-1, 1)
    with torch.no_grad():
        expected = frechet_numpy(net(shifted).double().numpy(), net(heldout).double().numpy())
    assert fid(shifted) == pytest.approx(expected, rel=1e-5) and expected > 0.05


class ConvTrunkNet(nn.Module):
    """A VGG/DenseNet-like net: ``features`` is a conv trunk (4-D output), forward gives (N, D)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3, stride=2), nn.ReLU())
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())

    def forward(self, x):
        return self.pool(self.features(x))


def test_feature_net_uses_forward_of_nets_with_a_features_trunk_and_rejects_non_2d_output(digits):
    """Only a classifier exposing ``features`` and ``feature_dim`` is measured through ``features``; a scripted
    net whose ``features`` is a conv trunk goes through its forward; a net returning 4-D fails up front."""
    net = torch.jit.script(ConvTrunkNet())
    feature_net = FeatureNet(net, "trunk")
    images = digits[1][:3]
    assert feature_net.num_features == 4
    assert torch.equal(feature_net(images), net(images))
    with pytest.raises(ValueError, match=r"'trunk-only'.*\(1, 4, 15, 15\)"):
        FeatureNet(torch.jit.script(ConvTrunkNet().features), "trunk-only")


def test_fid_of_a_set_with_itself_is_zero_and_noise_increases_it(digits, tmp_path):
    train, heldout = digits
    fid = FID(FeatureNet(RandomFeatures(), "random"), cache_dir=tmp_path)
    fid.set_reference(heldout, "heldout")
    assert abs(fid(heldout)) < 1e-3
    clean = fid(train)
    g = torch.Generator().manual_seed(0)
    noisy = fid((train + 0.5 * torch.randn(train.shape, generator=g)).clamp(-1, 1))
    assert noisy > clean > 0


def test_reference_statistics_are_cached(digits, tmp_path):
    train, heldout = digits
    first = FID(FeatureNet(RandomFeatures(), "random"), cache_dir=tmp_path)
    first.set_reference(heldout, "heldout")
    assert len(list(tmp_path.glob("*-heldout.pt"))) == 1
    second = FID(FeatureNet(RandomFeatures(), "random"), cache_dir=tmp_path)
    second.set_reference(None, "heldout")  # no images needed: read from the cache
    assert second(train) == pytest.approx(first(train), rel=1e-9)
    other = RandomFeatures()
    with torch.no_grad():
        other.fc.weight.mul_(2)
    third = FID(FeatureNet(other, "random"), cache_dir=tmp_path)  # other weights: another cache entry
    with pytest.raises(ValueError, match="no cached reference"):
        third.set_reference(None, "heldout")


def test_nfe_counter_counts_every_evaluation():
    net = nn.Linear(4, 4)
    with NFECounter(net) as counter:
        for _ in range(5):
            net(torch.zeros(3, 4))
        net(torch.zeros(6, 4))  # a CFG step: conditional + unconditional in one batch
    assert counter.calls == 6 and counter.examples == 21
    net(torch.zeros(1, 4))
    assert counter.calls == 6  # removed on exit


def test_cost_meter_nfe_and_flops():
    net = nn.Linear(64, 64, bias=False)
    steps, batch = 7, 5

    def generate():
        x = torch.zeros(batch, 64)
        for _ in range(steps):
            x = net(x)
        return x

    with NFECounter(net) as counter:
        cost = measure_cost(generate, counter, batch, params=64 * 64, repeats=2)
    assert cost.nfe == steps
    assert cost.gflops_per_image * 1e9 == pytest.approx(2 * 64 * 64 * steps)  # 2 FLOPs per multiply-add
    assert count_flops(generate) == 2 * 64 * 64 * steps * batch
    assert cost.latency_s > 0 and cost.images_per_s == pytest.approx(1 / cost.latency_s)
    assert cost.params_m == cost.active_params_m == pytest.approx(4096 / 1e6)


def test_pareto_front_and_outputs(tmp_path):
    rows = [
        {"model": "t", "scheduler": "ddim", "steps": 50, "fid": 1.0, "latency_s": 0.5},
        {"model": "t", "scheduler": "ddim", "steps": 4, "fid": 9.0, "latency_s": 0.05},
        {"model": "s", "scheduler": "lcm", "steps": 4, "fid": 2.0, "latency_s": 0.05},
        {"model": "t", "scheduler": "euler", "steps": 50, "fid": 1.5, "latency_s": 0.6},
    ]
    assert [(r["model"], r["steps"]) for r in pareto_front(rows)] == [("s", 4), ("t", 50)]
    write_csv(rows[:2], tmp_path / "qc.csv")
    write_csv(rows[2:], tmp_path / "qc.csv", append=True)
    lines = (tmp_path / "qc.csv").read_text().splitlines()
    assert len(lines) == 5 and lines[0].startswith("model,scheduler,accelerate,steps")
    table = format_table(rows, floor={"fid": 0.5, "fid_std": 0.05})
    assert "| s | lcm | 4 |" in table and "floor: FID(train, held-out) = 0.500 ± 0.050" in table


def test_uncertainties_in_tables_and_comparisons(tmp_path):
    assert format_uncertain(3.2137, 0.152) == "3.21 ± 0.15"
    assert format_uncertain(0.98213, 0.0123) == "0.982 ± 0.012"
    assert format_uncertain(45.27, 1.5) == "45.3 ± 1.5"
    assert format_uncertain(123.4, 15.0) == "123 ± 15"
    a = {"fid": 3.0, "fid_std": 0.3}
    assert not differ_beyond_uncertainty(a, {"fid": 3.4, "fid_std": 0.4})  # 0.4 < 0.5 = hypot(0.3, 0.4)
    assert differ_beyond_uncertainty(a, {"fid": 3.6, "fid_std": 0.4})
    assert not differ_beyond_uncertainty(a, {"fid": 3.6, "fid_std": 0.4}, sigmas=2.0)
    assert standard_error(torch.tensor([1.0, 2.0, 3.0, 4.0])) == pytest.approx(np.std([1, 2, 3, 4], ddof=1) / 2)
    assert proportion_standard_error(0.9, 100) == pytest.approx(0.03)
    rows = [{"model": "s", "scheduler": "lcm", "steps": 1, "fid": 3.2137, "fid_std": 0.152, "latency_s": 0.01},
            {"model": "s", "scheduler": "lcm", "steps": 2, "fid": 2.5, "fid_std": 0.1, "latency_s": 0.02}]
    table = format_table(rows)
    assert table.splitlines()[0] == "| model | scheduler | steps | fid | latency_s |"
    assert "| s | lcm | 1 | 3.21 ± 0.15 | 0.01 |" in table
    write_csv(rows, tmp_path / "qc.csv")
    header = (tmp_path / "qc.csv").read_text().splitlines()[0].split(",")
    assert header[header.index("fid") + 1] == "fid_std" and "clip_score_std" in header and "prompt_accuracy_std" in header
    # Appending to an older run's CSV (no uncertainty columns) keeps its header and column order.
    (tmp_path / "old.csv").write_text("model,scheduler,steps,fid,latency_s\n")
    write_csv(rows, tmp_path / "old.csv", append=True)
    assert (tmp_path / "old.csv").read_text().splitlines()[1:] == ["s,lcm,1,3.2137,0.01", "s,lcm,2,2.5,0.02"]


def _attention_flops(batch: int, heads: int, lq: int, lk: int, head_dim: int) -> int:
    """QK^T and AV written out: two matmuls of batch x heads (lq x head_dim) @ (head_dim x lk)-sized work."""
    return 2 * batch * heads * lq * lk * head_dim * 2


def test_flops_count_cpu_attention_like_torch_counts_the_math_kernel():
    """CPU attention runs torch's fused kernel, which torch's counter has no rule for (it counted 0): the count
    now equals a hand count, torch's own sdpa formula, and torch's count of the unfused math kernel."""
    from diffusers.models.attention_processor import Attention
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    torch.manual_seed(0)
    b, lq, lk, dim, context_dim, heads, head_dim = 2, 16, 7, 32, 24, 4, 8
    attn = Attention(dim, cross_attention_dim=context_dim, heads=heads, dim_head=head_dim)
    x, context = torch.randn(b, lq, dim), torch.randn(b, lk, context_dim)
    projections = 2 * b * (lq * dim * dim * 2 + lk * context_dim * dim * 2)  # to_q, to_out; to_k, to_v
    with torch.no_grad():
        flops = count_flops(lambda: attn(x, encoder_hidden_states=context))
        with sdpa_kernel(SDPBackend.MATH):  # matmuls that torch's counter sees
            math = count_flops(lambda: attn(x, encoder_hidden_states=context))
    assert flops - projections == _attention_flops(b, heads, lq, lk, head_dim) == 2 * 2 * 4 * 16 * 7 * 8 * 2
    assert flops == math
    q, k, v = (torch.randn(b, heads, n, head_dim, requires_grad=True) for n in (lq, lk, lk))
    assert count_flops(lambda: nn.functional.scaled_dot_product_attention(q, k, v)) == sdpa_flop_count(
        q.shape, k.shape, v.shape)
    total = count_flops(lambda: nn.functional.scaled_dot_product_attention(q, k, v).sum().backward())
    backward = sdpa_backward_flop_count(q.shape, q.shape, k.shape, v.shape)  # grad_out has the query's shape
    assert total == sdpa_flop_count(q.shape, k.shape, v.shape) + backward == 7 * b * heads * lq * lk * head_dim * 2


def test_flops_of_a_unet_transformer_block_against_a_hand_count():
    """One BasicTransformerBlock (self-attention, cross-attention, GEGLU feed-forward), every matmul written out."""
    from diffusers.models.attention import BasicTransformerBlock

    torch.manual_seed(0)
    b, tokens, text, dim, context_dim, heads, head_dim = 2, 16, 7, 32, 24, 4, 8
    block = BasicTransformerBlock(dim, heads, head_dim, cross_attention_dim=context_dim)
    x, context = torch.randn(b, tokens, dim), torch.randn(b, text, context_dim)
    with torch.no_grad():
        flops = count_flops(lambda: block(x, encoder_hidden_states=context))
    self_attention = 2 * b * tokens * dim * dim * 4 + _attention_flops(b, heads, tokens, tokens, head_dim)
    cross_attention = (2 * b * (tokens * dim * dim * 2 + text * context_dim * dim * 2)
                       + _attention_flops(b, heads, tokens, text, head_dim))
    feed_forward = 2 * b * tokens * (dim * 2 * 4 * dim + 4 * dim * dim)  # GEGLU: dim -> 2 x 4 dim, 4 dim -> dim
    assert flops == self_attention + cross_attention + feed_forward == 1_316_864
