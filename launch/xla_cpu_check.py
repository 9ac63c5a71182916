"""trainer=tpu on XLA's CPU device: one latent-consistency-distillation training step, then one sampling call of
the exported student as a user makes it (``DiffusionPipeline.from_pretrained(d).to(xla)(prompt)``).

Run by ``launch/xla_cpu_check.sh`` (it creates the torch 2.9 + torch-xla environment and sets PJRT_DEVICE=CPU).
Prints a Markdown summary and writes it, with the numbers, to ``--out`` (default runs/xla_cpu_check/).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/xla_cpu_check"))
    parser.add_argument("--prompt", default=None, help="default: the export's first evaluation prompt")
    args = parser.parse_args()
    if os.environ.get("PJRT_DEVICE") is None:
        sys.exit("error: PJRT_DEVICE is not set; run through launch/xla_cpu_check.sh (PJRT_DEVICE=CPU)")
    import torch
    import torch_xla

    out = args.out.resolve()
    run_dir = out / "train"
    cmd = [sys.executable, "-m", "distill.train", "+exp=consistency", "trainer=tpu", "data.batch_size=8",
           "trainer.max_steps=1", "method.lr_scheduler.warmup_steps=1", "method.lr_scheduler.total_steps=1",
           "trainer.limit_val_batches=0", "callbacks.quality_cost=null", "callbacks.samples=null",
           "sample_grid_seeds=0", "logger=csv", "callbacks.progress=null", f"hydra.run.dir={run_dir}"]
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    start = time.perf_counter()
    proc = subprocess.run(cmd, text=True, capture_output=True)
    train_s = time.perf_counter() - start
    (out / "train.log").parent.mkdir(parents=True, exist_ok=True)
    (out / "train.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
        sys.exit(f"error: the training step failed (exit {proc.returncode}); log: {out / 'train.log'}")
    import csv

    rows = list(csv.DictReader(open(run_dir / "csv" / "metrics.csv")))
    loss = next(float(r["train/loss"]) for r in rows if r.get("train/loss"))

    from diffusers import DiffusionPipeline

    device = torch_xla.device()
    pipe = DiffusionPipeline.from_pretrained(run_dir / "export").to(device)
    prompt = args.prompt or "a handwritten digit 3"
    times = []
    for _ in range(2):  # the first call traces and compiles the graphs, the second reuses them
        start = time.perf_counter()
        image = pipe(prompt).images[0]
        times.append(time.perf_counter() - start)
    image.save(out / "sample.png")
    import numpy as np

    pixels = np.asarray(image, dtype=np.float32)
    result = {"torch": torch.__version__, "torch_xla": torch_xla.__version__, "device": str(device),
              "pjrt_device": os.environ["PJRT_DEVICE"], "train_command": " ".join(cmd[1:]),
              "train_wall_s": round(train_s, 1), "train_loss_step_1": loss,
              "sample_call_s": [round(t, 2) for t in times], "image_size": list(image.size),
              "image_pixel_std": float(pixels.std()), "steps": pipe.scheduler.config.get("num_inference_steps")}
    (out / "result.json").write_text(json.dumps(result, indent=2))
    md = (f"XLA CPU check: torch {result['torch']}, torch_xla {result['torch_xla']}, device {device} "
          f"(PJRT_DEVICE={result['pjrt_device']})\n\n"
          f"- training: 1 LCM step under trainer=tpu in {train_s:.1f} s wall (process start, data, compile), "
          f"loss {loss:.4f}\n"
          f"- sampling: DiffusionPipeline.from_pretrained(export).to(xla)({prompt!r}) with its defaults: "
          f"{times[0]:.2f} s first call (tracing + compile), {times[1]:.2f} s second; image {image.size}, "
          f"pixel std {result['image_pixel_std']:.1f}\n")
    (out / "result.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
