"""Which gradients are non-finite, and where the first NaN appears.

Two tools for the two questions one asks when training turns NaN:

* :func:`nonfinite_gradients` answers *which variables* receive NaN or Inf gradients
  on a given batch: one forward and backward pass, no update, a record per variable.
* :func:`locate_nonfinite` answers *where* the first non-finite value is produced:
  it runs a function eagerly under TensorFlow's numerics checks and reports the op
  (forward or gradient), its name scope, the Keras layer and the line of user code.

Both return plain frozen dataclasses with a readable ``str``, so a chapter can simply
``print`` them.
"""

from __future__ import annotations

import dataclasses
import linecache
import math
import os
import sysconfig
import traceback
from typing import Any, Callable, Iterable, Sequence

import keras
import tensorflow as tf

from companion import _tf_internals
from companion._gradients import gradient_values
from companion.losses import mean_loss, resolve_loss

__all__ = [
    "GradientRecord",
    "GradientReport",
    "NonFiniteLocation",
    "locate_nonfinite",
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
        >>> model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, name="head")], name="net")
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
    state = list(model.non_trainable_variables)
    saved = [tf.identity(v.value) for v in state]
    try:
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            value = mean_loss(loss, y, y_pred)
            if model.losses:
                value = value + tf.cast(tf.add_n(model.losses), value.dtype)
        gradients = tape.gradient(value, variables)
    finally:
        for v, s in zip(state, saved):
            v.assign(s)
    nan_counts, inf_counts, max_abs = _gradient_statistics(gradients)
    return _records(
        variables,
        nan_counts.numpy(),
        inf_counts.numpy(),
        max_abs.numpy(),
        [g is not None for g in gradients],
    )


# --------------------------------------------------------------------------------------
# locate_nonfinite
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NonFiniteLocation:
    """Where the first NaN or Inf appeared, as found by :func:`locate_nonfinite`.

    Attributes:
        op_type: type of the op whose output was not finite, e.g. ``"Log"`` or
            ``"SqrtGrad"``.
        op_name: a readable name for that op. Eagerly executed ops have no graph name,
            so this is the TensorFlow name scope the op ran in followed by its type,
            e.g. ``"sequential/dense/MatMul"``; ops of the backward pass run in the
            ``"gradient_tape"`` scope, as in TensorFlow's own gradient graphs.
        phase: ``"forward"`` or ``"gradient"`` (the op ran inside
            ``GradientTape.gradient``).
        gradient_of: for a gradient op, the type of the forward op whose registered
            gradient produced the value (``"Sqrt"`` for ``"SqrtGrad"``); else ``None``.
        layer: path of the innermost Keras layer whose ``call`` was running, if any.
        filename: file of the innermost line of user code (not TensorFlow or Keras) on
            the stack; for a gradient op this is where ``tape.gradient`` was called.
        lineno: its line number.
        source: the text of that line.
        dtype: dtype of the non-finite tensor, e.g. ``"float32"``.
        shape: its shape.
        nan_count: number of NaN entries.
        inf_count: number of ``+Inf`` and ``-Inf`` entries.
        message: TensorFlow's full check-numerics message.
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
            lines.append(f"  user code: {os.path.basename(self.filename)}:{self.lineno}: {self.source}")
        return "\n".join(lines)


_LIBRARY_PACKAGES = frozenset(
    {"tensorflow", "keras", "tf_keras", "absl", "numpy", "tensorflow_probability", "ml_dtypes"}
)
_STDLIB = os.path.normcase(os.path.realpath(sysconfig.get_paths()["stdlib"]))


def _is_library_file(filename: str) -> bool:
    if filename == __file__ or filename.startswith("<frozen"):
        return True
    normalized = os.path.normcase(os.path.realpath(filename))
    parts = normalized.split(os.sep)
    for i, part in enumerate(parts[:-1]):
        if part in ("site-packages", "dist-packages") and parts[i + 1] in _LIBRARY_PACKAGES:
            return True
    return normalized.startswith(_STDLIB + os.sep) and "site-packages" not in parts


class _ScopeRecorder:
    """Op callback that remembers the type and name scope of the last eager op."""

    def __init__(self) -> None:
        self.last: tuple[str, str] | None = None

    def __call__(self, op_type, inputs, attrs, outputs, op_name=None, graph=None):
        if graph is None:
            op_type = op_type.decode() if isinstance(op_type, bytes) else str(op_type)
            if not op_type.startswith("CheckNumerics"):
                self.last = (op_type, tf.get_current_name_scope())
        return None


def _parse_location(error: tf.errors.InvalidArgumentError, recorder: _ScopeRecorder) -> NonFiniteLocation:
    message = error.message if hasattr(error, "message") else str(error)
    parsed = _tf_internals.parse_check_numerics_message(message)
    op_type = parsed["op_type"]

    phase, gradient_of, layer, user_frame = "forward", None, None, None
    for frame, lineno in traceback.walk_tb(error.__traceback__):
        code = frame.f_code
        kind, forward_op = _tf_internals.frame_phase(frame)
        if kind == "gradient function":
            phase, gradient_of = "gradient", forward_op
            layer = None  # layers on the stack belong to the caller, not to this op
        elif kind == "gradient":
            phase = "gradient"
        this = frame.f_locals.get("self")
        if phase == "forward" and isinstance(this, keras.layers.Layer) and code.co_name == "call":
            layer = str(getattr(this, "path", None) or this.name)
        if not _is_library_file(code.co_filename):
            user_frame = (code.co_filename, lineno)

    scope = None
    if recorder.last is not None and recorder.last[0] == op_type:
        scope = recorder.last[1]
    scope = scope.strip("/") if scope else ""
    if phase == "gradient" and not scope.startswith("gradient_tape"):
        scope = "gradient_tape/" + scope if scope else "gradient_tape"
    op_name = f"{scope}/{op_type}" if scope else op_type

    filename = lineno = source = None
    if user_frame is not None:
        filename, lineno = user_frame
        source = linecache.getline(filename, lineno).strip() or None
    return NonFiniteLocation(
        op_type=op_type,
        op_name=op_name,
        phase=phase,
        gradient_of=gradient_of,
        layer=layer,
        filename=filename,
        lineno=lineno,
        source=source,
        dtype=parsed["dtype"],
        shape=parsed["shape"],
        nan_count=parsed["nan_count"],
        inf_count=parsed["inf_count"],
        message=message.strip(),
    )


def locate_nonfinite(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> NonFiniteLocation | None:
    """Run ``fn(*args, **kwargs)`` under numerics checks and say where the first NaN/Inf appears.

    ``fn`` runs eagerly, op by op, with :func:`tf.debugging.enable_check_numerics`
    switched on, so the first op (of the forward pass or, if ``fn`` calls
    ``tape.gradient``, of the backward pass) whose floating-point output contains a NaN
    or an Inf stops it. The op is reported with its type, a name (name scope + type), the
    Keras layer it ran in, and the line of user code on the stack.

    Why eager and without XLA: :func:`tf.debugging.enable_check_numerics` works by
    instrumenting every op's output. Inside a function compiled with XLA
    (``jit_compile=True``, as in ``model.compile(jit_compile=True)`` or
    :func:`companion.training.train`) the check ops are either dropped or break the
    compilation (TensorFlow issue #59215), so a NaN goes unreported. While ``fn`` runs,
    :func:`tf.config.run_functions_eagerly` is therefore ``True`` (every
    ``tf.function``, compiled or not, runs as plain Python), and traceback filtering of
    TensorFlow and Keras is off so the stack shows the user's frames. All three settings
    and the check-numerics state are restored afterwards, even if ``fn`` raises.

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
        Exception: whatever ``fn`` raises, other than the check-numerics error.

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
    was_eager = tf.config.functions_run_eagerly()
    tf_filtering = tf.debugging.is_traceback_filtering_enabled()
    keras_filtering = keras.config.is_traceback_filtering_enabled()
    was_checking = _tf_internals.check_numerics_enabled()
    recorder = _ScopeRecorder()
    try:
        tf.config.run_functions_eagerly(True)
        tf.debugging.disable_traceback_filtering()
        keras.config.disable_traceback_filtering()
        if was_checking:  # re-register after the recorder so the recorder runs first
            tf.debugging.disable_check_numerics()
        with _tf_internals.op_callback(recorder):
            tf.debugging.enable_check_numerics()
            try:
                fn(*args, **kwargs)
            except tf.errors.InvalidArgumentError as error:
                if not _tf_internals.is_check_numerics_failure(error):
                    raise
                return _parse_location(error, recorder)
            finally:
                tf.debugging.disable_check_numerics()
        return None
    finally:
        if was_checking:
            tf.debugging.enable_check_numerics()
        tf.config.run_functions_eagerly(was_eager)
        if tf_filtering:
            tf.debugging.enable_traceback_filtering()
        if keras_filtering:
            keras.config.enable_traceback_filtering()
