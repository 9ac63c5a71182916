"""Variance of the gradient estimator under each ``method.noise`` option, at fixed weights (issue: efficient
stochastic reparametrisation).

    python bench/grad_variance.py                          # +exp=consistency (LCM) on the embedded default
    python bench/grad_variance.py --exp diffusion --batches 96 --batch-size 16
    python bench/grad_variance.py --options default antithetic "stratified antithetic" -- student=lora

For each option set (a space-separated list of ``method.noise`` switches: ``antithetic``, ``stratified``,
``lognormal``, ``adaptive``; ``default`` is none), the method is built from the experiment's composed config with
the same seed (so the same weights), and the student's gradient of the training loss is taken on ``--batches``
mini-batches: the same data batches for every option (common random numbers), each with its own noise and times.
An adaptive proposal is first warmed up on ``--warmup`` batches of losses (no gradient). Reported per option:

- ``trace_var``: E||g - E g||^2 over the batches (the total variance of one mini-batch's gradient estimate), with
  a bootstrap standard error over batches;
- ``ratio``: trace_var / the ``default`` option's (below 1: fewer images for the same gradient noise);
- ``cos_mean``: the cosine between the option's mean gradient and the default's (all options estimate the same
  gradient; near 1 up to the sampling error of the means);
- ``loss``: the mean training loss (the importance-weighted ones estimate the same loss).

The table (CSV and markdown) goes to ``--out``; results and the command are recorded in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
SWITCHES = {"antithetic": "method.noise.antithetic=true", "stratified": "method.noise.stratified=true",
            "lognormal": "method.noise.timesteps=lognormal", "adaptive": "method.noise.timesteps=adaptive"}


def compose(exp: str, overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from distill.config.builds import plain_choices
    from distill.config.schema import register_configs
    from distill.utils.loggers import register_resolvers

    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = hydra_compose(config_name="train", overrides=[f"+exp={exp}", *overrides])
    return plain_choices(cfg)


def build(cfg, seed: int):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    torch.manual_seed(seed)
    student = instantiate(cfg.student)
    extra = {"student": student, "sampling": OmegaConf.to_container(cfg.scheduler, resolve=True)}
    if cfg.teacher:
        extra["teacher"] = instantiate(cfg.teacher)
    return instantiate(cfg.method, _partial_=True, _convert_="all")(**extra)


def fixed_batches(cfg, n: int) -> list[dict]:
    from hydra.utils import instantiate

    datamodule = instantiate(cfg.data)
    datamodule.setup("fit")
    torch.manual_seed(0)
    batches = []
    while len(batches) < n:
        for batch in datamodule.train_dataloader():
            batches.append(batch)
            if len(batches) == n:
                break
    return batches


def gradients(method, batches: list[dict], seed: int, warmup: int) -> tuple[np.ndarray, list[float]]:
    method.train()
    params = [p for p in method.student.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # the adaptive proposal's history (a no-op otherwise)
        for i in range(warmup if method.noise.timesteps == "adaptive" else 0):
            method.loss(batches[i % len(batches)], g)
    rows, losses = [], []
    for batch in batches:
        method.zero_grad(set_to_none=True)
        loss = method.loss(batch, g)
        loss.backward()
        rows.append(torch.cat([p.grad.flatten() for p in params]).double().numpy())
        losses.append(float(loss.detach()))
    return np.stack(rows), losses


def trace_var(grads: np.ndarray) -> float:
    return float(((grads - grads.mean(0)) ** 2).sum(1).mean() * len(grads) / (len(grads) - 1))


def trace_var_gram(gram: np.ndarray, idx: np.ndarray) -> float:
    """``trace_var`` of the rows ``idx`` from their Gram matrix: (sum_i |g_i|^2 - n |mean g|^2) / (n - 1)."""
    n = len(idx)
    sub = gram[np.ix_(idx, idx)]
    return float((np.trace(sub) - sub.sum() / n) / (n - 1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exp", default="consistency")
    parser.add_argument("--options", nargs="+", default=["default", "antithetic", "stratified", "stratified antithetic",
                                                         "lognormal", "adaptive", "adaptive stratified antithetic"])
    parser.add_argument("--batches", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=40, help="batches of losses that warm an adaptive proposal up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bootstrap", type=int, default=500)
    parser.add_argument("--out", default="docs/grad_variance")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides after --, e.g. student=lora")
    args = parser.parse_args(argv)
    for option in args.options:
        unknown = [s for s in option.split() if s != "default" and s not in SWITCHES]
        if unknown:
            parser.error(f"--options {option!r}: unknown switch(es) {unknown}; use default or {sorted(SWITCHES)}")
    if args.batches < 4:
        parser.error(f"--batches={args.batches}: need at least 4 for a variance and its error")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    base = [f"data.batch_size={args.batch_size}", "data.num_workers=0", *args.overrides]
    batches = fixed_batches(compose(args.exp, base), args.batches)
    results, reference = [], None
    rng = np.random.default_rng(0)
    for option in args.options:
        switches = [SWITCHES[s] for s in option.split() if s != "default"]
        start = time.perf_counter()
        method = build(compose(args.exp, [*base, *switches]), args.seed)
        grads, losses = gradients(method, batches, args.seed + 1, args.warmup)
        mean = grads.mean(0)
        if reference is None:
            reference = (trace_var(grads), mean)
        gram = grads @ grads.T  # the bootstrap resamples batches: from the Gram matrix, not the gradients
        boot = [trace_var_gram(gram, rng.integers(0, len(grads), len(grads))) for _ in range(args.bootstrap)]
        tv = trace_var(grads)
        cos = float(mean @ reference[1] / (np.linalg.norm(mean) * np.linalg.norm(reference[1]) + 1e-300))
        results.append({"option": option, "overrides": " ".join(switches) or "(none)", "trace_var": tv,
                        "trace_var_se": float(np.std(boot, ddof=1)), "ratio": tv / reference[0],
                        "cos_mean": cos, "loss": float(np.mean(losses)),
                        "loss_se": float(np.std(losses, ddof=1) / np.sqrt(len(losses))),
                        "seconds": time.perf_counter() - start})
        r = results[-1]
        print(f"{option:32s} trace_var {tv:.4e} +- {r['trace_var_se']:.1e}  ratio {r['ratio']:.3f}  cos {cos:.3f}  "
              f"loss {r['loss']:.4f} +- {r['loss_se']:.4f}  ({r['seconds']:.0f} s)", flush=True)
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{args.exp}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(results[0]))
        writer.writeheader()
        writer.writerows(results)
    lines = [f"`python bench/grad_variance.py --exp {args.exp} --batches {args.batches} --batch-size {args.batch_size}"
             + (f" -- {' '.join(args.overrides)}" if args.overrides else "") + "`", "",
             "| option | trace Var[g] (± se) | ratio to default | cos(mean g, default's) | loss (± se) |",
             "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['option']} | {r['trace_var']:.3e} ± {r['trace_var_se']:.1e} | {r['ratio']:.3f} | "
                     f"{r['cos_mean']:.3f} | {r['loss']:.4f} ± {r['loss_se']:.4f} |")
    (out / f"{args.exp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
