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
import threading
from typing import Sequence

__all__ = ["BOOK_COLORS", "BOOK_STYLE", "HEADER_WIDTH", "PERTURB_ULP_ENV", "TABLE_STYLE", "Table", "html_table",
           "setup"]

#: The environment variable that turns on :func:`setup`'s ``perturb_ulp`` ("1" on, "0" or
#: unset off): ``COMPANION_PERTURB_ULP=1 python -m pytest book`` re-runs every chapter
#: with every new variable one ulp away from its seeded value.
PERTURB_ULP_ENV = "COMPANION_PERTURB_ULP"

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


def setup(seed: int = 0, *, deterministic: bool | None = None, perturb_ulp: bool | None = None) -> None:
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
    4. sets the matplotlib style :data:`BOOK_STYLE` and colours :data:`BOOK_COLORS`, if matplotlib is installed;
    5. with ``perturb_ulp``, moves every variable created from then on one ulp away from
       its initial value (below).

    **One ulp away.** A printed digit that a different order of summation would change
    (another CPU's vector width, another kernel) is a defect of the chapter: it passes
    here and fails on a reader's machine. ``perturb_ulp=True`` (or the environment
    variable ``COMPANION_PERTURB_ULP=1`` when ``perturb_ulp`` is ``None``) makes that
    class of defect visible on one machine: every floating-point ``tf.Variable`` created
    afterwards in this thread (every Keras weight, optimizer slot and metric, and every
    ``tf.Variable`` made from a computed value) starts with each finite, non-zero element moved to the
    neighbouring float, up or down at random (seeded by ``seed``, so the perturbed run is
    itself reproducible). Left as they are: exact zeros, infinities and NaNs; integer
    variables; a variable whose every element is a whole number (at most 2**24 in
    float32: Keras' ``ones`` and ``identity`` initialisers, a loss scale of 2**15), which
    every CPU computes exactly and a chapter may use to place a model on the point it
    studies (a random draw is never one); a variable made from a Python number or a list of them
    (``tf.Variable(1.0)``: what the author typed, the same on every CPU and often exactly
    the point a chapter studies; its initial value computed by TensorFlow or NumPy is
    moved); values restored from a checkpoint; and variables created under a
    ``tf.distribute`` strategy (whose replicas must stay equal). A one-ulp change is what a
    different rounding of the first sum does; a printed digit that survives it survives
    the reader's CPU. ``setup`` without it (the default) creates variables untouched. It
    uses the public ``tf.variable_creator_scope``; call ``setup`` outside any
    ``strategy.scope()``.

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
        perturb_ulp: ``None`` (default): as the environment variable
            ``COMPANION_PERTURB_ULP`` says ("1" on; unset, empty or "0" off);
            ``True``/``False``: on or off, whatever the environment says.

    Raises:
        TypeError: if ``seed`` is not an integer (``bool`` included), or
            ``deterministic`` or ``perturb_ulp`` is not ``None``, ``True`` or ``False``.
        ValueError: if ``seed`` is negative, or ``COMPANION_PERTURB_ULP`` is set to
            something other than "", "0" or "1".

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
    if perturb_ulp is not None and not isinstance(perturb_ulp, bool):
        kind = type(perturb_ulp).__name__
        raise TypeError(f"perturb_ulp must be None, True or False, got {kind} {perturb_ulp!r}")
    if perturb_ulp is None:
        perturb_ulp = _perturb_ulp_from_environment()

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
    _perturb_new_variables(seed if perturb_ulp else None)

    try:
        import matplotlib
    except ImportError:  # the package does not require matplotlib
        return
    from cycler import cycler

    style = dict(BOOK_STYLE)
    style["axes.prop_cycle"] = cycler(color=BOOK_COLORS)
    matplotlib.rcParams.update(style)


def _perturb_ulp_from_environment() -> bool:
    value = os.environ.get(PERTURB_ULP_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{PERTURB_ULP_ENV} must be unset, '0' or '1', got {value!r}")
    return value == "1"


# The perturbation: the seed of its random directions (None: off), how many variables it
# has moved (each variable's directions come from (seed, that count)), and the threads
# whose variable-creator stack holds the creator below (installed once per thread, on
# first use, and never removed: switching off only sets the seed to None).
_perturbation: dict[str, int | None] = {"seed": None, "count": 0}
_perturbing_threads: dict[int, object] = {}


def _one_ulp_away(value, seed: int, index: int, dtype=None):
    """``value`` with each finite non-zero element moved to a neighbouring float (a seeded random direction)."""
    import tensorflow as tf

    value = tf.convert_to_tensor(value, dtype=dtype)
    bits_dtype = {tf.float16: tf.int16, tf.bfloat16: tf.int16, tf.float32: tf.int32, tf.float64: tf.int64}.get(
        value.dtype
    )
    if bits_dtype is None:  # integers, booleans, complex numbers, strings: as they are
        return value
    # Whole numbers up to 2**digits (Keras' ``ones`` and ``identity``, a loss scale of
    # 2**15, a count) are exact on every CPU: any order of summation of them gives them
    # bit for bit, so a variable made only of them is left, as zeros are.
    digits = {tf.float16: 11, tf.bfloat16: 8, tf.float32: 24, tf.float64: 53}[value.dtype]
    whole = tf.reduce_all((tf.math.floor(value) == value) & (tf.abs(value) <= 2.0**digits))
    up = tf.random.stateless_uniform(tf.shape(value), seed=[seed, index]) < 0.5
    # The bits of a float, read as a signed integer, grow with its magnitude: +1 moves a
    # positive float up (towards +inf) and a negative one down.
    step = tf.where(tf.not_equal(up, value < 0), tf.ones([], bits_dtype), -tf.ones([], bits_dtype))
    bits = tf.bitcast(value, bits_dtype)
    moved = tf.bitcast(bits + step, value.dtype)
    moved = tf.where(tf.math.is_finite(moved), moved, tf.bitcast(bits - step, value.dtype))  # not past the largest
    return tf.where(tf.math.is_finite(value) & tf.not_equal(value, 0) & ~whole, moved, value)


def _is_typed_literal(value) -> bool:
    """Whether ``value`` is a Python number or a (nested) list or tuple of them.

    Such a value is what the author typed (``tf.Variable(1.5)``, ``tf.Variable([3.0, 4.0])``):
    the same on every CPU, often placed exactly on the point a chapter is about (b = 1,
    x = -50), so the perturbation leaves it. Values computed by TensorFlow or NumPy
    (initialisers, random draws, arrays) are what another CPU may round differently.
    """
    if isinstance(value, (bool, int, float)):
        return True
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(_is_typed_literal(v) for v in value)


def _perturbing_creator(next_creator, **kwargs):
    import tensorflow as tf

    from companion import _tf_internals

    seed = _perturbation["seed"]
    initial = kwargs.get("initial_value")
    if (
        seed is None
        or initial is None
        or _is_typed_literal(initial)
        or tf.distribute.has_strategy()
        or _tf_internals.is_checkpoint_restore(initial)
    ):
        return next_creator(**kwargs)
    index = _perturbation["count"]
    _perturbation["count"] = index + 1
    dtype = kwargs.get("dtype")
    if callable(initial):
        kwargs["initial_value"] = lambda: _one_ulp_away(initial(), seed, index, dtype)
    else:
        try:
            kwargs["initial_value"] = _one_ulp_away(initial, seed, index, dtype)
        except (TypeError, ValueError):  # not convertible to the dtype: tf.Variable says why
            pass
    return next_creator(**kwargs)


def _perturb_new_variables(seed: int | None) -> None:
    """Move every variable created from now on by one ulp (``seed``), or stop (``None``)."""
    _perturbation["seed"] = seed
    _perturbation["count"] = 0
    thread = threading.get_ident()
    if seed is not None and thread not in _perturbing_threads:
        import tensorflow as tf

        scope = tf.variable_creator_scope(_perturbing_creator)
        scope.__enter__()  # for the rest of the process: kept referenced so it is never closed
        _perturbing_threads[thread] = scope


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
#: that its header is no wider than the page (tests/test_browser.py measures it).
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
    (:data:`TABLE_STYLE`, inline, so Jupyter and Colab show it too): padding and rules
    between cells, numbers right-aligned in tabular figures, long column names broken
    into a few balanced lines, shorter ones the more columns there are
    (:data:`HEADER_WIDTH`).

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
