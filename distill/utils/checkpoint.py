"""Checkpoints that are never half-written, load without executing pickled code, and resume from the
newest readable file.

* ``AtomicCheckpointIO`` writes to ``<name>.tmp-<pid>`` in the same folder, flushes and fsyncs it, then
  renames it over the target (``os.replace`` is atomic on POSIX), so a crash or a full disk leaves the
  previous file intact. Lightning's ``ModelCheckpoint`` deletes an old periodic checkpoint only after the
  new one is saved, so rotation never drops below the newest complete file.
* Loading uses ``torch.load(weights_only=True)``: tensors and plain containers only.
* ``resolve_resume`` picks the newest checkpoint in a run directory that loads, naming any it skips.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the file and what to do."""


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_torch_save(obj, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError):
            reason = "the disk is full" if err.errno == errno.ENOSPC else err.strerror or str(err)
            previous = "the previous file there is unchanged" if path.exists() else "no earlier file was there"
            raise CheckpointError(
                f"could not write checkpoint {path}: {reason}; {previous}. Free space or point "
                "checkpoint.dirpath elsewhere, then resume with ckpt_path=last"
            ) from err
        raise
    _fsync_dir(path.parent)


def safe_load(path: str | Path, map_location="cpu") -> dict:
    """A checkpoint's contents without running pickled code; a clear error for a damaged file."""
    path = Path(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as err:  # truncated zip, bad magic number, disallowed global, ...
        size = path.stat().st_size if path.exists() else 0
        raise CheckpointError(
            f"checkpoint {path} ({size} bytes) is unreadable: it is truncated, corrupted or not a weights-only "
            f"checkpoint ({type(err).__name__}: {str(err).splitlines()[0][:200]})"
        ) from err


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO with atomic writes and weights-only reads."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict:
        return safe_load(path, map_location if map_location is not None else "cpu")


def _step_of(path: Path) -> int:
    digits = "".join(c for c in path.stem if c.isdigit())
    return int(digits) if digits else -1


def candidate_checkpoints(folder: Path) -> list[Path]:
    """Checkpoints in ``folder``, newest first (modification time, then the step in the name)."""
    files = [p for p in folder.glob("*.ckpt") if p.is_file()]
    return sorted(files, key=lambda p: (p.stat().st_mtime_ns, _step_of(p)), reverse=True)


def resolve_resume(folder: Path) -> tuple[Path | None, dict | None]:
    """The newest checkpoint in ``folder`` that loads, with its contents; (None, None) if there is none.
    Unreadable newer files are reported (by name) and skipped."""
    for stale in folder.glob("*.ckpt.tmp-*"):  # a write that was killed before its rename
        log.warning("removing %s, an unfinished checkpoint write", stale)
        stale.unlink(missing_ok=True)
    skipped = []
    for path in candidate_checkpoints(folder) if folder.is_dir() else []:
        try:
            checkpoint = safe_load(path)
        except CheckpointError as err:
            log.error("%s", err)
            skipped.append(path.name)
            continue
        if skipped:
            log.warning("resuming from %s instead of the unreadable %s", path, ", ".join(skipped))
        return path, checkpoint
    if skipped:
        raise CheckpointError(f"no readable checkpoint in {folder}: {', '.join(skipped)} are all unreadable")
    return None, None
