"""The English units of text the Chinese edition translates: a notebook's markdown cells, a markdown
page's blocks (a table's rows each its own unit), and the site's strings outside the pages."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re

from .. import settings


@dataclasses.dataclass(frozen=True)
class Unit:
    """One translatable piece of English text of a page."""

    key: str  # a notebook cell's id, or b<index> for a block of a markdown page
    index: int  # the cell's index in the notebook, or the block's index in the page
    text: str


def english_pages() -> list[pathlib.Path]:
    """The source of every page of the English book, in reading order."""
    return settings.toc_sources()


def read_notebook(path: pathlib.Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def md_blocks(text: str) -> list[tuple[str, str]]:
    """A markdown page split into blocks at blank lines, a fenced block (``` or :::) kept whole,
    a table split into its rows (:func:`_table_rows`).

    Returns (block, separator) pairs: the separator is the exact text between a block and the next
    (newlines), so that joining ``block + separator`` gives the page back byte for byte.
    """
    pieces: list[tuple[str, str]] = []
    current: list[str] = []
    blanks = 0
    fence = None
    lines = text.split("\n")
    for number, line in enumerate(lines):
        stripped = line.strip()
        if fence is None and stripped == "":
            blanks += 1
            continue
        if blanks and current:
            pieces.append(("\n".join(current), "\n" * (blanks + 1)))
            current = []
        elif blanks and not current:
            pieces.append(("", "\n" * blanks))
        blanks = 0
        current.append(line)
        if fence is None:
            match = re.match(r"(`{3,}|:{3,})", stripped)
            if match:
                fence = match.group(1)
        elif set(stripped) == {fence[0]} and len(stripped) >= len(fence):
            fence = None
    if current:
        pieces.append(("\n".join(current), "\n" * blanks))
    elif blanks:
        pieces.append(("", "\n" * blanks))
    return [row for block in pieces for row in _table_rows(*block)]


def _table_rows(block: str, separator: str) -> list[tuple[str, str]]:
    """A markdown table as one piece per row (its header and rule together), else the block itself.

    Each row is translated on its own: a new row (a new cause in the API page's causes table)
    is one new unit, and the other rows' translations stay current.
    """
    lines = block.split("\n")
    if len(lines) < 3 or not all(line.startswith("|") for line in lines) or not re.fullmatch(r"\|[-:| ]+\|", lines[1]):
        return [(block, separator)]
    rows = ["\n".join(lines[:2]), *lines[2:]]
    return [(row, "\n") for row in rows[:-1]] + [(rows[-1], separator)]


def join_md_blocks(pieces: list[tuple[str, str]]) -> str:
    return "".join(block + separator for block, separator in pieces)


def units_of(page: pathlib.Path) -> list[Unit]:
    """The translatable units of an English page."""
    if page.suffix == ".ipynb":
        nb = read_notebook(page)
        return [
            Unit(cell["id"], i, "".join(cell["source"]))
            for i, cell in enumerate(nb["cells"]) if cell["cell_type"] == "markdown"
        ]
    text = page.read_text(encoding="utf-8")
    return [Unit(f"b{i}", i, block) for i, (block, _) in enumerate(md_blocks(text)) if block.strip()]


def site_units() -> list[Unit]:
    """The book's own strings outside its pages: title, footer, the part captions of _toc.yml."""
    import yaml

    config = yaml.safe_load((settings.ROOT / "_config.yml").read_text())
    toc = yaml.safe_load((settings.ROOT / "_toc.yml").read_text())
    units = [Unit("title", 0, config["title"]), Unit("footer", 1, (config.get("html") or {}).get("extra_footer", ""))]
    for i, part in enumerate(toc.get("parts", [])):
        units.append(Unit(f"caption{i}", 2 + i, part["caption"]))
    return units


def of(page: pathlib.Path | None) -> list[Unit]:
    """The units of ``page``, or the site's strings for None."""
    return site_units() if page is None else units_of(page)
