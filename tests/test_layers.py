"""The import layers of the package, written down in one place, and a test that the code keeps them.

``LAYERS`` lists distill's modules from the top (the commands) to the bottom (plain helpers). A module may
import modules of its own layer and of the layers below it, never one above, and no chain of imports may come
back to where it started. Every import counts: at module level and inside functions (a lazy import is still a
dependency; it only hides a circle until the day both ends are imported first). A module named by a string
(a Hydra ``_target_``, the schema's ``builds("...", "distill.x.f")``) is not an import: the config names what
it builds that way, at any layer.

Where the order differs from the one sketched in issue 32, it follows what the packages hold today:
- ``config`` sits right below the commands, not at the bottom: only commands read the config, and the schema
  and checks still take their choice lists and model checks from the modules that define them (diffusion,
  models, inference, worlds) until those register themselves.
- ``worlds`` (``distill.worlds``: each embedded world's data, evaluation presets, shipped networks and the trainers
  that build them) sits above ``methods``, not at the bottom: a world's asset trainers are methods, and its data
  module, CLIP builder and students build on ``data``, ``models`` and the registries. Nothing generic imports a
  world: the config reaches it through ``_target_`` strings and ``${distill.asset:NAME}`` (the resolver and the
  schema in ``config``, above it, ask ``distill.worlds``), and the registries import the modules it lists by name.
- ``students`` (every student builder) sits above ``families``, ``compress``, ``accelerate`` and ``inference``:
  its builders make students of the networks those layers and ``models`` define (``student=pretrained`` loads
  any class distill exports), and only the methods and the config call them.
- ``metrics.cost``, ``metrics.quality_cost``, ``metrics.report`` and ``metrics.sanity`` are the evaluation
  layer (the quality-cost sweep, its cost meter, its tables and plots, and the metric checks drawn with them);
  the metrics themselves (FID, KID, CLIP score, their registry) sit with ``models``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import distill

PACKAGE = Path(distill.__file__).parent

LAYERS: tuple[tuple[str, ...], ...] = (
    # commands: the only code that reads cfg
    ("distill", "distill.train", "distill.evaluate", "distill.sample", "distill.fit_forecaster", "distill.api",
     "distill.report", "distill.serve"),
    ("distill.config",),
    ("distill.callbacks",),
    ("distill.worlds",),
    ("distill.methods",),
    # evaluation: the quality-cost sweep, its cost meter and its report
    ("distill.metrics.quality_cost", "distill.metrics.cost", "distill.metrics.report", "distill.metrics.sanity"),
    # every student builder: it makes students of the networks of the layers below
    ("distill.students",),
    ("distill.families", "distill.compress", "distill.accelerate", "distill.inference"),
    ("distill.models", "distill.diffusion", "distill.metrics"),
    ("distill.data", "distill.utils"),
)


def module_names() -> dict[str, Path]:
    """Dotted name -> file of every module of the package (a package's name for its ``__init__.py``)."""
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ("distill", *path.relative_to(PACKAGE).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def layer_of(module: str) -> int:
    """Index in ``LAYERS`` of the longest entry that is ``module`` or a package above it."""
    best, depth = None, -1
    for index, layer in enumerate(LAYERS):
        for entry in layer:
            if (module == entry or module.startswith(entry + ".")) and entry.count(".") > depth:
                best, depth = index, entry.count(".")
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it (or its package) to LAYERS in {__file__}")
    return best


def imports(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {imported distill module: first line}, from every import statement anywhere in the file; a name
    imported from a package counts as its submodule when it is one."""

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges = graph.setdefault(module, {})
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                    base = f"{parent}.{base}" if base else parent
                targets = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                found = known(target) if target.startswith("distill") else None
                if found is not None and found != module:
                    edges.setdefault(found, node.lineno)
    return graph


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    return [f"{module}:{line} imports {target} (layer {layer_of(target)} is above {module}'s {layer_of(module)})"
            for module, edges in sorted(graph.items()) for target, line in sorted(edges.items())
            if layer_of(target) < layer_of(module)]


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One circle through each strongly connected group of modules (Tarjan), each listed from its first module
    back to it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_circle(graph, group) for group in groups]


def _circle(graph: dict[str, dict[str, int]], group: list[str]) -> list[str]:
    """The shortest path inside ``group`` from its first module back to itself (breadth first)."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node]):
                if target == start:
                    return paths[node] + [start]
                if target in members and target not in paths:
                    paths[target] = paths[node] + [target]
                    following.append(target)
        frontier = following
    raise AssertionError(f"no circle in {group}")


def test_every_module_has_a_layer():
    for module in module_names():
        layer_of(module)


def test_no_import_runs_against_the_layers():
    upward = upward_imports(imports(module_names()))
    assert not upward, "imports against LAYERS (top first):\n" + "\n".join(upward)


def test_no_import_circle():
    circles = import_cycles(imports(module_names()))
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(circle) for circle in circles)


def test_the_checker_sees_lazy_upward_imports_and_circles(tmp_path):
    """The checks themselves: a function-level import against the order and a circle through one are found."""
    graph = {"distill.models.a": {"distill.inference.b": 3}, "distill.inference.b": {"distill.models.a": 1}}
    above, below = layer_of("distill.inference.b"), layer_of("distill.models.a")
    assert above < below
    assert upward_imports(graph) == [f"distill.models.a:3 imports distill.inference.b (layer {above} is above "
                                     f"distill.models.a's {below})"]
    assert import_cycles(graph) == [["distill.inference.b", "distill.models.a", "distill.inference.b"]]
    source = tmp_path / "distill"
    (source / "models").mkdir(parents=True)
    (source / "models" / "a.py").write_text("def f():\n    from ..inference import b\n")
    (source / "inference").mkdir()
    (source / "inference" / "__init__.py").write_text("")
    (source / "inference" / "b.py").write_text("import distill.models.a\n")
    found = imports({"distill.models.a": source / "models" / "a.py",
                     "distill.inference.b": source / "inference" / "b.py",
                     "distill.inference": source / "inference" / "__init__.py"})
    assert found == {"distill.models.a": {"distill.inference.b": 2}, "distill.inference.b": {"distill.models.a": 1},
                     "distill.inference": {}}
