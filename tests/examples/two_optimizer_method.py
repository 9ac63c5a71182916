"""A method with two roles, added from one file: a student generator and its critic, each with its own optimizer.

A least-squares GAN on the digits at 8x8 (Mao et al. 2017, eq. 9 with a = 0, b = c = 1): the student G maps
noise to images, the critic D scores them; it writes only its two losses, the base (``DistillMethod.add_role``)
alternates the updates. Built from a Hydra node as every method is (optimizers as partials)::

    _target_: tests.examples.two_optimizer_method.TwoOptimizerMethod
    optimizer: {_target_: torch.optim.Adam, _partial_: true, lr: 1.0e-3}
    critic_optimizer: {_target_: torch.optim.Adam, _partial_: true, lr: 1.0e-3}
    critic_updates_per_step: 3

and the student from ``{_target_: tests.examples.two_optimizer_method.tiny_generator}``. ``fit`` trains it through
the real Trainer with the callbacks ``distill.train`` adds (EMA, checkpoints, RNG state, preemption, non-finite
guard). The file registers the method and its student, so that the command line selects them::

    DISTILL_PLUGINS=tests.examples.two_optimizer_method python -m distill.train method=two_optimizer \\
        student=tiny_generator teacher=none data.resolution=8 'method.optimizer={_target_:torch.optim.Adam,_partial_:true}' \\
        'method.critic_optimizer={_target_:torch.optim.Adam,_partial_:true}'

As a script it is the process the resume test kills, and the data-parallel run (2 CPU processes, each rank's
final state saved as ``RUN_DIR/state_rank<r>.pt``)::

    python -m tests.examples.two_optimizer_method RUN_DIR STEPS CRITIC_UPDATES [resume | ddp:2:same | ddp:2:split]
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from distill.data.latents import batch_size_of
from distill.methods import METHODS
from distill.methods.base import DistillMethod
from distill.students import STUDENTS

LATENT_DIM, RESOLUTION = 16, 8


@STUDENTS.register("tiny_generator")
def tiny_generator(latent_dim: int = LATENT_DIM, resolution: int = RESOLUTION, width: int = 64) -> nn.Module:
    """z (N, latent_dim) -> images (N, 1, R, R) in [-1, 1]."""
    return nn.Sequential(nn.Linear(latent_dim, width), nn.SiLU(), nn.Linear(width, resolution * resolution), nn.Tanh(),
                         nn.Unflatten(1, (1, resolution, resolution)))


@METHODS.register("two_optimizer")
class TwoOptimizerMethod(DistillMethod):
    """The student G and the critic D; ``nonfinite_critic_at_updates`` makes those critic updates' losses NaN
    (fault injection for the non-finite guard's test); ``sampling`` is what ``distill.train`` passes every method
    (this one does not sample)."""

    def __init__(self, student: nn.Module, optimizer: Callable, critic_optimizer: Callable,
                 lr_scheduler: Callable | None = None, critic_lr_scheduler: Callable | None = None, *,
                 critic_updates_per_step: int = 1, critic_width: int = 64, resolution: int = RESOLUTION,
                 nonfinite_critic_at_updates: tuple[int, ...] = (), sampling: dict | None = None):
        super().__init__(optimizer, lr_scheduler)
        self.student = student
        self.latent_dim = student[0].in_features
        self.critic = nn.Sequential(nn.Flatten(), nn.Linear(resolution * resolution, critic_width), nn.SiLU(),
                                    nn.Linear(critic_width, 1))
        self.add_role("critic", critic_optimizer, critic_lr_scheduler, updates_per_step=critic_updates_per_step)
        self.nonfinite_critic_at_updates = set(nonfinite_critic_at_updates)

    def fakes(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        return self.student(torch.randn(n, self.latent_dim, generator=generator).to(self.device))

    def loss(self, batch: dict, generator: torch.Generator | None = None) -> torch.Tensor:
        """The student's: (D(G(z)) - 1)^2."""
        return (self.critic(self.fakes(batch_size_of(batch), generator)) - 1).pow(2).mean()

    def critic_loss(self, batch: dict) -> torch.Tensor:
        """The critic's: (D(x) - 1)^2 + D(G(z))^2, the fakes detached."""
        with torch.no_grad():
            fakes = self.fakes(batch_size_of(batch))
        loss = (self.critic(batch["pixel_values"]) - 1).pow(2).mean() + self.critic(fakes).pow(2).mean()
        if self.role_updates["critic"] in self.nonfinite_critic_at_updates:
            loss = loss * float("nan")
        return loss


def method_from_config(critic_updates_per_step: int, **options):
    """The method instantiated from its Hydra node, as ``distill.train`` does (``_partial_``, then the student)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    node = OmegaConf.create({
        "_target_": f"{__name__}.TwoOptimizerMethod",
        "optimizer": {"_target_": "torch.optim.Adam", "_partial_": True, "lr": 1.0e-3},
        "critic_optimizer": {"_target_": "torch.optim.Adam", "_partial_": True, "lr": 1.0e-3, "betas": [0.5, 0.9]},
        "lr_scheduler": {"_target_": "distill.methods.base.warmup_cosine", "_partial_": True, "warmup_steps": 2,
                         "total_steps": 10},
        "critic_lr_scheduler": {"_target_": "torch.optim.lr_scheduler.StepLR", "_partial_": True, "step_size": 3,
                                "gamma": 0.5},
        "critic_updates_per_step": critic_updates_per_step, **options,
    })
    student = instantiate({"_target_": f"{__name__}.tiny_generator"})
    return instantiate(node, _partial_=True, _convert_="all")(student=student)


def fit(run_dir: Path, max_steps: int, critic_updates_per_step: int, resume: bool = False, seed: int = 0,
        ema_half_life_images: float = 64, inject_nonfinite_at_steps: tuple[int, ...] = (), callbacks: tuple = (),
        devices: int = 1, same_batches: bool = True, **options):
    """Train ``max_steps`` steps in ``run_dir`` with the callbacks of ``distill.train`` (a checkpoint every step)
    and ``callbacks``; ``resume``: from the newest checkpoint there. ``devices`` > 1: that many CPU processes under
    ``strategy="ddp"`` as ``distill.train`` adopts it, each rank drawing the same batches
    (``same_batches``) or its own share of the data (the distributed sampler). Returns (method, trainer)."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from distill.callbacks.ema import EMA
    from distill.callbacks.resilience import (
        FinalCheckpoint,
        NonFiniteGuard,
        Preemption,
        RNGState,
        RunIdentity,
    )
    from distill.utils.checkpoint import AtomicCheckpointIO, resolve_resume
    from distill.utils.loggers import ResumableCSVLogger
    from distill.worlds.digits.data import DigitsDataModule

    ckpt_dir = run_dir / "checkpoints"
    ckpt_path = str(resolve_resume(str(ckpt_dir))[0]) if resume else None
    L.seed_everything(seed, workers=True)
    datamodule = DigitsDataModule(resolution=RESOLUTION, batch_size=16)
    method = method_from_config(critic_updates_per_step, **options)
    callbacks = [FinalCheckpoint(), EMA(half_life_images=ema_half_life_images, rampup_ratio=None),
                 ModelCheckpoint(dirpath=ckpt_dir, filename="step_{step:07d}", every_n_train_steps=1, save_top_k=-1,
                                 save_last=True, monitor="step", mode="max", auto_insert_metric_name=False),
                 RNGState(), RunIdentity(), Preemption(), NonFiniteGuard(3, list(inject_nonfinite_at_steps)), *callbacks]
    settings = {"gradient_clip_val": 1.0, "strategy": "ddp" if devices > 1 else "auto"}  # the method adopts them
    settings.update(method.adopt_trainer_settings(1.0, None, 1, settings["strategy"]))
    logger = ResumableCSVLogger(save_dir=str(run_dir), name="csv", version="", flush_logs_every_n_steps=1)
    trainer = L.Trainer(accelerator="cpu", devices=devices, max_steps=max_steps, max_epochs=-1, limit_val_batches=0,
                        log_every_n_steps=1, callbacks=callbacks, logger=logger, plugins=[AtomicCheckpointIO()],
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(run_dir),
                        use_distributed_sampler=not same_batches, **settings)
    trainer.fit(method, datamodule=datamodule, ckpt_path=ckpt_path)
    return method, trainer


if __name__ == "__main__":
    torch.set_num_threads(1)
    if len(sys.argv) > 4 and sys.argv[4].startswith("ddp"):  # RUN_DIR STEPS CRITIC_UPDATES ddp:DEVICES:same|split
        _, devices, batches = sys.argv[4].split(":")
        method, trainer = fit(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), devices=int(devices),
                              same_batches=batches == "same")
        torch.save({**method.state_dict(), "role_updates": dict(method.role_updates)},
                   Path(sys.argv[1]) / f"state_rank{trainer.global_rank}.pt")
    else:
        fit(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), resume=len(sys.argv) > 4 and sys.argv[4] == "resume")
