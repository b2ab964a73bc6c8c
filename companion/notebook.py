"""One-call set-up for the book's chapters.

Every chapter starts with::

    from companion.notebook import setup
    setup(seed=0)

which makes the chapter's outputs reproducible (the test suite re-runs every chapter
under nbval and compares its outputs with the committed ones) and gives every figure the
same look.
"""

from __future__ import annotations

import html
import math
import numbers
import os
import random
import sys
from typing import Sequence

__all__ = ["BOOK_COLORS", "BOOK_STYLE", "Table", "html_table", "setup"]

#: The matplotlib style of every figure in the book.
BOOK_STYLE: dict[str, object] = {
    "figure.figsize": (6.4, 3.6),
    "figure.dpi": 100,
    "savefig.dpi": 100,
    "figure.constrained_layout.use": True,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.titlesize": "medium",
    "axes.labelsize": "medium",
    "legend.fontsize": "small",
    "legend.frameon": False,
    "lines.linewidth": 1.6,
}
#: Colour cycle of the book (Okabe-Ito, colour-blind safe).
BOOK_COLORS = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000"]


def setup(seed: int = 0, *, deterministic: bool | None = None) -> None:
    """Make a chapter reproducible and quiet, and set the book's plot style.

    It

    1. quiets TensorFlow's C++ logging (``TF_CPP_MIN_LOG_LEVEL=2``; this only takes
       effect if TensorFlow has not been imported yet, so call ``setup`` first) and
       Python-side TensorFlow warnings;
    2. seeds Python's :mod:`random`, NumPy and TensorFlow with ``seed``
       (:func:`keras.utils.set_random_seed`);
    3. enables op determinism (:func:`tf.config.experimental.enable_op_determinism`),
       so the same code on the same machine gives bit-identical results, unless a GPU
       is visible (see below);
    4. sets the matplotlib style :data:`BOOK_STYLE` and colours :data:`BOOK_COLORS`, if matplotlib is installed.

    **On a GPU.** Op determinism makes every op either run a deterministic kernel or
    raise ``UnimplementedError`` when it has none on the device (TensorFlow's
    documentation of ``enable_op_determinism``); which ops those are changes from one
    TensorFlow release to the next. The book's outputs are made and checked on a CPU
    and would differ in their last digits on a GPU anyway (other kernels), so there
    determinism buys a reader little and could stop a chapter halfway. By default
    (``deterministic=None``) ``setup`` therefore enables it only when TensorFlow sees
    no GPU: on a GPU runtime (e.g. Colab's) the chapters run with TensorFlow's default
    kernels, seeded but not bit-reproducible from run to run. ``deterministic=True``
    enables it on any device (an op without a deterministic GPU kernel then raises);
    ``deterministic=False`` leaves TensorFlow's setting as it is. Nothing in
    ``companion`` pins work to a device: on a GPU runtime the chapters' tensors live on
    the GPU as TensorFlow places them.

    Args:
        seed: a non-negative integer.
        deterministic: ``None`` (default): enable op determinism unless a GPU is visible;
            ``True``: enable it on any device; ``False``: do not enable it.

    Raises:
        TypeError: if ``seed`` is not an integer (``bool`` included), or
            ``deterministic`` is not ``None``, ``True`` or ``False``.
        ValueError: if ``seed`` is negative.

    Example:
        >>> from companion.notebook import setup
        >>> setup(seed=0)

    Every chapter calls it first; the intro of the book says what it does on a GPU.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if deterministic is not None and not isinstance(deterministic, bool):
        kind = type(deterministic).__name__
        raise TypeError(f"deterministic must be None, True or False, got {kind} {deterministic!r}")

    if "tensorflow" not in sys.modules:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    random.seed(seed)
    keras.utils.set_random_seed(seed)
    if deterministic is None:
        # Listing physical devices does not initialise TensorFlow's runtime, so a chapter
        # can still configure logical devices after setup().
        deterministic = not tf.config.list_physical_devices("GPU")
    if deterministic:
        tf.config.experimental.enable_op_determinism()

    try:
        import matplotlib
    except ImportError:  # the package does not require matplotlib
        return
    from cycler import cycler

    style = dict(BOOK_STYLE)
    style["axes.prop_cycle"] = cycler(color=BOOK_COLORS)
    matplotlib.rcParams.update(style)


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
        def numeric(text: str) -> bool:
            try:
                float(text)
            except ValueError:
                return text in ("True", "False")
            return True

        lines = ['<table class="companion-table">']
        if self.caption is not None:
            lines.append(f"<caption>{html.escape(self.caption)}</caption>")
        if self.header:
            cells = "".join(f"<th>{html.escape(h)}</th>" for h in self.header)
            lines.append(f"<thead><tr>{cells}</tr></thead>")
        lines.append("<tbody>")
        for row in self.rows:
            cells = "".join(
                f'<td style="text-align: right">{html.escape(c)}</td>' if numeric(c) else f"<td>{html.escape(c)}</td>"
                for c in row
            )
            lines.append(f"<tr>{cells}</tr>")
        lines.append("</tbody>")
        lines.append("</table>")
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
    scalars count as the Python number they hold. Numbers are right-aligned.

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
        >>> table = html_table([["tf.pow", float("nan")], ["safe_pow", 0.25]], ["power", "d/dx"])
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
