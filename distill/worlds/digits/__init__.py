"""The digits world, the embedded default: scikit-learn's handwritten digits with captions (``data``), the shipped
networks in ``weights/`` (the classifier of the FID features, the VAE, the CLIP, the teacher and the noise-aware
classifier that guides sampling), the trainers that build them (``trainers``, each a method; ``python -m
distill.worlds.digits.build`` retrains them, as ``make assets`` does), its metrics (``metrics``) and the parts it
registers (``PARTS``). Its presets are the option files of ``distill/conf`` that name it (``data=digits``,
``teacher=digits``, ``eval=digits``, ``+exp=asset_*``)."""

from __future__ import annotations

from pathlib import Path

ASSET_ROOT = Path(__file__).parent / "weights"
ASSET_NAMES = ("classifier", "vae", "clip", "teacher", "noisy_classifier", "flow_teacher")

# The modules that register this world's parts, by kind of registry (``distill.utils.registry``)
PARTS: dict[str, tuple[str, ...]] = {
    "method": ("distill.worlds.digits.trainers.clip", "distill.worlds.digits.trainers.classifier",
               "distill.worlds.digits.trainers.noisy_classifier", "distill.worlds.digits.trainers.autoencoder"),
    "student": ("distill.worlds.digits.clip", "distill.worlds.digits.classifier"),
}

# The config group options this world adds, as ``_target_``s whose signature is the option's schema
OPTIONS: dict[str, dict[str, str]] = {"data": {"digits": "distill.worlds.digits.data.DigitsDataModule"}}


def asset_path(name: str) -> Path:
    """Folder of a shipped asset, loadable with the matching ``from_pretrained``."""
    path = ASSET_ROOT / name
    if not path.is_dir():
        raise FileNotFoundError(
            f"digits asset {name!r} is missing at {path}; rebuild the shipped assets with `make assets` "
            f"(known assets: {', '.join(ASSET_NAMES)})"
        )
    return path
