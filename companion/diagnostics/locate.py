"""Where the first NaN or Inf of a function appears: :func:`locate_nonfinite`.

It runs a function op by op under an :class:`~companion.diagnostics.trace.OpTracer`
and stops at the first op whose floating-point or complex output is not finite. For
an op of the backward pass it reports the forward op it differentiates, that op's
layer and the line that created it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from companion import _internal
from companion.diagnostics.sources import source_text
from companion.diagnostics.trace import FirstNonFinite, OpEvent, OpTracer, eager_trace, nonfinite_mask

__all__ = ["NonFiniteLocation", "locate_nonfinite"]


@dataclasses.dataclass(frozen=True)
class NonFiniteLocation:
    """Where the first NaN or Inf appeared, as found by :func:`locate_nonfinite`.

    Attributes:
        op_type: type of the op whose output was not finite, e.g. ``"Log"`` or
            ``"SqrtGrad"``.
        op_name: a readable name for that op: the TensorFlow name scope it ran in
            followed by its type, e.g. ``"sequential/dense/MatMul"``; ops of the
            backward pass run in the ``"gradient_tape"`` scope, as in TensorFlow's own
            gradient graphs.
        phase: ``"forward"`` or ``"gradient"`` (the op ran inside
            ``GradientTape.gradient``).
        gradient_of: for a gradient op, the type of the forward op whose registered
            gradient produced the value (``"Sqrt"`` for ``"SqrtGrad"``); else ``None``.
        layer: path of the innermost Keras layer whose ``call`` was running; for a
            gradient op, the layer of the forward op it differentiates.
        filename: file of the innermost line of user code (not TensorFlow or Keras)
            that created the op; for a gradient op, the line that created the forward
            op (as PyTorch's anomaly mode reports it).
        lineno: its line number.
        source: the text of that line.
        dtype: dtype of the non-finite tensor, e.g. ``"float32"``.
        shape: its shape.
        nan_count: number of NaN entries (a complex entry counts once).
        inf_count: number of ``+Inf`` and ``-Inf`` entries.
        message: a one-line summary.
        gradient_filename: for a gradient op, the user file where the tape ran it
            (the line of ``tape.gradient``); else ``None``.
        gradient_lineno: its line number.
    """

    op_type: str
    op_name: str
    phase: str
    gradient_of: str | None
    layer: str | None
    filename: str | None
    lineno: int | None
    source: str | None
    dtype: str | None
    shape: tuple[int | None, ...] | None
    nan_count: int
    inf_count: int
    message: str = dataclasses.field(repr=False)
    gradient_filename: str | None = None
    gradient_lineno: int | None = None

    def __str__(self) -> str:
        kind = f"gradient of {self.gradient_of}" if self.gradient_of else self.phase
        counts = []
        if self.nan_count:
            counts.append(f"{self.nan_count} NaN")
        if self.inf_count:
            counts.append(f"{self.inf_count} Inf")
        lines = [
            f"first non-finite value: output of op {self.op_type} ({kind})",
            f"  op name:   {self.op_name}",
            f"  tensor:    {self.dtype} {self.shape}" + (f", {', '.join(counts)}" if counts else ""),
        ]
        if self.layer:
            lines.append(f"  layer:     {self.layer}")
        if self.filename is not None:
            label = "forward:  " if self.gradient_of else "user code:"
            lines.append(f"  {label} {os.path.basename(self.filename)}:{self.lineno}: {self.source}")
        if self.gradient_filename is not None:
            name = os.path.basename(self.gradient_filename)
            lines.append(f"  gradient:  {name}:{self.gradient_lineno}")
        return "\n".join(lines)

    def _repr_pretty_(self, printer, cycle) -> None:  # IPython's text view: str, no full paths
        printer.text(str(self))

    def _repr_html_(self) -> str:
        """The location as a two-column HTML table (Jupyter, Colab and the book render it)."""
        from companion._tables import html_table  # noqa: PLC0415 - display only

        counts = ", ".join(
            text for n, text in ((self.nan_count, f"{self.nan_count} NaN"), (self.inf_count, f"{self.inf_count} Inf")) if n
        )
        rows = [
            ("op", self.op_type),
            ("phase", f"gradient of {self.gradient_of}" if self.gradient_of else self.phase),
            ("op name", self.op_name),
            ("tensor", f"{self.dtype} {self.shape}" + (f", {counts}" if counts else "")),
        ]
        if self.layer:
            rows.append(("layer", self.layer))
        if self.filename is not None:
            where = f"{os.path.basename(self.filename)}:{self.lineno}: {self.source}"
            rows.append(("forward op's line" if self.gradient_of else "user code", where))
        if self.gradient_filename is not None:
            rows.append(("tape.gradient", f"{os.path.basename(self.gradient_filename)}:{self.gradient_lineno}"))
        return html_table(rows, ["", "first non-finite value"]).html()


def count_nonfinite(array: np.ndarray) -> tuple[int, int]:
    """NaN and Inf counts of ``array`` (a complex entry with a NaN part counts as NaN)."""
    bad = nonfinite_mask(array)
    if np.iscomplexobj(array):
        nan = np.isnan(array.real) | np.isnan(array.imag)
    else:
        nan = np.isnan(array.astype(np.float64) if array.dtype.itemsize < 4 else array)
    return int(np.count_nonzero(nan)), int(np.count_nonzero(bad & ~nan))


def first_bad_output(event: OpEvent) -> np.ndarray:
    """The first output of the event's op that holds a NaN or an Inf."""
    for value in event.outputs:
        if value is not None and value.size and nonfinite_mask(value).any():
            return value
    raise ValueError("the event has no non-finite output")  # pragma: no cover


def dtype_name(array: np.ndarray) -> str:
    """TensorFlow's name of a NumPy array's dtype (``"float32"``, ``"bfloat16"``)."""
    return tf.as_dtype(array.dtype).name


def location_of(event: OpEvent) -> NonFiniteLocation:
    """A :class:`NonFiniteLocation` from a tracer's event."""
    record = event.record
    value = first_bad_output(event)
    nan_count, inf_count = count_nonfinite(value)
    where = event.forward if event.backward and event.forward is not None else record
    scope = record.scope.strip("/")
    if event.backward and not scope.startswith("gradient_tape"):
        scope = "gradient_tape/" + scope if scope else "gradient_tape"
    op_name = f"{scope}/{record.op_type}" if scope else record.op_type
    kind = f"gradient of {event.forward_type}" if event.backward else "forward"
    return NonFiniteLocation(
        op_type=record.op_type,
        op_name=op_name,
        phase="gradient" if event.backward else "forward",
        gradient_of=event.forward_type,
        layer=where.layer,
        filename=where.filename,
        lineno=where.lineno,
        source=source_text(where.filename, where.lineno),
        dtype=dtype_name(value),
        shape=tuple(int(d) for d in value.shape),
        nan_count=nan_count,
        inf_count=inf_count,
        message=f"{nan_count} NaN and {inf_count} Inf in the output of {record.op_type} ({kind})",
        gradient_filename=record.filename if event.backward else None,
        gradient_lineno=record.lineno if event.backward else None,
    )


def locate_nonfinite(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> NonFiniteLocation | None:
    """Run ``fn(*args, **kwargs)`` op by op and say where the first NaN/Inf appears.

    ``fn`` runs eagerly, op by op, with an op callback that checks every floating-point
    and complex output, so the first op (of the forward pass or, if ``fn`` calls
    ``tape.gradient``, of the backward pass) whose output contains a NaN or an Inf
    stops it. The op is reported with its type, a name (name scope + type), the Keras
    layer it ran in, and the line of user code that created it; for a gradient op, the
    forward op it differentiates, and that op's layer and line.

    Why eager and without XLA: an op callback sees each op's values only when ops run
    one by one. Inside a function compiled with XLA (``jit_compile=True``, as in
    ``model.compile(jit_compile=True)`` or :func:`companion.training.train`)
    :func:`tf.debugging.enable_check_numerics` either breaks the compilation or is
    dropped (TensorFlow issue #59215), so a NaN goes unreported. While ``fn`` runs,
    :func:`tf.config.run_functions_eagerly` is therefore ``True`` (every
    ``tf.function``, compiled or not, runs as plain Python); a user's
    ``enable_check_numerics`` is paused. Both are restored afterwards, even if ``fn``
    raises. :func:`companion.diagnostics.diagnose` also says when the compiled code and
    the op-by-op run disagree.

    Caveat: an intermediate Inf that is harmless by design (``-inf`` attention masks,
    ``log(0)`` in the untaken branch of a ``tf.where``) is reported as well; that is
    often exactly the bug (see the double-where), but not always.

    Args:
        fn: the code to check, e.g. a function that runs the model and
            ``tape.gradient``.
        *args: positional arguments for ``fn``.
        **kwargs: keyword arguments for ``fn``.

    Returns:
        A :class:`NonFiniteLocation`, or ``None`` if ``fn`` ran to the end and every
        checked op output was finite.

    Raises:
        TypeError: if ``fn`` is not callable.
        Exception: whatever ``fn`` raises.

    Example:
        >>> x = tf.Variable([0.0, 1.0])
        >>> def step():
        ...     with tf.GradientTape() as tape:
        ...         y = tf.reduce_sum(tf.sqrt(x))
        ...     return tape.gradient(y, x)
        >>> where = locate_nonfinite(step)
        >>> where.op_type, where.phase, where.gradient_of
        ('SqrtGrad', 'gradient', 'Sqrt')
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__} {fn!r}")
    tf_filtering = tf.debugging.is_traceback_filtering_enabled()
    keras_filtering = keras.config.is_traceback_filtering_enabled()
    was_checking = _internal.check_numerics_enabled()
    tracer = OpTracer(stop_at_first=True)
    try:
        tf.debugging.disable_traceback_filtering()
        keras.config.disable_traceback_filtering()
        if was_checking:  # the user's check would raise first, without layer or line
            tf.debugging.disable_check_numerics()
        with eager_trace(tracer):
            try:
                fn(*args, **kwargs)
            except Exception as error:
                # The tracer stopped fn (a library may have re-wrapped its exception).
                if isinstance(error, FirstNonFinite) or (tracer.stopped and tracer.events):
                    return location_of(tracer.events[0])
                raise
        return None
    finally:
        if was_checking:
            tf.debugging.enable_check_numerics()
        if tf_filtering:
            tf.debugging.enable_traceback_filtering()
        if keras_filtering:
            keras.config.enable_traceback_filtering()
