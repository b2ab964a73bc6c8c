"""Optimizers for ``model.fit`` users: :class:`SkipNonFinite` skips every update whose
gradients are not all finite (chapter *A training loop that survives NaN*).
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from companion import _internal
from companion._gradients import all_finite, one_update_at_a_time

__all__ = ["SkipNonFinite"]


@keras.saving.register_keras_serializable(package="companion")
class SkipNonFinite(keras.optimizers.Optimizer):
    """An optimizer wrapper that skips every update whose gradients are not all finite.

    For ``model.fit`` users: ``model.compile(optimizer=SkipNonFinite(keras.optimizers.Adam()))``.
    When any gradient of a step has a NaN or Inf entry, the wrapped optimizer is not
    called at all, so neither the weights nor its state (moments, iteration counter)
    change; :attr:`skipped_steps` counts such steps. Under a distribution strategy the
    decision is made across replicas (a NaN on one replica skips the step on all of
    them). It works with ``jit_compile=True``.

    What it cannot do inside ``fit``: the loss metric of a skipped step is NaN, so the
    epoch's mean loss shown by ``fit`` is NaN (and ``keras.callbacks.TerminateOnNaN``
    would stop training); batch-norm statistics updated by the forward pass are not
    restored. :func:`companion.training.train` has neither limitation.

    With ``mixed_float16``, ``compile`` wraps this optimizer in a
    :class:`keras.optimizers.LossScaleOptimizer`, which is the right order (overflowing
    steps are then handled by the loss scaler). Do not wrap a ``LossScaleOptimizer`` in
    ``SkipNonFinite``: it would never see an overflow and its scale would never drop.

    Args:
        inner_optimizer: the :class:`keras.optimizers.Optimizer` to guard.
        name: name of the wrapper.

    Raises:
        TypeError: if ``inner_optimizer`` is not a Keras optimizer.
        ValueError: if ``inner_optimizer`` is a ``LossScaleOptimizer``.

    Example:
        >>> model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        >>> optimizer = SkipNonFinite(keras.optimizers.SGD(0.1))
        >>> model.compile(optimizer=optimizer, loss="mse")
        >>> x = np.array([[1.0], [np.nan]], "float32")
        >>> _ = model.fit(x, x, batch_size=1, shuffle=False, verbose=0)
        >>> int(model.optimizer.skipped_steps), int(model.optimizer.iterations)
        (1, 1)
    """

    def __init__(self, inner_optimizer: keras.optimizers.Optimizer, name: str | None = None, **kwargs: Any) -> None:
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                "inner_optimizer must be a Keras optimizer (an instance of keras.optimizers.Optimizer), "
                f"got {type(inner_optimizer).__name__}"
            )
        if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
            raise ValueError(
                "SkipNonFinite cannot wrap a LossScaleOptimizer (the scaler would never see an overflow); "
                "wrap the other way round: LossScaleOptimizer(SkipNonFinite(optimizer))"
            )
        if kwargs:
            raise ValueError(
                f"SkipNonFinite does not support arguments {sorted(kwargs)}; set them on the inner optimizer"
            )
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer

    def build(self, var_list) -> None:
        """Create the skip counter and build the inner optimizer on ``var_list``."""
        if self.built:
            return
        self._skipped_steps = self.add_variable(
            shape=(), dtype="int64", initializer="zeros", aggregation="only_first_replica", name="skipped_steps"
        )
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    @property
    def skipped_steps(self):
        """Number of steps skipped because a gradient was not finite (a variable)."""
        if not self.built:
            return 0
        return self._skipped_steps

    @property
    def variables(self) -> list:
        return self._variables + self.inner_optimizer.variables

    @property
    def iterations(self):
        """The inner optimizer's iteration counter (skipped steps do not count)."""
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate) -> None:
        self.inner_optimizer.learning_rate = learning_rate

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list) -> None:
        self.inner_optimizer.finalize_variable_values(var_list)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):  # pragma: no cover
        """Not supported: :class:`SkipNonFinite` works with the TensorFlow backend only."""
        raise NotImplementedError("SkipNonFinite supports the TensorFlow backend only")

    def apply(self, grads, trainable_variables=None) -> None:
        """Apply ``grads`` with the inner optimizer if every gradient is finite; else skip."""
        grads = list(grads)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        if tf.distribute.in_cross_replica_context():
            raise ValueError("SkipNonFinite.apply() must be called in a replica context")
        if _internal.strategy_supports_no_merge_call():
            self._replica_apply(grads, trainable_variables)
        else:
            tf.distribute.get_replica_context().merge_call(self._cross_replica_apply, args=(grads, trainable_variables))

    @staticmethod
    def _finite(grads) -> tf.Tensor:
        return all_finite(grads)

    def _skip(self):
        self._skipped_steps.assign_add(1)
        return tf.constant(False)

    def _replica_apply(self, grads, trainable_variables):
        finite = self._finite(grads)
        context = tf.distribute.get_replica_context()
        if context is not None and context.num_replicas_in_sync > 1:
            bad = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(finite), tf.int32))
            finite = tf.equal(bad, 0)

        def apply():
            with one_update_at_a_time(self.inner_optimizer):
                self.inner_optimizer.apply(grads, trainable_variables)
            return tf.constant(True)

        tf.cond(finite, apply, self._skip)

    def _cross_replica_apply(self, distribution, grads, trainable_variables):
        bad_per_replica = distribution.extended.call_for_each_replica(
            lambda g: tf.cast(tf.logical_not(self._finite(g)), tf.int32), args=(grads,)
        )
        finite = tf.equal(distribution.reduce(tf.distribute.ReduceOp.SUM, bad_per_replica, axis=None), 0)

        def apply():
            distribution.extended.call_for_each_replica(self.inner_optimizer.apply, args=(grads, trainable_variables))
            return tf.constant(True)

        # The cond is made in cross-replica context, like LossScaleOptimizer does: a
        # cond in replica context must not contain the merge_call of apply().
        tf.cond(finite, apply, self._skip)

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name, "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer)}

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects=None) -> "SkipNonFinite":
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)
