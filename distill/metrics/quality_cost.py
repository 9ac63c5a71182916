"""Quality-cost sweep: for each (scheduler, steps) generate a fixed prompt/seed set, measure FID, CLIP
score, prompt accuracy and cost, and keep the Pareto front (lower FID at lower latency)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Protocol

import torch

from distill.data.digits import caption_for
from distill.metrics.cost import NFECounter, measure_cost


class Sampler(Protocol):
    """Anything that turns captions into images in [-1, 1] with a named scheduler and step count."""

    unet: torch.nn.Module

    def __call__(self, captions: list[str], labels: torch.Tensor, scheduler: str, steps: int,
                 guidance_scale: float | None, generator: torch.Generator) -> torch.Tensor: ...


class PipelineSampler:
    """A diffusers text-to-image pipeline (StableDiffusionPipeline layout)."""

    def __init__(self, pipe):
        from distill.inference.schedulers import make_scheduler

        self.pipe, self.unet = pipe, pipe.unet
        self.base_config = pipe.scheduler.config
        self._make = make_scheduler
        pipe.set_progress_bar_config(disable=True)
        self.size = pipe.unet.config.sample_size * pipe.vae_scale_factor

    @torch.no_grad()
    def __call__(self, captions, labels, scheduler, steps, guidance_scale, generator):
        self.pipe.scheduler = self._make(scheduler, self.base_config)
        out = self.pipe(list(captions), num_inference_steps=steps, guidance_scale=guidance_scale or 1.0,
                        height=self.size, width=self.size, generator=generator, output_type="pt").images
        return out * 2.0 - 1.0


class MethodSampler:
    """A training method's ``generate`` (the student as it is now, before any export)."""

    def __init__(self, method):
        self.method, self.unet = method, method.student
        self.default_guidance_scale = method.sampling.get("guidance_scale")

    @torch.no_grad()
    def __call__(self, captions, labels, scheduler, steps, guidance_scale, generator):
        batch = {"caption": list(captions), "label": labels}
        return self.method.generate(batch, generator, num_inference_steps=steps, guidance_scale=guidance_scale,
                                    scheduler=scheduler)


def digit_prompts(num_per_class: int) -> tuple[list[str], torch.Tensor]:
    labels = torch.arange(10).repeat(num_per_class)  # interleaved: every batch prefix covers all digits
    return [caption_for(int(i)) for i in labels], labels


class QualityCostEvaluator:
    """Fixed prompts and seeds; FID against a reference set; CLIP score; classifier prompt accuracy; cost."""

    def __init__(self, fid, clip_model=None, clip_tokenizer=None, classifier=None, num_per_class: int = 50,
                 seed: int = 0, batch_size: int = 250, cost_batch_size: int = 10, cost_repeats: int = 3,
                 resolution: int = 32):
        self.fid, self.clip_model, self.clip_tokenizer, self.classifier = fid, clip_model, clip_tokenizer, classifier
        self.resolution = resolution
        self.captions, self.labels = digit_prompts(num_per_class)
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
    def quality(self, images: torch.Tensor) -> dict:
        from distill.metrics.clip_score import clip_score

        if images.shape[-1] != self.resolution:  # judge every model at the reference resolution
            images = torch.nn.functional.interpolate(images, size=(self.resolution, self.resolution), mode="bilinear",
                                                     align_corners=False, antialias=True)
        row = {"fid": self.fid(images)}
        if self.clip_model is not None:
            scores = torch.cat([clip_score(self.clip_model, self.clip_tokenizer, images[i:i + 500], self.captions[i:i + 500])
                                for i in range(0, len(images), 500)])
            row["clip_score"] = scores.mean().item()
        if self.classifier is not None:
            from distill.metrics.digit_accuracy import prompted_digit_accuracy

            row["prompt_accuracy"] = prompted_digit_accuracy(images, self.labels, self.classifier)
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


COLUMNS = ["model", "scheduler", "steps", "guidance_scale", "nfe", "fid", "clip_score", "prompt_accuracy",
           "latency_s", "images_per_s", "peak_memory_mb", "gflops_per_image", "params_m", "active_params_m", "step"]


def write_csv(rows: list[dict], path: Path, append: bool = False) -> None:
    path = Path(path)
    new = not (append and path.exists())
    with open(path, "a" if append else "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerows(rows)


def format_table(rows: list[dict], floor: float | None = None) -> str:
    """A Markdown table of the rows (and the real-data FID floor)."""
    cols = [c for c in COLUMNS if any(c in r for r in rows)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            cells.append(f"{v:.4g}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    if floor is not None:
        lines.append(f"\nreal-data floor: FID(train, held-out) = {floor:.4g}")
    return "\n".join(lines)


def plot_pareto(rows: list[dict], path: Path, title: str = "quality vs cost", floor: float | None = None,
                x: str = "latency_s", y: str = "fid") -> Path:
    """FID against latency per image, one series per (model, scheduler), the front drawn as a line."""
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
        ax.plot([r[x] for r in rs], [r[y] for r in rs], marker=marker, linestyle=":", label=f"{model} {scheduler}")
        for r in rs:
            ax.annotate(str(r["steps"]), (r[x], r[y]), textcoords="offset points", xytext=(3, 3), fontsize=7)
    front = pareto_front(rows, x, y)
    ax.plot([r[x] for r in front], [r[y] for r in front], color="black", linewidth=1, alpha=0.5, label="Pareto front")
    if floor is not None:
        ax.axhline(floor, color="grey", linestyle="--", linewidth=1, label="real-data floor")
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


def real_data_floor(fid, num_samples: int, resolution: int = 32) -> float:
    """FID of real training digits against the held-out reference: the best a model can hope for."""
    from distill.data import DigitsDataModule

    dm = DigitsDataModule(resolution=resolution)
    dm.setup()
    g = torch.Generator().manual_seed(0)
    idx = torch.randperm(len(dm.train_set), generator=g)[:num_samples]
    return fid(dm.train_set.images[idx])


def heldout_reference(resolution: int = 32) -> tuple[torch.Tensor, str]:
    from distill.data import DigitsDataModule

    dm = DigitsDataModule(resolution=resolution)
    dm.setup()
    return dm.heldout_set.images, f"digits-heldout-r{resolution}-s{dm.split_seed}"




def build_evaluator(feature: str = "digits", clip: str | None = None, classifier: str | None = None,
                    num_per_class: int = 50, seed: int = 0, resolution: int = 32,
                    cost_repeats: int = 3) -> tuple[QualityCostEvaluator, float, str]:
    """The evaluator of the protocol (FID against the held-out digits, optional CLIP score and prompt
    accuracy from model folders), the real-data floor and the reference key."""
    from transformers import CLIPModel, CLIPTokenizer

    from distill.metrics.fid import FID
    from distill.models.classifier import DigitClassifier

    fid = FID(feature)
    reference, key = heldout_reference(resolution)
    fid.set_reference(reference, key)
    clip_model = CLIPModel.from_pretrained(clip).eval() if clip else None
    clip_tokenizer = CLIPTokenizer.from_pretrained(clip) if clip else None
    digit_classifier = DigitClassifier.from_pretrained(classifier).eval() if classifier else None
    evaluator = QualityCostEvaluator(fid, clip_model, clip_tokenizer, digit_classifier, num_per_class, seed,
                                     cost_repeats=cost_repeats, resolution=resolution)
    return evaluator, real_data_floor(fid, len(evaluator.captions), resolution), key
