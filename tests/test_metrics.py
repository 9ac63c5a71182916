"""FID, cost meter and quality-cost helpers against independent computations."""

import numpy as np
import pytest
import scipy.linalg
import torch
from torch import nn

from distill.data import DigitsDataModule
from distill.metrics.cost import NFECounter, count_flops, measure_cost
from distill.metrics.fid import FID, FeatureNet
from distill.metrics.quality_cost import format_table, pareto_front, write_csv


class RandomFeatures(nn.Module):
    """A fixed random conv net with a ``features`` method, standing in for the digit classifier."""

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
    assert len(lines) == 5 and lines[0].startswith("model,scheduler,steps")
    table = format_table(rows, floor=0.5)
    assert "| s | lcm | 4 |" in table and "floor" in table
