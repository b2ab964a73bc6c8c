"""Hide every exercise solution of the book until the reader opens it.

    python scripts/hide_solutions.py                 # every chapter under book/
    python scripts/hide_solutions.py book/x.ipynb    # just these
    python scripts/hide_solutions.py --check         # change nothing; exit 1 if a solution shows

A solution is its code cells (sources that start with `# Solution`) and the explanation in
the markdown after them, up to the next `**Exercise N.**` or heading. The code cells get the
tag `hide-cell` (code and output behind one toggle); the explanation is wrapped in
`<details class="solution">` (collapsed in the book, Jupyter and Colab alike). First-edition
`{admonition} Solution ... :class: dropdown` wrappers are converted. Idempotent: a second run
changes nothing. Only tags and those wrappers change, never a source of code or an output,
so the chapters need no re-execution (scripts/book_tools.py has the rules; tests/book/test_book.py
checks them).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import nbformat

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import book_tools  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", type=pathlib.Path, help="default: every notebook under book/")
    parser.add_argument("--check", action="store_true", help="report, change nothing; exit 1 if a solution shows")
    args = parser.parse_args(argv)
    failed = False
    for path in args.notebooks or book_tools.notebooks():
        nb = nbformat.read(path, as_version=4)
        if args.check:
            for problem in book_tools.solution_problems(nb):
                print(f"{path}: {problem}")
                failed = True
            continue
        outputs = [cell.get("outputs") for cell in nb.cells]
        changes = book_tools.hide_solutions(nb)
        assert [cell.get("outputs") for cell in nb.cells] == outputs  # never an output
        if changes:
            nbformat.write(nb, path)
            for change in changes:
                print(f"{path}: {change}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
