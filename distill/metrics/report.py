"""Reporting of quality-cost rows: the CSV, the Markdown table, the Pareto plot and sample-grid files.

Columns follow the metric registry (``distill.metrics.registry.METRICS``): a registered metric gets its
value and ``_std`` columns everywhere without an edit here.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from distill.metrics.bootstrap import difference_std as difference_std_of_replicates
from distill.metrics.registry import METRICS

RUN_COLUMNS = ["model", "scheduler", "accelerate", "steps", "guidance_scale", "nfe"]
COST_COLUMNS = ["latency_s", "images_per_s", "peak_memory_mb", "gflops_per_image", "params_m", "active_params_m"]


def quality_columns() -> list[str]:
    """Every registered metric's column followed by its uncertainty's."""
    return [c for name in METRICS for c in (name, f"{name}_std")]


def columns() -> list[str]:
    """The table columns: the run, the quality metrics with their uncertainties, the cost, the training step."""
    return RUN_COLUMNS + quality_columns() + COST_COLUMNS + ["step"]


def replicate_columns() -> list[str]:
    """The protocol the replicates were drawn under and every registered metric's paired replicates
    (``<name>_replicates``), the CSV's last columns."""
    return ["replicate_key"] + [f"{name}_replicates" for name in METRICS]


def encode_replicates(values: Sequence[float]) -> str:
    """Replicates as one CSV cell: space-separated, 8 significant figures."""
    return " ".join(f"{float(v):.8g}" for v in values)


def decode_replicates(cell: str) -> list[float]:
    return [float(v) for v in cell.split()]


def pareto_front(rows: list[dict], x: str = "latency_s", y: str = "fid") -> list[dict]:
    """Rows not dominated by another row that is at least as good on both axes and better on one."""
    front = []
    for r in rows:
        dominated = any(o is not r and o[x] <= r[x] and o[y] <= r[y] and (o[x] < r[x] or o[y] < r[y]) for o in rows)
        if not dominated:
            front.append(r)
    return sorted(front, key=lambda r: r[x])


def difference_std(a: dict, b: dict, key: str = "fid") -> float:
    """Uncertainty of ``a[key] - b[key]``: the paired bootstrap over shared resamples when both rows hold
    ``<key>_replicates`` of one protocol (equal ``replicate_key``: the same prompts and seeds, resampled together;
    what the rows share cancels), else the independent sqrt(std_a^2 + std_b^2) (``<key>_std`` of each row)."""
    ra, rb = a.get(f"{key}_replicates"), b.get(f"{key}_replicates")
    same = a.get("replicate_key") is not None and a.get("replicate_key") == b.get("replicate_key")
    if same and ra is not None and rb is not None and len(ra) == len(rb) >= 2:
        return difference_std_of_replicates(ra, rb)
    return math.hypot(a[f"{key}_std"], b[f"{key}_std"])


def differ_beyond_uncertainty(a: dict, b: dict, key: str = "fid", sigmas: float = 1.0) -> bool:
    """Whether rows ``a`` and ``b`` differ in ``key`` by more than ``sigmas`` times the uncertainty of their
    difference (``difference_std``: paired where the rows share prompts and seeds)."""
    return abs(a[key] - b[key]) > sigmas * difference_std(a, b, key)


def format_difference(a: dict, b: dict, key: str = "fid") -> str:
    """``a - b`` as ``+0.52 ± 0.18`` with the uncertainty of the difference (``difference_std``)."""
    text = format_uncertain(a[key] - b[key], difference_std(a, b, key))
    return text if text.startswith("-") else "+" + text


def format_uncertain(value: float, std: float) -> str:
    """``value ± std`` with the std to two significant figures and the value to the same decimal place; a std
    that is zero up to float rounding (every resample alike) prints as 0, the value to 4 significant figures."""
    if not math.isfinite(std) or not std > 1e-9 * max(1.0, abs(value)):
        return f"{value:.4g} ± {0.0 if math.isfinite(std) else std:.2g}"
    decimals = max(0, 1 - math.floor(math.log10(std)))
    return f"{value:.{decimals}f} ± {std:.{decimals}f}"


def format_quality(row: dict) -> str:
    """``FID=3.21 ± 0.15 KID=...`` for every registered metric the row holds (console lines)."""
    return " ".join(f"{cls.label}={format_uncertain(row[name], row[f'{name}_std'])}"
                    for name, cls in METRICS.items() if name in row)


def write_csv(rows: list[dict], path: Path, append: bool = False, lead: Sequence[str] = ()) -> None:
    """Write (or append to) a CSV of ``columns()`` and ``replicate_columns()`` (after the ``lead`` columns, e.g. a
    cross-run report's run and overrides); appending keeps an existing file's header (an older run's)."""
    path = Path(path)
    new = not (append and path.exists())
    header = list(lead) + columns() + replicate_columns()
    rows = [{k: encode_replicates(v) if k.endswith("_replicates") else v for k, v in r.items()} for r in rows]
    if not new:
        with open(path, newline="") as f:
            header = next(csv.reader(f), header)
    with open(path, "a" if append else "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerows(rows)


def _cell(row: dict, column: str) -> str:
    value, std = row.get(column, ""), row.get(f"{column}_std")
    if isinstance(value, float) and isinstance(std, float):
        return format_uncertain(value, std)
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def format_floor(floor: dict) -> str:
    """``real-data floor: FID(train, held-out) = 1.05 ± 0.17, KID(...) = ...``."""
    parts = [f"{METRICS[name].label}(train, held-out) = {_cell(floor, name)}" for name in METRICS if name in floor]
    return "real-data floor: " + ", ".join(parts)


def format_table(rows: list[dict], floor: dict | None = None, lead: Sequence[str] = ()) -> str:
    """A Markdown table of the rows, each quality number as ``value ± std`` (and the real-data floor), the ``lead``
    columns first."""
    cols = list(lead) + [c for c in columns() if any(c in r for r in rows) and not c.endswith("_std")]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r, c) for c in cols) + " |")
    if floor is not None:
        lines.append("\n" + format_floor(floor))
    return "\n".join(lines)


def plot_pareto(rows: list[dict], path: Path, title: str = "quality vs cost", floor: dict | None = None,
                x: str = "latency_s", y: str = "fid", series_of=None, point_label=None,
                legend_outside: bool | None = None) -> Path:
    """FID against latency per image with +-1 std error bars, one series per (model, scheduler) (or per
    ``series_of(row)``, each point labelled ``point_label(row)``, default its steps), the front drawn as a line,
    the real-data floor as a band. The legend goes beside the axes with more than 8 series, or as
    ``legend_outside`` says (long series names)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5), dpi=120)
    series: dict[tuple, list[dict]] = {}
    for r in rows:
        series.setdefault(series_of(r) if series_of else (r["model"], r["scheduler"]), []).append(r)
    for key, rs in sorted(series.items()):
        rs = sorted(rs, key=lambda r: r[x])
        name = key if series_of else f"{key[0]} {key[1]}"
        marker = "s" if name.startswith("teacher") and series_of is None and key[0] == "teacher" else "o"
        ax.errorbar([r[x] for r in rs], [r[y] for r in rs], yerr=[r.get(f"{y}_std", 0.0) for r in rs], marker=marker,
                    linestyle=":", capsize=2, label=name)
        for r in rs:
            ax.annotate(point_label(r) if point_label else str(r["steps"]), (r[x], r[y]), textcoords="offset points",
                        xytext=(3, 3), fontsize=6 if point_label else 7)
    front = pareto_front(rows, x, y)
    ax.plot([r[x] for r in front], [r[y] for r in front], color="black", linewidth=1, alpha=0.5, label="Pareto front")
    if floor is not None:
        ax.axhline(floor[y], color="grey", linestyle="--", linewidth=1, label="real-data floor")
        spread = floor.get(f"{y}_std", 0.0)
        ax.axhspan(floor[y] - spread, floor[y] + spread, color="grey", alpha=0.15, linewidth=0)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("latency per image (s)" if x == "latency_s" else x)
    ax.set_ylabel(y.upper() if y == "fid" else y)
    ax.set_title(title)
    if legend_outside or (legend_outside is None and len(series) > 8):  # beside the axes, not over the points
        fig.set_size_inches(9.5, 4.8)
        ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
    else:
        ax.legend(fontsize=7)
    return save_figure(fig, path)


def save_figure(fig, path: Path) -> Path:
    """Lay out, write (creating the folder) and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def save_grid(images: torch.Tensor, path: Path, nrow: int, prompts: list[str], scale: int = 3):
    """A sample grid (``nrow`` images a row, one prompt a row) as a PNG whose text chunk ``prompts`` holds the
    rows' prompts as JSON; returns the PIL image."""
    from PIL.PngImagePlugin import PngInfo

    from distill.utils.images import image_grid, upscale

    grid = upscale(image_grid(images, nrow=nrow), scale)
    info = PngInfo()
    info.add_text("prompts", json.dumps(list(prompts)))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path, pnginfo=info)
    return grid
