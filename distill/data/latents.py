"""Pre-encoded training latents: the frozen VAE's posterior of every training image, computed once.

Latent diffusion and its distillations encode every batch with a frozen VAE (Rombach et al. 2022), the
same images epoch after epoch. ``cached_latents`` encodes a map-style data set once and stores, per image,
the posterior's mean and standard deviation as memory-mapped ``.npy`` arrays with the captions and labels
beside them; training then draws ``mean + std * noise`` per step, the same distribution (and, with the same
generator, the same draw) as encoding the image afresh. The cache folder is named by a fingerprint of the
VAE's weights and of the data (files, sizes and modification times, or the image content), so a changed
VAE or data set builds a new cache and never reads a stale one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

log = logging.getLogger(__name__)
FORMAT_VERSION = 1


def batch_size_of(batch: dict) -> int:
    """How many examples a training batch holds, whether it carries images or cached latents."""
    for key in ("pixel_values", "latent_mean"):
        if key in batch:
            return int(batch[key].shape[0])
    raise KeyError(f"a batch needs 'pixel_values' or 'latent_mean'; got keys {sorted(batch)}")


@torch.no_grad()
def posterior_sample(vae, pixels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Images (N, C, H, W) -> a sample of the VAE posterior, unscaled, in float32 even inside a mixed-precision
    step: the latents are the data (as the latent cache holds them)."""
    with torch.autocast(pixels.device.type, enabled=False):
        dist = vae.encode(pixels.float()).latent_dist
    noise = torch.randn(dist.mean.shape, generator=generator).to(dist.mean)
    return dist.mean + dist.std * noise


@torch.no_grad()
def encode_latents(vae, pixels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``posterior_sample`` times the VAE's ``scaling_factor`` (Rombach et al. 2022); a model family's
    ``encode`` also applies a ``shift_factor``."""
    return posterior_sample(vae, pixels, generator) * vae.config.scaling_factor


def module_fingerprint(module: nn.Module) -> str:
    """SHA-256 over a module's parameter and buffer names, dtypes, shapes and bytes."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def dataset_fingerprint(dataset: Dataset) -> str:
    """The data set's own ``fingerprint()`` (cheap: file names, sizes, times) or a hash of every item's image
    and caption (one pass over the data)."""
    own = getattr(dataset, "fingerprint", None)
    if callable(own):
        return own()
    digest = hashlib.sha256()
    for i in range(len(dataset)):
        item = dataset[i]
        digest.update(item["pixel_values"].numpy().tobytes())
        digest.update(str(item.get("caption", "")).encode())
    return digest.hexdigest()


def _collate(items: list[dict]) -> dict:
    return {"pixel_values": torch.stack([it["pixel_values"] for it in items]),
            "caption": [str(it.get("caption", "")) for it in items], "label": [int(it.get("label", -1)) for it in items]}


@torch.no_grad()
def build_latent_cache(dataset: Dataset, vae: nn.Module, folder: Path, batch_size: int = 64,
                       num_workers: int = 0) -> Path:
    """Encode ``dataset`` with ``vae`` into ``folder`` (mean.npy, std.npy, meta.json); written to a temporary
    folder beside it and renamed, so that an interrupted build leaves no half cache."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        # its own generator: a run draws the same random numbers whether it built the cache or found it
        loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers, collate_fn=_collate,
                            generator=torch.Generator().manual_seed(0))
        device = next(vae.parameters()).device
        mean_mm = std_mm = None
        captions, labels, start = [], [], 0
        for batch in loader:
            dist = vae.encode(batch["pixel_values"].to(device)).latent_dist
            mean, std = dist.mean.float().cpu().numpy(), dist.std.float().cpu().numpy()
            if mean_mm is None:
                shape = (len(dataset), *mean.shape[1:])
                mean_mm = np.lib.format.open_memmap(tmp / "mean.npy", mode="w+", dtype=np.float32, shape=shape)
                std_mm = np.lib.format.open_memmap(tmp / "std.npy", mode="w+", dtype=np.float32, shape=shape)
            mean_mm[start:start + len(mean)], std_mm[start:start + len(mean)] = mean, std
            start += len(mean)
            captions += batch["caption"]
            labels += batch["label"]
        if mean_mm is None:
            raise ValueError("the training set is empty: nothing to encode")
        mean_mm.flush()
        std_mm.flush()
        del mean_mm, std_mm
        meta = {"format": FORMAT_VERSION, "num_items": start, "captions": captions, "labels": labels}
        (tmp / "meta.json").write_text(json.dumps(meta))
        try:
            os.replace(tmp, folder)
        except OSError:  # another process finished first (the folder exists and is not empty): keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
            if not (folder / "meta.json").exists():
                raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


class PosteriorEncoder:
    """Images -> the frozen VAE's posterior (``latent_mean``, ``latent_std``), for data that cannot be cached:
    a streamed training set is encoded in the data loader's workers, off the training step (each worker holds
    this float32 CPU copy of the VAE; the step then draws from the posterior as from a cache)."""

    def __init__(self, vae: nn.Module):
        import copy

        decoder = {name: getattr(vae, name) for name in ("decoder", "post_quant_conv") if hasattr(vae, name)}
        try:  # the workers encode only: no copy of the decoder
            for name in decoder:
                setattr(vae, name, None)
            self.vae = copy.deepcopy(vae).to("cpu", torch.float32).eval().requires_grad_(False)
        finally:
            for name, module in decoder.items():
                setattr(vae, name, module)

    @torch.no_grad()
    def __call__(self, batch: dict) -> dict:
        dist = self.vae.encode(batch["pixel_values"].to(torch.float32)).latent_dist
        out = {k: v for k, v in batch.items() if k != "pixel_values"}
        out["latent_mean"], out["latent_std"] = dist.mean.float(), dist.std.float()
        return out


class CachedLatentDataset(Dataset):
    """Items ``latent_mean``, ``latent_std`` (the VAE posterior, unscaled), ``caption`` and ``label`` of a cache
    folder, read from memory-mapped arrays (no image is decoded)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        meta = json.loads((self.folder / "meta.json").read_text())
        if meta.get("format") != FORMAT_VERSION:
            raise ValueError(f"latent cache {self.folder} has format {meta.get('format')}, expected {FORMAT_VERSION}; "
                             "delete the folder to rebuild it")
        self.mean = np.load(self.folder / "mean.npy", mmap_mode="r")
        self.std = np.load(self.folder / "std.npy", mmap_mode="r")
        self.captions, self.labels = meta["captions"], meta["labels"]

    def __len__(self) -> int:
        return len(self.captions)

    def __getitem__(self, i: int) -> dict:
        return {"latent_mean": torch.from_numpy(np.array(self.mean[i])), "latent_std": torch.from_numpy(np.array(self.std[i])),
                "caption": self.captions[i], "label": self.labels[i]}


def cache_folder(root: str | Path, vae: nn.Module, dataset: Dataset) -> Path:
    """``root/<key>``: the key is a hash of the VAE's weights and the data's fingerprint."""
    key = hashlib.sha256(f"{FORMAT_VERSION}:{module_fingerprint(vae)}:{dataset_fingerprint(dataset)}".encode())
    return Path(root).expanduser() / key.hexdigest()[:24]


def cached_latents(dataset: Dataset, vae: nn.Module, root: str | Path, build: bool = True,
                   batch_size: int = 64) -> CachedLatentDataset:
    """The latent cache of ``dataset`` under ``root``, built first if missing (``build``; a rank that must not
    build waits for the one that does and then finds it here)."""
    folder = cache_folder(root, vae, dataset)
    if not (folder / "meta.json").exists():
        if not build:
            raise FileNotFoundError(f"latent cache {folder} is missing; the building rank should have written it")
        log.info("encoding %d training images with the frozen VAE into %s (once)", len(dataset), folder)
        build_latent_cache(dataset, vae, folder, batch_size)
    else:
        log.info("training from cached latents in %s", folder)
    return CachedLatentDataset(folder)
