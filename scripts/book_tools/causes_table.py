"""The API page's table of the doctor's causes, rendered from ``companion.diagnostics.CAUSES``.

CAUSES is the one definition of the causes: ``python scripts/refresh_notebooks.py --no-execute``
rewrites the table, and tests/book/test_cause_sections.py fails while the page differs from
what this renders.
"""

from __future__ import annotations

import pathlib

from .settings import BOOK

API_PAGE = BOOK / "reference" / "api.md"
CAUSES_TABLE_HEADER = "| cause | what happened | fix | shown in |"


def causes_table() -> str:
    """The markdown table of every cause: name, description, fix and a link to its section."""
    from companion.diagnostics.causes import CAUSES

    rows = [CAUSES_TABLE_HEADER, "|---|---|---|---|"]
    for name, cause in CAUSES.items():
        chapter, _, anchor = cause.section.partition("#")
        page = chapter.removeprefix("book/")
        link = f"[{pathlib.PurePosixPath(page).name.replace('_', ' ')}](../{page}.ipynb#{anchor})"
        rows.append(f"| `{name}` | {cause.description} | {cause.fix} | {link} |")
    return "\n".join(rows)


def with_causes_table(page: str) -> str:
    """The API page's text with its causes table (the lines from the header on) rendered anew."""
    lines = page.split("\n")
    start = lines.index(CAUSES_TABLE_HEADER)
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "\n".join(lines[:start] + causes_table().split("\n") + lines[end:])
