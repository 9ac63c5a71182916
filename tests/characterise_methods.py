"""Fingerprint of short trainings of every method, for comparing two versions of the code bit for bit.

    OMP_NUM_THREADS=1 PYTHONPATH=<tree> python tests/characterise_methods.py OUT.json [--runs consistency ...]
    python tests/characterise_methods.py --compare OLD.json NEW.json

Each run is ``python -m distill.train +exp=...`` with a few steps on the shipped digits world (callbacks off but
the final sample grid, CSV logger). The fingerprint holds a SHA-256 of every tensor of ``last.ckpt`` (student,
target, stored teacher weights, optimizer state), of every file of every export folder, of the images each export
gives through ``DiffusionPipeline.from_pretrained(folder)`` with its intended call, of the final sample grid, and
the logged losses as written. Run it on the old and the new tree (``PYTHONPATH`` picks the tree, one thread for
both) and ``--compare`` the two: a refactoring that keeps behaviour reports no difference.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

COMMON = ["data.batch_size=8", "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1", "logger=csv",
          "callbacks.samples=null", "callbacks.progress=null", "callbacks.lr_monitor=null", "sample_grid_seeds=1"]
NO_QC = ["callbacks.quality_cost=null"]
RUNS: dict[str, list[str]] = {
    "consistency": ["+exp=consistency", *NO_QC, "trainer.max_steps=3", "trainer.val_check_interval=2",
                    "checkpoint.every_n_train_steps=3"],
    "consistency_lora": ["+exp=consistency", *NO_QC, "student=lora", "student.rank=4", "method.ema_decay=0",
                         "trainer.max_steps=2", "trainer.val_check_interval=2", "checkpoint.every_n_train_steps=2"],
    "consistency_moe_token": ["+exp=consistency", *NO_QC, "student=moe_token", "student.time_cond_proj_dim=8",
                              "trainer.max_steps=2", "trainer.val_check_interval=2", "checkpoint.every_n_train_steps=2"],
    "progressive": ["+exp=progressive", *NO_QC, "method.start_steps=8", "method.final_steps=2",
                    "method.steps_per_round=2", "trainer.max_steps=4", "trainer.val_check_interval=3",
                    "checkpoint.every_n_train_steps=4"],
    "progressive_w": ["+exp=progressive_w", *NO_QC, "method.start_steps=4", "method.final_steps=2",
                      "method.steps_per_round=2", "trainer.max_steps=4", "trainer.val_check_interval=3",
                      "checkpoint.every_n_train_steps=4"],
    "progressive_moe_timestep": ["+exp=progressive", *NO_QC, "student=moe_timestep", "student.time_cond_proj_dim=null",
                                 "method.start_steps=4", "method.final_steps=1", "method.steps_per_round=1",
                                 "trainer.max_steps=3", "trainer.val_check_interval=2", "checkpoint.every_n_train_steps=3"],
    "diffusion": ["+exp=diffusion", "student.size=debug", "scheduler.num_inference_steps=2", "trainer.max_steps=3",
                  "trainer.val_check_interval=2", "checkpoint.every_n_train_steps=3"],
    "teacher": ["+exp=teacher", "trainer.max_steps=2", "trainer.val_check_interval=2",
                "checkpoint.every_n_train_steps=2"],
}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def tensor_hashes(obj, prefix: str, out: dict) -> None:
    """SHA-256 of every tensor in a nested checkpoint structure, keyed by its path."""
    import torch

    if isinstance(obj, torch.Tensor):
        out[prefix] = f"{tuple(obj.shape)} {obj.dtype} {sha(obj.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())}"
    elif isinstance(obj, dict):
        for key, value in obj.items():
            tensor_hashes(value, f"{prefix}/{key}", out)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            tensor_hashes(value, f"{prefix}/{i}", out)


def export_images(folder: Path) -> str:
    """Images of the export through diffusers' loader with its intended call (registered defaults)."""
    import torch
    from diffusers import DiffusionPipeline

    import distill.inference.pipelines  # noqa: F401  (registers distill's classes)

    pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    info = json.loads((folder / "distill.json").read_text())
    generator = torch.Generator().manual_seed(0)
    if info.get("conditioning") == "class":
        images = pipe([0, 3, 7], generator=generator, output_type="pt").images
    else:
        prompts = ["a handwritten digit zero", "a handwritten digit three", "a handwritten digit seven"]
        images = pipe(prompts, generator=generator, output_type="pt").images
    return f"{tuple(images.shape)} {sha(images.contiguous().numpy().tobytes())}"


def fingerprint(run_dir: Path, tree: bytes) -> dict:
    """The hashes of one run; ``tree``, the code tree's path, is masked where exports name it (the teacher's
    path in distill.json, the model card and config.json's _name_or_path)."""
    import torch

    out: dict = {}
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    tensor_hashes(ckpt["state_dict"], "state_dict", out)
    tensor_hashes(ckpt["optimizer_states"], "optimizer", out)
    out["ckpt/progressive"] = json.dumps(ckpt.get("progressive"), sort_keys=True)
    folders = [run_dir / "export", *sorted((run_dir / "rounds").glob("*-steps"))]
    for folder in [f for f in folders if f.is_dir()]:
        name = folder.relative_to(run_dir)
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            out[f"file/{path.relative_to(run_dir)}"] = sha(path.read_bytes().replace(tree, b"<tree>"))
        if (folder / "distill.json").is_file():
            out[f"images/{name}"] = export_images(folder)
    grid = run_dir / "samples" / "final.png"
    out["samples/final.png"] = sha(grid.read_bytes()) if grid.is_file() else None
    rows = list(csv.DictReader(open(run_dir / "csv" / "metrics.csv")))
    for key in ("train/loss", "val/loss", "train/aux_loss"):
        out[f"log/{key}"] = [r[key] for r in rows if r.get(key)]
    return out


def train(name: str, run_dir: Path) -> None:
    cmd = [sys.executable, "-m", "distill.train", *RUNS[name], *COMMON, f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def compare(old: dict, new: dict) -> int:
    differences = 0
    for run in sorted(set(old) | set(new)):
        a, b = old.get(run, {}), new.get(run, {})
        diff = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        print(f"{run}: {len(a)} entries, {'identical' if not diff else f'{len(diff)} differ'}")
        for key in diff:
            print(f"  {key}: {a.get(key)} != {b.get(key)}")
        differences += len(diff)
    return 1 if differences else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, nargs="?")
    parser.add_argument("--runs", nargs="*", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("OLD", "NEW"))
    args = parser.parse_args()
    if args.compare:
        sys.exit(compare(*(json.loads(p.read_text()) for p in args.compare)))
    import distill

    tree = Path(distill.__file__).resolve().parents[1]
    print(f"distill from {tree}", flush=True)
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.runs:
            train(name, Path(tmp) / name)
            result[name] = fingerprint(Path(tmp) / name, str(tree).encode())
            print(f"{name}: {len(result[name])} entries", flush=True)
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
