"""Which variables receive non-finite gradients on one batch.

:func:`nonfinite_gradients` runs one forward and backward pass, applies no update, and
returns a :class:`GradientReport`: one :class:`GradientRecord` per variable.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Sequence

import keras
import tensorflow as tf

from companion._gradients import gradient_values
from companion.diagnostics.state import restore, snapshot
from companion.losses import mean_loss, resolve_loss

__all__ = [
    "GradientRecord",
    "GradientReport",
    "nonfinite_gradients",
]


# --------------------------------------------------------------------------------------
# Per-variable gradient records
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GradientRecord:
    """What one variable's gradient looked like on one batch.

    Attributes:
        path: the variable's Keras path, e.g. ``"sequential/dense/kernel"``.
        shape: the variable's shape.
        nan_count: number of NaN entries in the gradient.
        inf_count: number of ``+Inf`` or ``-Inf`` entries in the gradient.
        max_abs: the largest finite magnitude in the gradient; ``nan`` if no entry is
            finite, ``0.0`` if the variable received no gradient, ``None`` if not
            measured (the reports of :func:`companion.training.train` leave it out to
            keep the training step cheap).
        has_gradient: ``False`` if the loss does not depend on the variable (its
            gradient is ``None``).
    """

    path: str
    shape: tuple[int, ...]
    nan_count: int
    inf_count: int
    max_abs: float | None
    has_gradient: bool = True

    @property
    def finite(self) -> bool:
        """``True`` if the gradient has no NaN and no Inf entry."""
        return self.nan_count == 0 and self.inf_count == 0

    def __str__(self) -> str:
        if not self.has_gradient:
            return f"{self.path} {self.shape}: no gradient"
        text = f"{self.path} {self.shape}: {self.nan_count} NaN, {self.inf_count} Inf"
        if self.max_abs is not None:
            text += f", max |finite| {_format_float(self.max_abs)}"
        return text


class GradientReport(tuple):
    """A tuple of :class:`GradientRecord`, one per variable, that prints as a table.

    It is what :func:`nonfinite_gradients` returns. Being a tuple, it can be indexed and
    iterated; :attr:`nonfinite` keeps the records with a NaN or Inf entry, and
    ``str(report)`` (or :meth:`table`) formats all records as an aligned table.

    Example:
        >>> report = GradientReport([GradientRecord("dense/kernel", (2, 1), 1, 0, 0.5)])
        >>> report.all_finite
        False
        >>> print(report)  # doctest: +NORMALIZE_WHITESPACE
        variable      shape   NaN  Inf  max |finite|
        dense/kernel  (2, 1)    1    0      5.00e-01
    """

    def __new__(cls, records: Iterable[GradientRecord] = ()) -> "GradientReport":
        records = tuple(records)
        for record in records:
            if not isinstance(record, GradientRecord):
                raise TypeError(f"GradientReport holds GradientRecord objects, got {type(record).__name__}")
        return super().__new__(cls, records)

    @property
    def nonfinite(self) -> "GradientReport":
        """The records whose gradient has at least one NaN or Inf entry."""
        return GradientReport(r for r in self if not r.finite)

    @property
    def all_finite(self) -> bool:
        """``True`` if every gradient is finite."""
        return all(r.finite for r in self)

    def table(self) -> str:
        """The records as an aligned text table: variable, shape, NaN and Inf counts, largest finite magnitude."""
        header = ("variable", "shape", "NaN", "Inf", "max |finite|")
        rows = [
            (
                r.path,
                str(r.shape),
                str(r.nan_count) if r.has_gradient else "-",
                str(r.inf_count) if r.has_gradient else "-",
                _format_float(r.max_abs) if r.has_gradient else "no gradient",
            )
            for r in self
        ]
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        lines = []
        for row in [header, *rows]:
            cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1])]
            cells += [cell.rjust(width) for cell, width in zip(row[2:], widths[2:])]
            lines.append("  ".join(cells).rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return f"GradientReport({list(self)!r})"

    def _repr_pretty_(self, printer, cycle) -> None:  # IPython display
        printer.text(self.table())

    def _repr_html_(self) -> str:
        """The table as the book's HTML table (Jupyter, Colab and the book render it)."""
        from companion._tables import html_table  # noqa: PLC0415 - display only

        rows = [
            (
                r.path,
                str(r.shape),
                r.nan_count if r.has_gradient else "-",
                r.inf_count if r.has_gradient else "-",
                _format_float(r.max_abs) if r.has_gradient else "no gradient",
            )
            for r in self
        ]
        return html_table(rows, ["variable", "shape", "NaN", "Inf", "max |finite|"]).html()


def _format_float(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isnan(value):  # a max_abs of NaN: no entry of the gradient is finite
        return "none finite"
    return f"{value:.2e}"


def _gradient_statistics(gradients: Sequence[Any]) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """NaN counts, Inf counts and largest finite magnitudes, one entry per gradient.

    ``None`` gradients count as 0 NaN, 0 Inf, magnitude 0; a gradient without any
    finite entry has magnitude NaN. All gradients are flattened into one vector and
    reduced with three segment reductions, so the compiled size does not grow with the
    number of variables. Works eagerly, in graphs and under XLA.
    """
    count = len(gradients)
    nan_flags, inf_flags, magnitudes, segments = [], [], [], []
    for index, gradient in enumerate(gradients):
        if gradient is None:
            continue
        values = tf.reshape(gradient_values(gradient), [-1])
        finite = tf.math.is_finite(values)
        nan_flags.append(tf.cast(tf.math.is_nan(values), tf.int64))
        inf_flags.append(tf.cast(tf.math.is_inf(values), tf.int64))
        # -1 marks a non-finite entry, so a segment whose maximum is -1 has no finite entry.
        magnitudes.append(tf.cast(tf.where(finite, tf.abs(values), -tf.ones_like(values)), tf.float32))
        segments.append(tf.fill(tf.shape(values), index))
    if not segments:
        zeros = tf.zeros([count], tf.int64)
        return zeros, zeros, tf.zeros([count], tf.float32)
    segment_ids = tf.concat(segments, 0)
    nan_counts = tf.math.unsorted_segment_sum(tf.concat(nan_flags, 0), segment_ids, count)
    inf_counts = tf.math.unsorted_segment_sum(tf.concat(inf_flags, 0), segment_ids, count)
    largest = tf.math.unsorted_segment_max(tf.concat(magnitudes, 0), segment_ids, count)
    has_gradient = tf.constant([g is not None for g in gradients])
    max_abs = tf.where(
        has_gradient,
        tf.where(largest < 0, tf.constant(float("nan"), tf.float32), largest),
        tf.zeros_like(largest),
    )
    return nan_counts, inf_counts, max_abs


def _records(variables, nan_counts, inf_counts, max_abs, has_gradient) -> GradientReport:
    return GradientReport(
        GradientRecord(
            path=_variable_path(v),
            shape=tuple(int(d) for d in v.shape),
            nan_count=int(n),
            inf_count=int(i),
            max_abs=float(m),
            has_gradient=bool(h),
        )
        for v, n, i, m, h in zip(variables, nan_counts, inf_counts, max_abs, has_gradient)
    )


def _variable_path(variable) -> str:
    return str(getattr(variable, "path", None) or getattr(variable, "name", "variable"))


def _split_batch(batch) -> tuple[Any, Any]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    described = f"a {type(batch).__name__}"
    if isinstance(batch, (tuple, list)):
        described += f" of length {len(batch)}"
    raise TypeError(f"batch must be an (inputs, targets) pair, got {described}")


# --------------------------------------------------------------------------------------
# nonfinite_gradients
# --------------------------------------------------------------------------------------


def nonfinite_gradients(model: keras.layers.Layer, loss: Callable | str, batch: tuple[Any, Any]) -> GradientReport:
    """Gradients of ``loss`` on one batch, summarised per variable, without any update.

    It runs ``model(inputs, training=True)``, the loss (averaged over the batch, plus the
    model's regularisation losses, exactly as :func:`companion.training.train` computes
    it) and its gradient with respect to every trainable variable, and counts the NaN
    and Inf entries of each gradient. Nothing is updated: variables that the forward
    pass itself changes (batch-normalisation statistics, dropout seeds) are restored.

    Args:
        model: a built or unbuilt Keras model (any :class:`keras.layers.Layer`).
        loss: ``loss(y_true, y_pred)``: any callable, a :class:`keras.losses.Loss`, or a
            Keras loss name such as ``"mse"``.
        batch: an ``(inputs, targets)`` pair, e.g. one element of a ``tf.data.Dataset``.

    Returns:
        A :class:`GradientReport`: one :class:`GradientRecord` (path, shape, NaN count,
        Inf count, largest finite magnitude) per trainable variable, in the order of
        ``model.trainable_variables``; ``print`` it for a table, use ``.nonfinite`` for
        the offenders.

    Raises:
        TypeError: if ``model`` is not a Keras layer or model, ``loss`` is not callable,
            or ``batch`` is not a pair.
        ValueError: if the model has no trainable variables, or predictions and targets
            have incompatible shapes.

    Example:
        >>> head = keras.layers.Dense(1, name="head")
        >>> model = keras.Sequential([keras.Input((1,)), head], name="net")
        >>> batch = (tf.constant([[float("nan")]]), tf.constant([[0.0]]))
        >>> report = nonfinite_gradients(model, "mse", batch)
        >>> [r.path for r in report.nonfinite]
        ['net/head/kernel', 'net/head/bias']
    """
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(f"model must be a Keras model (keras.Model or keras.layers.Layer), got {type(model).__name__}")
    loss = resolve_loss(loss)
    x, y = _split_batch(batch)
    x = tf.nest.map_structure(tf.convert_to_tensor, x)
    y = tf.nest.map_structure(tf.convert_to_tensor, y)
    if not model.built:
        model(x)
    variables = list(model.trainable_variables)
    if not variables:
        raise ValueError(f"model {model.name!r} has no trainable variables")
    saved = snapshot(model.non_trainable_variables)  # every replica's copy, each restored to itself
    try:
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            value = mean_loss(loss, y, y_pred)
            if model.losses:
                value = value + tf.cast(tf.add_n(model.losses), value.dtype)
        gradients = tape.gradient(value, variables)
    finally:
        restore(saved)
    nan_counts, inf_counts, max_abs = _gradient_statistics(gradients)
    return _records(
        variables,
        nan_counts.numpy(),
        inf_counts.numpy(),
        max_abs.numpy(),
        [g is not None for g in gradients],
    )
