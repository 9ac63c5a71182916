"""A short real training run: the held-out loss falls, and the run directory holds what users expect."""

import csv

import pytest
import torch
from diffusers import DDPMPipeline, UNet2DModel

from distill.callbacks.ema import EMA, ema_beta
from distill.callbacks.resilience import NonFiniteGuard
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


class _Module(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.student = torch.nn.Linear(1, 1, bias=False)

    def log(self, *args, **kwargs) -> None:
        pass


class _Strategy:
    @staticmethod
    def reduce_boolean_decision(decision: bool, all: bool = True) -> bool:
        return decision


class _Trainer:
    world_size, accumulate_grad_batches, num_training_batches, is_last_batch, global_step = 1, 1, 10, False, 0
    strategy = _Strategy()


def _ema_of_zero_student_now_one() -> tuple[EMA, _Module]:
    """An EMA taken of a zero weight, the weight then set to 1 with a gradient (an optimizer step that ran)."""
    module = _Module()
    torch.nn.init.constant_(module.student.weight, 0.0)
    ema = EMA(half_life_images=4, rampup_ratio=None)
    ema.on_fit_start(None, module)
    torch.nn.init.constant_(module.student.weight, 1.0)
    module.student.weight.grad = torch.zeros(1, 1)
    return ema, module


def test_ema_update_moves_towards_weights():
    ema, module = _ema_of_zero_student_now_one()
    ema.on_train_batch_end(_Trainer(), module, None, {"pixel_values": torch.zeros(4, 1)}, 0)
    assert ema.ema.weight.item() == pytest.approx(0.5)  # one half-life of images
    ema.on_train_batch_end(_Trainer(), module, None, {"pixel_values": torch.zeros(4, 1)}, 1)
    assert ema.ema.weight.item() == pytest.approx(0.75)


def test_ema_skips_a_step_the_nonfinite_guard_skipped():
    ema, module = _ema_of_zero_student_now_one()
    guard, trainer, batch = NonFiniteGuard(), _Trainer(), {"pixel_values": torch.zeros(4, 1)}
    guard.on_before_backward(trainer, module, torch.tensor(float("nan")))
    guard.on_before_optimizer_step(trainer, module, torch.optim.SGD(module.parameters(), lr=1.0))
    ema.on_train_batch_end(trainer, module, None, batch, 0)
    assert guard.skipped == 1 and ema.ema.weight.item() == 0.0 and ema.seen_images == 0
    module.student.weight.grad = torch.zeros(1, 1)  # the next step runs: one half-life of images, counted once
    ema.on_train_batch_end(trainer, module, None, batch, 1)
    assert ema.ema.weight.item() == pytest.approx(0.5) and ema.seen_images == 4


def test_ema_follows_a_device_side_skip_mask_as_the_host_skip():
    """The guard's 0/1 mask on the device (a fused optimizer skipped the step through found_inf, gradients kept):
    a 0 moves neither the EMA nor its image count, a 1 is the host path's update, and the count checkpoints as
    an int."""
    ema, module = _ema_of_zero_student_now_one()
    trainer, batch = _Trainer(), {"pixel_values": torch.zeros(4, 1)}
    module.step_applied_mask = torch.tensor(0.0)
    ema.on_train_batch_end(trainer, module, None, batch, 0)
    assert ema.ema.weight.item() == 0.0 and int(ema.seen_images) == 0
    module.step_applied_mask = torch.tensor(1.0)
    ema.on_train_batch_end(trainer, module, None, batch, 1)
    assert ema.ema.weight.item() == pytest.approx(0.5) and ema.state_dict()["seen_images"] == 4
    ema.on_train_batch_end(trainer, module, None, batch, 2)
    assert ema.ema.weight.item() == pytest.approx(0.75)


def test_device_side_guard_counts_on_the_device_and_aborts_on_a_run_ended_before_the_read():
    from distill.callbacks.resilience import NonFiniteLossError

    class Trainer(_Trainer):
        optimizers, log_every_n_steps = [], 100
        precision_plugin = object()

    module = _Module()
    module.automatic_optimization, module.device = True, torch.device("cpu")
    module.student.weight.grad = torch.ones(1, 1)
    optimizer = torch.optim.AdamW(module.student.parameters(), lr=0.1, fused=True)
    trainer, guard = Trainer(), NonFiniteGuard(max_consecutive=2)
    trainer.optimizers = [optimizer]
    guard.on_fit_start(trainer, module)
    assert guard.device_side
    for loss in (float("nan"), float("nan"), 1.0):  # two bad steps in a row, then a good one: no read yet
        guard.on_before_backward(trainer, module, torch.tensor(loss))
        guard.on_before_optimizer_step(trainer, module, optimizer)
        assert float(optimizer.found_inf) == float(loss != loss) and float(module.step_applied_mask) == float(loss == loss)
    assert guard.skipped == 0  # nothing read on the host between logging steps
    with pytest.raises(NonFiniteLossError, match="2 consecutive steps"):
        guard.state_dict()  # read before a checkpoint is written: the run of 2 is not missed
    assert guard.skipped == 2 and guard.consecutive == 0


def test_ema_resumed_mid_window_keeps_the_windows_images():
    ema, module = _ema_of_zero_student_now_one()
    trainer, batch = _Trainer(), {"pixel_values": torch.zeros(4, 1)}
    trainer.accumulate_grad_batches = 2
    ema.on_train_batch_end(trainer, module, None, batch, 0)  # the first half of a window; then checkpoint, resume
    resumed, _ = _ema_of_zero_student_now_one()
    resumed.load_state_dict(ema.state_dict())
    resumed.on_train_batch_end(trainer, module, None, batch, 1)
    assert resumed.seen_images == 8  # both micro-batches: 2 half-lives, beta = 0.25
    assert resumed.ema.weight.item() == pytest.approx(0.75)


@pytest.mark.parametrize("buffers", [True, False])
def test_fused_ema_update_equals_a_per_tensor_lerp_and_copies_counters(buffers):
    import copy

    from distill.utils.optim import ema_update_

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7))
    average, before = copy.deepcopy(net), copy.deepcopy(net)
    for p in net.parameters():
        p.data.add_(torch.randn_like(p))
    net[1].running_mean.add_(1.0)
    net[1].num_batches_tracked.add_(3)
    ema_update_(average, net, 0.1, buffers=buffers)
    params = {name for name, _ in net.named_parameters()}
    for (name, a), b, c in zip(average.state_dict().items(), before.state_dict().values(), net.state_dict().values()):
        if not buffers and name not in params:
            assert torch.equal(a, b), name  # buffers untouched
        elif a.dtype.is_floating_point:
            assert torch.equal(a, b.clone().lerp_(c, 0.1)), name  # bit-identical to torch.lerp
        else:
            assert torch.equal(a, c), name
