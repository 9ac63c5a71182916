"""Students against their teacher in every feature space, each difference with its paired uncertainty.

    python bench/students_table.py "teacher=outputs/consistency_flow_digits/quality_cost.csv:teacher" \\
        "consistency=outputs/consistency_flow_digits/quality_cost.csv:student" \\
        "progressive=outputs/progressive_flow_digits/quality_cost.csv:student" \\
        --reference teacher@28 --out docs/flow_students_quality_cost.csv

Each argument is ``LABEL=CSV[:MODEL]``: the rows of ``CSV`` (a `distill.train` or `distill.evaluate`
quality_cost.csv) whose model column is ``MODEL`` (default: every row); of a (scheduler, steps) evaluated at several
training steps, the last evaluation (a progressive run evaluates each round's student at its own step count, so
each step count keeps the round that trained it). Every row gets, per feature space (``fid``, ``fid_pixels``,
``fid_clip``, and ``coverage`` where every row has it), its difference from the ``--reference`` row (``LABEL@STEPS``) with the paired bootstrap uncertainty
(``distill.metrics.report.difference_std``: the same prompts and seeds, resampled together); a difference within
its uncertainty is printed as "no measurable difference".
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SPACES = (("fid", "classifier"), ("fid_pixels", "pixels"), ("fid_clip", "CLIP"))
DIVERSITY = ("coverage", "coverage")  # a column where every row measured it (distill.metrics.manifold)
NUMERIC = ("steps", "nfe", "prompt_accuracy", "prompt_accuracy_std", "latency_s", "gflops_per_image", "step",
           *(k for key, _ in (*SPACES, DIVERSITY) for k in (key, f"{key}_std")))


def read_rows(spec: str) -> list[dict]:
    from distill.metrics.report import decode_replicates

    label, _, rest = spec.partition("=")
    path, _, model = rest.partition(":")
    if not label or not path:
        raise SystemExit(f"{spec!r}: expected LABEL=CSV[:MODEL]")
    rows = [r for r in csv.DictReader(open(path)) if not model or r["model"] == model]
    if not rows:
        raise SystemExit(f"{spec!r}: no rows (model {model!r}) in {path}")
    latest: dict[tuple, dict] = {}
    for r in rows:
        for key in NUMERIC:
            r[key] = float(r[key]) if r.get(key) not in (None, "") else float("nan")
        for key in (k for k in r if k.endswith("_replicates")):
            r[key] = decode_replicates(r[key]) if r[key] else None
        r["steps"], r["model"] = int(r["steps"]), label
        k = (r["scheduler"], r["steps"])
        if k not in latest or r["step"] >= latest[k]["step"]:
            latest[k] = r
    return sorted(latest.values(), key=lambda r: r["steps"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("specs", nargs="+")
    parser.add_argument("--reference", required=True, help="LABEL@STEPS: the row every difference is taken from")
    parser.add_argument("--out", help="the rows as CSV, with the differences")
    args = parser.parse_args(argv)
    from distill.metrics.report import difference_std

    rows = [row for spec in args.specs for row in read_rows(spec)]
    label, _, steps = args.reference.partition("@")
    refs = [r for r in rows if r["model"] == label and str(r["steps"]) == steps]
    if len(refs) != 1:
        raise SystemExit(f"--reference {args.reference!r}: {len(refs)} rows match (label {label!r}, steps {steps})")
    ref = refs[0]
    columns = [*SPACES, *([DIVERSITY] if all(r[DIVERSITY[0]] == r[DIVERSITY[0]] for r in rows) else [])]
    for r in rows:
        for key, _ in columns:
            r[f"{key}_diff"] = r[key] - ref[key]
            r[f"{key}_diff_std"] = difference_std(r, ref, key) if r is not ref else 0.0

    def cell(r, key):
        value, std = r[key], r[f"{key}_std"]
        f = 3 if key == DIVERSITY[0] else 2  # a share in [0, 1]
        if r is ref:
            return f"{value:.{f}f} ± {std:.{f}f}"
        diff, dstd = r[f"{key}_diff"], r[f"{key}_diff_std"]
        verdict = (f"{diff:+.{f}f} ± {dstd:.{f}f}" if abs(diff) > dstd
                   else f"no measurable difference ({diff:+.{f}f} ± {dstd:.{f}f})")
        return f"{value:.{f}f} ± {std:.{f}f} ({verdict})"

    head = " | ".join(f"FID {name} (vs {label} {steps} steps)" if key.startswith("fid") else
                      f"{name} (higher: more diverse)" for key, name in columns)
    print(f"| model | sampler | steps | NFE | {head} | prompt accuracy | latency / image | GFLOPs / image |")
    print("|---|---|---|---|" + "---|" * len(columns) + "---|---|---|")
    for r in rows:
        spaces = " | ".join(cell(r, key) for key, _ in columns)
        print(f"| {r['model']} | {r['scheduler']} | {r['steps']} | {r['nfe']:g} | {spaces} | "
              f"{100 * r['prompt_accuracy']:.1f}% | {1000 * r['latency_s']:.1f} ms | {r['gflops_per_image']:.2f} |")
    if args.out:
        keep = ["model", "scheduler", "steps", *NUMERIC[1:], *(f"{k}_diff{s}" for k, _ in columns for s in ("", "_std"))]
        with open(args.out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(keep)), extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
