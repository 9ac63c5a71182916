"""The notebooks run top to bottom (nbclient, the parameter cell set to small settings) and are committed without
outputs."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# the settings a test run uses: a few dozen training steps, a few images per digit
SMALL = {"01_quickstart": {"TRAIN_STEPS": 30, "BATCH_SIZE": 32, "NUM_PER_CLASS": 5}}


def test_committed_notebooks_hold_no_outputs():
    assert NOTEBOOKS, "notebooks/ holds no notebook"
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                assert cell.get("outputs") == [] and cell.get("execution_count") is None, \
                    f"{path.name} is committed with outputs; clear them (Jupyter: Clear All Outputs) before committing"


def _with_parameters(nb, values: dict, out: Path):
    """The notebook with its cell tagged ``parameters`` assigning ``values`` and ``OUT`` (papermill's convention)."""
    cells = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(cells) == 1, "a notebook needs exactly one cell tagged 'parameters'"
    source = cells[0].source
    for name, value in {**values, "OUT": str(out)}.items():
        source, n = re.subn(rf"^{name} = .*$", f"{name} = {value!r}", source, flags=re.M)
        assert n == 1, f"the parameter cell assigns no {name}"
    cells[0].source = source
    return nb


# the executions run in CI as their own step (`make notebooks`, .ci/run), outside the 15-minute default suite
@pytest.mark.notebooks
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path, tmp_path):
    import nbformat
    from nbclient import NotebookClient

    nb = _with_parameters(nbformat.read(path, as_version=4), SMALL.get(path.stem, {}), tmp_path / "out")
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 3  # the teacher's grid, the side-by-side grid, the Pareto plot
    if path.stem == "01_quickstart":
        tables = [o["data"]["text/markdown"] for c in nb.cells if c.cell_type == "code" for o in c.outputs
                  if "text/markdown" in o.get("data", {})]
        assert any("student (LCM)" in t and "teacher (DDIM)" in t for t in tables)
        assert (tmp_path / "out" / "lcm" / "export" / "model_index.json").is_file()
        assert (tmp_path / "out" / "pareto.png").is_file()
