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
        import torch_xla.runtime as xr

        return xr.global_runtime_device_count() if xr.device_type() is not None else 0

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
