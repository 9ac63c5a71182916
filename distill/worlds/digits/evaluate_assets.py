"""Quality of the digits classifier (FID features) and VAE, measured on the held-out digits.

    python -m distill.worlds.digits.evaluate_assets classifier vae [--classifier DIR] [--vae DIR] [--record]

The assets load through their public ``from_pretrained`` (shipped ones by default). ``--record``
writes the numbers into each evaluated asset's PROVENANCE.json under ``"quality"``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from diffusers import AutoencoderKL

from distill.models.classifier import ImageClassifier
from distill.models.vae import encode_latents
from distill.worlds.digits import asset_path
from distill.worlds.digits.data import DigitsDataModule
from distill.worlds.digits.trainers.autoencoder import psnr

EVAL_BATCH = 256


def heldout_digits(resolution: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed 360-image held-out split (data.heldout_fraction=0.2, data.split_seed=0): images, labels."""
    data = DigitsDataModule(resolution=resolution)
    data.setup()
    return data.heldout_set.images, data.heldout_set.labels


def _batches(images: torch.Tensor) -> list[torch.Tensor]:
    return list(images.split(EVAL_BATCH))


@torch.no_grad()
def classifier_accuracy(classifier: ImageClassifier, images: torch.Tensor, labels: torch.Tensor) -> float:
    classifier.eval()
    predictions = torch.cat([classifier(x).argmax(1) for x in _batches(images)])
    return (predictions == labels).float().mean().item()


@torch.no_grad()
def reconstruct(vae: AutoencoderKL, images: torch.Tensor) -> torch.Tensor:
    """Decoded posterior means, clamped to the image range [-1, 1]."""
    vae.eval()
    return torch.cat([vae.decode(vae.encode(x).latent_dist.mode()).sample.clamp(-1, 1) for x in _batches(images)])


def evaluate_classifier(classifier_dir: Path) -> dict:
    classifier = ImageClassifier.from_pretrained(classifier_dir)
    images, labels = heldout_digits(classifier.resolution)
    return {"heldout_accuracy": classifier_accuracy(classifier, images, labels), "num_heldout": len(labels)}


def evaluate_vae(vae_dir: Path, classifier_dir: Path) -> dict:
    vae = AutoencoderKL.from_pretrained(vae_dir)
    classifier = ImageClassifier.from_pretrained(classifier_dir)
    images, labels = heldout_digits(vae.config.sample_size)
    recon = reconstruct(vae, images)
    mse = torch.mean((recon - images) ** 2)
    scaled = encode_latents(vae, _batches(images), torch.Generator().manual_seed(0)) * vae.config.scaling_factor
    return {
        "reconstruction_accuracy": classifier_accuracy(classifier, recon, labels),
        "recon_mse": mse.item(),
        "recon_psnr_db": psnr(mse).item(),
        "scaling_factor": vae.config.scaling_factor,
        "latent_shape": list(scaled.shape[1:]),
        "heldout_scaled_latent_std": scaled.std().item(),
        "heldout_scaled_latent_mean": scaled.mean().item(),
        "num_heldout": len(labels),
    }


def record(asset_dir: Path, quality: dict) -> None:
    """Merge ``quality`` into the asset's PROVENANCE.json (created if absent)."""
    path = asset_dir / "PROVENANCE.json"
    provenance = json.loads(path.read_text()) if path.exists() else {}
    provenance["quality"] = quality
    path.write_text(json.dumps(provenance, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description="Measure the digits classifier and VAE on the held-out digits.")
    parser.add_argument("assets", nargs="+", choices=["classifier", "vae"])
    parser.add_argument("--classifier", type=Path, default=None, help="classifier folder (default: the shipped one)")
    parser.add_argument("--vae", type=Path, default=None, help="VAE folder (default: the shipped one)")
    parser.add_argument("--record", action="store_true", help="write the numbers into each PROVENANCE.json")
    args = parser.parse_args()
    classifier_dir = args.classifier or asset_path("classifier")
    results = {}
    if "classifier" in args.assets:
        results["classifier"] = evaluate_classifier(classifier_dir)
        if args.record:
            record(classifier_dir, results["classifier"])
    if "vae" in args.assets:
        vae_dir = args.vae or asset_path("vae")
        results["vae"] = evaluate_vae(vae_dir, classifier_dir)
        if args.record:
            record(vae_dir, {**results["vae"], "judged_by": str(args.classifier or "the shipped classifier")})
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
