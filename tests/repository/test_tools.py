"""The contributor tools: ``scripts/<command>.py`` runs the ``main`` of a module of the ``book_tools``
package (scripts/book_tools/), which the tests and the book's build import too.

- each command is only that: no code of its own, so every rule is defined once, in the package;
- each command answers ``--help`` and imports neither TensorFlow nor companion's training code to do so
  (a contributor's command starts in a fraction of a second);
- README's layout table and the package's docstring name every module of the package.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

import book_tools

SCRIPTS = book_tools.ROOT / "scripts"
COMMANDS = sorted(SCRIPTS.glob("*.py"))
PACKAGE = SCRIPTS / "book_tools"


def _module_of(command: pathlib.Path) -> str:
    tree = ast.parse(command.read_text())
    imports = [node for node in tree.body if isinstance(node, ast.ImportFrom) and node.module
               and node.module.startswith("book_tools")]
    assert len(imports) == 1 and [alias.name for alias in imports[0].names] == ["main"], (
        f"{command.name}: a command imports `main` from one book_tools module")
    return imports[0].module


def test_there_are_the_documented_commands():
    assert {c.stem for c in COMMANDS} == {"translate_book", "refresh_notebooks", "hide_solutions", "release"}


@pytest.mark.parametrize("command", COMMANDS, ids=lambda p: p.name)
def test_a_command_is_a_module_main_and_nothing_else(command):
    _module_of(command)
    tree = ast.parse(command.read_text())
    defined = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Assign))]
    assert not defined, f"{command.name} defines {[getattr(n, 'name', 'a value') for n in defined]}: " \
                        "put it in the package"


@pytest.mark.parametrize("command", COMMANDS, ids=lambda p: p.name)
def test_a_command_answers_help_without_importing_tensorflow(command):
    probe = (
        "import runpy, sys\n"
        f"sys.argv = [{str(command)!r}, '--help']\n"
        "try:\n"
        f"    runpy.run_path({str(command)!r}, run_name='__main__')\n"
        "except SystemExit as exit:\n"
        "    assert exit.code in (0, None), exit.code\n"
        "print('tensorflow' in sys.modules, 'keras' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=book_tools.ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "False False", "a command's --help imported TensorFlow"


def test_every_module_of_the_package_is_named_in_readme_and_in_its_docstring():
    readme = (book_tools.ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `scripts/book_tools/`"))
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    modules |= {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    listed = {name.rstrip("/") for name in re.findall(r"`([\w.]+/?)`", row)}
    assert modules <= listed, f"not in README's row of scripts/book_tools/: {sorted(modules - listed)}"
    for name in modules:
        assert f":mod:`.{name}`" in book_tools.__doc__, f"book_tools' docstring does not name {name}"
    zh = PACKAGE / "zh"
    from book_tools import zh as zh_package

    for path in zh.glob("*.py"):
        if path.stem != "__init__":
            assert path.stem in listed, f"README's row does not name zh/{path.name}"
            assert f":mod:`.{path.stem}`" in zh_package.__doc__, f"book_tools.zh's docstring does not name {path.stem}"
