"""The notebooks run top to bottom (nbclient, their parameter cell set to their small settings), write what they
declare, show their figure (docs/notebooks.md), and are committed without outputs."""

import importlib.util
import json
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
_spec = importlib.util.spec_from_file_location("notebook_run", ROOT / "notebooks" / "run.py")
run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run)


def test_committed_notebooks_hold_no_outputs():
    assert NOTEBOOKS, "notebooks/ holds no notebook"
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                assert cell.get("outputs") == [] and cell.get("execution_count") is None, \
                    f"{path.name} is committed with outputs; clear them (Jupyter: Clear All Outputs) before committing"


def test_notebooks_declare_parameters_small_settings_and_a_figure():
    import nbformat

    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        tags = [t for c in nb.cells for t in c.metadata.get("tags", [])]
        assert tags.count("parameters") == 1 and tags.count("figure") == 1, path.name
        meta = nb.metadata.get("distill", {})
        assert meta.get("small") and meta.get("expect"), f"{path.name}: metadata.distill.small/expect missing"
        run.with_parameters(nb, {**meta["small"], "OUT": "x"})  # every small setting is a parameter


def test_parameters_are_replaced_and_unknown_names_refused():
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("STEPS = 300\nOUT = 'a'\n",
                                                                    metadata={"tags": ["parameters"]})])
    assert run.with_parameters(nb, {"STEPS": 3, "OUT": "b"}).cells[0].source == "STEPS = 3\nOUT = 'b'\n"
    with pytest.raises(ValueError, match="assigns no NOPE"):
        run.with_parameters(nb, {"NOPE": 1})


# the executions run in CI as their own step (`make notebooks`, .ci/run), outside the 15-minute default suite
@pytest.mark.notebooks
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path, tmp_path):
    out = tmp_path / "out"
    start = time.perf_counter()
    nb = run.execute(path, out, small=True, timeout=600)  # a cell over 10 minutes fails there
    elapsed = time.perf_counter() - start
    # the whole notebook: its small settings should run in a few minutes (1.5-4.5 min measured on 2 busy cores)
    assert elapsed < 900, f"{path.name} took {elapsed:.0f} s with its small settings; make them smaller"
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    assert run.figure(nb).startswith(b"\x89PNG")
    missing = [f for f in nb.metadata["distill"]["expect"] if not (out / f).exists()]
    assert not missing, f"{path.name} did not write {missing}"
    if path.stem == "01_quickstart":
        tables = [o["data"]["text/markdown"] for c in nb.cells if c.cell_type == "code" for o in c.outputs
                  if "text/markdown" in o.get("data", {})]
        assert any("student (LCM)" in t and "teacher (DDIM)" in t for t in tables)


def test_output_folder_refuses_results_of_other_settings(tmp_path):
    from distill import api

    out = tmp_path / "nb"
    assert api.output_folder(out, {"TRAIN_STEPS": 300, "STEPS": (4, 8)}) == out
    assert api.output_folder(out, {"TRAIN_STEPS": 300, "STEPS": [4, 8]}) == out  # the same settings: reused
    with pytest.raises(ValueError, match=r"TRAIN_STEPS: 300 there, 30 now.*delete it"):
        api.output_folder(out, {"TRAIN_STEPS": 30, "STEPS": [4, 8]})
    with pytest.raises(ValueError, match="STEPS"):
        api.output_folder(out, {"TRAIN_STEPS": 300})
    api.output_folder(tmp_path / "s", {"TRIALS": 3, "BATCH": 16}, may_grow=["TRIALS"])
    api.output_folder(tmp_path / "s", {"TRIALS": 6, "BATCH": 16}, may_grow=["TRIALS"])  # more trials continue
    with pytest.raises(ValueError, match="TRIALS: 6 there, 2 now"):
        api.output_folder(tmp_path / "s", {"TRIALS": 2, "BATCH": 16}, may_grow=["TRIALS"])
