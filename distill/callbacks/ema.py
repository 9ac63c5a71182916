"""Exponential moving average of the student with a half-life counted in images (Karras et al. 2022, EDM)."""

from __future__ import annotations

import copy

import lightning as L
import torch

from distill.data.latents import batch_size_of
from distill.utils.optim import ema_update_, step_applied
from distill.utils.sharding import StateCopy, full_state, is_sharded


def ema_beta(batch_images: int, half_life_images: float, seen_images: int | torch.Tensor,
             rampup_ratio: float | None) -> float | torch.Tensor:
    """beta = 0.5 ** (batch / half_life); with ramp-up the half-life is at most rampup_ratio * seen images.
    ``seen_images`` may be a tensor on the device (a count masked by skipped steps): beta is then one too."""
    if isinstance(seen_images, torch.Tensor):
        half_life = torch.full_like(seen_images, float(half_life_images), dtype=torch.float64)
        if rampup_ratio is not None:
            half_life = torch.minimum(half_life, seen_images.double() * rampup_ratio)
        return torch.pow(0.5, batch_images / half_life.clamp(min=1e-8))
    half_life = half_life_images
    if rampup_ratio is not None:
        half_life = min(half_life, seen_images * rampup_ratio)
    return 0.5 ** (batch_images / max(half_life, 1e-8))


def closes_optimizer_step(trainer, batch_idx: int) -> bool:
    """Whether Lightning steps the optimizer after this batch: it closes an accumulation window, or the epoch
    (Lightning steps on the epoch's last batch even when the window is incomplete)."""
    if not (batch_idx + 1) % trainer.accumulate_grad_batches:
        return True
    return batch_idx + 1 == trainer.num_training_batches or trainer.is_last_batch


class EMA(L.Callback):
    """Keeps ``ema`` = EMA of ``pl_module.<attr>``, updated once per optimizer step with the images that step
    used (all micro-batches of an accumulation window, on every rank); a step the non-finite guard skipped moves
    neither the EMA nor its image count. ``updates`` counts the student updates it followed: under a method with
    several roles (``DistillMethod.add_role``) a training step is one student update, whatever the other roles'
    updates, so the EMA follows the student's alone. Validation and export use the EMA weights. Lightning runs
    ModelCheckpoint after the other callbacks, so a checkpoint holds the EMA of its own step."""

    def __init__(self, half_life_images: float = 20000, rampup_ratio: float | None = 0.05, attr: str = "student"):
        self.half_life_images, self.rampup_ratio, self.attr = half_life_images, rampup_ratio, attr
        self.ema: torch.nn.Module | None = None
        self.seen_images = 0
        self.updates = 0  # optimizer steps of ``attr`` averaged in (skipped ones not)
        self._window_images = 0  # images of the optimizer step in progress (0 at every step boundary)
        self._pending_state: dict | None = None
        self._backup: dict | None = None

    def on_fit_start(self, trainer, pl_module) -> None:
        module = getattr(pl_module, self.attr)
        # a sharded (FSDP) student cannot be deep-copied: its state's shards are kept instead
        self.ema = StateCopy(module) if is_sharded(module) else copy.deepcopy(module).requires_grad_(False).eval()
        if self._pending_state is not None:
            self.ema.load_state_dict(self._pending_state)
            self._pending_state = None

    @torch.no_grad()
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._window_images += batch_size_of(batch) * trainer.world_size
        if not closes_optimizer_step(trainer, batch_idx):
            return
        batch_images, self._window_images = self._window_images, 0
        module = getattr(pl_module, self.attr)
        applied = step_applied(pl_module, module)
        if applied is False:
            return
        if applied is True:
            self.seen_images += batch_images
            self.updates += 1
            beta = ema_beta(batch_images, self.half_life_images, self.seen_images, self.rampup_ratio)
            ema_update_(self.ema, module, 1.0 - beta)
            return
        # the guard skips on the device: count and average through its 0/1 mask, no host sync
        self.seen_images = self.seen_images + batch_images * applied.to(torch.int64)
        self.updates = self.updates + applied.to(torch.int64)
        beta = ema_beta(batch_images, self.half_life_images, self.seen_images, self.rampup_ratio)
        ema_update_(self.ema, module, ((1.0 - beta) * applied).float())

    @property
    def swapped_out(self) -> bool:
        """True while the live (not the EMA) weights are in the module."""
        return self._backup is None

    def swap_in(self, pl_module) -> None:
        module = getattr(pl_module, self.attr)
        self._backup = {k: v.detach().clone() for k, v in module.state_dict().items()}
        module.load_state_dict(self.ema.state_dict())

    def swap_out(self, pl_module) -> None:
        if self._backup is not None:
            getattr(pl_module, self.attr).load_state_dict(self._backup)
            self._backup = None

    def on_validation_start(self, trainer, pl_module) -> None:
        if self.ema is not None and not trainer.sanity_checking:
            self.swap_in(pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:
        self.swap_out(pl_module)

    def copy_to(self, pl_module) -> None:
        """Replace the live weights with the EMA weights (used before export)."""
        if self.ema is not None:
            getattr(pl_module, self.attr).load_state_dict(self.ema.state_dict())

    def state_dict(self) -> dict:
        # sharded: gathered to full tensors on every rank (each rank's call is part of the collective)
        return {"ema": full_state(self.ema.state_dict()) if self.ema is not None else None, "seen_images": int(self.seen_images),
                "updates": int(self.updates), "window_images": self._window_images}

    def load_state_dict(self, state: dict) -> None:
        self.seen_images = state["seen_images"]
        self.updates = state.get("updates", 0)  # checkpoints from before it was stored
        self._window_images = state.get("window_images", 0)  # checkpoints from before it was stored
        if self.ema is not None and state["ema"] is not None:
            self.ema.load_state_dict(state["ema"])
        else:
            self._pending_state = state["ema"]
