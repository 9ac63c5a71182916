"""Compressed teachers before any recovery training, as pipeline folders that `distill.evaluate` measures.

    python bench/compress_untrained.py --out outputs/compress_untrained pruned30=pruned:0.3 pruned50=pruned:0.5 \\
        pruned70=pruned:0.7 lowrank50=lowrank:0.5 lowrank25=lowrank:0.25
    for d in outputs/compress_untrained/*/; do
      python -m distill.evaluate pipeline=$d schedulers=[ddim] steps=[25] guidance_scale=3.0 hydra.run.dir=$d/eval
    done

Each folder is the teacher's pipeline with its UNet replaced by the compressed one (built by the same student
builders as `student=pruned` / `student=lowrank`, magnitude importance, FLOPs target for pruning, parameter
budget for low rank), so that the "before recovery" rows of the compression table come from the same
evaluation as the trained students'.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build(kind: str, value: float, teacher):
    from distill.students.compressed import lowrank_student, pruned_student

    if kind == "pruned":
        return pruned_student(teacher.denoiser, ratio=value, teacher=teacher)
    if kind == "lowrank":
        return lowrank_student(teacher.denoiser, budget=value)
    raise SystemExit(f"unknown variant kind {kind!r}: use pruned:<ratio of FLOPs removed> or lowrank:<budget kept>")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="+", help="NAME=pruned:RATIO or NAME=lowrank:BUDGET")
    parser.add_argument("--teacher", default=None, help="a pipeline folder (default: the shipped asset 'teacher')")
    parser.add_argument("--out", default="outputs/compress_untrained")
    args = parser.parse_args(argv)
    specs = []
    for spec in args.variants:
        name, _, rest = spec.partition("=")
        kind, _, value = rest.partition(":")
        try:
            specs.append((name, kind, float(value)))
        except ValueError:
            parser.error(f"{spec!r}: expected NAME=pruned:RATIO or NAME=lowrank:BUDGET")

    import torch

    from distill.families import load_teacher

    if args.teacher is None:
        from distill.worlds import asset_path

        args.teacher = str(asset_path("teacher"))
    torch.manual_seed(0)
    for name, kind, value in specs:
        teacher = load_teacher(args.teacher)
        unet = build(kind, value, teacher).eval()
        out = Path(args.out) / name
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(args.teacher, out, ignore=shutil.ignore_patterns("unet", "README.md", "PROVENANCE.json"))
        unet.save_pretrained(out / "unet")
        index = json.loads((out / "model_index.json").read_text())
        index["unet"] = [type(unet).__module__, type(unet).__name__]  # the library diffusers imports it from
        (out / "model_index.json").write_text(json.dumps(index, indent=2))
        params = sum(p.numel() for p in unet.parameters())
        print(f"{name}: {type(unet).__name__}, {params} parameters -> {out}")


if __name__ == "__main__":
    main()
