"""A folder of images with optional same-name ``.txt`` captions."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import DataLoader, Dataset

from distill.data.resumable import ResumableDataMixin, evaluation_loader
from distill.data.transforms import image_to_tensor

log = logging.getLogger(__name__)
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


class ImageFolderDataset(Dataset):
    def __init__(self, files: list[Path], resolution: int, channels: int, caption_ext: str, default_caption: str):
        self.files, self.resolution, self.channels = files, resolution, channels
        self.caption_ext, self.default_caption = caption_ext, default_caption

    def __len__(self) -> int:
        return len(self.files)

    def fingerprint(self) -> str:
        """A hash of the files' paths, sizes and modification times (images and captions) and of the
        resolution, channels and default caption: what a latent cache of this set depends on."""
        import hashlib

        digest = hashlib.sha256(f"{self.resolution}:{self.channels}:{self.caption_ext}:{self.default_caption}".encode())
        for path in self.files:
            for f in (path, path.with_suffix(self.caption_ext)):
                stat = f.stat() if f.exists() else None
                digest.update(f"{f}:{stat and stat.st_size}:{stat and stat.st_mtime_ns}".encode())
        return digest.hexdigest()

    def __getitem__(self, i: int) -> dict:
        path = self.files[i]
        with Image.open(path) as image:
            pixels = image_to_tensor(image, self.resolution, self.channels)
        caption_file = path.with_suffix(self.caption_ext)
        caption = caption_file.read_text().strip() if caption_file.exists() else self.default_caption
        return {"pixel_values": pixels, "caption": caption, "label": -1}


class ImageFolderDataModule(ResumableDataMixin, L.LightningDataModule):
    """Images under ``root`` (recursively); unreadable files are skipped and counted, or raise."""

    def __init__(
        self,
        root: str,
        resolution: int = 32,
        channels: int = 3,
        batch_size: int = 32,
        eval_batch_size: int = 64,
        heldout_fraction: float = 0.1,
        split_seed: int = 0,
        caption_ext: str = ".txt",
        default_caption: str = "",
        skip_unreadable: bool = True,
        num_workers: int = 0,
        shuffle_seed: int = 0,
    ):
        super().__init__()
        self.root = Path(root)
        self.resolution, self.channels, self.batch_size = resolution, channels, batch_size
        self.eval_batch_size, self.heldout_fraction, self.split_seed = eval_batch_size, heldout_fraction, split_seed
        self.caption_ext, self.default_caption = caption_ext, default_caption
        self.skip_unreadable, self.num_workers, self.shuffle_seed = skip_unreadable, num_workers, shuffle_seed
        self.num_skipped = 0
        self.train_set: ImageFolderDataset | None = None
        self.heldout_set: ImageFolderDataset | None = None

    def _readable_files(self) -> list[Path]:
        if not self.root.is_dir():
            raise FileNotFoundError(f"data.root={str(self.root)!r} is not a directory; point it at a folder of images")
        files = sorted(p for p in self.root.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS)
        good = []
        for path in files:
            try:  # decoded whole: verify() passes a truncated JPEG, which then fails mid-run
                with Image.open(path) as image:
                    image.load()
                good.append(path)
            except (UnidentifiedImageError, OSError) as err:
                if not self.skip_unreadable:
                    raise ValueError(f"unreadable image {path}: {err}; fix or remove it, or set data.skip_unreadable=true") from err
                self.num_skipped += 1
        if self.num_skipped:
            log.warning("skipped %d unreadable image(s) under %s", self.num_skipped, self.root)
        if not good:
            raise ValueError(f"data.root={str(self.root)!r} holds no readable image ({', '.join(IMAGE_EXTENSIONS)})")
        return good

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        files = self._readable_files()
        order = torch.randperm(len(files), generator=torch.Generator().manual_seed(self.split_seed)).tolist()
        n_heldout = int(round(len(files) * self.heldout_fraction)) if len(files) > 1 else 0
        heldout = sorted(order[:n_heldout])
        train = sorted(order[n_heldout:])
        args = (self.resolution, self.channels, self.caption_ext, self.default_caption)
        self.train_set = ImageFolderDataset([files[i] for i in train], *args)
        self.heldout_set = ImageFolderDataset([files[i] for i in heldout] or [files[i] for i in train[:1]], *args)

    def train_dataloader(self) -> DataLoader:
        return self._train_loader(self.train_set, self.batch_size, self.shuffle_seed,
                                  len(self.train_set) >= self.batch_size, self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return evaluation_loader(self.heldout_set, self.eval_batch_size)
