"""Mean and spread over seeds of quality-cost rows from several runs, one table per comparison.

    python bench/seeds_table.py copy=outputs/moe_seeds/copy-s*/quality_cost.csv \
        moe_token=outputs/moe_seeds/moe_token-s*/quality_cost.csv --metric fid --out docs/moe_seeds.csv

Each ``label=glob`` names one variant; each file matched is one seed (its last evaluation step is used).
Rows are grouped by (model, scheduler, steps); the table shows mean +- sample standard deviation over
seeds and the number of seeds, so that a difference is only read as one when it exceeds the spread.
"""

from __future__ import annotations

import argparse
import csv
import glob
import statistics
from pathlib import Path


def last_step_rows(path: str, model: str = "student") -> dict[tuple, dict]:
    rows = [r for r in csv.DictReader(open(path)) if r["model"] == model]
    if not rows:
        raise ValueError(f"{path} has no rows of model {model!r}")
    last = max(int(r["step"] or 0) for r in rows)
    return {(r["scheduler"], int(r["steps"])): r for r in rows if int(r["step"] or 0) == last}


def summarise(variants: dict[str, list[str]], metric: str, model: str = "student") -> list[dict]:
    out = []
    for label, files in variants.items():
        if not files:
            raise ValueError(f"{label}: no file matched")
        per_seed = [last_step_rows(f, model) for f in files]
        for key in sorted(set.intersection(*(set(p) for p in per_seed))):
            values = [float(p[key][metric]) for p in per_seed]
            out.append({"variant": label, "scheduler": key[0], "steps": key[1], "seeds": len(values),
                        "mean": statistics.fmean(values),
                        "std": statistics.stdev(values) if len(values) > 1 else float("nan"),
                        "values": " ".join(f"{v:.3f}" for v in values)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+", help="label=glob of quality_cost.csv files, one per seed")
    parser.add_argument("--metric", default="fid")
    parser.add_argument("--model", default="student")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    variants = {}
    for spec in args.variants:
        label, _, pattern = spec.partition("=")
        variants[label] = sorted(glob.glob(pattern))
    rows = summarise(variants, args.metric, args.model)
    print(f"| variant | sampler | steps | {args.metric} mean ± sd | seeds | per seed |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['scheduler']} | {r['steps']} | {r['mean']:.2f} ± {r['std']:.2f} | {r['seeds']} | {r['values']} |")
    if args.out:
        with open(args.out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
