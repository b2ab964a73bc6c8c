"""The test command's two workers: pytest-xdist (pyproject.toml's addopts), with conftest.py's
scheduling (a file is one unit of work, the built book's tests are one unit, the longest
unit is handed out first)."""

from __future__ import annotations

import ast
import collections

import pytest

import book_tools

ROOT = book_tools.ROOT
tomllib = pytest.importorskip("tomllib")
pytest.importorskip("xdist")


@pytest.fixture(scope="module")
def root_conftest(pytestconfig):
    plugin = pytestconfig.pluginmanager.get_plugin(str(ROOT / "conftest.py"))
    assert plugin is not None, "the root conftest.py is not loaded"
    return plugin


def test_the_test_command_runs_two_workers_that_take_whole_files():
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    assert options[options.index("-n") + 1] == "2"
    assert options[options.index("--dist") + 1] == "loadfile"
    # the plugin is in the lock's input and in the package's test extra
    assert "pytest-xdist" in (ROOT / "requirements.in").read_text().split()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(r.startswith("pytest-xdist") for r in project["optional-dependencies"]["test"])
    # CI's kill matrix runs alone, in one process
    assert "-m killmatrix -n 0" in (ROOT / ".ci" / "run").read_text()


def test_every_test_file_that_uses_the_built_book_is_in_its_unit(root_conftest):
    users = set()
    for path in sorted((ROOT / "tests").glob("*/test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and "built_book" in [a.arg for a in node.args.args]:
                users.add(path.relative_to(ROOT).as_posix())
    assert users == set(root_conftest.BUILT_BOOK_FILES), (
        "list every test file that uses the built_book fixture in conftest.py's BUILT_BOOK_FILES "
        "(one worker builds the book once for all of them)"
    )


def test_a_notebook_a_module_and_the_built_books_files_are_one_unit_each(root_conftest):
    split = lambda nodeid: root_conftest._FileScheduling._split_scope(None, nodeid)  # noqa: E731
    assert split("book/case_a/reproduce.ipynb::Cell 3") == split("book/case_a/reproduce.ipynb::Cell 0")
    assert split("book/case_a/reproduce.ipynb::Cell 3") == "book/case_a/reproduce.ipynb"
    assert split("tests/distributed/test_launch.py::test_x[a::b]") == "tests/distributed/test_launch.py"
    assert split("tests/distributed/test_launch.py::TestA::test_x") == "tests/distributed/test_launch.py"
    units = {split(f"{path}::test_x") for path in root_conftest.BUILT_BOOK_FILES}
    assert units == {"the built book"}


class _Node:
    def __init__(self):
        self.sent = []

    def send_runtest_some(self, indices):
        self.sent.append(indices)


def test_a_worker_is_handed_the_longest_unit_left(root_conftest, monkeypatch):
    monkeypatch.setattr(root_conftest, "UNIT_SECONDS", {"tests/test_slow.py": 300, "the built book": 100})
    collection = ["tests/test_a.py::t1", "tests/test_a.py::t2", "tests/test_a.py::t3", "tests/test_slow.py::t",
                  "tests/book/test_built_book.py::t", "tests/test_b.py::t"]
    scheduler = object.__new__(root_conftest._FileScheduling)
    scheduler.workqueue = collections.OrderedDict()
    for nodeid in collection:
        scheduler.workqueue.setdefault(scheduler._split_scope(nodeid), {})[nodeid] = False
    node = _Node()
    scheduler.assigned_work, scheduler.registered_collections = {}, {node: collection}
    for _ in range(4):
        scheduler._assign_work_unit(node)
    # the listed units by their seconds, then the others by their number of tests
    assert list(scheduler.assigned_work[node]) == [
        "tests/test_slow.py", "the built book", "tests/test_a.py", "tests/test_b.py"
    ]
    assert node.sent == [[3], [4], [0, 1, 2], [5]]


def test_every_unit_with_measured_seconds_exists(root_conftest):
    missing = [unit for unit in root_conftest.UNIT_SECONDS if unit != "the built book" and not (ROOT / unit).is_file()]
    assert not missing, f"conftest.py's UNIT_SECONDS names files that are gone: {missing}"
    assert all(path.startswith("tests/") and (ROOT / path).is_file() for path in root_conftest.BUILT_BOOK_FILES)
