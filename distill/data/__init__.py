"""LightningDataModules. Every batch is a dict: pixel_values (N, C, H, W) in [-1, 1], caption, label."""

from distill.data.digits import DIGIT_WORDS, DigitsDataModule, caption_for
from distill.data.imagefolder import ImageFolderDataModule
from distill.data.shards import WebDatasetDataModule

__all__ = ["DIGIT_WORDS", "DigitsDataModule", "ImageFolderDataModule", "WebDatasetDataModule", "caption_for"]
