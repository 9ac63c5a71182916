"""The shipped digits world: classifier (FID features), VAE, CLIP, teacher and the noise-aware classifier that
guides sampling, each rebuilt by `make assets`."""

from __future__ import annotations

from pathlib import Path

ASSET_ROOT = Path(__file__).parent / "digits"
ASSET_NAMES = ("classifier", "vae", "clip", "teacher", "noisy_classifier")


def asset_path(name: str) -> Path:
    """Folder of a shipped asset, loadable with the matching ``from_pretrained``."""
    path = ASSET_ROOT / name
    if not path.is_dir():
        raise FileNotFoundError(
            f"digits asset {name!r} is missing at {path}; rebuild the shipped assets with `make assets` "
            f"(known assets: {', '.join(ASSET_NAMES)})"
        )
    return path
