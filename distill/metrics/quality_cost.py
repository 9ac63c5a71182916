"""Quality-cost sweep: for each (scheduler, steps) generate a fixed prompt/seed set from an evaluation set,
measure every registered quality metric (each with its uncertainty, ``<name>_std``) and the cost, and keep
the Pareto front (lower FID at lower latency)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from distill.families import denoiser_of, native_size
from distill.inference.schedulers import scheduler_options
from distill.metrics.bootstrap import protocol_key
from distill.metrics.cost import NFECounter, measure_cost
from distill.metrics.registry import Samples, build_metrics
from distill.utils.seeding import global_rng_seeded_by


class Sampler(Protocol):
    """Anything that turns captions into images in [-1, 1] with a named scheduler and step count; its
    ``denoiser`` is the network the cost meter counts."""

    denoiser: torch.nn.Module

    def __call__(self, captions: list[str], labels: torch.Tensor, scheduler: str, steps: int,
                 guidance_scale: float | None, generator: torch.Generator) -> torch.Tensor: ...


class PipelineSampler:
    """A diffusers text-to-image pipeline (StableDiffusionPipeline layout). Each scheduler of a sweep is
    built from the pipeline's own scheduler config with that scheduler's options: ``options[name]``, else
    those of the package's ``conf/scheduler/<name>.yaml``. ``own`` names the scheduler the pipeline was
    exported with (its ``distill.json``): that name keeps the pipeline's own scheduler class and config, e.g.
    a progressive student's ``GridDDIMScheduler`` for "ddim" (diffusers' DDIM would leave its training grid)."""

    def __init__(self, pipe, options: dict[str, dict] | None = None, own: str | None = None,
                 null_prompts: bool = False):
        self.pipe, self.denoiser = pipe, denoiser_of(pipe)
        self.null_prompts = null_prompts  # sample from the empty prompt (labels kept: a guide alone steers)
        self.base_config = pipe.scheduler.config
        self.own_class, self.own = type(pipe.scheduler), own
        self.options = dict(options or {})
        pipe.set_progress_bar_config(disable=True)
        self.size = native_size(pipe)
        self.accelerator = None  # a training-free sampling accelerator (distill.accelerate), None: plain

    def scheduler(self, name: str):
        from distill.inference.schedulers import make_scheduler

        if name == self.own:
            return self.own_class.from_config(self.base_config)
        options = self.options[name] if name in self.options else scheduler_options(name)
        return make_scheduler(name, self.base_config, **options)

    @torch.no_grad()
    def __call__(self, captions, labels, scheduler, steps, guidance_scale, generator):
        from distill.accelerate import accelerated

        self.pipe.scheduler = self.scheduler(scheduler)
        prompts = [""] * len(captions) if self.null_prompts else list(captions)
        with accelerated(self.pipe, self.accelerator, scheduler_name=scheduler, guidance_scale=guidance_scale or 1.0,
                         labels=labels, prompts=list(captions)) as context:
            step = {} if context is None else {"callback_on_step_end": context.step_end}
            out = self.pipe(prompts, num_inference_steps=steps, guidance_scale=guidance_scale or 1.0,
                            height=self.size, width=self.size, generator=generator, output_type="pt", **step).images
        return out * 2.0 - 1.0


def prompt_strata(captions: list[str], labels: torch.Tensor | None) -> torch.Tensor:
    """Each sample's stratum for the FID bootstrap (N,): its label, else the index of its prompt among the
    distinct prompts (the protocol draws a fixed number per prompt)."""
    if labels is not None:
        return labels
    index: dict[str, int] = {}
    return torch.tensor([index.setdefault(c, len(index)) for c in captions])


class QualityCostEvaluator:
    """Fixed prompts and seeds from an evaluation set; its metrics (FID, KID, CLIP score, prompt accuracy, any
    other registered one its inputs allow); cost.

    ``num_per_class`` samples of each prompt, interleaved (every batch prefix covers all prompts), generated
    in batches of ``batch_size`` with seeds ``seed + batch index``. Every quality number comes with
    ``<name>_std``, the standard deviation of its estimate (see each metric in ``distill.metrics.registry``).
    """

    def __init__(self, eval_set, num_per_class: int = 50, seed: int = 0, batch_size: int = 250,
                 cost_batch_size: int = 10, cost_repeats: int = 3):
        if num_per_class < 1:
            raise ValueError(f"num_per_class={num_per_class} must be >= 1 (samples of each prompt)")
        self.eval_set, self.resolution = eval_set, eval_set.resolution
        self.prompts, prompt_labels = eval_set.prompts()
        self.captions = [p for _ in range(num_per_class) for p in self.prompts]
        self.labels = prompt_labels.repeat(num_per_class) if prompt_labels is not None else None
        self.strata = prompt_strata(self.captions, self.labels)
        self.metrics = build_metrics(eval_set, seed)
        self.seed, self.batch_size = seed, batch_size
        self.cost_batch_size, self.cost_repeats = cost_batch_size, cost_repeats

    @property
    def num_batches(self) -> int:
        return -(-len(self.captions) // self.batch_size)

    def _batch_labels(self, start: int, stop: int) -> torch.Tensor:
        if self.labels is None:  # unlabelled prompts: a class-conditional model samples its null class
            return torch.full((len(self.captions[start:stop]),), -1, dtype=torch.long)
        return self.labels[start:stop]

    @torch.no_grad()
    def generate(self, sampler: Sampler, scheduler: str, steps: int, guidance_scale: float | None,
                 on_batch: Callable[[], None] | None = None) -> torch.Tensor:
        images = []
        for i, start in enumerate(range(0, len(self.captions), self.batch_size)):
            generator = torch.Generator().manual_seed(self.seed + i)
            stop = start + self.batch_size
            with global_rng_seeded_by(generator):  # the re-noising of a multi-step flow_lcm student too
                images.append(sampler(self.captions[start:stop], self._batch_labels(start, stop), scheduler, steps,
                                      guidance_scale, generator).float().cpu())
            if on_batch is not None:
                on_batch()
        return torch.cat(images)

    def _resized(self, images: torch.Tensor) -> torch.Tensor:
        if images.shape[-1] == self.resolution:
            return images
        return torch.nn.functional.interpolate(images, size=(self.resolution, self.resolution), mode="bilinear",
                                               align_corners=False, antialias=True)

    @torch.no_grad()
    def measure(self, samples: Samples, real_data: bool = False) -> dict:
        """``{name: value, name_std: std, name_replicates: [...]}`` of every metric (``real_data``: those measured
        on real images); the replicates are paired across the rows of this evaluator (same prompts and seeds)."""
        row = {"replicate_key": protocol_key(samples.strata, self.seed)}
        for metric in self.metrics:
            if real_data and not metric.real_data:
                continue
            estimate = metric(samples)
            row[metric.name], row[f"{metric.name}_std"] = estimate.value, estimate.std
            if estimate.replicates is not None:
                row[f"{metric.name}_replicates"] = estimate.replicates.tolist()
        return row

    @torch.no_grad()
    def quality(self, images: torch.Tensor) -> dict:
        """Every metric of ``images`` generated from the evaluator's prompts, judged at the reference resolution."""
        return self.measure(Samples(self._resized(images), self.captions, self.labels, self.strata))

    def evaluate(self, sampler: Sampler, model: str, scheduler: str, steps: int, guidance_scale: float | None,
                 measure: bool = True, on_batch: Callable[[], None] | None = None) -> tuple[dict, torch.Tensor]:
        if guidance_scale is None:  # the sampler's own default, so that the table shows what was used
            guidance_scale = getattr(sampler, "default_guidance_scale", None)
        images = self.generate(sampler, scheduler, steps, guidance_scale, on_batch)
        row = {"model": model, "scheduler": scheduler, "steps": steps,
               "guidance_scale": guidance_scale if guidance_scale is not None else 1.0}
        row.update(self.quality(images))
        if measure:
            row.update(self.cost(sampler, scheduler, steps, guidance_scale))
        return row, images

    def sweep(self, sampler: Sampler, model: str, plan: Iterable[tuple[str, int]], guidance_scale: float | None,
              measure: bool = True, on_row: Callable[[dict, torch.Tensor], None] | None = None) -> list[dict]:
        """One row per (scheduler, steps) of ``plan``, with a progress bar over the generated batches;
        ``on_row(row, images)`` after each (printing, saving grids)."""
        from tqdm.auto import tqdm

        plan = list(plan)
        rows = []
        with tqdm(total=len(plan) * self.num_batches, desc=f"quality-cost {model}", unit="batch",
                  dynamic_ncols=True) as bar:
            for scheduler, steps in plan:
                bar.set_postfix_str(f"{scheduler} steps={steps}")
                row, images = self.evaluate(sampler, model, scheduler, int(steps), guidance_scale, measure,
                                            on_batch=lambda: bar.update(1))
                rows.append(row)
                if on_row is not None:
                    on_row(row, images)
        return rows

    def cost(self, sampler: Sampler, scheduler: str, steps: int, guidance_scale: float | None) -> dict:
        n = min(self.cost_batch_size, len(self.captions))  # the images generated: NFE and latency are per image
        captions, labels = self.captions[:n], self._batch_labels(0, n)

        def run() -> torch.Tensor:
            return sampler(captions, labels, scheduler, steps, guidance_scale, torch.Generator().manual_seed(0))

        params = sum(p.numel() for p in sampler.denoiser.parameters())
        active = getattr(sampler.denoiser, "active_parameters", lambda: params)()
        device = next(sampler.denoiser.parameters()).device
        with NFECounter(sampler.denoiser) as counter:
            cost = measure_cost(run, counter, n, params, active, repeats=self.cost_repeats, device=device)
        return cost.as_dict()

    def grid(self, images: torch.Tensor, seeds: int, max_rows: int = 10) -> torch.Tensor:
        """Interleaved samples (p0, p1, ..., p0, p1, ...) reordered into rows of one prompt each, ``seeds``
        columns, the first ``max_rows`` prompts: (rows * seeds, C, H, W)."""
        num_prompts, seeds = len(self.prompts), min(seeds, len(self.captions) // len(self.prompts))
        return images[[j * num_prompts + p for p in range(min(max_rows, num_prompts)) for j in range(seeds)]]

    def grid_prompts(self, max_rows: int = 10) -> list[str]:
        """The prompt of each row of ``grid``."""
        return self.prompts[:max_rows]


def real_data_floor(evaluator: QualityCostEvaluator) -> dict | None:
    """The real-data metrics (FID, KID and their spreads) of real training images against the reference,
    drawn as the evaluator prompts them (as many of each label, resampled within labels): the best a model can
    hope for. None when the evaluation set has no data module."""
    real = evaluator.eval_set.real_images(evaluator.labels, len(evaluator.captions))
    if real is None:
        return None
    images, labels = real
    strata = labels if labels is not None else torch.zeros(len(images), dtype=torch.long)
    return evaluator.measure(Samples(images, [""] * len(images), labels, strata), real_data=True)


def build_evaluator(eval_set, num_per_class: int = 50, seed: int = 0,
                    cost_repeats: int = 3) -> tuple[QualityCostEvaluator, dict | None, str]:
    """The evaluator of ``eval_set`` (reference statistics loaded), its real-data floor and the reference key."""
    evaluator = QualityCostEvaluator(eval_set, num_per_class, seed, cost_repeats=cost_repeats)
    eval_set.fid()  # the reference, before any sampling: a bad reference fails here
    return evaluator, real_data_floor(evaluator), eval_set.reference_key
