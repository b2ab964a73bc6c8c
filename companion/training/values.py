"""The guarded step's reads and tests of values: raw ops on variables' handles and tensors
(the finiteness tests live in :mod:`companion._gradients`, which ``SkipNonFinite`` and the
doctor's scan share).

Shared by the guarded step (:mod:`companion.training.step`) and the deferred update
(:mod:`companion.training.deferred`); raw ops because the guard traces them into every
training step, where a wrapper's Python costs more than the op.
"""

from __future__ import annotations

import tensorflow as tf

from companion._gradients import SELECT_LIMIT, entries, entries_finite, tensors_finite as all_finite

__all__ = ["SELECT_LIMIT", "all_finite", "entries", "entries_finite", "float_values", "read"]


def float_values(logs, scalars: bool = False) -> list:
    values = [v for v in tf.nest.flatten(logs) if tf.is_tensor(v) and v.dtype.is_floating]
    if scalars:
        values = [v for v in values if v.shape.rank == 0] or values
    return values


def read(variable) -> tf.Tensor:
    """The variable's value, read straight from its handle (a Keras or a TensorFlow variable)."""
    return tf.raw_ops.ReadVariableOp(resource=variable.handle, dtype=tf.as_dtype(variable.dtype))
