"""The book's structure: every chapter is in the table of contents, carries the Colab cell,
and has committed outputs that nbval can compare."""

from __future__ import annotations

import json
import pathlib
import re

import pytest
import yaml

import book_tools
import companion
from companion.book.benchmark_results import BenchmarkResult, load_results
from test_translations import _prose

NOTEBOOKS = book_tools.notebooks()
IDS = [str(p.relative_to(book_tools.BOOK)) for p in NOTEBOOKS]


def _load(path: pathlib.Path) -> dict:
    return json.loads(path.read_text())


def _toc_files() -> set[str]:
    toc = yaml.safe_load((book_tools.ROOT / "_toc.yml").read_text())
    files = {toc["root"]}
    stack = list(toc.get("parts", [])) + list(toc.get("chapters", []))
    while stack:
        entry = stack.pop()
        if "file" in entry:
            files.add(entry["file"])
        stack.extend(entry.get("chapters", []) + entry.get("sections", []))
    return files


def test_book_has_chapters():
    assert NOTEBOOKS, "no notebooks found under book/"


def test_every_notebook_is_in_the_toc_and_every_toc_entry_exists():
    toc = _toc_files()
    listed = {str(p.relative_to(book_tools.ROOT).with_suffix("")) for p in NOTEBOOKS}
    assert listed <= toc, f"notebooks missing from _toc.yml: {sorted(listed - toc)}"
    for entry in toc:
        candidates = [book_tools.ROOT / f"{entry}{ext}" for ext in (".md", ".ipynb")]
        assert any(c.exists() for c in candidates), f"_toc.yml lists {entry}, which does not exist"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_first_code_cell_installs_this_version_and_is_shown_collapsed(path):
    cell = book_tools.first_code_cell(_load(path))
    source = "".join(cell["source"])
    assert source == book_tools.colab_cell_source(), (
        f"{path.name}: the install cell is out of date; run `python scripts/refresh.py --no-execute`"
    )
    # the code of this version: its tag on a release, the development branch (`main`) before it
    assert book_tools.installed_ref(source) == book_tools.install_ref(companion.__version__)
    assert book_tools.repository_url() in source
    tags = set(cell["metadata"].get("tags", []))
    assert "nbval-skip" in tags  # nbval does not run it: the tests use the checkout's package
    assert "hide-input" in tags and not tags & {"remove-cell", "remove-input"}, (
        f"{path.name}: the install cell must be on the page, collapsed (hide-input), got tags {sorted(tags)}"
    )
    assert max(len(line) for line in source.splitlines()) <= 88


def _run_install_cell(monkeypatch, companion_importable: bool) -> list[tuple[str, str]]:
    """Run the install cell as IPython would; return the line magics it calls, expanded."""
    import importlib.util

    from IPython.core.inputtransformer2 import TransformerManager

    python = TransformerManager().transform_cell(book_tools.colab_cell_source())
    calls = []
    namespace = {}

    class FakeIPython:
        def run_line_magic(self, name, line, *args, **kwargs):
            # IPython expands {name} in a magic's line with the caller's variables.
            calls.append((name, line.format(**namespace)))

    namespace["get_ipython"] = lambda: FakeIPython()
    find_spec = importlib.util.find_spec

    def fake_find_spec(name, *args, **kwargs):
        if name == "companion" and not companion_importable:
            return None
        return find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake_find_spec)
    exec(compile(python, "<install cell>", "exec"), namespace)
    return calls


def test_install_cell_is_valid_ipython_and_installs_nothing_where_companion_is_importable(monkeypatch):
    assert _run_install_cell(monkeypatch, companion_importable=True) == []


def test_install_cell_installs_this_version_wherever_companion_is_missing(monkeypatch):
    calls = _run_install_cell(monkeypatch, companion_importable=False)
    assert len(calls) == 1 and calls[0][0] == "pip"
    name, code = book_tools.colab_install_spec().split(" @ ")
    # With the book extra: what the chapters import beside companion (a fresh environment,
    # a downloaded notebook, may have neither matplotlib nor mpmath).
    assert calls[0][1] == f'install --quiet "{name}[book] @ {code}"'


def test_the_book_extra_holds_every_package_the_chapters_import_beside_companion():
    import ast
    import pathlib
    import sys
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    # companion's own requirements, the standard library, and the kernel that runs a notebook.
    provided = {"companion", "keras", "tensorflow", "numpy", "IPython", *sys.stdlib_module_names}
    extra = {re.split(r"[<>=\[; ]", spec)[0].lower() for spec in project["optional-dependencies"]["book"]}
    imported = set()
    for path in sorted(root.glob("book/**/*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            source = "\n".join(line for line in "".join(cell["source"]).splitlines()
                               if not line.lstrip().startswith(("%", "!")))
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.Import):
                    imported |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    imported.add(node.module.split(".")[0])
    assert imported - provided <= extra, sorted(imported - provided - extra)


def test_install_cell_names_the_tag_of_a_release_and_the_branch_of_a_development_version():
    url = "https://github.com/o/r"
    assert book_tools.colab_install_spec(url, "1.2.3") == f"nan-gradients-companion @ git+{url}@v1.2.3"
    development = book_tools.colab_install_spec(url, "1.2.3.dev0")
    assert development == f"nan-gradients-companion @ git+{url}@{book_tools.repository_branch()}"
    for version, ref in (("1.2.3", "v1.2.3"), ("1.2.4.dev0", book_tools.repository_branch())):
        source = book_tools.colab_cell_source(url, version)
        assert book_tools.installed_ref(source) == ref and book_tools.installed_url(source) == url
        assert max(len(line) for line in source.splitlines()) <= book_tools.CODE_WIDTH


def test_install_cell_replaces_the_colab_only_cell_of_earlier_versions():
    import nbformat
    from book_tools import refresh

    old = (
        "import sys\n\nif \"google.colab\" in sys.modules:\n"
        '    %pip install --quiet "nan-gradients-companion @ git+https://example.org/x@v0.0.1"'
    )
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# Title"),
        nbformat.v4.new_code_cell(old, metadata={"tags": ["nbval-skip", "remove-cell"]}),
        nbformat.v4.new_code_cell("from companion.book.notebook import setup"),
    ])
    assert refresh.sync_colab_cell(nb)
    assert len(nb["cells"]) == 3
    assert nb["cells"][1]["source"] == book_tools.colab_cell_source()
    assert nb["cells"][1]["metadata"]["tags"] == book_tools.COLAB_TAGS
    assert not refresh.sync_colab_cell(nb)  # idempotent


def test_installed_distribution_has_the_package_version():
    from importlib.metadata import version

    assert version("nan-gradients-companion") == companion.__version__ == book_tools.package_version()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_outputs_are_committed_and_clean(path):
    cells = [c for c in _load(path)["cells"] if c["cell_type"] == "code"]
    for index, cell in enumerate(cells):
        source = "".join(cell["source"])
        if book_tools.is_colab_cell(cell):
            continue
        tags = cell["metadata"].get("tags", [])
        assert cell["execution_count"] is not None, f"{path.name}: code cell {index} was never run"
        for output in cell["outputs"]:
            assert not (output["output_type"] == "stream" and output["name"] == "stderr"), (
                f"{path.name}: code cell {index} has a committed stderr output"
            )
            if output["output_type"] == "error":
                assert "raises-exception" in tags, f"{path.name}: code cell {index} failed: {output['ename']}"
        assert not re.search(r"^(def|class) ", source, re.M), (
            f"{path.name}: code cell {index} defines a function or class; production code belongs in companion/"
        )
    counts = [c["execution_count"] for c in cells if c["execution_count"] is not None]
    assert counts == list(range(counts[0], counts[0] + len(counts))), f"{path.name}: cells not run top to bottom"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_starts_with_setup(path):
    cells = [c for c in _load(path)["cells"] if c["cell_type"] == "code"]
    assert "setup(seed=" in "".join(cells[1]["source"]), f"{path.name}: the cell after the Colab cell must call setup"


def test_pages_link_to_the_configured_repository():
    url = book_tools.repository_url()
    owner_repo = re.compile(r"github\.com/([\w.-]+/[\w.-]+)")
    for page in book_tools.linked_pages():
        for found in owner_repo.findall(page.read_text()):
            if found.split("/")[0] in {"tensorflow", "keras-team", "jupyter-book", "computationalmodelling"}:
                continue
            assert url.endswith(found.removesuffix(".git")), (
                f"{page.name} links to {found}, not to repository.url {url}; "
                "run `python scripts/refresh.py --no-execute`"
            )


# --- Exercises: every solution hidden until opened ---------------------------------------


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_every_solution_is_hidden_until_opened(path):
    nb = _load(path)
    problems = book_tools.solution_problems(nb)
    assert not problems, f"{path.name}: run `python scripts/hide_solutions.py`\n  " + "\n  ".join(problems)
    import copy

    assert book_tools.hide_solutions(copy.deepcopy(nb)) == [], f"{path.name}: run `python scripts/hide_solutions.py`"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_every_exercise_has_a_worked_solution(path):
    # After each `**Exercise N.**`, before the next one: a code cell `# Solution...` or a hidden explanation.
    stated, solved = [], set()
    for cell in _load(path)["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and book_tools.is_solution_code(cell) and stated:
            solved.add(stated[-1])
        for piece in re.split(r"(?=^\*\*Exercise \d+\.\*\*)", source, flags=re.M) if cell["cell_type"] == "markdown" else []:
            if book_tools.SOLUTION_OPEN in piece and stated:
                solved.add(stated[-1])
            number = re.match(r"\*\*Exercise (\d+)\.\*\*", piece)
            if number:
                stated.append(number.group(1))
    assert stated == [str(n) for n in range(1, len(stated) + 1)], f"{path.name}: exercises numbered {stated}"
    assert set(stated) <= solved, f"{path.name}: exercises without a solution: {sorted(set(stated) - solved)}"


def test_hide_solutions_hides_code_output_and_text_and_changes_nothing_else():
    import copy

    import nbformat

    output = nbformat.v4.new_output("stream", name="stdout", text="42\n")
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("## Exercises\n\n**Exercise 1.** Compute it."),
        nbformat.v4.new_code_cell("# Solution to exercise 1.\nprint(42)", metadata={"tags": ["hide-input"]}),
        nbformat.v4.new_markdown_cell(
            "```{admonition} Solution, in words\n:class: dropdown\nIt is $6 \\cdot 7$.\n```\n\n"
            "**Exercise 2.** Explain it."
        ),
        nbformat.v4.new_code_cell("# Solution: the same.\nprint(42)"),
        nbformat.v4.new_markdown_cell("Because $42 = 2 \\cdot 3 \\cdot 7$.\n\n## What to remember\n\n- 42."),
    ])
    nb.cells[1].outputs = [output]
    before = copy.deepcopy(nb)
    assert book_tools.solution_problems(nb)  # shown: the checker sees it
    assert book_tools.hide_solutions(nb)
    assert book_tools.solution_problems(nb) == []
    assert [c.metadata.get("tags") for c in nb.cells if c.cell_type == "code"] == [["hide-cell"], ["hide-cell"]]
    assert [c.outputs for c in nb.cells if c.cell_type == "code"] == [[output], []]
    assert nb.cells[1].metadata["mystnb"]["code_prompt_show"] == "Solution to exercise 1: show the code and its output"
    assert nb.cells[3].metadata["mystnb"]["code_prompt_show"] == "Solution to exercise 2: show the code and its output"
    assert [c.source for c in nb.cells if c.cell_type == "code"] == [c.source for c in before.cells if c.cell_type == "code"]
    assert nb.cells[2].source == (
        '<details class="solution">\n<summary>Solution, in words</summary>\n\nIt is $6 \\cdot 7$.\n\n</details>\n\n'
        "**Exercise 2.** Explain it."
    )
    assert nb.cells[4].source.startswith(
        '<details class="solution">\n<summary>Solution to exercise 2, in words</summary>\n\nBecause'
    ) and nb.cells[4].source.endswith("</details>\n\n## What to remember\n\n- 42.")
    assert nb.cells[0].source == before.cells[0].source
    again = copy.deepcopy(nb)
    assert book_tools.hide_solutions(again) == [] and again == nb  # idempotent


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_every_chapter_has_exercises(path):
    # DESIGN: every chapter ends with exercises whose worked solutions run like any other cell.
    text = "".join("".join(c["source"]) for c in _load(path)["cells"] if c["cell_type"] == "markdown")
    assert re.search(r"^\*\*Exercise 1\.\*\*", text, re.M), f"{path.name} has no exercises"


# --- What the page shows: lines and cells that fit -------------------------------------


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_every_code_and_text_output_line_fits_the_page(path):
    # At 1280 px the book shows book_tools.CODE_WIDTH characters of code (companion.css);
    # a longer line makes its block scroll sideways (tests/book/test_browser.py measures it).
    too_long = [
        f"cell {index} {where} ({len(line)} chars): {line[:50]}..."
        for index, cell in enumerate(_load(path)["cells"])
        for where, line in book_tools.shown_text_lines(cell)
        if len(line) > book_tools.CODE_WIDTH
    ]
    assert not too_long, (
        f"{path.name}: {len(too_long)} lines wider than {book_tools.CODE_WIDTH} characters\n  " + "\n  ".join(too_long)
    )


def _visible_code_cells():
    for path, chapter in zip(NOTEBOOKS, IDS):
        for index, cell in enumerate(_load(path)["cells"]):
            tags = set(cell["metadata"].get("tags", []))
            if cell["cell_type"] == "code" and not tags & {"hide-input", "hide-cell", "remove-input", "remove-cell"}:
                yield chapter, index, cell


def test_no_visible_code_cell_is_longer_than_the_limit():
    """A visible cell shows the computation that matters: a plot or drawing goes behind
    `hide-input`, a table's formatting is html_table's job, helper logic lives in companion,
    and a long computation is split where a sentence of text can stand between its parts."""
    limit = book_tools.CODE_CELL_LINES
    problems = []
    for chapter, index, cell in _visible_code_cells():
        lines = len("".join(cell["source"]).splitlines())
        if lines > limit:
            problems.append(f"{chapter} cell {index} ({cell.get('id')}) shows {lines} lines of code (at most {limit})")
    assert not problems, "\n".join(problems)


def test_refreshed_outputs_are_never_made_with_the_ulp_perturbation(monkeypatch):
    import os

    from book_tools import refresh

    monkeypatch.setenv("COMPANION_PERTURB_ULP", "1")
    refresh.prepare_kernel_environment()
    assert "COMPANION_PERTURB_ULP" not in os.environ
    assert os.environ["PYTHONHASHSEED"] == "0"


#: The fields of a shipped result that the performance page may quote.
_QUOTED = ("ratio", "q1", "q3", "target", "cpu", "cpu_ratio", "fastest")


def _quotable(result: BenchmarkResult) -> set[str]:
    """Every value of ``result`` the page may state, as it would write it."""
    values = [row[field] for row in result.ratios for field in _QUOTED if isinstance(row.get(field), (int, float))]
    for model in result.document.get("split", {}).values():
        for parts in model.values():
            values.extend(parts.values())
    return {text for value in values for text in (f"{value:.2f}", f"{value:.1f}", f"{value:g}")}


def test_every_decimal_the_performance_page_states_is_a_value_of_its_shipped_results():
    """The page's prose quotes the committed benchmark results, not an older run of them: a
    number that no shipped result holds (a re-measured ratio whose sentence stayed behind, a
    history of earlier runs) fails here. History belongs in the CHANGELOG. Stricter than the check of every
    page (test_prose_numbers.py), which also accepts a number a cell prints: here a decimal is a result's."""
    page = _load(book_tools.ROOT / "book" / "tools" / "performance.ipynb")
    known = set().union(*(_quotable(result) for result in load_results()))
    stray = []
    for cell in page["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        prose = _prose("".join(cell["source"]))
        stray += [m.group() for m in re.finditer(r"(?<![\w.])\d+\.\d+(?![\w.])", prose) if m.group() not in known]
    assert not stray, f"numbers the shipped results do not hold: {stray}"
