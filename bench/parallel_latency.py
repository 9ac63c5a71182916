"""Latency per image of denoising over processes (distill.inference.parallel) against one process, on the same
cores: one process at 1 and at 2 threads, CFG parallel and AsyncDiff on 2 processes at 1 thread each.

    bash bench/parallel_latency.sh                      # every setting, one JSON line each -> docs/parallel_latency.csv
    python bench/parallel_latency.py --threads 2        # one process
    python -m torch.distributed.run --standalone --nproc_per_node=2 bench/parallel_latency.py --parallel cfg

One pipeline call per image batch (text encoder, every step, VAE decode), DDIM with the teacher's trailing spacing;
``--rounds`` timed calls after one untimed call, each started together on every rank (a barrier); the median of
rank 0's wall time over the batch. AsyncDiff's deviation from the one-process sample is reported beside it
(relative L2 of the latents, the same seed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pipeline", default=None, help="default: the digits UNet teacher")
    parser.add_argument("--parallel", default="none", choices=["none", "cfg", "asyncdiff"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--guidance", type=float, default=3.0)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--stride", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from distill.families import native_size
    from distill.inference.loading import load_pipeline
    from distill.inference.parallel import start
    from distill.inference.schedulers import make_scheduler
    from distill.worlds import asset_path

    path = args.pipeline or str(asset_path("teacher"))
    pipe = load_pipeline(path)
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = make_scheduler("ddim", pipe.scheduler.config, timestep_spacing="trailing")
    parallel = start(pipe, args.parallel, args.guidance, warmup_steps=args.warmup_steps, stride=args.stride,
                     timeout_s=60)
    group = parallel.group if parallel is not None else None
    size = native_size(pipe)
    prompts = [f"a handwritten digit {d}" for d in ("zero", "one", "two", "three", "four", "five", "six", "seven",
                                                     "eight", "nine")]
    prompts = (prompts * args.batch)[:args.batch]

    def call(output_type: str = "pil"):
        generator = torch.Generator().manual_seed(0)
        return pipe(prompts, guidance_scale=args.guidance, num_inference_steps=args.steps, height=size, width=size,
                    generator=generator, output_type=output_type).images

    latents = call("latent")  # untimed: the first call, and the sample the deviation is measured on
    seconds = []
    for _ in range(args.rounds):
        if group is not None:
            group.barrier()
        begun = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - begun)
    if group is not None:
        group.close()
        if group.rank:
            return
    reference = Path(f"/tmp/parallel_latency_reference_{args.steps}_{args.batch}.pt")
    deviation = None
    if args.parallel == "none" and args.threads == 1:
        torch.save(latents, reference)
    elif reference.exists():
        expected = torch.load(reference)
        deviation = float((latents - expected).norm() / expected.norm())
    median = statistics.median(seconds)
    print(json.dumps({"pipeline": Path(path).name, "parallel": args.parallel,
                      "processes": group.world_size if group else 1, "threads": args.threads, "steps": args.steps,
                      "guidance_scale": args.guidance, "batch": args.batch,
                      "warmup_steps": args.warmup_steps if args.parallel == "asyncdiff" else None,
                      "stride": args.stride if args.parallel == "asyncdiff" else None,
                      "ms_per_image": round(1e3 * median / args.batch, 2),
                      "ms_per_image_min": round(1e3 * min(seconds) / args.batch, 2), "rounds": args.rounds,
                      "owners": getattr(parallel, "owners", None), "latent_deviation": deviation}))


if __name__ == "__main__":
    main()
