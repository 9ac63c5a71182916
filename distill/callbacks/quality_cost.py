"""Quality-cost evaluation during training: every registered metric (FID, KID, CLIP score, prompt accuracy)
and the cost of the student for each (scheduler, steps) pair on an evaluation set, the teacher's rows once, a
table and a Pareto plot for every logger."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch


def trained_parameter(module: torch.nn.Module) -> torch.nn.Parameter:
    """The first floating-point parameter that requires grad (a LoRA adapter, not the frozen base weight
    before it), else the first parameter: the device and dtype the module is trained in."""
    parameters = list(module.parameters())
    return next((p for p in parameters if p.requires_grad and p.is_floating_point()), parameters[0])


class MethodSampler:
    """A training method's ``generate`` (the student as it is now, before any export)."""

    def __init__(self, method):
        self.method, self.denoiser = method, method.student
        self.accelerator = None  # a training-free sampling accelerator (distill.accelerate) on the student
        # the guidance the student's intended call really uses (1 for a LoRA student that distilled it)
        defaults = method.call_defaults() if hasattr(method, "call_defaults") else {}
        self.default_guidance_scale = defaults.get("default_guidance_scale", method.sampling.get("guidance_scale"))

    @torch.no_grad()
    def __call__(self, captions, labels, scheduler, steps, guidance_scale, generator):
        from distill.accelerate import accelerated_denoiser

        batch = {"caption": list(captions), "label": labels}
        pipe = self.method.pipeline(scheduler) if self.accelerator is not None else None  # its scheduler and VAE
        with accelerated_denoiser(self.denoiser, self.accelerator, steps, scheduler, guidance_scale, pipe,
                                  labels=labels, prompts=list(captions)):
            return self.method.generate(batch, generator, num_inference_steps=steps, guidance_scale=guidance_scale,
                                        scheduler=scheduler)


class QualityCostCallback(L.Callback):
    """Every ``every_n_steps`` training steps and at the end of training.

    ``eval_set`` (``distill.metrics.eval_set.EvalSet``, the config group ``eval``) gives the prompts, the
    reference and the measuring networks; ``num_per_class`` samples of each prompt are drawn. ``accelerators``
    (presets of ``conf/accelerate``, e.g. ``[none,deepcache]``) sweep training-free sampling accelerators on the
    student and the teacher like schedulers, a row each (model ``student+<preset>``). ``steps=None``
    evaluates the method's own current step count (``pl_module.student_steps``, e.g. the round of progressive
    distillation); the Pareto plot then shows every evaluation so far. The teacher runs on the student's device
    in the student's dtype, so that its rows and the student's compare models, not devices.
    """

    def __init__(
        self,
        eval_set,
        every_n_steps: int = 1000,
        schedulers: tuple[str, ...] = ("ddim",),
        steps: tuple[int, ...] | None = (1, 2, 4),
        guidance_scale: float | None = None,
        teacher: str | None = None,
        teacher_schedulers: tuple[str, ...] = ("ddim",),
        teacher_steps: tuple[int, ...] = (1, 2, 4, 50),
        teacher_guidance_scale: float | None = None,
        num_per_class: int = 20,
        seed: int = 0,
        measure_cost: bool = True,
        grid_seeds: int = 4,
        accelerators: tuple[str, ...] = ("none",),
    ):
        from distill.accelerate import check_schedulers, preset

        for name in accelerators:  # a bad preset (or chain), or one a swept scheduler cannot take, fails here
            check_schedulers(preset(name), [*schedulers, *teacher_schedulers])
        self.eval_set = eval_set
        self.every_n_steps, self.schedulers = every_n_steps, list(schedulers)
        self.steps = list(steps) if steps is not None else None
        self.guidance_scale = guidance_scale
        self.teacher, self.teacher_schedulers, self.teacher_steps = teacher, list(teacher_schedulers), list(teacher_steps)
        self.teacher_guidance_scale = teacher_guidance_scale
        self.num_per_class, self.seed, self.measure_cost = num_per_class, seed, measure_cost
        self.grid_seeds = min(grid_seeds, num_per_class)
        self.accelerators = list(accelerators)
        self.teacher_rows: list[dict] = []
        self.history: list[dict] = []
        self._evaluator = None
        self._floor: dict | None = None
        self._last_step = -1

    # ------------------------------------------------------------------ setup

    def _build(self):
        from distill.metrics.quality_cost import build_evaluator

        self._evaluator, self._floor, _ = build_evaluator(self.eval_set, self.num_per_class, self.seed)

    def _teacher_sampler(self, pl_module):
        """The teacher pipeline on the device and in the dtype of ``pl_module``'s student."""
        from distill.inference.loading import load_pipeline, pipeline_defaults
        from distill.metrics.quality_cost import PipelineSampler

        student = trained_parameter(pl_module.student)
        sampler = PipelineSampler(load_pipeline(self.teacher).to(device=student.device, dtype=student.dtype),
                                  own=pipeline_defaults(self.teacher).get("name"))
        sampler.size = teacher_sample_size(sampler.size, pl_module)
        return sampler

    def _teacher_rows(self, pl_module) -> list[dict]:
        """The teacher's rows, computed once (they are kept in the checkpoint); the teacher is released after."""
        if self.teacher is None or self.teacher_rows:
            return self.teacher_rows
        from distill.inference.loading import call_defaults, pipeline_defaults

        sampler = self._teacher_sampler(pl_module)
        device = sampler.denoiser.device
        guidance = self.teacher_guidance_scale
        if guidance is None:
            # the teacher's intended call (distill.json), else its pipeline class's (StableDiffusionPipeline: 7.5)
            guidance = pipeline_defaults(self.teacher).get("guidance_scale", call_defaults(sampler.pipe)[1])
        plan = [(name, steps) for name in self.teacher_schedulers for steps in self.teacher_steps]
        self.teacher_rows = self._sweep(
            sampler, "teacher", plan, guidance, lambda row: f"{row['model']}-{row['scheduler']}-{row['steps']}.png",
            pipeline=self.teacher)
        del sampler
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return self.teacher_rows

    def _sweep(self, sampler, model: str, plan: list, guidance, grid_name, pipeline: str | None = None) -> list[dict]:
        """The evaluator's sweep of ``plan`` once per accelerator preset (plain first)."""
        from distill.accelerate import preset

        rows = []
        for name in self.accelerators:
            sampler.accelerator = preset(name, path=pipeline)
            label = model if name == "none" else f"{model}+{name}"
            rows += [dict(row, accelerate=name) for row in self._evaluator.sweep(
                sampler, label, plan, guidance, self.measure_cost,
                on_row=lambda row, images: self._save_grid(self._trainer, images, grid_name(row)))]
        sampler.accelerator = None
        return rows

    def _save_grid(self, trainer, images: torch.Tensor, name: str) -> None:
        """Rows = the evaluation set's first prompts, columns = seeds, in the run's samples/ folder."""
        if self.grid_seeds < 1:
            return
        from distill.metrics.report import save_grid

        save_grid(self._evaluator.grid(images, self.grid_seeds), Path(trainer.default_root_dir) / "samples" / name,
                  self.grid_seeds, self._evaluator.grid_prompts())

    # ------------------------------------------------------------------ hooks

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.every_n_steps > 0 and trainer.global_step % self.every_n_steps == 0 and trainer.global_step > 0:
            self.run(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self.run(trainer, pl_module)

    @torch.no_grad()
    def run(self, trainer, pl_module) -> list[dict]:
        from distill.utils.sharding import gathered, strategy_of

        sharded = strategy_of(trainer) is not None  # every rank takes part in gathering the weights
        if ((not trainer.is_global_zero and not sharded) or trainer.global_step == self._last_step
                or trainer.sanity_checking or trainer.fast_dev_run):  # a smoke run skips evaluation, as Lightning skips logging
            return []
        from distill.callbacks.ema import EMA

        self._last_step = trainer.global_step
        self._trainer = trainer
        # Judge the EMA weights when an EMA is kept (they are what gets exported).
        ema = next((c for c in trainer.callbacks if isinstance(c, EMA) and c.ema is not None), None)
        swap = ema is not None and ema.swapped_out
        if swap:
            ema.swap_in(pl_module)
        try:
            with gathered(trainer, pl_module):
                return self._evaluate(trainer, pl_module) if trainer.is_global_zero else []
        finally:
            if swap:
                ema.swap_out(pl_module)

    def _evaluate(self, trainer, pl_module) -> list[dict]:
        from distill.metrics.report import plot_pareto, write_csv

        if self._evaluator is None:
            self._build()
        teacher_rows = self._teacher_rows(pl_module)
        sampler = MethodSampler(pl_module)
        step = trainer.global_step
        plan = [(name, steps) for name in self.schedulers
                for steps in (self.steps if self.steps is not None else [pl_module.student_steps])]
        rows = self._sweep(sampler, "student", plan, self.guidance_scale,
                           lambda row: f"{row['model']}-{row['scheduler']}-{row['steps']}_step_{step:07d}.png")
        for row in rows:
            row["step"] = step
        self.history.extend(rows)
        run_dir = Path(trainer.default_root_dir)
        csv_path = run_dir / "quality_cost.csv"
        first = not csv_path.exists()
        write_csv(([dict(r, step=step) for r in teacher_rows] if first else []) + rows, csv_path, append=True)
        shown = rows if self.steps is not None else [r for r in self.history]
        plot = plot_pareto(teacher_rows + shown, run_dir / "plots" / f"pareto_step_{step:07d}.png",
                           title=f"step {step}: FID vs latency", floor=self._floor)
        self._log(trainer, rows, teacher_rows, plot)
        return rows

    def _log(self, trainer, rows: list[dict], teacher_rows: list[dict], plot: Path) -> None:
        from PIL import Image

        from distill.metrics.report import columns, format_table, quality_columns

        metrics = {}
        for r in rows:
            tag = f"{r['scheduler']}-{r['steps']}" + (f"+{r['accelerate']}" if r.get("accelerate", "none") != "none" else "")
            for key in quality_columns() + ["latency_s"]:
                if key in r:
                    metrics[f"val/{key}@{tag}"] = r[key]
        for key, value in (self._floor or {}).items():  # val/fid_floor, val/fid_floor_std, val/kid_floor, ...
            if not isinstance(value, int | float):  # the paired replicates and their protocol key: for tables
                continue
            name, std = (key[:-4], "_std") if key.endswith("_std") else (key, "")
            metrics[f"val/{name}_floor{std}"] = value
        table = format_table(teacher_rows + rows, self._floor)
        image = Image.open(plot).convert("RGB")
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
            if hasattr(logger, "log_table"):  # wandb: the table, its FID-latency scatter chart, the Pareto plot
                import wandb

                cols = [c for c in columns() if any(c in r for r in rows)]
                data = wandb.Table(columns=cols, data=[[r.get(c) for c in cols] for r in teacher_rows + rows])
                chart = {"quality_cost_scatter": wandb.plot.scatter(data, "latency_s", "fid", title="FID vs latency")
                         } if {"latency_s", "fid"} <= set(cols) else {}
                logger.log_metrics({"quality_cost": data, **chart}, step=trainer.global_step)
                logger.log_image("pareto", images=[image], step=trainer.global_step)
            elif hasattr(logger, "experiment") and hasattr(logger.experiment, "add_text"):  # TensorBoard
                import numpy as np

                logger.experiment.add_text("quality_cost", table, trainer.global_step)
                logger.experiment.add_image("pareto", np.asarray(image), trainer.global_step, dataformats="HWC")

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        return {"teacher_rows": self.teacher_rows, "history": self.history}

    def load_state_dict(self, state: dict) -> None:
        self.teacher_rows, self.history = list(state["teacher_rows"]), list(state["history"])


def teacher_sample_size(teacher_size: int, pl_module) -> int:
    """The side, in pixels, the teacher's rows sample at: the student's where its family shifts the schedule by
    resolution (Flux: ``pl_module.latent_size`` set, the student's pipeline sampling at the training size and its mu),
    so that the teacher is compared at the student's size and token count; else the teacher's own native size."""
    if getattr(pl_module, "latent_size", None) is None:
        return teacher_size
    from distill.families import native_size

    return native_size(pl_module.pipeline())
