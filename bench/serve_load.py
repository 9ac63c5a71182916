"""Load test of ``distill.serve``: throughput and latency of each engine mode under closed-loop load, and a 2x
overload check. Localhost only, a bounded number of requests, every wait under a timeout: it stops by itself.

    python bench/serve_load.py --pipelines teacher lcm=<LCM export> --overload \\
        --out docs/serve_load.json --plot docs/serve_load.png
    python bench/serve_load.py --quick --out /tmp/serve_load.json           # a tiny run (the test's)

For every round, every pipeline and every ``--modes`` entry (the order rotated each round) one server is started
(``python -m distill.serve pipeline=... host=127.0.0.1 port=0 engine.mode=...``), warmed up, then loaded at each
``--concurrency`` C: C asyncio workers send requests back to back (prompts "a handwritten digit 0".."9", distinct
seeds) until ``--requests`` (default max(24, 2C)) have been answered; then SIGTERM, and the exit code is recorded.
Per cell: images/s (images / wall time of the cell), client-side p50/p95/p99 latency of the answered requests, the
count of each status, the mean denoise batch (the server's ``batch_sizes["denoise"]``) and the server's peak RSS
(psutil, every 0.2 s). Reported: the median over ``--rounds`` rounds, each mode's speed-up over ``sequential`` at
the same C (per round, median), and a verdict on the issue's target: at C=16 the full pipeline (stream) gives
>= 1.5x the throughput of sequential at no worse p95.

``--overload``: per pipeline and ``--overload-timeout-s`` value, a stream-mode server with a small queue
(``--overload-queue-size``) gets an open-loop Poisson stream at 2x the stream-mode throughput at C=16 (this run's,
or ``--overload-rate name=images/s``) for ``--overload-seconds``, each request with that ``timeout_s``; every request
must get an image, a 429 or a 504 (anything else, or no answer, is lost), the server's RSS must not grow from the
first half of the window to the second, and the client must keep the schedule (else the load was not 2x).
``--rows-from X.json`` keeps the closed-loop rows of an earlier run and runs no rounds:

    python bench/serve_load.py --pipelines teacher lcm=<LCM export> --rows-from docs/serve_load.json \\
        --overload --overload-timeout-s 5 15 --out docs/serve_load.json

``--out X.json`` writes the rows, settings and machine, and X.md the tables; ``--plot`` throughput and p95 latency
against concurrency, one column per pipeline. ``--threads``: the server's torch threads (default 1, leaving the
other core of a 2-core machine to this load generator). Requests go out as hand-written HTTP/1.1 on asyncio, one
connection per request (cheap, and the same for every mode); ``--client httpx`` sends the closed loop through
``distill.serve.AsyncClient`` instead, whose kept-alive connections meet a ~40 ms stall per request from this server
(its listening socket lacks TCP_NODELAY; see BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import platform
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from distill.serve.engine import MODES  # noqa: E402  (the engine's modes, in its order)

PROMPTS = [f"a handwritten digit {d}" for d in range(10)]
URL_LINE = re.compile(r"distill\.serve: .* on (http://127\.0\.0\.1:\d+)")


class RSS:
    """Samples a process's resident memory every ``period`` s in a thread: ``peak`` since :meth:`reset`, and
    the (time, bytes) series for the overload check."""

    def __init__(self, pid: int, period: float = 0.2):
        import psutil

        self.proc, self.period = psutil.Process(pid), period
        self.peak, self.series = 0, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def now(self) -> int:
        try:
            return self.proc.memory_info().rss
        except Exception:  # noqa: BLE001 - the server has exited
            return 0

    def _run(self) -> None:
        while not self.stop.is_set():
            rss = self.now()
            self.peak = max(self.peak, rss)
            self.series.append((time.monotonic(), rss))
            self.stop.wait(self.period)

    def reset(self) -> None:
        self.peak, self.series = self.now(), []

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=2)


class Server:
    """A ``python -m distill.serve`` subprocess on 127.0.0.1 (any free port); killed on exit in any case."""

    def __init__(self, pipeline: str, mode: str, args, queue_size: int, logdir: Path):
        overrides = [f"pipeline={pipeline}", "host=127.0.0.1", "port=0", f"threads={args.threads}",
                     f"engine.mode={mode}", f"engine.max_batch_size={args.max_batch_size}",
                     f"engine.max_wait_ms={args.max_wait_ms}", f"engine.queue_size={queue_size}",
                     "engine.timeout_s=900"]
        if args.steps:
            overrides.append(f"steps={args.steps}")
        self.cmd = [sys.executable, "-m", "distill.serve", *overrides]
        self.log = logdir / f"server_{mode}_{os.getpid()}_{time.monotonic_ns()}.log"
        self.timeout, self.threads = args.start_timeout, args.threads
        self.proc = self.rss = self.url = None
        self.lines: list[str] = []
        self.exit_code = None

    def __enter__(self) -> Server:
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=self.log.open("w"), text=True,
                                     env=env, cwd=ROOT)
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + self.timeout
        while self.url is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{shlex.join(self.cmd)} did not start (exit {self.proc.returncode}); its "
                                   f"log: {self.log}\n{self.log.read_text()[-2000:]}")
            time.sleep(0.05)
        self.rss = RSS(self.proc.pid)
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if self.url is None and (m := URL_LINE.search(line)):
                self.url = m[1]

    def stop(self, timeout: float = 120.0) -> int | None:
        """SIGTERM (the server drains, then exits); the exit code, or None when it had to be killed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                return None
        self.exit_code = self.proc.returncode
        return self.exit_code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __exit__(self, *exc) -> None:
        if self.rss is not None:
            self.rss.close()
        self.kill()


async def wait_healthy(url: str, timeout: float) -> dict:
    import httpx

    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=url, timeout=5) as http:
        while True:
            try:
                response = await http.get("/health")
                if response.status_code == 200:
                    return response.json()
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url}/health did not answer 200 within {timeout} s")
            await asyncio.sleep(0.2)


async def request(client, index: int, seed: int, timeout_s: float | None = None) -> dict:
    """One request's outcome: status (an int, or the exception's name), client latency, denoise batch."""
    from distill.serve import ServeError

    start = time.perf_counter()
    try:
        out = await client.generate(PROMPTS[index % 10], seed=seed, timeout_s=timeout_s)
        status, batch = 200, out.info.get("batch_sizes", {}).get("denoise")
        if len(out.png) != 1:
            status = "no image"
    except ServeError as err:
        status, batch = err.status, None
    except Exception as err:  # noqa: BLE001 - a lost request, counted as such
        status, batch = type(err).__name__, None
    return {"status": status, "latency_s": time.perf_counter() - start, "batch": batch}


async def closed_loop(url: str, concurrency: int, requests: int, seeds, timeout: float,
                      client: str = "raw") -> tuple[list, float, float]:
    """``concurrency`` workers sending back to back until ``requests`` are answered, through ``distill.serve``'s
    AsyncClient (``client="httpx"``) or :func:`post`; (outcomes, wall seconds, this process's CPU seconds per
    second: near 1, the load generator is the bottleneck)."""
    from distill.serve import AsyncClient

    counter, results = itertools.count(), []

    async def worker(http):
        while (i := next(counter)) < requests:
            results.append(await (request(http, i, next(seeds)) if http else raw_request(url, i, next(seeds))))

    async with AsyncClient(url, timeout=timeout, max_connections=max(concurrency, 8)) as http:
        start, cpu = time.perf_counter(), time.process_time()
        workers = [worker(http if client == "httpx" else None) for _ in range(concurrency)]
        await asyncio.wait_for(asyncio.gather(*workers), timeout)
        wall = time.perf_counter() - start
    return results, wall, (time.process_time() - cpu) / wall


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if r["status"] == 200]
    latencies = [r["latency_s"] for r in ok]
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    batches = [r["batch"] for r in ok if r["batch"] is not None]
    return {"requests": len(results), "images": len(ok), "wall_s": wall, "images_per_s": len(ok) / wall,
            "p50_ms": 1e3 * percentile(latencies, 50), "p95_ms": 1e3 * percentile(latencies, 95),
            "p99_ms": 1e3 * percentile(latencies, 99), "mean_denoise_batch": statistics.fmean(batches) if batches
            else float("nan"), "statuses": statuses}


def warm_up(url: str, n: int, seeds, timeout: float) -> None:
    """``n`` requests one at a time, then a burst of ``n`` at once (batched shapes); not measured."""
    if n:
        asyncio.run(closed_loop(url, 1, n, seeds, timeout))
        asyncio.run(closed_loop(url, n, n, seeds, timeout))


def run_server(name: str, path: str, mode: str, args, seeds, logdir: Path, round_: int) -> tuple[list[dict], dict]:
    """Start a server, load it at every concurrency, stop it; (cell rows, server record)."""
    rows = []
    with Server(path, mode, args, args.queue_size, logdir) as server:
        health = asyncio.run(wait_healthy(server.url, args.start_timeout))
        warm_up(server.url, args.warmup, seeds, args.cell_timeout)
        for c in args.concurrency:
            n = args.requests or max(24, 2 * c)
            server.rss.reset()
            results, wall, cpu = asyncio.run(closed_loop(server.url, c, n, seeds, args.cell_timeout, args.client))
            row = {"model": name, "mode": mode, "concurrency": c, "round": round_, **summarize(results, wall),
                   "peak_rss_mb": server.rss.peak / 2**20, "client_cpu": cpu, "load_avg_1min": os.getloadavg()[0]}
            rows.append(row)
            print(f"round {round_} {name} {mode:10s} C={c:3d}: {row['images_per_s']:7.2f} images/s, p95 "
                  f"{row['p95_ms']:8.1f} ms, batch {row['mean_denoise_batch']:5.2f}, {row['statuses']}", flush=True)
        code = server.stop()
    record = {"model": name, "mode": mode, "round": round_, "exit_code": code, "defaults": health.get("defaults"),
              "stopped_line": any("stopped" in line for line in server.lines)}
    if code != 0:
        print(f"warning: the {name} {mode} server exited with {code} after SIGTERM (expected 0)", file=sys.stderr)
    return rows, record


async def post(host: str, port: int, body: bytes, timeout: float) -> tuple[int, bytes]:
    """One ``POST /generate`` on its own connection, HTTP/1.1 by hand: (status, body)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        writer.write(b"POST /generate HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: "
                     b"%d\r\nConnection: close\r\n\r\n%s" % (host.encode(), len(body), body))
        head, _, data = (await asyncio.wait_for(reader.read(-1), timeout)).partition(b"\r\n\r\n")
        return int(head.split(b" ", 2)[1]), data
    finally:
        writer.close()


async def raw_request(url: str, index: int, seed: int, timeout_s: float | None = None, wait: float = 900.0) -> dict:
    """:func:`request` through :func:`post`."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    payload = {"prompt": PROMPTS[index % 10], "seed": seed, **({"timeout_s": timeout_s} if timeout_s else {})}
    start, batch = time.perf_counter(), None
    try:
        status, data = await post(host, int(port), json.dumps(payload).encode(), (timeout_s or wait) + 60)
        if status == 200:
            info = json.loads(data)
            batch = info.get("batch_sizes", {}).get("denoise")
            if len(info["images"]) != 1:
                status = "no image"
    except Exception as err:  # noqa: BLE001 - a lost request, counted as such
        status = type(err).__name__
    return {"status": status, "latency_s": time.perf_counter() - start, "batch": batch}


async def open_loop(url: str, rate: float, seconds: float, timeout_s: float, seeds, rng: random.Random) -> dict:
    """Poisson arrivals at ``rate``/s for ``seconds`` (at most 1.5x the expected count); every answer awaited."""
    limit = int(math.ceil(1.5 * rate * seconds)) + 1
    tasks = []
    start, cpu = time.perf_counter(), time.process_time()
    arrival = planned = 0.0
    for i in range(limit):
        arrival += rng.expovariate(rate)
        if arrival > seconds:
            break
        await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
        tasks.append(asyncio.create_task(raw_request(url, i, next(seeds), timeout_s)))
        planned = arrival
    sent = time.perf_counter() - start
    done, pending = await asyncio.wait(tasks, timeout=timeout_s + 90)
    for task in pending:
        task.cancel()
    wall = time.perf_counter() - start
    results = [t.result() for t in done] + [{"status": "no answer", "latency_s": float("nan")} for _ in pending]
    return {"results": results, "sent_s": sent, "lag_s": sent - planned, "wall_s": wall,
            "client_cpu": (time.process_time() - cpu) / wall}


def overload(name: str, path: str, rate_c16: float | None, timeout_s: float, args, seeds, logdir: Path) -> dict:
    """2x overload of a stream-mode server with a small queue: statuses, lost requests, RSS over time."""
    import httpx

    from distill.serve import parse_metrics

    with Server(path, "stream", args, args.overload_queue_size, logdir) as server:
        asyncio.run(wait_healthy(server.url, args.start_timeout))
        warm_up(server.url, args.warmup, seeds, args.cell_timeout)
        if rate_c16 is None:  # not measured in this run: measure it here
            results, wall, _ = asyncio.run(closed_loop(server.url, 16, max(24, args.requests or 32), seeds,
                                                       args.cell_timeout))
            rate_c16 = summarize(results, wall)["images_per_s"]
        rate = 2 * rate_c16
        time.sleep(1.0)
        server.rss.reset()
        rss_start = server.rss.now()
        t0 = time.monotonic()
        out = asyncio.run(open_loop(server.url, rate, args.overload_seconds, timeout_s, seeds, random.Random(0)))
        time.sleep(1.0)
        rss_end = server.rss.now()
        with httpx.Client(base_url=server.url, timeout=10) as http:
            health = http.get("/health").json()
            metrics = parse_metrics(http.get("/metrics").text)
        series = [(t - t0, b) for t, b in server.rss.series]
        code = server.stop()
    results = out["results"]
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    lost = sum(v for k, v in statuses.items() if k not in ("200", "429", "504"))
    half = out["wall_s"] / 2
    first = max((b for t, b in series if t <= half), default=0) / 2**20
    second = max((b for t, b in series if t > half), default=0) / 2**20
    late = [r["latency_s"] for r in results if r["status"] == 504]
    dropped = metrics.get("distill_serve_dropped_total")
    ok = [r["latency_s"] for r in results if r["status"] == 200]
    record = {
        "model": name, "mode": "stream", "queue_size": args.overload_queue_size, "timeout_s": timeout_s,
        "stream_c16_images_per_s": rate_c16, "offered_per_s": rate, "seconds": args.overload_seconds,
        "sent": len(results), "sent_s": out["sent_s"], "client_lag_s": out["lag_s"], "wall_s": out["wall_s"],
        "client_cpu": out["client_cpu"], "statuses": statuses, "lost": lost,
        "goodput_images_per_s": statuses.get("200", 0) / out["wall_s"], "p95_ms_200": 1e3 * percentile(ok, 95),
        # admitted = answered 200 or 504 (a 429 is refused at the door); the target is under 5%
        "expired_share_of_admitted": statuses.get("504", 0) / max(1, statuses.get("200", 0) + statuses.get("504", 0)),
        "max_ms_504": 1e3 * max(late) if late else float("nan"),
        "rss_start_mb": rss_start / 2**20, "rss_peak_first_half_mb": first, "rss_peak_second_half_mb": second,
        "rss_peak_mb": max(first, second), "rss_end_mb": rss_end / 2**20,
        "after": {"queue_depth": health.get("queue_depth"), "in_flight": health.get("in_flight"),
                  "dropped": dropped},
        "exit_code": code,
    }
    record["bounded"] = second <= first * 1.05 + 16  # no growth beyond 5% (+16 MB of allocator noise)
    record["on_schedule"] = out["lag_s"] < 1.0  # the client sent at the rate it aimed at (else it was the bottleneck)
    record["met"] = lost == 0 and record["bounded"] and record["on_schedule"]
    print(f"overload {name} timeout_s={timeout_s:g}: offered {rate:.2f}/s for {args.overload_seconds:g} s (client lag "
          f"{out['lag_s']:.1f} s), {statuses}, lost {lost}, RSS {record['rss_start_mb']:.0f} -> peak {first:.0f}/"
          f"{second:.0f} (halves) -> {record['rss_end_mb']:.0f} MB", flush=True)
    return record


def aggregate(raw: list[dict]) -> list[dict]:
    """Median over rounds per (model, mode, concurrency); speed-up over sequential per round, then median."""
    cells: dict[tuple, list[dict]] = {}
    for row in raw:
        cells.setdefault((row["model"], row["mode"], row["concurrency"]), []).append(row)
    out = []
    for (model, mode, c), rows in cells.items():
        agg = {"model": model, "mode": mode, "concurrency": c, "rounds": len(rows)}
        for key in ("images_per_s", "p50_ms", "p95_ms", "p99_ms", "mean_denoise_batch"):
            agg[key] = statistics.median(r[key] for r in rows)
        agg["requests_per_round"] = rows[0]["requests"]
        agg["peak_rss_mb"] = max(r["peak_rss_mb"] for r in rows)
        agg["statuses"] = {}
        for r in rows:
            for k, v in r["statuses"].items():
                agg["statuses"][k] = agg["statuses"].get(k, 0) + v
        base = {r["round"]: r for r in cells.get((model, "sequential", c), [])}
        pairs = [(r, base[r["round"]]) for r in rows if r["round"] in base]
        if pairs:
            agg["speedup"] = statistics.median(r["images_per_s"] / b["images_per_s"] for r, b in pairs)
            agg["p95_ratio"] = statistics.median(r["p95_ms"] / b["p95_ms"] for r, b in pairs)
        out.append(agg)
    order = {m: i for i, m in enumerate(MODES)}
    return sorted(out, key=lambda a: (a["model"], order.get(a["mode"], 9), a["concurrency"]))


def verdicts(rows: list[dict], overloads: list[dict]) -> list[str]:
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        cell = {(r["mode"], r["concurrency"]): r for r in rows if r["model"] == model}
        seq, full = cell.get(("sequential", 16)), cell.get(("stream", 16))
        if seq and full:
            met = full["speedup"] >= 1.5 and full["p95_ms"] <= seq["p95_ms"]
            lines.append(f"{model}, C=16: stream {full['images_per_s']:.2f} images/s = {full['speedup']:.2f}x "
                         f"sequential's {seq['images_per_s']:.2f} (target >= 1.5x), p95 {full['p95_ms']:.0f} ms vs "
                         f"{seq['p95_ms']:.0f} ms (target: no worse): **{'met' if met else 'missed'}**")
    for o in overloads:
        lag = "" if o["on_schedule"] else f", but the client fell {o['client_lag_s']:.1f} s behind: not 2x"
        lines.append(f"{o['model']}, 2x overload ({o['offered_per_s']:.2f} requests/s for {o['seconds']:g} s{lag}, "
                     f"queue {o['queue_size']}, timeout_s {o['timeout_s']:g}): {o['sent']} sent, {o['statuses']}, lost "
                     f"{o['lost']}; RSS {o['rss_start_mb']:.0f} MB at start, peak {o['rss_peak_first_half_mb']:.0f} / "
                     f"{o['rss_peak_second_half_mb']:.0f} MB (first / second half), {o['rss_end_mb']:.0f} MB at end: "
                     f"**{'met' if o['met'] else 'missed'}**")
    return lines


def markdown(rows: list[dict], overloads: list[dict]) -> str:
    lines = ["| model | mode | concurrency | images/s | speed-up vs sequential | p50 ms | p95 ms | p99 ms | "
             "mean denoise batch | statuses (all rounds) | peak RSS MB |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        statuses = " ".join(f"{k}: {v}" for k, v in sorted(r["statuses"].items()))
        lines.append(f"| {r['model']} | {r['mode']} | {r['concurrency']} | {r['images_per_s']:.2f} | "
                     f"{r.get('speedup', float('nan')):.2f}x | {r['p50_ms']:.0f} | {r['p95_ms']:.0f} | "
                     f"{r['p99_ms']:.0f} | {r['mean_denoise_batch']:.2f} | {statuses} | {r['peak_rss_mb']:.0f} |")
    if overloads:
        lines += ["", "| model | timeout_s | offered requests/s (2x stream C=16) | client lag s | sent | 200 | 429 | "
                  "504 | expired share of admitted | lost | goodput images/s | p95 ms (200) | max ms (504) | RSS start / "
                  "peak 1st half / peak 2nd half / end MB |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for o in overloads:
            s = o["statuses"]
            lines.append(f"| {o['model']} | {o['timeout_s']:g} | {o['offered_per_s']:.2f} | {o['client_lag_s']:.1f} | "
                         f"{o['sent']} | {s.get('200', 0)} | "
                         f"{s.get('429', 0)} | {s.get('504', 0)} | {o.get('expired_share_of_admitted', float('nan')):.1%} | "
                         f"{o['lost']} | {o['goodput_images_per_s']:.2f} | "
                         f"{o['p95_ms_200']:.0f} | {o['max_ms_504']:.0f} | {o['rss_start_mb']:.0f} / "
                         f"{o['rss_peak_first_half_mb']:.0f} / {o['rss_peak_second_half_mb']:.0f} / "
                         f"{o['rss_end_mb']:.0f} |")
    return "\n".join(lines + [""] + [f"- {v}" for v in verdicts(rows, overloads)]) + "\n"


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(2, len(models), figsize=(5 * len(models), 7), squeeze=False)
    for j, model in enumerate(models):
        for mode in MODES:
            cells = sorted((r for r in rows if r["model"] == model and r["mode"] == mode),
                           key=lambda r: r["concurrency"])
            if not cells:
                continue
            cs = [r["concurrency"] for r in cells]
            axes[0][j].plot(cs, [r["images_per_s"] for r in cells], "o-", label=mode)
            axes[1][j].plot(cs, [r["p95_ms"] for r in cells], "o-", label=mode)
        axes[0][j].set_title(model)
        axes[0][j].set_ylabel("images/s")
        axes[1][j].set_ylabel("p95 latency (ms)")
        axes[1][j].set_yscale("log")
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency (closed loop)")
            ax.grid(True, which="both", alpha=0.3)
        axes[0][j].legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def parse_pipelines(items: list[str]) -> dict[str, str]:
    """``name=path``, or ``teacher`` alone for the shipped digits teacher."""
    from distill.worlds.digits import asset_path

    out = {}
    for item in items:
        name, _, path = item.partition("=")
        if not path:
            if name != "teacher":
                raise ValueError(f"--pipelines {item!r}: give name=<pipeline folder> (only 'teacher' has a default)")
            path = str(asset_path("teacher"))
        if not Path(path).is_dir():
            raise ValueError(f"--pipelines {item!r}: {path} is not a folder")
        out[name] = str(Path(path).resolve())
    return out


def _shown(text: str) -> str:
    """``text`` as the results show it: paths inside the repository relative to it, no machine's own paths."""
    return text.replace(f"{ROOT}{os.sep}", "")


def code_version() -> dict:
    """The commit, and whether distill/serve differs from it (the numbers measure the working tree)."""
    import hashlib

    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    diff = git("diff", "HEAD", "--", "distill/serve")
    return {"commit": git("rev-parse", "HEAD").strip(), "serve_uncommitted_changes": bool(diff),
            "serve_diff_sha1": hashlib.sha1(diff.encode()).hexdigest()[:12] if diff else None}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipelines", nargs="+", default=["teacher"],
                        help="name=<pipeline folder>, or 'teacher' for the shipped digits teacher")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=None)
    parser.add_argument("--concurrency", nargs="+", type=int, default=None)
    parser.add_argument("--requests", type=int, default=None, help="requests per cell (default: max(24, 2C))")
    parser.add_argument("--rounds", type=int, default=None, help="default 3")
    parser.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--max-wait-ms", type=float, default=20.0)
    parser.add_argument("--queue-size", type=int, default=None, help="closed-loop cells (default: max C + 16)")
    parser.add_argument("--steps", type=int, default=None, help="the servers' step count (default: the export's)")
    parser.add_argument("--client", choices=("raw", "httpx"), default="raw",
                        help="closed-loop client: raw HTTP/1.1 on asyncio (cheap), or distill.serve.AsyncClient")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up requests (default 4)")
    parser.add_argument("--overload", action="store_true", help="run the 2x overload check")
    parser.add_argument("--overload-seconds", type=float, default=None, help="default 30")
    parser.add_argument("--overload-queue-size", type=int, default=16)
    parser.add_argument("--overload-timeout-s", type=float, nargs="+", default=[5.0],
                        help="the requests' timeout_s; one overload run per value")
    parser.add_argument("--overload-rate", nargs="+", default=[],
                        help="name=images/s: the stream-mode throughput at C=16 to double (default: this run's)")
    parser.add_argument("--rows-from", default=None, help="a previous --out JSON: keep its closed-loop rows, "
                                                          "run no rounds (e.g. only --overload)")
    parser.add_argument("--start-timeout", type=float, default=180.0, help="seconds for a server to come up")
    parser.add_argument("--cell-timeout", type=float, default=900.0, help="seconds a cell may take at most")
    parser.add_argument("--quick", action="store_true", help="tiny defaults: modes sequential stream, C 1 2, "
                                                             "4 requests, 1 round, 2 steps")
    parser.add_argument("--out", default=None, help="X.json (+ X.md)")
    parser.add_argument("--plot", default=None, help="a PNG: throughput and p95 against concurrency")
    parser.add_argument("--note", default="", help="a note kept in the JSON (e.g. what else ran)")
    args = parser.parse_args(argv)
    quick = {"modes": ["sequential", "stream"], "concurrency": [1, 2], "requests": 4, "rounds": 1, "steps": 2,
             "warmup": 1, "overload_seconds": 3.0}
    full = {"modes": list(MODES), "concurrency": [1, 4, 16, 64], "requests": None, "rounds": 3, "steps": None,
            "warmup": 4, "overload_seconds": 30.0}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        pipelines = parse_pipelines(args.pipelines)
        if min(args.concurrency) < 1 or args.rounds < 0 or (args.requests is not None and args.requests < 1):
            raise ValueError("--concurrency and --requests must be >= 1, --rounds >= 0")
        rates = {k: float(v) for k, _, v in (item.partition("=") for item in args.overload_rate)}
        previous = json.loads(Path(args.rows_from).read_text()) if args.rows_from else None
    except (ValueError, OSError) as err:
        parser.exit(2, f"error: {err}\n")
    args.queue_size = args.queue_size or max(args.concurrency) + 16

    import psutil
    import torch

    seeds = itertools.count(1000)
    logdir = Path(tempfile.mkdtemp(prefix="serve_load_"))
    servers = [(name, mode) for name in pipelines for mode in args.modes]
    raw, records, overloads = [], [], []
    started = time.time()
    if previous is not None:
        args.rounds = 0
        raw, records = previous["raw"], previous["servers"]
    for r in range(args.rounds):
        k = r % len(servers)
        for name, mode in servers[k:] + servers[:k]:
            rows, record = run_server(name, pipelines[name], mode, args, seeds, logdir, r)
            raw += rows
            records.append(record)
    rows = aggregate(raw)
    if args.overload:
        for name, path in pipelines.items():
            c16 = rates.get(name) or next((a["images_per_s"] for a in rows if a["model"] == name
                                           and a["mode"] == "stream" and a["concurrency"] == 16), None)
            for timeout_s in args.overload_timeout_s:
                overloads.append(overload(name, path, c16, timeout_s, args, seeds, logdir))
    result = {
        "command": _shown("python bench/serve_load.py " + shlex.join(sys.argv[1:] if argv is None else argv)),
        "date": time.strftime("%Y-%m-%d %H:%M"), "minutes": (time.time() - started) / 60,
        "machine": {"cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "memory_gb": psutil.virtual_memory().total / 2**30, "torch": torch.__version__,
                    "python": platform.python_version()},
        "code": code_version(),
        "settings": {"pipelines": {k: _shown(v) for k, v in pipelines.items()}, "modes": args.modes, "concurrency": args.concurrency,
                     "requests": args.requests or "max(24, 2C)", "rounds": args.rounds, "server_threads": args.threads,
                     "max_batch_size": args.max_batch_size, "max_wait_ms": args.max_wait_ms,
                     "queue_size": args.queue_size, "steps": args.steps, "warmup": args.warmup,
                     "client": args.client},
        "note": args.note, "closed_loop_from": previous and {k: previous[k] for k in (
            "command", "date", "minutes", "code", "settings", "note")}, "rows": rows, "overload": overloads, "raw": raw, "servers": records,
        "verdicts": verdicts(rows, overloads),
    }
    command = f"`{result['command']}`"
    if previous:
        result["settings"] = {**previous["settings"], "overload_only": result["settings"]}
        command = f"`{previous['command']}` (closed loop, {previous['date']}), then {command} (overload)"
    table = markdown(rows, overloads)
    print(table)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        out.with_suffix(".md").write_text(f"{command}\n\n{table}")
    if args.plot:
        settings = previous["settings"] if previous else result["settings"]
        plot(rows, args.plot, f"distill.serve on {os.cpu_count()} CPU cores, server threads="
                              f"{settings['server_threads']}, max_batch_size={settings['max_batch_size']}; median of "
                              f"{settings['rounds']} rounds")
    return result


if __name__ == "__main__":
    main()
