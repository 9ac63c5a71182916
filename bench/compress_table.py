"""One quality-cost table and Pareto plot from several runs' CSVs (compressed students against their teacher,
sampling accelerators against plain sampling, ...).

    python bench/compress_table.py teacher=outputs/compress/pruned50/quality_cost.csv:teacher \\
        "pruned50 untrained=outputs/compress_untrained/pruned50/eval/quality_cost.csv" \\
        "pruned50=outputs/compress/pruned50/quality_cost.csv:student" ... \\
        --out docs/compress_quality_cost.csv --plot docs/compress_pareto.png

Each argument is ``LABEL=CSV[:MODEL]``: the rows of ``CSV`` (a `distill.train` quality_cost.csv, or a
`distill.evaluate` one) whose model column is ``MODEL`` (default: every row), at the last evaluated training step,
relabelled ``LABEL``. The plot puts FID against GFLOPs per image (the cost that does not depend on the machine's
load; latency is measured side by side by bench/compress_latency.py).
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NUMERIC = ("steps", "nfe", "fid", "fid_std", "prompt_accuracy", "prompt_accuracy_std", "clip_score", "latency_s",
           "gflops_per_image", "params_m", "peak_memory_mb")


def read_rows(spec: str) -> list[dict]:
    label, _, rest = spec.partition("=")
    path, _, model = rest.partition(":")
    if not label or not path:
        raise SystemExit(f"{spec!r}: expected LABEL=CSV[:MODEL]")
    rows = list(csv.DictReader(open(path)))
    if model:
        rows = [r for r in rows if r["model"] == model]
    if not rows:
        raise SystemExit(f"{spec!r}: no rows (model {model!r}) in {path}")
    if rows[0].get("step"):
        last = max(int(r["step"]) for r in rows)
        rows = [r for r in rows if int(r["step"]) == last]
    out = []
    for r in rows:
        row = {k: float(r[k]) for k in NUMERIC if r.get(k) not in (None, "")}
        row.update(model=label, scheduler=r["scheduler"], steps=int(float(r["steps"])))
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("specs", nargs="+")
    parser.add_argument("--out", required=True)
    parser.add_argument("--plot")
    parser.add_argument("--title", default="compressed students: FID vs GFLOPs per image")
    parser.add_argument("--groups", nargs="+", default=None, metavar="NAME=PREFIX",
                        help="one plot series per group: the rows whose label starts with PREFIX, each point labelled "
                             "by the rest of its label")
    args = parser.parse_args(argv)
    groups = []
    for item in args.groups or []:
        name, sep, prefix = item.partition("=")
        if not sep or not name:
            parser.exit(2, f"error: --groups {item!r}: give NAME=PREFIX\n")
        groups.append((name, prefix))
    rows = [row for spec in args.specs for row in read_rows(spec)]
    from distill.metrics.report import plot_pareto, write_csv

    write_csv(rows, Path(args.out))
    if args.plot:
        def group(r):  # the longest matching prefix
            return max(((len(p), (n, p)) for n, p in groups if r["model"].startswith(p)), default=(0, (r["model"], "")))[1]

        plot_pareto(rows, Path(args.plot), title=args.title, x="gflops_per_image",
                    series_of=(lambda r: group(r)[0]) if groups else None,
                    point_label=(lambda r: r["model"][len(group(r)[1]):].lstrip("-") or "plain") if groups else None)
    print("| model | sampler | steps | NFE | params (M) | GFLOPs / image | FID | prompt accuracy |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['scheduler']} | {r['steps']} | {r.get('nfe', float('nan')):g} | "
              f"{r.get('params_m', float('nan')):.3f} | {r.get('gflops_per_image', float('nan')):.3f} | "
              f"{r['fid']:.2f} ± {r.get('fid_std', 0):.2f} | {100 * r.get('prompt_accuracy', float('nan')):.1f}% |")


if __name__ == "__main__":
    main()
