"""Low rank of a diffusion transformer before any recovery: parameters, FLOPs and output error, rule by rule.

    python bench/lowrank_transformer.py                                   # the digits flow DiT, the default rules
    python bench/lowrank_transformer.py --pipeline PATH energy=0.9 rank=16 flops=0.5 params=0.5 --json out.json

A rule is ``energy=E`` (each layer's smallest rank keeping E of its squared singular values), ``rank=R``, ``params=B``
(a budget: B of the factorisable weights) or ``flops=B`` (B of one call's FLOPs, attention counted). Each factorises
the pipeline's transformer as ``student=lowrank`` does (``distill.compress.lowrank_transformer``, the block linears,
adaLN and embedders dense) and is measured on the teacher's own sampling at the pipeline's steps and guidance from
``--seeds`` seeds of every prompt:

* velocity error: ||v_low - v|| / ||v|| over the transformer's inputs of every call of those trajectories (recorded
  by a forward hook: conditional and unconditional halves, every step);
* image error: the mean absolute difference of the low-rank pipeline's images from the same seeds against the
  teacher's (pixels in [0, 1]);
* GFLOPs of one call at batch 1 with the recorded context length (``distill.utils.flops``: attention counted).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_PIPELINE = ROOT / "distill" / "worlds" / "digits" / "weights" / "flow_teacher"
DEFAULT_PROMPTS = [f"a handwritten digit {w}" for w in
                   ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")]
DEFAULT_RULES = ["energy=0.99", "energy=0.95", "energy=0.9", "rank=32", "rank=16", "rank=8", "flops=0.75",
                 "flops=0.5", "params=0.5"]
RULE_KWARGS = {"energy": lambda v: {"energy": float(v)}, "rank": lambda v: {"rank": int(v)},
               "params": lambda v: {"budget": float(v)}, "flops": lambda v: {"budget": float(v), "target": "flops"}}


def parse_rule(text: str) -> dict:
    kind, _, value = text.partition("=")
    if kind not in RULE_KWARGS or not value:
        raise SystemExit(f"rule {text!r}: use energy=E, rank=R, params=B or flops=B")
    return RULE_KWARGS[kind](value)


def record_calls(pipe, prompts: list[str], seeds: int):
    """(images (N, C, H, W), [keyword inputs of every transformer call]) of the pipeline's default sampling."""
    import torch

    calls = []

    def record(module, args, kwargs):
        calls.append({k: v.detach().clone() for k, v in kwargs.items() if torch.is_tensor(v)})

    hook = pipe.transformer.register_forward_pre_hook(record, with_kwargs=True)
    try:
        images = sample(pipe, prompts, seeds)
    finally:
        hook.remove()
    return images, calls


def sample(pipe, prompts: list[str], seeds: int):
    import torch

    out = []
    for seed in range(seeds):
        out.append(pipe(prompts, generator=torch.Generator().manual_seed(seed), output_type="pt").images)
    return torch.cat(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rules", nargs="*", default=DEFAULT_RULES, help="energy=E, rank=R, params=B or flops=B")
    parser.add_argument("--pipeline", default=str(DEFAULT_PIPELINE))
    parser.add_argument("--prompt", action="append", help="a prompt (repeat; default: the ten digit captions)")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    rules = [(text, parse_rule(text)) for text in args.rules]  # every rule checked before anything loads

    import torch
    from diffusers import DiffusionPipeline

    import distill.inference.pipelines  # noqa: F401  (distill's export classes)
    from distill.compress.lowrank import call_flops
    from distill.compress.lowrank_transformer import lowrank_transformer

    pipe = DiffusionPipeline.from_pretrained(args.pipeline)
    pipe.set_progress_bar_config(disable=True)
    teacher = pipe.transformer.eval()
    prompts = args.prompt or DEFAULT_PROMPTS
    images, calls = record_calls(pipe, prompts, args.seeds)
    one = {k: v[:1] for k, v in calls[0].items()}  # batch 1 for FLOPs and the factorisation's budget
    with torch.no_grad():
        velocities = [teacher(**c).sample for c in calls]
    rows = [{"rule": "teacher", "params": sum(p.numel() for p in teacher.parameters()),
             "gflops": call_flops(teacher, one) / 1e9, "velocity_error": 0.0, "image_error": 0.0, "layers": 0}]
    for text, kwargs in rules:
        start = time.perf_counter()
        low, report = lowrank_transformer(teacher, example_inputs=one, **kwargs)
        low.eval()
        with torch.no_grad():
            err2 = sum(float((low(**c).sample - v).square().sum()) for c, v in zip(calls, velocities))
        pipe.register_modules(transformer=low)
        low_images = sample(pipe, prompts, args.seeds)
        pipe.register_modules(transformer=teacher)
        rows.append({"rule": text, "params": report.model_params_after, "gflops": report.flops_after / 1e9,
                     "velocity_error": (err2 / sum(float(v.square().sum()) for v in velocities)) ** 0.5,
                     "image_error": float((low_images - images).abs().mean()), "layers": len(report.ranks)})
        print(f"{text}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    print(f"{args.pipeline}: {len(prompts)} prompts x {args.seeds} seeds, {len(calls)} transformer calls")
    print("| rule | params (M) | GFLOPs / call | layers factorised | velocity error | image error |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rule']} | {r['params'] / 1e6:.3f} | {r['gflops']:.4f} | {r['layers']} | "
              f"{r['velocity_error']:.4f} | {r['image_error']:.4f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
