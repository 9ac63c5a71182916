"""Quality-cost evaluation during training: FID / CLIP / prompt accuracy / cost of the student for each
(scheduler, steps) pair, the teacher's rows once, a table and a Pareto plot for every logger."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch


def trained_parameter(module: torch.nn.Module) -> torch.nn.Parameter:
    """The first floating-point parameter that requires grad (a LoRA adapter, not the frozen base weight
    before it), else the first parameter: the device and dtype the module is trained in."""
    parameters = list(module.parameters())
    return next((p for p in parameters if p.requires_grad and p.is_floating_point()), parameters[0])


class QualityCostCallback(L.Callback):
    """Every ``every_n_steps`` training steps and at the end of training.

    ``nfe=None`` evaluates the method's own current step count (``pl_module.student_steps``, e.g. the
    round of progressive distillation); the Pareto plot then shows every evaluation so far. The teacher
    runs on the student's device in the student's dtype, so that its rows and the student's compare models,
    not devices. ``fid_bootstrap`` resamples give each FID its spread (``fid_std``).
    """

    def __init__(
        self,
        every_n_steps: int = 1000,
        schedulers: tuple[str, ...] = ("ddim",),
        nfe: tuple[int, ...] | None = (1, 2, 4),
        guidance_scale: float | None = None,
        teacher: str | None = None,
        teacher_schedulers: tuple[str, ...] = ("ddim",),
        teacher_nfe: tuple[int, ...] = (1, 2, 4, 50),
        teacher_guidance_scale: float | None = None,
        num_per_class: int = 20,
        seed: int = 0,
        feature: str = "digits",
        clip: str | None = None,
        classifier: str | None = None,
        resolution: int = 32,
        measure_cost: bool = True,
        grid_seeds: int = 4,
        fid_bootstrap: int = 50,
    ):
        self.every_n_steps, self.schedulers = every_n_steps, list(schedulers)
        self.nfe = list(nfe) if nfe is not None else None
        self.guidance_scale = guidance_scale
        self.teacher, self.teacher_schedulers, self.teacher_nfe = teacher, list(teacher_schedulers), list(teacher_nfe)
        self.teacher_guidance_scale = teacher_guidance_scale
        self.num_per_class, self.seed, self.feature = num_per_class, seed, feature
        self.clip, self.classifier, self.resolution, self.measure_cost = clip, classifier, resolution, measure_cost
        self.grid_seeds = min(grid_seeds, num_per_class)
        self.fid_bootstrap = fid_bootstrap
        self.teacher_rows: list[dict] = []
        self.history: list[dict] = []
        self._evaluator = None
        self._floor: dict | None = None
        self._last_step = -1

    # ------------------------------------------------------------------ setup

    def _build(self):
        from distill.metrics.quality_cost import build_evaluator

        self._evaluator, self._floor, _ = build_evaluator(self.feature, self.clip, self.classifier,
                                                          self.num_per_class, self.seed, self.resolution,
                                                          fid_bootstrap=self.fid_bootstrap)

    def _teacher_sampler(self, pl_module):
        """The teacher pipeline on the device and in the dtype of ``pl_module``'s student."""
        from distill.metrics.quality_cost import PipelineSampler
        from distill.sample import load_pipeline, pipeline_defaults

        student = trained_parameter(pl_module.student)
        return PipelineSampler(load_pipeline(self.teacher).to(device=student.device, dtype=student.dtype),
                               own=pipeline_defaults(self.teacher).get("name"))

    def _teacher_rows(self, pl_module) -> list[dict]:
        """The teacher's rows, computed once (they are kept in the checkpoint); the teacher is released after."""
        if self.teacher is None or self.teacher_rows:
            return self.teacher_rows
        from distill.sample import pipeline_defaults

        sampler = self._teacher_sampler(pl_module)
        device = sampler.unet.device
        guidance = self.teacher_guidance_scale
        if guidance is None:
            guidance = pipeline_defaults(self.teacher).get("guidance_scale", 1.0)
        for name in self.teacher_schedulers:
            for steps in self.teacher_nfe:
                row, images = self._evaluator.evaluate(sampler, "teacher", name, steps, guidance, self.measure_cost)
                self.teacher_rows.append(row)
                self._save_grid(self._trainer, images, f"teacher-{name}-{steps}.png")
        del sampler
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return self.teacher_rows

    def _save_grid(self, trainer, images: torch.Tensor, name: str) -> None:
        """Rows = digits 0-9, columns = seeds, in the run's samples/ folder."""
        if self.grid_seeds < 1:
            return
        from distill.evaluate import digit_rows_grid
        from distill.utils.images import image_grid, upscale

        out = Path(trainer.default_root_dir) / "samples"
        out.mkdir(parents=True, exist_ok=True)
        upscale(image_grid(digit_rows_grid(images, self.grid_seeds), nrow=self.grid_seeds), 3).save(out / name)

    # ------------------------------------------------------------------ hooks

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.every_n_steps > 0 and trainer.global_step % self.every_n_steps == 0 and trainer.global_step > 0:
            self.run(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self.run(trainer, pl_module)

    @torch.no_grad()
    def run(self, trainer, pl_module) -> list[dict]:
        if (not trainer.is_global_zero or trainer.global_step == self._last_step or trainer.sanity_checking
                or trainer.fast_dev_run):  # a smoke run skips evaluation, as Lightning skips logging
            return []
        from distill.callbacks.ema import EMA
        from distill.metrics.quality_cost import MethodSampler, plot_pareto, write_csv

        self._last_step = trainer.global_step
        self._trainer = trainer
        if self._evaluator is None:
            self._build()
        teacher_rows = self._teacher_rows(pl_module)
        sampler = MethodSampler(pl_module)
        # Judge the EMA weights when an EMA is kept (they are what gets exported).
        ema = next((c for c in trainer.callbacks if isinstance(c, EMA) and c.ema is not None), None)
        swap = ema is not None and ema.swapped_out
        if swap:
            ema.swap_in(pl_module)
        rows = []
        try:
            for name in self.schedulers:
                for steps in self.nfe if self.nfe is not None else [pl_module.student_steps]:
                    row, images = self._evaluator.evaluate(sampler, "student", name, steps, self.guidance_scale,
                                                           self.measure_cost)
                    row["step"] = trainer.global_step
                    rows.append(row)
                    self._save_grid(trainer, images, f"student-{name}-{steps}_step_{trainer.global_step:07d}.png")
        finally:
            if swap:
                ema.swap_out(pl_module)
        self.history.extend(rows)
        run_dir = Path(trainer.default_root_dir)
        csv_path = run_dir / "quality_cost.csv"
        first = not csv_path.exists()
        write_csv(([dict(r, step=trainer.global_step) for r in teacher_rows] if first else []) + rows, csv_path, append=True)
        shown = rows if self.nfe is not None else [r for r in self.history]
        plot = plot_pareto(teacher_rows + shown, run_dir / "plots" / f"pareto_step_{trainer.global_step:07d}.png",
                           title=f"step {trainer.global_step}: FID vs latency", floor=self._floor)
        self._log(trainer, rows, teacher_rows, plot)
        return rows

    def _log(self, trainer, rows: list[dict], teacher_rows: list[dict], plot: Path) -> None:
        from PIL import Image

        from distill.metrics.quality_cost import COLUMNS, format_table

        metrics = {}
        for r in rows:
            tag = f"{r['scheduler']}-{r['steps']}"
            for key in ("fid", "fid_std", "clip_score", "clip_score_std", "prompt_accuracy", "prompt_accuracy_std",
                        "latency_s"):
                if key in r:
                    metrics[f"val/{key}@{tag}"] = r[key]
        metrics["val/fid_floor"], metrics["val/fid_floor_std"] = self._floor["fid"], self._floor["fid_std"]
        table = format_table(teacher_rows + rows, self._floor)
        image = Image.open(plot).convert("RGB")
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
            if hasattr(logger, "log_table"):  # wandb
                cols = [c for c in COLUMNS if any(c in r for r in rows)]
                logger.log_table("quality_cost", columns=cols,
                                 data=[[r.get(c) for c in cols] for r in teacher_rows + rows], step=trainer.global_step)
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
