"""The library apart from the book: ``companion.book`` holds the chapters' support code.

The top level of :mod:`companion` lists only what a project imports; the library never
imports the book's part (statically: no ``import`` of it in any library module; and at run
time: importing every library module loads no ``companion.book`` module); the old import
paths of the moved modules still work, warn with a ``DeprecationWarning`` pointing at the
importing line, and are the new modules themselves.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys
import warnings

import pytest

import companion
from companion import _moved

PACKAGE = pathlib.Path(companion.__file__).resolve().parent
BOOK = PACKAGE / "book"
OLD_NAMES = set(_moved.MOVED)
LIBRARY_MODULES = ("attention", "diagnostics", "launch", "losses", "numerics", "optimizers", "training")


def _library_files() -> list[pathlib.Path]:
    files = [p for p in PACKAGE.rglob("*.py") if BOOK not in p.parents]
    stubs = {PACKAGE / f"{name.split('.')[-1]}.py" for name in OLD_NAMES} | {PACKAGE / "_moved.py"}
    return sorted(set(files) - stubs)


def _imported_modules(tree: ast.AST) -> set[str]:
    """Every module an ``import`` or ``from ... import`` names, with ``from a import b`` as ``a.b`` too."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _is_book(name: str) -> bool:
    return name == "companion.book" or name.startswith("companion.book.") or name in OLD_NAMES


def test_the_library_never_imports_the_book_statically():
    offenders = []
    for path in _library_files():
        source = path.read_text()
        for name in _imported_modules(ast.parse(source, str(path))):
            if _is_book(name):
                offenders.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
        # importlib.import_module("companion.book...") and friends, as strings
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and _is_book(node.value):
                if path.name != "__init__.py" or path.parent != PACKAGE:
                    offenders.append(f"{path.relative_to(PACKAGE.parent)} names {node.value!r}")
    assert not offenders, "\n".join(offenders)


def test_the_checker_sees_each_spelling_of_an_import_of_the_book():
    source = "import companion.book.models\nfrom companion.book import notebook\nfrom companion import notebook\n"
    names = {n for n in _imported_modules(ast.parse(source)) if _is_book(n)}
    assert names == {"companion.book.models", "companion.book", "companion.book.notebook", "companion.notebook"}


def test_importing_every_library_module_loads_nothing_of_the_book():
    code = (
        "import importlib, pkgutil, sys, companion\n"
        f"for name in {LIBRARY_MODULES!r}:\n"
        "    module = importlib.import_module('companion.' + name)\n"
        "    for info in pkgutil.walk_packages(getattr(module, '__path__', []), module.__name__ + '.'):\n"
        "        if not info.name.endswith('__main__'):\n"
        "            importlib.import_module(info.name)\n"
        "print(sorted(m for m in sys.modules if m.startswith('companion.book')"
        f" or m in {sorted(OLD_NAMES)!r}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=PACKAGE.parent, check=True).stdout.strip().splitlines()[-1]
    assert out == "[]"


def test_the_top_level_lists_the_library_and_the_book_only():
    assert set(companion.__all__) == {"__version__", "book", *LIBRARY_MODULES}
    assert not OLD_NAMES & {f"companion.{name}" for name in dir(companion)}


@pytest.mark.parametrize("old", sorted(OLD_NAMES))
def test_an_old_path_warns_at_the_importing_line_and_is_the_new_module(old):
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    moved = [w for w in caught if issubclass(w.category, DeprecationWarning) and old in str(w.message)]
    assert len(moved) == 1, [str(w.message) for w in caught]
    # attributed to this file (the line that imported the old path), not to importlib or the stub
    assert moved[0].filename == __file__
    new = [importlib.import_module(name) for name in _moved.MOVED[old]]
    if len(new) == 1:
        assert module is new[0]
    else:  # companion.checklist became companion.book.survey and companion.book.cases
        for part in new:
            for name in part.__all__:
                assert getattr(module, name) is getattr(part, name)


def test_an_old_name_as_an_attribute_of_companion_warns_too():
    sys.modules.pop("companion.runs", None)
    companion.__dict__.pop("runs", None)
    with pytest.warns(DeprecationWarning, match="companion.runs has moved to companion.book.runs"):
        module = companion.runs
    assert module is importlib.import_module("companion.book.runs")


def test_every_module_of_the_book_is_listed_and_documented():
    from companion import book

    on_disk = {p.stem for p in BOOK.glob("*.py") if p.stem != "__init__"} | {
        p.name for p in BOOK.iterdir() if (p / "__init__.py").is_file()}
    assert set(book.__all__) == on_disk
    api = (pathlib.Path(__file__).resolve().parents[2] / "book" / "reference" / "api.md").read_text()
    for name in on_disk:
        assert f".. automodule:: companion.book.{name}\n" in api, name
