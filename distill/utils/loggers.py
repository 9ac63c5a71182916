"""Logger helpers: wandb goes offline by itself when no API key is configured or its server does not answer."""

from __future__ import annotations

import csv
import functools
import logging
import netrc
import os
import socket
import threading
from urllib.parse import urlsplit

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment

log = logging.getLogger(__name__)


def wandb_offline() -> bool:
    """Offline unless WANDB_MODE=online, or an API key is in WANDB_API_KEY or ~/.netrc, and wandb's server
    answers; a key without a reachable server logs offline with a warning (wandb itself would retry for minutes)."""
    mode = os.environ.get("WANDB_MODE", "").lower()
    if mode in ("offline", "disabled", "dryrun"):
        return True
    if mode == "online" or os.environ.get("WANDB_API_KEY") or _netrc_key():
        url = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
        address = (url.hostname or "api.wandb.ai", url.port or (80 if url.scheme == "http" else 443))
        if reachable(*address):
            return False
        log.warning("wandb: an API key is set but %s:%d does not answer within %g s; logging offline to the run "
                    "directory (upload later with `wandb sync <run dir>/wandb/offline-run-*`)", *address, PROBE_TIMEOUT_S)
    os.environ["WANDB_MODE"] = "offline"
    return True


def _netrc_key() -> bool:
    try:
        return bool(netrc.netrc().authenticators("api.wandb.ai"))
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


PROBE_TIMEOUT_S = 3.0


@functools.cache
def reachable(host: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether ``host:port`` accepts a TCP connection within ``timeout`` seconds, name lookup included (in a
    thread: a lookup without a network can block longer than any socket timeout). Asked once per process."""
    answered = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            answered.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(answered)


class AppendingExperimentWriter(ExperimentWriter):
    """Lightning's CSV writer deletes an existing metrics.csv when a run resumes; this one keeps its rows
    and continues the file (the header extends when new metrics appear)."""

    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as f:
                self.metrics_keys = sorted(next(csv.reader(f), []))


class ResumableCSVLogger(CSVLogger):
    """``CSVLogger`` that appends to the run's metrics.csv on resume instead of replacing it."""

    @property
    @rank_zero_experiment
    def experiment(self) -> AppendingExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = AppendingExperimentWriter(log_dir=self.log_dir)
        return self._experiment
