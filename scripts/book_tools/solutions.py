"""Exercises and their solutions: every solution hidden until the reader opens it.

    python scripts/hide_solutions.py                 # every chapter under book/
    python scripts/hide_solutions.py book/x.ipynb    # just these
    python scripts/hide_solutions.py --check         # change nothing; exit 1 if a solution shows

A chapter's exercises are markdown paragraphs that start with `**Exercise N.**`; each
solution is one or more code cells whose source starts with `# Solution`, then, if it
has one, its explanation: the markdown that follows them up to the next exercise or
heading. A solution is hidden whole until the reader opens it:

- its code cells carry the tag `hide-cell` (the book shows one collapsed toggle for the
  code and its output together, labelled "Solution to exercise N: show the code and its
  output" through myst-nb's cell metadata; nbval and Colab run the cell as usual);
- its explanation is wrapped in `<details class="solution"><summary>...</summary>`, which
  the book (MyST passes the HTML through; book/_static/companion.css styles it), Jupyter
  and Colab all show collapsed, with the markdown and math inside rendered when opened.

The command applies this to every chapter (idempotent: a second run changes nothing). Only
tags and those wrappers change, never a source of code or an output, so the chapters need
no re-execution; tests/book/test_book.py checks the rules.
"""

from __future__ import annotations

import argparse
import pathlib
import re

from . import settings

SOLUTION_CODE_TAG = "hide-cell"
SOLUTION_OPEN = '<details class="solution">'
SOLUTION_CLOSE = "</details>"
_EXERCISE = re.compile(r"^\*\*Exercise (\d+)\.\*\*", re.M)
_HEADING = re.compile(r"^#{1,6} ", re.M)
_DETAILS = re.compile(
    r'<details class="solution">\s*<summary>(?P<title>.*?)</summary>\s*(?P<body>.*?)\s*</details>', re.S
)
# A MyST admonition or dropdown whose title starts with "Solution" (the wrapper of the
# first edition, shown as raw text in Jupyter and Colab).
_ADMONITION = re.compile(
    r"^(?P<fence>`{3,}|:{3,})\{(?:admonition|dropdown)\}[ \t]*(?P<title>Solution[^\n]*)\n"
    r"(?P<options>(?::[\w-]+:[^\n]*\n)*)(?P<body>.*?)\n(?P=fence)[ \t]*$",
    re.S | re.M,
)


def is_solution_code(cell: dict) -> bool:
    """Whether ``cell`` is a code cell of a solution (its source starts with ``# Solution``)."""
    return cell.get("cell_type") == "code" and "".join(cell["source"]).lstrip().startswith("# Solution")


def split_solution_text(source: str) -> tuple[str, str]:
    """A markdown cell that follows a solution: (its explanation, the rest from the next exercise or heading on)."""
    starts = [m.start() for m in (_EXERCISE.search(source), _HEADING.search(source)) if m]
    cut = min(starts) if starts else len(source)
    return source[:cut], source[cut:]


def solution_details(title: str, body: str) -> str:
    """An explanation wrapped so that it is hidden until opened."""
    return f"{SOLUTION_OPEN}\n<summary>{title.strip()}</summary>\n\n{body.strip()}\n\n{SOLUTION_CLOSE}"


def _is_wrapped(text: str) -> bool:
    match = _DETAILS.fullmatch(text.strip())
    return bool(match) and SOLUTION_OPEN not in match.group("body")


def _exercise_number(cells: list[dict], index: int) -> str | None:
    """The number of the last exercise stated before cell ``index``."""
    for cell in reversed(cells[:index]):
        if cell["cell_type"] == "markdown":
            numbers = _EXERCISE.findall("".join(cell["source"]))
            if numbers:
                return numbers[-1]
    return None


def _hidden(text: str, default_title: str) -> str:
    """``text`` (an explanation) as one hidden block; earlier wrappers are unwrapped first."""
    if _is_wrapped(text):
        return text.strip()
    titles = [m.group("title") for m in _ADMONITION.finditer(text)] + [m.group("title") for m in _DETAILS.finditer(text)]
    body = _ADMONITION.sub(lambda m: m.group("body").strip(), text)
    body = _DETAILS.sub(lambda m: m.group("body").strip(), body)
    return solution_details(titles[0] if titles else default_title, body)


def hide_solutions(nb: dict) -> list[str]:
    """Hide every solution of ``nb`` in place; return what changed (empty: nothing to do).

    Only the tags of solution code cells and the wrapper around solution explanations
    change; sources of code cells and every output stay as they are.
    """
    changes = []
    cells = nb["cells"]
    after_solution = False
    for index, cell in enumerate(cells):
        if cell["cell_type"] == "code":
            after_solution = is_solution_code(cell)
            if after_solution:
                tags = cell.setdefault("metadata", {}).get("tags", [])
                new = [t for t in tags if t not in ("hide-input", "hide-output")]
                if SOLUTION_CODE_TAG not in new:
                    new.append(SOLUTION_CODE_TAG)
                if new != tags:
                    cell["metadata"]["tags"] = new
                    changes.append(f"code cell {index}: tags {tags} -> {new}")
                number = _exercise_number(cells, index)
                name = f"Solution to exercise {number}" if number else "Solution"
                # The toggle's label in the book (myst-nb's cell-level code_prompt_show/hide).
                prompts = {"code_prompt_show": f"{name}: show the code and its output",
                           "code_prompt_hide": f"{name}: hide"}
                mystnb = cell["metadata"].get("mystnb", {})
                if any(mystnb.get(key) != value for key, value in prompts.items()):
                    cell["metadata"]["mystnb"] = {**mystnb, **prompts}
                    changes.append(f"code cell {index}: toggle labelled {prompts['code_prompt_show']!r}")
            continue
        if cell["cell_type"] != "markdown":
            continue
        source = "".join(cell["source"])
        if after_solution:
            explanation, rest = split_solution_text(source)
            after_solution = not rest
        else:
            explanation, rest = "", source
        number = _exercise_number(cells, index)
        title = f"Solution to exercise {number}, in words" if number else "Solution, in words"
        new_source = _hidden(explanation, title) if explanation.strip() else ""
        # A first-edition dropdown elsewhere (a solution without code) is converted too.
        rest = _ADMONITION.sub(lambda m: solution_details(m.group("title"), m.group("body")), rest)
        new_source = "\n\n".join(part.strip("\n") for part in (new_source, rest) if part.strip())
        if new_source != source.strip("\n"):  # a real change, not just the cell's last newline
            cell["source"] = new_source
            changes.append(f"markdown cell {index}: solution hidden")
    return changes


def solution_problems(nb: dict) -> list[str]:
    """Every solution of ``nb`` that a reader sees before opening it (empty: all hidden)."""
    problems = []
    after_solution = False
    for index, cell in enumerate(nb["cells"]):
        source = "".join(cell["source"])
        if cell["cell_type"] == "code":
            after_solution = is_solution_code(cell)
            tags = set(cell.get("metadata", {}).get("tags", []))
            if after_solution and (SOLUTION_CODE_TAG not in tags or tags & {"remove-cell", "remove-input"}):
                problems.append(f"code cell {index} (a solution) is not tagged {SOLUTION_CODE_TAG}: {sorted(tags)}")
            continue
        if cell["cell_type"] != "markdown":
            continue
        if _ADMONITION.search(source):
            problems.append(f"markdown cell {index}: a solution in a MyST dropdown (raw text in Jupyter and Colab)")
        if after_solution:
            explanation, rest = split_solution_text(source)
            after_solution = not rest
            if explanation.strip() and not _is_wrapped(explanation):
                problems.append(f"markdown cell {index}: solution text outside {SOLUTION_OPEN}: "
                                f"{explanation.strip()[:60]!r}")
    return problems


def main(argv: list[str] | None = None) -> int:
    import nbformat

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:3]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", type=pathlib.Path, help="default: every notebook under book/")
    parser.add_argument("--check", action="store_true", help="report, change nothing; exit 1 if a solution shows")
    args = parser.parse_args(argv)
    failed = False
    for path in args.notebooks or settings.notebooks():
        nb = nbformat.read(path, as_version=4)
        if args.check:
            for problem in solution_problems(nb):
                print(f"{path}: {problem}")
                failed = True
            continue
        outputs = [cell.get("outputs") for cell in nb.cells]
        changes = hide_solutions(nb)
        assert [cell.get("outputs") for cell in nb.cells] == outputs  # never an output
        if changes:
            nbformat.write(nb, path)
            for change in changes:
                print(f"{path}: {change}")
    return 1 if failed else 0
