"""A proof, from a few running scalars, that an optimizer's update will be finite.

The guarded step applies the model optimizer's update in place, under one predicate,
instead of copying every weight and moment so that it can put them back. The predicate
has to include what the update itself will write: an update can overflow from finite
gradients (a learning rate of 1e37, an epsilon that is 0 in float16, a gradient whose
square overflows). Testing what it wrote would need the old values to put back, the copy
this design avoids; for Keras' own SGD, Adam, AdamW and Lion the update is instead
*proved* finite from bounds:

* ``G`` bounds every gradient entry: the gradients' global norm (after any clipping),
  which the guard computes anyway (``max |g| <= ||g||_2``).
* ``W`` bounds every ``|w|`` and ``M`` every optimizer slot (``|m|``, ``v``, a momentum),
  kept as two scalars on the device: measured exactly when :func:`train` starts (one
  read of every weight and slot per call) and advanced after every applied step by the
  update's own worst case (no read of a weight or a slot).

For Adam with learning rate ``lr``, ``beta_1 < 1`` and ``epsilon > 0``:
``|m'| <= max(M, G)``, ``v' <= max(M, G**2)``, ``alpha <= lr / (1 - beta_1)``, and the
step ``|alpha m' / (sqrt(v') + eps)| <= alpha max(M, G) / eps``; weight decay multiplies
``|w|`` by at most ``1 + lr wd``. SGD's momentum ``m' = mu m - lr g`` gives
``|m'| <= mu M + lr G``; Lion's step is ``lr`` times a sign. Every bound is held below a
quarter of the largest finite value of the narrowest floating dtype the update computes
in, a margin that covers the rounding of the few operations between. Where the bound
fails (or the optimizer is not one of these), the step takes the tested path: it copies
what the update writes, applies it, tests it and puts it back if it is not finite, and
forgets ``W`` and ``M``, which the host measures exactly again after the host call.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

#: A bound not known (or too large to prove anything): larger than any float32, and small
#: enough that the proof's products and quotients stay finite in float64.
UNKNOWN = 1e60

#: The optimizers whose update :class:`UpdateBound` can bound (the exact classes: a
#: subclass may override the update).
PROVABLE = (keras.optimizers.SGD, keras.optimizers.Adam, keras.optimizers.AdamW, keras.optimizers.Lion)


def provable(optimizer, variables) -> bool:
    """Whether ``optimizer``'s update of ``variables`` can be bounded: one of
    :data:`PROVABLE` (the exact class), without a moving average of the weights, gradient
    accumulation, variable constraints or weights overwritten by their gradients."""
    if type(optimizer) not in PROVABLE:
        return False
    if getattr(optimizer, "use_ema", False) or getattr(optimizer, "gradient_accumulation_steps", None):
        return False
    for v in variables:
        if getattr(v, "constraint", None) is not None or getattr(v, "overwrite_with_gradient", False):
            return False
        if not tf.as_dtype(v.dtype).is_floating:
            return False
    return True


def _limit(variables, slots) -> float:
    """A quarter of the largest finite value of the narrowest floating dtype involved."""
    dtypes = {tf.as_dtype(v.dtype) for v in [*variables, *slots] if tf.as_dtype(v.dtype).is_floating}
    return 0.25 * min((float(np.finfo(d.as_numpy_dtype).max) for d in dtypes), default=3.4e38)


def _smallest(value: float, variables) -> float:
    """``value`` as the narrowest floating dtype of ``variables`` stores it (0 if it underflows)."""
    dtypes = {tf.as_dtype(v.dtype) for v in variables if tf.as_dtype(v.dtype).is_floating}
    return min((float(np.asarray(value, d.as_numpy_dtype)) for d in dtypes), default=value)


class UpdateBound:
    """Running bounds of the weights and the slots, and the proof of one update.

    Args:
        optimizer: the model's optimizer (not a loss-scale wrapper).
        variables: the trainable variables it updates.
    """

    def __init__(self, optimizer, variables) -> None:
        self.optimizer = optimizer
        self.use(variables)
        # Float64 scalars, and "unknown" as UNKNOWN rather than inf: the proof's own
        # arithmetic stays finite (a user's enable_check_numerics sees every op of it).
        with tf.init_scope():
            self.weights = tf.Variable(UNKNOWN, dtype=tf.float64, trainable=False, name="guard_weight_bound")
            self.slots = tf.Variable(UNKNOWN, dtype=tf.float64, trainable=False, name="guard_slot_bound")
            #: How many updates took the tested path (the proof failed, or is off).
            self.tested = tf.Variable(0, dtype=tf.int64, trainable=False, name="guard_tested_updates")

    def use(self, variables) -> None:
        """Bound the update of ``variables`` (the ones the optimizer's ``apply`` is given)."""
        self.variables = list(variables)
        self.enabled = bool(self.variables) and provable(self.optimizer, self.variables)

    def _slots(self) -> list:
        """The optimizer's per-weight state (moments, momentums), not its counters."""
        shapes = {tuple(v.shape) for v in self.variables}
        return [v for v in self.optimizer.variables if tf.as_dtype(v.dtype).is_floating and tuple(v.shape) in shapes]

    def measure(self) -> None:
        """``W`` and ``M`` measured exactly (eagerly: once per call of :func:`train`, and after
        a host call in which an update took the tested path); a
        negative second moment or anything non-finite leaves the proof off (``inf``)."""
        if not self.enabled or not self.optimizer.built:
            return
        with tf.init_scope():  # eagerly, also when called while the step is traced
            self._assign_measured()

    def _assign_measured(self) -> None:
        self.weights.assign(_largest(self.variables))
        self.slots.assign(_largest(self._slots(), nonnegative_names=("velocity",)))

    def forget(self) -> None:
        """Inside the step (the tested path): ``W`` and ``M`` unknown, until :meth:`measure`
        runs on the host after the host call (a measure traced into the step would cost
        every first call more than all the tested steps it would save)."""
        self.tested.assign_add(1)
        if self.enabled:
            self.weights.assign(UNKNOWN)
            self.slots.assign(UNKNOWN)

    def prove(self, gradient_bound, learning_rate):
        """Whether the next update is finite, and the assignments that advance the bounds
        past it (to run only if it is applied); ``(False, no-op)`` when not provable."""
        if not self.enabled:
            return tf.constant(False), lambda: None
        optimizer = self.optimizer
        limit = _limit(self.variables, self._slots())
        g = tf.minimum(tf.cast(gradient_bound, tf.float64), UNKNOWN)
        lr = tf.minimum(tf.abs(tf.cast(learning_rate, tf.float64)), UNKNOWN)
        w = tf.minimum(tf.convert_to_tensor(self.weights), UNKNOWN)
        m = tf.minimum(tf.convert_to_tensor(self.slots), UNKNOWN)
        decay = min(abs(float(getattr(optimizer, "weight_decay", None) or 0.0)), UNKNOWN)
        w_decayed = w * (1.0 + lr * decay)
        if isinstance(optimizer, keras.optimizers.Adam):  # AdamW is an Adam
            beta_1, eps = float(optimizer.beta_1), _smallest(float(optimizer.epsilon), self.variables)
            if not (0.0 <= beta_1 < 1.0 - 1e-12) or eps < 1e-100:
                return tf.constant(False), lambda: None
            m_next = tf.maximum(m, tf.maximum(g, tf.square(g)))
            step = lr / (1.0 - beta_1) * tf.maximum(m, g) / eps
        elif isinstance(optimizer, keras.optimizers.Lion):
            m_next = tf.maximum(m, g)
            step = lr
        else:  # SGD
            momentum = min(abs(float(optimizer.momentum)), UNKNOWN)
            if momentum:
                m_next = momentum * m + lr * g
                step = momentum * m_next + lr * g if optimizer.nesterov else m_next
            else:
                m_next, step = m, lr * g
        w_next = w_decayed + step
        values = tf.stack([g, tf.square(g), lr, w_next, m_next, step])
        proved = tf.reduce_all(values < limit)

        def advance():
            self.weights.assign(w_next)
            self.slots.assign(m_next)

        return proved, advance


def _largest(variables, nonnegative_names=()) -> tf.Tensor:
    """The largest ``|entry|`` of ``variables`` (:data:`UNKNOWN` if one is not finite, or if one
    whose name contains one of ``nonnegative_names`` has a negative entry)."""
    largest = tf.constant(0.0, tf.float64)
    for v in variables:
        value = tf.convert_to_tensor(v)
        if value.shape.num_elements() == 0:
            continue
        size = tf.abs(value)
        top = tf.cast(tf.reduce_max(size), tf.float64)
        # Not finite, or a NaN that the maximum dropped; a sum that overflows is taken as
        # not finite too (the proof is then off: safe).
        bad = tf.logical_not(tf.logical_and(tf.math.is_finite(top), tf.math.is_finite(tf.reduce_sum(size))))
        name = str(getattr(v, "path", None) or v.name)
        if any(n in name for n in nonnegative_names):
            bad = tf.logical_or(bad, tf.reduce_any(value < 0))
        largest = tf.where(bad, tf.constant(UNKNOWN, tf.float64), tf.maximum(largest, tf.minimum(top, UNKNOWN)))
    return largest
