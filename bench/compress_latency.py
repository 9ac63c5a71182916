"""Inference cost of compressed UNet variants side by side: parameters, FLOPs, UNet and full-sampling latency,
throughput and peak memory, all measured in one process, interleaved, on the same device and dtype.

    python bench/compress_latency.py --threads 2 --out compress_latency.json   # every variant, ~6-7 min at 2 threads
    python bench/compress_latency.py --variants teacher pruned50 lowrank50 qkv --rounds 2 --steps 2
    python bench/compress_latency.py --export pruned50_kd=PATH --variants teacher pruned50 pruned50_kd pruned50_kd+qkv

Variants are built from the UNet of the pipeline folder ``--teacher``. A name is a base and optional fusions
joined by ``+`` (``pruned50+qkv``; fusions alone apply to the teacher):

* ``teacher``: the pipeline's own UNet, the reference of the speed-ups and output differences;
* ``prunedNN``: ``distill.compress.prune.prune_unet(unet, NN/100, target="flops")``, magnitude importance: NN% of
  the FLOPs removed by structured pruning, counted at the tokenizer's text length as ``student=pruned`` counts
  them (so that ``pruned50`` is the network ``+exp=compress`` trains), the teacher's weights not retrained;
* ``lowrankNN``: ``distill.compress.lowrank.lowrank_unet(unet, budget=NN/100)``: truncated SVD keeping NN% of the
  factorisable weight parameters, not retrained;
* ``qkv``, ``channels_last``, ``compile``: ``distill.compress.fusion.fuse_unet`` (fused QKV projections,
  channels-last weights, torch.compile with inductor);
* ``NAME`` given as ``--export NAME=PATH``: the UNet of a trained export (a pipeline folder), so that recovered
  students are timed with their trained weights. Every export is measured; naming it in ``--variants`` sets its
  place or adds fusions. Latency does not depend on the weights; the table's ``weights`` column says which.

Every variant runs inside the teacher's pipeline with only the UNet swapped (``pipe.unet = variant``), with DDIM
built from the pipeline's scheduler config, ``num_inference_steps`` and ``guidance_scale`` the same for all (an
export's own intended call is not used), a fixed generator and ``output_type="pt"``. Columns:

* params: parameters the UNet holds (``qkv`` keeps to_q/to_k/to_v next to the fused to_qkv, so it holds more than
  it uses); GFLOPs/UNet call: one forward of one sample at the tokenizer's text length
  (``distill.utils.flops.count_flops``, torch's flop counter: matmuls, attention, convolutions);
* UNet ms batch B: one forward on B x (UNet evaluations per step) samples, as a sampling step at batch B runs
  it (CFG at guidance_scale > 1: 2B), with a 0-d timestep as the pipeline passes it;
* sample ms/image batch B: one pipeline call for B images (text encoder, every step, VAE decode) divided by B;
  images/s: B over the call's time at the largest batch;
* peak memory MB: the UNet's weights plus the peak of tensor memory allocated during one sampling call at the
  largest batch above what was allocated before it (CUDA: ``torch.cuda.max_memory_allocated``; CPU: the running
  sum of the CPU allocations and frees torch's profiler records with ``profile_memory=True``; the process's
  resident set is not used: in one process the allocator keeps what earlier calls freed, so its deltas read ~0);
* speed-up: the teacher's sample time over the variant's, per round, median over rounds (median of ratios);
  beside it the teacher's median sample time over the variant's (ratio of medians): the two differ when the
  machine's load drifts between rounds;
* max output diff: max |unet(x) - teacher(x)| / max |teacher(x)| on the fixed UNet input of batch 1; fusions are
  checked in float32 against 1e-5 (``qkv``, ``channels_last``) or 1e-4 (with ``compile``), compared with their
  unfused base: the teacher, or another base where that is among the variants too (else not checked). The
  script exits 1 after writing its output when a check fails.

Timing: each variant is first called once per measurement (the first calls are reported apart: they hold
torch.compile's compilation, cold, in an empty inductor cache; the UNet-only calls pass the pipeline's exact
arguments, so that sampling reuses the compiled graphs), then ``rounds`` rounds each run every measurement of
every variant (UNet ``unet-repeats`` calls, sampling ``repeats`` calls, each measurement across the variants in
turn, their order rotated each round); a round's value is its mean time per call, and the table shows the median
over rounds. Results go in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import itertools
import json
import os
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from distill.compress.fusion import fuse_unet
from distill.compress.lowrank import lowrank_unet
from distill.compress.prune import prune_unet, unet_example_inputs
from distill.inference.loading import load_pipeline
from distill.metrics.cost import NFECounter
from distill.utils.flops import count_flops

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VARIANTS = ["teacher", "pruned30", "pruned50", "pruned70", "lowrank50", "lowrank25", "qkv", "channels_last",
                    "compile", "qkv+channels_last+compile"]
FUSIONS = ("qkv", "channels_last", "compile")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MIB = 2**20


@dataclass
class Spec:
    """A variant name parsed: its base (teacher, prunedNN, lowrankNN or an export's name) and its fusions."""

    name: str
    base: str
    fusions: tuple[str, ...]

    @property
    def tolerance(self) -> float | None:
        """The largest output difference the fusions may make; None for a variant without fusions."""
        return (1e-4 if "compile" in self.fusions else 1e-5) if self.fusions else None


@dataclass
class Variant:
    """A built variant: its UNet, what its weights are, its compression report and its measurements."""

    spec: Spec
    unet: nn.Module
    weights: str
    build_s: float
    report: dict = field(default_factory=dict)
    applied: list[str] = field(default_factory=list)
    result: dict = field(default_factory=dict)


def parse_variant(name: str, exports: dict[str, str]) -> Spec:
    """``base+fusion+...`` -> Spec; raises ValueError naming what is wrong."""
    parts = name.split("+")
    base, fusions = ("teacher", parts) if parts[0] in FUSIONS else (parts[0], parts[1:])
    if bad := [f for f in fusions if f not in FUSIONS]:
        raise ValueError(f"variant {name!r}: {bad} are not fusions {list(FUSIONS)}")
    if len(set(fusions)) != len(fusions):
        raise ValueError(f"variant {name!r} names a fusion twice")
    if base not in exports and base != "teacher":
        m = re.fullmatch(r"(pruned|lowrank)(\d+)", base)
        if m is None or not 0 < int(m[2]) < 100:
            raise ValueError(f"variant {name!r}: base {base!r} is none of teacher, prunedNN, lowrankNN (NN in "
                             f"1..99) or an --export name {sorted(exports)}")
    return Spec(name, base, tuple(f for f in FUSIONS if f in fusions))


def parse_exports(items: list[str]) -> dict[str, str]:
    """``NAME=PATH`` items -> {name: path}; raises ValueError naming a bad item."""
    exports = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--export {item!r}: give NAME=PATH (a pipeline folder)")
        if "+" in name or name in FUSIONS or name == "teacher" or re.fullmatch(r"(pruned|lowrank)\d+", name):
            raise ValueError(f"--export {item!r}: the name {name!r} clashes with a built-in variant or has a '+'")
        if not (Path(path) / "model_index.json").is_file():
            raise ValueError(f"--export {item!r}: {path} has no model_index.json; give a diffusers pipeline folder")
        exports[name] = path
    return exports


# ---------------------------------------------------------------------------------------------- building


def _base_unet(base: str, teacher: nn.Module, exports: dict[str, str],
               text_len: int) -> tuple[nn.Module, str, dict]:
    """(a fresh UNet for ``base``, what its weights are, the compression report as a dict); ``text_len``: the
    text tokens at which pruning counts FLOPs (the pruning stop point depends on it)."""
    if base == "teacher":
        return copy.deepcopy(teacher), "teacher", {}
    if base in exports:
        return load_pipeline(exports[base]).unet.eval(), f"trained: {exports[base]}", {}
    kind, percent = re.fullmatch(r"(pruned|lowrank)(\d+)", base).groups()
    if kind == "pruned":
        unet, report = prune_unet(teacher, int(percent) / 100, target="flops",
                                  example_inputs=unet_example_inputs(teacher, text_len=text_len))
        return unet.eval(), "teacher's, pruned, not retrained", {
            "achieved": report.achieved, "params_before": report.params_before, "params_after": report.params_after,
            "flops_before": report.flops_before, "flops_after": report.flops_after}
    unet, report = lowrank_unet(teacher, budget=int(percent) / 100)
    return unet.eval(), "teacher's, SVD-truncated, not retrained", {"ranks": report.ranks}


def build_variant(spec: Spec, teacher: nn.Module, exports: dict[str, str], text_len: int) -> Variant:
    """The variant's UNet on the CPU in float32, fused but not yet compiled (FLOPs are counted first)."""
    start = time.perf_counter()
    if spec.base == "teacher" and not spec.fusions:
        unet, weights, report = teacher, "teacher", {}
    else:
        unet, weights, report = _base_unet(spec.base, teacher, exports, text_len)
    applied = []
    if "qkv" in spec.fusions or "channels_last" in spec.fusions:
        unet, applied = fuse_unet(unet, qkv="qkv" in spec.fusions, channels_last="channels_last" in spec.fusions)
    return Variant(spec, unet, weights, time.perf_counter() - start, report, applied)


# ---------------------------------------------------------------------------------------------- measuring


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    """Seconds per call over ``calls`` back-to-back calls of ``fn``."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / calls


def peak_call_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes of tensor memory allocated during one call of ``fn`` above what was allocated before it."""
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        _sync(device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # the raw allocator events (FunctionEvent attributes each allocation to its op, without the running order)
    events = sorted((e for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU),
                    key=lambda e: e.start_ns())
    return max(itertools.accumulate(e.nbytes() for e in events), default=0)


def relative_max_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|, in float32."""
    out, ref = out.float(), ref.float()
    return float((out - ref).abs().max() / ref.abs().max())


def unet_call(unet: nn.Module, samples: int, text_len: int) -> Callable[[], tuple]:
    """One UNet forward on seeded inputs of ``samples`` samples, called as the pipeline calls it (the same
    positional and keyword arguments, a 0-d timestep: torch.compile guards on them and would recompile)."""
    inputs = unet_example_inputs(unet, samples, text_len)
    return functools.partial(unet, inputs["sample"], torch.tensor(500, device=unet.device),
                             encoder_hidden_states=inputs["encoder_hidden_states"],
                             timestep_cond=inputs.get("timestep_cond"), cross_attention_kwargs=None,
                             added_cond_kwargs=None, return_dict=False)


class Bench:
    """The teacher pipeline and the sampling settings; ``sample(n)`` runs one pipeline call for n images with the
    UNet that ``pipe.unet`` holds."""

    def __init__(self, pipe, steps: int, guidance_scale: float, prompt: str, seed: int, device: torch.device):
        self.pipe, self.steps, self.guidance_scale = pipe, steps, guidance_scale
        self.prompt, self.seed, self.device = prompt, seed, device
        self.text_len = pipe.tokenizer.model_max_length

    def sample(self, n: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed)
        return self.pipe([self.prompt] * n, num_inference_steps=self.steps, guidance_scale=self.guidance_scale,
                         generator=generator, output_type="pt").images

    def counts(self, unet: nn.Module) -> dict:
        """GFLOPs of one UNet forward on one sample, GFLOPs and UNet evaluations per image of a batch-1 call."""
        self.pipe.unet = unet
        with NFECounter(unet) as nfe:
            sample_flops = count_flops(lambda: self.sample(1))
        return {"unet_gflops": count_flops(unet_call(unet, 1, self.text_len)) / 1e9,
                "sample_gflops_per_image": sample_flops / 1e9, "nfe_per_image": nfe.examples}


def measurements(bench: Bench, unet: nn.Module, batch_sizes: list[int], evals_per_step: int,
                 unet_repeats: int, repeats: int) -> dict[str, tuple[Callable[[], object], int, int]]:
    """{key: (call, calls per round, images per call)}: the UNet at every batch, then sampling at every batch."""
    units = {}
    for b in batch_sizes:
        units[f"unet_b{b}"] = (unet_call(unet, b * evals_per_step, bench.text_len), unet_repeats, b)
    for b in batch_sizes:
        units[f"sample_b{b}"] = (functools.partial(bench.sample, b), repeats, b)
    return units


def warm_up(bench: Bench, variants: list[Variant], units: dict[str, dict], diff_key: str,
            check_tolerance: bool) -> None:
    """Each variant's first call of each measurement (timed apart: it holds torch.compile's compilation), and
    the output difference of its ``diff_key`` UNet call against the teacher's and, for fusions, against their
    unfused base's where that is measured too."""
    outputs = {}
    for v in variants:
        first = {}
        bench.pipe.unet = v.unet
        for key, (fn, _, _) in units[v.spec.name].items():
            _sync(bench.device)
            start = time.perf_counter()
            out = fn()
            _sync(bench.device)
            first[key] = time.perf_counter() - start
            if key == diff_key:
                outputs[v.spec.name] = out[0]
        v.result["first_call_s"] = first
        print(f"{v.spec.name}: first calls (s) " + ", ".join(f"{k} {s:.2f}" for k, s in first.items()),
              file=sys.stderr, flush=True)
    for v in variants:
        out = outputs[v.spec.name]
        base = outputs.get(v.spec.base) if v.spec.fusions else None
        base_diff = None if base is None else relative_max_diff(out, base)
        tol = v.spec.tolerance if check_tolerance and base is not None else None
        v.result.update(max_output_diff=relative_max_diff(out, outputs["teacher"]), fusion_diff=base_diff,
                        tolerance=tol, within_tolerance=None if tol is None else base_diff <= tol)


def run_rounds(bench: Bench, variants: list[Variant], units: dict[str, dict], rounds: int) -> None:
    """``rounds`` rounds of every measurement of every variant; seconds per call of each round in v.result."""
    for v in variants:
        v.result["rounds_s"] = {key: [] for key in units[v.spec.name]}
    for r in range(rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        start = time.perf_counter()
        for key in units[variants[0].spec.name]:
            for v in order:
                fn, calls, _ = units[v.spec.name][key]
                bench.pipe.unet = v.unet
                v.result["rounds_s"][key].append(clock(fn, calls, bench.device))
        print(f"round {r + 1}/{rounds}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def median_of_ratios(reference_s: list[float], variant_s: list[float]) -> float:
    """Median over rounds of the round's speed-up: what the machine's load shares within a round cancels."""
    return statistics.median(r / v for r, v in zip(reference_s, variant_s))


def ratio_of_medians(reference_s: list[float], variant_s: list[float]) -> float:
    """The reference's median time over the variant's: the speed-up of the typical call."""
    return statistics.median(reference_s) / statistics.median(variant_s)


def summarise(variants: list[Variant], units: dict[str, dict], bench: Bench, batch_sizes: list[int]) -> None:
    """Medians over rounds, per-round speed-ups against the teacher, and the peak memory, into v.result."""
    teacher = variants[0].result["rounds_s"]
    for v in variants:
        rounds = v.result["rounds_s"]
        ms = {}
        for key, (_, _, images) in units[v.spec.name].items():
            per = 1 if key.startswith("unet") else images  # UNet: per call; sampling: per image
            ms[key] = statistics.median(rounds[key]) * 1e3 / per
        v.result["ms"] = ms
        v.result["speedup"] = {key: median_of_ratios(teacher[key], rounds[key]) for key in rounds}
        v.result["speedup_of_medians"] = {key: ratio_of_medians(teacher[key], rounds[key]) for key in rounds}
        largest = batch_sizes[-1]
        v.result["images_per_s"] = largest / statistics.median(rounds[f"sample_b{largest}"])
        bench.pipe.unet = v.unet
        peak = peak_call_bytes(functools.partial(bench.sample, largest), bench.device)
        fn, _, _ = units[v.spec.name][f"unet_b{largest}"]
        v.result["peak_unet_call_mb"] = peak_call_bytes(fn, bench.device) / MIB
        weights = sum(t.numel() * t.element_size() for t in itertools.chain(v.unet.parameters(), v.unet.buffers()))
        v.result.update(peak_call_mb=peak / MIB, weights_mb=weights / MIB, peak_memory_mb=(peak + weights) / MIB)


# ---------------------------------------------------------------------------------------------- output


def environment(args: argparse.Namespace, device: torch.device, argv: list[str]) -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown") if Path("/proc/cpuinfo").exists() else "unknown"
    import diffusers

    return {"command": shlex.join([sys.executable, str(Path(__file__).relative_to(ROOT)
                                                       if Path(__file__).is_relative_to(ROOT) else __file__), *argv]),
            "torch": torch.__version__, "diffusers": diffusers.__version__, "threads": torch.get_num_threads(),
            "cpu": cpu, "device": str(device), "dtype": args.dtype,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}


def table(variants: list[Variant], batch_sizes: list[int]) -> str:
    largest = batch_sizes[-1]
    head = (["variant", "weights", "params", "GFLOPs/UNet call (1 sample)"]
            + [f"UNet ms batch {b}" for b in batch_sizes] + [f"sample ms/image batch {b}" for b in batch_sizes]
            + [f"images/s batch {largest}", f"peak memory MB (batch {largest})"]
            + [f"speed-up batch {b}: median of ratios / ratio of medians" for b in batch_sizes]
            + ["max output diff"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v in variants:
        r = v.result
        diff = "0" if v.spec.name == variants[0].spec.name else f"{r['max_output_diff']:.1e}"
        if r["within_tolerance"] is not None:
            diff += " (ok)" if r["within_tolerance"] else f" (FAILS {r['tolerance']:.0e})"
        cells = ([v.spec.name, v.weights, f"{r['params'] / 1e6:.3f}M", f"{r['unet_gflops']:.4f}"]
                 + [f"{r['ms'][f'unet_b{b}']:.2f}" for b in batch_sizes]
                 + [f"{r['ms'][f'sample_b{b}']:.1f}" for b in batch_sizes]
                 + [f"{r['images_per_s']:.1f}", f"{r['peak_memory_mb']:.1f}"]
                 + [f"{r['speedup'][f'sample_b{b}']:.2f} / {r['speedup_of_medians'][f'sample_b{b}']:.2f}"
                    for b in batch_sizes] + [diff])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def notes(variants: list[Variant], nfe_teacher: float) -> list[str]:
    out = []
    for v in variants:
        r = v.result
        if "compile" in v.spec.fusions:
            out.append(f"{v.spec.name}: first calls, holding torch.compile's compilation (s): "
                       + ", ".join(f"{k} {s:.1f}" for k, s in r["first_call_s"].items()))
        if r["nfe_per_image"] != nfe_teacher:
            out.append(f"{v.spec.name}: {r['nfe_per_image']} UNet evaluations per image against the teacher's "
                       f"{nfe_teacher} (its UNet changes how the pipeline guides)")
        if v.spec.fusions and v.spec.base != "teacher":
            out.append(f"{v.spec.name}: output diff against unfused {v.spec.base}: {r['fusion_diff']:.1e}"
                       if r["fusion_diff"] is not None else
                       f"{v.spec.name}: fusions not checked, as unfused {v.spec.base} is not among the variants")
    return out


# ---------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[Spec], dict[str, str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher", default=str(ROOT / "distill/worlds/digits/weights/teacher"),
                        help="the pipeline folder whose UNet the variants are built from and which samples")
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS,
                        help="base[+fusion...]: teacher, prunedNN, lowrankNN or an --export name, fusions "
                             f"{list(FUSIONS)}; the teacher is always measured (first)")
    parser.add_argument("--export", action="append", default=[], metavar="NAME=PATH",
                        help="a trained export (pipeline folder) measured as variant NAME (repeatable)")
    parser.add_argument("--steps", type=int, default=25, help="num_inference_steps")
    parser.add_argument("--guidance-scale", type=float, default=3.0)
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=1, help="sampling calls per variant and batch in a round")
    parser.add_argument("--unet-repeats", type=int, default=10, help="UNet calls per variant and batch in a round")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--prompt", default="an image",
                        help="the text is padded to the tokenizer's length, so it does not change the cost")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="also write every measurement as JSON")
    args = parser.parse_args(argv)
    for key in ("steps", "rounds", "repeats", "unet_repeats", "threads"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')}={getattr(args, key)} must be >= 1")
    if min(args.batch_sizes) < 1:
        parser.error(f"--batch-sizes {args.batch_sizes}: every batch size must be >= 1")
    args.batch_sizes = sorted(set(args.batch_sizes))
    try:
        exports = parse_exports(args.export)
        names = list(dict.fromkeys(["teacher", *args.variants, *(e for e in exports if e not in args.variants)]))
        specs = [parse_variant(name, exports) for name in names]
    except ValueError as err:
        parser.error(str(err))
    return args, specs, exports


def measure(args: argparse.Namespace, specs: list[Spec], exports: dict[str, str]) -> tuple[list[Variant], int]:
    """Build the variants and time them; returns (variants, UNet evaluations per step)."""
    from diffusers import DDIMScheduler

    pipe = load_pipeline(args.teacher)
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    teacher = pipe.unet.eval()
    variants = []
    for spec in specs:
        variants.append(build_variant(spec, teacher, exports, pipe.tokenizer.model_max_length))
        print(f"built {spec.name} in {variants[-1].build_s:.1f} s", file=sys.stderr, flush=True)
    with torch.no_grad():  # pruning above traces with autograd
        return variants, time_variants(args, pipe, variants)


def time_variants(args: argparse.Namespace, pipe, variants: list[Variant]) -> int:
    """Count, warm up, run the rounds and summarise into each ``v.result``; returns UNet evaluations per step."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    pipe.to(device)
    if pipe.unet.dtype != dtype:  # diffusers warns on every .to(dtype=...), even to float32 from float32
        pipe.to(dtype=dtype)
    bench = Bench(pipe, args.steps, args.guidance_scale, args.prompt, args.seed, device)
    for v in variants:
        v.unet.to(device)
        if v.unet.dtype != dtype:
            v.unet.to(dtype=dtype)
        v.result.update(params=sum(p.numel() for p in v.unet.parameters()), **bench.counts(v.unet))
        if "compile" in v.spec.fusions:  # after counting: the flop counter does not see into compiled code
            v.unet, compiled = fuse_unet(v.unet, qkv=False, compile=True)
            v.applied += compiled
    evals_per_step = round(variants[0].result["nfe_per_image"] / args.steps)
    units = {v.spec.name: measurements(bench, v.unet, args.batch_sizes, evals_per_step, args.unet_repeats,
                                       args.repeats) for v in variants}
    warm_up(bench, variants, units, f"unet_b{args.batch_sizes[0]}", dtype == torch.float32)
    run_rounds(bench, variants, units, args.rounds)
    summarise(variants, units, bench, args.batch_sizes)
    return evals_per_step


def main(argv: list[str] | None = None) -> dict:
    """Measure, print the table, write ``--out``; returns what is written."""
    from torch._inductor.utils import fresh_cache

    argv = sys.argv[1:] if argv is None else list(argv)
    args, specs, exports = parse_args(argv)
    torch.set_num_threads(args.threads)
    env = environment(args, torch.device(args.device), argv)
    print(f"command: {env['command']}\ntorch {env['torch']}, diffusers {env['diffusers']}, {env['threads']} threads, "
          f"CPU {env['cpu']}, device {env['device']}{' (' + env['gpu'] + ')' if env['gpu'] else ''}, {args.dtype}",
          flush=True)
    # an empty inductor cache, so that the first calls of compiled variants hold a cold compilation
    compiles = any("compile" in spec.fusions for spec in specs)
    with fresh_cache() if compiles else contextlib.nullcontext():
        variants, evals_per_step = measure(args, specs, exports)
    print(f"DDIM {args.steps} steps, guidance {args.guidance_scale} ({evals_per_step} UNet evaluations per step); "
          f"median of {args.rounds} interleaved rounds ({args.unet_repeats} UNet / {args.repeats} sampling calls each)")
    print(table(variants, args.batch_sizes))
    for line in notes(variants, variants[0].result["nfe_per_image"]):
        print(line)
    out = {**env, "settings": {k: getattr(args, k) for k in ("teacher", "steps", "guidance_scale", "batch_sizes",
                                                             "rounds", "repeats", "unet_repeats", "prompt", "seed")},
           "evals_per_step": evals_per_step, "peak_memory": "tensor bytes allocated during the call above those "
           "before it (CUDA: max_memory_allocated; CPU: torch profiler allocation events) plus the UNet's weights",
           "variants": {v.spec.name: {"base": v.spec.base, "fusions": list(v.spec.fusions), "weights": v.weights,
                                      "build_s": v.build_s, "applied": v.applied, "report": v.report, **v.result}
                        for v in variants}}
    out["out_of_tolerance"] = [n for n, r in out["variants"].items() if r["within_tolerance"] is False]
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    result = main()
    if result["out_of_tolerance"]:
        sys.exit(f"output difference above tolerance: {result['out_of_tolerance']}")
