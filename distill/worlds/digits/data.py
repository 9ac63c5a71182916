"""The embedded data set: scikit-learn's 1,797 real 8x8 handwritten digits, upscaled, with captions."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from distill.data.resumable import ResumableDataMixin, evaluation_loader

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def caption_for(label: int) -> str:
    return f"a handwritten digit {DIGIT_WORDS[int(label)]}"


def load_digit_images(resolution: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 digits as (N, 1, R, R) float tensors in [-1, 1] and (N,) labels."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8) in [0, 1]
    if resolution != 8:
        images = F.interpolate(images, size=(resolution, resolution), mode="bilinear", align_corners=False)
    images = images.clamp(0.0, 1.0) * 2.0 - 1.0
    return images, torch.tensor(bunch.target, dtype=torch.long)


def split_indices(labels: torch.Tensor, heldout_fraction: float, split_seed: int) -> tuple[list[int], list[int]]:
    """A fixed, class-stratified train / held-out split (the held-out part is the evaluation set)."""
    from sklearn.model_selection import train_test_split

    idx = list(range(len(labels)))
    train, heldout = train_test_split(
        idx, test_size=heldout_fraction, random_state=split_seed, stratify=labels.numpy()
    )
    return sorted(train), sorted(heldout)


class DigitsDataset(Dataset):
    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def fingerprint(self) -> str:
        """A hash of the images and labels (what a latent cache of this set depends on)."""
        import hashlib

        digest = hashlib.sha256(self.images.contiguous().numpy().tobytes())
        digest.update(self.labels.numpy().tobytes())
        digest.update("\n".join(caption_for(int(label)) for label in self.labels).encode())
        return digest.hexdigest()

    def __getitem__(self, i: int) -> dict:
        label = int(self.labels[i])
        return {"pixel_values": self.images[i], "label": label, "caption": caption_for(label)}


class DigitsDataModule(ResumableDataMixin, L.LightningDataModule):
    """Digits at ``resolution`` x ``resolution``, 1 channel, with a fixed stratified held-out split."""

    def __init__(
        self,
        resolution: int = 16,
        batch_size: int = 128,
        eval_batch_size: int = 256,
        heldout_fraction: float = 0.2,
        split_seed: int = 0,
        num_workers: int = 0,
        channels: int = 1,
        shuffle_seed: int = 0,
    ):
        super().__init__()
        if channels not in (1, 3):
            raise ValueError(f"data.channels={channels} is not supported; use 1 (grey) or 3 (grey replicated to RGB)")
        if resolution < 8:
            raise ValueError(f"data.resolution={resolution} is below the digits' native 8; use >= 8")
        if not 0.0 < heldout_fraction < 1.0:
            raise ValueError(f"data.heldout_fraction={heldout_fraction} must be in (0, 1)")
        self.resolution, self.batch_size, self.eval_batch_size = resolution, batch_size, eval_batch_size
        self.heldout_fraction, self.split_seed, self.num_workers = heldout_fraction, split_seed, num_workers
        self.channels, self.shuffle_seed = channels, shuffle_seed
        self.train_set: DigitsDataset | None = None
        self.heldout_set: DigitsDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        images, labels = load_digit_images(self.resolution)
        images = images.expand(-1, self.channels, -1, -1).contiguous()
        train, heldout = split_indices(labels, self.heldout_fraction, self.split_seed)
        if len(train) < self.batch_size:  # whole batches only (drop_last): not one would be drawn
            raise ValueError(f"data.batch_size={self.batch_size} is larger than the training set ({len(train)} images "
                             f"at data.heldout_fraction={self.heldout_fraction}); set data.batch_size <= {len(train)}")
        self.train_set = DigitsDataset(images[train], labels[train])
        self.heldout_set = DigitsDataset(images[heldout], labels[heldout])

    def train_dataloader(self) -> DataLoader:
        return self._train_loader(self.train_set, self.batch_size, self.shuffle_seed, True, self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return evaluation_loader(self.heldout_set, self.eval_batch_size)

    test_dataloader = val_dataloader
