"""The optimizer calls a guarded step intercepts, and the update it runs for them.

While :class:`~companion.training.step.GuardedStep` traces the model's own
``train_step``, the calls that step makes on the optimizers are intercepted (replaced
for the call of ``train`` through :class:`~companion.training.patches.ModelPatches`):

* ``optimizer.scale_loss(loss)`` of the model's optimizer notes the loss, and what the
  gradients will be multiplied by (the dynamic loss scale, ``loss_scale_factor``).
* ``optimizer.apply(gradients, variables)`` of the model's optimizer notes the gradients,
  sums them across replicas once, clips them if asked and runs the update: deferred to
  the step's end (:class:`~companion.training.deferred.DeferredUpdate`), at once (masked:
  the step's end selects every variable's new or old value; or unguarded), or, with
  several replicas or a loss scaler, under a conditional on the loss and the gradients'
  norm being finite.
* ``apply`` of any other optimizer the model holds (a GAN's ``d_optimizer``), or a second
  ``apply`` of the model's, notes its gradients and their norm (a skipped step's end puts
  back what it wrote).

What the calls noted while one replica's step was traced is kept in a
:class:`TraceSlot`. The chapter *A training loop that survives NaN* derives the design.
"""

from __future__ import annotations

import threading

import tensorflow as tf

from companion import _internal
from companion._gradients import global_norm, one_update_at_a_time, scale_gradient
from companion.training.deferred import DeferredUpdate, Undeferrable
from companion.training.patches import ModelPatches
from companion.training.values import read as _read


class TraceSlot(threading.local):
    """What the intercepted optimizer calls saw while one replica's step was traced."""

    def __init__(self) -> None:
        self.active = False
        self.loss = None
        self.multiplier_fn = None
        self.record = None
        self.halted = None
        self.late = []  # (variable, value before the step) of optimizers built during the step
        self.grads = {}  # id(variable) -> its gradient, from every optimizer's apply
        self.norms = []  # the global norms of the applies of optimizers other than the model's
        self.spike = None  # (spike, threshold) when the update's own conditional tested it


class OptimizerInterception:
    """The optimizer calls of a :class:`~companion.training.step.GuardedStep`, intercepted.

    A mixin of ``GuardedStep``: it reads the step's set-up (``model``, ``optimizer``,
    ``optimizers``, ``loss_scaler``, ``inner``, ``variables``, ``replicas``, ``guard``,
    ``masked``, ``presummed``, ``clip``, ``spikes``, ``loss_spikes``, ``bound``, the
    :class:`TraceSlot` ``_slot`` and ``_scale()``) and sets its ``mode``.
    """

    def _global_loss(self, slot):
        loss = tf.constant(float("nan")) if slot.loss is None else tf.cast(slot.loss, tf.float32)
        if self.replicas > 1 and slot.loss is not None:
            # fit's per-replica loss is already divided by the number of replicas.
            loss = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, loss)
        return loss

    def _intercept(self, patches: ModelPatches) -> None:
        optimizer, slot = self.optimizer, self._slot
        if optimizer is not None:
            scale_loss = optimizer.scale_loss
            apply = optimizer.apply

            def noted_scale_loss(loss):
                scaled = scale_loss(loss)
                if slot.active and slot.loss is None:
                    slot.loss = loss
                    slot.multiplier_fn = lambda: tf.cast(scale_loss(tf.constant(1.0, loss.dtype)), tf.float32)
                return scaled

            def guarded_apply(grads, trainable_variables=None):
                if not slot.active:
                    return apply(grads, trainable_variables)
                if slot.record is not None:  # a second apply of the same optimizer
                    if isinstance(slot.deferred, DeferredUpdate):
                        raise Undeferrable("the step calls the optimizer's apply twice")
                    return self._noted_apply(optimizer, apply, grads, trainable_variables)
                return self._apply(apply, list(grads), trainable_variables)

            patches.set(optimizer, "scale_loss", noted_scale_loss)
            patches.set(optimizer, "apply", guarded_apply)
        for other in self.optimizers:
            if other is optimizer:
                continue
            patches.set(other, "apply", self._noting(other, other.apply))

    def _noting(self, optimizer, apply):
        slot = self._slot

        def noted_apply(grads, trainable_variables=None):
            if not slot.active:
                return apply(grads, trainable_variables)
            return self._noted_apply(optimizer, apply, grads, trainable_variables)

        return noted_apply

    def _noted_apply(self, optimizer, apply, grads, trainable_variables):
        """An optimizer other than the model's (or its second apply): its gradients are
        noted for the step's test; the step's end puts back what it wrote."""
        slot = self._slot
        grads = list(grads)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
        if not optimizer.built and trainable_variables is not None:
            # As Keras' apply would, but here, so that the new state's values before the
            # step are known (a GAN's optimizers are built by their first apply).
            with tf.init_scope():
                optimizer.build(trainable_variables)
            slot.late.extend((v, _read(v)) for v in optimizer.variables)
        variables = trainable_variables if trainable_variables is not None else []
        for g, v in zip(grads, variables):
            if g is not None:
                slot.grads[id(v)] = g
        slot.norms.append(global_norm(grads))
        return apply(grads, trainable_variables)

    def _apply(self, apply, grads, trainable_variables):
        slot = self._slot
        if trainable_variables is None:
            trainable_variables = self.variables
        trainable_variables = list(trainable_variables)
        if not self.optimizer.built:
            # As Keras' apply would, but before the update is traced (masked or not).
            with tf.init_scope():
                self.optimizer.build(trainable_variables)
            if self.guard and not slot.deferred:
                slot.late.extend((v, _read(v)) for v in self._optimizer_state())
        # Gradients arrive multiplied by what scale_loss multiplied the loss by (the
        # dynamic loss scale, the optimizer's loss_scale_factor).
        multiplier = slot.multiplier_fn() if slot.loss is not None else tf.constant(1.0)
        present = [i for i, g in enumerate(grads) if g is not None]
        # A step that does not call scale_loss (its own loss) is tested on its loss later.
        loss = self._global_loss(slot) if slot.loss is not None else tf.constant(0.0)
        summed = grads
        if self.replicas > 1 and present:
            context = tf.distribute.get_replica_context()
            reduced = context.all_reduce(tf.distribute.ReduceOp.SUM, [grads[i] for i in present])
            summed = list(grads)
            for i, g in zip(present, reduced):
                summed[i] = g
        norm = global_norm(summed) / multiplier
        if self.guard and not self.masked:
            finite = tf.logical_and(tf.math.is_finite(loss), tf.math.is_finite(norm))
            applied = tf.logical_and(finite, tf.logical_not(slot.halted))
            if self.spikes is not None and slot.loss is not None:
                # A loss spike skips the update's conditional too (the step's end reuses it).
                slot.spike = self.loss_spikes.test(loss, slot.halted)
                applied = tf.logical_and(applied, tf.logical_not(slot.spike[0]))
        else:  # masked: the step's end tests the loss, the norm and what the step wrote
            applied = tf.raw_ops.LogicalNot(x=slot.halted)
        update = summed if self.presummed else grads
        if self.clip is not None:
            factor = tf.minimum(self.clip / tf.maximum(norm, 1e-30), 1.0)
            factor = tf.where(tf.math.is_finite(factor), factor, 1.0)
            update = [scale_gradient(g, factor) for g in update]
        for g, v in zip(summed, trainable_variables):
            if g is not None:
                slot.grads[id(v)] = g

        scale = self._scale()  # before the update may change it
        if slot.deferred:
            # The bounds of exactly the variables this apply updates, measured now (at
            # trace time: the values before the first step of this trace).
            self.bound.use(trainable_variables)
            self.bound.measure()
            bound = norm if self.clip is None else tf.minimum(norm, self.clip)
            slot.deferred = DeferredUpdate(self, apply, update, trainable_variables, bound)
            slot.after_apply = len(tf.compat.v1.get_default_graph().get_operations())
            slot.record = (loss, norm, tf.raw_ops.LogicalNot(x=slot.halted), scale, None)
            self.mode = "deferred"
            return self.optimizer.iterations
        if self.presummed:
            with _internal.optimizer_all_reduce_skipped(self.inner):
                self._update(apply, update, trainable_variables, applied)
        else:
            self._update(apply, update, trainable_variables, applied)
        slot.record = (loss, norm, applied, scale, None)
        return self.optimizer.iterations

    def _optimizer_state(self) -> list:
        """The model's optimizer's variables but the dynamic loss scale's."""
        if self.loss_scaler is None:
            return list(self.optimizer.variables)
        scale = {id(self.loss_scaler.dynamic_scale), id(self.loss_scaler.step_counter)}
        return [v for v in self.optimizer.variables if id(v) not in scale]

    def _direct(self) -> list:
        """What a deferred update writes: the model's trainable variables and its
        optimizer's state (no copy of them is ever made on the untested path)."""
        found, seen = [], set()
        optimizer_state = self._optimizer_state() if self.optimizer is not None and self.optimizer.built else []
        for v in [*self.model.trainable_variables, *optimizer_state]:
            if id(v) not in seen:
                seen.add(id(v))
                found.append(v)
        return found

    def run_apply(self, apply, grads, variables):
        return apply(grads, variables)

    def _update(self, apply, grads, variables, applied) -> None:
        if not self.guard:
            self.mode = "unguarded"
            self.run_apply(apply, grads, variables)
            return
        if self.masked:
            # One replica: the update runs, and the step's end selects, for every
            # variable the step wrote, between its new and its old value.
            self.mode = "masked"
            self.run_apply(apply, grads, variables)
            return
        self.mode = "conditional"
        if self.loss_scaler is not None:

            def skip():
                # As the loss scaler does on an overflow: halve the scale.
                scaler = self.loss_scaler
                scaler.step_counter.assign(0)
                scaler.dynamic_scale.assign(tf.convert_to_tensor(scaler.dynamic_scale) * 0.5)
                return tf.constant(0)
        else:

            def skip():
                return tf.constant(0)

        def run():
            with one_update_at_a_time(self.inner):
                self.run_apply(apply, grads, variables)
            return tf.constant(0)

        if self.replicas > 1 and not _internal.strategy_supports_no_merge_call():
            context = tf.distribute.get_replica_context()

            def cross_replica(distribution, grads, applied):
                def apply_each():
                    distribution.extended.call_for_each_replica(
                        lambda g: self.run_apply(apply, g, variables), args=(grads,)
                    )
                    return tf.constant(0)

                value = distribution.experimental_local_results(applied)[0]
                tf.cond(value, apply_each, skip)

            context.merge_call(cross_replica, args=(grads, applied))
        else:
            tf.cond(applied, run, skip)
