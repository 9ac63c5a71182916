"""Training throughput of plain diffusion training (images/s of one optimizer step), per UNet size.

    python bench/train_throughput.py --sizes debug tiny small --batch-size 128 --repeats 5

Times forward + backward + AdamW step on the digits; reports the median of ``repeats`` timings of
``steps`` steps each, after warm-up. Results go in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from diffusers import DDPMScheduler

from distill.methods.diffusion import DiffusionTraining
from distill.models.conditioning import ClassConditioner
from distill.students.sized import build_class_unet
from distill.worlds.digits.data import DigitsDataModule


def measure(size: str, batch_size: int, resolution: int, steps: int, repeats: int) -> tuple[float, int]:
    torch.manual_seed(0)
    dm = DigitsDataModule(resolution=resolution, batch_size=batch_size)
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    method = DiffusionTraining(
        student=build_class_unet(resolution, 1, size=size),
        noise_scheduler=DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012),
        conditioner=ClassConditioner(10),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
    )
    opt = method.configure_optimizers()

    def step():
        opt.zero_grad(set_to_none=True)
        method.loss(batch).backward()
        opt.step()

    for _ in range(3):
        step()
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        timings.append(time.perf_counter() - start)
    n_params = sum(p.numel() for p in method.student.parameters())
    return batch_size * steps / statistics.median(timings), n_params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["debug", "tiny", "small"])
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--resolution", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch_size}, {args.resolution}x{args.resolution}")
    print(f"| UNet size | parameters | images/s (median of {args.repeats}) |")
    print("|---|---|---|")
    for size in args.sizes:
        ips, n = measure(size, args.batch_size, args.resolution, args.steps, args.repeats)
        print(f"| {size} | {n / 1e6:.2f}M | {ips:.0f} |")


if __name__ == "__main__":
    main()
