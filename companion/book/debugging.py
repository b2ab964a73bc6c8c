"""TensorFlow's and Keras' own NaN tools, run on one of the chapter's failures.

The chapter *Finding your own NaN* compares what a reader already has with the NaN
doctor, on the same rebuilt report (:func:`companion.book.reports.rebuild`), trained with
``fit`` as compiled by its reporter and again with XLA (``jit_compile=True``):

* ``tf.debugging.check_numerics(loss, ...)`` in the user's loss: raises at a non-finite
  loss, naming only the message it was given. Under XLA it compiles to the identity
  (TensorFlow issue #117319), and training goes on.
* ``tf.debugging.enable_check_numerics()``: a check after every op of every graph and
  eager op; the first non-finite output raises ``InvalidArgumentError`` naming the op and
  the stack that created it. Under XLA the step does not compile: the check's summary op
  has no XLA kernel.
* TensorFlow's Debugger V2, ``tf.debugging.experimental.enable_dump_debug_info``: every
  op's output summarised (``FULL_HEALTH``: counts of ``-inf``, ``+inf`` and ``NaN``) and
  written to a directory, read back afterwards
  (``tensorflow.python.debug.lib.debug_events_reader.DebugDataReader``, what TensorBoard's
  debugger plugin reads). It does not stop training.
* Keras' ``TerminateOnNaN``: stops ``fit`` after the batch whose logged loss is ``NaN``
  or infinite, after that batch's update.
* :class:`companion.diagnostics.NaNDoctor`.

Each run says what the tool told the reader (an op, a line, a batch), whether it
stopped, and whether the weights were finite afterwards: :class:`ToolRun`.
:func:`compare_tools` runs them all. Keras drops ``jit_compile=True`` (with a warning)
while TensorFlow's op determinism is on, as :func:`companion.book.notebook.setup` turns it
on; :func:`xla_allowed` turns it off while a model is compiled, so that the XLA runs are
XLA (``ToolRun.xla`` says what the model ran with).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import shutil
import tempfile
from typing import Iterator

import keras
import numpy as np
import tensorflow as tf

from companion import _internal

__all__ = [
    "TOOLS",
    "ToolRun",
    "check_numerics_op_run",
    "check_numerics_run",
    "compare_tools",
    "debugger_v2_run",
    "nan_doctor_run",
    "terminate_on_nan_run",
    "xla_allowed",
]

#: The tools :func:`compare_tools` runs, in the order of its rows.
TOOLS = ("check_numerics op", "enable_check_numerics", "Debugger V2", "TerminateOnNaN", "NaNDoctor")


@dataclasses.dataclass(frozen=True)
class ToolRun:
    """What one tool told the reader about one training run.

    Attributes:
        tool: one of :data:`TOOLS`.
        xla: whether the training step ran under XLA (the model's ``jit_compile``).
        stopped: whether training stopped (an error, or ``fit`` ended early).
        op: the op type the tool named, or ``None``.
        line: ``"file:line"`` of the user's code the tool named, or ``None``.
        batch: ``"epoch e, batch b"`` the tool named, or ``None``.
        weights_finite: whether every weight was finite after the run.
        failed: the tool's own failure, if it made training fail for another reason
            than a ``NaN`` (``None`` otherwise).
    """

    tool: str
    xla: bool
    stopped: bool
    op: str | None
    line: str | None
    batch: str | None
    weights_finite: bool
    failed: str | None = None


def _determinism_enabled() -> bool:
    return _internal.op_determinism_enabled()  # where Keras reads it (no public getter)


@contextlib.contextmanager
def xla_allowed() -> Iterator[None]:
    """TensorFlow's op determinism off inside the block, as it was after it.

    Keras compiles a model with ``jit_compile=False`` (and warns) while op determinism
    is on; a model compiled inside this block keeps ``jit_compile=True``.
    """
    was = _determinism_enabled()
    _internal.disable_op_determinism()  # the public API can only enable it
    try:
        yield
    finally:
        if was:
            tf.config.experimental.enable_op_determinism()


def _rebuild(key: str, xla: bool):
    from companion.book.reports import rebuild  # noqa: PLC0415 - reports imports Keras models

    r = rebuild(key)
    with xla_allowed():
        r.model.compile(optimizer=keras.optimizers.SGD(0.01), loss=r.model.loss, jit_compile=xla)
    return r


def _fit(r, callbacks=()):
    if isinstance(r.data, tf.data.Dataset):
        return r.model.fit(r.data, epochs=r.epochs, verbose=0, callbacks=list(callbacks))
    x, y = r.data
    return r.model.fit(x, y, batch_size=32, epochs=r.epochs, verbose=0, shuffle=False, callbacks=list(callbacks))


def _finite(model) -> bool:
    return all(bool(np.isfinite(v.numpy()).all()) for v in model.weights)


def _user_frame(frames) -> str | None:
    """``"file:line"`` of the last frame outside TensorFlow, Keras and Python's own code."""
    library = (os.sep + "tensorflow" + os.sep, os.sep + "keras" + os.sep, "site-packages", "dist-packages")
    found = None
    for filename, lineno, *_ in frames:
        if not any(part in filename for part in library) and not filename.startswith("<"):
            found = f"{os.path.basename(filename)}:{lineno}"
    return found


def _unsupported(error: Exception) -> str:
    found = re.search(r"unsupported operations[^:]*: (\w+)", str(error))
    return f"{found.group(1) if found else 'an op'} has no XLA kernel"


def check_numerics_run(key: str, xla: bool) -> ToolRun:
    """Train rebuild ``key`` with ``fit`` under ``tf.debugging.enable_check_numerics``.

    The op is the one the ``InvalidArgumentError`` names; the line is the last frame
    outside TensorFlow and Keras of the stack it says the op was defined at. Under XLA
    the step does not compile (``failed`` says why).
    """
    r = _rebuild(key, xla)
    op = line = failed = None
    tf.debugging.enable_check_numerics()
    try:
        _fit(r)
        stopped = False
    except tf.errors.InvalidArgumentError as error:
        stopped, message = True, str(error)
        if "unsupported operations" in message:
            failed = _unsupported(error)
        else:
            found = re.search(r'of graph op "(\w+)"', message) or re.search(r'of op "?(\w+)"?', message)
            op = found.group(1) if found else None
            line = _user_frame((f, int(n)) for f, n in re.findall(r'File "([^"]+)", line (\d+)', message))
    finally:
        tf.debugging.disable_check_numerics()
    return ToolRun("enable_check_numerics", bool(r.model.jit_compile), stopped, op, line, None, _finite(r.model),
                   failed)


def check_numerics_op_run(key: str, xla: bool) -> ToolRun:
    """Train rebuild ``key`` with its loss checked by ``tf.debugging.check_numerics``.

    The loss is ``tf.debugging.check_numerics(loss(y, p), "loss")``, as a user adds it
    (and as case A's answer recommends). Under XLA the op compiles to the identity
    (TensorFlow issue #117319) and checks nothing.
    """
    r = _rebuild(key, xla)
    loss = keras.losses.get(r.model.loss)

    def checked(y_true, y_pred):
        return tf.debugging.check_numerics(loss(y_true, y_pred), "loss")

    with xla_allowed():
        r.model.compile(optimizer=keras.optimizers.SGD(0.01), loss=checked, jit_compile=xla)
    try:
        _fit(r)
        stopped, op = False, None
    except tf.errors.InvalidArgumentError:
        stopped, op = True, "CheckNumerics"
    return ToolRun("check_numerics op", bool(r.model.jit_compile), stopped, op, None, None, _finite(r.model))


def debugger_v2_run(key: str, xla: bool, dump_root: str | None = None) -> ToolRun:
    """Train rebuild ``key`` with ``fit`` under Debugger V2, then read its dump.

    The dump (``FULL_HEALTH``: counts of infinities and ``NaN``\\ s of every op's output
    in every graph) goes to ``dump_root`` (a new temporary directory if ``None``, removed
    afterwards). The op is the first graph op whose output held a ``NaN`` or an
    infinity, and the line the last frame of its creation stack outside TensorFlow and
    Keras.
    """
    debug_events_reader = _internal.debug_events_reader()  # Debugger V2's reader

    r = _rebuild(key, xla)
    root = dump_root or tempfile.mkdtemp(prefix="debugger_v2_")
    writer = tf.debugging.experimental.enable_dump_debug_info(
        root, tensor_debug_mode="FULL_HEALTH", circular_buffer_size=-1)
    failed = None
    try:
        history = _fit(r)
    except tf.errors.InvalidArgumentError as error:  # XLA has no kernel for the debugger's summary op
        history, failed = None, _unsupported(error)
    finally:
        writer.FlushNonExecutionFiles()
        writer.FlushExecutionFiles()
        tf.debugging.experimental.disable_dump_debug_info()
    op = line = None
    try:
        with debug_events_reader.DebugDataReader(root) as reader:
            reader.update()
            for trace in reader.graph_execution_traces():
                # FULL_HEALTH: [tensor id, device id, dtype, rank, size, -inf, +inf, nan, neg, zero, pos]
                health = reader.graph_execution_trace_to_tensor_value(trace)
                if any(health[5:8]):
                    op = trace.op_type
                    creation = reader.graph_by_id(trace.graph_id).get_op_creation_digest(trace.op_name)
                    line = _user_frame(reader.read_graph_op_creation_stack_trace(creation)[1])
                    break
    finally:
        if dump_root is None:
            shutil.rmtree(root, ignore_errors=True)
    stopped = history is None or len(history.history.get("loss", ())) < r.epochs
    return ToolRun("Debugger V2", bool(r.model.jit_compile), stopped, op, line, None, _finite(r.model), failed)


class _Batches(keras.callbacks.Callback):
    """The epoch and batch of the last batch ``fit`` ended."""

    def __init__(self):
        super().__init__()
        self.epoch = self.batch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.batch = batch


def terminate_on_nan_run(key: str, xla: bool) -> ToolRun:
    """Train rebuild ``key`` with ``fit`` and Keras' ``TerminateOnNaN``.

    The batch is the one after which ``fit`` stopped (the first whose logged loss is
    not finite); ``TerminateOnNaN`` names no op and no line.
    """
    r = _rebuild(key, xla)
    seen = _Batches()
    with contextlib.redirect_stdout(io.StringIO()):  # its "Batch 0: Invalid loss, terminating training"
        _fit(r, callbacks=[seen, keras.callbacks.TerminateOnNaN()])
    stopped = bool(r.model.stop_training)
    batch = f"epoch {seen.epoch}, batch {seen.batch}" if stopped else None
    return ToolRun("TerminateOnNaN", bool(r.model.jit_compile), stopped, None, None, batch, _finite(r.model))


def nan_doctor_run(key: str, xla: bool) -> ToolRun:
    """Train rebuild ``key`` with ``fit`` and :class:`companion.diagnostics.NaNDoctor`."""
    from companion.diagnostics import NaNDoctor  # noqa: PLC0415 - the book's support, not the library's

    r = _rebuild(key, xla)
    doctor = NaNDoctor(verbose=False)
    _fit(r, callbacks=[doctor])
    d = doctor.diagnosis
    if d is None:
        return ToolRun("NaNDoctor", bool(r.model.jit_compile), False, None, None, None, _finite(r.model))
    line = None
    if d.source:
        filename, _, number = d.source.rpartition(":")
        line = f"{os.path.basename(filename)}:{number}"
    batch = f"epoch {d.epoch}, batch {d.batch}" if d.epoch is not None else f"batch {d.batch}"
    return ToolRun("NaNDoctor", bool(r.model.jit_compile), bool(r.model.stop_training), d.op, line, batch,
                   _finite(r.model))


def compare_tools(key: str = "probabilities_crossentropy") -> list[ToolRun]:
    """Every tool of :data:`TOOLS` on rebuild ``key``, with ``fit`` as compiled and with XLA.

    Args:
        key: a key of :data:`companion.book.reports.REPORTS` trained with ``fit``.

    Returns:
        A :class:`ToolRun` per tool, without XLA then with it (ten in all).

    Example:
        >>> runs = compare_tools()
        >>> [(run.tool, run.xla, run.op) for run in runs[:2]]
        [('check_numerics op', False, 'CheckNumerics'), ('enable_check_numerics', False, 'Log')]
    """
    runs = []
    for xla in (False, True):
        runs += [check_numerics_op_run(key, xla), check_numerics_run(key, xla), debugger_v2_run(key, xla),
                 terminate_on_nan_run(key, xla), nan_doctor_run(key, xla)]
    return runs
