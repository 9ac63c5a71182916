"""LightningDataModules. Every batch is a dict: pixel_values (N, C, H, W) in [-1, 1], caption, label.
The embedded default world's data module lives with that world (``distill.worlds``)."""

from distill.data.imagefolder import ImageFolderDataModule
from distill.data.shards import WebDatasetDataModule

__all__ = ["ImageFolderDataModule", "WebDatasetDataModule"]
