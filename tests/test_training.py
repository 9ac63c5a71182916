"""A short real training run: the held-out loss falls, and the run directory holds what users expect."""

import csv

import pytest
import torch
from diffusers import DDPMPipeline, UNet2DModel

from distill.callbacks.ema import EMA, ema_beta
from tests.conftest import run_train


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("train") / "run"
    proc = run_train(
        "student.size=debug", "data.batch_size=64", "trainer.max_steps=160", "trainer.val_check_interval=20",
        "trainer.log_every_n_steps=10", "checkpoint.every_n_train_steps=80", "checkpoint.save_top_k=2",
        "callbacks.samples.num_seeds=1", "scheduler.num_inference_steps=10", "sample_grid_seeds=2",
        "logger=csv", f"hydra.run.dir={run_dir}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def _val_losses(run_dir):
    rows = list(csv.DictReader(open(run_dir / "csv" / "metrics.csv")))
    return [(int(r["step"]), float(r["val/loss"])) for r in rows if r.get("val/loss")]


def test_training_lowers_heldout_loss(trained_run):
    losses = _val_losses(trained_run)
    assert [s for s, _ in losses] == [19, 39, 59, 79, 99, 119, 139, 159]
    first, last = losses[0][1], losses[-1][1]
    assert last < 0.6 * first, losses


def test_run_directory_layout(trained_run):
    ckpts = sorted(p.name for p in (trained_run / "checkpoints").iterdir())
    assert ckpts == ["last.ckpt", "step_0000080.ckpt", "step_0000160.ckpt"]
    assert (trained_run / "config.yaml").read_text().count("max_steps: 160") == 1
    assert (trained_run / ".hydra" / "overrides.yaml").exists()
    assert (trained_run / "samples" / "final.png").exists()
    assert len(list((trained_run / "samples").glob("step_*.png"))) == 8


def test_export_loads_with_diffusers_and_matches_ema(trained_run):
    pipe = DDPMPipeline.from_pretrained(trained_run / "export")
    assert isinstance(pipe.unet, UNet2DModel) and pipe.unet.config.num_class_embeds == 11
    assert type(pipe.scheduler).__name__ == "DDIMScheduler"
    ckpt = torch.load(trained_run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    ema_state = next(v for k, v in ckpt["callbacks"].items() if k.startswith("EMA"))["ema"]
    for name, value in pipe.unet.state_dict().items():
        torch.testing.assert_close(value, ema_state[name])


def test_ema_beta_formula():
    # EDM: beta = 0.5 ** (batch / half_life); the ramp-up caps the half-life at ratio * images seen.
    assert ema_beta(64, 6400, 10**9, None) == pytest.approx(0.5 ** 0.01)
    assert ema_beta(64, 6400, 640, 0.05) == pytest.approx(0.5 ** (64 / 32))


def test_ema_update_moves_towards_weights():
    class Module(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.student = torch.nn.Linear(1, 1, bias=False)

    module = Module()
    torch.nn.init.constant_(module.student.weight, 0.0)
    ema = EMA(half_life_images=4, rampup_ratio=None)
    ema.on_fit_start(None, module)
    torch.nn.init.constant_(module.student.weight, 1.0)

    class Trainer:
        world_size, accumulate_grad_batches = 1, 1

    ema.on_train_batch_end(Trainer(), module, None, {"pixel_values": torch.zeros(4, 1)}, 0)
    assert ema.ema.weight.item() == pytest.approx(0.5)  # one half-life of images
    ema.on_train_batch_end(Trainer(), module, None, {"pixel_values": torch.zeros(4, 1)}, 1)
    assert ema.ema.weight.item() == pytest.approx(0.75)
