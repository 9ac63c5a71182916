"""Checkpoints that are never half-written, load without executing pickled code, and resume from the
readable file of the highest step.

* Paths are fsspec URLs or local paths, so checkpoint folders may live on ``s3://``, ``gs://``, ``file://``
  or ``memory://``. On a local disk ``AtomicCheckpointIO`` writes to ``<name>.tmp-<pid>`` in the same folder,
  flushes and fsyncs it, then renames it over the target (``os.replace`` is atomic on POSIX); elsewhere it
  uses Lightning's own fsspec save, which serialises to memory first and writes the object in one put (an
  object store shows a whole object or none). Either way a crash or a full disk leaves the previous file
  intact, and Lightning's ``ModelCheckpoint`` deletes an old periodic checkpoint only after the new one is
  saved, so rotation never drops below the newest complete file. (Lightning's local save writes the target
  in place, without the rename or fsync, which is why the local path stays ours.)
* Loading uses ``torch.load(weights_only=True)``: tensors and plain containers only.
* ``resolve_resume`` picks the checkpoint of a run directory with the highest stored step that loads, naming any it
  skips.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
from pathlib import Path, PurePosixPath

import torch
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
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


def local_path(path: str | Path) -> Path | None:
    """``path`` as a local Path (plain paths and ``file://`` URLs), or None for any other filesystem."""
    fs, inner = url_to_fs(str(path))
    return Path(inner) if isinstance(fs, LocalFileSystem) else None


def _write_error(path, err: OSError, previous_exists: bool) -> CheckpointError:
    reason = "the disk is full" if err.errno == errno.ENOSPC else err.strerror or str(err)
    previous = "the previous file there is unchanged" if previous_exists else "no earlier file was there"
    return CheckpointError(
        f"could not write checkpoint {path}: {reason}; {previous}. Free space or point "
        "checkpoint.dirpath elsewhere, then resume with ckpt_path=last"
    )


SHARDED_META = "meta.pt"  # Lightning's metadata file in a sharded (distributed) checkpoint folder


def atomic_torch_save(obj, path: str | Path) -> None:
    """Write ``obj`` to a local path so that the target is either the old file or the whole new one."""
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
            raise _write_error(path, err, path.exists()) from err
        raise
    _fsync_dir(path.parent)


def safe_load(path: str | Path, map_location="cpu", mmap: bool = False) -> dict:
    """A checkpoint's contents (local path or fsspec URL) without running pickled code; a clear error for a
    damaged file. A sharded checkpoint's folder gives its metadata (everything but the sharded weights and
    optimizer states). ``mmap``: a local file's tensors are mapped from the file, not read (a cheap look at
    its step); other filesystems read the whole file either way."""
    fs, inner = url_to_fs(str(path))
    if fs.isdir(inner) and fs.isfile(f"{inner}/{SHARDED_META}"):
        path, inner = f"{str(path).rstrip('/')}/{SHARDED_META}", f"{inner}/{SHARDED_META}"
    local = local_path(path) if mmap else None
    try:
        if local is not None:
            return torch.load(local, map_location=map_location, weights_only=True, mmap=True)
        with fs.open(inner, "rb") as f:
            return torch.load(f, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as err:  # truncated zip, bad magic number, disallowed global, ...
        size = fs.size(inner) if fs.exists(inner) else 0
        raise CheckpointError(
            f"checkpoint {path} ({size} bytes) is unreadable: it is truncated, corrupted or not a weights-only "
            f"checkpoint ({type(err).__name__}: {str(err).splitlines()[0][:200]})"
        ) from err


def _to_cpu_if_xla(checkpoint: dict) -> dict:
    """XLA tensors copied to the CPU (as Lightning's XLACheckpointIO does), so that the file loads anywhere."""
    from lightning.fabric.utilities.apply_func import apply_to_collection

    found = []
    apply_to_collection(checkpoint, torch.Tensor, lambda t: found.append(t.device.type == "xla"))
    if not any(found):
        return checkpoint
    return apply_to_collection(checkpoint, torch.Tensor, lambda t: t.cpu() if t.device.type == "xla" else t)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO with atomic writes and weights-only reads."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        checkpoint = _to_cpu_if_xla(checkpoint)
        local = local_path(path)
        if local is not None:
            atomic_torch_save(checkpoint, local)
            return
        fs, inner = url_to_fs(str(path))
        try:
            super().save_checkpoint(checkpoint, path, storage_options)
        except OSError as err:
            raise _write_error(path, err, fs.exists(inner)) from err

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict:
        return safe_load(path, map_location if map_location is not None else "cpu")


def _step_of(path: str) -> int:
    numerals = "".join(c for c in PurePosixPath(str(path)).stem if c.isdigit())
    return int(numerals) if numerals else -1


def _mtime(info: dict) -> float:
    """Modification time from an fsspec ``info`` dict (local: mtime; object stores: LastModified/updated;
    memory: created); 0 where the filesystem reports none."""
    for key in ("mtime", "LastModified", "updated", "created"):
        value = info.get(key)
        if value is not None:
            return value.timestamp() if hasattr(value, "timestamp") else float(value)
    return 0.0


def candidate_checkpoints(folder: str | Path) -> list[Path | str]:
    """Checkpoints in ``folder`` (local path or fsspec URL), newest first (modification time, then the step
    in the name): Paths for a local folder, URLs for any other filesystem."""
    fs, inner = url_to_fs(str(folder))
    if not fs.isdir(inner):
        return []
    # a file, or a sharded checkpoint's folder (trainer=fsdp: one shard per rank and the metadata file)
    infos = [info for info in fs.ls(inner, detail=True) if info["name"].endswith(".ckpt") and (
        info["type"] == "file" or (info["type"] == "directory" and fs.isfile(f"{info['name']}/{SHARDED_META}")))]
    infos.sort(key=lambda info: (_mtime(info), _step_of(info["name"])), reverse=True)
    if local_path(folder) is not None:
        return [Path(info["name"]) for info in infos]
    return [fs.unstrip_protocol(info["name"]) for info in infos]


def resolve_resume(folder: str | Path) -> tuple[Path | str | None, dict | None]:
    """The readable checkpoint in ``folder`` with the highest stored global step (not the newest file: a run
    directory copied with ``cp -r`` has new, arbitrary file times), with its contents (a local file's tensors
    memory-mapped); (None, None) if there is none. Unreadable files are reported (by name) and skipped."""
    local = local_path(folder)
    if local is not None:
        for old in local.glob("*.ckpt.old"):  # a sharded save stopped between its two renames: the previous one
            if not old.with_suffix("").exists():
                log.warning("restoring %s, the checkpoint a killed save was replacing", old.with_suffix(""))
                with contextlib.suppress(OSError):  # another rank restored it first
                    old.rename(old.with_suffix(""))
        # a write killed before its rename (every rank may clean at once: errors of a concurrent removal ignored)
        for stale in [*local.glob("*.ckpt.tmp-*"), *local.glob("*.ckpt.tmp"), *local.glob("*.ckpt.old")]:
            log.warning("removing %s, an unfinished checkpoint write", stale)
            shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
    skipped, best = [], None
    for path in candidate_checkpoints(folder):  # equal steps: the newest file wins
        try:
            checkpoint = safe_load(path, mmap=True)
        except CheckpointError as err:
            log.error("%s", err)
            skipped.append(PurePosixPath(str(path)).name)
            continue
        step = checkpoint.get("global_step", -1)
        if best is None or step > best[0]:
            best = (step, path, checkpoint)
    if best is None:
        if skipped:
            raise CheckpointError(f"no readable checkpoint in {folder}: {', '.join(skipped)} are all unreadable")
        return None, None
    if skipped:
        log.warning("resuming from %s instead of the unreadable %s", best[1], ", ".join(skipped))
    return best[1], best[2]
