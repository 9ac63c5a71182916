import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    # Parallel workers share the cores: each worker and the trainings it launches take their share, not all.
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)
else:
    torch.set_num_threads(min(2, torch.get_num_threads()))


def hub_from_folder(monkeypatch, folder: Path) -> list[str]:
    """``huggingface_hub.hf_hub_download`` answers any repo id from the pipeline ``folder`` (EntryNotFoundError for a
    file it lacks, as the hub answers); returns the list of the files asked for, in order."""
    import huggingface_hub
    from huggingface_hub.utils import EntryNotFoundError

    fetched = []

    def download(repo_id, filename, revision=None, **_):
        fetched.append(filename)
        if not (folder / filename).is_file():
            raise EntryNotFoundError(f"{repo_id} has no {filename}")
        return str(folder / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    return fetched


def run_cli(cmd: list[str], capture_output: bool = False, text: bool = False, cwd=None, env: dict | None = None,
            timeout: float | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, ...)`` for a ``[sys.executable, "-m", MODULE, ...]`` command with captured text output,
    through tests/forkserver.py (same result; other commands and options run as subprocess.run runs them)."""
    from tests.forkserver import run_module

    if capture_output and text and cmd[:2] == [sys.executable, "-m"]:
        return run_module(cmd[2], list(cmd[3:]), cwd or os.getcwd(), dict(env if env is not None else os.environ),
                          timeout)
    return subprocess.run(cmd, capture_output=capture_output, text=text, cwd=cwd, env=env, timeout=timeout)


def run_train(*overrides: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 600,
              fresh: bool = False):
    """Run ``python -m distill.train`` as users do; returns the CompletedProcess (a fork of an interpreter that has
    done the imports where the environment allows, a fresh interpreter when ``fresh``: tests/forkserver.py)."""
    from tests.forkserver import run_module

    full_env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", **(env or {})}
    return run_module("distill.train", list(overrides), cwd or ROOT, full_env, timeout, fresh=fresh)


@pytest.fixture
def compose():
    """Compose the real train config with overrides, as Hydra would (no run directory)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from distill.config.resolvers import register_resolvers
    from distill.config.schema import register_configs

    register_configs()
    register_resolvers()

    def _compose(*overrides: str):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return hydra_compose(config_name="train", overrides=list(overrides), return_hydra_config=True)

    return _compose
