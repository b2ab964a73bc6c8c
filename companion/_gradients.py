"""Tensor helpers over lists of gradients, shared by the training loop, the optimizer
wrapper and the diagnostics. A gradient may be a dense tensor, ``tf.IndexedSlices``
(from an embedding lookup) or ``None`` (a variable the loss does not depend on).
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import numpy as np
import tensorflow as tf


def gradient_values(gradient):
    """The dense values of a gradient (``IndexedSlices`` keep only their ``values``)."""
    if isinstance(gradient, tf.IndexedSlices):
        return gradient.values
    return gradient


def scale_gradient(gradient, factor):
    """``gradient * factor`` for a dense gradient or ``IndexedSlices``; ``None`` stays ``None``."""
    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(
            gradient.values * tf.cast(factor, gradient.values.dtype), gradient.indices, gradient.dense_shape
        )
    return gradient * tf.cast(factor, gradient.dtype)


def global_norm(gradients: Sequence[Any]) -> tf.Tensor:
    """The float32 global norm sqrt(sum of all squared entries), NaN or Inf if any entry is.

    In raw ops: the guard traces it into every training step, where a wrapper's Python
    costs more than the op.
    """
    squares = []
    for gradient in gradients:
        if gradient is None:
            continue
        values = tf.convert_to_tensor(gradient_values(gradient))
        if values.dtype != tf.float32:
            values = tf.cast(values, tf.float32)
        # Half the sum of squares in one pass (as tf.linalg.global_norm): no temporary of
        # the gradient's size, as a square followed by a sum would make.
        squares.append(tf.raw_ops.L2Loss(t=values))
    if not squares:
        return tf.constant(0.0, tf.float32)
    half = squares[0] if len(squares) == 1 else tf.raw_ops.AddN(inputs=squares)
    return tf.raw_ops.Sqrt(x=tf.raw_ops.Mul(x=half, y=tf.constant(2.0, tf.float32)))


def all_finite(gradients: Sequence[Any]) -> tf.Tensor:
    """A boolean scalar: every entry of every gradient is finite (``None`` skipped; an
    ``IndexedSlices`` by its values), a large one tested by its sum first
    (:func:`tensors_finite`)."""
    return tensors_finite([gradient_values(g) for g in gradients if g is not None])


#: A tensor of more entries than this is tested for finiteness by its sum first
#: (:func:`tensors_finite`). Without XLA, the guarded step puts a state (the variables a
#: step may write) of more entries back under a conditional, a smaller one by selects
#: (``companion.training.step.GuardedStep._put_back``): at about a nanosecond per entry
#: and step, the selects of 2**16 entries cost what the conditional's trace does over a
#: thousand steps.
SELECT_LIMIT = 2**16

#: The shape of a flattened tensor.
_FLAT = np.array([-1], np.int32)


def entries(values) -> int:
    """How many entries ``values`` hold (an unknown shape counts as more than
    :data:`SELECT_LIMIT`)."""
    return sum(v.shape.num_elements() if v.shape.num_elements() is not None else SELECT_LIMIT + 1 for v in values)


def tensors_finite(values, flatten: bool = False) -> tf.Tensor:
    """Whether every entry of every floating tensor or variable of ``values`` is finite
    (raw ops: a test per tensor, and one for them all). With ``flatten``, the small
    tensors of each dtype are concatenated and tested at once: fewer ops to trace and to
    run, for tensors small enough that the copy costs less than the ops it saves.

    A tensor of more than :data:`SELECT_LIMIT` entries is tested by its sum first (a sum
    is finite only if every entry is: a NaN or an infinity survives any sum), a pass with
    no temporary the size of the tensor; only if some sum is not finite (a non-finite
    entry, or finite entries whose sum overflows) are they tested entry by entry."""
    values = [tf.convert_to_tensor(v) for v in values]
    values = [v for v in values if v.dtype.is_floating]
    large = [v for v in values if v.shape.num_elements() is not None and v.shape.num_elements() > SELECT_LIMIT]
    if not large:
        return entries_finite(values, flatten)
    ids = {id(v) for v in large}
    small = [v for v in values if id(v) not in ids]
    sums = [tf.raw_ops.Sum(input=v, axis=list(range(v.shape.rank))) for v in large]
    quick = entries_finite(sums)
    large_finite = tf.cond(quick, lambda: tf.constant(True), lambda: entries_finite(large))
    if not small:
        return large_finite
    return tf.raw_ops.LogicalAnd(x=entries_finite(small, flatten), y=large_finite)


def entries_finite(values, flatten: bool = False) -> tf.Tensor:
    """Whether every entry of the floating tensors ``values`` is finite, entry by entry."""
    flags = []
    if flatten:
        groups: dict = {}
        for value in values:
            groups.setdefault(value.dtype, []).append(tf.raw_ops.Reshape(tensor=value, shape=_FLAT))
        values = [parts[0] if len(parts) == 1 else tf.raw_ops.ConcatV2(values=parts, axis=0)
                  for parts in groups.values()]
    for value in values:
        flag = tf.raw_ops.IsFinite(x=value)
        if value.shape.rank != 0:
            rank = value.shape.rank
            axis = list(range(rank)) if rank is not None else tf.range(tf.rank(value))
            flag = tf.raw_ops.All(input=flag, axis=axis)
        flags.append(flag)
    if not flags:
        return tf.constant(True)
    return flags[0] if len(flags) == 1 else tf.raw_ops.All(input=tf.raw_ops.Pack(values=flags), axis=0)


def nonfinite_counts(gradients: Sequence[Any], flatten: bool = False) -> tuple[tf.Tensor, tf.Tensor]:
    """NaN and Inf counts per gradient (``None`` counts 0), as two int64 vectors (raw ops:
    the guard traces them into every training step).

    With ``flatten``, when every gradient is dense with a known shape, the counts come from
    one concatenation of all gradients and two segment sums: a handful of ops whatever the
    number of variables (for small models, whose every op costs more than its work).
    """
    present = [g for g in gradients if g is not None]
    if flatten and not any(isinstance(g, tf.IndexedSlices) or g.shape.num_elements() is None for g in present):
        # Every dtype widens exactly to the widest one present (a float64 value cast to
        # float32 could overflow into a spurious Inf).
        wide = tf.float64 if any(g.dtype == tf.float64 for g in present) else tf.float32
        if not present:
            zeros = tf.zeros([len(gradients)], tf.int64)
            return zeros, zeros
        parts = [tf.raw_ops.Reshape(tensor=g if g.dtype == wide else tf.raw_ops.Cast(x=g, DstT=wide), shape=[-1])
                 for g in present]
        flat = parts[0] if len(parts) == 1 else tf.raw_ops.ConcatV2(values=parts, axis=0)
        sizes = [0 if g is None else g.shape.num_elements() for g in gradients]
        ids = tf.constant(np.repeat(np.arange(len(gradients), dtype=np.int32), sizes))
        return tuple(
            tf.raw_ops.UnsortedSegmentSum(
                data=tf.raw_ops.Cast(x=test(x=flat), DstT=tf.int64), segment_ids=ids, num_segments=len(gradients)
            )
            for test in (tf.raw_ops.IsNan, tf.raw_ops.IsInf)
        )
    nan_counts, inf_counts = [], []
    for gradient in gradients:
        if gradient is None:
            nan_counts.append(tf.constant(0, tf.int64))
            inf_counts.append(tf.constant(0, tf.int64))
            continue
        values = tf.convert_to_tensor(gradient_values(gradient))
        rank = values.shape.rank
        axis = list(range(rank)) if rank is not None else tf.range(tf.rank(values))
        nan_counts.append(tf.raw_ops.Sum(input=tf.raw_ops.Cast(x=tf.raw_ops.IsNan(x=values), DstT=tf.int64), axis=axis))
        inf_counts.append(tf.raw_ops.Sum(input=tf.raw_ops.Cast(x=tf.raw_ops.IsInf(x=values), DstT=tf.int64), axis=axis))
    return tf.raw_ops.Pack(values=nan_counts), tf.raw_ops.Pack(values=inf_counts)


#: Variables with fewer entries are updated as the optimizer schedules them: their
#: temporaries are small, and chaining them would only add latency.
CHAIN_FROM = 2**16
#: The same on a CPU alone (8 MiB of float32): its memory is seldom the limit, and a
#: model of small variables loses the overlap of their short updates.
CHAIN_FROM_ON_CPU = 2**21


@contextlib.contextmanager
def one_update_at_a_time(optimizer, smallest: int | None = None):
    """While traced inside, the large variables' updates of ``optimizer`` run one after another.

    An update that waits for a test of every gradient (a conditional on their norm, as
    a loss scaler's or the guard's) starts every variable's update at the same moment,
    with all their temporaries alive at once (Adam's holds two or three arrays the size
    of its variable). ``benchmarks/update_peak.py`` measures it on three 3072 x 3072
    float32 layers with Adam: over the peak of TensorFlow's allocator in ``fit``'s update,
    the conditional adds 0.96 x the weights' bytes, the same conditional chained 0.30.
    Without the conditional, the updates start as the backward pass frees each gradient,
    staggered. Chaining them, each after the previous variable's last write, keeps one
    variable's temporaries alive at a time. Nothing is computed differently: only the
    order is fixed.

    Which variables are large: ``smallest`` entries or more; by default
    :data:`CHAIN_FROM` where a GPU or a TPU is (whose kernels run in stream order anyway
    and whose memory is the limit; ``smallest=CHAIN_FROM`` chains as there on a CPU), and
    :data:`CHAIN_FROM_ON_CPU` on a CPU alone. There, chaining every variable from
    :data:`CHAIN_FROM` up made the steady time of a compute-bound MLP of 0.4 M weights
    (256-512-512-1) 1.91 times ``fit``'s in one run of ``benchmarks/scale.py``, its short
    updates losing their overlap, for a few MiB.

    Works through the optimizer's public ``update_step``, ``assign``, ``assign_add`` and
    ``assign_sub`` (the hooks Keras asks an optimizer's update to use), replaced on the
    instance for the duration; an optimizer without them is left as it is, and so is one
    traced by several replicas at once (their threads share the instance).
    """
    if smallest is None:
        accelerated = any(tf.config.list_logical_devices(kind) for kind in ("GPU", "TPU"))
        smallest = CHAIN_FROM if accelerated else CHAIN_FROM_ON_CPU
    names = ("update_step", "assign", "assign_add", "assign_sub")
    context = tf.distribute.get_replica_context()
    several = context is None or context.num_replicas_in_sync > 1
    if (several or not tf.inside_function()
            or not all(callable(getattr(optimizer, n, None)) for n in names)):
        yield
        return
    originals = {name: getattr(optimizer, name) for name in names}
    own = {name: name in vars(optimizer) for name in names}
    previous: list = []
    written: list = []

    def writing(name):
        def write(variable, value):
            written.append(variable)
            return originals[name](variable, value)

        return write

    def update_step(gradient, variable, learning_rate):
        nonlocal previous
        entries = variable.shape.num_elements()
        if entries is not None and entries < smallest:
            return originals["update_step"](gradient, variable, learning_rate)
        written.clear()
        with tf.control_dependencies(previous):
            result = originals["update_step"](gradient, variable, learning_rate)
        # A read of each variable the update wrote comes after its last write (automatic
        # control dependencies order the ops on one variable): the next update waits for it.
        previous = [_handle_read(v) for v in {id(v): v for v in written}.values()] or previous
        return result

    try:
        for name in names[1:]:
            setattr(optimizer, name, writing(name))
        optimizer.update_step = update_step
        yield
    finally:
        for name in names:
            if own[name]:
                setattr(optimizer, name, originals[name])
            else:
                try:
                    delattr(optimizer, name)
                except AttributeError:
                    pass


def _handle_read(variable) -> tf.Tensor:
    variable = getattr(variable, "value", variable) if not hasattr(variable, "handle") else variable
    return tf.raw_ops.ReadVariableOp(resource=variable.handle, dtype=tf.as_dtype(variable.dtype))
