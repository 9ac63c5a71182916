"""The command-line jobs from Python, through Hydra's compose API (no shell-out): what notebooks and scripts call.

    from distill import api

    cfg = api.compose("train", ["+exp=consistency", "trainer.max_steps=50"], run_dir="outputs/nb/lcm")
    metrics = api.train(cfg)                       # as `python -m distill.train +exp=consistency trainer.max_steps=50`
    rows = api.evaluate(["pipeline=outputs/nb/lcm/export", "steps=[1,2,4]"], run_dir="outputs/nb/eval")

Each job runs exactly the function its command runs (``distill.train.run``, ``distill.evaluate.sweep``) with the same
composed config (schemas, validation and defaults included), in the given run directory; a bad setting raises
(``SystemExit`` with the command's exit code, or ``ValueError``) instead of ending the process.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

CONF = Path(__file__).resolve().parent / "conf"


def compose(config_name: str = "train", overrides: Sequence[str] = (), run_dir: str | Path | None = None) -> DictConfig:
    """The config ``python -m distill.<job> OVERRIDES`` would run with (``config_name``: train, evaluate, sample,
    serve), its Hydra node included, its run directory ``run_dir`` (default: the config's own)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from distill.config.resolvers import register_resolvers
    from distill.config.schema import register_configs

    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3", job_name=config_name):
        cfg = hydra_compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)
    if run_dir is not None:
        with open_dict(cfg):
            cfg.hydra.run.dir = str(run_dir)
    return cfg


@contextmanager
def _hydra_context(cfg: DictConfig):
    """Hydra's runtime state for ``cfg`` (its output directory created), as ``@hydra.main`` sets it, then restored."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    previous = HydraConfig.instance().cfg
    with open_dict(cfg):
        out = Path(cfg.hydra.run.dir).resolve()
        cfg.hydra.runtime.output_dir = str(out)
        cfg.hydra.mode = RunMode.RUN
    out.mkdir(parents=True, exist_ok=True)
    HydraConfig.instance().set_config(cfg)
    try:
        yield out
    finally:
        HydraConfig.instance().cfg = previous


def _job(cfg: DictConfig) -> DictConfig:
    """The job's part of ``cfg`` (what ``@hydra.main`` passes): everything but the ``hydra`` node."""
    job = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    OmegaConf.set_struct(job, True)
    return job


def train(cfg_or_overrides: DictConfig | Sequence[str], run_dir: str | Path | None = None) -> dict:
    """Run ``distill.train`` on a composed config (``compose("train", ...)``) or on overrides; returns the final
    metrics (``trainer.callback_metrics``). The run directory holds what the command's holds (checkpoints, export,
    csv logs, quality_cost.csv, samples)."""
    from distill.train import run

    cfg = cfg_or_overrides if isinstance(cfg_or_overrides, DictConfig) else compose("train", cfg_or_overrides, run_dir)
    with _hydra_context(cfg):
        return run(_job(cfg))


def evaluate(cfg_or_overrides: DictConfig | Sequence[str], run_dir: str | Path | None = None) -> list[dict]:
    """Run ``distill.evaluate``'s quality-cost sweep; returns its rows (the table written to ``run_dir``:
    quality_cost.csv, table.md, pareto.png, grids/)."""
    from distill.evaluate import sweep

    cfg = cfg_or_overrides if isinstance(cfg_or_overrides, DictConfig) else compose("evaluate", cfg_or_overrides,
                                                                                  run_dir)
    with _hydra_context(cfg) as out:
        return sweep(_job(cfg), out)


def output_folder(path: str | Path, settings: dict, may_grow: Sequence[str] = ()) -> Path:
    """``path`` created, as the output folder of a notebook or script run with ``settings`` (JSON-able), which are
    recorded in ``<path>/settings.json``. A folder already holding results of other settings is refused
    (``ValueError`` naming the differences and the fix) instead of silently reusing students trained otherwise;
    a name in ``may_grow`` may take a larger value than recorded (e.g. more search trials continue a study)."""
    import json

    folder = Path(path)
    record = folder / "settings.json"
    settings = json.loads(json.dumps(settings))  # as they will read back (tuples as lists)
    if record.is_file():
        saved = json.loads(record.read_text())
        changed = {k: (saved.get(k), v) for k, v in settings.items() if saved.get(k) != v
                   and not (k in may_grow and isinstance(v, int | float) and isinstance(saved.get(k), int | float)
                            and v >= saved[k])}
        changed.update({k: (v, None) for k, v in saved.items() if k not in settings})
        if changed:
            diff = ", ".join(f"{k}: {old!r} there, {new!r} now" for k, (old, new) in changed.items())
            raise ValueError(f"{folder} holds results of other settings ({diff}); delete it, or choose another "
                             f"output folder, to run with these")
    folder.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    return folder
