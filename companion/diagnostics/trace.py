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
        self._count = 0
        self.masked_selects: list[OpRecord] = []
        self.nonfinite_writes = 0  # assignments of a non-finite value to a variable
        self.writes = 0  # every write of a variable (an assignment, an optimizer's apply)
        self.stopped = False
        self._thread = threading.get_ident()

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
        self._count += 1
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
                index=self._count,
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
