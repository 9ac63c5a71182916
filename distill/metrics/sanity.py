"""Metric sensitivity suite: does each reported distance rise, monotonically, as real images get worse?

Real images of the evaluation set (its data module's held-out split, else its reference folder) are split,
seeded and stratified by label, into a reference half and a probe half. The probes are degraded by known
amounts (``DEGRADATIONS``) and measured against the reference half, in every feature space: the set's own
network (``feature``), its ``extra_features`` and the pixel space (always, it needs no weights). What is
measured is every registered metric (``distill.metrics.registry.METRICS``) of ``eval.metrics`` whose inputs
the probes have, called as in a sweep, the reference half in place of the set's reference: FID and KID in
each space, the CLIP score where the probes have captions, the prompt accuracy where they have labels, and a
metric of one's own. A row's ``space`` is the metric's input (its feature space, else its first need, else
``images``) and its ``distance`` the metric's name less ``_<space>`` (``fid_pixels``: space ``pixels``,
distance ``fid``); a metric that is higher when better is reported as its relative drop,
``<distance>_drop`` = 1 - value / clean value (``clip_score_drop``, ``prompt_accuracy_drop``). A distance
that does not rise beyond its noise as a defect grows cannot see that defect; ``verdicts`` says so for each
(degradation, space, distance).

    python -m distill.evaluate sanity=true [eval.extra_features=[pixels,clip]] [sanity_images=300]
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from distill.metrics.fid import FID, describe
from distill.metrics.registry import Metric, Samples, build_metrics

# ---------------------------------------------------------------- degradations
# Each maps probes (N, C, H, W) in [-1, 1], their labels (N,) (-1: unlabelled), a strength and a generator to
# degraded images (N, C, H, W) and the probe each came from (N,), so that captions and labels follow.


def gaussian_blur(images: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable Gaussian blur with standard deviation ``sigma`` pixels (kernel radius ceil(3 sigma), reflected
    borders)."""
    radius = min(max(1, math.ceil(3 * sigma)), images.shape[-1] - 1, images.shape[-2] - 1)
    x = torch.arange(-radius, radius + 1, dtype=images.dtype)
    kernel = torch.exp(-x.square() / (2 * sigma**2))
    kernel = kernel / kernel.sum()
    c = images.shape[1]
    out = F.conv2d(F.pad(images, (radius, radius, 0, 0), mode="reflect"), kernel.view(1, 1, 1, -1).repeat(c, 1, 1, 1),
                   groups=c)
    return F.conv2d(F.pad(out, (0, 0, radius, radius), mode="reflect"), kernel.view(1, 1, -1, 1).repeat(c, 1, 1, 1),
                    groups=c)


def _same(images: torch.Tensor) -> torch.Tensor:
    return torch.arange(len(images))


def blur(images, labels, sigma, generator):
    """Gaussian blur, ``sigma`` in pixels at the evaluation resolution."""
    return gaussian_blur(images, sigma), _same(images)


def noise(images, labels, sigma, generator):
    """Additive Gaussian noise of std ``sigma`` (images in [-1, 1], as models produce them), clipped."""
    eps = torch.randn(images.shape, generator=generator, dtype=images.dtype)
    return (images + sigma * eps).clamp(-1, 1), _same(images)


def brightness(images, labels, delta, generator):
    """Every pixel brightened by ``delta`` (images in [-1, 1]), clipped."""
    return (images + delta).clamp(-1, 1), _same(images)


def contrast(images, labels, amount, generator):
    """Contrast reduced by ``amount``: each image blended towards its mean, m + (1 - amount) (x - m)."""
    mean = images.mean(dim=(1, 2, 3), keepdim=True)
    return mean + (1 - amount) * (images - mean), _same(images)


def drop_classes(images, labels, fraction, generator):
    """``round(fraction * K)`` of the K classes (at most K - 1; the same seeded order at every strength, so the
    dropped sets are nested) are dropped; the set keeps its size by cycling through the kept probes, so dropping
    classes here also repeats images (``unique_images`` counts the distinct ones)."""
    classes = labels.unique()
    order = classes[torch.randperm(len(classes), generator=generator)]
    dropped = order[:min(len(classes) - 1, round(fraction * len(classes)))]
    kept = torch.nonzero(~torch.isin(labels, dropped)).flatten()
    index = kept[torch.arange(len(labels)) % len(kept)]
    return images[index], index


def collapse(images, labels, fraction, generator):
    """Diversity collapse: in each class (the whole set when unlabelled) only ``1 - fraction`` of the distinct
    images are kept (at least one; nested across strengths), repeated to fill the class's places."""
    index = torch.empty(len(labels), dtype=torch.long)
    for c in labels.unique():
        members = torch.nonzero(labels == c).flatten()
        members = members[torch.randperm(len(members), generator=generator)]
        keep = max(1, round((1 - fraction) * len(members)))
        index[members] = members[:keep][torch.arange(len(members)) % keep]
    return images[index], index


@dataclass(frozen=True)
class Degradation:
    apply: Callable  # (images, labels, strength, generator) -> (images, source index)
    strengths: tuple[float, ...]  # the default sweep, mild to severe
    unit: str
    needs_labels: bool = False
    max_strength: float = math.inf


DEGRADATIONS: dict[str, Degradation] = {
    "blur": Degradation(blur, (0.5, 1.0, 1.5, 2.0, 3.0), "Gaussian sigma, pixels"),
    "noise": Degradation(noise, (0.05, 0.1, 0.2, 0.4, 0.6), "std, images in [-1, 1]"),
    "brightness": Degradation(brightness, (0.05, 0.1, 0.2, 0.4, 0.8), "shift, images in [-1, 1]"),
    "contrast": Degradation(contrast, (0.1, 0.2, 0.3, 0.5, 0.8), "reduction, 1 = flat", max_strength=1.0),
    "drop_classes": Degradation(drop_classes, (0.1, 0.2, 0.3, 0.5, 0.8), "fraction of classes", True, 1.0),
    "collapse": Degradation(collapse, (0.5, 0.75, 0.9, 1.0), "fraction of distinct images removed",
                            max_strength=1.0),
}
STRENGTHS: dict[str, list[float]] = {name: list(d.strengths) for name, d in DEGRADATIONS.items()}


def check_strengths(overrides: Mapping[str, Sequence[float]] | None = None, key: str = "sanity_strengths") -> dict:
    """The sweep to run: ``STRENGTHS`` with the lists of ``overrides`` in place of the defaults (an empty list
    skips that degradation); fails naming the key on an unknown degradation or strengths that are not
    increasing, positive and within the degradation's range."""
    overrides = dict(overrides or {})
    unknown = [name for name in overrides if name not in DEGRADATIONS]
    if unknown:
        raise ValueError(f"{key} names unknown degradation(s) {unknown}; use some of {list(DEGRADATIONS)}")
    sweep = {}
    for name, default in STRENGTHS.items():
        values = [float(v) for v in overrides.get(name, default)]
        top = DEGRADATIONS[name].max_strength
        if values and (values[0] <= 0 or any(b <= a for a, b in zip(values, values[1:])) or values[-1] > top):
            bound = "> 0" if math.isinf(top) else f"in (0, {top:g}]"
            raise ValueError(f"{key}.{name}={values} must be increasing strengths {bound} ({DEGRADATIONS[name].unit}), "
                             f"e.g. {default}; [] skips {name}")
        if values:
            sweep[name] = values
    if not sweep:
        raise ValueError(f"{key} skips every degradation; give at least one a list of strengths")
    return sweep


# ---------------------------------------------------------------- real images and their split


def real_images(eval_set) -> tuple[torch.Tensor, list[str] | None, torch.Tensor | None, str]:
    """Real images (N, C, R, R) of ``eval_set``, their captions and labels (None where it has none), and where
    they came from: the data module's held-out split, else the reference folder."""
    if eval_set.reference is None:
        images, captions, labels = eval_set.heldout()
        return images, captions, labels if len(labels) and bool((labels >= 0).all()) else None, "held-out split"
    if str(eval_set.reference).endswith(".npz"):
        raise ValueError(f"the metric sanity suite degrades real images, but eval.reference={eval_set.reference!r} "
                         "holds statistics only; point eval.reference at a folder of images, or set "
                         "eval.reference=null with eval.data")
    return eval_set.reference_images()[0], None, None, f"reference folder {eval_set.reference}"


def split_reference(labels: torch.Tensor | None, count: int, max_images: int | None, seed: int,
                    fraction: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the reference and probe images: ``max_images`` of the ``count`` (seeded draw), split within
    each label (the whole set when unlabelled) into ``fraction`` reference and the rest probes."""
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(count, generator=generator)[:max_images]
    groups = labels[chosen] if labels is not None else torch.zeros(len(chosen), dtype=torch.long)
    reference, probes = [], []
    for g in groups.unique():
        members = chosen[groups == g]
        cut = round(fraction * len(members))
        reference.append(members[:cut])
        probes.append(members[cut:])
    reference, probes = torch.cat(reference).sort().values, torch.cat(probes).sort().values
    if min(len(reference), len(probes)) < 4:
        raise ValueError(f"the sanity suite has {len(reference)} reference and {len(probes)} probe images; it needs "
                         "at least 4 of each (raise sanity_images, or give the evaluation set more real images)")
    return reference, probes


# ---------------------------------------------------------------- measuring


class _Halves:
    """The evaluation set as a registered metric sees it inside the suite: the reference half stands in for the
    set's reference in every space, and the probes' captions and labels are the inputs a metric may need."""

    def __init__(self, suite: SanitySuite):
        self._suite, self._eval_set = suite, suite.eval_set
        self.extra_features = [space for space in suite.spaces if space != "feature"]

    def __getattr__(self, name: str):
        return getattr(self._eval_set, name)

    def fid(self, space: str = "feature") -> FID:
        return self._suite.spaces[space]

    def available(self, need: str) -> bool:
        if need == "feature" or need.startswith("features:"):
            return need.removeprefix("features:") in self._suite.spaces
        if need == "labels":
            return self._suite.labels is not None
        if need == "captions":
            return bool(self._suite.captions)
        return self._eval_set.available(need)


def metric_key(metric: Metric) -> tuple[str, str]:
    """A metric's (space, distance) in the suite's rows: its feature space, else its first need, else ``images``;
    its name less ``_<space>``, as ``<distance>_drop`` when higher is better."""
    spaces = [need.removeprefix("features:") for need in metric.needs if need == "feature" or need.startswith("features:")]
    space = (spaces or list(metric.needs) or ["images"])[0]
    distance = metric.name.removesuffix(f"_{space}")
    return space, f"{distance}_drop" if metric.higher_is_better else distance


class SanitySuite:
    """The reference half in every feature space and the measurements of (degraded) probes against it."""

    def __init__(self, eval_set, spaces: Sequence[str] | None = None, max_images: int | None = None, seed: int = 0):
        self.eval_set, self.seed = eval_set, seed
        images, captions, labels, self.source = real_images(eval_set)
        reference, probes = split_reference(labels, len(images), max_images, seed)
        self.num_reference = len(reference)
        self.probes = images[probes]
        self.captions = [captions[i] for i in probes] if captions is not None else None
        self.labels = labels[probes] if labels is not None else None
        if spaces is None:
            spaces = (["feature"] if eval_set.feature is not None else []) + list(eval_set.extra_features)
            spaces += [] if "pixels" in spaces else ["pixels"]
        self.spaces: dict[str, FID] = {}
        for space in spaces:
            fid = FID(eval_set.feature_spec(space), cache_dir=None, input_shape=tuple(images.shape[1:]))
            fid.set_reference(images[reference])
            self.spaces[space] = fid
        self.metrics = build_metrics(_Halves(self), seed)
        clean = self._samples(self.probes, _same(self.probes))
        self.clean = {m.name: m(clean).value for m in self.metrics if m.higher_is_better}  # the drops' base

    def describe_spaces(self) -> dict[str, str]:
        return {space: describe(self.eval_set.feature_spec(space)) for space in self.spaces}

    def _samples(self, images: torch.Tensor, index: torch.Tensor) -> Samples:
        labels = self.labels[index] if self.labels is not None else None
        strata = labels if labels is not None else torch.zeros(len(images), dtype=torch.long)
        return Samples(images, [self.captions[i] for i in index] if self.captions else [], labels, strata)

    def measure(self, images: torch.Tensor, index: torch.Tensor) -> dict[tuple[str, str], tuple[float, float]]:
        """{(space, distance): (value, std)} of degraded probes ``images`` (N, C, H, W), each from probe ``index``,
        one entry per metric of ``self.metrics`` (``metric_key``)."""
        samples = self._samples(images, index)
        out = {}
        for metric in self.metrics:
            estimate = metric(samples)
            value, std = estimate.value, estimate.std
            if metric.higher_is_better:
                base = self.clean[metric.name]
                value, std = (1 - value / base, std / base) if base else (math.nan, math.nan)
            out[metric_key(metric)] = (value, std)
        return out

    def plan(self, strengths: Mapping[str, Sequence[float]] | None = None) -> dict[str, list[float]]:
        """``check_strengths(strengths)`` less what these probes cannot take (dropping classes without labels)."""
        return {name: values for name, values in check_strengths(strengths).items()
                if self.labels is not None or not DEGRADATIONS[name].needs_labels}

    def run(self, strengths: Mapping[str, Sequence[float]] | None = None,
            on_row: Callable[[str, float], None] | None = None) -> list[dict]:
        """Rows (degradation, strength, space, distance, value, std, unique_images): the clean probes first
        (degradation ``clean``, strength 0), then every degradation of ``plan(strengths)`` at every strength."""
        clean = self.measure(self.probes, _same(self.probes))
        rows = [dict(degradation="clean", strength=0.0, space=s, distance=d, value=v, std=sd,
                     unique_images=len(self.probes)) for (s, d), (v, sd) in clean.items()]
        for name, values in self.plan(strengths).items():
            degradation = DEGRADATIONS[name]
            labels = self.labels if self.labels is not None else torch.zeros(len(self.probes), dtype=torch.long)
            for strength in values:
                generator = torch.Generator().manual_seed(self.seed)  # the same draw at every strength: nested
                images, index = degradation.apply(self.probes, labels, strength, generator)
                unique = len(index.unique())
                for (space, distance), (value, std) in self.measure(images, index).items():
                    rows.append(dict(degradation=name, strength=strength, space=space, distance=distance, value=value,
                                     std=std, unique_images=unique))
                if on_row is not None:
                    on_row(name, strength)
        return rows


# ---------------------------------------------------------------- verdicts and reports


def verdicts(rows: list[dict], sigmas: float = 2.0) -> list[dict]:
    """Per (degradation, space, distance), where the value reaches more than ``sigmas`` combined stds above the
    clean one (``detected_at``: the first strength that does): ``monotone`` (it rises at every step from the
    clean value), ``monotone within noise`` (a step falls, but by less than one combined std), ``not monotone``
    (a step falls by more), else ``insensitive``; ``ratio``: the strongest value over the clean one (NaN
    unless the clean one is positive). The probes are the same images at every strength, so steps are coupled
    and the stds (each value's own spread) overstate the noise of a step: the point estimates are the test."""
    clean = {(r["space"], r["distance"]): r for r in rows if r["degradation"] == "clean"}
    series: dict[tuple[str, str, str], list[dict]] = {}
    for r in rows:
        if r["degradation"] != "clean":
            series.setdefault((r["degradation"], r["space"], r["distance"]), []).append(r)
    out = []
    for (degradation, space, distance), rs in series.items():
        c = clean[space, distance]
        rs = sorted(rs, key=lambda r: r["strength"])
        values = [c["value"]] + [r["value"] for r in rs]
        above = [r["strength"] for r in rs if r["value"] - c["value"] > sigmas * math.hypot(c["std"], r["std"])]
        stds = [c["std"]] + [r["std"] for r in rs]
        falls = [a - b for a, b in zip(values, values[1:])]
        worst = max((f / (math.hypot(s1, s2) or math.inf) for f, s1, s2 in zip(falls, stds, stds[1:])), default=0.0)
        verdict = ("insensitive" if not above else "monotone" if max(falls) <= 0 else
                   "monotone within noise" if worst < 1 else "not monotone")
        out.append(dict(degradation=degradation, space=space, distance=distance, verdict=verdict,
                        detected_at=above[0] if above else None, clean=c["value"], strongest=values[-1],
                        ratio=values[-1] / c["value"] if c["value"] > 0 else math.nan))
    return out


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _number(value: float) -> str:
    return "nan" if not math.isfinite(value) else f"{value:.3g}" if abs(value) < 1e4 else f"{value:.3e}"


def format_markdown(rows: list[dict], found: list[dict], header: str = "") -> str:
    """The distances (one column per space and distance, value ± std) and the verdicts as Markdown tables."""
    keys = list(dict.fromkeys((r["space"], r["distance"]) for r in rows))
    names = [f"{d.upper() if d in ('fid', 'kid') else d} {s}" for s, d in keys]
    cells: dict[tuple[str, float], dict] = {}
    for r in rows:
        cell = cells.setdefault((r["degradation"], r["strength"]), {"unique": r["unique_images"]})
        cell[r["space"], r["distance"]] = f"{_number(r['value'])} ± {_number(r['std'])}"
    lines = [header] if header else []
    lines += ["| degradation | strength | distinct images | " + " | ".join(names) + " |",
              "|---|---|---|" + "---|" * len(keys)]
    for (degradation, strength), cell in cells.items():
        lines.append(f"| {degradation} | {strength:g} | {cell['unique']} | "
                     + " | ".join(cell.get(k, "") for k in keys) + " |")
    lines += ["", "Verdict per degradation and distance (first strength that rises beyond 2 combined std; strongest "
              "value / clean value where the clean one is positive):", "",
              "| degradation | " + " | ".join(names) + " |", "|---|" + "---|" * len(keys)]
    by_degradation: dict[str, dict] = {}
    for v in found:
        ratio = f", x{_number(v['ratio'])}" if math.isfinite(v["ratio"]) else ""
        seen = f" from {v['detected_at']:g}" if v["detected_at"] is not None else ""
        by_degradation.setdefault(v["degradation"], {})[v["space"], v["distance"]] = f"{v['verdict']}{seen}{ratio}"
    for degradation, cell in by_degradation.items():
        lines.append(f"| {degradation} | " + " | ".join(cell.get(k, "") for k in keys) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str = "metric sensitivity") -> Path:
    """Distance against strength: one column per degradation, one row per distance, one line per space (each
    starting at the clean value, strength 0), +-1 std error bars; FID on a log axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    degradations = list(dict.fromkeys(r["degradation"] for r in rows if r["degradation"] != "clean"))
    distances = list(dict.fromkeys(r["distance"] for r in rows))
    fig, axes = plt.subplots(len(distances), len(degradations), figsize=(2.6 * len(degradations), 2.2 * len(distances)),
                             dpi=110, squeeze=False)
    clean = {(r["space"], r["distance"]): r for r in rows if r["degradation"] == "clean"}
    for i, distance in enumerate(distances):
        for j, degradation in enumerate(degradations):
            ax = axes[i][j]
            for space in dict.fromkeys(r["space"] for r in rows if r["distance"] == distance):
                rs = [clean[space, distance]] + sorted((r for r in rows if r["degradation"] == degradation
                                                        and r["space"] == space and r["distance"] == distance),
                                                       key=lambda r: r["strength"])
                ax.errorbar([0.0 if k == 0 else r["strength"] for k, r in enumerate(rs)], [r["value"] for r in rs],
                            yerr=[r["std"] for r in rs], marker="o", markersize=3, capsize=2, label=space)
            if distance == "fid":
                ax.set_yscale("log")
            if i == 0:
                ax.set_title(degradation, fontsize=9)
            if i == len(distances) - 1:
                ax.set_xlabel(DEGRADATIONS[degradation].unit, fontsize=7)
            if j == 0:
                ax.set_ylabel(distance, fontsize=9)
            ax.tick_params(labelsize=7)
        axes[i][0].legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    from distill.metrics.report import save_figure

    return save_figure(fig, path)


def run_sanity(eval_set, out_dir: Path, strengths: Mapping[str, Sequence[float]] | None = None,
               max_images: int | None = None, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """The suite on ``eval_set`` (``strengths``: overrides of ``STRENGTHS``): ``sanity.csv``,
    ``sanity_verdicts.csv``, ``sanity.md`` and ``sanity.png`` in ``out_dir``; returns the rows and the verdicts."""
    from tqdm.auto import tqdm

    suite = SanitySuite(eval_set, max_images=max_images, seed=seed)
    with tqdm(total=sum(len(v) for v in suite.plan(strengths).values()), desc="metric sanity", unit="set") as bar:
        rows = suite.run(strengths, on_row=lambda name, strength: bar.update(1))
    found = verdicts(rows)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out_dir / "sanity.csv")
    write_csv(found, out_dir / "sanity_verdicts.csv")
    spaces = ", ".join(f"`{space}` = {name}" for space, name in suite.describe_spaces().items())
    header = (f"Metric sensitivity on the evaluation set {eval_set.name!r}: {len(suite.probes)} probe images degraded "
              f"and measured against {suite.num_reference} reference images, both real ({suite.source}, split "
              f"seeded by {seed}). Feature spaces: {spaces}.\n")
    (out_dir / "sanity.md").write_text(format_markdown(rows, found, header) + "\n")
    plot(rows, out_dir / "sanity.png", title=f"metric sensitivity: {eval_set.name}")
    return rows, found

