"""XLA devices through Lightning (``trainer=tpu``): TPUs, or XLA's CPU device (``PJRT_DEVICE=CPU``) for a check
without a TPU.

Lightning's ``XLAAccelerator`` counts devices with ``torch_xla._internal.tpu``, which finds none on a CPU or GPU
PJRT device; :class:`PJRTAccelerator` counts the devices of whichever PJRT runtime is configured. Everything
else (the single-device and multi-process XLA strategies, the step marking) is Lightning's.
"""

from __future__ import annotations

import functools

from lightning.fabric.accelerators.xla import _XLA_AVAILABLE
from lightning.pytorch.accelerators import XLAAccelerator


class PJRTAccelerator(XLAAccelerator):
    """``XLAAccelerator`` for any PJRT device type (TPU, CPU, CUDA), as ``PJRT_DEVICE`` selects."""

    @staticmethod
    @functools.lru_cache(maxsize=1)
    def auto_device_count() -> int:
        if not _XLA_AVAILABLE:
            return 0
        # counted without starting the PJRT runtime: Lightning spawns one process per device afterwards, and
        # torch_xla refuses to spawn once the parent process has initialised the runtime
        import os

        import torch_xla.runtime as xr

        kind = xr.device_type()
        if kind == "TPU":
            return XLAAccelerator.auto_device_count()
        if kind == "CPU":
            return int(os.environ.get("CPU_NUM_DEVICES", 1))
        if kind in ("CUDA", "GPU"):
            import torch

            return int(os.environ.get("GPU_NUM_DEVICES", torch.cuda.device_count()))
        return 0

    @staticmethod
    @functools.lru_cache(maxsize=1)
    def is_available() -> bool:
        try:
            return PJRTAccelerator.auto_device_count() > 0
        except (ValueError, AssertionError, OSError, RuntimeError):
            return False

    @staticmethod
    def parse_devices(devices):
        return _parse(devices)

    @staticmethod
    def get_parallel_devices(devices):
        import torch

        devices = _parse(devices)
        if isinstance(devices, int):
            return [torch.device("xla", i) for i in range(devices)]
        return [torch.device("xla", devices[0])]


def _parse(devices):
    """1, all devices, or one device index (Lightning's rule for XLA), counted by the PJRT runtime."""
    if isinstance(devices, str):
        devices = int(devices) if devices.strip().isdigit() else devices
    count = PJRTAccelerator.auto_device_count()
    if devices == "auto" or devices == -1:
        return count
    if isinstance(devices, int) and devices in {1, count}:
        return devices
    if isinstance(devices, (list, tuple)) and len(devices) == 1 and 0 <= int(devices[0]) < count:
        return [int(devices[0])]
    raise ValueError(f"trainer.devices={devices!r}: XLA runs on 1 device or all {count} of this host's, or on one "
                     "device index given as a one-element list")


def atomic_xla_checkpoint_io():
    """Lightning's XLA strategies take only an ``XLACheckpointIO``: this one writes as distill's
    ``AtomicCheckpointIO`` does (the XLA tensors copied to the CPU, then an atomic rename; weights-only reads)."""
    from lightning.pytorch.plugins.io import XLACheckpointIO

    from distill.utils.checkpoint import AtomicCheckpointIO

    class AtomicXLACheckpointIO(XLACheckpointIO):
        save_checkpoint = AtomicCheckpointIO.save_checkpoint
        load_checkpoint = AtomicCheckpointIO.load_checkpoint

    return AtomicXLACheckpointIO()



def sync_free_optimizer(cls: type) -> type:
    """torch_xla's sync-free counterpart of ``cls`` (AdamW, Adam, SGD), which skips a step on the device when a
    0-dim ``found_inf`` tensor is set, with no host read. distill's non-finite guard sets ``found_inf`` as an
    attribute (as for a fused optimizer) during Lightning's closure, so it is read after the closure has run."""
    import torch
    from torch_xla.amp import syncfree

    bases = {torch.optim.AdamW: syncfree.AdamW, torch.optim.Adam: syncfree.Adam, torch.optim.SGD: syncfree.SGD}
    if cls not in bases:
        raise ValueError(f"{cls.__name__} has no sync-free XLA counterpart; use torch.optim.AdamW, Adam or SGD")

    class SyncFree(bases[cls]):
        _step_supports_amp_scaling = True  # the guard's device-side path: it sets found_inf instead of reading

        def step(self, closure=None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            found_inf = getattr(self, "found_inf", None)
            super().step(found_inf=None if found_inf is None else found_inf.reshape(()))
            return loss

    SyncFree.__name__ = SyncFree.__qualname__ = f"SyncFree{cls.__name__}"
    return SyncFree
