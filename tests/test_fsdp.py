"""trainer=fsdp: FSDP2 sharding through Lightning's ModelParallelStrategy, on 2 CPU processes (gloo).

The references: the same training under DDP (sharding changes where the weights live, not what is computed),
an unbroken run (a resumed one must match it exactly), and the unsharded network (what ``gathered`` lends rank 0).
"""

import csv
import math
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from distill.utils.checkpoint import resolve_resume, safe_load
from distill.utils.sharding import shard_units
from tests.conftest import run_train

SHRINK = ["trainer.limit_val_batches=0", "callbacks.samples=null", "trainer.log_every_n_steps=1",
          "callbacks.progress=null", "sample_grid_seeds=0", "logger=csv"]
DEBUG = ["+exp=debug", "data.batch_size=128", "trainer.max_steps=3", "method.lr_scheduler.total_steps=3",
         "method.lr_scheduler.warmup_steps=1", "checkpoint.every_n_train_steps=1", *SHRINK]
LCM = ["+exp=consistency", "data.batch_size=8", "trainer.max_steps=4", "method.lr_scheduler.total_steps=4",
       "method.lr_scheduler.warmup_steps=2", "callbacks.quality_cost=null", "checkpoint.every_n_train_steps=1",
       "checkpoint.save_top_k=-1", "export=false", *SHRINK]


def _losses(run_dir: Path) -> dict[int, float]:
    rows = csv.DictReader(open(run_dir / "csv" / "metrics.csv"))
    return {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}


# ---------------------------------------------------------------- which modules become FSDP units


def test_shard_units_are_the_outermost_declared_blocks():
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(8, 16),
                                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), layers_per_block=1,
                                cross_attention_dim=8, attention_head_dim=2, norm_num_groups=4)
    units = shard_units(unet)
    names = {type(u).__name__ for u in units}
    assert names <= set(UNet2DConditionModel._no_split_modules)
    ids = {id(u) for u in units}
    for unit in units:  # none inside another (a CrossAttnUpBlock2D's resnets belong to it)
        assert not any(id(m) in ids for m in unit.modules() if m is not unit)
    assert sum(isinstance(u, type(unet.up_blocks[1])) for u in units) == 1
    covered = {id(p) for u in units for p in u.parameters()}
    assert all(id(p) in covered for p in unet.down_blocks[0].resnets[0].parameters())


def test_shard_units_without_declared_blocks_are_the_stages():
    net = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]), torch.nn.ReLU())
    assert shard_units(net) == list(net[0])


# ---------------------------------------------------------------- sharded EMA and gathered copies vs plain ones


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Method(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.student = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
        self.student.register_buffer("scale", torch.tensor([2.0]), persistent=False)
        self.teacher = torch.nn.Linear(5, 3)

    def frozen_networks(self):
        return [self.teacher]


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh

    from distill.utils.optim import ema_update_
    from distill.utils.sharding import ShardedStrategy, StateCopy, full_state, gathered

    plain = _Method()
    method = _Method()
    strategy = ShardedStrategy()
    strategy._device_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
    strategy.parallel_devices = [torch.device("cpu")] * 2
    strategy.shard(method)

    class Trainer:  # what gathered() reads of a trainer
        pass

    trainer = Trainer()
    trainer.strategy = strategy
    type(strategy).global_rank = property(lambda self: rank)
    type(strategy).barrier = lambda self, name=None: dist.barrier()

    # an EMA of the sharded student, stepped against a changed student, equals the same EMA unsharded
    ema, ema_plain = StateCopy(method.student), {k: v.clone() for k, v in plain.student.state_dict().items()}
    with torch.no_grad():
        for p, q in zip(method.student.parameters(), plain.student.parameters()):
            p.add_(1.0)
            q.add_(1.0)
    ema_update_(ema, method.student, 0.25)

    class Bag:
        def state_dict(self):
            return ema_plain

    ema_update_(Bag(), plain.student, 0.25)
    gathered_ema = full_state(ema.state_dict())
    # a full state loads back into the shards (what resuming the EMA callback does)
    ema2 = StateCopy(method.student)
    ema2.load_state_dict(gathered_ema)
    again = full_state(ema2.state_dict())
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    with gathered(trainer, method):
        result = None
        if rank == 0:
            result = {"student": method.student(x), "teacher": method.teacher(x),
                      "is_plain": not any(type(p).__name__ == "DTensor" for p in method.student.parameters())}
    sharded_again = all(type(p).__name__ == "DTensor" for p in method.student.parameters())
    if rank == 0:
        torch.save({"ema": gathered_ema, "ema_plain": ema_plain, "again": again, "sharded_again": sharded_again,
                    "ref_student": plain.student(x), "ref_teacher": plain.teacher(x), **result}, out)
    dist.barrier()
    dist.destroy_process_group()


def test_sharded_ema_and_gathered_networks_equal_the_unsharded_ones(tmp_path):
    out = tmp_path / "out.pt"
    mp.start_processes(_worker, args=(_free_port(), str(out)), nprocs=2, start_method="spawn")
    r = torch.load(out)
    for key, value in r["ema_plain"].items():
        assert torch.allclose(r["ema"][key], value, atol=1e-6), key
        assert torch.equal(r["again"][key], r["ema"][key]), key
    assert r["is_plain"] and r["sharded_again"]
    assert torch.allclose(r["student"], r["ref_student"], atol=1e-6)  # both students were moved by +1
    assert torch.allclose(r["teacher"], r["ref_teacher"], atol=1e-6)


# ---------------------------------------------------------------- whole training runs


@pytest.mark.slow  # ~60 s: two 2-process runs; the default suite keeps the sharded EMA/gather equivalence
def test_fsdp_training_equals_ddp(tmp_path):
    """Sharding changes where parameters, gradients and optimizer states live, not the update: 3 steps of the
    debug run (an EMA callback, AdamW, clipping) under trainer=cpu_fsdp and trainer=cpu_ddp give the same student."""
    runs = {}
    for trainer in ("cpu_fsdp", "cpu_ddp"):
        run_dir = tmp_path / trainer
        proc = run_train(*DEBUG, f"trainer={trainer}", f"hydra.run.dir={run_dir}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[trainer] = run_dir
    fsdp, ddp = runs["cpu_fsdp"], runs["cpu_ddp"]
    ckpt = fsdp / "checkpoints" / "last.ckpt"
    assert ckpt.is_dir() and (ckpt / "meta.pt").is_file() and len(list(ckpt.glob("*.distcp"))) == 2  # one per rank
    assert resolve_resume(fsdp / "checkpoints")[0] == ckpt
    assert safe_load(ckpt)["global_step"] == 3
    a, b = (load_file(d / "export" / "unet" / "diffusion_pytorch_model.safetensors") for d in (fsdp, ddp))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=1e-4, atol=1e-6), key
    la, lb = _losses(fsdp), _losses(ddp)
    assert len(la) == 3 and all(abs(la[k] - lb[k]) <= 1e-5 * abs(lb[k]) for k in la)


def _dcp_state(folder: Path, tmp: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, tmp)
    return torch.load(tmp, weights_only=False)


@pytest.mark.slow
def test_fsdp_resume_is_exact(tmp_path):
    """LCM (student, EMA target and teacher all sharded): 2 steps, then a resume to 4, equals 4 unbroken steps:
    every shard of the weights and optimizer states, the metadata (RNG, data position) and the loss curve."""
    from tests.test_resilience import _assert_same_state

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    proc = run_train(*LCM, "trainer=cpu_fsdp", f"hydra.run.dir={straight}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_train(*LCM, "trainer=cpu_fsdp", "trainer.max_steps=2", f"hydra.run.dir={resumed}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_train(*LCM, "trainer=cpu_fsdp", "ckpt_path=last", f"hydra.run.dir={resumed}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = (_dcp_state(d / "checkpoints" / "last.ckpt", tmp_path / f"{d.name}.pt") for d in (straight, resumed))
    assert any(k.startswith("target.") for k in a["state_dict"]) and "optimizer_0" in a
    assert not any(k.startswith("teacher_unet.") for k in a["state_dict"])  # the frozen teacher is rebuilt
    _assert_same_state(a, b, "sharded")
    ma, mb = (safe_load(d / "checkpoints" / "last.ckpt") for d in (straight, resumed))
    assert ma["global_step"] == mb["global_step"] == 4
    assert "RNGState" in ma["callbacks"]
    for key in ma["callbacks"]:  # RNG states of both ranks, non-finite guard, ... (a ModelCheckpoint names its run)
        if not key.startswith("ModelCheckpoint"):
            _assert_same_state(ma["callbacks"][key], mb["callbacks"][key], key)
    _assert_same_state(ma["loops"], mb["loops"], "loops")
    la, lb = _losses(straight), _losses(resumed)
    assert len(la) == 4 and la == {k: lb[k] for k in la}


def test_fsdp_refuses_a_mixture_of_experts(compose):
    from distill.config.validate import ConfigError, validate

    for student in ("moe_timestep", "moe_token"):
        with pytest.raises(ConfigError, match="trainer=fsdp with student .*moe.*use trainer=ddp"):
            validate(compose("+exp=consistency", "trainer=cpu_fsdp", f"student={student}"))


def test_a_sharded_save_killed_between_its_renames_resumes_from_the_previous_checkpoint(tmp_path):
    """ShardedStrategy.save_checkpoint renames last.ckpt to last.ckpt.old, then last.ckpt.tmp to last.ckpt: a kill
    between the two leaves no last.ckpt; the previous one is restored and the unfinished one removed."""
    folder = tmp_path / "checkpoints"
    for name, step in (("last.ckpt.old", 6), ("last.ckpt.tmp", 7), ("step_0000005.ckpt", 5)):
        (folder / name).mkdir(parents=True)
        torch.save({"global_step": step}, folder / name / "meta.pt")
        os.utime(folder / name, (1e9 + step, 1e9 + step))  # saved in step order
    path, checkpoint = resolve_resume(folder)
    assert path == folder / "last.ckpt" and checkpoint["global_step"] == 6
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step_0000005.ckpt"]


def test_sharded_metadata_loads_weights_only_whatever_the_caller_asks(tmp_path):
    """Lightning passes its own weights_only to the strategy; meta.pt (RNG states, loops, callbacks) is read
    weights-only anyway, as every other checkpoint: pickled code in it is refused, not run."""
    from torch.distributed.checkpoint import save

    from distill.utils.checkpoint import CheckpointError
    from distill.utils.sharding import ShardedStrategy

    class Boom:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    net = torch.nn.Module()
    net.student = torch.nn.Linear(2, 2)
    folder = tmp_path / "last.ckpt"
    save({"state_dict": net.state_dict()}, checkpoint_id=str(folder))  # one process: no process group needed
    torch.save({"global_step": 3, "x": Boom()}, folder / "meta.pt")
    strategy = ShardedStrategy()
    strategy.model = net
    with pytest.raises(CheckpointError, match="meta.pt .* not a weights-only checkpoint"):
        strategy.load_checkpoint(folder, weights_only=False)
    assert not (tmp_path / "pwned").exists()
    torch.save({"global_step": 3}, folder / "meta.pt")
    assert strategy.load_checkpoint(folder, weights_only=False) == {"global_step": 3}


def test_fsdp_refuses_progressive_distillation(tmp_path):
    proc = run_train("+exp=progressive", "trainer=cpu_fsdp", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and "trainer=fsdp does not run progressive distillation" in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_fsdp_strategy_options_train(tmp_path):
    """FSDP's mixed precision (bf16 parameters, fp32 reduction), activation checkpointing, ZeRO-2-like resharding
    and an unsharded teacher: 2 LCM steps run and log finite losses."""
    run_dir = tmp_path / "run"
    proc = run_train(*LCM, "trainer=cpu_fsdp", "trainer.max_steps=2", "trainer.strategy.param_dtype=bf16",
                     "trainer.strategy.reduce_dtype=fp32", "trainer.strategy.activation_checkpointing=true",
                     "trainer.strategy.reshard_after_forward=false", "trainer.strategy.shard_frozen=false",
                     f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = _losses(run_dir)
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses.values())
