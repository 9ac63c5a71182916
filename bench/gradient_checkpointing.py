"""Peak activation memory and step time of the copy student with and without gradient checkpointing.

    python bench/gradient_checkpointing.py --batch-sizes 128 512 --steps 7 --out gc.json

One training step of the digits teacher's copy student (``copy_student(unet, 256)``, as in the consistency
and progressive experiments): forward on random latents (4 x S x S, S = the teacher's latent size unless
``--latent-size``) and random text embeddings, MSE loss, backward, AdamW step. Two warm-up steps create the
gradients and the optimizer state first, so that what the measured steps add is activations and temporaries;
step time and peak are medians over ``steps`` steps. Step times come from one process that alternates steps
with and without checkpointing (the VM's speed drifts between processes by more than the effect), with the
default allocator; peak memory from a fresh process per configuration. Peak activation memory is the step's peak minus the memory
just before it: on CUDA from
``max_memory_allocated``; on CPU the peak resident set (VmHWM, reset by writing 5 to /proc/self/clear_refs)
minus the resident set before the step, with MALLOC_MMAP_THRESHOLD_=65536 so that glibc returns freed
large tensors to the OS instead of keeping them. Results go in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from distill.families import load_teacher
from distill.students.copies import copy_student
from distill.worlds.digits import asset_path

MIB = 2**20


def _status_bytes(field: str) -> int:
    """A memory line of /proc/self/status (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set (Linux >= 4.0)


def measure(batch_size: int, latent_size: int | None, flags: list[bool], steps: int, device: str) -> list[dict]:
    """A copy student per gradient-checkpointing flag in ``flags`` (same weights, same inputs), their training
    steps interleaved so that a slow spell of the machine hits each alike: median step time (s) and peak
    activation memory (bytes) over ``steps`` steps each, after two warm-up steps each."""
    torch.manual_seed(0)
    teacher = load_teacher(str(asset_path("teacher")))
    students = [copy_student(teacher.denoiser, time_cond_proj_dim=256, gradient_checkpointing=f).to(device) for f in flags]
    optimizers = [torch.optim.AdamW(s.parameters(), lr=1e-4) for s in students]
    cfg, n = students[0].config, batch_size
    size = latent_size or cfg.sample_size
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(n, cfg.in_channels, size, size, generator=g).to(device)  # (N, 4, S, S)
    target = torch.randn(n, cfg.in_channels, size, size, generator=g).to(device)
    text = torch.randn(n, teacher.tokenizer.model_max_length, cfg.cross_attention_dim, generator=g).to(device)  # (N, L, D)
    w_embedding = torch.randn(n, cfg.time_cond_proj_dim, generator=g).to(device)
    t = torch.randint(0, 1000, (n,), generator=g).to(device)
    cuda = device.startswith("cuda")

    def step(i: int) -> None:
        optimizers[i].zero_grad(set_to_none=False)  # the gradients stay allocated: they are not activations
        pred = students[i](latents, t, encoder_hidden_states=text, timestep_cond=w_embedding).sample
        F.mse_loss(pred, target).backward()
        optimizers[i].step()

    for _ in range(2):
        for i in range(len(flags)):
            step(i)
    times, peaks = [[] for _ in flags], [[] for _ in flags]
    for _ in range(steps):
        for i in range(len(flags)):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            else:
                before = _status_bytes("VmRSS")
                _reset_peak_rss()
            start = time.perf_counter()
            step(i)
            if cuda:
                torch.cuda.synchronize()
            times[i].append(time.perf_counter() - start)
            peaks[i].append((torch.cuda.max_memory_allocated() if cuda else _status_bytes("VmHWM")) - before)
    return [{"batch_size": n, "latent_size": size, "gradient_checkpointing": f, "step_s": statistics.median(times[i]),
             "step_s_all": times[i], "peak_activation_bytes": statistics.median(peaks[i]),
             "parameters": sum(p.numel() for p in students[i].parameters())} for i, f in enumerate(flags)]


def run_fresh(batch_size: int, latent_size: int | None, flags: list[bool], steps: int, device: str,
              env: dict | None = None) -> list[dict]:
    """``measure`` in a new interpreter, so that no configuration inherits another's heap."""
    spec = json.dumps([batch_size, latent_size, flags, steps, device])
    proc = subprocess.run([sys.executable, __file__, "--worker", spec], env={**os.environ, **(env or {})},
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"worker {spec} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compare(batch_size: int, latent_size: int | None, steps: int, device: str) -> list[dict]:
    """Rows without and with checkpointing: step times from one process that interleaves the two (with the
    default allocator, as training runs), peak activation memory from a fresh process per configuration."""
    off, on = run_fresh(batch_size, latent_size, [False, True], steps, device)
    for row in (off, on):
        # every large block mmap'd, so freed ones leave the resident set (this slows the step: timed above instead)
        alone = run_fresh(batch_size, latent_size, [row["gradient_checkpointing"]], steps, device,
                          env={"MALLOC_MMAP_THRESHOLD_": "65536"})[0]
        row["peak_activation_bytes"] = alone["peak_activation_bytes"]
    on["memory_change"] = on["peak_activation_bytes"] / off["peak_activation_bytes"] - 1
    on["time_change"] = on["step_s"] / off["step_s"] - 1
    return [off, on]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[128, 512])
    parser.add_argument("--latent-size", type=int, default=None, help="latent side S; default: the teacher's")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(*json.loads(args.worker))))
        return
    if args.device == "cpu" and not Path("/proc/self/clear_refs").exists():
        raise SystemExit("CPU peak memory needs Linux's /proc/self/clear_refs; use --device cuda")

    rows = [row for n in args.batch_sizes for row in compare(n, args.latent_size, args.steps, args.device)]
    print(f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads, "
          f"copy student ({rows[0]['parameters'] / 1e6:.2f}M parameters), median of {args.steps} steps")
    print("| batch | latent | checkpointing | step time (ms) | peak activation memory (MiB) | memory | time |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        change = (f"{r['memory_change']:+.0%} | {r['time_change']:+.0%}" if r["gradient_checkpointing"] else "- | -")
        print(f"| {r['batch_size']} | 4x{r['latent_size']}x{r['latent_size']} | {'on' if r['gradient_checkpointing'] else 'off'} "
              f"| {r['step_s'] * 1e3:.0f} | {r['peak_activation_bytes'] / MIB:.0f} | {change} |")
    if args.out:
        args.out.write_text(json.dumps({"torch": torch.__version__, "device": args.device,
                                        "threads": torch.get_num_threads(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
