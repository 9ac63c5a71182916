"""Sample grids (rows = the evaluation set's first prompts, columns = seeds) at every validation, saved and logged."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch

from distill.metrics.report import save_grid


def save_sample_grid(pl_module, path: Path, batch: dict, num_seeds: int, seed: int = 0, **kwargs):
    """Generate ``batch`` (``caption`` and ``label`` of each image, ``num_seeds`` per row) with the method's
    ``generate`` and save it as a grid whose PNG metadata lists the rows' prompts."""
    images = pl_module.generate(batch, torch.Generator().manual_seed(seed), **kwargs)
    return save_grid(images, path, num_seeds, batch["caption"][::num_seeds], scale=4)


class SampleGrid(L.Callback):
    """``eval_set`` (``distill.metrics.eval_set.EvalSet``) supplies the prompts (and labels) of the rows."""

    def __init__(self, eval_set, num_seeds: int = 4, seed: int = 0):
        self.eval_set, self.num_seeds, self.seed = eval_set, num_seeds, seed

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        from distill.methods.base import DistillMethod
        from distill.utils.sharding import gathered, strategy_of

        sharded = strategy_of(trainer) is not None  # every rank takes part in gathering the weights
        if (trainer.sanity_checking or (not trainer.is_global_zero and not sharded)
                or type(pl_module).generate is DistillMethod.generate):
            return
        out = Path(trainer.default_root_dir) / "samples" / f"step_{trainer.global_step:07d}.png"
        with gathered(trainer, pl_module):
            if not trainer.is_global_zero:
                return
            grid = save_sample_grid(pl_module, out, self.eval_set.grid_batch(self.num_seeds), self.num_seeds, self.seed)
        for logger in trainer.loggers:
            if hasattr(logger, "log_image"):
                logger.log_image(key="samples", images=[grid], step=trainer.global_step)
            elif hasattr(logger, "experiment") and hasattr(logger.experiment, "add_image"):
                import numpy as np

                array = np.asarray(grid)
                logger.experiment.add_image("samples", array, trainer.global_step, dataformats="HW" if array.ndim == 2 else "HWC")
