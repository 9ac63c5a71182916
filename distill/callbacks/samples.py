"""Sample grids (rows = digits 0-9, columns = seeds) at every validation, saved and logged."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch

from distill.data.digits import caption_for
from distill.utils.images import image_grid, upscale


def digit_condition_batch(num_seeds: int) -> dict:
    """Conditions for a grid: each digit 0-9 repeated ``num_seeds`` times, row by row."""
    labels = torch.arange(10).repeat_interleave(num_seeds)
    return {"label": labels, "caption": [caption_for(int(i)) for i in labels]}


def save_sample_grid(pl_module, path: Path, num_seeds: int, seed: int = 0, **kwargs):
    batch = digit_condition_batch(num_seeds)
    images = pl_module.generate(batch, torch.Generator().manual_seed(seed), **kwargs)
    grid = upscale(image_grid(images, nrow=num_seeds), 4)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    return grid


class SampleGrid(L.Callback):
    def __init__(self, num_seeds: int = 4, seed: int = 0):
        self.num_seeds, self.seed = num_seeds, seed

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        from distill.methods.base import DistillMethod

        if trainer.sanity_checking or not trainer.is_global_zero or type(pl_module).generate is DistillMethod.generate:
            return
        out = Path(trainer.default_root_dir) / "samples" / f"step_{trainer.global_step:07d}.png"
        grid = save_sample_grid(pl_module, out, self.num_seeds, self.seed)
        for logger in trainer.loggers:
            if hasattr(logger, "log_image"):
                logger.log_image(key="samples", images=[grid], step=trainer.global_step)
            elif hasattr(logger, "experiment") and hasattr(logger.experiment, "add_image"):
                import numpy as np

                array = np.asarray(grid)
                logger.experiment.add_image("samples", array, trainer.global_step, dataformats="HW" if array.ndim == 2 else "HWC")
