"""The uncertainty of a difference between two rows of one protocol: the paired bootstrap (Efron & Tibshirani
1993, sec. 8.2-8.3) against a by-hand paired resampling, its limits (independent sets: the combined std;
identical sets shifted by a constant: zero), the CSV round trip, and the sampling cost of small evaluations."""

import math

import pytest
import torch
from torch import nn

from distill.metrics.bootstrap import difference_std, protocol_key, resample_indices
from distill.metrics.fid import frechet_distance, gaussian_statistics
from distill.metrics.kid import kernel_inception_distance, kid_subset_values
from distill.metrics.quality_cost import QualityCostEvaluator
from distill.metrics.registry import Estimate, Samples, mean_estimate
from distill.metrics.report import (
    differ_beyond_uncertainty,
    format_difference,
    format_table,
    write_csv,
)
from distill.report import read_rows
from tests.test_metrics import identity_fid

DIM, N, R = 4, 240, 200


def paired_sets(noise: float, seed: int = 0):
    """Features of one set and of a second one sharing its prompts and seeds (a + small per-sample change)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(N, DIM, generator=g, dtype=torch.float64) * torch.tensor([1.0, 0.5, 2.0, 1.0], dtype=torch.float64)
    return a, a * 1.08 + noise * torch.randn(N, DIM, generator=g, dtype=torch.float64)


def fid_row(fid, features, strata, seed=1) -> dict:
    values = fid.bootstrap_values(features, R, seed, strata)
    return {"fid": fid.from_features(features), "fid_std": float(values.std()), "fid_replicates": values.tolist(),
            "replicate_key": protocol_key(strata, seed)}


def test_fid_difference_is_the_paired_bootstrap_by_hand():
    """The replicates' difference equals resampling the pairs together by hand, and it is far tighter than the
    combined std when the sets share prompts and seeds."""
    fid = identity_fid(torch.full((DIM,), 0.3), torch.eye(DIM))
    a, b = paired_sets(noise=0.05)
    strata = torch.arange(N) % 10  # ten prompts, 24 samples each, interleaved as the evaluator draws them
    row_a, row_b = fid_row(fid, a, strata), fid_row(fid, b, strata)
    reference = fid.reference_statistics()
    generator = torch.Generator().manual_seed(1)
    by_hand = []
    for _ in range(R):
        i = resample_indices(strata, generator)
        by_hand.append(frechet_distance(*reference, *gaussian_statistics(a[i]))
                       - frechet_distance(*reference, *gaussian_statistics(b[i])))
    by_hand = torch.tensor(by_hand, dtype=torch.float64).std().item()
    assert difference_std(row_a["fid_replicates"], row_b["fid_replicates"]) == pytest.approx(by_hand, rel=1e-9)
    combined = math.hypot(row_a["fid_std"], row_b["fid_std"])
    assert by_hand < 0.3 * combined  # what the rows share cancels
    # a difference the combined std calls noise is measured by the paired one
    delta = abs(row_a["fid"] - row_b["fid"])
    assert by_hand < delta < combined
    assert differ_beyond_uncertainty(row_a, row_b)
    assert not differ_beyond_uncertainty({k: v for k, v in row_a.items() if k != "fid_replicates"}, row_b)


def test_independent_sets_give_the_combined_std():
    fid = identity_fid(torch.full((DIM,), 0.3), torch.eye(DIM))
    strata = torch.arange(N) % 10
    paired = []
    for seed in range(12):
        a, _ = paired_sets(0.0, seed=2 * seed)
        b, _ = paired_sets(0.0, seed=2 * seed + 1)
        ra, rb = fid_row(fid, a, strata), fid_row(fid, b, strata)
        paired.append(difference_std(ra["fid_replicates"], rb["fid_replicates"])
                      / math.hypot(ra["fid_std"], rb["fid_std"]))
    assert sum(paired) / len(paired) == pytest.approx(1.0, abs=0.1)


def test_rows_of_another_sample_count_are_not_paired():
    """With one seed, N and 2N samples draw related indices (randint(N) = randint(2N) mod N), neither shared nor
    independent: such rows get the combined sd, as rows without replicates do."""
    fid = identity_fid(torch.full((DIM,), 0.3), torch.eye(DIM))
    a, b = paired_sets(noise=0.05)
    small = fid_row(fid, a[: N // 2], torch.arange(N // 2) % 10)
    large = fid_row(fid, b, torch.arange(N) % 10)
    assert small["replicate_key"] != large["replicate_key"]
    from distill.metrics.report import difference_std as row_difference_std

    assert row_difference_std(small, large) == math.hypot(small["fid_std"], large["fid_std"])
    same = fid_row(fid, b[: N // 2], torch.arange(N // 2) % 10)
    assert row_difference_std(small, same) == difference_std(small["fid_replicates"], same["fid_replicates"])


def test_mean_metrics_pair_up_to_the_standard_error_of_the_differences():
    """CLIP score and prompt accuracy are means: their paired bootstrap estimates std(a - b) / sqrt(N)."""
    g = torch.Generator().manual_seed(0)
    a = torch.rand(N, generator=g, dtype=torch.float64)
    b = a + 0.01 + 0.02 * torch.randn(N, generator=g, dtype=torch.float64)
    samples = Samples(torch.zeros(N, 1, 2, 2), [""] * N, None, torch.arange(N) % 10)
    ea, eb = (mean_estimate(s, samples, 2000, 3, std=0.0) for s in (a, b))
    assert ea.value == pytest.approx(a.mean().item())
    analytic = (a - b).std().item() / math.sqrt(N)
    assert difference_std(ea.replicates, eb.replicates) == pytest.approx(analytic, rel=0.1)


def test_kid_subsets_pair_up():
    """Two sets of the same sizes get the same subsets: the subset estimates of a set against itself shifted by
    nothing differ by zero, and kernel_inception_distance is the mean and spread of the subset values."""
    g = torch.Generator().manual_seed(0)
    real, fake = torch.randn(60, DIM, generator=g), torch.randn(40, DIM, generator=g) + 0.2
    values = kid_subset_values(real, fake, 30, 10, seed=5)
    assert kernel_inception_distance(real, fake, 30, 10, seed=5) == pytest.approx(
        (values.mean().item(), values.std(unbiased=False).item()))
    assert difference_std(values, kid_subset_values(real, fake.clone(), 30, 10, seed=5)) == 0.0
    with pytest.raises(ValueError, match="same length"):
        difference_std(values, values[:10])


def test_replicates_round_trip_through_the_csv(tmp_path):
    fid = identity_fid(torch.full((DIM,), 0.3), torch.eye(DIM))
    a, b = paired_sets(noise=0.05)
    strata = torch.arange(N) % 10
    rows = [dict(model=m, scheduler="ddim", steps=4, **fid_row(fid, x, strata)) for m, x in (("a", a), ("b", b))]
    write_csv(rows, tmp_path / "qc.csv")
    back = read_rows(tmp_path / "qc.csv")
    assert difference_std(back[0]["fid_replicates"], back[1]["fid_replicates"]) == pytest.approx(
        difference_std(rows[0]["fid_replicates"], rows[1]["fid_replicates"]), rel=1e-6)
    assert "replicates" not in format_table(back)  # the table shows values and stds only
    assert format_difference(back[1], back[0]).startswith("+")


def test_std_zero_up_to_rounding_prints_as_zero():
    from distill.metrics.report import format_uncertain

    assert format_uncertain(3.1234567891234567, 4e-16) == "3.123 ± 0"
    assert format_uncertain(3.1234567891234567, 0.0) == "3.123 ± 0"
    assert format_uncertain(1.5e-3, 2.1e-4) == "0.00150 ± 0.00021"  # a small KID keeps its digits


class _StepUNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x * self.weight


class _Sampler:
    """Calls its denoiser once per step on a batch of one row per caption (the samplers' ``.denoiser``)."""

    def __init__(self):
        self.denoiser = _StepUNet()

    def __call__(self, captions, labels, scheduler, steps, guidance_scale, generator):
        x = torch.zeros(len(captions), 1)
        for _ in range(steps):
            x = self.denoiser(x)
        return x


def test_cost_of_an_evaluation_smaller_than_the_cost_batch_is_per_image():
    """With fewer samples than cost_batch_size (10), NFE and latency are per generated image (2 steps: NFE 2,
    not 1.2 from dividing 6 images' evaluations by 10)."""
    evaluator = QualityCostEvaluator.__new__(QualityCostEvaluator)
    evaluator.captions, evaluator.labels = ["a", "b", "c", "d", "e", "f"], None
    evaluator.cost_batch_size, evaluator.cost_repeats = 10, 1
    cost = evaluator.cost(_Sampler(), "ddim", 2, None)
    assert cost["nfe"] == 2.0


def test_estimate_is_value_std_replicates():
    e = Estimate(1.0, 0.1)
    assert (e.value, e.std, e.replicates) == (1.0, 0.1, None)
