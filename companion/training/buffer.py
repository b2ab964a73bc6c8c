"""The guarded step's records on the device: a small buffer of variables the host drains.

Every step writes its row (loss, gradient norm, applied or not, loss scale, spike), the
NaN/Inf counts per variable of a skipped step, and, for the NaN doctor, which logged
values were not finite. :class:`~companion.training.callbacks.GuardCallback` drains the
buffer after every host call (every ``steps_per_execution`` steps) into the run's
:class:`~companion.training.records.TrainingHistory`. The ``written`` and
``consecutive`` counters also carry the consecutive-skip limit across the host call.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from companion.training.records import APPLIED, COLUMNS
from companion.training.values import all_finite, read

#: Sync-on-read variables: each replica writes its own copy, the host reads the first.
ON_READ = dict(
    synchronization=tf.VariableSynchronization.ON_READ,
    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
    trainable=False,
)


class RecordBuffer:
    """The rows of the steps of one host call.

    Args:
        capacity: the most steps one host call runs (``steps_per_execution``).
        variables: the trainable variables whose NaN/Inf counts a row holds.
        strategy: the distribution strategy (the buffer is made in its scope).
    """

    def __init__(self, capacity: int, variables: int, strategy) -> None:
        self.capacity = int(capacity)
        # One replica: the host's reads and write are raw ops on the handles (a drain runs
        # after every host call, often every step; Keras' reads cost it some 3 times more).
        self.one = int(strategy.num_replicas_in_sync) == 1
        self.log_keys: list = []
        self.log_flags = None
        with strategy.scope():
            self.records = tf.Variable(tf.zeros([self.capacity, COLUMNS]), name="guard_records", **ON_READ)
            self.counts = tf.Variable(
                tf.zeros([self.capacity, 2, max(variables, 1)], tf.int64), name="guard_counts", **ON_READ
            )
            self.written = tf.Variable(tf.constant(0, tf.int32), name="guard_written", **ON_READ)
            self.consecutive = tf.Variable(tf.constant(0, tf.int32), name="guard_consecutive", **ON_READ)
        with tf.init_scope():
            self._zero = tf.constant(0, tf.int32)  # (a drain's write: made once, not at every host call)

    def write_log_flags(self, logs, written) -> None:
        """Whether each floating logged value of the step was finite, into its row."""
        keys = [k for k, v in logs.items() if tf.is_tensor(v) and v.dtype.is_floating]
        if self.log_flags is None or self.log_keys != keys:
            with tf.init_scope():
                self.log_flags = tf.Variable(tf.ones([self.capacity, max(len(keys), 1)]), trainable=False,
                                             name="guard_log_flags")
            self.log_keys = keys
        flags = [tf.cast(all_finite([logs[k]]), tf.float32) for k in keys] or [tf.constant(1.0)]
        index = tf.reshape(tf.minimum(written, self.capacity - 1), [1, 1])
        tf.raw_ops.ResourceScatterNdUpdate(ref=self.log_flags.handle, indices=index,
                                           updates=tf.expand_dims(tf.stack(flags), 0))

    def nonfinite_logs(self, row: int) -> list[str]:
        """The logged values that were not finite at ``row`` of the last drained records."""
        if self.log_flags is None:
            return []
        flags = tf.convert_to_tensor(self.log_flags).numpy()[min(row, self.capacity - 1)]
        return [key for key, flag in zip(self.log_keys, flags) if flag < 0.5]

    def write_counts(self, counts, written, applied, variables: int, every_step: bool) -> None:
        """The step's NaN/Inf counts (``counts()``, of ``variables`` gradients) into its
        row, unless ``applied``; ``every_step``: written without a conditional (a few
        ops; an applied step's counts are never read)."""
        if self.counts.shape[-1] != variables:
            return
        index = tf.reshape(tf.minimum(written, self.capacity - 1), [1, 1])

        def write_counts():
            tf.raw_ops.ResourceScatterNdUpdate(ref=self.counts.handle, indices=index, updates=tf.expand_dims(counts(), 0))
            return tf.constant(0)

        if every_step or applied is None:
            write_counts()  # at every step (an applied step's counts are never read), or now
        else:
            tf.cond(applied, lambda: tf.constant(0), write_counts)

    def record_raw(self, row, counts, written, consecutive, halted, applied, ended, variables: int,
                   every_step: bool) -> None:
        """The step's row of records, on one replica: raw writes, and no conditional but
        the counts' of a large model (a halted step's row lands past the last one
        :meth:`drain` reads)."""
        index = tf.reshape(tf.minimum(written, self.capacity - 1), [1, 1])
        tf.raw_ops.ResourceScatterNdUpdate(ref=self.records.handle, indices=index,
                                           updates=tf.reshape(row, [1, COLUMNS]))
        if counts is not None:
            self.write_counts(counts, written, applied, variables, every_step)
        running = tf.cast(tf.raw_ops.LogicalNot(x=halted), tf.int32)
        tf.raw_ops.AssignVariableOp(resource=self.written.handle, value=written + running)
        following = tf.raw_ops.SelectV2(condition=applied if ended is None else ended, t=tf.zeros_like(consecutive),
                                        e=consecutive + running)
        tf.raw_ops.AssignVariableOp(resource=self.consecutive.handle, value=following)

    def record(self, row, counts, written, consecutive, halted, applied, ended, variables: int) -> None:
        """The step's row of records, under several replicas (Keras' assigns: the buffer
        is a sync-on-read variable there)."""

        def write():
            index = tf.minimum(written, self.capacity - 1)
            self.records.assign(tf.tensor_scatter_nd_update(tf.convert_to_tensor(self.records), [[index]], [row]))
            if counts is not None and self.counts.shape[-1] == variables:

                def write_counts():
                    self.counts.assign(
                        tf.tensor_scatter_nd_update(tf.convert_to_tensor(self.counts), [[index]], [counts()])
                    )
                    return tf.constant(0)

                tf.cond(applied, lambda: tf.constant(0), write_counts)
            self.written.assign(written + 1)
            ended_ = applied if ended is None else ended
            self.consecutive.assign(tf.where(ended_, tf.zeros_like(consecutive), consecutive + 1))
            return tf.constant(0)

        tf.cond(halted, lambda: tf.constant(0), write)

    def reset(self, consecutive: int = 0) -> None:
        """No step written yet, and ``consecutive`` non-finite steps behind."""
        self.written.assign(0)
        self.consecutive.assign(consecutive)

    def drain(self, guard: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
        """The records of the steps run since the last drain, and their NaN/Inf counts.

        Two small eager reads and one write per host call (a third read where a step was
        skipped); a traced function would cost more to trace than all the reads of a
        short run.
        """
        if not self.one:
            n = min(int(tf.convert_to_tensor(self.written).numpy()), self.capacity)
            records = tf.convert_to_tensor(self.records).numpy()[:n]
            self.written.assign(0)
            counts = (lambda: tf.convert_to_tensor(self.counts).numpy()[:n])
        else:
            n = min(int(read(self.written).numpy()), self.capacity)
            records = read(self.records).numpy()[:n]
            if n:
                tf.raw_ops.AssignVariableOp(resource=self.written.handle, value=self._zero)
            counts = (lambda: read(self.counts).numpy()[:n])
        if not guard or records[:, APPLIED].all():
            return records, None
        return records, counts()
