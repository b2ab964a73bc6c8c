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
