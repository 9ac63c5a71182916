"""Run a notebook top to bottom with its parameters set (papermill's convention, on nbclient), and take its
figure. Used by the tests (small settings) and to make the pictures of docs/notebooks.md (full settings):

    python notebooks/run.py notebooks/02_quality_cost.ipynb --small --out-root /tmp/nb --figure-dir /tmp/nb/figures
    python notebooks/run.py notebooks/*.ipynb --figure-dir docs/notebooks      # every notebook, its own settings
    python notebooks/run.py notebooks/02_quality_cost.ipynb --set TRAIN_STEPS=200 NUM_PER_CLASS=10

A notebook declares:
- one code cell tagged ``parameters`` whose lines ``NAME = value`` are replaced by the given values (``OUT``, the
  output folder, always among them);
- ``metadata.distill.small``: the settings a test run uses (a few dozen steps, a few images per class);
- ``metadata.distill.expect``: files (relative to ``OUT``) a successful run writes;
- one code cell tagged ``figure`` whose PNG output is the notebook's picture in docs/notebooks.md.
"""

from __future__ import annotations

import argparse
import ast
import base64
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def with_parameters(nb, values: dict):
    """``nb`` with its cell tagged ``parameters`` assigning ``values`` (each name must be assigned there once)."""
    cells = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    if len(cells) != 1:
        raise ValueError(f"a notebook needs exactly one cell tagged 'parameters', found {len(cells)}")
    source = cells[0].source
    for name, value in values.items():
        source, n = re.subn(rf"^{name} = .*$", lambda _, name=name, value=value: f"{name} = {value!r}", source,
                            flags=re.M)  # a function: the value's backslashes stay as they are
        if n != 1:
            raise ValueError(f"the parameter cell assigns no {name} (known: "
                             f"{re.findall(r'^([A-Z_][A-Z0-9_]*) = ', source, flags=re.M)})")
    cells[0].source = source
    return nb


def execute(path: Path, out: Path, small: bool = False, timeout: int | None = None, **values):
    """The executed notebook (``nbformat`` node): parameters ``small`` (its ``metadata.distill.small``) and
    ``values`` set, ``OUT=out``, run in the repository root; ``timeout``: seconds a cell may take (None: no limit).
    Raises nbclient's ``CellExecutionError`` on a failing cell, ``CellTimeoutError`` on a cell over time."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    params = dict(nb.metadata.get("distill", {}).get("small", {})) if small else {}
    nb = with_parameters(nb, {**params, **values, "OUT": str(out)})
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    return nb


def figure(nb) -> bytes:
    """The PNG the cell tagged ``figure`` displays (its last one)."""
    cells = [c for c in nb.cells if "figure" in c.metadata.get("tags", [])]
    if len(cells) != 1:
        raise ValueError(f"a notebook needs exactly one cell tagged 'figure', found {len(cells)}")
    pngs = [o["data"]["image/png"] for o in cells[0].outputs if "image/png" in o.get("data", {})]
    if not pngs:
        raise ValueError("the cell tagged 'figure' displayed no PNG")
    return base64.b64decode(pngs[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--small", action="store_true", help="the test settings (metadata.distill.small)")
    parser.add_argument("--set", nargs="+", default=[], metavar="NAME=VALUE",
                        help="parameters to set (Python literals), over the notebook's own or --small ones")
    parser.add_argument("--out-root", type=Path, default=ROOT / "outputs" / "notebooks",
                        help="each notebook's OUT is <out-root>/<name> (a trained student there is reused)")
    parser.add_argument("--timeout", type=int, default=None, help="seconds a cell may take (default: no limit; a "
                        "full-budget training cell takes tens of minutes on 2 CPU cores)")
    parser.add_argument("--figure-dir", type=Path, help="write each notebook's figure to <dir>/<name>.png")
    parser.add_argument("--executed-dir", type=Path, help="also write each executed notebook there")
    args = parser.parse_args(argv)
    for path in args.notebooks:
        if not path.is_file():
            print(f"error: no notebook {path}", file=sys.stderr)
            return 2
    values = {}
    for item in args.set:
        if item.startswith("OUT="):
            print("error: --set OUT=... is --out-root's job (each notebook's OUT is <out-root>/<name>)", file=sys.stderr)
            return 2
        name, sep, text = item.partition("=")
        try:
            values[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            sep = ""
        if not sep or not name.isidentifier():
            print(f"error: --set {item!r} is not NAME=<Python literal>, e.g. TRAIN_STEPS=200 or STEPS=[1,2]",
                  file=sys.stderr)
            return 2
    import nbformat

    for path in args.notebooks:
        start = time.perf_counter()
        try:
            nb = execute(path, (args.out_root / path.stem).resolve(), small=args.small, timeout=args.timeout,
                         **values)
        except ValueError as err:  # a parameter the notebook does not have
            print(f"error: {path.name}: {err}", file=sys.stderr)
            return 2
        print(f"{path.name}: ran in {time.perf_counter() - start:.0f} s")
        if args.figure_dir:
            args.figure_dir.mkdir(parents=True, exist_ok=True)
            target = args.figure_dir / f"{path.stem}.png"
            target.write_bytes(figure(nb))
            print(f"  figure -> {target}")
        if args.executed_dir:
            args.executed_dir.mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, args.executed_dir / path.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
