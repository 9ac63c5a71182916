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


def _last_counts(text: str) -> dict[str, int]:
    """TotalSamples of each metric in the last report of an XLA_METRICS_FILE (torch_xla appends one per step)."""
    counts: dict[str, int] = {}
    metric = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("Metric: "):
            metric = line.split(": ", 1)[1]
        elif line.startswith("TotalSamples: ") and metric is not None:
            counts[metric] = int(line.split(": ", 1)[1])
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/xla_cpu_check"))
    parser.add_argument("--prompt", default="a handwritten digit 3")
    parser.add_argument("--reuse", action="store_true", help="keep trainings already finished in --out (sample only)")
    args = parser.parse_args()
    if os.environ.get("PJRT_DEVICE") is None:
        sys.exit("error: PJRT_DEVICE is not set; run through launch/xla_cpu_check.sh (PJRT_DEVICE=CPU)")
    import torch
    import torch_xla

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    # two trainings, of 2 and 4 steps, each logging once (at its last step): the differences in torch_xla's
    # counters are what the 2 extra steps cost (graph compilations, device-to-host transfers)
    counts, losses, walls = {}, {}, {}
    for steps in (2, 4):
        run_dir = out / f"train_{steps}"
        cmd = [sys.executable, "-m", "distill.train", "+exp=consistency", "trainer=tpu", "data.batch_size=8",
               f"trainer.max_steps={steps}", "method.lr_scheduler.warmup_steps=1",
               f"method.lr_scheduler.total_steps={steps}", "trainer.limit_val_batches=0", "callbacks.quality_cost=null",
               "callbacks.samples=null", "sample_grid_seeds=0", "logger=csv", f"trainer.log_every_n_steps={steps}",
               "callbacks.progress=null", f"hydra.run.dir={run_dir}"]
        metrics_file, log_file = out / f"xla_metrics_{steps}.txt", out / f"train_{steps}.log"
        if args.reuse and (run_dir / "export").is_dir() and metrics_file.is_file():
            walls[steps] = json.loads((out / "walls.json").read_text())[str(steps)]
            text = log_file.read_text()
        else:
            if run_dir.exists():
                import shutil

                shutil.rmtree(run_dir)
            metrics_file.unlink(missing_ok=True)
            start = time.perf_counter()
            proc = subprocess.run(cmd, text=True, capture_output=True,
                                  env={**os.environ, "XLA_METRICS_FILE": str(metrics_file)})
            walls[steps] = time.perf_counter() - start
            text = proc.stdout + proc.stderr
            log_file.write_text(text)
            if proc.returncode != 0:
                print(proc.stderr[-4000:], file=sys.stderr)
                sys.exit(f"error: the training failed (exit {proc.returncode}); log: {log_file}")
            saved = json.loads((out / "walls.json").read_text()) if (out / "walls.json").is_file() else {}
            (out / "walls.json").write_text(json.dumps({**saved, str(steps): walls[steps]}))
        import csv

        rows = list(csv.DictReader(open(run_dir / "csv" / "metrics.csv")))
        losses[steps] = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
        counts[steps] = _last_counts(metrics_file.read_text())
        guard = [line for line in text.splitlines() if "non-finite guard: skips" in line]
    per_step = {k: (counts[4].get(k, 0) - counts[2].get(k, 0)) / 2 for k in ("CompileTime", "TransferFromDeviceTime")}
    loss = losses[4][-1]
    cmd_shown = " ".join(cmd[1:])

    from diffusers import DiffusionPipeline

    import distill.inference.pipelines  # noqa: F401  (registers the export's pipeline class with diffusers)

    device = torch_xla.device()
    pipe = DiffusionPipeline.from_pretrained(out / "train_4" / "export").to(device)
    prompt = args.prompt
    times = []
    for _ in range(2):  # the first call traces and compiles the graphs, the second reuses them
        start = time.perf_counter()
        image = pipe(prompt).images[0]
        times.append(time.perf_counter() - start)
    image.save(out / "sample.png")
    import numpy as np

    pixels = np.asarray(image, dtype=np.float32)
    result = {"torch": torch.__version__, "torch_xla": torch_xla.__version__, "device": str(device),
              "pjrt_device": os.environ["PJRT_DEVICE"], "train_command": cmd_shown,
              "train_wall_s": {k: round(v, 1) for k, v in walls.items()}, "train_loss_step_4": loss,
              "per_extra_step": per_step, "non_finite_guard": guard[0].split(" - ")[-1] if guard else None,
              "sample_call_s": [round(t, 2) for t in times], "image_size": list(image.size),
              "image_pixel_std": float(pixels.std()), "steps": pipe.scheduler.config.get("num_inference_steps")}
    (out / "result.json").write_text(json.dumps(result, indent=2))
    md = (f"XLA CPU check: torch {result['torch']}, torch_xla {result['torch_xla']}, device {device} "
          f"(PJRT_DEVICE={result['pjrt_device']})\n\n"
          f"- training: LCM under trainer=tpu, 4 steps in {walls[4]:.1f} s wall (process start, data, compile), "
          f"loss at step 4 {loss:.4f}; each step after the second: {per_step['CompileTime']:g} graph "
          f"compilations, {per_step['TransferFromDeviceTime']:g} device-to-host transfers "
          f"(torch_xla counters, 4-step run minus 2-step run, over 2); {result['non_finite_guard']}\n"
          f"- sampling: DiffusionPipeline.from_pretrained(export).to(xla)({prompt!r}) with its defaults: "
          f"{times[0]:.2f} s first call (tracing + compile), {times[1]:.2f} s second; image {image.size}, "
          f"pixel std {result['image_pixel_std']:.1f}\n")
    (out / "result.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
