"""What every method shares: optimizers from partials, sampling, export."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import lightning as L
import torch

from distill.data.latents import (
    batch_size_of,
    encode_latents,  # noqa: F401  (its old home: methods and tests import it here)
)
from distill.diffusion.noise import (
    NoiseOptions,
    TimeSampler,
    antithetic_noise,
    distinct_rows,
    lognormal_bin_probabilities,
    pair_rows,
)
from distill.utils.seeding import global_rng_seeded_by


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_ratio: float = 0.1):
    """Linear warm-up to the base LR, then cosine decay to ``min_ratio`` of it at ``total_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / max(1, warmup_steps)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@torch.no_grad()
def pipeline_images(pipe, captions: list[str], generator: torch.Generator, num_inference_steps: int | None = None,
                    guidance_scale: float | None = None) -> torch.Tensor:
    """Images (N, C, H, W) in [-1, 1] from a pipeline at its denoiser's native size, in eval mode (``None``: the
    pipeline's default step count or guidance)."""
    from distill.families import denoiser_of, native_size

    denoiser = denoiser_of(pipe)
    was_training = denoiser.training
    denoiser.eval()
    size = native_size(pipe)
    with global_rng_seeded_by(generator):  # a stock flow pipeline's scheduler steps draw from the global RNG
        images = pipe(list(captions), num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                      height=size, width=size, generator=generator, output_type="pt").images
    denoiser.train(was_training)
    return images * 2.0 - 1.0


FROZEN_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_NOISE = NoiseOptions()  # method.noise's defaults (NoiseOptions); never mutated


def _plateau_monitor(scheduler, key: str) -> dict:
    """What Lightning needs to step a ``ReduceLROnPlateau`` schedule under automatic optimization: the logged loss
    it watches, every step (``lr_scheduler_step`` averages it over the ranks); nothing for any other schedule
    (several roles step theirs in ``update_roles``). Lightning steps it after the step's checkpoint callbacks, so a
    checkpoint of step N holds the schedule before step N's update (resumed runs step it at N + 1 with N + 1's
    loss: one decision fewer); several roles step theirs inside the step, before any checkpoint."""
    return {"monitor": key} if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) else {}


def finds_unused_parameters(strategy) -> bool:
    """Whether a Lightning strategy is DDP told to find unused parameters (what several roles need: each role's
    backward reaches only its own network)."""
    from lightning.pytorch.strategies import DDPStrategy

    return isinstance(strategy, DDPStrategy) and bool(strategy._ddp_kwargs.get("find_unused_parameters"))


def _check_compile_supported(device: torch.device | None = None) -> None:
    """torch.compile runs here: dynamo supports the platform and, on CPU, a C++ compiler is on the PATH."""
    import os
    import shutil

    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        raise ValueError("method.compile=true: torch.compile is not supported on this platform/Python "
                         f"(torch {torch.__version__}); set method.compile=false")
    compilers = [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
    if device is not None and device.type == "cpu" and not any(c and shutil.which(c) for c in compilers):
        raise ValueError("method.compile=true on CPU needs a C++ compiler (g++ or clang++, or $CXX) for inductor's "
                         "kernels; install one or set method.compile=false")


def cpu_has_bf16() -> bool:
    """Whether this CPU has native bfloat16 arithmetic (AVX512-BF16 or AMX); elsewhere oneDNN emulates it, slower."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


@dataclass(frozen=True)
class Role:
    """A network that trains with its own optimizer: ``getattr(method, name)``, its loss ``<name>_loss(batch)``,
    its optimizer and LR schedule (partials, as ``method.optimizer``: params -> optimizer, optimizer -> scheduler)
    and its updates per training step (the student's is 1: a step is one student update)."""

    name: str
    optimizer: Callable
    lr_scheduler: Callable | None = None
    updates_per_step: int = 1


class DistillMethod(L.LightningModule):
    """Base of every method: ``self.student`` is what trains; ``optimizer``/``lr_scheduler`` are partials.

    Training-speed switches, the same for every method (measured in BENCHMARKS.md, bench/train_speed.py):
    ``compile`` runs the student and the frozen networks through ``torch.compile`` (in place, so checkpoint
    keys do not change); ``frozen_dtype`` ("bf16"/"fp16") runs the frozen teacher under autocast in that dtype, its
    outputs returned in float32 (a consistency target runs at the student's precision, so that the residual
    f_student - f_target compares like with like: measured at initialisation, a bf16 target moves the target by
    ~57% of the residual, a bf16 teacher by 1.4-5.9%; the VAE encodes in float32: its latents are the data);
    ``channels_last`` stores the convolution weights channels-last; ``latent_cache`` trains from the frozen VAE's posterior of every training image,
    encoded once into ``latent_cache_dir`` (distill.data.latents) instead of encoding every batch; a streamed
    training set (webdataset) cannot be cached and is encoded in the data workers instead.
    The student's own precision is Lightning's ``trainer.precision`` (e.g. bf16-mixed).

    ``noise`` (``method.noise``, ``distill.diffusion.noise.NoiseOptions``): how each step draws its noise
    (``draw_noise``: antithetic pairs) and its times (``draw_time_bins``: stratified, importance-sampled with
    unbiasing weights); a method passes its time grid's noise levels and weights its per-example losses. With
    antithetic pairs a method's loss pairs its batch first (``paired_batch``) and its other per-example draws (the
    guidance scale, the condition dropout: ``paired``), so that a pair differs only in the sign of its noise.

    Networks and optimizers by role: ``optimizer``/``lr_scheduler`` are the student's; a method with a critic or a
    discriminator sets ``self.critic`` and calls ``add_role("critic", critic_optimizer, critic_lr_scheduler,
    updates_per_step=critic_updates_per_step)`` (its constructor's arguments named so), and writes ``loss`` (the
    student's, also the validation loss) and ``critic_loss(batch)``. With the student alone, Lightning optimizes
    automatically, as it always did. With several roles the base optimizes manually: each training step runs, on
    its one batch, ``updates_per_step`` updates of each other role in the order they were added, then the student's
    update (each: zero its gradients, its loss with only its parameters requiring gradients, backward, the non-finite
    guard, clipping at the trainer's ``gradient_clip_val`` (``adopt_trainer_settings``), its optimizer step), then
    steps each role's LR schedule once. One step is one student update, whatever the other roles' ratios:
    ``trainer.global_step``, ``trainer.max_steps``, checkpoint names, the loggers' step, the EMA, the LR schedules'
    step counts (e.g. ``total_steps: ${trainer.max_steps}``) all count student updates. Each role's optimizer and
    schedule state and update count are in the checkpoint; its random numbers come from the global generators,
    which the checkpoint holds too (``RNGState``), so a resume is bit-exact. Gradient accumulation is refused there.
    Under DDP every update's gradients are averaged over the ranks (Lightning prepares the reducer for each manual
    backward; the strategy must find unused parameters); sharded (FSDP) training of several roles is refused.
    """

    def __init__(self, optimizer: Callable, lr_scheduler: Callable | None = None, *, compile: bool = False,
                 frozen_dtype: Literal["bf16", "fp16"] | None = None, channels_last: bool = False,
                 latent_cache: bool = False, latent_cache_dir: str = "~/.cache/distill/latents",
                 noise: NoiseOptions = DEFAULT_NOISE):
        super().__init__()
        self.noise = NoiseOptions.of(noise)
        self._time_sampler: TimeSampler | None = None
        self._time_sampler_key: tuple | None = None
        self._pending_time_sampler_state: dict | None = None  # a resumed adaptive history, until the first draw
        if frozen_dtype is not None and frozen_dtype not in FROZEN_DTYPES:
            raise ValueError(f"method.frozen_dtype={frozen_dtype!r}; use one of {sorted(FROZEN_DTYPES)} or null (float32)")
        if compile:
            _check_compile_supported()
        self.optimizer_factory = optimizer  # the student's role (``roles``)
        self.lr_scheduler_factory = lr_scheduler
        self._other_roles: dict[str, Role] = {}  # add_role
        self.role_updates: dict[str, int] = {"student": 0}  # updates run under manual optimization (checkpointed)
        self.gradient_clip_val: float | None = None  # manual optimization: the trainer's (adopt_trainer_settings)
        self.gradient_clip_algorithm: str | None = None
        self.compile_networks, self.frozen_dtype, self.channels_last = compile, frozen_dtype, channels_last
        self.latent_cache, self.latent_cache_dir = latent_cache, latent_cache_dir
        self._frozen_autocast_dtype = FROZEN_DTYPES.get(frozen_dtype)

    # ------------------------------------------------------------------ noise and time sampling (method.noise)

    @property
    def antithetic(self) -> bool:
        """Whether this loss draws antithetic pairs: ``method.noise.antithetic`` in training (a validation loss
        evaluates every example of its batch, with i.i.d. noise)."""
        return self.noise.antithetic and self.training

    def distinct_rows(self, n: int) -> int:
        """How many rows of a batch of ``n`` draw their own times, scales and examples: ceil(n/2) with antithetic
        pairs (the rest repeat them, ``paired``), else n."""
        return distinct_rows(n) if self.antithetic else n

    def paired(self, x, n: int | None = None):
        """With antithetic pairs, ``x``'s rows for a batch of ``n`` (default ``len(x)``): row i + ceil(n/2) repeats
        row i (``distill.diffusion.noise.pair_rows``); ``x`` itself otherwise."""
        return pair_rows(x, n) if self.antithetic else x

    def paired_batch(self, batch: dict) -> dict:
        """The batch with every per-example entry (a tensor or list of N rows: images, cached latents, captions)
        ``paired``: the examples of the antithetic pairs (the batch itself without them)."""
        if not self.antithetic:
            return batch
        from distill.data.latents import batch_size_of

        n = batch_size_of(batch)
        per_example = {k for k, v in batch.items()
                       if isinstance(v, torch.Tensor) and v.ndim > 0 and len(v) == n or isinstance(v, (list, tuple)) and len(v) == n}
        return {k: pair_rows(v) if k in per_example else v for k, v in batch.items()}

    def draw_noise(self, like: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Standard normal noise shaped and placed as ``like``: i.i.d., or antithetic pairs (eps, -eps)."""
        if self.antithetic:
            return antithetic_noise(tuple(like.shape), generator).to(like)
        return torch.randn(like.shape, generator=generator).to(like)

    def time_sampler(self, sigmas: torch.Tensor, target: torch.Tensor | None = None, stage: int = 0) -> TimeSampler:
        """The sampler of the method's K time bins whose noise levels (ascending, sigma = sqrt((1 - abar) / abar))
        are ``sigmas`` and whose own distribution is ``target`` (uniform when None); rebuilt, its history
        cleared, when the grid or the ``stage`` changes (a progressive round, iCT's curriculum)."""
        key = (stage, len(sigmas), None if target is None else tuple(target.double().tolist()))
        if self._time_sampler is None or self._time_sampler_key != key:
            o = self.noise
            probs = lognormal_bin_probabilities(sigmas.detach().double().cpu(), o.p_mean, o.p_std) \
                if o.timesteps == "lognormal" else None
            sampler = TimeSampler(len(sigmas), o.timesteps, o.stratified, probs=probs, history=o.history,
                                  uniform_mix=o.uniform_mix, target=None if target is None else target.cpu())
            pending = self._pending_time_sampler_state
            if pending is not None and pending["counts"].shape == sampler.counts.shape:
                sampler.load_state_dict(pending)  # resumed: the history the checkpoint holds
            self._pending_time_sampler_state = None
            self._time_sampler, self._time_sampler_key = sampler, key
        return self._time_sampler

    def draw_time_bins(self, n: int, sigmas: torch.Tensor, generator: torch.Generator | None = None,
                       target: torch.Tensor | None = None, stage: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(bins, weights) for ``n`` examples over the bins of noise levels ``sigmas`` (see ``time_sampler``):
        bins on the CPU; weights p / q in float32, or None when every weight is 1 (no importance sampling).
        Outside training (a validation loss) the bins come from the method's own distribution, unweighted."""
        if not self.training:
            target = None if target is None else target.cpu()
            return TimeSampler(len(sigmas), "default", self.noise.stratified, target=target).sample(n, generator)[0], None
        # antithetic pairs: the distinct rows draw (stratified over them), their partners repeat the draws
        bins, weights = self.time_sampler(sigmas, target, stage).sample(self.distinct_rows(n), generator)
        bins, weights = self.paired(bins, n), self.paired(weights, n)
        return bins, (None if self.noise.timesteps == "default" else weights.float())

    def record_time_losses(self, bins: torch.Tensor, losses: torch.Tensor) -> None:
        """Feed the adaptive proposal each example's unweighted loss (all ranks' under data parallelism, so that
        every rank draws from the same proposal)."""
        if self.noise.timesteps != "adaptive" or self._time_sampler is None:
            return
        bins, losses = bins.to(losses.device), losses.detach().float()
        trainer = self._trainer
        if trainer is not None and trainer.world_size > 1:
            bins, losses = self.all_gather(bins).flatten(), self.all_gather(losses).flatten()
        self._time_sampler.update(bins.cpu(), losses.cpu())

    def weighted_mean(self, per_example: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        """The batch loss: the mean of the per-example losses times their importance weights (if any)."""
        if weights is not None:
            per_example = per_example * weights.to(per_example)
        return per_example.mean()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if not self.automatic_optimization:  # Lightning's own keys hold every role's optimizer and schedule
            checkpoint["role_updates"] = dict(self.role_updates)
        if self.noise.timesteps != "adaptive":
            return
        if self._time_sampler is not None:
            checkpoint["time_sampler"] = self._time_sampler.state_dict()
        elif self._pending_time_sampler_state is not None:  # resumed, saved before a draw
            checkpoint["time_sampler"] = self._pending_time_sampler_state

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.role_updates.update(checkpoint.get("role_updates", {}))
        state = checkpoint.get("time_sampler")
        if state is not None and self.noise.timesteps == "adaptive":
            self._pending_time_sampler_state = state  # the grid is known at the first draw
            self._time_sampler = None

    # ------------------------------------------------------------------ speed switches

    def frozen_networks(self) -> list[torch.nn.Module]:
        """The frozen networks run every step (teacher, consistency target): what ``compile``/``channels_last``
        also apply to."""
        return []

    def prepare_network(self, module: torch.nn.Module) -> torch.nn.Module:
        """``module`` channels-last and compiled as the switches say (in place; its state_dict keys unchanged)."""
        if self.channels_last:
            module.to(memory_format=torch.channels_last)
        if self.compile_networks:
            module.compile()
        return module

    def frozen_autocast(self, enabled: bool = True):
        """Autocast in ``frozen_dtype`` around a frozen network's pass (a no-op without it or unless ``enabled``)."""
        from contextlib import nullcontext

        if self._frozen_autocast_dtype is None or not enabled:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self._frozen_autocast_dtype)

    def _check_frozen_dtype(self) -> None:
        """bf16/fp16 autocast where the device runs it; bf16 on a CPU without native bf16 falls back to float32
        with a warning (it would be slower, not wrong)."""

        dtype, device = self._frozen_autocast_dtype, self.device
        if dtype is None:
            return
        if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise ValueError(f"method.frozen_dtype=bf16 but {torch.cuda.get_device_name(device)} has no bfloat16; "
                             "use method.frozen_dtype=fp16 or null")
        if device.type == "cpu" and dtype == torch.bfloat16 and not cpu_has_bf16():
            logging.getLogger(__name__).warning("method.frozen_dtype=bf16: this CPU has no native bfloat16; the frozen "
                                                "networks stay in float32")
            self._frozen_autocast_dtype = None

    def configure_model(self) -> None:
        """Under ``trainer=fsdp`` (``distill.utils.sharding.ShardedStrategy``), shard the networks; otherwise
        nothing (the networks are built in ``__init__``)."""
        from distill.utils.sharding import strategy_of

        strategy = strategy_of(self._trainer)
        if strategy is not None:
            strategy.shard(self)

    def on_fit_start(self) -> None:
        """After the strategy has moved the networks to their device (``setup`` runs before): check the dtype and
        compiler there, prepare the networks, and encode the latent cache on that device."""
        self._check_frozen_dtype()
        if self.compile_networks:
            _check_compile_supported(self.device)
        if self.compile_networks or self.channels_last:
            for module in [self.student, *self.frozen_networks()]:
                self.prepare_network(module)
        if self.latent_cache:
            self._attach_latent_cache()

    def check_latent_cache(self, datamodule) -> None:
        """With ``latent_cache``: a VAE to encode with and a map-style training set to encode (checked before
        any compute)."""
        if not self.latent_cache:
            return
        if getattr(self, "vae", None) is None:
            raise ValueError("method.latent_cache=true needs a VAE: this method trains in pixel space; set it to false")
        if datamodule is None or not (hasattr(datamodule, "train_set") or hasattr(datamodule, "encode_in_workers")):
            raise ValueError(f"method.latent_cache=true needs a map-style data module with a train_set (the embedded "
                             f"default world's, imagefolder) or a stream that encodes in its workers (webdataset); "
                             f"{type(datamodule).__name__} is neither: set method.latent_cache=false")

    def _attach_latent_cache(self) -> None:
        from distill.data.latents import CachedLatentDataset, cached_latents

        datamodule, vae = self.trainer.datamodule, self.vae
        self.check_latent_cache(datamodule)
        if not hasattr(datamodule, "train_set"):  # a stream: nothing to cache, encode in the data workers instead
            from distill.data.latents import PosteriorEncoder

            workers = getattr(datamodule, "num_workers", 0)
            if not workers:
                logging.getLogger(__name__).warning(
                    "method.latent_cache=true on a stream with data.num_workers=0: nothing to cache, and no worker to "
                    "encode in; the VAE encodes in the training step as without it. Set data.num_workers > 0")
                return
            logging.getLogger(__name__).info("streamed data: the frozen VAE's encoder runs in the %d data workers "
                                             "(float32, CPU)", workers)
            datamodule.encode_in_workers(PosteriorEncoder(vae))
            return
        if isinstance(datamodule.train_set, CachedLatentDataset):  # a second fit on the same data module
            return
        # one process per node builds (the cache folder may be local to each node); the others wait and read it
        builder = self.trainer.local_rank == 0
        if builder:
            cached = cached_latents(datamodule.train_set, vae, self.latent_cache_dir, build=True)
        self.trainer.strategy.barrier("latent_cache")
        if not builder:
            cached = cached_latents(datamodule.train_set, vae, self.latent_cache_dir, build=False)
        datamodule.train_set = cached

    def latents(self, batch: dict, generator: torch.Generator | None = None) -> torch.Tensor:
        """The batch in the diffusion space: a draw from the cached VAE posterior (``latent_mean``/``latent_std``,
        the same draw ``encode`` makes with the same generator) scaled by the method's ``family``, or ``encode`` of its
        images; ``paired`` (the rows of a ``paired_batch`` share their posterior draw too)."""
        if "latent_mean" in batch:
            mean, std = batch["latent_mean"], batch["latent_std"]
            noise = torch.randn(mean.shape, generator=generator).to(mean)
            return self.paired(self.family.scale_latents(mean + std * noise))
        return self.paired(self.encode(batch["pixel_values"], generator))

    def encode(self, pixels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Images (N, C, H, W) -> the diffusion space; each method with a VAE or pixel space defines it."""
        raise NotImplementedError

    def add_student_aux_loss(self, loss: torch.Tensor, batch_size: int) -> torch.Tensor:
        """``loss`` plus the auxiliary loss of a mixture-of-experts student's last own forward (router load
        balancing, z-loss; a stop-gradient target pass does not replace it), whose router statistics
        (expert load overall and per noise level) are logged on logging steps only (reading them to the host
        is a device sync)."""
        from distill.models.moe import moe_aux_and_stats

        aux, stats = moe_aux_and_stats(self.student, with_stats=self._logging_step())
        if stats:
            self.log_dict(stats, batch_size=batch_size)
        if aux is None:
            return loss
        self.log("train/aux_loss", aux, batch_size=batch_size)
        return loss + aux

    def _logging_step(self) -> bool:
        """Whether Lightning writes this step's logged values (every ``trainer.log_every_n_steps``, and at the
        end); True outside a trainer."""
        trainer = self._trainer
        if trainer is None:
            return True
        connector = getattr(trainer, "_logger_connector", None)
        return bool(getattr(connector, "should_update_logs", True))

    def trainable_parameters(self):
        return [p for p in self.student.parameters() if p.requires_grad]

    def _optimizer_factory(self, factory: Callable | None = None) -> Callable:
        """The configured optimizer (``factory``, default the student's), without ``fused=True`` where a fused
        kernel cannot run: under ``16-mixed`` (Lightning's gradient scaler refuses to clip a fused optimizer, and
        owns its skip flag) and on devices without fused kernels (XLA); said in the log, never silently."""
        import functools

        factory = self.optimizer_factory if factory is None else factory
        keywords = getattr(factory, "keywords", None) or {}
        if self.device.type == "xla" and getattr(factory, "func", None) is not None:
            # XLA: torch_xla's sync-free optimizer, so that a non-finite step is skipped without a host read
            from distill.utils.xla import sync_free_optimizer

            logging.getLogger(__name__).info("XLA device: %s runs as torch_xla's sync-free variant",
                                             factory.func.__name__)
            rest = {k: v for k, v in keywords.items() if k not in ("fused", "foreach")}
            return functools.partial(sync_free_optimizer(factory.func), *factory.args, **rest)
        if not keywords.get("fused"):
            return factory
        trainer = self._trainer
        scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None) if trainer is not None else None
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        device = self.device.type
        reason = ("trainer.precision=16-mixed scales gradients with a GradScaler" if scaler is not None else
                  f"the {device} device has no fused optimizer kernels"
                  if device not in _get_fused_kernels_supported_devices() else None)
        if reason is None:
            return factory
        logging.getLogger(__name__).warning("method.optimizer.fused=true: %s; using the unfused optimizer", reason)
        return functools.partial(factory.func, *factory.args, **{**keywords, "fused": False})

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Lightning's mixed-precision plugin refuses to clip a fused optimizer because a gradient scaler would
        unscale inside its step; without a scaler (bf16-mixed, or 16-mixed on CPU) there is nothing to unscale,
        so the gradients are clipped as in full precision."""
        plugin = self.trainer.precision_plugin
        if gradient_clip_val and hasattr(plugin, "scaler") and plugin.scaler is None:
            from lightning.pytorch.plugins.precision import Precision
            from lightning.pytorch.utilities import GradClipAlgorithmType

            algorithm = GradClipAlgorithmType(gradient_clip_algorithm or "norm")
            Precision.clip_gradients(plugin, optimizer, gradient_clip_val, algorithm)
            return
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self):
        if not self.automatic_optimization:
            return self._configure_role_optimizers()
        optimizer = self._optimizer_factory()(self.trainable_parameters())
        if self.lr_scheduler_factory is None:
            return optimizer
        scheduler = self.lr_scheduler_factory(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step",
                                                         **_plateau_monitor(scheduler, "train/loss")}}

    # ------------------------------------------------------------------ networks and optimizers by role

    @property
    def roles(self) -> dict[str, Role]:
        """Every trained network by role, in the order of their optimizers: the student's, then ``add_role``'s."""
        student = Role("student", self.optimizer_factory, self.lr_scheduler_factory)
        return {"student": student, **self.__dict__.get("_other_roles", {})}

    @property
    def automatic_optimization(self) -> bool:
        """Lightning's automatic optimization with the student alone; the base's manual one with several roles."""
        return not self.__dict__.get("_other_roles")

    def add_role(self, name: str, optimizer: Callable, lr_scheduler: Callable | None = None, *,
                 updates_per_step: int = 1) -> None:
        """Train ``self.<name>`` (set before the fit) with ``optimizer`` (params -> optimizer) and ``lr_scheduler``
        (optimizer -> scheduler, stepped once per training step), ``updates_per_step`` times per student update,
        on the loss ``<name>_loss(batch)``; errors name the constructor's ``<name>_*`` arguments."""
        if name == "student" or name in self._other_roles:
            raise ValueError(f"role {name!r} is already declared ({', '.join(self.roles)}); give the network another name")
        if isinstance(updates_per_step, bool) or not isinstance(updates_per_step, int) or updates_per_step < 1:
            raise ValueError(f"method.{name}_updates_per_step={updates_per_step!r} must be an integer >= 1 ({name} "
                             "updates per student update)")
        if not callable(optimizer):
            raise ValueError(f"method.{name}_optimizer={optimizer!r} is not an optimizer partial; give one with "
                             "_target_ (e.g. torch.optim.AdamW) and _partial_: true")
        if not callable(getattr(self, f"{name}_loss", None)):
            raise TypeError(f"{type(self).__name__} declares the role {name!r} but defines no {name}_loss(batch)")
        self._other_roles[name] = Role(name, optimizer, lr_scheduler, updates_per_step)
        self.role_updates[name] = 0

    def role_parameters(self, name: str) -> list[torch.nn.Parameter]:
        """What role ``name``'s optimizer trains: ``trainable_parameters`` for the student, else every parameter
        of ``self.<name>`` that requires gradients."""
        if name == "student":
            return self.trainable_parameters()
        network = getattr(self, name, None)
        if not isinstance(network, torch.nn.Module):
            raise TypeError(f"{type(self).__name__} declares the role {name!r} but self.{name} is "
                            f"{type(network).__name__}, not a network")
        return [p for p in network.parameters() if p.requires_grad]

    @staticmethod
    def role_loss_key(name: str) -> str:
        """The logged training loss of role ``name``."""
        return "train/loss" if name == "student" else f"train/{name}_loss"

    def lr_scheduler_step(self, scheduler, metric) -> None:
        """Step ``scheduler``; a ``ReduceLROnPlateau`` on ``metric`` averaged over the ranks, so that every rank
        takes the same decision (a rank's own loss would give each replica its own learning rate)."""
        if not isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            scheduler.step()
            return
        metric = torch.as_tensor(metric, dtype=torch.float32, device=self.device)
        if self.trainer.world_size > 1:
            metric = self.trainer.strategy.reduce(metric, reduce_op="mean")
        scheduler.step(float(metric))

    def role_of(self, optimizer) -> str:
        """The role that ``optimizer`` (a torch optimizer, or Lightning's wrapper of one) updates."""
        optimizer = getattr(optimizer, "optimizer", optimizer)
        for name, own in zip(self.roles, self.trainer.optimizers):
            if own is optimizer:
                return name
        raise KeyError(f"{type(optimizer).__name__} is none of {type(self).__name__}'s optimizers ({', '.join(self.roles)})")

    def student_loss(self, batch: dict) -> torch.Tensor:
        """The student's training loss: ``loss``."""
        return self.loss(batch)

    def loss(self, batch: dict, generator: torch.Generator | None = None) -> torch.Tensor:
        """The method's (the student's) training objective on ``batch``; randomness from ``generator``."""
        raise NotImplementedError

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor | None:
        """One student update: under automatic optimization the student's loss (plus a mixture's auxiliary loss)
        for Lightning to step; with several roles, every role's updates (``update_roles``)."""
        if not self.automatic_optimization:
            return self.update_roles(batch)
        n = batch_size_of(batch)
        loss = self.student_loss(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=n)
        return self.add_student_aux_loss(loss, n)

    def update_roles(self, batch: dict) -> None:
        """One training step on ``batch``: each other role's ``updates_per_step`` updates in the order they were
        added, then the student's update (during the others' updates ``global_step`` is this step's index, as in
        an automatic step), then each LR schedule's step (a ``ReduceLROnPlateau`` on the role's last loss)."""
        optimizers = dict(zip(self.roles, self.optimizers()))
        n = batch_size_of(batch)
        for role in [*self._other_roles.values(), self.roles["student"]]:
            for _ in range(role.updates_per_step):
                self._update(role.name, optimizers[role.name], batch, n)
        for name, scheduler in self._role_schedulers.items():
            # a plateau schedule on the role's loss of its last update this step
            self.lr_scheduler_step(scheduler, self._last_role_loss.get(name))

    def _update(self, name: str, optimizer, batch: dict, n: int) -> None:
        """One update of role ``name``: only its parameters require gradients meanwhile. The student steps through
        Lightning's optimizer wrapper (which counts ``global_step``), the others through the strategy directly:
        the same precision plugin (scaler), callbacks (the non-finite guard) and clipping, uncounted."""
        with self.toggled_optimizer(optimizer):
            optimizer.zero_grad()
            loss = getattr(self, f"{name}_loss")(batch)
            self.log(self.role_loss_key(name), loss, prog_bar=name == "student", batch_size=n)
            self._last_role_loss[name] = loss.detach()
            if name == "student":
                loss = self.add_student_aux_loss(loss, n)
            self.manual_backward(loss)
            if name == "student":
                optimizer.step()
            else:
                from lightning.pytorch.core.optimizer import do_nothing_closure

                self.trainer.strategy.optimizer_step(optimizer.optimizer, do_nothing_closure, model=self)
        self.role_updates[name] += 1

    def _configure_role_optimizers(self) -> tuple[list, list]:
        """One optimizer per role, in role order, and the LR schedulers of those that have one (stepped by
        ``update_roles``; Lightning steps none under manual optimization, but checkpoints and restores them)."""
        if self.trainer.world_size > 1 and not finds_unused_parameters(self.trainer.strategy):
            raise ValueError(f"{type(self).__name__} trains several roles ({', '.join(self.roles)}) over "
                             f"{self.trainer.world_size} processes with {type(self.trainer.strategy).__name__}: each "
                             "role's backward leaves the other roles' parameters without gradients, which DDP must "
                             "be told of; use trainer.strategy=ddp_find_unused_parameters_true (what distill.train "
                             "picks for trainer=ddp), or trainer.devices=1")
        optimizers, schedulers, owner = [], [], {}
        self._role_schedulers, self._last_role_loss = {}, {}
        for role in self.roles.values():
            params = self.role_parameters(role.name)
            for p in params:
                if owner.setdefault(id(p), role.name) != role.name:
                    raise ValueError(f"a parameter of role {role.name!r} is also trained by role {owner[id(p)]!r}; "
                                     "each network trains under one role")
            optimizer = self._optimizer_factory(role.optimizer)(params)
            optimizers.append(optimizer)
            if role.lr_scheduler is not None:
                self._role_schedulers[role.name] = role.lr_scheduler(optimizer)  # named for the LR monitor's log
                schedulers.append({"scheduler": self._role_schedulers[role.name], "interval": "step",
                                   "name": f"lr-{role.name}"})
        return optimizers, schedulers

    def adopt_trainer_settings(self, gradient_clip_val: float | None, gradient_clip_algorithm: str | None = None,
                               accumulate_grad_batches: int = 1, strategy=None) -> dict:
        """The trainer's settings for this method: with several roles Lightning refuses ``gradient_clip_val``
        under manual optimization, so the method keeps it and clips each role's update itself, and the returned
        overrides build the Trainer without it; gradient accumulation is refused there; data parallelism
        (``strategy="ddp"``) becomes DDP that finds unused parameters (each role's backward reaches only its own
        network), every backward's gradients averaged over the ranks. Nothing changes (``{}``) for the student
        alone."""
        if self.automatic_optimization:
            return {}
        if accumulate_grad_batches != 1:
            raise ValueError(f"trainer.accumulate_grad_batches={accumulate_grad_batches}: {type(self).__name__} trains "
                             f"several roles ({', '.join(self.roles)}) with manual optimization, which accumulates no "
                             "gradients; set trainer.accumulate_grad_batches=1 (and raise data.batch_size instead)")
        self.gradient_clip_val, self.gradient_clip_algorithm = gradient_clip_val, gradient_clip_algorithm
        own = {"gradient_clip_val": None, "gradient_clip_algorithm": None}
        if strategy == "ddp":
            own["strategy"] = "ddp_find_unused_parameters_true"
        return own

    def on_before_optimizer_step(self, optimizer) -> None:
        """Under manual optimization, clip the gradients of the update about to step: after the non-finite guard
        and after a gradient scaler unscaled them, where Lightning clips under automatic optimization."""
        if not self.automatic_optimization and self.gradient_clip_val:
            self.configure_gradient_clipping(optimizer, self.gradient_clip_val, self.gradient_clip_algorithm)

    def generate(self, batch: dict, generator: torch.Generator) -> torch.Tensor:
        """Images (N, C, H, W) in [-1, 1] for the conditions in ``batch``; each method defines how."""
        raise NotImplementedError

    def export(self, out_dir: str | Path) -> Path:
        """Save the student in an ecosystem format (a diffusers folder); each method defines which."""
        raise NotImplementedError
