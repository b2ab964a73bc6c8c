"""HTML tables in one style: the book's, the doctor's and the diagnostics' reports.

:func:`html_table` renders rows as an HTML table with inline styles (``TABLE_STYLE``), so
Jupyter, Colab and the built book show it the same way: rules, padding, numbers
right-aligned in tabular figures, long headers wrapped. Library code (``companion.diagnostics``)
renders its reports with it; the book's chapters take it from :mod:`companion.book.notebook`.
"""

from __future__ import annotations

import html
import math
import numbers
from typing import Sequence

__all__ = ["HEADER_WIDTH", "TABLE_STYLE", "Table", "html_table"]


def _cell_text(value: object, float_format: str) -> str:
    """One cell as text: floats with ``float_format``, booleans and integers as Python prints them."""
    if value is None:
        return ""
    if hasattr(value, "dtype") and getattr(value, "shape", None) == ():  # NumPy / TF scalar
        value = value.item() if hasattr(value, "item") else value.numpy().item()
    if isinstance(value, (bool, str)):
        return str(value)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        value = float(value)
        return str(value) if not math.isfinite(value) else format(value, float_format)
    return str(value)


#: The inline style of every table :func:`html_table` makes (inline, so that Jupyter,
#: Colab and the built book show the same table): booktabs-like rules (a heavy rule above
#: and below, a thin one under the header, faint ones between rows) in the text's colour,
#: so they suit light and dark themes; padding between cells; numbers right-aligned, in
#: tabular (equal-width) figures and never broken across lines; and a wrapper that lets
#: a table wider than the page scroll inside itself rather than widen the page.
TABLE_STYLE: dict[str, str] = {
    "wrap": "overflow-x: auto; max-width: 100%; margin: 0.25em 0 0.75em",
    "table": (
        "border-collapse: collapse; border-spacing: 0; width: auto; margin: 0; "
        "border-top: 2px solid currentColor; border-bottom: 2px solid currentColor; "
        "font-variant-numeric: tabular-nums lining-nums; font-size: 0.9em; line-height: 1.35"
    ),
    "caption": "caption-side: top; text-align: left; padding: 0 0 0.35em; font-style: italic",
    "th": (
        "padding: 0.4em 0.75em; border: none; border-bottom: 1px solid currentColor; "
        "vertical-align: bottom; font-weight: 600; background: none"
    ),
    "td": (
        "padding: 0.25em 0.75em; border: none; border-top: 1px solid rgba(128, 128, 128, 0.3); "
        "vertical-align: top; background: none"
    ),
    "number": "text-align: right; white-space: nowrap",
    "text": "text-align: left",
}


def _is_numeric(text: str) -> bool:
    """Whether a cell's text is a number (``nan`` and ``inf`` included) or a boolean: right-aligned."""
    try:
        float(text)
    except ValueError:
        return text in ("True", "False")
    return True


#: How many characters of column names a table's header may hold side by side, about what
#: the book's text column shows at a table's type size (0.85 of the text's, 740 px at a
#: window 1280 px wide). A table of many columns breaks its names into shorter lines, so
#: that its header is no wider than the page (tests/book/test_browser.py measures it).
HEADER_WIDTH = 90


def _header_line_length(columns: int) -> int:
    """The longest line a column name gets in a table of ``columns`` columns: 10 to 20."""
    return max(10, min(20, HEADER_WIDTH // max(1, columns)))


#: Words a column name never breaks around: a relation stays with both its sides ("x = -2").
_RELATIONS = frozenset({"=", "<", ">", "<=", ">=", "≤", "≥", "≈", "!="})


def _header_lines(name: str, longest_line: int = 20) -> list[str]:
    """``name`` cut at spaces into ``ceil(len / longest_line)`` lines, the longest as short as can be.

    A relation (``=``, ``<``, ...) and the words either side of it stay on one line.
    """
    words: list[str] = []
    bind_next = False
    for word in name.split():
        if words and (bind_next or word in _RELATIONS):
            words[-1] += " " + word
        else:
            words.append(word)
        bind_next = word in _RELATIONS
    if not words:
        return []
    count = min(len(words), max(1, math.ceil(len(name) / longest_line)))
    # best[i, k]: (longest line, cut points) of the best split of words[i:] into k lines.
    best: dict[tuple[int, int], tuple[int, tuple[int, ...]]] = {}
    for k in range(1, count + 1):
        for i in range(len(words) - k, -1, -1):
            if k == 1:
                best[i, k] = (len(" ".join(words[i:])), (len(words),))
                continue
            # Of equally good splits, the one with the fuller first lines ("value at | x = 0").
            best[i, k] = min(
                ((max(len(" ".join(words[i:cut])), best[cut, k - 1][0]), (cut, *best[cut, k - 1][1]))
                 for cut in range(i + 1, len(words) - k + 2)),
                key=lambda option: (option[0], [-cut for cut in option[1]]),
            )
    lines, start = [], 0
    for cut in best[0, count][1]:
        lines.append(" ".join(words[start:cut]))
        start = cut
    return lines


def _header_html(name: str, longest_line: int = 20) -> str:
    """A column name, escaped, that breaks into a few balanced lines, never a word a line.

    Names up to ``longest_line`` characters stay on one line; longer ones are cut at
    spaces into ``ceil(len / longest_line)`` lines whose longest is as short as it can
    be, with non-breaking spaces inside each line, so a narrow column cannot stack the
    name one word a line.
    """
    lines = _header_lines(name, longest_line)
    if not lines:
        return html.escape(name)
    return " ".join("&nbsp;".join(html.escape(word) for word in line.split(" ")) for line in lines)


class Table:
    """Rows of values shown as an HTML table in a notebook, and as aligned text elsewhere.

    Made by :func:`html_table`; see there. ``_repr_html_`` is what Jupyter, Colab and the
    built book show; ``repr`` is the plain-text fallback (a terminal, a doctest).

    Attributes:
        header: the column names (a tuple of str, possibly empty).
        rows: the cells as text, a tuple of tuples of str, one per row.
        caption: the caption or None.
    """

    def __init__(self, header: tuple[str, ...], rows: tuple[tuple[str, ...], ...], caption: str | None):
        self.header = header
        self.rows = rows
        self.caption = caption

    def _repr_html_(self) -> str:
        return self.html()

    def html(self) -> str:
        """The table as HTML, in the book's style (what Jupyter and the book render)."""
        columns = len(self.header) if self.header else (len(self.rows[0]) if self.rows else 0)
        numeric_column = [
            all(_is_numeric(row[i]) for row in self.rows if row[i]) and any(row[i] for row in self.rows)
            for i in range(columns)
        ]
        lines = [f'<div class="companion-table-wrap" style="{TABLE_STYLE["wrap"]}">',
                 f'<table class="companion-table" style="{TABLE_STYLE["table"]}">']
        if self.caption is not None:
            lines.append(f'<caption style="{TABLE_STYLE["caption"]}">{html.escape(self.caption)}</caption>')
        if self.header:
            longest_line = _header_line_length(columns)
            cells = "".join(
                f'<th style="{TABLE_STYLE["th"]}; text-align: {"right" if numeric else "left"}">'
                f"{_header_html(h, longest_line)}</th>"
                for h, numeric in zip(self.header, numeric_column)
            )
            lines.append(f"<thead><tr>{cells}</tr></thead>")
        lines.append("<tbody>")
        for row in self.rows:
            cells = "".join(
                f'<td style="{TABLE_STYLE["td"]}; {TABLE_STYLE["number" if _is_numeric(c) else "text"]}">'
                f"{html.escape(c)}</td>"
                for c in row
            )
            lines.append(f"<tr>{cells}</tr>")
        lines.append("</tbody>")
        lines.append("</table>")
        lines.append("</div>")
        return "\n".join(lines)

    def __repr__(self) -> str:
        table = ([self.header] if self.header else []) + list(self.rows)
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))] if table else []
        lines = [] if self.caption is None else [self.caption]
        for k, row in enumerate(table):
            lines.append("  ".join(c.rjust(w) for c, w in zip(row, widths)).rstrip())
            if k == 0 and self.header:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)


def html_table(
    rows: Sequence[Sequence[object]],
    header: Sequence[str] | None = None,
    *,
    caption: str | None = None,
    float_format: str = ".4g",
) -> Table:
    """Show rows of values as an HTML table: the last expression of a notebook cell.

    Chapters print tables with this rather than with padded f-strings, so that the
    book shows a real table at any width and the cell that makes it shows the
    computation, not the formatting. Floats are formatted with ``float_format``
    (``nan`` and ``inf`` as Python prints them), booleans and integers as Python prints
    them, ``None`` as an empty cell, anything else with ``str``; NumPy and TensorFlow
    scalars count as the Python number they hold. Every table has the book's one style
    (``TABLE_STYLE``, inline, so Jupyter and Colab show it too): padding and rules
    between cells, numbers right-aligned in tabular figures, long column names broken
    into a few balanced lines, shorter ones the more columns there are
    (``HEADER_WIDTH``).

    Args:
        rows: a sequence of rows, each a sequence of cells, all of the same length.
        header: optional column names, as many as the rows have cells.
        caption: optional caption shown above the table.
        float_format: a format spec for floats, e.g. ``".3g"`` or ``".4f"``.

    Returns:
        A :class:`Table`; Jupyter renders it with its ``_repr_html_``.

    Raises:
        TypeError: if ``rows`` is not a sequence of sequences, or ``float_format`` is
            not a str.
        ValueError: if rows differ in length, or the header has another length.

    Example:
        >>> rows = [["tf.pow", float("nan")], ["safe_pow", 0.25]]
        >>> table = html_table(rows, ["power", "d/dx"])
        >>> print(repr(table))
           power  d/dx
        --------  ----
          tf.pow   nan
        safe_pow  0.25
    """
    if not isinstance(float_format, str):
        raise TypeError(f"float_format must be a str such as '.3g', got {type(float_format).__name__}")
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence):
        raise TypeError(f"rows must be a sequence of rows (lists or tuples), got {type(rows).__name__}")
    text_rows = []
    for index, row in enumerate(rows):
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
            raise TypeError(f"row {index} must be a list or tuple of cells, got {type(row).__name__}")
        text_rows.append(tuple(_cell_text(value, float_format) for value in row))
    lengths = {len(row) for row in text_rows}
    if len(lengths) > 1:
        raise ValueError(f"every row must have the same number of cells, got lengths {sorted(lengths)}")
    names = tuple(str(h) for h in header) if header is not None else ()
    if names and lengths and len(names) != lengths.pop():
        raise ValueError(f"header has {len(names)} names but the rows have {len(text_rows[0])} cells")
    return Table(names, tuple(text_rows), caption)
