"""The NaN doctor for a custom training step: :func:`diagnose_function`."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from companion._gradients import gradient_values
from companion.diagnostics.causes import CAUSES
from companion.diagnostics.diagnosis import Diagnosis, from_event, keep_state
from companion.diagnostics.remedies import UNCHECKED
from companion.diagnostics.rewrites import choice, verify_clamp
from companion.diagnostics.step import culprit
from companion.diagnostics.trace import OpTracer, eager_trace, nonfinite_mask, raised

__all__ = ["diagnose_function"]


def _all_finite_results(result) -> bool:
    """Whether ``result`` holds float tensors and every one of them is finite."""
    values = [gradient_values(v) for v in tf.nest.flatten(result) if isinstance(v, (tf.Tensor, tf.IndexedSlices))]
    values = [v for v in values if v.dtype.is_floating or v.dtype.is_complex]
    if not values:
        return False
    return all(not nonfinite_mask(np.asarray(v.numpy())).any() for v in values)


def diagnose_function(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Diagnosis | None:
    """Run a custom training step op by op and diagnose its first harmful NaN or Inf.

    For custom loops (eager, ``tf.function``, ``jit_compile=True``: every function runs
    op by op here). Unlike :func:`~companion.diagnostics.locate_nonfinite`, which stops
    at the first non-finite op, ``fn`` runs to its end, so a NaN that a ``tf.where``
    drops in the forward pass is told apart from one that reaches the loss: if every
    non-finite forward value was dropped by a ``tf.where`` (or none appeared), the
    culprit is the first non-finite op of the backward pass; else the first forward
    one. If ``fn`` returns tensors (its loss, its gradients), all of them are finite, and
    it assigned no NaN or Inf to a variable (an optimizer applying a NaN gradient), the
    non-finite values on the way were harmless and the result is ``None``. The
    fields are those of :func:`diagnose`, with ``batch=None`` (the report shows the
    symptom instead) and the variables unnamed (``fn`` owns them). If the arguments are
    tensors or arrays, :meth:`Diagnosis.save` writes them, and
    :func:`~companion.diagnostics.replay` calls a (fixed) function with them again.

    Args:
        fn: the step, e.g. a function that runs the model and ``tape.gradient``.
        *args: positional arguments for ``fn``.
        **kwargs: keyword arguments for ``fn``.

    Returns:
        A :class:`Diagnosis`, or ``None`` if no op output was non-finite, or if
        everything ``fn`` returned is finite.

    Raises:
        TypeError: if ``fn`` is not callable.

    Example:
        >>> w = tf.Variable(1.0)
        >>> def step(x):
        ...     with tf.GradientTape() as tape:
        ...         loss = tf.reduce_sum(tf.sqrt(w * x))
        ...     return tape.gradient(loss, w)
        >>> compiled = tf.function(step, jit_compile=True)
        >>> d = diagnose_function(compiled, tf.constant([0.0, 4.0]))
        >>> d.phase, d.op, d.forward_op, d.cause
        ('backward', 'SqrtGrad', 'Sqrt', 'singular_derivative')
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__} {fn!r}")
    tracer = OpTracer()
    tf_filtering = tf.debugging.is_traceback_filtering_enabled()
    refused = None
    try:
        tf.debugging.disable_traceback_filtering()
        with eager_trace(tracer):
            result = fn(*args, **kwargs)
    except Exception as error:  # an eager kernel that refuses what a compiled one makes NaN of
        refused = raised(error, tracer)
        if refused is None or tracer.events:
            raise
        first = (str(error).strip().splitlines() or [""])[0][:200]
        refused_by = f"run op by op, this op raised {type(error).__name__}: {first} (compiled with XLA it returns NaN)"
    finally:
        if tf_filtering:
            tf.debugging.enable_traceback_filtering()
    if refused is not None:
        found = from_event(refused, tracer, index=None, variables=(), disagreement=refused_by,
            loss_finite=False, losses_before=())
    else:
        if not tracer.events or (_all_finite_results(result) and not tracer.nonfinite_writes):
            return None
        event = culprit(tracer)
        found = from_event(
            event, tracer, index=None, variables=(), disagreement=None, loss_finite=event.backward, losses_before=()
        )
    remedy, verified = _remedy(found, tracer, fn, args, kwargs)
    if remedy is None and found.cause in ("overflow", "inf_arithmetic") and _grown(found):
        remedy, verified = GROWN_REMEDY, GROWN_CHECK
        again = _called_twice(tracer)
        if again is not None:  # the same layer's outputs on two inputs, both that large: targets from itself
            cause = CAUSES["bootstrapped_targets"]
            found = dataclasses.replace(found, cause="bootstrapped_targets", fix=cause.fix, section=cause.section,
                                        inputs_summary=f"{again}; {found.inputs_summary}")
    if remedy is not None:
        found = dataclasses.replace(found, remedy=remedy, verified=verified)
    return keep_state(found, _arguments_state(args, kwargs))


#: The remedy for values that grew over earlier calls of the step until one overflowed.
GROWN_REMEDY = ("bound each step: tf.clip_by_global_norm(gradients, 1.0) before the optimizer applies them (or "
                "clipnorm=1.0 in it); targets made from the model's own outputs (Q-learning, TD): a target network "
                "copied every N steps, and rewards scaled to about 1")

#: What the doctor can say of it: the one call it has cannot show a cure.
GROWN_CHECK = ("not verified: diagnose_function runs this one call of the step, on values that earlier calls made "
               "that large; the steps that made them are not in it (run the loop again with the remedy)")


def _grown(found) -> bool:
    """Whether the op overflowed from inputs already beyond the fourth root of the dtype's largest value."""
    import re  # noqa: PLC0415

    largest = re.search(r"largest \|input\| ([0-9.e+-]+)", found.inputs_summary or "")
    limit = float(np.finfo(np.float32).max) ** 0.25
    return largest is not None and float(largest.group(1)) >= limit


def _called_twice(tracer) -> str | None:
    """A layer whose forward op ran on two inputs in the step with outputs beyond the fourth root of float32's max.

    A Q-learning step calls its network on the states and on the next states (the
    targets ``r + gamma * max Q(s')``): when both are that large, the targets grew
    with the outputs they were made from.
    """
    limit = float(np.finfo(np.float32).max) ** 0.25
    runs: dict = {}
    for tensor, record in tracer.kept_outputs():
        if record is None or record.layer is None or record.op_type not in ("MatMul", "BatchMatMulV2", "Einsum"):
            continue
        try:
            value = np.asarray(tensor.numpy(), np.float64)
        except Exception:  # noqa: BLE001 - not a value
            continue
        runs.setdefault(record.layer, []).append(float(np.max(np.abs(value))) if value.size else 0.0)
    for layer, sizes in runs.items():
        large = [v for v in sizes if v >= limit]
        if len(large) >= 2:
            return (f"{layer} ran {len(sizes)} times in the step, its outputs up to {max(large):.3g} on "
                    f"{len(large)} of them (targets made from the model's own outputs grow with them)")
    return None


def _finite_run(fn, args, kwargs) -> tuple[bool, OpTracer]:
    """Whether ``fn`` run op by op is finite as :func:`diagnose_function` judges it (and raises nothing)."""
    tracer = OpTracer()
    try:
        with eager_trace(tracer):
            result = fn(*args, **kwargs)
    except tf.errors.InvalidArgumentError:  # an eager kernel still refuses its inputs
        return False, tracer
    return (not tracer.events or (_all_finite_results(result) and not tracer.nonfinite_writes)), tracer


def _remedy(found, tracer, fn, args, kwargs) -> tuple[str | None, str | None]:
    """The first remedy, and ``fn`` re-run once with it applied on the user's line (never raises)."""
    try:
        remedy, clamp = choice(found)
    except Exception:  # noqa: BLE001 - the doctor's own failure is never the user's
        return None, None
    if remedy is None:
        return None, None
    if clamp is None:
        return remedy, UNCHECKED
    if tracer.writes:
        return remedy, ("not verified: the function writes variables (an optimizer step, a metric): the "
                        "doctor does not run it a second time")
    try:
        return remedy, verify_clamp(found, clamp, lambda: _finite_run(fn, args, kwargs)[0]) or UNCHECKED
    except Exception as error:  # noqa: BLE001
        return remedy, f"not verified: the re-run with the remedy failed ({type(error).__name__}: {error})"[:300]


def _arguments_state(args, kwargs) -> dict | None:
    """The call's arguments for :meth:`Diagnosis.save`, if they are all tensors or arrays."""
    if kwargs:
        return None
    leaves = tf.nest.flatten(args)
    if not leaves or not all(isinstance(v, (tf.Tensor, tf.Variable, np.ndarray, np.generic, float, int))
                             for v in leaves):
        return None
    values = tf.nest.map_structure(lambda v: np.asarray(v.numpy() if hasattr(v, "numpy") else v), args)
    return {"kind": "function", "args": tuple(values), "numpy_random": np.random.get_state()}
