"""Sampling latency and memory of whole pipelines side by side: exported students and their teacher, each called
as a user calls it, every variant in one process, interleaved (the order rotated each round), same device, dtype,
prompts and generator seed; median over rounds.

    python bench/pipeline_latency.py --threads 2 --batch-sizes 1 16 --rounds 5 --out docs/flow_students_latency.json \
        "teacher@28=distill/worlds/digits/weights/flow_teacher:steps=28,guidance_scale=3.0" \
        "consistency@4=outputs/consistency_flow_trailing/export:steps=4" --reference teacher@28

A variant is ``NAME=FOLDER[:key=value,...]``: the folder is loaded with ``DiffusionPipeline.from_pretrained`` (the
class its ``model_index.json`` names; ``distill``'s pipeline classes are registered first), and each call passes
``num_inference_steps`` (``steps``), ``guidance_scale`` and any other ``key=value`` given, nothing else: an export's
own defaults (its ``distill.json`` call) fill the rest, as for a user. ``accelerate=PRESET`` samples with a
training-free accelerator of ``conf/accelerate`` (``distill.accelerate.enable``, once, before any call) and
``accelerate.KEY=VALUE`` sets its options (``accelerate.path``: default the folder), e.g.
``"fbcache=FOLDER:steps=28,accelerate=fbcache,accelerate.threshold=0.08"``. Columns:

* NFE / image: the denoiser's calls in one sampling call over the batch (``distill.metrics.cost.NFECounter``: a CFG
  step counts 2 where the pipeline batches both branches); a call a cache shortened counts, and ``cached_share``
  in the JSON is the share of calls that were shortened;
* ms / image at each batch size: one pipeline call for B prompts (text encoder, every step, VAE decode) over B;
* speed-up against ``--reference``: per round, median over rounds (median of ratios), and beside it the
  reference's median time over the variant's (ratio of medians): the two differ when the load drifts;
* peak memory MB: the pipeline's weights plus the peak tensor memory allocated during one call at the largest
  batch above what was allocated before it (``bench/compress_latency.py``'s ``peak_call_bytes``).

Every variant is called once per batch size before the rounds (not timed). Results go in BENCHMARKS.md or the
document of the table they complete.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from accelerate_latency import parse_value  # noqa: E402
from compress_latency import (  # noqa: E402  (bench scripts share their timing helpers)
    clock,
    environment,
    median_of_ratios,
    peak_call_bytes,
    ratio_of_medians,
)

MIB = 2**20


def parse_variant(text: str) -> tuple[str, Path, dict]:
    """``NAME=FOLDER[:k=v,...]`` -> (name, folder, call arguments); ValueError naming what is wrong."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise ValueError(f"variant {text!r}: give NAME=FOLDER[:steps=N,guidance_scale=W,...]")
    folder, _, options = rest.partition(":")
    call = {}
    for item in filter(None, options.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"variant {name}: option {item!r} is not key=value")
        call["num_inference_steps" if key == "steps" else key] = parse_value(value)
    options = sorted(k for k in call if k.startswith("accelerate."))
    if options and "accelerate" not in call:
        raise ValueError(f"variant {name}: accelerator options {options} without accelerate=PRESET")
    path = Path(folder)
    if not (path / "model_index.json").is_file():
        raise ValueError(f"variant {name}: {folder} has no model_index.json; give a pipeline folder "
                         f"(a distill export or a diffusers pipeline saved with save_pretrained)")
    return name, path, call


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("variants", nargs="+", help="NAME=FOLDER[:steps=N,guidance_scale=W,...]")
    p.add_argument("--reference", help="the variant the speed-ups are against (default: the first)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=1, help="calls per variant, batch size and round")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--prompt", default="3", help="the prompt of every image (the batch repeats it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="JSON with the environment, per-round times and the table")
    args = p.parse_args(argv)
    try:
        args.specs = [parse_variant(v) for v in args.variants]
    except ValueError as e:
        p.error(str(e))
    names = [s[0] for s in args.specs]
    if len(set(names)) != len(names):
        p.error(f"variant names must differ: {names}")
    args.reference = args.reference or names[0]
    if args.reference not in names:
        p.error(f"--reference {args.reference} is not a variant: {names}")
    if args.rounds < 1 or args.repeats < 1 or min(args.batch_sizes) < 1:
        p.error("--rounds, --repeats and every batch size must be >= 1")
    return args


class Variant:
    def __init__(self, name: str, folder: Path, call: dict, device: torch.device, dtype: torch.dtype,
                 prompt: str, seed: int):
        from diffusers import DiffusionPipeline

        import distill.inference.pipelines  # noqa: F401  (registers distill's pipeline classes)
        from distill.families import denoiser_of

        call = dict(call)
        kind = call.pop("accelerate", None)
        options = {k.removeprefix("accelerate."): call.pop(k) for k in list(call) if k.startswith("accelerate.")}
        self.name, self.folder, self.call = name, folder, call
        self.pipe = DiffusionPipeline.from_pretrained(folder, dtype=dtype).to(device)
        self.pipe.set_progress_bar_config(disable=True)
        self.accelerator = None
        if kind is not None:
            from distill.accelerate import accelerator_options, enable, make_accelerator

            node = accelerator_options(kind)
            self.accelerator = make_accelerator(node["kind"], {**node["options"], **options}, path=str(folder))
            enable(self.pipe, self.accelerator, guidance_scale=call.get("guidance_scale"))
        self.denoiser = denoiser_of(self.pipe)
        self.device, self.prompt, self.seed = device, prompt, seed
        self.rounds_s: dict[int, list[float]] = {}
        self.weights_bytes = sum(p.numel() * p.element_size()
                                 for m in self.pipe.components.values() if isinstance(m, torch.nn.Module)
                                 for p in m.parameters())

    def sample(self, batch: int):
        generator = torch.Generator("cpu").manual_seed(self.seed)
        with torch.no_grad():
            return self.pipe([self.prompt] * batch, generator=generator, output_type="pt", **self.call).images

    def nfe(self, batch: int) -> float:
        from distill.metrics.cost import NFECounter

        with NFECounter(self.denoiser) as counter:
            self.sample(batch)
        self.cached_share = counter.cached / max(counter.calls, 1)  # of the network calls, those that skipped part
        return counter.examples / batch


def run(args: argparse.Namespace) -> dict:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    variants = [Variant(*spec, device, dtype, args.prompt, args.seed) for spec in args.specs]
    largest = max(args.batch_sizes)
    for v in variants:  # warm-up: every batch size once, not timed
        for b in args.batch_sizes:
            v.sample(b)
        v.nfe_per_image = v.nfe(1)
        v.peak_mb = (peak_call_bytes(lambda v=v: v.sample(largest), device) + v.weights_bytes) / MIB
    for r in range(args.rounds):
        start = time.perf_counter()
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for b in args.batch_sizes:
            for v in order:
                v.rounds_s.setdefault(b, []).append(clock(lambda v=v, b=b: v.sample(b), args.repeats, device) / b)
        print(f"round {r + 1}/{args.rounds}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    ref = next(v for v in variants if v.name == args.reference)
    rows = []
    for v in variants:
        row = {"variant": v.name, "folder": str(v.folder), "call": v.call,
               "accelerator": v.accelerator.describe() if v.accelerator is not None else None,
               "nfe_per_image": v.nfe_per_image, "cached_share": v.cached_share,
               "peak_memory_mb": v.peak_mb, "rounds_s_per_image": {str(b): s for b, s in v.rounds_s.items()}}
        for b in args.batch_sizes:
            row[f"ms_per_image_b{b}"] = 1e3 * statistics.median(v.rounds_s[b])
            row[f"speedup_b{b}_median_of_ratios"] = median_of_ratios(ref.rounds_s[b], v.rounds_s[b])
            row[f"speedup_b{b}_ratio_of_medians"] = ratio_of_medians(ref.rounds_s[b], v.rounds_s[b])
        rows.append(row)
    return {"rows": rows}


def table(rows: list[dict], batch_sizes: list[int], reference: str) -> str:
    head = (["variant", "call", "NFE / image"] + [f"ms / image b{b}" for b in batch_sizes]
            + [f"speed-up vs {reference} b{b} (median of ratios / ratio of medians)" for b in batch_sizes]
            + [f"peak memory MB (b{max(batch_sizes)})"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        call = ", ".join([f"{k}={v}" for k, v in r["call"].items()] + ([r["accelerator"]] if r["accelerator"] else []))
        cells = ([r["variant"], call, f"{r['nfe_per_image']:g}"]
                 + [f"{r[f'ms_per_image_b{b}']:.1f}" for b in batch_sizes]
                 + [f"{r[f'speedup_b{b}_median_of_ratios']:.2f}x / {r[f'speedup_b{b}_ratio_of_medians']:.2f}x"
                    for b in batch_sizes]
                 + [f"{r['peak_memory_mb']:.1f}"])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    env = {**environment(args, torch.device(args.device), argv),
           "command": shlex.join([sys.executable, "bench/pipeline_latency.py", *argv])}
    print(f"command: {env['command']}\ntorch {env['torch']}, diffusers {env['diffusers']}, {env['threads']} threads, "
          f"CPU {env['cpu']}, device {env['device']}, {args.dtype}", flush=True)
    result = run(args)
    text = table(result["rows"], args.batch_sizes, args.reference)
    print(text)
    out = {"environment": env, "batch_sizes": args.batch_sizes, "rounds": args.rounds, "reference": args.reference,
           **result, "table": text}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
