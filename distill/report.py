"""Cross-run report: every run's quality-cost rows in one table, one Pareto plot and one static HTML dashboard.

``python -m distill.report <run dirs | multirun dir | evaluate dirs> [--out DIR]`` (or ``distill-report``) finds
each directory that holds a ``quality_cost.csv`` (a training run with the quality-cost callback, a
``distill.evaluate`` output, every job of a Hydra multirun), keeps each run's final evaluation (the rows of its
last ``step``, and the teacher's rows, which the callback writes once with the first evaluation), names each run by
the overrides that distinguish it from the others (``method.num_ddim_timesteps=25,student=lora``) and writes to
``--out``:

``report.md``, ``report.csv``
    one row per (run, model, scheduler, steps) point, led by the run's label, its distinguishing overrides (a
    column each), whether the point is on the Pareto front of FID against latency across all runs, and its directory.
``pareto.png``
    FID against latency, a series per run (``distill.metrics.report.plot_pareto``).
``dashboard.html``
    the same plot in Plotly with its JavaScript inline (it opens from disk, offline): FID ± std against latency or
    NFE, the front marked, each point's hover naming its run, the config that distinguishes the run and the point's
    numbers, a click opening its sample grid; below it, the runs with links to their grids.

Teacher rows of the same quality in every run (the same teacher measured by the same protocol) appear once, as the
run ``teacher``, with the first run's cost.
"""

from __future__ import annotations

import argparse
import csv
import html
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import yaml

CSV_NAME = "quality_cost.csv"
STRING_COLUMNS = {"model", "scheduler", "accelerate", "replicate_key"}
LEAD = ["run"]  # then one column per distinguishing override, then TAIL
TAIL = ["pareto", "dir"]
MAX_CONFIG_LINES = 8  # config differences shown in a point's hover (the runs table lists them all)
TEACHER_RUN = "teacher"
PLACEHOLDERS = ("(default)", "(none)")  # a key a run did not override, its value unknown (not set / appended)
LEGEND_CHARS = 48  # legend names are cut here (the tables and hovers hold the whole label)


class ReportInputError(ValueError):
    """A path given to the report that holds no run (the CLI exits 2 with this message)."""


@dataclass
class Run:
    """One run directory: its final quality-cost rows, its overrides (as typed), Hydra's group choices and its
    flattened resolved config (the run's own directory replaced by ``<run dir>``)."""

    dir: Path
    rows: list[dict]
    overrides: list[str] | None = None  # None: no Hydra record (.hydra/overrides.yaml), e.g. distill.evaluate's
    choices: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    floor: dict | None = None
    label: str = ""
    short: str = ""  # the label for a plot legend: last key component, numbers to 4 significant figures
    distinct: dict = field(default_factory=dict)  # distinguishing override key (as typed) -> this run's value
    config_diff: dict = field(default_factory=dict)  # distinguishing resolved-config key -> this run's value
    folder: str = ""  # relative to the runs' common folder


# ---------------------------------------------------------------------------------------------- reading


def _natural_key(path: Path) -> list:
    """``2`` before ``10``: multirun job folders in their numeric order."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


def discover(paths: list[str | Path]) -> tuple[list[Path], list[Path]]:
    """The run directories under ``paths`` (a directory holding ``quality_cost.csv``, or every one below a directory,
    not looking inside a run) and the Hydra job directories found without one (a job that failed or is running).
    Raises ``ReportInputError`` naming the first path that does not exist or holds no run."""
    runs, skipped, seen = [], [], set()
    for given in paths:
        path = Path(given)
        if path.is_file() and path.name == CSV_NAME:
            path = path.parent
        if not path.is_dir():
            raise ReportInputError(f"{given}: no such directory")
        found = []
        for root, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            if CSV_NAME in files:
                found.append(Path(root))
                dirs[:] = []  # a run's own folders (samples, export, ...) hold no other run
            elif ".hydra" in os.listdir(root):
                skipped.append(Path(root))
        if not found:
            raise ReportInputError(f"{given}: no {CSV_NAME} in it or below it")
        for run in sorted(found, key=_natural_key):
            if run.resolve() not in seen:
                seen.add(run.resolve())
                runs.append(run)
    return runs, skipped


def _value(column: str, cell: str):
    from distill.metrics.report import decode_replicates

    if column in STRING_COLUMNS:
        return cell
    if column.endswith("_replicates"):
        return decode_replicates(cell)
    for kind in (int, float):
        try:
            return kind(cell)
        except ValueError:
            pass
    return cell


def read_rows(path: Path) -> list[dict]:
    """The rows of a quality-cost CSV, numbers as int or float, empty cells left out (as the writer's rows lack
    them)."""
    with open(path, newline="") as f:
        return [{k: _value(k, v) for k, v in row.items() if k is not None and v not in ("", None)}
                for row in csv.DictReader(f)]


def final_rows(rows: list[dict]) -> list[dict]:
    """The run's final evaluation: the rows of the last ``step``, and the teacher's rows of the last step that has
    any (the callback writes them once, with the first evaluation); every row when the CSV has no step (a
    ``distill.evaluate`` output)."""
    last = {}
    for r in rows:
        if isinstance(r.get("step"), int | float):
            last[_is_teacher(r)] = max(last.get(_is_teacher(r), r["step"]), r["step"])
    if not last:
        return list(rows)
    return [r for r in rows if r.get("step") == last.get(_is_teacher(r))]


def _is_teacher(row: dict) -> bool:
    return str(row.get("model", "")).startswith("teacher")


def _callback_teacher(row: dict) -> bool:
    """A teacher row of the training callback (it has a step), measured alongside a student; distill.evaluate's
    rows of a teacher are the subject of their run, never merged."""
    return _is_teacher(row) and "step" in row


def _flatten(node, prefix: str = "") -> dict:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out if out or not prefix else {prefix[:-1]: "{}"}
    return {prefix[:-1]: node}


def _load_yaml(path: Path):
    if not path.is_file():
        return None
    with open(path) as f:
        return yaml.safe_load(f)


def unregistered_metrics(rows: list[dict]) -> list[str]:
    """The metrics whose columns ``rows`` hold (each metric's ``<name>_replicates``) but that are not registered in
    this process (a plugin's, measured with ``DISTILL_PLUGINS`` set): the tables keep the registered ones only."""
    from distill.metrics.registry import METRICS

    measured = dict.fromkeys(k.removesuffix("_replicates") for r in rows for k in r if k.endswith("_replicates"))
    return [name for name in measured if name not in METRICS]


def load_run(run_dir: Path) -> Run:
    """Rows, overrides, Hydra choices and config of a run directory (``config.yaml``, else ``.hydra/config.yaml``,
    else a ``distill.evaluate`` output's ``protocol.json``)."""
    rows = final_rows(read_rows(run_dir / CSV_NAME))
    if not rows:
        raise ReportInputError(f"{run_dir / CSV_NAME}: no rows")
    recorded = run_dir / ".hydra" / "overrides.yaml"
    overrides = [str(o) for o in _load_yaml(recorded) or []] if recorded.is_file() else None
    hydra_cfg = _load_yaml(run_dir / ".hydra" / "hydra.yaml") or {}
    choices = ((hydra_cfg.get("hydra") or {}).get("runtime") or {}).get("choices") or {}
    config, floor = None, None
    for name in ("config.yaml", ".hydra/config.yaml"):
        config = _load_yaml(run_dir / name)
        if config is not None:
            break
    if config is None and (run_dir / "protocol.json").is_file():
        config = json.loads((run_dir / "protocol.json").read_text())
        floor = config.get("real_data_floor_metrics")
    flat = _flatten(config or {})
    own = {str(run_dir), str(run_dir.resolve()), str(flat.get("trainer.default_root_dir", run_dir))}
    for key, value in flat.items():  # the run's own directory is no difference between runs
        if isinstance(value, str):
            for path in sorted(own, key=len, reverse=True):
                value = value.replace(path, "<run dir>")
            flat[key] = value
    return Run(run_dir, rows, overrides, {str(k): v for k, v in choices.items()}, flat, floor)


# ---------------------------------------------------------------------------------------------- labels


def _fmt(value) -> str:
    """A config value as an override would write it: ``true``, ``null``, ``[1,2,4]``."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, list | dict):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def _parse_override(override: str) -> tuple[str, str, str]:
    """(key as typed, bare key, value as a config value would print): ``+exp=x`` -> (``+exp``, ``exp``, ``x``)."""
    key, _, value = override.partition("=")
    bare = key.lstrip("+~")
    try:
        value = _fmt(yaml.safe_load(value)) if value else ("(deleted)" if key.startswith("~") else "")
    except yaml.YAMLError:
        pass
    return key, bare, value


def _short_value(value: str) -> str:
    """A float written to 4 significant figures (``0.0003506575`` -> ``0.0003507``); anything else as it is."""
    try:
        number = float(value)
    except ValueError:
        return value
    return value if number.is_integer() or not any(c in value for c in ".eE") else f"{number:.4g}"


def _lookup(run: Run, bare: str, typed: str) -> str:
    """The value a run that did not override ``bare`` ran with: its Hydra group choice or config value."""
    if bare in run.choices:
        return _fmt(run.choices[bare])
    if bare in run.config:
        return _fmt(run.config[bare])
    return PLACEHOLDERS[typed.startswith("+")]


def label_runs(runs: list[Run]) -> None:
    """Set each run's ``distinct`` (the overrides whose values differ between the runs that recorded overrides, keys
    in first-seen order), ``label`` (those as ``key=value,...``, else the run's folder relative to the runs' common
    folder; made unique) and ``config_diff`` (the resolved config entries that differ between runs)."""
    parsed = [{bare: (typed, value) for typed, bare, value in map(_parse_override, run.overrides or [])}
              for run in runs]
    keys: dict[str, str] = {}  # bare -> as first typed
    for overrides in parsed:
        for bare, (typed, _) in overrides.items():
            keys.setdefault(bare, typed)
    values = [{bare: ov[bare][1] if bare in ov else _lookup(run, bare, typed) for bare, typed in keys.items()}
              for run, ov in zip(runs, parsed, strict=True)]
    hydra = [v for run, v in zip(runs, values, strict=True) if run.overrides is not None]
    distinct = [bare for bare in keys if len({v[bare] for v in hydra}) > 1]
    common = Path(os.path.commonpath([str(r.dir.resolve()) for r in runs]))
    for run, vals in zip(runs, values, strict=True):
        run.distinct = {keys[bare]: vals[bare] for bare in distinct}
        here = run.dir.resolve()
        run.folder = str(here.relative_to(common)) if here != common else here.name
        # the label leaves out keys a run neither set nor can name a value for (its table cell says "(default)")
        run.label = ",".join(f"{k}={v}" for k, v in run.distinct.items() if v not in PLACEHOLDERS) or run.folder
    tails = {k: k.lstrip("+~").rsplit(".", 1)[-1] for k in (keys[bare] for bare in distinct)}
    unique = len(set(tails.values())) == len(tails)  # else the full keys (two distinguishing keys end alike)
    for run in runs:
        run.short = ",".join(f"{tails[k] if unique else k}={_short_value(v)}" for k, v in run.distinct.items()
                             if v not in PLACEHOLDERS) or run.label
    counts: dict[str, int] = {}
    for run in runs:
        counts[run.label] = counts.get(run.label, 0) + 1
    for run in runs:  # the same overrides twice (a repeated run): the folder tells them apart
        if counts[run.label] > 1:
            run.label = f"{run.label} ({run.folder})"
    all_keys = sorted({k for run in runs for k in run.config if not k.startswith("hydra.")})
    for key in all_keys:
        seen = {_fmt(run.config[key]) if key in run.config else "(absent)" for run in runs}
        if len(seen) > 1:
            for run in runs:
                run.config_diff[key] = _fmt(run.config[key]) if key in run.config else "(absent)"


# ---------------------------------------------------------------------------------------------- rows


def _same_teacher(runs: list[Run]) -> bool:
    """Whether two or more runs measured a teacher and all of them got the same points and quality (the same
    model, protocol and seeds; the cost is measured anew by each run, and differs by timing noise)."""
    from distill.metrics.report import RUN_COLUMNS, quality_columns

    keys = RUN_COLUMNS + quality_columns()
    measured = [t for t in (sorted(json.dumps({k: r.get(k) for k in keys}) for r in run.rows if _callback_teacher(r))
                            for run in runs) if t]
    return len(measured) > 1 and all(t == measured[0] for t in measured)


def gather(runs: list[Run], x: str = "latency_s", y: str = "fid") -> tuple[list[dict], list[str]]:
    """Every run's rows led by ``run``, the distinguishing overrides, ``pareto`` (1 on the front of ``y`` against
    ``x`` across all runs, else 0) and ``dir``; and the lead columns. A teacher of the same quality in every run
    that measured one is kept once (the first run's rows, cost included), as the run ``teacher`` (``_shared``);
    ``_run`` is the row's ``Run`` (the writers ignore both)."""
    from distill.metrics.report import pareto_front

    override_columns = list(dict.fromkeys(k for run in runs for k in run.distinct))
    once = _same_teacher(runs)
    owner = next((run for run in runs if any(map(_callback_teacher, run.rows))), None)  # its teacher rows stay
    rows = []
    for run in runs:
        for r in run.rows:
            teacher = _callback_teacher(r)
            if once and teacher and run is not owner:
                continue
            lead = {"run": TEACHER_RUN if once and teacher else run.label}
            lead.update({k: ("" if once and teacher else run.distinct.get(k, "")) for k in override_columns})
            rows.append({**lead, **r, "dir": str(run.dir), "_run": run, "_shared": once and teacher})
    measured = [r for r in rows if _finite(r.get(x)) and _finite(r.get(y))]
    front = {id(r) for r in pareto_front(measured, x, y)}
    for r in rows:
        r["pareto"] = int(id(r) in front)
    return rows, LEAD + override_columns


def _finite(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def _numbers(rows: list[dict]) -> dict[str, int]:
    """Each run's number (1, 2, ... in the order given) by label; a teacher shared by every run has none."""
    labels = dict.fromkeys(r["run"] for r in rows if not r["_shared"])
    return {label: i for i, label in enumerate(labels, 1)}


def _series(rows: list[dict]):
    """A plot series per run, per (run, model, scheduler) where a run has several (a teacher's schedulers beside
    its student); named by the run's number and label, cut to ``LEGEND_CHARS``."""
    numbers = _numbers(rows)
    width = len(str(len(numbers)))
    curves: dict[str, set] = {}
    for r in rows:
        curves.setdefault(r["run"], set()).add((r.get("model", ""), r.get("scheduler", "")))

    def name(r):
        short = r["run"] if r["_shared"] else r["_run"].short or r["run"]
        text = short if r["_shared"] else f"[{numbers[r['run']]:0{width}d}] {short}"  # [01] sorts before [10]
        text = text if len(text) <= LEGEND_CHARS else text[:LEGEND_CHARS - 1] + "…"
        return text if len(curves[r["run"]]) == 1 else f"{text} {r.get('model', '')} {r.get('scheduler', '')}"

    return name


def _point(r: dict) -> str:
    accel = r.get("accelerate", "none")
    return f"{r.get('scheduler', '')} {r.get('steps', '')}" + (f" +{accel}" if accel not in ("none", "") else "")


def _floor(runs: list[Run]) -> dict | None:
    """The real-data floor when every run recorded the same one (``distill.evaluate`` outputs of one protocol)."""
    floors = {json.dumps(run.floor, sort_keys=True) for run in runs}
    return runs[0].floor if len(floors) == 1 and runs[0].floor else None


# ---------------------------------------------------------------------------------------------- outputs


def _grids(run: Run, row: dict) -> Path | None:
    """The sample grid of a row: the callback's ``samples/<model>-<scheduler>-<steps>[_step_<step>].png`` or
    distill.evaluate's ``grids/<model>-<scheduler>-<steps>.png``."""
    stem = f"{row.get('model', '')}-{row.get('scheduler', '')}-{row.get('steps', '')}"
    names = [f"samples/{stem}.png", f"grids/{stem}.png"]
    if isinstance(row.get("step"), int):
        names.insert(0, f"samples/{stem}_step_{row['step']:07d}.png")
    return next((run.dir / n for n in names if (run.dir / n).is_file()), None)


def _href(path: Path, out: Path) -> str:
    return quote(os.path.relpath(path.resolve(), out.resolve()).replace(os.sep, "/"))


def _config_lines(run: Run) -> list[str]:
    """The run's config differences, those under a distinguishing override first (``student.*`` for
    ``student=lora``), each ``key=value``."""
    bare = tuple(k.lstrip("+~") for k in run.distinct)
    first = [k for k in run.config_diff if k in bare or k.startswith(tuple(f"{b}." for b in bare))]
    keys = first + [k for k in run.config_diff if k not in first]
    return [f"{k}={run.config_diff[k]}" for k in keys]


def _fid(r: dict) -> str:
    """``value ± std`` as in the Markdown tables."""
    from distill.metrics.report import format_uncertain

    return format_uncertain(r["fid"], r.get("fid_std", float("nan")))


def _cut(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[:chars - 3] + "..."


def _hover(run: Run, r: dict, shared_teacher: bool) -> str:
    """The point's run (its distinguishing overrides) and numbers, the first of the run's other config differences
    and its overrides (Plotly's hover HTML: <br> lines, values escaped)."""
    def e(text):
        return html.escape(text, quote=False)

    fid = f"FID {_fid(r)}" if _finite(r.get("fid")) else "FID n/a"
    latency = f"{r['latency_s'] * 1e3:.3g} ms/img" if _finite(r.get("latency_s")) else "latency n/a"
    nfe = f"NFE {r['nfe']:g}" if _finite(r.get("nfe")) else "NFE n/a"
    lines = [f"<b>{e(_cut(r['run'], 120))}</b>", e(f"{r.get('model', '')} {_point(r)} · {nfe} · {fid} · {latency}")]
    if r["pareto"]:
        lines.append("on the Pareto front (FID vs latency)")
    if shared_teacher:
        lines.append(e(f"the same teacher quality in every run (cost as measured in {run.dir})"))
        return "<br>".join(lines)
    lines += [e(f"{k}={v}") for k, v in run.distinct.items() if len(r["run"]) > 120]  # the label was cut
    shown = {k.lstrip("+~") for k in run.distinct}
    config = [line for line in _config_lines(run) if line.partition("=")[0] not in shown]
    if config:
        lines.append("<i>config differences:</i>")
        lines += [e(_cut(line, 100)) for line in config[:MAX_CONFIG_LINES]]
        if len(config) > MAX_CONFIG_LINES:
            lines.append(f"... {len(config) - MAX_CONFIG_LINES} more in the runs table")
    if run.overrides:
        lines.append(e(_cut("overrides: " + " ".join(run.overrides), 160)))
    return "<br>".join(lines)


def write_tables(rows: list[dict], lead: list[str], out: Path, floor: dict | None, plot: bool = True
                 ) -> tuple[Path, Path]:
    """``report.csv`` (every column, numbers as the runs wrote them) and ``report.md`` (the runs, the table with
    ``value ± std``, the front)."""
    from distill.metrics.report import format_table, write_csv

    write_csv(rows, out / "report.csv", lead=lead + TAIL)
    md_rows = [{**r, **{k: str(r[k]).replace("|", "\\|") for k in lead}, "pareto": "✓" if r["pareto"] else ""}
               for r in rows]
    table = format_table(md_rows, floor, lead=lead + ["pareto"])
    numbers = _numbers(rows)
    runs = list(dict.fromkeys((r["run"], r["dir"]) for r in rows if not r["_shared"]))
    front = [f"{r['run']}: {_point(r)} ({r['fid']:.4g} FID, {r['latency_s'] * 1e3:.3g} ms/img)"
             for r in sorted((r for r in rows if r["pareto"]), key=lambda r: r["latency_s"])]
    text = "\n".join([
        f"# Quality-cost report: {len(runs)} runs", "",
        *[f"{numbers[label]}. `{label}`: {d}" for label, d in runs],
        *[f"- `{TEACHER_RUN}`: the same teacher quality in every run that measured one (cost from {shared[0]['dir']})"
          for shared in [[r for r in rows if r["_shared"]]] if shared], "",
        table, "",
        "Pareto front (FID against latency, across runs): " + ("; ".join(front) or "none (no latency measured)"), "",
        *(["![Pareto plot](pareto.png)", ""] if plot else []), "Interactive: [dashboard.html](dashboard.html)", ""])
    (out / "report.md").write_text(text)
    return out / "report.md", out / "report.csv"


def write_plot(rows: list[dict], out: Path, floor: dict | None) -> Path | None:
    """``pareto.png`` by ``plot_pareto``, a series per run (None when no row has a latency)."""
    from distill.metrics.report import plot_pareto

    measured = [r for r in rows if _finite(r.get("latency_s")) and _finite(r.get("fid"))]
    if not measured:
        return None
    runs = len(_numbers(rows))
    series_of = _series(rows)
    return plot_pareto(measured, out / "pareto.png", title=f"{runs} runs: FID vs latency", floor=floor,
                       series_of=series_of, point_label=_point,
                       legend_outside=max(len(series_of(r)) for r in measured) > 24 or None)


def dashboard_figure(rows: list[dict], out: Path):
    """The Plotly figure: a trace per series (FID ± std against latency; a button switches to NFE), the Pareto
    front of each axis as a black line through open circles, each point's hover and grid link."""
    import plotly.graph_objects as go

    from distill.metrics.report import pareto_front

    axes = {"latency_s": "latency per image (s)", "nfe": "NFE per image"}

    def value(r, key):
        return r[key] if _finite(r.get(key)) else None

    series_of = _series(rows)
    series: dict[str, list[dict]] = {}
    for r in rows:
        series.setdefault(series_of(r), []).append(r)
    fig = go.Figure()
    xs: dict[str, list] = {key: [] for key in axes}  # per axis, every trace's x
    for name, rs in series.items():
        rs = sorted(rs, key=lambda r: (value(r, "latency_s") is None, value(r, "latency_s") or 0, value(r, "nfe") or 0))
        grids = [_grids(r["_run"], r) for r in rs]
        fig.add_trace(go.Scatter(
            x=[value(r, "latency_s") for r in rs], y=[value(r, "fid") for r in rs], name=name,
            legendgroup=rs[0]["run"], mode="lines+markers", line={"dash": "dot", "width": 1}, marker={"size": 8},
            error_y={"type": "data", "array": [r.get("fid_std", 0.0) for r in rs], "visible": True, "thickness": 1},
            text=[_hover(r["_run"], r, r["_shared"]) for r in rs], hovertemplate="%{text}<extra></extra>",
            customdata=[_href(g, out) if g else "" for g in grids]))
        for key in axes:
            xs[key].append([value(r, key) for r in rs])
    fronts = {}
    for key in axes:
        fronts[key] = front = pareto_front([r for r in rows if _finite(r.get(key)) and _finite(r.get("fid"))],
                                           key, "fid")
        fig.add_trace(go.Scatter(
            x=[r[key] for r in front], y=[r["fid"] for r in front], name=f"Pareto front ({key.split('_')[0]})",
            mode="lines+markers", visible=key == "latency_s", line={"color": "black", "width": 1},
            marker={"symbol": "circle-open", "size": 15, "color": "black", "line": {"width": 1.5}},
            hoverinfo="skip"))  # the point under the circle tells that it is on the front
    buttons = [{"label": f"x: {key.split('_')[0]}", "method": "update",
                "args": [{"x": xs[key] + [[r[k] for r in fronts[k]] for k in axes],
                          "visible": [True] * len(series) + [k == key for k in axes]},
                         {"xaxis.title.text": title}]} for key, title in axes.items()]
    fig.update_layout(
        title=f"{len(_numbers(rows))} runs: FID vs latency or NFE (click a point for its sample grid)",
        xaxis={"type": "log", "title": {"text": axes["latency_s"]}},
        yaxis={"type": "log", "title": {"text": "FID"}}, hovermode="closest", height=600, template="plotly_white",
        updatemenus=[{"type": "buttons", "direction": "right", "buttons": buttons, "x": 0, "xanchor": "left",
                      "y": 1.12, "yanchor": "top", "showactive": True}])
    return fig


def _runs_table(runs: list[Run], rows: list[dict], out: Path) -> str:
    """A row per run (and one for a teacher shared by the runs): label, folder, distinguishing overrides and every
    config difference (folded), all overrides, points, best FID, links to the sample grids."""
    e = html.escape
    numbers = _numbers(rows)
    shared = [r for r in rows if r["_shared"]]
    body = []
    for run in runs + ([shared[0]["_run"]] if shared else []):
        teacher = len(body) == len(runs)
        rs = shared if teacher else [r for r in rows if r["_run"] is run and not r["_shared"]]
        links = [f'<a href="{_href(grid, out)}">{e(r.get("model", ""))} {e(_point(r))}</a>'
                 for r in rs if (grid := _grids(run, r)) is not None]
        if not teacher and (run.dir / "samples" / "final.png").is_file():
            links.append(f'<a href="{_href(run.dir / "samples" / "final.png", out)}">final.png</a>')
        best = min((r["fid"] for r in rs if _finite(r.get("fid"))), default=None)
        if teacher:
            config, overrides = "the same teacher quality in every run that measured one; cost from this run", ""
        else:
            config = "<br>".join(f"{e(k)}={e(v)}" for k, v in run.distinct.items()) or "&ndash;"
            diff = _config_lines(run)
            if diff:
                config += (f"<details><summary>{len(diff)} config differences</summary>"
                           + "<br>".join(e(line) for line in diff) + "</details>")
            overrides = e(" ".join(run.overrides or [])) or "&ndash;"
        cells = ["" if teacher else str(numbers[run.label]), e(TEACHER_RUN if teacher else run.label),
                 f'<a href="{_href(run.dir, out)}">{e(str(run.dir))}</a>', config, f"<code>{overrides}</code>",
                 str(len(rs)), "" if best is None else f"{best:.4g}", " · ".join(links)]
        body.append('<tr class="run">' + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ["#", "run", "directory", "distinguishing overrides, config",
                                              "all overrides", "points", "best FID", "sample grids"])
    return f'<table id="runs"><tr>{head}</tr>{"".join(body)}</table>'


def _points_table(rows: list[dict]) -> str:
    e = html.escape
    head = ["run", "model", "scheduler", "steps", "NFE", "FID", "latency (ms/img)", "Pareto"]
    body = []
    for r in rows:
        fid = _fid(r) if _finite(r.get("fid")) else ""
        latency = f"{r['latency_s'] * 1e3:.3g}" if _finite(r.get("latency_s")) else ""
        nfe = f"{r['nfe']:g}" if _finite(r.get("nfe")) else ""
        cells = [r["run"], r.get("model", ""), r.get("scheduler", ""), r.get("steps", ""), nfe, fid,
                 latency, "✓" if r["pareto"] else ""]
        body.append("<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in cells) + "</tr>")
    return ('<table id="points"><tr>' + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>" + "".join(body)
            + "</table>")


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.25em 0.5em; text-align: left; vertical-align: top;
          max-width: 36em; overflow-wrap: anywhere; }}
th {{ background: #f3f3f3; }}
code {{ font-size: 0.85em; }}
</style></head><body>
<h1>{title}</h1>
<p>{summary}</p>
{plot}
<h2>Runs</h2>
{runs}
<h2>Points</h2>
{points}
</body></html>
"""

CLICK = """var gd = document.getElementById('{plot_id}');
gd.on('plotly_click', function (event) {
  var url = event.points.length ? event.points[0].customdata : '';
  if (url) { window.open(url, '_blank'); }
});"""


def write_dashboard(rows: list[dict], runs: list[Run], out: Path) -> Path:
    """``dashboard.html``: the Plotly figure with plotly.js inline (no server, no network), the runs and points."""
    fig = dashboard_figure(rows, out)
    plot = fig.to_html(full_html=False, include_plotlyjs=True, div_id="pareto", post_script=CLICK,
                       config={"displaylogo": False, "responsive": True})
    front = sum(r["pareto"] for r in rows)
    summary = (f"{len(runs)} runs, {len(rows)} points, {front} on the Pareto front of FID against latency "
               f"(open circles). Written {time.strftime('%Y-%m-%d %H:%M:%S')} by <code>python -m distill.report"
               f"</code>.")
    page = PAGE.format(title=html.escape(f"distill report: {len(runs)} runs"), summary=summary, plot=plot,
                       runs=_runs_table(runs, rows, out), points=_points_table(rows))
    (out / "dashboard.html").write_text(page, encoding="utf-8")
    return out / "dashboard.html"


def report(paths: list[str | Path], out: Path) -> dict[str, Path]:
    """Find, read and label the runs (``ReportInputError`` before anything is written), then write everything;
    returns the written files by name."""
    found, skipped = discover(paths)
    runs = [load_run(d) for d in found]
    for job in skipped:
        print(f"distill.report: {job}: a Hydra job without {CSV_NAME} (failed or running), skipped", file=sys.stderr)
    for run in runs:
        unknown = unregistered_metrics(run.rows)
        if unknown:
            print(f"distill.report: {run.dir / CSV_NAME} holds metric(s) {unknown} that no registered metric names; "
                  "they are left out of the report: name the module that registers them in DISTILL_PLUGINS (as "
                  "for the run that measured them, e.g. DISTILL_PLUGINS=tests.examples.toy_metric)", file=sys.stderr)
    label_runs(runs)
    rows, lead = gather(runs)
    out.mkdir(parents=True, exist_ok=True)
    floor = _floor(runs)
    plot = write_plot(rows, out, floor)
    md, csv_path = write_tables(rows, lead, out, floor, plot=plot is not None)
    written = {"report.md": md, "report.csv": csv_path, "dashboard.html": write_dashboard(rows, runs, out)}
    return written | ({"pareto.png": plot} if plot is not None else {})


def main(argv: list[str] | None = None) -> int:
    """``distill-report PATH... [--out DIR]``; exits 2 naming a path that holds no run."""
    parser = argparse.ArgumentParser(
        prog="distill-report", description="One table, Pareto plot and HTML dashboard across runs' quality_cost.csv.")
    parser.add_argument("paths", nargs="+", help="run directories, multirun directories or distill.evaluate outputs")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default: <path>/report for one path, else outputs/report/<date>/<time>)")
    args = parser.parse_args(argv)
    out = args.out or (Path(args.paths[0]) / "report" if len(args.paths) == 1
                       else Path("outputs/report") / time.strftime("%Y-%m-%d") / time.strftime("%H-%M-%S"))
    try:
        written = report(args.paths, out)
    except ReportInputError as err:
        parser.error(str(err))
    print((out / "report.md").read_text())
    print("wrote " + ", ".join(str(p) for p in written.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
