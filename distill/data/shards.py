"""Tar shards in the webdataset layout (``key.png`` + ``key.txt``) for data too large for a folder."""

from __future__ import annotations

import glob
import io

import lightning as L
import torch
from PIL import Image
from torch.utils.data import DataLoader

from distill.data.resumable import evaluation_loader
from distill.data.transforms import image_to_tensor

IMAGE_KEYS = ("png", "jpg", "jpeg", "webp")


def _expand(pattern: str) -> list[str]:
    """Accept brace patterns (``shard-{000..009}.tar``, expanded by webdataset) or shell globs."""
    if "{" in pattern:
        import braceexpand

        return list(braceexpand.braceexpand(pattern))
    files = sorted(glob.glob(pattern))
    if not files:
        raise FileNotFoundError(f"data.urls={pattern!r} matches no shard; give a glob or brace pattern of .tar files")
    return files


class WebDatasetDataModule(L.LightningDataModule):
    """Streams shards: shuffled by shard and in a buffer for training, in order for evaluation.

    Not resumable mid-epoch (a resume restarts the stream): a stream has no length, so Lightning's fetcher
    prefetches one batch from it, and a stream state saved through StatefulDataLoader would count that batch as
    trained and skip it on resume. The sized data modules (distill.data.resumable) resume exactly."""

    def __init__(
        self,
        urls: str,
        heldout_urls: str | None = None,
        resolution: int = 32,
        channels: int = 3,
        batch_size: int = 32,
        eval_batch_size: int = 64,
        shuffle_buffer: int = 1000,
        seed: int = 0,
        num_workers: int = 0,
    ):
        super().__init__()
        self.urls, self.heldout_urls = _expand(urls), _expand(heldout_urls) if heldout_urls else None
        self.resolution, self.channels = resolution, channels
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.shuffle_buffer, self.seed, self.num_workers = shuffle_buffer, seed, num_workers
        self.encoder = None

    def encode_in_workers(self, encoder) -> None:
        """Train on encoded batches: ``encoder`` (a picklable batch -> batch callable, e.g. the frozen VAE's
        ``distill.data.latents.PosteriorEncoder``) runs in the data loader's workers on each collated batch, so
        that a stream too large to cache is still encoded off the training step (``data.num_workers`` > 0)."""
        self.encoder = encoder

    def _decode(self, sample: dict) -> dict:
        key = next((k for k in IMAGE_KEYS if k in sample), None)
        if key is None:
            raise ValueError(f"shard sample {sample.get('__key__')!r} has no image ({', '.join(IMAGE_KEYS)})")
        with Image.open(io.BytesIO(sample[key])) as image:
            pixels = image_to_tensor(image, self.resolution, self.channels)
        caption = sample["txt"].decode("utf-8").strip() if "txt" in sample else ""
        label = int(sample["cls"].decode()) if "cls" in sample else -1
        return {"pixel_values": pixels, "caption": caption, "label": label}

    def _dataset(self, urls: list[str], train: bool):
        import webdataset as wds

        nodesplitter = wds.split_by_node if torch.distributed.is_available() and torch.distributed.is_initialized() else None
        ds = wds.WebDataset(
            urls, shardshuffle=len(urls) if train else False, seed=self.seed,
            nodesplitter=nodesplitter, empty_check=False,
        )
        if train:
            ds = ds.shuffle(self.shuffle_buffer, seed=self.seed)
        return ds.map(self._decode)

    def train_dataloader(self) -> DataLoader:
        # off the step's critical path: persistent workers, pinned host memory when a GPU takes the batches; the
        # workers' seeds from the loader's own generator, not a draw from the global RNG at each epoch's start
        off_path = {"num_workers": self.num_workers, "persistent_workers": self.num_workers > 0,
                    "pin_memory": torch.cuda.is_available(), "generator": torch.Generator().manual_seed(self.seed)}
        if self.encoder is None:
            return DataLoader(self._dataset(self.urls, True), batch_size=self.batch_size, **off_path)
        from torch.utils.data import default_collate

        # batches are collated and encoded in the workers; the loader passes them through as they are
        ds = self._dataset(self.urls, True).batched(self.batch_size, collation_fn=default_collate, partial=True)
        return DataLoader(ds.map(self.encoder), batch_size=None, **off_path)

    def val_dataloader(self) -> DataLoader:
        return evaluation_loader(self._dataset(self.heldout_urls or self.urls[:1], False), self.eval_batch_size)
