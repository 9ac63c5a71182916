"""FID against training images for runs that logged the quality-cost callback (``quality_cost.csv``), and the
training images each run needed to reach a fixed FID.

    python bench/quality_curve.py outputs/ct/ect outputs/ct/ect_noise --steps 2 --target 6.0 --out docs/ct/curve.md

For each run directory: its batch size (``config.yaml``) and, per evaluation step, the FID (± its sample-draw
standard deviation) of the student at ``--steps`` sampling steps. ``--target``: the first evaluation at which the FID
is at or below the target, as training images (steps x batch size); evaluations are every
``callbacks.quality_cost.every_n_steps``, so this is an upper bound at that resolution. The teacher's rows, if any,
are listed once.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import yaml


def read(run: Path) -> tuple[int, list[dict]]:
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    path = run / "quality_cost.csv"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: was the run made with callbacks.quality_cost?")
    return int(cfg["data"]["batch_size"]), list(csv.DictReader(open(path)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 2], help="the student's sampling steps to list")
    parser.add_argument("--target", type=float, default=None, help="FID to reach (at the last of --steps)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    lines = ["| run | train step | images | " + " | ".join(f"FID @ {s} steps" for s in args.steps) + " |",
             "|---|---|---|" + "---|" * len(args.steps)]
    teacher, reached = {}, []
    for run in args.runs:
        batch, rows = read(run)
        by_step: dict[int, dict[int, str]] = {}
        for r in rows:
            if r["model"] == "teacher":
                teacher[(r["scheduler"], r["steps"])] = f"{float(r['fid']):.2f} ± {float(r['fid_std']):.2f}"
                continue
            by_step.setdefault(int(r["step"]), {})[int(float(r["steps"]))] = r
        hit = None
        for step in sorted(by_step):
            cells = [by_step[step].get(s) for s in args.steps]
            lines.append(f"| {run.name} | {step} | {step * batch} | " + " | ".join(
                f"{float(c['fid']):.2f} ± {float(c['fid_std']):.2f}" if c else "" for c in cells) + " |")
            last = cells[-1]
            if hit is None and args.target is not None and last and float(last["fid"]) <= args.target:
                hit = step
        if args.target is not None:
            reached.append(f"- {run.name}: FID <= {args.target} at {args.steps[-1]} steps "
                           + (f"first at step {hit} ({hit * batch} images)" if hit else "not reached"))
    for (scheduler, steps), fid in sorted(teacher.items()):
        lines.append(f"| teacher ({scheduler}) | | | {steps} steps: {fid} |" + " |" * (len(args.steps) - 1))
    text = "\n".join(lines + ([""] + reached if reached else [])) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
