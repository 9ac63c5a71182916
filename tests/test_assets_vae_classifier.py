"""The digits classifier (FID features) and VAE: short real trainings, the shipped assets' quality, the math."""

import csv

import pytest
import torch
from diffusers import AutoencoderKL

from distill.models.classifier import ImageClassifier
from distill.models.vae import (
    encode_latents,
    latent_scaling_factor,
    measure_scaling_factor,
)
from distill.students.assets import build_vae
from distill.worlds.digits import asset_path
from distill.worlds.digits.evaluate_assets import classifier_accuracy, heldout_digits, reconstruct
from distill.worlds.digits.trainers.classifier import random_affine
from tests.conftest import run_train

SHORT = ("callbacks.progress=null", "trainer.enable_model_summary=false", "trainer.log_every_n_steps=1",
         "method.lr_scheduler.warmup_steps=2")


def _val_losses(run_dir) -> list[float]:
    rows = csv.DictReader(open(run_dir / "csv" / "metrics.csv"))
    return [float(r["val/loss"]) for r in rows if r.get("val/loss")]


def test_classifier_short_training_exports_a_loadable_classifier(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(
        "+exp=asset_classifier", *SHORT, "data.batch_size=32", "trainer.max_steps=24",
        "trainer.val_check_interval=8", "checkpoint.every_n_train_steps=24", f"hydra.run.dir={run_dir}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = _val_losses(run_dir)
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    classifier = ImageClassifier.from_pretrained(run_dir / "export")
    assert not classifier.training
    x = torch.rand(3, 1, 16, 16) * 2 - 1  # another resolution is resized to the training one inside
    assert classifier(x).shape == (3, 10) and classifier.features(x).shape == (3, 128)


def test_vae_short_training_exports_a_loadable_vae_with_measured_scale(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(
        "+exp=asset_vae", *SHORT, "data.batch_size=16", "data.eval_batch_size=64", "trainer.max_steps=16",
        "trainer.val_check_interval=4", "trainer.limit_val_batches=1", "checkpoint.every_n_train_steps=16",
        "method.scale_max_batches=4", f"hydra.run.dir={run_dir}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = _val_losses(run_dir)
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    vae = AutoencoderKL.from_pretrained(run_dir / "export")
    assert vae.config.scaling_factor != 1.0  # measured, not build_vae's placeholder
    latents = vae.encode(torch.zeros(2, 1, 32, 32)).latent_dist.mode()
    assert latents.shape == (2, 4, 8, 8)


@pytest.fixture(scope="module")
def heldout():
    return heldout_digits(32)


@pytest.fixture(scope="module")
def shipped_classifier():
    return ImageClassifier.from_pretrained(asset_path("classifier"))


def test_shipped_classifier_accuracy(shipped_classifier, heldout):
    images, labels = heldout
    assert len(labels) == 360
    assert classifier_accuracy(shipped_classifier, images, labels) >= 0.97
    assert shipped_classifier.features(images[:4]).shape == (4, shipped_classifier.feature_dim)


def test_shipped_vae_reconstructions_are_recognised_and_latents_unit_scaled(shipped_classifier, heldout):
    images, labels = heldout
    vae = AutoencoderKL.from_pretrained(asset_path("vae"))
    assert classifier_accuracy(shipped_classifier, reconstruct(vae, images), labels) >= 0.95
    latents = encode_latents(vae, images.split(180), torch.Generator().manual_seed(0))
    assert latents.shape == (360, 4, 8, 8)
    assert 0.8 <= (latents * vae.config.scaling_factor).std().item() <= 1.25


def test_scaling_factor_is_one_over_latent_std():
    latents = torch.randn(4000, generator=torch.Generator().manual_seed(0)) * 3.0 + 1.0
    assert latent_scaling_factor(latents) == pytest.approx(1 / latents.std().item())
    assert latent_scaling_factor(latents) == pytest.approx(1 / 3.0, rel=0.05)


def test_measure_scaling_factor_gives_unit_std_and_is_stored():
    torch.manual_seed(0)
    vae = build_vae(block_out_channels=(8, 8, 8), norm_num_groups=4)
    images = [torch.rand(4, 1, 32, 32) * 2 - 1]
    factor = measure_scaling_factor(vae, images, seed=0)
    assert vae.config.scaling_factor == factor
    scaled = encode_latents(vae, images, torch.Generator().manual_seed(0)) * factor
    assert scaled.std().item() == pytest.approx(1.0, rel=1e-5)


def test_random_affine_keeps_background_and_identity():
    x = -torch.ones(2, 1, 32, 32)
    x[:, :, 12:20, 12:20] = 1.0
    same = random_affine(x, 0.0, 0.0, 0.0)
    torch.testing.assert_close(same, x, atol=1e-5, rtol=0)
    moved = random_affine(x, 0.0625, 10.0, 0.1, torch.Generator().manual_seed(0))
    assert moved[:, :, 0, :].max() == pytest.approx(-1.0)  # pixels from outside are background, not padding 0
    assert (moved > 0).any()
