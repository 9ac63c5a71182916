"""Quality-cost sweep: for each (scheduler, steps) generate a fixed prompt/seed set, measure FID, CLIP
score, prompt accuracy (each with its uncertainty, ``<name>_std``) and cost, and keep the Pareto front
(lower FID at lower latency)."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Protocol

import torch

from distill.data.digits import caption_for
from distill.inference.schedulers import scheduler_options
from distill.metrics.cost import NFECounter, measure_cost


class Sampler(Protocol):
    """Anything that turns captions into images in [-1, 1] with a named scheduler and step count."""

    unet: torch.nn.Module

    def __call__(self, captions: list[str], labels: torch.Tensor, scheduler: str, steps: int,
                 guidance_scale: float | None, generator: torch.Generator) -> torch.Tensor: ...


class PipelineSampler:
    """A diffusers text-to-image pipeline (StableDiffusionPipeline layout). Each scheduler of a sweep is
    built from the pipeline's own scheduler config with that scheduler's options: ``options[name]``, else
    those of the package's ``conf/scheduler/<name>.yaml``. ``own`` names the scheduler the pipeline was
    exported with (its ``distill.json``): that name keeps the pipeline's own scheduler class and config, e.g.
    a progressive student's ``GridDDIMScheduler`` for "ddim" (diffusers' DDIM would leave its training grid)."""

    def __init__(self, pipe, options: dict[str, dict] | None = None, own: str | None = None):
        self.pipe, self.unet = pipe, pipe.unet
        self.base_config = pipe.scheduler.config
        self.own_class, self.own = type(pipe.scheduler), own
        self.options = dict(options or {})
        pipe.set_progress_bar_config(disable=True)
        self.size = pipe.unet.config.sample_size * pipe.vae_scale_factor

    def scheduler(self, name: str):
        from distill.inference.schedulers import make_scheduler

        if name == self.own:
            return self.own_class.from_config(self.base_config)
        options = self.options[name] if name in self.options else scheduler_options(name)
        return make_scheduler(name, self.base_config, **options)

    @torch.no_grad()
    def __call__(self, captions, labels, scheduler, steps, guidance_scale, generator):
        self.pipe.scheduler = self.scheduler(scheduler)
        out = self.pipe(list(captions), num_inference_steps=steps, guidance_scale=guidance_scale or 1.0,
                        height=self.size, width=self.size, generator=generator, output_type="pt").images
        return out * 2.0 - 1.0


class MethodSampler:
    """A training method's ``generate`` (the student as it is now, before any export)."""

    def __init__(self, method):
        self.method, self.unet = method, method.student
        # the guidance the student's intended call really uses (1 for a LoRA student that distilled it)
        defaults = method.call_defaults() if hasattr(method, "call_defaults") else {}
        self.default_guidance_scale = defaults.get("default_guidance_scale", method.sampling.get("guidance_scale"))

    @torch.no_grad()
    def __call__(self, captions, labels, scheduler, steps, guidance_scale, generator):
        batch = {"caption": list(captions), "label": labels}
        return self.method.generate(batch, generator, num_inference_steps=steps, guidance_scale=guidance_scale,
                                    scheduler=scheduler)


def digit_prompts(num_per_class: int) -> tuple[list[str], torch.Tensor]:
    labels = torch.arange(10).repeat(num_per_class)  # interleaved: every batch prefix covers all digits
    return [caption_for(int(i)) for i in labels], labels


def prompt_strata(captions: list[str], labels: torch.Tensor | None) -> torch.Tensor:
    """Each sample's stratum for the FID bootstrap (N,): its label, else the index of its prompt among the
    distinct prompts (the protocol draws a fixed number per prompt)."""
    if labels is not None:
        return labels
    index: dict[str, int] = {}
    return torch.tensor([index.setdefault(c, len(index)) for c in captions])


def standard_error(values: torch.Tensor) -> float:
    """Standard error of the mean of ``values`` (N,): sample standard deviation / sqrt(N)."""
    return values.double().std().item() / math.sqrt(len(values))


def proportion_standard_error(p: float, n: int) -> float:
    """Standard error of a proportion ``p`` measured on ``n`` independent trials: sqrt(p (1 - p) / n)."""
    return math.sqrt(p * (1.0 - p) / n)


class QualityCostEvaluator:
    """Fixed prompts and seeds; FID against a reference set; CLIP score; classifier prompt accuracy; cost.

    Every quality number comes with ``<name>_std``, the standard deviation of its estimate: for FID the
    bootstrap over the generated samples (``fid_bootstrap`` resamples within each prompt's samples, the
    reference fixed), for the CLIP
    score and the prompt accuracy the standard error of their mean over the samples.
    """

    def __init__(self, fid, clip_model=None, clip_tokenizer=None, classifier=None, num_per_class: int = 50,
                 seed: int = 0, batch_size: int = 250, cost_batch_size: int = 10, cost_repeats: int = 3,
                 resolution: int = 32, fid_bootstrap: int = 50):
        if fid_bootstrap < 2:
            raise ValueError(f"fid_bootstrap={fid_bootstrap} resamples cannot give a spread; use at least 2 (default 50)")
        self.fid, self.clip_model, self.clip_tokenizer, self.classifier = fid, clip_model, clip_tokenizer, classifier
        self.resolution, self.fid_bootstrap = resolution, fid_bootstrap
        self.captions, self.labels = digit_prompts(num_per_class)
        self.strata = prompt_strata(self.captions, self.labels)
        self.seed, self.batch_size = seed, batch_size
        self.cost_batch_size, self.cost_repeats = cost_batch_size, cost_repeats

    @torch.no_grad()
    def generate(self, sampler: Sampler, scheduler: str, steps: int, guidance_scale: float | None) -> torch.Tensor:
        images = []
        for i, start in enumerate(range(0, len(self.captions), self.batch_size)):
            generator = torch.Generator().manual_seed(self.seed + i)
            images.append(sampler(self.captions[start:start + self.batch_size],
                                  self.labels[start:start + self.batch_size], scheduler, steps, guidance_scale,
                                  generator).float().cpu())
        return torch.cat(images)

    @torch.no_grad()
    def fid_with_spread(self, images: torch.Tensor, strata: torch.Tensor | None = None) -> dict:
        """``fid`` and its bootstrap ``fid_std`` of ``images``, resampled within ``strata`` (N,) (default: the
        evaluator's prompts, for images generated from them); the features are computed once."""
        features = self.fid.features(images)
        strata = self.strata if strata is None else strata
        return {"fid": self.fid.from_features(features),
                "fid_std": self.fid.bootstrap_std(features, self.fid_bootstrap, self.seed, strata)}

    @torch.no_grad()
    def quality(self, images: torch.Tensor) -> dict:
        from distill.metrics.clip_score import clip_score

        if images.shape[-1] != self.resolution:  # judge every model at the reference resolution
            images = torch.nn.functional.interpolate(images, size=(self.resolution, self.resolution), mode="bilinear",
                                                     align_corners=False, antialias=True)
        row = self.fid_with_spread(images)
        if self.clip_model is not None:
            scores = torch.cat([clip_score(self.clip_model, self.clip_tokenizer, images[i:i + 500], self.captions[i:i + 500])
                                for i in range(0, len(images), 500)])
            row["clip_score"], row["clip_score_std"] = scores.mean().item(), standard_error(scores)
        if self.classifier is not None:
            from distill.metrics.digit_accuracy import prompted_digit_accuracy

            accuracy = prompted_digit_accuracy(images, self.labels, self.classifier)
            row["prompt_accuracy"] = accuracy
            row["prompt_accuracy_std"] = proportion_standard_error(accuracy, len(images))
        return row

    def evaluate(self, sampler: Sampler, model: str, scheduler: str, steps: int, guidance_scale: float | None,
                 measure: bool = True) -> tuple[dict, torch.Tensor]:
        if guidance_scale is None:  # the sampler's own default, so that the table shows what was used
            guidance_scale = getattr(sampler, "default_guidance_scale", None)
        images = self.generate(sampler, scheduler, steps, guidance_scale)
        row = {"model": model, "scheduler": scheduler, "steps": steps,
               "guidance_scale": guidance_scale if guidance_scale is not None else 1.0}
        row.update(self.quality(images))
        if measure:
            row.update(self.cost(sampler, scheduler, steps, guidance_scale))
        return row, images

    def cost(self, sampler: Sampler, scheduler: str, steps: int, guidance_scale: float | None) -> dict:
        n = self.cost_batch_size
        captions, labels = self.captions[:n], self.labels[:n]

        def run() -> torch.Tensor:
            return sampler(captions, labels, scheduler, steps, guidance_scale, torch.Generator().manual_seed(0))

        params = sum(p.numel() for p in sampler.unet.parameters())
        active = getattr(sampler.unet, "active_parameters", lambda: params)()
        device = next(sampler.unet.parameters()).device
        with NFECounter(sampler.unet) as counter:
            cost = measure_cost(run, counter, n, params, active, repeats=self.cost_repeats, device=device)
        return cost.as_dict()


def pareto_front(rows: list[dict], x: str = "latency_s", y: str = "fid") -> list[dict]:
    """Rows not dominated by another row that is at least as good on both axes and better on one."""
    front = []
    for r in rows:
        dominated = any(o is not r and o[x] <= r[x] and o[y] <= r[y] and (o[x] < r[x] or o[y] < r[y]) for o in rows)
        if not dominated:
            front.append(r)
    return sorted(front, key=lambda r: r[x])


COLUMNS = ["model", "scheduler", "steps", "guidance_scale", "nfe", "fid", "fid_std", "clip_score", "clip_score_std",
           "prompt_accuracy", "prompt_accuracy_std", "latency_s", "images_per_s", "peak_memory_mb", "gflops_per_image",
           "params_m", "active_params_m", "step"]


def differ_beyond_uncertainty(a: dict, b: dict, key: str = "fid", sigmas: float = 1.0) -> bool:
    """Whether rows ``a`` and ``b`` differ in ``key`` by more than ``sigmas`` times their combined
    uncertainty sqrt(std_a^2 + std_b^2) (independent estimates; ``<key>_std`` of each row)."""
    combined = math.hypot(a[f"{key}_std"], b[f"{key}_std"])
    return abs(a[key] - b[key]) > sigmas * combined


def format_uncertain(value: float, std: float) -> str:
    """``value ± std`` with the std to two significant digits and the value to the same decimal place."""
    if not std > 0 or not math.isfinite(std):
        return f"{value:.4g} ± {std:.2g}"
    decimals = max(0, 1 - math.floor(math.log10(std)))
    return f"{value:.{decimals}f} ± {std:.{decimals}f}"


def write_csv(rows: list[dict], path: Path, append: bool = False) -> None:
    """Write (or append to) a CSV of ``COLUMNS``; appending keeps an existing file's header (an older run's)."""
    path = Path(path)
    new = not (append and path.exists())
    columns = COLUMNS
    if not new:
        with open(path, newline="") as f:
            columns = next(csv.reader(f), COLUMNS)
    with open(path, "a" if append else "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerows(rows)


def _cell(row: dict, column: str) -> str:
    value, std = row.get(column, ""), row.get(f"{column}_std")
    if isinstance(value, float) and isinstance(std, float):
        return format_uncertain(value, std)
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def format_table(rows: list[dict], floor: dict | None = None) -> str:
    """A Markdown table of the rows, each quality number as ``value ± std`` (and the real-data FID floor)."""
    cols = [c for c in COLUMNS if any(c in r for r in rows) and not c.endswith("_std")]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r, c) for c in cols) + " |")
    if floor is not None:
        lines.append(f"\nreal-data floor: FID(train, held-out) = {_cell(floor, 'fid')}")
    return "\n".join(lines)


def plot_pareto(rows: list[dict], path: Path, title: str = "quality vs cost", floor: dict | None = None,
                x: str = "latency_s", y: str = "fid") -> Path:
    """FID against latency per image with +-1 std error bars, one series per (model, scheduler), the front
    drawn as a line, the real-data floor as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5), dpi=120)
    series: dict[tuple, list[dict]] = {}
    for r in rows:
        series.setdefault((r["model"], r["scheduler"]), []).append(r)
    for (model, scheduler), rs in sorted(series.items()):
        rs = sorted(rs, key=lambda r: r[x])
        marker = "s" if model == "teacher" else "o"
        ax.errorbar([r[x] for r in rs], [r[y] for r in rs], yerr=[r.get(f"{y}_std", 0.0) for r in rs], marker=marker,
                    linestyle=":", capsize=2, label=f"{model} {scheduler}")
        for r in rs:
            ax.annotate(str(r["steps"]), (r[x], r[y]), textcoords="offset points", xytext=(3, 3), fontsize=7)
    front = pareto_front(rows, x, y)
    ax.plot([r[x] for r in front], [r[y] for r in front], color="black", linewidth=1, alpha=0.5, label="Pareto front")
    if floor is not None:
        ax.axhline(floor[y], color="grey", linestyle="--", linewidth=1, label="real-data floor")
        spread = floor.get(f"{y}_std", 0.0)
        ax.axhspan(floor[y] - spread, floor[y] + spread, color="grey", alpha=0.15, linewidth=0)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("latency per image (s)" if x == "latency_s" else x)
    ax.set_ylabel(y.upper() if y == "fid" else y)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def real_data_floor(evaluator: QualityCostEvaluator) -> dict:
    """FID (and its bootstrap spread, resampled within labels) of real training digits against the held-out
    reference, drawn as the evaluator prompts them (as many of each label): the best a model can hope for."""
    from distill.data import DigitsDataModule

    dm = DigitsDataModule(resolution=evaluator.resolution)
    dm.setup()
    labels = dm.train_set.labels
    idx = draw_like(labels, evaluator.labels, torch.Generator().manual_seed(0))
    return evaluator.fid_with_spread(dm.train_set.images[idx], labels[idx])


def draw_like(labels: torch.Tensor, wanted: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Indices into ``labels`` (M,) of a random draw without replacement holding as many of each label as
    ``wanted`` (N,) does."""
    values, counts = wanted.unique(return_counts=True)
    pools = [torch.nonzero(labels == v).flatten() for v in values]
    return torch.cat([p[torch.randperm(len(p), generator=generator)[:int(n)]] for p, n in zip(pools, counts)])


def heldout_reference(resolution: int = 32) -> tuple[torch.Tensor, str]:
    from distill.data import DigitsDataModule

    dm = DigitsDataModule(resolution=resolution)
    dm.setup()
    return dm.heldout_set.images, f"digits-heldout-r{resolution}-s{dm.split_seed}"


def build_evaluator(feature: str = "digits", clip: str | None = None, classifier: str | None = None,
                    num_per_class: int = 50, seed: int = 0, resolution: int = 32,
                    cost_repeats: int = 3, fid_bootstrap: int = 50) -> tuple[QualityCostEvaluator, dict, str]:
    """The evaluator of the protocol (FID against the held-out digits, optional CLIP score and prompt
    accuracy from model folders), the real-data floor (``fid``, ``fid_std``) and the reference key."""
    from transformers import CLIPModel, CLIPTokenizer

    from distill.metrics.fid import FID
    from distill.models.classifier import DigitClassifier

    reference, key = heldout_reference(resolution)
    fid = FID(feature, input_shape=tuple(reference.shape[1:]))
    fid.set_reference(reference, key)
    clip_model = CLIPModel.from_pretrained(clip).eval() if clip else None
    clip_tokenizer = CLIPTokenizer.from_pretrained(clip) if clip else None
    digit_classifier = DigitClassifier.from_pretrained(classifier).eval() if classifier else None
    evaluator = QualityCostEvaluator(fid, clip_model, clip_tokenizer, digit_classifier, num_per_class, seed,
                                     cost_repeats=cost_repeats, resolution=resolution, fid_bootstrap=fid_bootstrap)
    return evaluator, real_data_floor(evaluator), key
