"""The guarded step's reads and tests of values: raw ops on variables' handles and tensors.

Shared by the guarded step (:mod:`companion.training.step`) and the deferred update
(:mod:`companion.training.deferred`); raw ops because the guard traces them into every
training step, where a wrapper's Python costs more than the op.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

#: Without XLA, a state (the variables a step may write) of more entries than this is put
#: back under a conditional, a smaller one by selects (see ``GuardedStep._put_back``): at
#: about a nanosecond per entry and step, the selects of 2**16 entries cost what the
#: conditional's trace does over a thousand steps.
SELECT_LIMIT = 2**16

def float_values(logs, scalars: bool = False) -> list:
    values = [v for v in tf.nest.flatten(logs) if tf.is_tensor(v) and v.dtype.is_floating]
    if scalars:
        values = [v for v in values if v.shape.rank == 0] or values
    return values


def read(variable) -> tf.Tensor:
    """The variable's value, read straight from its handle (a Keras or a TensorFlow variable)."""
    return tf.raw_ops.ReadVariableOp(resource=variable.handle, dtype=tf.as_dtype(variable.dtype))


#: The shape of a flattened tensor.
_FLAT = np.array([-1], np.int32)


def entries(values) -> int:
    """How many entries ``values`` hold (an unknown shape counts as more than
    :data:`SELECT_LIMIT`)."""
    return sum(v.shape.num_elements() if v.shape.num_elements() is not None else SELECT_LIMIT + 1 for v in values)


def all_finite(values, flatten: bool = False) -> tf.Tensor:
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
