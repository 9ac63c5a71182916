"""No lost work: exact resume (RNG states per rank), preemption (SIGUSR1 / SIGTERM), non-finite guard.

These callbacks are always on (``distill.train`` adds them); ``conf/resilience`` configures them.
"""

from __future__ import annotations

import logging
import random
import signal

import lightning as L
import numpy as np
import torch

from distill.utils.sharding import local, unsharded_class

log = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: saved and stopped on a scheduler's signal; relaunch to resume
NONFINITE_EXIT_CODE = 3


class NonFiniteLossError(RuntimeError):
    pass


class Preempted(Exception):
    """Raised by ``Preemption`` right after its checkpoint: it ends the fit there, so that nothing else runs before
    the exit (no validation pass, no ``on_train_end`` work such as the final quality-cost sweep, no export)."""


def _gather(obj):
    """Every rank's ``obj`` as a list ordered by rank (a one-element list without a process group)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        out = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(out, obj)
        return out
    return [obj]


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def capture_rng() -> dict:
    """This process's python, numpy and torch (CPU and CUDA) generator states, in plain types/tensors."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class RNGState(L.Callback):
    """Stores every rank's RNG states in the checkpoint and restores them right before the first
    training batch after a resume, so the resumed run draws the same random numbers as an unbroken one."""

    def __init__(self):
        self._pending: dict | None = None

    def state_dict(self) -> dict:
        return {"per_rank": _gather(capture_rng())}  # a collective: every rank saves checkpoints together

    def load_state_dict(self, state_dict: dict) -> None:
        ranks = state_dict.get("per_rank") or []
        rank = _rank()
        if rank < len(ranks):
            self._pending = ranks[rank]
        elif ranks:
            log.warning("checkpoint holds RNG states of %d rank(s); rank %d starts from its seed", len(ranks), rank)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._pending is not None:
            restore_rng(self._pending)
            self._pending = None


def last_checkpoint_path(trainer, name: str = "last.ckpt") -> str:
    """``name`` in the run's checkpoint folder (a local folder or an fsspec URL)."""
    dirpath = trainer.checkpoint_callback.dirpath if trainer.checkpoint_callback else trainer.default_root_dir
    return f"{str(dirpath).rstrip('/')}/{name}"


class Preemption(L.Callback):
    """On SIGUSR1 or SIGTERM (SLURM's warning signal, Kubernetes' eviction), finish the current step, save
    ``last.ckpt`` on every rank in agreement at that step boundary, and stop at once by raising ``Preempted``
    (a scheduler's grace period is short: Lightning's ``should_stop`` would still run a validation pass and every
    ``on_train_end`` hook); ``distill.train`` then exits with ``PREEMPTED_EXIT_CODE`` so that the scheduler
    requeues the same command, which resumes."""

    def __init__(self, signals: tuple[str, ...] = ("SIGUSR1", "SIGTERM"), checkpoint_name: str = "last.ckpt"):
        self.signals = [getattr(signal, s) for s in signals]
        self.checkpoint_name = checkpoint_name
        self.received: int | None = None
        self._previous: dict = {}
        self._step_at_batch_start = -1

    def _handler(self, signum, frame) -> None:
        self.received = signum

    def on_train_start(self, trainer, pl_module) -> None:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.signals:  # replaces Lightning's own SIGTERM / SLURM handlers for the fit
            self._previous[sig] = signal.signal(sig, self._handler)

    def _restore_handlers(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._step_at_batch_start = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        stop = trainer.strategy.reduce_boolean_decision(self.received is not None, all=False)
        # inside a gradient-accumulation window (no optimizer step yet), wait for the window's step: a checkpoint
        # here would lose the gradients accumulated so far
        if not stop or trainer.global_step == self._step_at_batch_start:
            return
        path = last_checkpoint_path(trainer, self.checkpoint_name)
        trainer.save_checkpoint(path, weights_only=False)
        name = signal.Signals(self.received).name if self.received is not None else "a signal on another rank"
        log.warning("received %s: saved %s at step %d and stopping; relaunch the same command with ckpt_path=last "
                    "(and the same hydra.run.dir) to resume", name, path, trainer.global_step)
        raise Preempted(f"preempted at step {trainer.global_step}")

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore_handlers()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._restore_handlers()


class FinalCheckpoint(L.Callback):
    """Saves ``last.ckpt`` when training ends on a step that no checkpoint holds (``max_steps`` not a multiple of
    ``checkpoint.every_n_train_steps``), so that a finished run's last checkpoint holds all it trained. Put before
    the other callbacks, it saves before the ``on_train_end`` work of theirs and of the method (the final
    quality-cost sweep, progressive distillation's last round export), which a kill may interrupt."""

    def __init__(self, checkpoint_name: str = "last.ckpt"):
        self.checkpoint_name = checkpoint_name
        self._held_step = -1  # the step of the newest checkpoint saved or resumed from

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        self._held_step = trainer.global_step

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        self._held_step = checkpoint.get("global_step", -1)

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.checkpoint_callback is None or trainer.fast_dev_run or trainer.global_step == self._held_step:
            return
        path = last_checkpoint_path(trainer, self.checkpoint_name)
        trainer.save_checkpoint(path, weights_only=False)
        log.info("saved %s at the final step %d", path, trainer.global_step)


class NonFiniteGuard(L.Callback):
    """A non-finite loss or gradient on any rank skips the optimizer step on all ranks (the weights and
    optimizer moments stay as they were, and so do the EMA and the consistency target); skipped steps are
    counted and logged, and ``max_consecutive`` bad steps in a row abort the run with a clear error before
    any later checkpoint is written, so the last good checkpoint stays.

    Two ways to skip, chosen at the start of training:

    * **on the device**, without a host sync per step, when the optimizer takes AMP's ``found_inf`` flag
      (``_step_supports_amp_scaling``: fused AdamW/Adam/SGD, e.g. ``method.optimizer.fused=true``) and no
      gradient scaler owns that flag (not ``16-mixed``): the bad-step flag is computed and reduced over ranks
      as a tensor, handed to the optimizer as ``found_inf`` (it then leaves weights, moments and step count
      unchanged, as under GradScaler), and exposed as ``pl_module.step_applied_mask`` for the EMA updates.
      The counters live on the device and are read on the host only on logging steps, when a checkpoint is
      written and at the end; the longest run of bad steps since the last read is kept, so an abort is never
      missed, only reported at the next read;
    * **on the host** otherwise: one flag read per step; every gradient is dropped, which any optimizer skips;
    * under a gradient **scaler** (``16-mixed``) the scaler skips a step whose gradients overflow and lowers its
      scale, which is routine while the scale settles: the guard then leaves the gradients to the scaler and
      counts (and aborts on) non-finite losses only.

    A method with several roles (``DistillMethod.add_role``: a critic, a discriminator) skips on the host, each
    update on its own: a bad critic update skips the critic's step only. The student's skips are ``skipped``
    (logged as ``train/nonfinite_skipped``), another role's are ``role_skipped[role]``
    (``train/nonfinite_skipped_<role>``); ``max_consecutive`` bad updates in a row of any one role abort.
    """

    def __init__(self, max_consecutive: int = 10, inject_at_steps: list[int] | tuple = ()):
        if max_consecutive < 1:
            raise ValueError(f"resilience.max_consecutive_nonfinite={max_consecutive} must be >= 1")
        self.max_consecutive = max_consecutive
        self.inject_at_steps = set(inject_at_steps)  # fault injection for tests: NaN gradients at these steps
        self.skipped = 0
        self.consecutive = 0
        self.device_side = False
        self._loss_finite: bool | torch.Tensor = True  # over the accumulation window of the next step
        self._scaler = False
        self._counters: torch.Tensor | None = None  # on the device: skipped, consecutive, longest run since read
        self._read_step = 0  # the step of the last host read
        self.role_skipped: dict[str, int] = {}  # roles other than the student's (manual optimization)
        self.role_consecutive: dict[str, int] = {}

    def state_dict(self) -> dict:
        self._read(None, None)  # a checkpoint is never written after an abort-worthy run of bad steps
        state = {"skipped": self.skipped, "consecutive": self.consecutive}
        if self.role_skipped:
            state["roles"] = {"skipped": dict(self.role_skipped), "consecutive": dict(self.role_consecutive)}
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        self.skipped, self.consecutive = state_dict.get("skipped", 0), state_dict.get("consecutive", 0)
        roles = state_dict.get("roles", {})
        self.role_skipped, self.role_consecutive = dict(roles.get("skipped", {})), dict(roles.get("consecutive", {}))
        self._counters = None

    def on_fit_start(self, trainer, pl_module) -> None:
        optimizers = trainer.optimizers
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self._scaler = scaler is not None
        self.device_side = (len(optimizers) == 1 and pl_module.automatic_optimization and scaler is None
                            and getattr(optimizers[0], "_step_supports_amp_scaling", False))
        if not self.device_side:
            pl_module.step_applied_mask = None
        where = ("device (optimizer found_inf, no per-step host sync)" if self.device_side else
                 "host (one flag read per step; a fused optimizer, method.optimizer.fused=true, skips on the device)"
                 if getattr(pl_module, "automatic_optimization", True) else
                 "host, each role's update on its own (one flag read per update: several roles)")
        log.info("non-finite guard: skips bad steps on the %s", where)

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        finite = torch.isfinite(loss.detach()).all()  # and-ed over the micro-batches of an accumulation window
        self._loss_finite = self._loss_finite & (finite if self.device_side else bool(finite))

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_step in self.inject_at_steps:
            for p in pl_module.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        loss_finite, self._loss_finite = self._loss_finite, True  # the next window starts
        if self.device_side:
            self._flag_on_device(trainer, pl_module, optimizer, params, loss_finite)
            return
        # one host sync per step: a single reduction over every gradient, not one per parameter; under a scaler
        # the (scaled) gradients overflow routinely and the scaler skips those steps itself
        finite = loss_finite and (self._scaler or not params or
                                  bool(torch.stack([torch.isfinite(local(p.grad)).all() for p in params]).all()))
        bad = trainer.strategy.reduce_boolean_decision(not finite, all=False)
        role = "student" if getattr(pl_module, "automatic_optimization", True) else pl_module.role_of(optimizer)
        if role != "student":
            self._count_role(trainer, pl_module, role, bad)
        elif not bad:
            self.consecutive = 0
        if not bad:
            return
        for p in params:  # AdamW and SGD skip parameters without gradients: nothing moves
            if self._scaler:  # the scaler must see the step's gradients (it records its inf checks on them)
                p.grad.fill_(float("nan"))
            else:
                p.grad = None
        if role != "student":
            return
        self.skipped += 1
        self.consecutive += 1
        pl_module.log("train/nonfinite_skipped", float(self.skipped), rank_zero_only=True)
        log.warning("non-finite loss or gradient at step %d: optimizer step skipped (%d in a row, %d in all)",
                    trainer.global_step, self.consecutive, self.skipped)
        self._check_abort(trainer.global_step, self.consecutive)

    def _count_role(self, trainer, pl_module, role: str, bad: bool) -> None:
        """Count a non-student role's update: its skips and its run of bad updates in a row."""
        self.role_skipped.setdefault(role, 0)
        self.role_consecutive[role] = self.role_consecutive.get(role, 0) + 1 if bad else 0
        if not bad:
            return
        self.role_skipped[role] += 1
        pl_module.log(f"train/nonfinite_skipped_{role}", float(self.role_skipped[role]), rank_zero_only=True)
        log.warning("non-finite %s loss or gradient at step %d: that %s update skipped (%d in a row, %d in all)",
                    role, trainer.global_step, role, self.role_consecutive[role], self.role_skipped[role])
        self._check_abort(trainer.global_step, self.role_consecutive[role], role)

    def _flag_on_device(self, trainer, pl_module, optimizer, params, loss_finite) -> None:
        device = params[0].device if params else pl_module.device
        finite = torch.as_tensor(loss_finite, device=device)
        if params:
            # sharded gradients: each rank checks its shard, and the all-reduce below joins them
            finite = finite & torch.stack([torch.isfinite(local(p.grad)).all() for p in params]).all()
        bad = (~finite).float()
        if trainer.world_size > 1:  # any rank's bad step skips it everywhere; an all-reduce on the device
            bad = (trainer.strategy.reduce(bad, reduce_op="sum") > 0).float()
        optimizer.found_inf = bad
        pl_module.step_applied_mask = 1.0 - bad
        if self._counters is None or self._counters.device != device:
            self._counters = torch.tensor([self.skipped, self.consecutive, self.consecutive], dtype=torch.float32,
                                          device=device)  # exact counts up to 2**24 steps
        skipped, consecutive, longest = self._counters.unbind()
        consecutive = (consecutive + 1) * bad
        self._counters = torch.stack([skipped + bad, consecutive, torch.maximum(longest, consecutive)])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.device_side:
            return
        for optimizer in trainer.optimizers:  # the flag was for that step only
            if hasattr(optimizer, "found_inf"):
                del optimizer.found_inf
        if trainer.global_step % max(trainer.log_every_n_steps, 1) == 0:
            self._read(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self._read(trainer, None)  # no metric logging from this hook

    def _read(self, trainer, pl_module) -> None:
        """The device counters on the host: log what was skipped since the last read, abort on a long run."""
        if self._counters is None:
            return
        skipped, consecutive, longest = (int(v) for v in self._counters.tolist())
        self._counters[2] = consecutive  # the longest run restarts from the current one
        step = trainer.global_step if trainer is not None else None
        if skipped > self.skipped:
            if pl_module is not None:
                pl_module.log("train/nonfinite_skipped", float(skipped), rank_zero_only=True)
            log.warning("non-finite loss or gradient: %d optimizer step(s) skipped since step %d (%d in all)%s",
                        skipped - self.skipped, self._read_step, skipped, "" if step is None else f", now step {step}")
        self.skipped, self.consecutive = skipped, consecutive
        self._read_step = step if step is not None else self._read_step
        self._check_abort(step, longest)

    def _check_abort(self, step, run: int, role: str = "student") -> None:
        if run >= self.max_consecutive:
            where = "" if step is None else f" (read at step {step})"
            what = "steps" if role == "student" else f"{role} updates"
            raise NonFiniteLossError(
                f"{run} consecutive {what} had a non-finite loss or gradient{where}; stopped without saving. The "
                "last good checkpoint is kept. Lower the learning rate, enable gradient clipping "
                "(trainer.gradient_clip_val), or raise resilience.max_consecutive_nonfinite"
            )


def describe_run(pl_module) -> dict:
    """What a checkpoint must match to be resumed by this run: the method and the student's class."""
    method, student = type(pl_module), unsharded_class(getattr(pl_module, "student", None))
    return {"method": f"{method.__module__}.{method.__qualname__}",
            "student": f"{student.__module__}.{student.__qualname__}"}


class RunIdentity(L.Callback):
    """Writes the method, the student class and the wandb run id into every checkpoint (``distill`` key),
    and the training metrics of the step it was saved at: Lightning writes those to the loggers only
    after the checkpoint, so a kill in between would leave a gap in the curve. A resumed run logs them
    again (the same values at the same step)."""

    def __init__(self):
        self._pending: dict | None = None

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        info = describe_run(pl_module)
        from lightning.pytorch.loggers import WandbLogger

        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                info["wandb_run_id"] = logger.version
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")}
        info["step_metrics"] = {"step": max(0, trainer.global_step - 1), "metrics": metrics}
        checkpoint["distill"] = info

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        self._pending = checkpoint.get("distill", {}).get("step_metrics")

    def on_train_start(self, trainer, pl_module) -> None:
        if self._pending and self._pending["metrics"] and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(self._pending["metrics"], step=self._pending["step"])
                logger.save()
        self._pending = None
