"""Sampling latency of the training-free accelerators side by side: every variant in one process, interleaved
(the order rotated each round), same device, dtype, prompts and generator; median over rounds.

    python bench/accelerate_latency.py --threads 2 --out docs/accelerate_latency.json   # the default set
    python bench/accelerate_latency.py --variants "ddim50" "ddim50 deepcache:interval=3" --rounds 3

A variant is ``<scheduler><steps>[@cfg<scale>] [<accelerator>[:key=value,...]]`` on the pipeline ``--teacher``,
or on ``--lcm`` when it starts with ``lcm:`` (e.g. ``lcm:lcm4 deepcache:interval=2``). Accelerators are those of
``distill.accelerate`` (deepcache, forecast, classifier) with their options; ``@cfg`` sets the guidance scale
(default: the pipeline's intended one). Columns: UNet evaluations per image (NFE: a CFG step counts 2; predicted
steps none), GFLOPs per image of one whole sampling call, ms per image at each batch size (one pipeline call:
text encoder, every step, VAE decode; over the batch), the speed-up against the variant's baseline (the same
pipeline, scheduler, steps and guidance without an accelerator; per round, median over rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_VARIANTS = [
    "ddim50", "ddim50 deepcache:interval=2", "ddim50 deepcache:interval=3", "ddim50 deepcache:interval=5",
    "ddim50 forecast:interval=2", "ddim50 forecast:interval=5",
    "dpmsolver20", "dpmsolver20 deepcache:interval=2", "dpmsolver20 forecast:interval=2",
    "dpmsolver20 forecast:interval=3",
    "ddim50@cfg1", "ddim50@cfg1 classifier:scale=3", "ddim50 classifier:scale=3",
    "lcm:lcm4", "lcm:lcm4 deepcache:interval=2",
]


def parse_value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "null": None}.get(text, text)


def parse_variant(text: str) -> dict:
    """``[lcm:]<scheduler><steps>[@cfg<w>] [kind[:k=v,...]]`` -> its settings; ValueError naming what is wrong."""
    import re

    from distill.accelerate import ACCELERATORS, make_accelerator

    parts = text.split()
    if not parts or len(parts) > 2:
        raise ValueError(f"variant {text!r}: give '<scheduler><steps>[@cfg<w>] [accelerator[:k=v,...]]'")
    head = parts[0]
    pipeline = "lcm" if head.startswith("lcm:") else "teacher"
    m = re.fullmatch(r"(?:lcm:)?([a-z]+?)(\d+)(?:@cfg([\d.]+))?", head)
    if m is None:
        raise ValueError(f"variant {text!r}: {head!r} is not <scheduler><steps>[@cfg<w>]")
    kind, options = "none", {}
    if len(parts) == 2:
        kind, _, rest = parts[1].partition(":")
        if kind not in ACCELERATORS:
            raise ValueError(f"variant {text!r}: accelerator {kind!r} is not one of {sorted(ACCELERATORS)}")
        options = {k: parse_value(v) for k, v in (item.split("=", 1) for item in rest.split(",") if item)}
    if kind == "classifier":  # the guide the presets name: the shipped digits asset of the mode
        from distill.worlds.digits import asset_path

        guide = {"noisy": "noisy_classifier", "x0": "classifier", "clip": "clip"}[options.get("mode", "noisy")]
        options.setdefault("classifier", str(asset_path(guide)))
    make_accelerator(kind, options)  # bad options fail here, before anything is loaded
    return {"label": text, "pipeline": pipeline, "scheduler": m[1], "steps": int(m[2]),
            "guidance_scale": float(m[3]) if m[3] else None, "kind": kind, "options": options}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher", default=None, help="pipeline folder (default: the embedded digits teacher)")
    parser.add_argument("--lcm", default=None, help="an LCM student's export (for the lcm: variants)")
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--prompt", default="a handwritten digit 7")
    parser.add_argument("--label", type=int, default=7, help="the prompt's class, for classifier guidance")
    parser.add_argument("--out", default=None, help="JSON results (default: print only)")
    args = parser.parse_args(argv)
    try:
        variants = [parse_variant(v) for v in args.variants]
        if any(v["pipeline"] == "lcm" for v in variants) and not args.lcm:
            raise ValueError("lcm: variants need --lcm <an LCM export folder>")
    except ValueError as err:
        parser.exit(2, f"error: {err}\n")
    if args.threads:
        torch.set_num_threads(args.threads)

    from distill.accelerate import accelerated, make_accelerator
    from distill.inference.loading import load_pipeline, pipeline_defaults
    from distill.inference.schedulers import make_scheduler, scheduler_options
    from distill.metrics.cost import NFECounter
    from distill.utils.flops import count_flops
    from distill.worlds.digits import asset_path

    paths = {"teacher": args.teacher or str(asset_path("teacher")), "lcm": args.lcm}
    pipes = {k: load_pipeline(p) for k, p in paths.items() if p and any(v["pipeline"] == k for v in variants)}
    for pipe in pipes.values():
        pipe.set_progress_bar_config(disable=True)
    schedulers = {}

    def call(v: dict, batch: int):
        pipe = pipes[v["pipeline"]]
        key = (v["pipeline"], v["scheduler"])
        if key not in schedulers:
            schedulers[key] = make_scheduler(v["scheduler"], pipe.scheduler.config, **scheduler_options(v["scheduler"]))
        pipe.scheduler = schedulers[key]
        guidance = v["guidance_scale"]
        if guidance is None:
            guidance = pipeline_defaults(paths[v["pipeline"]]).get("guidance_scale", 1.0)
        if "accelerator" not in v:  # built once (a guide is loaded once), outside the timed calls after the warm-up
            v["accelerator"] = make_accelerator(v["kind"], v["options"])
        with accelerated(pipe, v["accelerator"], scheduler_name=v["scheduler"], guidance_scale=guidance,
                         labels=torch.full((batch,), args.label)):
            return pipe([args.prompt] * batch, num_inference_steps=v["steps"], guidance_scale=guidance,
                        generator=torch.Generator().manual_seed(0), output_type="pt").images

    for v in variants:  # warm-up and the batch-1 counts
        pipe = pipes[v["pipeline"]]
        with NFECounter(pipe.unet) as counter:
            call(v, 1)
        v["nfe"] = counter.examples
        v["gflops_per_image"] = count_flops(lambda v=v: call(v, 1)) / 1e9
        for b in args.batch_sizes:
            call(v, b)
    times = {(v["label"], b): [] for v in variants for b in args.batch_sizes}
    for r in range(args.rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for b in args.batch_sizes:
            for v in order:
                start = time.perf_counter()
                call(v, b)
                times[(v["label"], b)].append((time.perf_counter() - start) / b)
    rows = []
    for v in variants:
        base = next(u for u in variants if (u["pipeline"], u["scheduler"], u["steps"], u["guidance_scale"]) ==
                    (v["pipeline"], v["scheduler"], v["steps"], v["guidance_scale"]) and u["kind"] == "none") \
            if any(u["kind"] == "none" and (u["pipeline"], u["scheduler"], u["steps"], u["guidance_scale"]) ==
                   (v["pipeline"], v["scheduler"], v["steps"], v["guidance_scale"]) for u in variants) else None
        row = {k: v[k] for k in ("label", "nfe", "gflops_per_image")}
        for b in args.batch_sizes:
            row[f"ms_per_image_b{b}"] = 1e3 * statistics.median(times[(v["label"], b)])
            if base is not None:
                ratios = [t0 / t for t0, t in zip(times[(base["label"], b)], times[(v["label"], b)])]
                row[f"speedup_b{b}"] = statistics.median(ratios)
        rows.append(row)
    print("| variant | NFE | GFLOPs/image | " + " | ".join(f"ms/image b{b} | speed-up b{b}" for b in args.batch_sizes) + " |")
    print("|---|---|---|" + "---|---|" * len(args.batch_sizes))
    for row in rows:
        cells = [f"{row[f'ms_per_image_b{b}']:.1f} | {row.get(f'speedup_b{b}', float('nan')):.2f}x"
                 for b in args.batch_sizes]
        print(f"| {row['label']} | {row['nfe']:g} | {row['gflops_per_image']:.3f} | " + " | ".join(cells) + " |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "command": "python bench/accelerate_latency.py " + shlex.join(sys.argv[1:] if argv is None else argv),
            "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "rounds": args.rounds,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
