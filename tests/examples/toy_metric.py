"""A metric added from one file: the mean brightness of the samples, in [0, 1].

Selected by name once the module is imported as a plugin (``distill.utils.registry``)::

    DISTILL_PLUGINS=tests.examples.toy_metric python -m distill.evaluate pipeline=<dir> eval.metrics=[fid,toy]

Its column (``toy``, ``toy_std``) then stands in the CSV, the table and the console lines, beside the built-in ones.
"""

from __future__ import annotations

from distill.metrics.registry import (
    Estimate,
    Metric,
    Samples,
    mean_estimate,
    register_metric,
    standard_error,
)


@register_metric
class ToyMetric(Metric):
    """Mean pixel value of each sample mapped from [-1, 1] to [0, 1], averaged; std: the standard error of that
    mean; replicates: the evaluation's shared bootstrap resamples (paired across rows)."""

    name, label, real_data = "toy", "bright", True

    def __call__(self, samples: Samples) -> Estimate:
        scores = (samples.images.float().mean(dim=(1, 2, 3)) + 1) / 2  # (N,)
        return mean_estimate(scores, samples, self.eval_set.fid_bootstrap, self.seed, standard_error(scores))
