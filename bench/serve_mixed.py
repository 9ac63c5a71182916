"""Mixed traffic on ``distill.serve``: requests of several classes (step counts, schedulers) on one served pipeline,
closed loop, each engine mode in turn; images/s and per-class latency. Localhost only, bounded, stops by itself.

    python bench/serve_mixed.py --pipeline <LCM export> --out docs/serve_mixed.json
    python bench/serve_mixed.py --pipeline <LCM export> --quick --out /tmp/serve_mixed.json   # a tiny run

Classes (``--classes name=steps[:scheduler]``; default ``lcm1=1 lcm2=2 lcm4=4 ddim25=25:ddim``): the LCM student at
1, 2 and 4 of its own steps and a 25-step DDIM class on the same network (a teacher-length trajectory). Request i
of a cell is of class ``i mod len(classes)``, so every class holds the same share of the clients. For every round
(``--rounds``, default 3) and every mode (the order rotated each round) one server is started with
``bench/serve_load.py``'s settings, warmed up with every class, then loaded at each ``--concurrency`` C. Per cell:
images/s overall, and per class p50/p95 latency and the mean denoise batch. Reported: medians over rounds, and the
verdict asked of stream mode: at the largest C no class's p95 worse than batch mode's.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from serve_load import (  # noqa: E402
    MODES,
    PROMPTS,
    Server,
    code_version,
    parse_pipelines,
    percentile,
    post,
    wait_healthy,
)

DEFAULT_CLASSES = ["lcm1=1", "lcm2=2", "lcm4=4", "ddim25=25:ddim"]


def parse_classes(items: list[str]) -> dict[str, dict]:
    """``name=steps[:scheduler]`` -> {name: request fields}."""
    classes = {}
    for item in items:
        name, sep, spec = item.partition("=")
        steps, _, scheduler = spec.partition(":")
        if not sep or not steps.isdigit():
            raise SystemExit(f"--classes {item!r}: expected name=steps[:scheduler], e.g. ddim25=25:ddim")
        classes[name] = {"steps": int(steps), **({"scheduler": scheduler} if scheduler else {})}
    return classes


async def one(url: str, fields: dict, index: int, seed: int, wait: float) -> dict:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"prompt": PROMPTS[index % 10], "seed": seed, **fields}).encode()
    start, batch = time.perf_counter(), None
    try:
        status, data = await post(host, int(port), body, wait)
        if status == 200:
            batch = json.loads(data).get("batch_sizes", {}).get("denoise")
    except Exception as err:  # noqa: BLE001 - a lost request, counted as such
        status = type(err).__name__
    return {"status": status, "latency_s": time.perf_counter() - start, "batch": batch}


async def closed_loop(url: str, classes: dict[str, dict], concurrency: int, requests: int, seeds,
                      wait: float) -> tuple[list[dict], float]:
    """``concurrency`` workers back to back until ``requests`` are answered; request i is of class i mod K."""
    names = list(classes)
    counter, results = itertools.count(), []

    async def worker():
        while (i := next(counter)) < requests:
            name = names[i % len(names)]
            results.append({"class": name, **await one(url, classes[name], i, next(seeds), wait)})

    start = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))), wait)
    return results, time.perf_counter() - start


def summarize(results: list[dict], wall: float, names: list[str]) -> dict:
    ok = [r for r in results if r["status"] == 200]
    row = {"requests": len(results), "images": len(ok), "wall_s": wall, "images_per_s": len(ok) / wall,
           "errors": len(results) - len(ok), "classes": {}}
    for name in names:
        mine = [r for r in ok if r["class"] == name]
        lat = [r["latency_s"] for r in mine]
        batches = [r["batch"] for r in mine if r["batch"] is not None]
        row["classes"][name] = {"images": len(mine), "p50_ms": 1e3 * percentile(lat, 50),
                                "p95_ms": 1e3 * percentile(lat, 95),
                                "mean_denoise_batch": statistics.fmean(batches) if batches else float("nan")}
    return row


def aggregate(raw: list[dict], names: list[str]) -> list[dict]:
    cells: dict[tuple, list[dict]] = {}
    for row in raw:
        cells.setdefault((row["mode"], row["concurrency"]), []).append(row)
    out = []
    for (mode, c), rows in cells.items():
        agg = {"mode": mode, "concurrency": c, "rounds": len(rows),
               "images_per_s": statistics.median(r["images_per_s"] for r in rows),
               "errors": sum(r["errors"] for r in rows), "classes": {}}
        for name in names:
            agg["classes"][name] = {key: statistics.median(r["classes"][name][key] for r in rows)
                                    for key in ("p50_ms", "p95_ms", "mean_denoise_batch")}
        out.append(agg)
    order = {m: i for i, m in enumerate(MODES)}
    return sorted(out, key=lambda a: (a["concurrency"], order[a["mode"]]))


def verdict(rows: list[dict], names: list[str]) -> str:
    c = max(r["concurrency"] for r in rows)
    cell = {r["mode"]: r for r in rows if r["concurrency"] == c}
    if "stream" not in cell or "batch" not in cell:
        return "stream against batch: not both measured"
    worse = [f"{n} {cell['stream']['classes'][n]['p95_ms']:.0f} ms vs {cell['batch']['classes'][n]['p95_ms']:.0f}"
             for n in names if cell["stream"]["classes"][n]["p95_ms"] > cell["batch"]["classes"][n]["p95_ms"]]
    head = (f"C={c}: stream {cell['stream']['images_per_s']:.2f} images/s vs batch "
            f"{cell['batch']['images_per_s']:.2f}")
    return head + (f"; stream's p95 is worse in {', '.join(worse)}: **not met**" if worse else
                   "; no class's p95 worse in stream: **met**")


def markdown(rows: list[dict], names: list[str]) -> str:
    head = "| C | mode | images/s | " + " | ".join(f"{n} p50 / p95 ms (batch)" for n in names) + " | errors |"
    lines = [head, "|" + "---|" * (4 + len(names))]
    for r in rows:
        cells = [f"{r['classes'][n]['p50_ms']:.0f} / **{r['classes'][n]['p95_ms']:.0f}** "
                 f"({r['classes'][n]['mean_denoise_batch']:.1f})" for n in names]
        lines.append(f"| {r['concurrency']} | {r['mode']} | {r['images_per_s']:.2f} | " + " | ".join(cells) +
                     f" | {r['errors']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipeline", required=True, help="an export (e.g. an LCM student), a pipeline folder, or "
                                                          "teacher (the shipped one)")
    parser.add_argument("--classes", nargs="+", default=DEFAULT_CLASSES)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--concurrency", nargs="+", type=int, default=[8, 16])
    parser.add_argument("--requests", type=int, default=None, help="requests per cell (default: 4C)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--max-wait-ms", type=float, default=20.0)
    parser.add_argument("--start-timeout", type=float, default=180.0)
    parser.add_argument("--cell-timeout", type=float, default=900.0)
    parser.add_argument("--quick", action="store_true", help="modes batch stream, C 4, 1 round, 8 requests")
    parser.add_argument("--out", default=None, help="X.json (+ X.md)")
    args = parser.parse_args(argv)
    if args.quick:
        args.modes, args.concurrency, args.rounds, args.requests = ["batch", "stream"], [4], 1, 8
    classes = parse_classes(args.classes)
    pipeline = str(Path(args.pipeline).resolve()) if Path(args.pipeline).is_dir() else \
        next(iter(parse_pipelines([args.pipeline]).values()))
    names = list(classes)
    # serve_load's Server reads these settings
    args.steps, args.queue_size = None, max(args.concurrency) + 16
    logdir = Path(os.environ.get("TMPDIR", "/tmp")) / "serve_mixed_logs"
    logdir.mkdir(parents=True, exist_ok=True)
    seeds = itertools.count(1)
    raw = []
    for round_ in range(args.rounds):
        modes = args.modes[round_ % len(args.modes):] + args.modes[:round_ % len(args.modes)]
        for mode in modes:
            with Server(pipeline, mode, args, args.queue_size, logdir) as server:
                asyncio.run(wait_healthy(server.url, args.start_timeout))
                asyncio.run(closed_loop(server.url, classes, len(names), 2 * len(names), seeds, args.cell_timeout))
                for c in args.concurrency:
                    results, wall = asyncio.run(closed_loop(server.url, classes, c, args.requests or 4 * c, seeds,
                                                            args.cell_timeout))
                    row = {"mode": mode, "concurrency": c, "round": round_, **summarize(results, wall, names),
                           "load_avg_1min": os.getloadavg()[0]}
                    raw.append(row)
                    per = ", ".join(f"{n} p95 {row['classes'][n]['p95_ms']:.0f}" for n in names)
                    print(f"round {round_} {mode:10s} C={c:3d}: {row['images_per_s']:6.2f} images/s, {per} ms, "
                          f"errors {row['errors']}", flush=True)
                server.stop()
    rows = aggregate(raw, names)
    text = verdict(rows, names)
    print(markdown(rows, names))
    print(text)
    out = {"rows": rows, "raw": raw, "verdict": text, "classes": classes, "settings": vars(args),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), **code_version()}}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1, default=str))
        Path(args.out).with_suffix(".md").write_text(markdown(rows, names) + "\n\n" + text + "\n")
    return out


if __name__ == "__main__":
    main()
