"""``python -m distill.report``: runs found in a multirun, a single run and a distill.evaluate output; each labelled
by the overrides that distinguish it; its final evaluation kept; the table, CSV, Pareto front and dashboard checked
against hand-made numbers; bad input refused with exit 2 before anything is written."""

from __future__ import annotations

import csv
import json
import math
import os
import sys
from pathlib import Path

import pytest
import yaml

from distill import report
from distill.metrics.report import columns, replicate_columns, write_csv

PNG = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010806000000"
                    "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082")

# (latency_s, fid) of each final student point by steps; the earlier evaluation (step 10) is better than all of
# them, so that it would take the whole front if it were (wrongly) read as final.
MULTIRUN = {  # job: (overrides, points)
    "0": (["+exp=consistency", "method.num_ddim_timesteps=25", "student=copy"],
          {1: (0.010, 30.0), 2: (0.020, 12.0), 4: (0.040, 8.0)}),
    "1": (["+exp=consistency", "method.num_ddim_timesteps=50"],  # student: the group default (copy)
          {1: (0.012, 25.0), 2: (0.020, 10.0), 4: (0.040, 9.0)}),
    "2": (["+exp=consistency", "method.num_ddim_timesteps=25", "student=lora"],
          {1: (0.008, 40.0), 2: (0.030, 11.0), 4: (0.050, 6.0)}),
}
LABELS = {"0": "method.num_ddim_timesteps=25,student=copy", "1": "method.num_ddim_timesteps=50,student=copy",
          "2": "method.num_ddim_timesteps=25,student=lora"}
TEACHER = {50: (0.5, 4.0), 4: (0.045, 8.5)}  # ddim; the same in every job
EVALUATED = {8: (0.1, 5.0), 2: (0.025, 10.0)}  # a distill.evaluate output of "mymodel" with dpmsolver
# the front of FID against latency over all of these, as (run, model, steps)
FRONT = {(LABELS["2"], "student", 1), (LABELS["0"], "student", 1), (LABELS["1"], "student", 1),
         (LABELS["1"], "student", 2), (LABELS["0"], "student", 4), (LABELS["2"], "student", 4),
         ("eval_mymodel", "mymodel", 8), ("teacher", "teacher", 50)}


def _row(model: str, scheduler: str, steps: int, latency: float, fid: float, **extra) -> dict:
    """A row as the quality-cost evaluator makes it (every column but the extra feature spaces)."""
    return {"model": model, "scheduler": scheduler, "accelerate": "none", "steps": steps, "guidance_scale": 3.0,
            "nfe": float(steps), "fid": fid, "fid_std": round(fid / 30, 6), "kid": 0.5, "kid_std": 0.1,
            "clip_score": 86.25, "clip_score_std": 0.05, "prompt_accuracy": 1.0, "prompt_accuracy_std": 0.0,
            "latency_s": latency, "images_per_s": 1 / latency, "peak_memory_mb": 1200.25, "gflops_per_image": 0.2,
            "params_m": 1.49, "active_params_m": 1.49, **extra}


def _training_run(run: Path, overrides: list[str], points: dict, student: str) -> None:
    """A training run's folder as distill.train leaves it: quality_cost.csv as the callback appends it (teacher
    rows with the first evaluation), config.yaml, .hydra/{config,hydra,overrides}.yaml, samples/."""
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (run / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump(
        {"hydra": {"runtime": {"choices": {"exp": "consistency", "student": student, "method": "consistency"}}}}))
    steps = next(o for o in overrides if o.startswith("method.num_ddim_timesteps=")).split("=")[1]
    config = {"seed": 0, "method": {"num_ddim_timesteps": int(steps), "lr": 1e-4},
              "student": {"_target_": f"distill.students.copies.{student}_student"},
              "trainer": {"max_steps": 20, "default_root_dir": str(run)}}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    jitter = int(run.name) * 1e-4  # each job times the teacher anew: the same quality, another latency
    teacher = [_row("teacher", "ddim", n, TEACHER[n][0] + jitter, TEACHER[n][1], step=10) for n in (4, 50)]
    early = [_row("student", "ddim", n, 0.001, 1.0, step=10) for n in points]
    final = [_row("student", "ddim", n, *points[n], step=20) for n in points]
    write_csv(teacher + early, run / "quality_cost.csv", append=True)
    write_csv(final, run / "quality_cost.csv", append=True)
    (run / "samples").mkdir()
    for name in ["final.png", "teacher-ddim-4.png", "teacher-ddim-50.png"] + [
            f"student-ddim-{n}_step_{s:07d}.png" for n in points for s in (10, 20)]:
        (run / "samples" / name).write_bytes(PNG)


def make_runs(tmp_path: Path) -> dict[str, Path]:
    """A Hydra multirun (three jobs and one that failed before any evaluation) and a distill.evaluate output under
    ``tmp_path``; ``out``: where the report goes."""
    multirun = tmp_path / "multirun"
    for job, (overrides, points) in MULTIRUN.items():
        student = next((o.split("=")[1] for o in overrides if o.startswith("student=")), "copy")
        _training_run(multirun / job, overrides, points, student)
    (multirun / "3" / ".hydra").mkdir(parents=True)  # failed: no quality_cost.csv
    (multirun / "3" / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["method.num_ddim_timesteps=75"]))
    (multirun / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {"mode": "MULTIRUN"}}))
    evaluated = tmp_path / "eval_mymodel"
    (evaluated / "grids").mkdir(parents=True)
    write_csv([_row("mymodel", "dpmsolver", n, *EVALUATED[n]) for n in EVALUATED], evaluated / "quality_cost.csv")
    for n in EVALUATED:
        (evaluated / "grids" / f"mymodel-dpmsolver-{n}.png").write_bytes(PNG)
    (evaluated / "protocol.json").write_text(json.dumps({"pipeline": "some/model", "num_per_class": 50, "seed": 0}))
    return {"multirun": multirun, "eval": evaluated, "out": tmp_path / "report"}


@pytest.fixture
def runs(tmp_path) -> dict[str, Path]:
    return make_runs(tmp_path)


def _read(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_table_labels_final_rows_and_front(runs, capsys):
    """The CLI on a multirun folder and an evaluate folder: one label per run from its distinguishing overrides
    (a job that left a key at its default is named by its Hydra choice; the shared ``+exp`` is no distinction),
    the final evaluation's rows only, the teacher once, every number exact in the CSV, the front as worked out."""
    assert report.main([str(runs["multirun"]), str(runs["eval"]), "--out", str(runs["out"])]) == 0
    assert "multirun/3: a Hydra job without quality_cost.csv" in capsys.readouterr().err.replace(os.sep, "/")
    out = runs["out"]
    assert sorted(p.name for p in out.iterdir()) == ["dashboard.html", "pareto.png", "report.csv", "report.md"]

    rows = _read(out / "report.csv")
    header = list(rows[0])
    assert header == ["run", "method.num_ddim_timesteps", "student", "pareto", "dir"] + columns() + replicate_columns()
    got = {(r["run"], r["model"], int(r["steps"])): r for r in rows}
    expected = {(LABELS[job], "student", n): p for job, (_, points) in MULTIRUN.items() for n, p in points.items()}
    expected |= {("teacher", "teacher", n): p for n, p in TEACHER.items()}
    expected |= {("eval_mymodel", "mymodel", n): p for n, p in EVALUATED.items()}
    assert set(got) == set(expected)  # no step-10 student row, the teacher once, every point of every run
    for key, (latency, fid) in expected.items():
        r = got[key]
        assert (float(r["latency_s"]), float(r["fid"]), float(r["fid_std"])) == (latency, fid, round(fid / 30, 6))
    assert {k for k, r in got.items() if r["pareto"] == "1"} == FRONT
    for job in MULTIRUN:
        r = got[(LABELS[job], "student", 1)]
        assert (r["method.num_ddim_timesteps"], r["student"]) == tuple(x.split("=")[1] for x in LABELS[job].split(","))
        assert Path(r["dir"]) == runs["multirun"] / job and r["step"] == "20"
    assert got[("eval_mymodel", "mymodel", 8)]["student"] == "(default)"  # no Hydra record: nothing to compare

    # read_rows parses the report back to the numbers the callback wrote
    parsed = report.read_rows(out / "report.csv")
    assert [(r["run"], r["fid"], r["latency_s"], r["steps"], r["nfe"]) for r in parsed] == [
        (r["run"], float(r["fid"]), float(r["latency_s"]), int(r["steps"]), float(r["nfe"])) for r in rows]
    assert all(isinstance(r["steps"], int) and isinstance(r["model"], str) for r in parsed)

    md = (out / "report.md").read_text()
    assert "| run | method.num_ddim_timesteps | student | pareto | model | scheduler | accelerate | steps |" in md
    assert (f"| {LABELS['1']} | 50 | copy | ✓ | student | ddim | none | 2 | 3 | 2 | 10.00 ± 0.33 | 0.50 ± 0.10 | "
            "86.250 ± 0.050 | 1 ± 0 | 0.02 | 50 | 1200 | 0.2 | 1.49 | 1.49 | 20 |") in md
    assert f"| {LABELS['0']} | 25 | copy |  | student | ddim | none | 2 |" in md  # dominated by job 1's
    for i, job in enumerate(MULTIRUN, 1):
        assert f"{i}. `{LABELS[job]}`: {runs['multirun'] / job}" in md
    assert f"4. `eval_mymodel`: {runs['eval']}" in md
    page = (out / "dashboard.html").read_text()
    for label in [*LABELS.values(), "eval_mymodel", "teacher"]:
        assert f"<td>{label}</td>" in page


def test_grid_links_resolve_from_the_output_folder(runs):
    """Every sample-grid link of the dashboard's runs table points (relative, from the output folder) at the final
    evaluation's grid of its run, or the run's final.png."""
    import re
    from urllib.parse import unquote

    report.main([str(runs["multirun"]), str(runs["eval"]), "--out", str(runs["out"])])
    page = (runs["out"] / "dashboard.html").read_text()
    table = page[page.index('<table id="runs">'):]
    links = [unquote(h) for h in re.findall(r'href="([^"]+\.png)"', table)]
    targets = {(runs["out"] / link).resolve() for link in links}
    assert all(not Path(link).is_absolute() for link in links)
    assert all(t.is_file() for t in targets), links
    names = {t.relative_to(runs["out"].parent).as_posix() for t in targets}
    assert "multirun/2/samples/student-ddim-4_step_0000020.png" in names
    assert "multirun/2/samples/student-ddim-4_step_0000010.png" not in names
    assert {"multirun/0/samples/teacher-ddim-50.png", "multirun/0/samples/final.png",
            "eval_mymodel/grids/mymodel-dpmsolver-8.png"} <= names


def test_single_run_and_old_header(tmp_path):
    """One run directory with an older CSV header (no ``accelerate`` column), student and teacher rows of
    different steps: both kept, the label is the folder, the default output folder is <run>/report."""
    run = tmp_path / "lcm_run"
    run.mkdir()
    header = [c for c in columns() if c != "accelerate"]
    rows = [_row("teacher", "ddim", 4, 0.03, 7.0, step=500), _row("student", "lcm", 1, 0.02, 3.0, step=500),
            _row("student", "lcm", 1, 0.018, 2.5, step=1000)]
    with open(run / "quality_cost.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    assert report.main([str(run)]) == 0
    got = _read(run / "report" / "report.csv")
    assert [(r["run"], r["model"], r["step"], r["accelerate"], r["pareto"]) for r in got] == [
        ("lcm_run", "teacher", "500", "", "0"), ("lcm_run", "student", "1000", "", "1")]
    assert (run / "report" / "pareto.png").stat().st_size > 10_000


def test_pareto_set_on_a_hand_made_example():
    """The front ``gather`` marks: rows not dominated on (latency, FID) across runs, ties on one axis broken by the
    other; rows without a latency are left off."""
    def run(label, points):
        r = report.Run(Path(label), [_row("student", "ddim", i, *p) for i, p in enumerate(points)], [])
        r.label = label
        return r

    a = run("a", [(1.0, 10.0), (2.0, 5.0), (4.0, 5.0)])  # (4, 5): as good as (2, 5) on FID, slower
    b = run("b", [(1.0, 11.0), (3.0, 4.0), (5.0, 1.0)])  # (1, 11): as fast as (1, 10), worse
    c = run("c", [(0.5, 50.0)])
    c.rows.append({k: v for k, v in _row("student", "ddim", 9, 0.1, 0.1).items() if k != "latency_s"})
    rows, lead = report.gather([a, b, c])
    assert lead == ["run"]
    assert sorted((r["run"], r["latency_s"], r["fid"]) for r in rows if r["pareto"]) == [
        ("a", 1.0, 10.0), ("a", 2.0, 5.0), ("b", 3.0, 4.0), ("b", 5.0, 1.0), ("c", 0.5, 50.0)]


def test_teacher_once_only_when_its_quality_is_the_same():
    """The callback's teacher rows of equal quality (latency aside) are one run ``teacher`` with the first run's
    cost; a teacher measured otherwise in one run stays with each run, and so do distill.evaluate's teacher rows
    (no step: the teacher is what that run measured)."""
    def runs(teacher_fid_b, **step):
        a = report.Run(Path("a"), [_row("teacher", "ddim", 4, 0.04, 7.0, **step),
                                   _row("student", "lcm", 1, 0.01, 3.0, **step)], [])
        b = report.Run(Path("b"), [_row("teacher", "ddim", 4, 0.05, teacher_fid_b, **step),
                                   _row("student", "lcm", 1, 0.02, 2.0, **step)], [])
        a.label, b.label = "a", "b"
        return [a, b]

    rows, _ = report.gather(runs(7.0, step=10))
    assert [(r["run"], r["model"], r["latency_s"], r["_shared"]) for r in rows] == [
        ("teacher", "teacher", 0.04, True), ("a", "student", 0.01, False), ("b", "student", 0.02, False)]
    for separate in (runs(7.5, step=10), runs(7.0)):
        rows, _ = report.gather(separate)
        assert [(r["run"], r["model"], r["_shared"]) for r in rows] == [
            ("a", "teacher", False), ("a", "student", False), ("b", "teacher", False), ("b", "student", False)]


@pytest.mark.parametrize("make, message", [
    (lambda tmp: [], "the following arguments are required: paths"),
    (lambda tmp: [str(tmp / "missing")], "missing: no such directory"),
    (lambda tmp: [str((tmp / "empty").mkdir() or tmp / "empty")], "empty: no quality_cost.csv in it or below it"),
])
def test_bad_input_exits_2_naming_the_path(tmp_path, capsys, make, message):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        report.main([*make(tmp_path), "--out", str(out)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_empty_csv_exits_2(tmp_path, runs, capsys):
    """A run whose CSV has a header and no rows (a run killed between writes) is refused, naming the file."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "quality_cost.csv").write_text(",".join(columns()) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        report.main([str(runs["multirun"]), str(bad), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert f"{bad / 'quality_cost.csv'}: no rows" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:'distill.report' found in sys.modules:RuntimeWarning")  # imported above
def test_module_entry_point(runs, monkeypatch, capsys):
    """``python -m distill.report`` (run in-process, as ``-m`` runs it): exit 0, the table on stdout."""
    import runpy

    monkeypatch.setattr(sys, "argv", ["distill.report", str(runs["eval"]), "--out", str(runs["out"])])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("distill.report", run_name="__main__", alter_sys=True)
    assert exit_info.value.code == 0
    assert "| eval_mymodel |" in capsys.readouterr().out and (runs["out"] / "dashboard.html").is_file()
    assert math.isclose(float(_read(runs["out"] / "report.csv")[0]["fid"]), EVALUATED[8][1])


def test_legend_names_are_short_and_keep_what_tells_runs_apart():
    """The plot legend names a run by its distinguishing overrides with the last key component and floats to 4
    significant digits (an Optuna learning rate has 16); the full keys stay where two keys end alike; the tables keep
    the whole label."""
    def run(folder, overrides):
        r = report.Run(Path(folder), [_row("student", "lcm", 4, 1.0, 1e-2)], overrides)
        return r

    a = run("0", ["method.num_ddim_timesteps=50", "method.optimizer.lr=0.0003506575410186655"])
    b = run("1", ["method.num_ddim_timesteps=25", "method.optimizer.lr=1e-4"])
    report.label_runs([a, b])
    assert a.label == "method.num_ddim_timesteps=50,method.optimizer.lr=0.0003506575410186655"
    assert (a.short, b.short) == ("num_ddim_timesteps=50,lr=0.0003507", "num_ddim_timesteps=25,lr=0.0001")
    rows, _ = report.gather([a, b])
    assert {report._series(rows)(r) for r in rows} == {"[1] num_ddim_timesteps=50,lr=0.0003507",
                                                        "[2] num_ddim_timesteps=25,lr=0.0001"}
    c, d = run("c", ["student.lr=1", "method.lr=2"]), run("d", ["student.lr=3", "method.lr=4"])
    report.label_runs([c, d])
    assert c.short == "student.lr=1,method.lr=2"
