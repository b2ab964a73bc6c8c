"""The op-by-op re-run: every eager op's output checked, every gradient op mapped back.

:class:`OpTracer` is a TensorFlow op callback. While it is registered and code runs
eagerly (``tf.config.run_functions_eagerly(True)`` makes every ``tf.function``, XLA
or not, run op by op), it sees each op with its input and output values, and:

* for an op of the forward pass, records the op's type, its Keras layer and the line
  of user code that created it (as PyTorch's anomaly mode records the forward
  traceback), indexed by the identity of its output tensors;
* for an op that the tape runs while differentiating (it runs under TensorFlow's
  ``_gradient_function`` for one forward op), finds that forward op's record from the
  tensors the tape hands to it, so a ``SqrtGrad`` is reported with the ``Sqrt``, the
  layer and the line that made it;
* keeps an :class:`OpEvent` for each op whose floating-point or complex output holds a
  NaN or an Inf (complex values count when their real or imaginary part is not
  finite: ``tf.debugging.check_numerics`` does not check complex tensors at all).

For graph construction (a ``dataset.map``, a ``tf.function`` that is traced rather
than run eagerly) the callback returns the op's outputs unchanged, as TensorFlow's
callback chain requires: each callback's return value becomes the next one's
``outputs``.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from typing import Any

import numpy as np
import tensorflow as tf

from companion import _internal
from companion.diagnostics.sources import where_in_user_code

# Ops that write a variable: the value they write (input 1) is checked.
_WRITE_OPS = frozenset({"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"})

# Ops whose outputs are handles, state or bookkeeping, never numbers to check.
_IGNORED_OPS = frozenset(
    {
        "VarHandleOp", "ReadVariableOp", "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
        "DestroyResourceOp", "CheckNumerics", "CheckNumericsV2", "Identity", "IdentityN", "NoOp",
        "StatelessRandomGetKeyCounter", "IteratorGetNext", "Const", "Placeholder",
    }
)


@dataclasses.dataclass(frozen=True)
class OpRecord:
    """One forward op as the tracer saw it when it ran.

    Attributes:
        op_type: e.g. ``"Sqrt"``.
        stage: what the caller said was running (``"forward"``, ``"loss"``, ...).
        scope: the TensorFlow name scope the op ran in (``"net/dense"``).
        layer: path of the innermost Keras layer whose ``call`` was running.
        filename: file of the innermost line of user code that created the op.
        lineno: its line number.
        inputs: the op's input values (NumPy arrays; ``None`` for non-numeric inputs).
        nonfinite: whether an output held a NaN or an Inf.
    """

    op_type: str
    stage: str
    scope: str
    layer: str | None
    filename: str | None
    lineno: int | None
    inputs: tuple = dataclasses.field(repr=False)
    nonfinite: bool = False


@dataclasses.dataclass(frozen=True)
class OpEvent:
    """An op whose output held a NaN or an Inf.

    Attributes:
        record: the op itself (for a gradient op: where the tape ran it).
        forward: for a gradient op, the record of the forward op it differentiates.
        forward_type: for a gradient op, the forward op's type (even without a record).
        outputs: the op's output values (NumPy arrays).
        index: position of the op among all ops the tracer saw.
    """

    record: OpRecord
    forward: OpRecord | None
    forward_type: str | None
    outputs: tuple = dataclasses.field(repr=False)
    index: int = 0

    @property
    def backward(self) -> bool:
        """Whether the op ran while the tape differentiated (a gradient op)."""
        return self.forward_type is not None or self.record.stage == "backward"


def _numeric(value) -> np.ndarray | None:
    """A NumPy copy of a float or complex eager tensor, else ``None``."""
    dtype = getattr(value, "dtype", None)
    if dtype is None or not (dtype.is_floating or dtype.is_complex):
        return None
    try:
        return np.asarray(value.numpy())
    except Exception:  # pragma: no cover - a symbolic or deleted tensor
        return None


def nonfinite_mask(array: np.ndarray) -> np.ndarray:
    """Where ``array`` (float, bfloat16 or complex) is NaN or Inf."""
    if np.iscomplexobj(array):
        return ~(np.isfinite(array.real) & np.isfinite(array.imag))
    return ~np.isfinite(array.astype(np.float64) if array.dtype.kind == "V" or array.dtype.itemsize < 4 else array)


class OpTracer:
    """Op callback of the op-by-op re-run (see the module docstring).

    Set :attr:`stage` before each part of the computation (``"forward"``, ``"loss"``,
    ``"backward"``); read :attr:`events` afterwards. ``stop_at_first=True`` raises
    :class:`FirstNonFinite` from the first non-finite op, which stops the code being
    traced right there.
    """

    def __init__(self, *, stop_at_first: bool = False, max_events: int = 64) -> None:
        self.stage = "forward"
        self.events: list[OpEvent] = []
        self.stop_at_first = stop_at_first
        self.max_events = max_events
        self._by_output: dict[int, OpRecord] = {}
        self._by_type: dict[str, list[OpRecord]] = {}
        self._alive: list[Any] = []  # keeps traced tensors alive, so their ids stay unique
        self.events_seen = 0
        self.masked_selects: list[OpRecord] = []
        self.nonfinite_writes = 0  # assignments of a non-finite value to a variable
        self.writes = 0  # every write of a variable (an assignment, an optimizer's apply)
        self.stopped = False
        self._thread = threading.get_ident()


    def kept_outputs(self) -> list:
        """The traced output tensors kept alive, each with its op's record (or ``None``)."""
        return [(tensor, self._by_output.get(id(tensor))) for tensor in self._alive]
    def __call__(self, op_type, inputs, attrs, outputs, op_name=None, graph=None):
        # Graph construction: hand the outputs on untouched (the next callback, e.g.
        # TensorFlow's check-numerics, receives what we return as the op's outputs).
        if graph is not None or self.stopped or threading.get_ident() != self._thread:
            return outputs
        op_type = op_type.decode() if isinstance(op_type, bytes) else str(op_type)
        if op_type in _WRITE_OPS or op_type.startswith(("ResourceApply", "ResourceSparseApply", "ResourceScatter")):
            self.writes += 1
        if op_type in _WRITE_OPS and len(inputs) > 1:
            value = _numeric(inputs[1])
            if value is not None and value.size and nonfinite_mask(value).any():
                self.nonfinite_writes += 1  # a variable is assigned a NaN or an Inf
        if op_type in _IGNORED_OPS or op_type.startswith("__inference"):
            return outputs
        self.events_seen += 1
        frame = sys._getframe(1)
        backprop = _internal.backprop_forward_op(frame)
        stage = self.stage
        if backprop is None and stage != "backward" and _internal.in_backprop(frame):
            stage = "backward"  # e.g. the tape adding up the gradients of a shared tensor
        layer, filename, lineno = where_in_user_code(frame)
        values = [_numeric(t) for t in outputs]
        nonfinite = any(v is not None and v.size and nonfinite_mask(v).any() for v in values)
        record = OpRecord(
            op_type=op_type,
            stage=stage if backprop is None else "backward",
            scope=tf.get_current_name_scope(),
            layer=layer,
            filename=filename,
            lineno=lineno,
            inputs=tuple(_numeric(t) for t in inputs) if (nonfinite or backprop is None) else (),
            nonfinite=nonfinite,
        )
        forward = None
        if backprop is None and stage != "backward" and op_type in ("Select", "SelectV2") and not nonfinite:
            branches = record.inputs[1:3]
            if any(v is not None and v.size and nonfinite_mask(v).any() for v in branches):
                self.masked_selects.append(record)  # a tf.where that drops a NaN/Inf
        if backprop is None and stage != "backward":
            self._alive.extend(outputs)
            for tensor in outputs:
                self._by_output[id(tensor)] = record
            self._by_type.setdefault(op_type, []).append(record)
        elif nonfinite and backprop is not None:
            forward = self._forward_record(backprop)
        if nonfinite and len(self.events) < self.max_events:
            event = OpEvent(
                record=record,
                forward=forward,
                forward_type=backprop["op_type"] if backprop else None,
                outputs=tuple(values),
                index=self.events_seen,
            )
            self.events.append(event)
            if self.stop_at_first:
                self.stopped = True
                raise FirstNonFinite(event)
        return outputs

    def _forward_record(self, backprop: dict[str, Any]) -> OpRecord | None:
        """The forward op the tape is differentiating, from the tensors it was given."""
        for tensor in backprop["outputs"]:
            if tensor is not None and id(tensor) in self._by_output:
                record = self._by_output[id(tensor)]
                if record.op_type == backprop["op_type"]:
                    return record
        candidates = self._by_type.get(backprop["op_type"], [])
        inputs = [_numeric(t) if t is not None else None for t in backprop["inputs"]]
        for record in reversed(candidates):  # the tape runs backwards: the latest match first
            if len(record.inputs) == len(inputs) and all(
                a is None or b is None or (a.shape == b.shape and np.array_equal(a, b, equal_nan=True))
                for a, b in zip(record.inputs, inputs)
            ):
                return record
        return candidates[-1] if candidates else None

    def first(self, *, backward: bool | None = None) -> OpEvent | None:
        """The first event (of the backward pass only, or of the forward only, if asked)."""
        for event in self.events:
            if backward is None or event.backward == backward:
                return event
        return None


class FirstNonFinite(Exception):
    """Raised by an :class:`OpTracer` with ``stop_at_first=True``; carries the event."""

    def __init__(self, event: OpEvent) -> None:
        super().__init__(f"non-finite output of {event.record.op_type}")
        self.event = event


class eager_trace:
    """Context manager: run everything op by op under ``tracer``.

    Turns on ``tf.config.run_functions_eagerly`` (so ``tf.function`` and XLA-compiled
    functions run as Python), registers the tracer as an op callback, and restores
    both on exit.
    """

    def __init__(self, tracer: OpTracer) -> None:
        self.tracer = tracer
        self._was_eager = None
        self._callback = None

    def __enter__(self) -> OpTracer:
        self._was_eager = tf.config.functions_run_eagerly()
        tf.config.run_functions_eagerly(True)
        self._callback = _internal.op_callback(self.tracer)
        self._callback.__enter__()
        return self.tracer

    def __exit__(self, *exc) -> None:
        try:
            self._callback.__exit__(*exc)
        finally:
            tf.config.run_functions_eagerly(self._was_eager)


def _op_name(error: BaseException) -> str | None:
    """The op type an eager kernel's error names (``[Op:SparseSoftmaxCrossEntropyWithLogits]``), or ``None``."""
    import re  # noqa: PLC0415

    text = str(error)
    found = re.search(r"\[Op:(\w+)\]", text) or re.search(r"__wrapped__(\w+?)_device_", text)
    return found.group(1) if found else None


def _snake(op: str) -> str:
    import re  # noqa: PLC0415

    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", op).lower()


def _value(tensor) -> np.ndarray | None:
    """A NumPy copy of any numeric eager tensor or array (integers too), else ``None``."""
    try:
        array = np.asarray(tensor.numpy() if hasattr(tensor, "numpy") else tensor)
    except Exception:  # noqa: BLE001 - a symbolic tensor, a handle
        return None
    return array if array.dtype.kind in "biufc" else None


def raised(error: BaseException, tracer: OpTracer) -> OpEvent | None:
    """The op whose eager kernel raised ``error`` in the op-by-op re-run, as an event; else ``None``.

    An op callback sees an op only after its kernel ran, so an op whose kernel refuses
    its inputs (``SparseSoftmaxCrossEntropyWithLogits`` given a label outside ``[0,
    classes)``: eager raises where an XLA kernel returns NaN) is never traced. Its
    inputs are read from the frame of TensorFlow's generated wrapper that called the
    kernel (in the error's traceback), its user line and layer from the frames above
    it, and its outputs from the same op run alone on those inputs, compiled with XLA
    (what the compiled step computed). ``None`` unless those outputs hold a NaN or an
    Inf.
    """
    op = _op_name(error)
    if op is None or getattr(tf.raw_ops, op, None) is None:
        return None
    from companion.diagnostics.causes import argument_names  # noqa: PLC0415 - causes imports no trace

    names = argument_names(op)
    frames, tb = [], error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    frame = next((f for f in reversed(frames) if f.f_code.co_name == _snake(op)
                  and all(n in f.f_locals for n in names)), None)
    if frame is None or not names:
        return None
    tensors = [frame.f_locals[n] for n in names]
    inputs = tuple(_value(t) for t in tensors)
    if any(v is None for v in inputs):
        return None
    try:
        with tf.init_scope():
            run = tf.function(lambda *a: getattr(tf.raw_ops, op)(**dict(zip(names, a))), jit_compile=True)
            outputs = run(*[tf.constant(v) for v in inputs])
    except Exception:  # noqa: BLE001 - no XLA kernel, or it refuses the inputs as well
        return None
    values = tuple(_numeric(t) for t in (outputs if isinstance(outputs, (list, tuple)) else [outputs]))
    if not any(v is not None and v.size and nonfinite_mask(v).any() for v in values):
        return None
    layer, filename, lineno = where_in_user_code(frame)
    if filename is not None and _called_by_the_doctor(frame, filename):
        filename = lineno = None  # a compiled Keras loss: no line of the user's makes the op
    record = OpRecord(op_type=op, stage=tracer.stage, scope="", layer=layer, filename=filename, lineno=lineno,
                      inputs=inputs, nonfinite=True)
    return OpEvent(record=record, forward=None, forward_type=None, outputs=values, index=tracer.events_seen + 1)


def _called_by_the_doctor(frame, filename: str) -> bool:
    """Whether the doctor's own re-run (not user code) called the library code that made the op at ``frame``."""
    import os  # noqa: PLC0415

    here = os.path.dirname(os.path.realpath(__file__))
    while frame is not None and frame.f_code.co_filename != filename:
        if os.path.dirname(os.path.realpath(frame.f_code.co_filename)) == here:
            return True
        frame = frame.f_back
    return False
