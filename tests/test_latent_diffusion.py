"""Latent, text-conditioned diffusion training (the teacher recipe) against a tiny random SD world."""

import pytest
import torch
from diffusers import DDPMScheduler, StableDiffusionPipeline
from transformers import CLIPTextModel, CLIPTokenizer

from distill.methods.diffusion import DiffusionTraining
from distill.models.conditioning import TextConditioner
from tests.conftest import run_cli, run_train
from tests.sd_tiny import write_tiny_sd


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory):
    return write_tiny_sd(tmp_path_factory.mktemp("sd") / "pipe")


def test_text_conditioner_caches_prompt_embeddings(tiny_sd):
    cond = TextConditioner(CLIPTextModel.from_pretrained(tiny_sd / "text_encoder"),
                           CLIPTokenizer.from_pretrained(tiny_sd / "tokenizer"))
    batch = {"caption": ["a handwritten digit one", "a handwritten digit two", "a handwritten digit one"]}
    first = cond(batch)["encoder_hidden_states"]
    assert first.shape == (3, 8, 32) and cond.encoder_calls == 2
    again = cond(batch, drop=torch.tensor([False, True, False]))["encoder_hidden_states"]
    assert cond.encoder_calls == 3  # only "" was new
    torch.testing.assert_close(again[0], first[0])
    torch.testing.assert_close(again[1], cond.null(1)["encoder_hidden_states"][0])
    # The cache returns what the encoder computes.
    fresh = TextConditioner(cond.text_encoder, cond.tokenizer, cache=False)(batch)["encoder_hidden_states"]
    torch.testing.assert_close(fresh, first)


def test_latent_encoding_uses_scaling_factor(tiny_sd):
    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd)
    method = DiffusionTraining(pipe.unet, DDPMScheduler(), TextConditioner(pipe.text_encoder, pipe.tokenizer),
                               optimizer=torch.optim.AdamW, vae=pipe.vae)
    x = torch.rand(2, 1, 32, 32) * 2 - 1
    latents = method.encode(x, torch.Generator().manual_seed(0))
    assert latents.shape == (2, 4, 8, 8)
    mean = pipe.vae.encode(x).latent_dist.mean
    # Sampled latents are scaling_factor * (mean + std * noise): close to scaled mean for a peaked posterior.
    assert torch.allclose(latents / 0.5, mean, atol=6 * pipe.vae.encode(x).latent_dist.std.max().item())
    torch.testing.assert_close(method.decode(latents), pipe.vae.decode(latents / 0.5).sample)


def test_latent_diffusion_command_exports_stable_diffusion_pipeline(tiny_sd, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(
        "+exp=teacher", f"method.vae.pretrained_model_name_or_path={tiny_sd / 'vae'}",
        f"method.conditioner.text_encoder.pretrained_model_name_or_path={tiny_sd / 'text_encoder'}",
        f"method.conditioner.tokenizer.pretrained_model_name_or_path={tiny_sd / 'tokenizer'}",
        "student.size=debug", "student.cross_attention_dim=32", "data.batch_size=16", "trainer.max_steps=30",
        "trainer.val_check_interval=10", "trainer.limit_val_batches=1", "trainer.log_every_n_steps=5",
        "checkpoint.every_n_train_steps=30", "scheduler.num_inference_steps=3", "callbacks.samples.num_seeds=1",
        "sample_grid_seeds=1", "logger=csv", f"hydra.run.dir={run_dir}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    import csv

    val = [float(r["val/loss"]) for r in csv.DictReader(open(run_dir / "csv" / "metrics.csv")) if r.get("val/loss")]
    assert len(val) == 3 and val[-1] < val[0]
    pipe = StableDiffusionPipeline.from_pretrained(run_dir / "export")
    assert pipe.unet.config.cross_attention_dim == 32 and pipe.safety_checker is None
    image = pipe("a handwritten digit seven", num_inference_steps=2, height=32, width=32, output_type="pt",
                 generator=torch.Generator().manual_seed(0)).images
    assert image.shape == (1, 1, 32, 32) and torch.isfinite(image).all()


def test_sample_command_writes_grid(tiny_sd, tmp_path):
    import sys

    from PIL import Image

    out = tmp_path / "grid.png"
    proc = run_cli(
        [sys.executable, "-m", "distill.sample", f"pipeline={tiny_sd}", f"out={out}", "num_seeds=2",
         "num_inference_steps=2", "sampler=dpmsolver", "prompts=[a handwritten digit one,two]"],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert Image.open(out).size == (4 * 2 * (32 + 2), 4 * 2 * (32 + 2))  # 2 x 2 tiles of 32 px, 1-px frames, x4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grid.png"]  # nothing else written
    bad = run_cli([sys.executable, "-m", "distill.sample", f"pipeline={tmp_path}"], capture_output=True, text=True)
    assert bad.returncode == 1 and "model_index.json" in bad.stderr
