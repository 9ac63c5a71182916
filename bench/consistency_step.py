"""Throughput of one latent-consistency-distillation step on the digits teacher, with its breakdown.

    python bench/consistency_step.py --batch-size 128 --repeats 5

Parts, timed separately (median of ``repeats`` runs of ``steps`` steps each, after warm-up): VAE encode,
guided teacher (conditional + unconditional in one batch) + DDIM solver step, target forward,
student forward + backward + optimizer step. Results go in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from distill.diffusion import ddim_step, guidance_condition
from distill.families import load_teacher
from distill.methods.consistency import LatentConsistencyDistillation
from distill.students.copies import copy_student
from distill.worlds.digits import asset_path
from distill.worlds.digits.data import DigitsDataModule


def timed(fn, steps: int, repeats: int) -> float:
    fn()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        runs.append((time.perf_counter() - start) / steps)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    teacher = load_teacher(str(asset_path("teacher")))
    method = LatentConsistencyDistillation(teacher, lambda unet: copy_student(unet, 256),
                                           optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4))
    optimizer = method.configure_optimizers()
    dm = DigitsDataModule(resolution=32, batch_size=args.batch_size)
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    n = args.batch_size
    x0 = method.encode(batch["pixel_values"])
    t = method.solver_timesteps[torch.randint(0, 50, (n,))]
    w = torch.full((n,), 2.0)
    cond = method.conditioner(batch)["encoder_hidden_states"]
    uncond = method.conditioner.null(n)["encoder_hidden_states"]
    w_kwargs = guidance_condition(w, method.w_dim, x0)

    def teacher_and_solver():
        x0_w, eps_w = method._teacher(x0, t, cond, uncond, w)
        return ddim_step(x0_w, eps_w, *method.schedule.alpha_sigma((t - method.skip).clamp(min=0), x0.ndim))

    def full():
        optimizer.zero_grad(set_to_none=True)
        method.loss(batch).backward()
        optimizer.step()
        method._update_target()

    def student():
        optimizer.zero_grad(set_to_none=True)
        method._consistency_fn(method.student, x0, t, cond, w_kwargs).square().mean().backward()
        optimizer.step()

    with torch.no_grad():
        parts = {
            "VAE encode": timed(lambda: method.encode(batch["pixel_values"]), args.steps, args.repeats),
            "teacher (CFG, 2 passes in 1 batch) + DDIM step": timed(teacher_and_solver, args.steps, args.repeats),
            "target forward": timed(lambda: method._consistency_fn(method.target, x0, t, cond, w_kwargs), args.steps, args.repeats),
        }
    parts["student forward + backward + AdamW"] = timed(student, args.steps, args.repeats)
    total = timed(full, args.steps, args.repeats)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {n}, digits teacher 32x32 -> 4x8x8")
    print("| part | ms per step | share |")
    print("|---|---|---|")
    for name, seconds in parts.items():
        print(f"| {name} | {seconds * 1e3:.0f} | {seconds / total:.0%} |")
    print(f"| **full step** | {total * 1e3:.0f} | {n / total:.0f} images/s |")


if __name__ == "__main__":
    main()
