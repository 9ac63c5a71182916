"""Variance of the gradient estimator under each ``method.noise`` option, at fixed weights (issue: efficient
stochastic reparametrisation).

    python bench/grad_variance.py                          # +exp=consistency (LCM) on the embedded default
    python bench/grad_variance.py --exp diffusion --batches 96 --batch-size 16
    python bench/grad_variance.py --options default antithetic "stratified antithetic" -- student=lora
    python bench/grad_variance.py --options default stratified --batches 8 --draws 50   # the noise's own variance

For each option set (a space-separated list of ``method.noise`` switches: ``antithetic``, ``stratified``,
``lognormal``, ``adaptive``; ``default`` is none), the method is built from the experiment's composed config with
the same seed (so the same weights), and the student's gradient of the training loss is taken ``--draws`` times on
each of ``--batches`` mini-batches: the same data batches for every option (common random numbers), each draw with
its own noise and times. An adaptive proposal is first warmed up on ``--warmup`` batches of losses (no gradient).
Reported per option:

- ``trace_var``: E||g - E g||^2 of one draw on one batch (the total variance of one mini-batch's gradient estimate:
  data, noise and times), with a bootstrap standard error over batches; with ``--draws`` R > 1 it is the variance
  of the batches' mean gradients plus (1 - 1/R) times ``noise_var``;
- ``ratio``: trace_var / the ``default`` option's (below 1: fewer images for the same gradient noise);
- ``noise_var`` (R > 1): E_batch[trace Var(g | batch)], the part of the variance the options act on (the noise and
  times of a fixed batch), ± its standard error over batches, and ``noise_ratio`` to the default's ± a paired
  bootstrap standard error (the batches resampled together for both options, as they share the data);
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
    from distill.config.resolvers import register_resolvers
    from distill.config.schema import register_configs

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


def gradients(method, batches: list[dict], seed: int, warmup: int,
              draws: int = 1) -> tuple[np.ndarray, np.ndarray | None, list[float]]:
    """(the mean gradient of each batch (B, P), each batch's trace Var(g | batch) over its ``draws`` (B,), or None
    for one draw, the losses); the draws are streamed (sum and sum of squared norms), not stored."""
    method.train()
    params = [p for p in method.student.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # the adaptive proposal's history (a no-op otherwise)
        for i in range(warmup if method.noise.timesteps == "adaptive" else 0):
            method.loss(batches[i % len(batches)], g)
    means, within, losses = [], [], []
    for batch in batches:
        total, square = None, 0.0
        for _ in range(draws):
            method.zero_grad(set_to_none=True)
            loss = method.loss(batch, g)
            loss.backward()
            grad = torch.cat([p.grad.flatten() for p in params]).double()
            total = grad.clone() if total is None else total + grad
            square += float(grad @ grad)
            losses.append(float(loss.detach()))
        means.append((total / draws).numpy())
        within.append(streamed_trace_var(total, square, draws) if draws > 1 else 0.0)
    return np.stack(means), (np.array(within) if draws > 1 else None), losses


def streamed_trace_var(total: torch.Tensor, square: float, n: int) -> float:
    """``trace_var`` of n vectors from their sum ``total`` and the sum of their squared norms ``square``."""
    return (square - float(total @ total) / n) / (n - 1)


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
    parser.add_argument("--draws", type=int, default=1, help="gradients per batch (> 1: the noise's own variance)")
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
    if args.draws < 1:
        parser.error(f"--draws={args.draws}: need at least 1")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    base = [f"data.batch_size={args.batch_size}", "data.num_workers=0", *args.overrides]
    batches = fixed_batches(compose(args.exp, base), args.batches)
    results, reference = [], None
    rng = np.random.default_rng(0)
    for option in args.options:
        switches = [SWITCHES[s] for s in option.split() if s != "default"]
        start = time.perf_counter()
        method = build(compose(args.exp, [*base, *switches]), args.seed)
        grads, within, losses = gradients(method, batches, args.seed + 1, args.warmup, args.draws)
        mean = grads.mean(0)
        gram = grads @ grads.T  # the bootstrap resamples batches: from the Gram matrix, not the gradients
        shrink = 0.0 if within is None else (1 - 1 / args.draws) * within
        idx = [rng.integers(0, len(grads), len(grads)) for _ in range(args.bootstrap)]
        tv = trace_var(grads) + float(np.mean(shrink))
        boot = [trace_var_gram(gram, i) + float(np.mean(shrink[i] if within is not None else 0.0)) for i in idx]
        if reference is None:
            reference = (tv, mean, within)
        cos = float(mean @ reference[1] / (np.linalg.norm(mean) * np.linalg.norm(reference[1]) + 1e-300))
        row = {"option": option, "overrides": " ".join(switches) or "(none)", "trace_var": tv,
               "trace_var_se": float(np.std(boot, ddof=1)), "ratio": tv / reference[0]}
        if within is not None:
            ratios = [within[i].mean() / reference[2][i].mean() for i in idx]  # paired: the same batches
            row.update(noise_var=float(within.mean()), noise_var_se=float(within.std(ddof=1) / np.sqrt(len(within))),
                       noise_ratio=float(within.mean() / reference[2].mean()),
                       noise_ratio_se=float(np.std(ratios, ddof=1)))
        row.update(cos_mean=cos, loss=float(np.mean(losses)), loss_se=float(np.std(losses, ddof=1) / np.sqrt(len(losses))),
                   seconds=time.perf_counter() - start)
        results.append(row)
        r = results[-1]
        noise = (f"  noise_var {r['noise_var']:.4e} +- {r['noise_var_se']:.1e}  noise_ratio {r['noise_ratio']:.3f} +- "
                 f"{r['noise_ratio_se']:.3f}") if within is not None else ""
        print(f"{option:32s} trace_var {tv:.4e} +- {r['trace_var_se']:.1e}  ratio {r['ratio']:.3f}{noise}  cos {cos:.3f}  "
              f"loss {r['loss']:.4f} +- {r['loss_se']:.4f}  ({r['seconds']:.0f} s)", flush=True)
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{args.exp}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(results[0]))
        writer.writeheader()
        writer.writerows(results)
    draws = args.draws > 1
    lines = [f"`python bench/grad_variance.py --exp {args.exp} --batches {args.batches} --batch-size {args.batch_size}"
             + (f" --draws {args.draws}" if draws else "") + f" --options {' '.join(repr(o) if ' ' in o else o for o in args.options)}"
             + (f" -- {' '.join(args.overrides)}" if args.overrides else "") + "`", "",
             "| option | trace Var[g] (± se) | ratio to default |"
             + (" noise Var[g] at a fixed batch (± se) | noise ratio (± paired se) |" if draws else "")
             + " cos(mean g, default's) | loss (± se) |",
             "|---|---|---|" + ("---|---|" if draws else "") + "---|---|"]
    for r in results:
        noise = (f" {r['noise_var']:.3e} ± {r['noise_var_se']:.1e} | {r['noise_ratio']:.3f} ± {r['noise_ratio_se']:.3f} |"
                 if draws else "")
        lines.append(f"| {r['option']} | {r['trace_var']:.3e} ± {r['trace_var_se']:.1e} | {r['ratio']:.3f} |{noise} "
                     f"{r['cos_mean']:.3f} | {r['loss']:.4f} ± {r['loss_se']:.4f} |")
    (out / f"{args.exp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
