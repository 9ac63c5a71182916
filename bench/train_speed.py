"""Training speed of latent consistency distillation: distill's `+exp=consistency` with each speed switch
against a minimal plain-PyTorch loop of the same algorithm (fp32, same teacher, data and batch).

    python bench/train_speed.py --batch-sizes 32 128 --steps 30 --warmup 10 --repeats 3
    python bench/train_speed.py --configs default latent_cache --batch-sizes 128   # a subset

Each measurement is its own process, as a user runs it: ``python -m distill.train +exp=consistency ...`` with
a step timer callback, or this file's ``--plain`` loop. Images/s are taken over the steps after ``warmup``
(start-up, compilation and the final save cancelled out); the first ``warmup`` steps' time is reported
apart (it holds torch.compile's compilation). Runs are interleaved (plain loop, then every configuration,
``repeats`` times) and each configuration's speed-up is the median over repeats of its images/s divided
by the plain loop's of the same repeat. Results go in BENCHMARKS.md.

The plain loop follows the structure of diffusers' examples/consistency_distillation/train_lcm_distill_sd_wds.py
(Luo et al. 2023, Algorithm 1), written here from the paper: per step it encodes the images with the VAE and
the captions with the text encoder, runs the teacher's conditional and unconditional passes, one skipping
DDIM step, the EMA target, the pseudo-Huber loss, gradient clipping, AdamW and a per-parameter EMA update.
The algorithm is distill's default (per-example pseudo-Huber, zero-initialised w projection, warm-up + cosine
LR); the per-step work is the reference script's, and differs from distill's in three places that are
framework choices, not the algorithm: distill embeds each distinct caption once (a cache) instead of running the
text encoder on every batch, runs the conditional and unconditional teacher passes as one batch of 2N, and
updates the EMA target with one fused ``_foreach_lerp_`` instead of a loop over parameters.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

ROOT = Path(__file__).resolve().parents[1]
SWITCHES = {
    "default": [],
    "latent_cache": ["method.latent_cache=true"],
    "teacher_bf16": ["method.frozen_dtype=bf16"],
    "student_bf16": ["trainer.precision=bf16-mixed"],
    "channels_last": ["method.channels_last=true"],
    "fused_adamw": ["+method.optimizer.fused=true"],
    "compile": ["method.compile=true"],
    "cache+teacher_bf16": ["method.latent_cache=true", "method.frozen_dtype=bf16"],
    "cache+bf16": ["method.latent_cache=true", "method.frozen_dtype=bf16", "trainer.precision=bf16-mixed"],
    "cache+bf16+compile": ["method.latent_cache=true", "method.frozen_dtype=bf16", "trainer.precision=bf16-mixed",
                           "method.compile=true"],
}


class StepTimer(L.Callback):
    """Wall time at the end of every training batch, written to ``step_times.json`` in the run directory."""

    def __init__(self):
        self.times: list[float] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.times.append(time.perf_counter())  # times[0]: the start, before the first step (and its compilation)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module) -> None:
        Path(trainer.default_root_dir, "step_times.json").write_text(json.dumps(self.times))


def images_per_s(times: list[float], batch_size: int, warmup: int) -> tuple[float, float]:
    """(images/s over the steps after ``warmup``, seconds of the first ``warmup`` steps); ``times`` holds the
    start and then the end of every step."""
    steady = times[warmup:]
    return batch_size * (len(steady) - 1) / (steady[-1] - steady[0]), times[warmup] - times[0]


# ---------------------------------------------------------------------------------------------- plain loop

def plain_loop(batch_size: int, steps: int, seed: int = 0) -> list[float]:
    """The minimal fp32 LCM loop; returns the wall time at its start and at the end of each step."""
    from diffusers import UNet2DConditionModel

    from distill.assets import asset_path
    from distill.data import DigitsDataModule
    from distill.models.teacher import load_teacher

    torch.manual_seed(seed)
    teacher = load_teacher(str(asset_path("teacher")))
    vae, text_encoder, tokenizer = teacher.vae.eval(), teacher.text_encoder.eval(), teacher.tokenizer
    teacher_unet = teacher.unet.eval().requires_grad_(False)
    for m in (vae, text_encoder):
        m.requires_grad_(False)
    student = UNet2DConditionModel.from_config({**teacher_unet.config, "time_cond_proj_dim": 256})
    student.load_state_dict(teacher_unet.state_dict(), strict=False)  # teacher weights; the w-embedding new
    torch.nn.init.zeros_(student.time_embedding.cond_proj.weight)  # so that the student starts as the teacher
    student.train()
    target = UNet2DConditionModel.from_config(student.config).eval().requires_grad_(False)
    target.load_state_dict(student.state_dict())
    optimizer = torch.optim.AdamW(student.parameters(), lr=2e-4, weight_decay=0.0)
    def lr_factor(s: int) -> float:  # linear warm-up over 50 steps, cosine to 0.1 at 1,000 (the experiment's)
        if s < 50:
            return (s + 1) / 50
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - 50) / 950)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)

    abar = teacher.scheduler.alphas_cumprod.float()
    T, n_solver = teacher.scheduler.config.num_train_timesteps, 50
    skip = T // n_solver
    solver_t = torch.arange(1, n_solver + 1) * skip - 1  # t_n on the DDIM solver grid
    huber_c, sigma_data, t_scale, ema = 0.001, 0.5, 10.0, 0.95

    def tokens(captions):
        return tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                         return_tensors="pt").input_ids

    def scalings(t):  # LCM boundary scalings at timestep_scaling 10
        s = (t * t_scale).float()
        c_skip = sigma_data**2 / (s**2 + sigma_data**2)
        return c_skip.view(-1, 1, 1, 1), (s / (s**2 + sigma_data**2).sqrt()).view(-1, 1, 1, 1)

    def w_embedding(w, dim=256):  # sinusoidal embedding of w * 1000 (as LCM)
        half = dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half) / (half - 1))
        args = (w * 1000.0)[:, None] * freqs[None]
        return torch.cat([args.sin(), args.cos()], dim=1)

    def x0_of(eps, x, t):
        a = abar[t].sqrt().view(-1, 1, 1, 1)
        s = (1 - abar[t]).sqrt().view(-1, 1, 1, 1)
        return (x - s * eps) / a

    with torch.no_grad():
        uncond = text_encoder(tokens([""]))[0]
    dm = DigitsDataModule(resolution=32, batch_size=batch_size)
    dm.setup()
    loader = dm.train_dataloader()
    times, step = [time.perf_counter()], 0
    while step < steps:
        for batch in loader:
            with torch.no_grad():
                latents = vae.encode(batch["pixel_values"]).latent_dist.sample() * vae.config.scaling_factor
                cond = text_encoder(tokens(batch["caption"]))[0]
            n = latents.shape[0]
            index = torch.randint(0, n_solver, (n,))
            t = solver_t[index]
            t_prev = (t - skip).clamp(min=0)
            noise = torch.randn_like(latents)
            x_t = abar[t].sqrt().view(-1, 1, 1, 1) * latents + (1 - abar[t]).sqrt().view(-1, 1, 1, 1) * noise
            w = 1.0 + 4.0 * torch.rand(n)  # cfg scale - 1 in [1, 5] (cfg scale 2..6)
            w_emb = w_embedding(w)
            c_skip, c_out = scalings(t)
            eps_s = student(x_t, t, timestep_cond=w_emb, encoder_hidden_states=cond).sample
            pred = c_skip * x_t + c_out * x0_of(eps_s, x_t, t)
            with torch.no_grad():
                eps_c = teacher_unet(x_t, t, encoder_hidden_states=cond).sample
                eps_u = teacher_unet(x_t, t, encoder_hidden_states=uncond.expand(n, -1, -1)).sample
                wv = w.view(-1, 1, 1, 1)
                x0_c, x0_u = x0_of(eps_c, x_t, t), x0_of(eps_u, x_t, t)
                x0_g, eps_g = x0_c + wv * (x0_c - x0_u), eps_c + wv * (eps_c - eps_u)
                x_prev = abar[t_prev].sqrt().view(-1, 1, 1, 1) * x0_g + (1 - abar[t_prev]).sqrt().view(-1, 1, 1, 1) * eps_g
                eps_t = target(x_prev, t_prev, timestep_cond=w_emb, encoder_hidden_states=cond).sample
                c_skip_p, c_out_p = scalings(t_prev)
                tgt = c_skip_p * x_prev + c_out_p * x0_of(eps_t, x_prev, t_prev)
            # pseudo-Huber per example (iCT), distill's default; diffusers' script takes it per element
            loss = (((pred - tgt) ** 2).flatten(1).sum(1).add(huber_c**2).sqrt() - huber_c).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for p_t, p_s in zip(target.parameters(), student.parameters()):
                    p_t.mul_(ema).add_(p_s, alpha=1 - ema)
            times.append(time.perf_counter())
            step += 1
            if step == steps:
                break
    return times


# ---------------------------------------------------------------------------------------------- runner

def run_distill(config: str, batch_size: int, steps: int, run_dir: Path, cache_dir: Path) -> list[float]:
    overrides = ["+exp=consistency", f"data.batch_size={batch_size}", f"trainer.max_steps={steps}",
                 "callbacks.quality_cost=null", "callbacks.samples=null", "callbacks.progress=null", "logger=csv",
                 "export=false", "sample_grid_seeds=0", "trainer.limit_val_batches=0",
                 "checkpoint.every_n_train_steps=1000000", f"method.latent_cache_dir={cache_dir}",
                 "+callbacks.step_timer._target_=bench.train_speed.StepTimer", f"hydra.run.dir={run_dir}",
                 *SWITCHES[config]]
    if config == "fused_adamw":
        overrides.append("trainer.gradient_clip_val=null")  # Lightning refuses clipping with a fused optimizer under AMP
    proc = subprocess.run([sys.executable, "-m", "distill.train", *overrides], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise RuntimeError(f"{config} failed:\n{proc.stderr[-3000:]}")
    return json.loads((run_dir / "step_times.json").read_text())


def run_plain(batch_size: int, steps: int) -> list[float]:
    proc = subprocess.run([sys.executable, __file__, "--plain", "--batch-sizes", str(batch_size), "--steps", str(steps)],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise RuntimeError(f"plain loop failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(SWITCHES), choices=list(SWITCHES))
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[32, 128])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="also write the raw measurements as JSON")
    parser.add_argument("--plain", action="store_true", help="run only the plain loop and print its step times")
    args = parser.parse_args()
    if args.plain:
        print(json.dumps(plain_loop(args.batch_sizes[0], args.steps)))
        return
    raw: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "latents"
        for batch_size in args.batch_sizes:
            for rep in range(args.repeats):
                for name in ["plain", *args.configs]:
                    run_dir = Path(tmp) / f"{name}-{batch_size}-{rep}"
                    times = (run_plain(batch_size, args.steps) if name == "plain"
                             else run_distill(name, batch_size, args.steps, run_dir, cache))
                    ips, warm = images_per_s(times, batch_size, args.warmup)
                    raw.setdefault(str(batch_size), {}).setdefault(name, []).append({"images_per_s": ips, "warmup_s": warm})
                    print(f"batch {batch_size} repeat {rep} {name}: {ips:.0f} images/s (first {args.warmup} steps "
                          f"{warm:.1f} s)", file=sys.stderr, flush=True)
    if args.out:
        args.out.write_text(json.dumps(raw, indent=1))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.steps} steps, images/s over steps "
          f"{args.warmup + 1}-{args.steps}, median of {args.repeats} interleaved repeats")
    print("| batch | configuration | images/s | x plain loop | first steps (s) |")
    print("|---|---|---|---|---|")
    for batch_size, rows in raw.items():
        plain = [r["images_per_s"] for r in rows["plain"]]
        for name, runs in rows.items():
            ips = statistics.median(r["images_per_s"] for r in runs)
            ratio = statistics.median(r["images_per_s"] / p for r, p in zip(runs, plain))
            warm = statistics.median(r["warmup_s"] for r in runs)
            print(f"| {batch_size} | {name} | {ips:.0f} | {ratio:.2f} | {warm:.1f} |")


if __name__ == "__main__":
    main()
