"""Quality metrics as registered classes: a metric is one class here, and every table, CSV, plot and logger
picks it up from ``METRICS``.

A metric reads a ``Samples`` (images and what they were generated from) and returns an ``Estimate``: its value,
the standard deviation of that estimate (the column ``<name>_std``) and its replicates on resamples shared by
every row of the protocol (``<name>_replicates``), from which two rows' difference gets its paired uncertainty
(``distill.metrics.report.difference_std``). It takes what it measures with from the
evaluation set (``distill.metrics.eval_set.EvalSet``); ``needs`` names the inputs without which it is skipped.
"""

from __future__ import annotations

import logging
import math
import weakref
from dataclasses import dataclass
from typing import ClassVar

import torch

from distill.metrics.bootstrap import bootstrap_replicates
from distill.metrics.fid import to_model_pixels
from distill.utils.registry import Registry

log = logging.getLogger(__name__)


class Samples:
    """Images (N, C, H, W) in [-1, 1] with their captions (N,), labels (N,) or None, and the strata (N,) of the
    bootstrap; features are computed once per feature network and shared by the metrics that use them."""

    def __init__(self, images: torch.Tensor, captions: list[str], labels: torch.Tensor | None, strata: torch.Tensor):
        self.images, self.captions, self.labels, self.strata = images, captions, labels, strata
        self._features: dict[int, torch.Tensor] = {}

    def features(self, fid) -> torch.Tensor:
        if id(fid) not in self._features:
            self._features[id(fid)] = fid.features(self.images)
        return self._features[id(fid)]


@dataclass(frozen=True)
class Estimate:
    """A metric's value, the standard deviation of the estimate, and its replicates (R,) on resamples that depend
    only on the protocol (seed, strata, sizes), so that replicate k of every row is paired; None: no pairing."""

    value: float
    std: float
    replicates: torch.Tensor | None = None


def mean_estimate(scores: torch.Tensor, samples: Samples, num_resamples: int, seed: int, std: float) -> Estimate:
    """The mean of per-sample ``scores`` (N,) with ``std`` and its bootstrap replicates on the shared resamples."""
    scores = scores.double().cpu()
    return Estimate(scores.mean().item(), std,
                    bootstrap_replicates(lambda i: scores[i].mean().item(), samples.strata, num_resamples, seed))


class Metric:
    """Base of every quality metric. Subclasses set ``name`` (the CSV column), ``label`` (short, for
    console lines), ``needs`` (evaluation-set inputs: "feature", "clip", "classifier", "labels", "captions"),
    ``real_data`` (also measured on real images, for the data floor) and ``higher_is_better`` (a score such as
    the CLIP score rather than a distance; the metric sanity suite reports its relative drop), and implement
    ``__call__``."""

    name: ClassVar[str]
    label: ClassVar[str]
    needs: ClassVar[tuple[str, ...]] = ()
    real_data: ClassVar[bool] = False
    higher_is_better: ClassVar[bool] = False

    def __init__(self, eval_set, seed: int = 0):
        self.eval_set, self.seed = eval_set, seed

    def __call__(self, samples: Samples) -> Estimate:
        """The value, the standard deviation of the estimate and its paired replicates on ``samples``."""
        raise NotImplementedError


METRICS = Registry("metric", ordered=True)  # the built-in metrics are this module's; the order is the column order


def register_metric(cls: type[Metric]) -> type[Metric]:
    """Class decorator: registers ``cls`` in ``METRICS`` under ``cls.name`` (registration order: column order)."""
    return METRICS.register(cls.name)(cls)


def standard_error(values: torch.Tensor) -> float:
    """Standard error of the mean of ``values`` (N,): sample standard deviation / sqrt(N)."""
    return values.double().std().item() / math.sqrt(len(values))


def proportion_standard_error(p: float, n: int) -> float:
    """Standard error of a proportion ``p`` measured on ``n`` independent trials: sqrt(p (1 - p) / n)."""
    return math.sqrt(p * (1.0 - p) / n)


@register_metric
class FIDMetric(Metric):
    """FID against the reference; its std is the stratified bootstrap over the samples (reference fixed)."""

    name, label, needs, real_data = "fid", "FID", ("feature",), True
    space: ClassVar[str] = "feature"  # the evaluation set's feature space (``EvalSet.feature_spec``)

    def __call__(self, samples: Samples) -> Estimate:
        fid = self.eval_set.fid(self.space)
        features = samples.features(fid)
        replicates = fid.bootstrap_values(features, self.eval_set.fid_bootstrap, self.seed, samples.strata)
        return Estimate(fid.from_features(features), float(replicates.std()), replicates)


@register_metric
class KIDMetric(Metric):
    """KID against the reference features (unbiased at any sample count); its std is the spread over subsets."""

    name, label, needs, real_data = "kid", "KID", ("feature",), True
    space: ClassVar[str] = "feature"

    def __call__(self, samples: Samples) -> Estimate:
        from distill.metrics.kid import kid_subset_values

        fid = self.eval_set.fid(self.space)
        features = samples.features(fid)
        if fid.reference_features is None:
            return Estimate(math.nan, math.nan)  # statistics-only reference (.npz without features)
        if min(len(fid.reference_features), len(features)) < 4:
            log.warning("KID needs at least 4 reference and 4 generated images (got %d and %d); reported as NaN",
                        len(fid.reference_features), len(features))
            return Estimate(math.nan, math.nan)
        values = kid_subset_values(fid.reference_features, features, self.eval_set.kid_subsets,
                                   self.eval_set.kid_subset_size, self.seed)
        return Estimate(float(values.mean()), float(values.std(unbiased=False)), values)


@register_metric
class CLIPScoreMetric(Metric):
    """CLIP score of each sample against its caption, averaged; std: the standard error of that mean."""

    name, label, needs, higher_is_better = "clip_score", "CLIP", ("clip", "captions"), True

    def __call__(self, samples: Samples) -> Estimate:
        from distill.metrics.clip_score import clip_score

        model, tokenizer, mean, std = self.eval_set.clip_model()
        images = samples.images
        channels = model.config.vision_config.num_channels
        if images.shape[1] != channels and images.shape[1] == 1:  # grey samples, RGB model
            images = images.expand(-1, channels, -1, -1)
        images = to_model_pixels(images, mean, std)
        scores = torch.cat([clip_score(model, tokenizer, images[i:i + 500], samples.captions[i:i + 500])
                            for i in range(0, len(images), 500)])
        return mean_estimate(scores, samples, self.eval_set.fid_bootstrap, self.seed, standard_error(scores))


@register_metric
class PromptAccuracyMetric(Metric):
    """Share of samples the classifier assigns to their prompt's label; std: the proportion's standard error."""

    name, label, needs, higher_is_better = "prompt_accuracy", "acc", ("classifier", "labels"), True

    @torch.no_grad()
    def __call__(self, samples: Samples) -> Estimate:
        classifier = self.eval_set.classifier_model()
        logits = torch.cat([classifier(chunk) for chunk in samples.images.split(256)])
        correct = (logits.argmax(1) == samples.labels.to(logits.device)).float()
        accuracy = correct.mean().item()
        return mean_estimate(correct, samples, self.eval_set.fid_bootstrap, self.seed,
                             proportion_standard_error(accuracy, len(samples.images)))


# FID and KID in the extra feature spaces (``eval.extra_features``, ``distill.metrics.feature_spaces``): a
# column each, measured only where the space is selected.


@register_metric
class PixelFIDMetric(FIDMetric):
    """FID of the low-resolution pixels (``eval.extra_features=[pixels]``)."""

    name, label, needs, space = "fid_pixels", "FID-pix", ("features:pixels",), "pixels"


@register_metric
class PixelKIDMetric(KIDMetric):
    """KID of the low-resolution pixels (``eval.extra_features=[pixels]``)."""

    name, label, needs, space = "kid_pixels", "KID-pix", ("features:pixels",), "pixels"


@register_metric
class CLIPFIDMetric(FIDMetric):
    """FID in the CLIP model's image embedding (``eval.extra_features=[clip]``)."""

    name, label, needs, space = "fid_clip", "FID-clip", ("features:clip",), "clip"


@register_metric
class CLIPKIDMetric(KIDMetric):
    """KID in the CLIP model's image embedding (``eval.extra_features=[clip]``)."""

    name, label, needs, space = "kid_clip", "KID-clip", ("features:clip",), "clip"


# Fidelity and diversity on k-NN manifolds of the FID's feature space (``distill.metrics.manifold``): precision (the
# share of samples inside the real data's neighbourhoods) and coverage (the share of real neighbourhoods reached).

_RADII: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # FID -> its reference's k-NN radii, computed once


class _ManifoldMetric(Metric):
    """Precision or coverage against the reference features, k = ``manifold.NEAREST_K``; std and paired replicates:
    the evaluation's shared stratified bootstrap over the samples (the real balls fixed, as FID's reference)."""

    needs, real_data, higher_is_better = ("feature",), True, True
    space: ClassVar[str] = "feature"
    index: ClassVar[int]  # 0: precision, 1: coverage

    def __call__(self, samples: Samples) -> Estimate:
        from distill.metrics.manifold import precision_and_coverage, real_fake_distances, real_radii

        fid = self.eval_set.fid(self.space)
        if fid.reference_features is None:
            return Estimate(math.nan, math.nan)  # statistics-only reference (.npz without features)
        if fid not in _RADII:
            _RADII[fid] = real_radii(fid.reference_features)
        radii = _RADII[fid]
        distances = real_fake_distances(fid.reference_features, samples.features(fid))
        replicates = bootstrap_replicates(lambda i: precision_and_coverage(distances, radii, i)[self.index],
                                          samples.strata, self.eval_set.fid_bootstrap, self.seed)
        return Estimate(precision_and_coverage(distances, radii)[self.index], float(replicates.std()), replicates)


@register_metric
class PrecisionMetric(_ManifoldMetric):
    """Precision (Kynkäänniemi et al. 2019): the share of samples inside a real feature's k-NN ball."""

    name, label, index = "precision", "prec", 0


@register_metric
class CoverageMetric(_ManifoldMetric):
    """Coverage (Naeem et al. 2020): the share of real features whose k-NN ball holds a sample; a collapsed
    generator loses it while its precision and prompt accuracy stay high."""

    name, label, index = "coverage", "cov", 1


def build_metrics(eval_set, seed: int = 0) -> list[Metric]:
    """The metrics ``eval_set.metrics`` names whose inputs the set has, in registration order."""
    return [METRICS[name](eval_set, seed) for name in METRICS
            if name in eval_set.metrics and all(eval_set.available(need) for need in METRICS[name].needs)]
