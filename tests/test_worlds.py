"""Generic code names no world: outside ``distill/worlds/`` (and the option files of ``distill/conf``, Hydra's
groups, which name the worlds they configure), no module of the package holds the word "digit" in a name, a
string, a docstring or a comment. The embedded default world is reached through the config and the registries."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

import distill

PACKAGE = Path(distill.__file__).parent
WORLDS = PACKAGE / "worlds"
WORD = "digit"

# (module relative to the package, the name or text that may stay) and why
ALLOWED: dict[tuple[str, str], str] = {
    ("report.py", "isdigit"): "str.isdigit, Python's own method (splitting numbers out of run names)",
    ("serve/app.py", "isdigit"): "str.isdigit, Python's own method (checking a Content-Length header)",
    ("utils/xla.py", "isdigit"): "str.isdigit, Python's own method (a device count given as text)",
    ("utils/checkpoint.py", "isdigit"): "str.isdigit, Python's own method (the step number in a file name)",
}


def words_in(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every name, attribute, argument, imported module, string and comment of ``path`` that
    holds ``WORD`` (case-insensitive)."""
    source = path.read_text()
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename=str(path))):
        texts: list[str] = []
        if isinstance(node, ast.Name):
            texts = [node.id]
        elif isinstance(node, ast.Attribute):
            texts = [node.attr]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            texts = [node.name]
        elif isinstance(node, ast.arg):
            texts = [node.arg]
        elif isinstance(node, ast.keyword) and node.arg:
            texts = [node.arg]
        elif isinstance(node, ast.alias):
            texts = [node.name, node.asname or ""]
        elif isinstance(node, ast.ImportFrom):
            texts = [node.module or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            texts = [node.value]
        for text in texts:
            at = text.lower().find(WORD)
            if at >= 0:  # a string's line: where the word is, inside a docstring of several lines
                found.append((getattr(node, "lineno", 0) + text.count("\n", 0, at), text))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT and WORD in token.string.lower():
            found.append((token.start[0], token.string))
    return sorted(found)


def excerpt(text: str) -> str:
    """The word with up to 30 characters of ``text`` either side, on one line."""
    at = text.lower().find(WORD)
    return repr(text[max(at - 30, 0):at + len(WORD) + 30].replace("\n", " "))


def offenders(package: Path = PACKAGE) -> list[str]:
    out = []
    for path in sorted(package.rglob("*.py")):
        if path.is_relative_to(package / "worlds") or path.is_relative_to(package / "conf"):
            continue
        module = path.relative_to(package).as_posix()
        for line, text in words_in(path):
            if (module, text) not in ALLOWED:
                out.append(f"{module}:{line}: {excerpt(text)}")
    return out


def test_generic_modules_name_no_world():
    found = offenders()
    assert not found, ("generic modules that name the digits world (move the code into distill/worlds/, reach it "
                       "through the config, or add a justified entry to ALLOWED):\n" + "\n".join(found))


def test_every_allowed_entry_is_still_needed():
    used = {(path.relative_to(PACKAGE).as_posix(), text) for path in PACKAGE.rglob("*.py")
            if not path.is_relative_to(WORLDS) for _, text in words_in(path)}
    assert set(ALLOWED) <= used, f"stale ALLOWED entries: {sorted(set(ALLOWED) - used)}"


def test_the_check_sees_names_strings_and_comments(tmp_path):
    (tmp_path / "worlds").mkdir()
    (tmp_path / "worlds" / "inside.py").write_text("DIGITS = 'a handwritten digit'\n")
    (tmp_path / "generic.py").write_text('"""Doc."""\n\nimport os  # the digits default\n\n\n'
                                         'def f(n_digits):\n    return os.sep.isdigit(), "Digit"\n')
    # isdigit is allowed by module: here it is found
    assert offenders(tmp_path) == ["generic.py:3: '# the digits default'", "generic.py:6: 'n_digits'",
                                   "generic.py:7: 'Digit'", "generic.py:7: 'isdigit'"]


def test_a_world_reaches_the_registries_the_schema_and_the_asset_resolver():
    """The digits world's parts register from its own package and its data option gets a generated schema."""
    from distill.config.schema import SCHEMAS
    from distill.methods import METHODS
    from distill.students import STUDENTS
    from distill.worlds import asset_path, options, parts

    assert {METHODS.get(name).__module__ for name in ("clip", "classifier", "vae", "noisy_classifier")} == {
        f"distill.worlds.digits.trainers.{module}" for module in ("clip", "classifier", "autoencoder",
                                                                  "noisy_classifier")}
    assert STUDENTS.get("digit_classifier").__module__ == "distill.worlds.digits.classifier"
    assert STUDENTS.get("clip").__module__ == "distill.worlds.digits.clip"
    assert set(parts("student")) == {"distill.worlds.digits.clip", "distill.worlds.digits.classifier"}
    assert options("data") == {"digits": "distill.worlds.digits.data.DigitsDataModule"}
    schema = SCHEMAS["data"]["digits"]
    assert (schema.__name__, schema._target_) == ("DigitsDataConfig", "distill.worlds.digits.data.DigitsDataModule")
    assert asset_path("teacher") == WORLDS / "digits" / "weights" / "teacher"
    with pytest.raises(FileNotFoundError, match="no world ships an asset 'teachr'; known assets: classifier, clip"):
        asset_path("teachr")
