"""Logger helpers: wandb goes offline by itself when no API key is configured."""

from __future__ import annotations

import csv
import netrc
import os

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from omegaconf import OmegaConf


def wandb_offline() -> bool:
    """Offline unless WANDB_MODE=online, or an API key is in WANDB_API_KEY or ~/.netrc."""
    mode = os.environ.get("WANDB_MODE", "").lower()
    if mode in ("offline", "disabled", "dryrun"):
        return True
    if mode == "online":
        return False
    if os.environ.get("WANDB_API_KEY"):
        return False
    try:
        rc = netrc.netrc()
        if rc.authenticators("api.wandb.ai"):
            return False
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        pass
    os.environ.setdefault("WANDB_MODE", "offline")
    return True


def _asset(name: str) -> str:
    from distill.assets import asset_path

    return str(asset_path(name))


def register_resolvers() -> None:
    """``${distill.wandb_offline:}`` and ``${distill.asset:NAME}`` (path of a shipped digits asset)."""
    if not OmegaConf.has_resolver("distill.wandb_offline"):
        OmegaConf.register_new_resolver("distill.wandb_offline", lambda: wandb_offline())
    if not OmegaConf.has_resolver("distill.asset"):
        OmegaConf.register_new_resolver("distill.asset", _asset)



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
