"""Rebuild the shipped digits assets: train each with its experiment, copy its export into the package.

    python -m distill.worlds.digits.build [classifier vae clip teacher noisy_classifier flow_teacher] [--seed 0]

Order matters: the VAE is judged by the classifier, the teacher needs the VAE and CLIP, the noise-aware
classifier (the guide of classifier guidance) the VAE and the teacher's noise schedule, the flow-matching teacher
the VAE and CLIP. The previous asset stays in place until the new one has been trained and copied completely. Next
to the weights, PROVENANCE.json records the command, seed, git revision, wall time and the final validation metrics.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from distill.worlds.digits import ASSET_NAMES, ASSET_ROOT

EXPERIMENTS = {"classifier": "asset_classifier", "vae": "asset_vae", "clip": "asset_clip", "teacher": "teacher",
               "noisy_classifier": "asset_noisy_classifier", "flow_teacher": "flow_teacher"}


def git_revision() -> str:
    """HEAD, with "+dirty" when tracked files differ from it (the weights then came from uncommitted code)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def last_metrics(run_dir: Path) -> dict:
    """The last logged value of every validation metric in the run's metrics.csv."""
    path = run_dir / "csv" / "metrics.csv"
    if not path.exists():
        return {}
    found: dict[str, float] = {}
    for row in csv.DictReader(open(path)):
        for key, value in row.items():
            if key.startswith("val/") and value:
                found[key] = float(value)
    return found


def build(name: str, seed: int, runs_root: Path, overrides: list[str]) -> Path:
    run_dir = runs_root / name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    command = [sys.executable, "-m", "distill.train", f"+exp={EXPERIMENTS[name]}", f"seed={seed}",
               "logger=csv", f"hydra.run.dir={run_dir}", *overrides]
    revision = git_revision()  # before training: the code that produced the weights
    start = time.time()
    subprocess.run(command, check=True)
    wall = time.time() - start
    staged = ASSET_ROOT / f".{name}.new"
    if staged.exists():
        shutil.rmtree(staged)
    shutil.copytree(run_dir / "export", staged)
    provenance = {
        "asset": name,
        "command": "python -m distill.train " + " ".join(command[3:]),
        "seed": seed,
        "git_revision": revision,
        "train_wall_time_s": round(wall, 1),
        "cpu_threads": os.cpu_count(),
        "final_metrics": last_metrics(run_dir),
        "date": time.strftime("%Y-%m-%d"),
    }
    (staged / "PROVENANCE.json").write_text(json.dumps(provenance, indent=2) + "\n")
    target = ASSET_ROOT / name
    if target.exists():
        shutil.rmtree(target)
    staged.rename(target)
    print(f"asset {name}: {target} ({wall / 60:.1f} min)")
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description="Rebuild the shipped digits assets.")
    parser.add_argument("assets", nargs="*", default=list(ASSET_NAMES), choices=list(ASSET_NAMES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs-root", type=Path, default=Path("outputs/assets"))
    args = parser.parse_args()
    ASSET_ROOT.mkdir(parents=True, exist_ok=True)
    for name in [n for n in ASSET_NAMES if n in args.assets]:
        build(name, args.seed, args.runs_root, [])


if __name__ == "__main__":
    main()
