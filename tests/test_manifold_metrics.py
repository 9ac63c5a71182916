"""Precision and coverage (distill.metrics.manifold) against the authors' package ``prdc`` and the expected coverage
of two samples of one distribution (Naeem et al. 2020, eq. 5); the registered metrics on a collapsed generator."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from distill.metrics.manifold import precision_and_coverage, real_fake_distances, real_radii


@pytest.mark.parametrize("k", [3, 5])
def test_precision_and_coverage_equal_the_prdc_package(k):
    prdc = pytest.importorskip("prdc")
    g = torch.Generator().manual_seed(0)
    real = torch.randn(300, 8, generator=g)
    fake = 1.3 * torch.randn(170, 8, generator=g) + 0.4  # another distribution: both values well inside (0, 1)
    reference = prdc.compute_prdc(real.numpy().astype(np.float64), fake.numpy().astype(np.float64), k)
    precision, coverage = precision_and_coverage(real_fake_distances(real, fake, chunk=64),
                                                 real_radii(real, k, chunk=64))
    assert 0.1 < reference["precision"] < 0.9 and 0.1 < reference["coverage"] < 0.9
    assert precision == pytest.approx(float(reference["precision"]), abs=1e-12)
    assert coverage == pytest.approx(float(reference["coverage"]), abs=1e-12)


def test_coverage_of_two_samples_of_one_distribution_is_the_papers_expectation():
    """Naeem et al. eq. 5: with N real and M fake samples of one distribution, E[coverage] =
    1 - prod_{i=1..k} (N - i) / (M + N - i) (exchangeability, for any continuous distribution)."""
    n, m, k = 1200, 1200, 5
    expected = 1 - math.prod((n - i) / (m + n - i) for i in range(1, k + 1))  # 0.9692
    values = []
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        real, fake = torch.randn(n, 6, generator=g), torch.randn(m, 6, generator=g)
        values.append(precision_and_coverage(real_fake_distances(real, fake), real_radii(real, k))[1])
    # a coverage of 1200 balls: sd about sqrt(p (1 - p) / N) = 0.005 (correlated balls), mean of 4 seeds
    assert abs(np.mean(values) - expected) < 0.008, (values, expected)


def test_radii_refuse_a_reference_smaller_than_k():
    with pytest.raises(ValueError, match="5-th nearest neighbour"):
        real_radii(torch.randn(5, 3))


class _Features:
    """A feature network that is the identity on (N, D) 'images', with a reference of its own."""

    def __init__(self, reference):
        self.reference_features = reference

    def features(self, images):
        return images


def _metric(name, reference, bootstrap=40):
    from distill.metrics.registry import METRICS

    fid = _Features(reference)
    eval_set = SimpleNamespace(fid=lambda space: fid, fid_bootstrap=bootstrap)
    return METRICS[name](eval_set, seed=0)


def test_a_collapsed_generator_keeps_its_precision_and_loses_coverage():
    from distill.metrics.registry import Samples

    g = torch.Generator().manual_seed(1)
    reference = torch.randn(400, 4, generator=g)
    strata = torch.arange(400) % 10
    diverse = torch.randn(400, 4, generator=g)
    modes = reference[:8]  # eight real points, each sample a small jitter of one of them
    collapsed = modes[torch.arange(400) % 8] + 0.01 * torch.randn(400, 4, generator=g)
    rows = {}
    for label, images in (("diverse", diverse), ("collapsed", collapsed)):
        samples = Samples(images, [""] * 400, None, strata)
        rows[label] = {name: _metric(name, reference)(samples) for name in ("precision", "coverage")}
    assert rows["collapsed"]["precision"].value == 1.0  # every sample sits on a real point
    assert rows["diverse"]["precision"].value > 0.8
    # a real point lies in its own ball and in those of the about k others it is a k-NN of: 8 modes reach about
    # 8 (k + 1) = 48 of the 400 balls (0.12)
    assert 0.08 < rows["collapsed"]["coverage"].value < 0.2
    assert rows["diverse"]["coverage"].value > 0.9
    for row in rows.values():  # paired bootstrap replicates on the evaluation's shared resamples
        for estimate in row.values():
            assert estimate.replicates.shape == (40,) and estimate.std == pytest.approx(float(estimate.replicates.std()))
    assert 0 < rows["diverse"]["coverage"].std < 0.03


def test_a_statistics_only_reference_gives_nan():
    from distill.metrics.registry import Samples

    estimate = _metric("coverage", None)(Samples(torch.randn(10, 4), [""] * 10, None, torch.zeros(10)))
    assert math.isnan(estimate.value) and math.isnan(estimate.std)


def test_on_real_digits_coverage_falls_by_the_share_of_dropped_classes_and_precision_stays():
    """The metric sanity suite on the held-out digits (180 reference, 180 probes): dropping a fraction f of the
    classes (the kept probes repeated) leaves every probe real, so precision stays, and leaves the dropped classes'
    balls empty, so coverage falls by f; a within-class collapse to a tenth of the images lowers coverage too,
    where prompt accuracy cannot see it."""
    from distill.metrics.sanity import DEGRADATIONS, SanitySuite
    from tests.test_eval_set import instantiate_eval

    suite = SanitySuite(instantiate_eval("eval=digits", "eval.clip=null", cache_dir=None), max_images=720, seed=0)
    want = {"drop_classes": [0.2, 0.5], "collapse": [0.9]}
    rows = suite.run({name: want.get(name, []) for name in DEGRADATIONS})
    value = {(r["degradation"], r["strength"], r["distance"]): r["value"] for r in rows}
    for f in (0.2, 0.5):
        assert value["drop_classes", f, "coverage_drop"] == pytest.approx(f, abs=0.03)
        assert abs(value["drop_classes", f, "precision_drop"]) < 0.05
    assert value["collapse", 0.9, "coverage_drop"] > 0.4 and abs(value["collapse", 0.9, "precision_drop"]) < 0.05
    assert value["collapse", 0.9, "prompt_accuracy_drop"] == pytest.approx(0.0, abs=0.02)
