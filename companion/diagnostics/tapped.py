"""The batches ``fit`` trains on, kept by its input pipeline itself.

The NaN doctor must diagnose the batch ``fit`` failed on, not the one a second read of the
data would give (shuffled arrays, a ``tf.data`` pipeline that reshuffles every epoch). Its
tap maps ``fit``'s pipeline through :meth:`TappedBatches.keep`, a few graph ops per
batch: the batch's tensors serialized into hash tables on the host, under the index of
the step that will train on it (the pipeline yields batches in the order ``fit`` trains
on them). No Python runs per batch (a ``tf.py_function`` per batch cost a small model's
steps their time, and took the interpreter's lock from ``fit``'s loop); the doctor reads
a batch back only when it needs it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

__all__ = ["TappedBatches"]


class TappedBatches:
    """The batches of a pipeline whose elements are ``spec``, by their index from the first.

    Args:
        spec: the pipeline's ``element_spec`` (a nest of ``tf.TensorSpec``); ``None``:
            nothing is tapped, nothing is kept.
    """

    def __init__(self, spec: Any = None) -> None:
        self.spec = spec
        self._first = 0  # the lowest index not forgotten
        self._tables: list = []
        if spec is None:
            self._count = self._bytes = None
            return
        self._dtypes = [s.dtype for s in tf.nest.flatten(spec)]
        with tf.init_scope(), tf.device("CPU:0"):
            self._count = tf.Variable(0, dtype=tf.int64, trainable=False, name="tapped_count")
            self._bytes = tf.Variable(0, dtype=tf.int64, trainable=False, name="tapped_bytes")
            self._tables = [tf.lookup.experimental.MutableHashTable(tf.int64, tf.string, default_value="")
                            for _ in self._dtypes]

    def keep(self, structure) -> list:
        """The ops that keep one batch (traced into the pipeline's map function)."""
        index = tf.reshape(self._count.assign_add(1, read_value=True) - 1, [1])
        serialized = [tf.reshape(tf.io.serialize_tensor(v), [1]) for v in tf.nest.flatten(structure)]
        ops = [table.insert(index, value) for table, value in zip(self._tables, serialized)]
        size = tf.add_n([tf.cast(tf.strings.length(value), tf.int64) for value in serialized])
        ops.append(self._bytes.assign_add(size[0], read_value=False))
        return ops

    @property
    def produced(self) -> int:
        """How many batches the pipeline has handed on (kept or since forgotten)."""
        return 0 if self._count is None else int(self._count.numpy())

    @property
    def nbytes(self) -> int:
        """The bytes kept (the batches' serialized tensors)."""
        return 0 if self._bytes is None else int(self._bytes.numpy())

    def __bool__(self) -> bool:
        return self.produced > self._first

    def kept(self, first: int, last: int) -> bool:
        """Whether the batches of the steps ``first`` to ``last`` are all kept (the
        batches are forgotten oldest first)."""
        return self._first <= first and last < self.produced

    def get(self, index: int):
        """The batch of step ``index`` as numpy arrays in its nest, or ``None`` if not kept."""
        if index < self._first or index >= self.produced:
            return None
        key = tf.constant([index], tf.int64)
        values = [table.lookup(key)[0] for table in self._tables]
        if any(not bool(tf.strings.length(v).numpy()) for v in values):
            return None
        arrays = [np.asarray(tf.io.parse_tensor(v, dtype).numpy()) for v, dtype in zip(values, self._dtypes)]
        return tf.nest.pack_sequence_as(self.spec, arrays)

    def forget(self, before: int) -> None:
        """Drop the batches of the steps before ``before``."""
        before = min(before, self.produced)
        if before <= self._first:
            return
        keys = tf.range(self._first, before, dtype=tf.int64)
        freed = sum(int(tf.reduce_sum(tf.cast(tf.strings.length(table.lookup(keys)), tf.int64)).numpy())
                    for table in self._tables)
        for table in self._tables:
            table.remove(keys)
        self._bytes.assign_sub(freed)
        self._first = before
