"""Hyperparameter search (issue 18): the distill_optuna Hydra sweeper (single and multi-objective, resumable
through SQLite, failed trials), and ``distill.train``'s objectives.

The sweeper is exercised on a toy Hydra app (a known objective, so the Pareto set and the best trial can be
checked exactly against every trial the study holds); ``distill.train`` returning its objectives to a sweep is
checked on the debug experiment.
"""

import subprocess
import sys
import textwrap

import pytest
import yaml

from tests.conftest import ROOT

APP = textwrap.dedent('''
    import hydra

    @hydra.main(version_base="1.3", config_path=".", config_name="config")
    def main(cfg):
        if cfg.fail and cfg.y == "b":
            raise RuntimeError("this trial fails")
        if cfg.two:
            return [cfg.x ** 2, (cfg.x - 2) ** 2 + (0.5 if cfg.y == "b" else 0.0)]
        return (cfg.x - 1.5) ** 2 + (1.0 if cfg.y == "b" else 0.0)

    if __name__ == "__main__":
        main()
''')


@pytest.fixture
def app(tmp_path):
    (tmp_path / "app.py").write_text(APP)
    (tmp_path / "config.yaml").write_text("x: 0.0\ny: a\nfail: false\ntwo: false\n")
    return tmp_path


def sweep(app, *overrides: str, storage: str | None = None, name: str = "sweep"):
    args = [sys.executable, "app.py", "-m", "hydra/sweeper=distill_optuna", f"hydra.sweep.dir={name}",
            "x=interval(-4.0,4.0)", "y=choice(a,b)",
            *([f"hydra.sweeper.storage=sqlite:///{app / storage}"] if storage else []), *overrides]
    result = subprocess.run(args, cwd=app, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return yaml.safe_load((app / name / "optimization_results.yaml").read_text())


def trials(app, storage: str, study: str = "distill"):
    import optuna

    return optuna.load_study(study_name=study, storage=f"sqlite:///{app / storage}").get_trials()


def test_single_objective_reports_the_best_of_its_trials(app):
    out = sweep(app, "hydra.sweeper.n_trials=6", storage="s.db")
    done = [t for t in trials(app, "s.db") if t.state.name == "COMPLETE"]
    assert len(done) == 6 and out["n_trials"] == 6
    best = min(done, key=lambda t: t.value)
    assert out["best_value"] == pytest.approx(best.value) and out["best_params"] == best.params
    for t in done:  # each value is the toy objective of the parameters the trial ran with
        assert t.value == pytest.approx((t.params["x"] - 1.5) ** 2 + (1.0 if t.params["y"] == "b" else 0.0))
    assert len(list((app / "sweep").glob("[0-9]*"))) == 6  # one job directory per trial


def test_an_interrupted_search_continues_from_its_storage(app):
    import optuna

    sweep(app, "hydra.sweeper.n_trials=3", storage="r.db", name="first")
    study = optuna.load_study(study_name="distill", storage=f"sqlite:///{app / 'r.db'}")
    study.ask()  # a trial left running, as by a killed sweep
    sweep(app, "hydra.sweeper.n_trials=5", storage="r.db", name="second")
    states = [t.state.name for t in trials(app, "r.db")]
    assert states.count("COMPLETE") == 5 and states.count("FAIL") == 1 and "RUNNING" not in states
    assert len(list((app / "second").glob("[0-9]*"))) == 2  # only the missing trials ran


def test_multi_objective_search_returns_the_pareto_set(app):
    out = sweep(app, "two=true", "hydra.sweeper.n_trials=8", "hydra.sweeper.sampler=nsga2",
                "hydra.sweeper.directions=[minimize,minimize]", storage="m.db")
    done = [t for t in trials(app, "m.db") if t.state.name == "COMPLETE"]

    def dominated(a, b):  # b dominates a
        return all(y <= x for x, y in zip(a, b)) and any(y < x for x, y in zip(a, b))

    expected = {t.number for t in done if not any(dominated(t.values, o.values) for o in done)}
    assert {p["trial"] for p in out["pareto"]} == expected and expected


def test_a_failing_trial_fails_alone_and_grid_search_covers_the_grid(app):
    sweep(app, "fail=true", "hydra.sweeper.n_trials=5", "hydra.sweeper.sampler=grid", "x=choice(0.0,1.0,2.0)",
          storage="f.db")
    everything = trials(app, "f.db")
    assert all(t.params["y"] == "b" for t in everything if t.state.name == "FAIL")
    assert len(everything) == 6  # the whole grid ran, then the sweep stopped (5 completed trials cannot be had)
    assert sum(t.state.name == "COMPLETE" for t in everything) == 3  # the grid has 3 points with y=a
    assert {t.params["x"] for t in everything if t.state.name == "COMPLETE"} == {0.0, 1.0, 2.0}


def test_bad_sweeper_settings_name_the_value(app):
    result = subprocess.run([sys.executable, "app.py", "-m", "hydra/sweeper=distill_optuna", "hydra.sweep.dir=bad",
                             "hydra.sweeper.directions=[fastest]", "x=interval(0.0,1.0)"],
                            cwd=app, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "directions=['fastest']" in result.stderr


def _write_quality_cost(run_dir, rows):
    from distill.metrics.report import write_csv

    write_csv(rows, run_dir / "quality_cost.csv")


def test_objectives_read_the_students_last_evaluation_at_its_steps(tmp_path, compose):
    from distill.train import objective

    cfg = compose("+exp=consistency", "objectives=[fid,latency_s]")
    row = {"model": "student", "scheduler": "lcm", "guidance_scale": 3.0, "nfe": 4}
    _write_quality_cost(tmp_path, [
        {**row, "steps": 4, "fid": 9.0, "latency_s": 0.5, "step": 500},
        {**row, "steps": 4, "fid": 3.0, "latency_s": 0.25, "step": 1000},
        {**row, "steps": 1, "fid": 7.0, "latency_s": 0.1, "step": 1000},
        {**row, "model": "teacher", "scheduler": "ddim", "steps": 4, "fid": 1.0, "latency_s": 0.2, "step": 1000},
    ])
    assert objective(cfg, tmp_path, {}) == [3.0, 0.25]
    cfg.objective_steps, cfg.objectives = 1, ["fid"]
    assert objective(cfg, tmp_path, {}) == 7.0
    cfg.objectives = ["train/loss"]
    assert objective(cfg, tmp_path, {"train/loss": 0.125}) == 0.125
    cfg.objective_steps, cfg.objectives = 8, ["fid"]
    with pytest.raises(ValueError, match="no student row at 8 steps"):
        objective(cfg, tmp_path, {})


@pytest.mark.parametrize("overrides, message", [
    (["+exp=debug", "objectives=[fid]"], "measured by the quality_cost callback"),
    (["+exp=consistency", "objectives=[speed]"], "'speed' is neither a quality-cost column"),
    (["+exp=consistency", "objectives=[fid]", "objective_steps=8"], "does not measure that count"),
])
def test_bad_objectives_are_refused_before_training(overrides, message, compose):
    """``check_objectives`` runs with the config validation (exit 2 naming the value, before any compute)."""
    from distill.config.validate import ConfigError
    from distill.train import check_objectives

    with pytest.raises(ConfigError, match=message.replace("(", "\\(")):
        check_objectives(compose(*overrides))


@pytest.mark.slow  # about 20 s of training: in `make test-all`
def test_a_training_sweep_optimises_what_distill_train_returns(tmp_path):
    """Two trials of the debug training under the Optuna sweeper: each returns its logged loss, and the study
    records exactly those values."""
    db = tmp_path / "train.db"
    result = subprocess.run(
        [sys.executable, "-m", "distill.train", "-m", "+exp=debug", "hydra/sweeper=distill_optuna",
         "objectives=[train/loss]", "hydra.sweeper.n_trials=2", "hydra.sweeper.sampler=grid",
         "seed=choice(0,1)", f"hydra.sweeper.storage=sqlite:///{db}",
         f"hydra.sweep.dir={tmp_path / 'sweep'}", "trainer.max_steps=2", "export=false"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    import optuna

    done = optuna.load_study(study_name="distill", storage=f"sqlite:///{db}").get_trials()
    assert sorted(t.params["seed"] for t in done) == [0, 1] and all(t.state.name == "COMPLETE" for t in done)
    for t in done:  # the value is the last train/loss the job logged
        job = next(d for d in (tmp_path / "sweep").iterdir() if d.is_dir() and
                   f"seed={t.params['seed']}" in (d / ".hydra" / "overrides.yaml").read_text())
        import csv

        losses = [float(r["train/loss"]) for r in csv.DictReader(open(next(job.rglob("metrics.csv"))))
                  if r.get("train/loss")]
        assert t.value == pytest.approx(losses[-1], rel=1e-5)
