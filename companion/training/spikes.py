"""``skip_loss_spikes``: a finite loss far above the running mean of the recent losses.

A step whose loss is more than ``z`` running standard deviations above the running mean
of the counted steps' losses is skipped like a non-finite one, after a warm-up. The
test and the statistics live on the device, in the step (no host round trip); every
replica and worker sees the same all-reduced loss and the same statistics, so they
decide alike.
"""

from __future__ import annotations

import tensorflow as tf

from companion.training.values import read

#: ``skip_loss_spikes``: the applied steps a spike test waits for (its warm-up), the
#: window of the running mean and variance of the loss (an exponential moving average
#: whose weight is ``1 / min(steps seen, SPIKE_WINDOW)``: the exact mean and variance of
#: the first ``SPIKE_WINDOW`` steps, then of about the last ``SPIKE_WINDOW``), and the
#: smallest spread it assumes, relative to the mean (a loss that stays constant would
#: otherwise make any step above it a spike).
SPIKE_WARMUP = 20
SPIKE_WINDOW = 100
SPIKE_MIN_SPREAD = 1e-2



class LossSpikes:
    """The running loss statistics of one guarded step, and its spike test.

    Args:
        z: the ``skip_loss_spikes`` of :func:`companion.training.train`.
        replicas: the strategy's replicas in sync (one replica writes with raw ops).
        on_read: the variable arguments of the guard's buffer (sync on read).
    """

    def __init__(self, z: float, replicas: int, on_read: dict) -> None:
        self.z = float(z)
        self.replicas = replicas
        # The running mean and variance of the loss, and the steps they have seen.
        self.stats = tf.Variable(tf.zeros([3]), name="guard_loss_stats", **on_read)

    def test(self, loss, halted):
        """Whether the step's loss is a spike, and the threshold it was tested against.

        A spike: after :data:`SPIKE_WARMUP` counted steps, a finite loss above ``mean +
        z * spread``, where ``mean`` and ``spread`` (the standard deviation, at least
        :data:`SPIKE_MIN_SPREAD` times ``|mean|``) are the running statistics of
        :meth:`count`. Both replicas and workers see the same (all-reduced) loss and
        the same statistics, so they decide alike.
        """
        stats = read(self.stats) if self.replicas == 1 else tf.convert_to_tensor(self.stats)
        mean, variance, seen = stats[0], stats[1], stats[2]
        loss = tf.cast(loss, tf.float32)
        spread = tf.maximum(tf.sqrt(tf.maximum(variance, 0.0)), SPIKE_MIN_SPREAD * tf.abs(mean))
        threshold = mean + self.z * spread
        spike = tf.logical_and(
            tf.logical_and(seen >= SPIKE_WARMUP, tf.math.is_finite(loss)),
            tf.logical_and(loss > threshold, tf.logical_not(halted)),
        )
        return spike, threshold

    def count(self, loss, spike, threshold, counted) -> None:
        """The running mean and variance of the loss, moved by a counted step's loss: an
        applied step's, or a spike's clipped to the threshold (a lasting change of level
        is then accepted after some steps instead of skipped for ever).

        ``d = x - mean; mean += a d; variance = (1 - a) (variance + a d**2)`` with ``a =
        1 / min(seen + 1, SPIKE_WINDOW)``: the exact mean and variance of the first steps,
        then exponential moving averages (West's weighted update, no square of the loss
        itself, which could overflow).
        """
        one = self.replicas == 1
        stats = read(self.stats) if one else tf.convert_to_tensor(self.stats)
        mean, variance, seen = stats[0], stats[1], stats[2]
        value = tf.where(spike, threshold, tf.cast(loss, tf.float32))
        value = tf.where(counted, value, mean)  # a step not counted moves nothing (and makes no NaN)
        rate = 1.0 / tf.minimum(seen + 1.0, float(SPIKE_WINDOW))
        d = value - mean
        new = tf.stack([mean + rate * d, (1.0 - rate) * (variance + rate * d * d), seen + 1.0])
        new = tf.where(counted, new, stats)
        if one:
            tf.raw_ops.AssignVariableOp(resource=self.stats.handle, value=new)
        else:
            self.stats.assign(new)

    def reset(self) -> None:
        """Forget the running loss statistics (after a rollback: the warm-up again)."""
        self.stats.assign(tf.zeros([3]))
