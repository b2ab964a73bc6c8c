"""Private TensorFlow/Keras APIs, one family: eager ops: op callbacks, the check-numerics state, the forward op of a gradient.

Each hook says what it relies on and what happens when it is gone, and is registered
(:func:`companion._internal.registry.hook`) with its canary tests.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator


from companion._internal.registry import hook, warn_once


# --------------------------------------------------------------------------------------
# Op callbacks and the check-numerics state (companion.diagnostics)
# --------------------------------------------------------------------------------------
# Relies on: ``tensorflow.python.framework.op_callbacks.add_op_callback`` /
# ``remove_op_callback``: the op-by-op re-run of the diagnostics sees every eager op's
# inputs and outputs through one. TensorFlow hands each callback's return value to the
# next callback as the op's outputs while it builds a graph (a ``dataset.map`` inside
# the traced code), so a callback must return ``outputs``, never ``None``. Also the
# module state ``tensorflow.python.debug.lib.check_numerics_callback._state`` (whether
# the user had ``enable_check_numerics`` on, so it can be paused and restored).
# If gone: no op is seen (a warning says so): diagnoses name the batch and the
# variables but no op; the user's check-numerics setting is assumed off.


@hook('test_op_callbacks_see_eager_ops_and_check_numerics_state_is_readable')
@contextlib.contextmanager
def op_callback(callback: Callable) -> Iterator[bool]:
    """Register ``callback`` for every op while active; yields whether that was possible."""
    try:
        from tensorflow.python.framework import op_callbacks
    except ImportError:  # pragma: no cover
        op_callbacks = None
    if op_callbacks is None or not hasattr(op_callbacks, "add_op_callback"):  # pragma: no cover
        warn_once("op_callbacks", "tensorflow op_callbacks are gone: the NaN doctor cannot see ops one by one")
        yield False
        return
    op_callbacks.add_op_callback(callback)
    try:
        yield True
    finally:
        op_callbacks.remove_op_callback(callback)


@hook('test_op_callbacks_see_eager_ops_and_check_numerics_state_is_readable')
def check_numerics_enabled() -> bool:
    """Whether :func:`tf.debugging.enable_check_numerics` is on in this thread."""
    try:
        from tensorflow.python.debug.lib import check_numerics_callback
        state = check_numerics_callback._state
    except (ImportError, AttributeError):  # pragma: no cover
        warn_once("check_numerics_callback._state", "cannot tell whether enable_check_numerics is on; assuming off")
        return False
    return hasattr(state, "check_numerics_callback")


# --------------------------------------------------------------------------------------
# The forward op of a gradient being computed (from a traceback or the live stack)
# --------------------------------------------------------------------------------------
# Relies on: eager ``GradientTape.gradient`` calling each op's registered gradient from
# ``tensorflow/python/eager/backprop.py``'s ``_gradient_function(op_name, attr_tuple,
# num_inputs, inputs, outputs, out_grads, skip_input_indices, forward_pass_name_scope)``;
# its local ``op_name`` is the forward op's type and ``inputs``/``outputs`` the forward
# op's tensors (the op-by-op re-run maps them back to the forward op's record).
# Also relies on ``GradientTape.gradient`` (backprop.py) and ``imperative_grad``
# (imperative_grad.py) being Python frames on the stack while the tape runs ops.
# If gone: a gradient op is reported as an op of the forward pass, without the forward
# op it differentiates, its layer and its line (no warning: the stack is only read).


@hook('test_eager_backprop_names_the_forward_op_of_a_failing_gradient', 'test_eager_backprop_exposes_the_forward_op_and_its_tensors_to_op_callbacks')
def backprop_forward_op(frame) -> dict[str, Any] | None:
    """The forward op that eager backprop is differentiating, seen from ``frame`` outwards.

    Returns ``None`` outside ``GradientTape.gradient``; else a dict with the forward op's
    ``op_type``, the ``inputs`` and ``outputs`` the tape kept for it (tensors, or
    ``None`` where the gradient does not need them) and its forward ``scope``.
    """
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_gradient_function" and code.co_filename.endswith("backprop.py"):
            local = frame.f_locals
            forward = local.get("op_name")
            return {
                "op_type": forward.decode() if isinstance(forward, bytes) else str(forward),
                "inputs": tuple(local.get("inputs") or ()),
                "outputs": tuple(local.get("outputs") or ()),
                "scope": local.get("forward_pass_name_scope"),
            }
        frame = frame.f_back
    return None


@hook('test_eager_backprop_exposes_the_forward_op_and_its_tensors_to_op_callbacks')
def in_backprop(frame) -> bool:
    """Whether ``frame`` (or a caller) runs inside eager ``GradientTape.gradient``."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "imperative_grad" and code.co_filename.endswith("imperative_grad.py"):
            return True
        if code.co_name == "gradient" and code.co_filename.endswith("backprop.py"):
            return True
        frame = frame.f_back
    return False


# --------------------------------------------------------------------------------------
# The ops inside a functional op (the guard's deferred update reads what a step writes)
# --------------------------------------------------------------------------------------
# Relies on: a graph's ``_get_function(name)`` returning the function that a functional
# op (``While``, ``If``, ``PartitionedCall``: an RNN layer's loop, a ``tf.cond``) names in
# its ``func`` attributes, with its ``FunctionDef`` as ``.definition``.
# Why: the guarded step defers the optimizer's update only if the traced step never
# writes the weights itself; a functional op that takes a weight's handle may only read
# it (an LSTM's loop), and its body says which.
# If gone: ``None``; the guard counts such an op as a write and traces the step again
# with the masked update (same results, a copy of the weights per step), with a warning.

#: Ops that only read a resource variable (any other op that takes its handle may write it).
READ_OPS = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape", "VarIsInitializedOp"})


@hook("test_the_ops_inside_a_functional_op_are_readable")
def functional_op_writes(op) -> bool | None:
    """Whether a functional op's functions (its branches, its loop's body, nested calls)
    contain an op that may write a resource; ``None`` if they cannot be read or ``op``
    calls no function."""
    getter = getattr(op.graph, "_get_function", None)
    if getter is None:
        warn_once("graph_get_function", "tf.Graph has no _get_function: the guard cannot look inside a loop or a "
                  "conditional of the step, and traces it with the masked update")
        return None
    pending = [op.node_def.attr[a].func.name for a in op.node_def.attr if op.node_def.attr[a].HasField("func")]
    if not pending:
        return None  # not a functional op
    seen: set[str] = set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        function = getter(name)
        definition = getattr(function, "definition", None)
        if definition is None:
            return None
        for node in definition.node_def:
            nested = [node.attr[a].func.name for a in node.attr if node.attr[a].HasField("func")]
            pending.extend(nested)
            if nested or node.op in READ_OPS:
                continue
            if node.op.startswith(("Assign", "ResourceApply", "ResourceSparseApply", "ResourceScatter",
                                   "ResourceStridedSliceAssign", "DestroyResourceOp")):
                return True
    return False


# --------------------------------------------------------------------------------------
# Op determinism, read and turned off (the book's XLA runs), and Debugger V2's reader
# --------------------------------------------------------------------------------------
# Relies on: ``tensorflow.python.framework.config.is_op_determinism_enabled`` and
# ``disable_op_determinism`` (the public API can only enable it; Keras reads the first
# to drop ``jit_compile=True``), and ``tensorflow.python.debug.lib.debug_events_reader``
# (the ``DebugDataReader`` TensorBoard's debugger plugin reads a Debugger V2 dump with).
# Why: the doctor's chapter compares TensorFlow's own tools with the doctor under XLA.
# If gone: determinism is taken as off and left alone; the reader is ``None`` (the
# chapter's Debugger V2 row says it could not read the dump).


@hook("test_op_determinism_can_be_read_and_turned_off")
def op_determinism_enabled() -> bool:
    """Whether TensorFlow's op determinism is on."""
    try:
        from tensorflow.python.framework import config  # noqa: PLC0415
    except ImportError:  # pragma: no cover
        warn_once("op_determinism", "tensorflow.python.framework.config is gone: op determinism taken as off")
        return False
    return bool(config.is_op_determinism_enabled())


@hook("test_op_determinism_can_be_read_and_turned_off")
def disable_op_determinism() -> None:
    """Turn TensorFlow's op determinism off."""
    try:
        from tensorflow.python.framework import config  # noqa: PLC0415
    except ImportError:  # pragma: no cover
        warn_once("op_determinism", "tensorflow.python.framework.config is gone: op determinism left as it is")
        return
    config.disable_op_determinism()


@hook("test_a_debugger_v2_dump_can_be_read")
def debug_events_reader():
    """The module with Debugger V2's ``DebugDataReader``, or ``None``."""
    try:
        from tensorflow.python.debug.lib import debug_events_reader as reader  # noqa: PLC0415
    except ImportError:  # pragma: no cover
        warn_once("debug_events_reader", "tensorflow.python.debug.lib.debug_events_reader is gone: a Debugger V2 "
                  "dump cannot be read")
        return None
    return reader
