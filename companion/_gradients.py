"""Tensor helpers over lists of gradients, shared by the training loop, the optimizer
wrapper and the diagnostics. A gradient may be a dense tensor, ``tf.IndexedSlices``
(from an embedding lookup) or ``None`` (a variable the loss does not depend on).
"""

from __future__ import annotations

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
        rank = values.shape.rank
        axis = list(range(rank)) if rank is not None else tf.range(tf.rank(values))
        squares.append(tf.raw_ops.Sum(input=tf.raw_ops.Square(x=values), axis=axis))
    if not squares:
        return tf.constant(0.0, tf.float32)
    return tf.raw_ops.Sqrt(x=squares[0] if len(squares) == 1 else tf.raw_ops.AddN(inputs=squares))


def all_finite(gradients: Sequence[Any]) -> tf.Tensor:
    """A boolean scalar: every entry of every gradient is finite."""
    flags = [tf.reduce_all(tf.math.is_finite(gradient_values(g))) for g in gradients if g is not None]
    if not flags:
        return tf.constant(True)
    return tf.reduce_all(tf.stack(flags))


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
