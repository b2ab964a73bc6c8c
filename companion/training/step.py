"""The guarded step that :func:`companion.training.train` installs in Keras' own ``fit``.

``train`` *is* ``model.fit``: Keras' trainer runs the epochs, the callbacks, the
validation, ``steps_per_execution``, ``History``. What ``train`` adds is a guarded
``train_step``, installed on the model for the duration of the call: it runs the
model's own ``train_step`` (Keras', or the user's override: a GAN's, a VAE's, Keras'
guide's) and decides, after it, whether the step counts.

* On one replica, without XLA or a loss scaler, the model optimizer's update is
  deferred to the step's end and run under one predicate, with no copy of the weights
  or of the optimizer's state (:mod:`companion.training.deferred`); only the small state
  the step writes itself is read before it and put back. Otherwise (and for a step that
  reads or writes what the update writes, traced again):
* Before the step, the values of every variable a step may write are read (under
  several replicas, each replica its own copy): every variable of the model (weights,
  non-trainable state such as batch-norm statistics, the metrics) and of every
  optimizer it holds (``model.optimizer`` and any other, a GAN's ``d_optimizer`` and
  ``g_optimizer``; an optimizer first built by the
  step's own ``apply`` is built just before it, and read then). Not the random state
  (a skipped random draw is not drawn again) and not the dynamic loss scale.
* While the step is traced, its calls on the optimizers are intercepted:
  ``optimizer.scale_loss(loss)`` notes the loss; ``optimizer.apply(gradients,
  variables)`` notes the gradients (for the model's optimizer they are summed across
  replicas once, clipped if asked, and tested before the update).
* After the step, it is non-finite when its loss (noted, else its logged ``loss`` or
  first logged value), any optimizer's gradients, any value it logs, or any variable
  it may have written is not finite, or when the
  consecutive-skip limit was reached. Every variable read before the step is then
  written back, ``where(ok, new, old)``: nothing the step did remains, whoever wrote
  it. Under several replicas the same decision is taken on every replica (an
  all-reduce), the update of the model's optimizer is put under a conditional, and
  every replica puts back its own copy of every variable (other optimizers' writes
  included).

The step's record (loss, norm, applied or not, loss scale, NaN/Inf counts per variable
on a skipped step) is written into a small buffer of variables, and the logs are re-read
so that they never show a skipped step. The buffer is drained by
:class:`~companion.training.callbacks.GuardCallback` after every host call (every ``steps_per_execution`` steps), which fills the
:class:`TrainingHistory` (:mod:`companion.training.records`) and raises
:class:`NonFiniteError`; once the consecutive-skip
limit is reached inside a host call, the remaining steps of that call apply nothing and
are not recorded.

Under a multi-worker strategy the step's logs get a leading axis of length 1 (Keras'
``fit`` reduces them with ``strategy.reduce("MEAN", value, axis=0)``, which fails on a
scalar), and the model's symbolic build takes its example batch from the local
replica (a repair in :mod:`companion._internal.keras_trainer`): the two places where Keras 3's
``fit`` fails under ``MultiWorkerMirroredStrategy``.

What the step changes on the model and its optimizers, and how it is put back, is
listed in :mod:`companion.training.patches`. The design is derived in the chapter *A training loop that survives NaN*.
"""

from __future__ import annotations

import contextlib
import threading
import types
import weakref
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from companion import _internal
from companion._gradients import global_norm, nonfinite_counts, one_update_at_a_time, scale_gradient
from companion.training.bounds import UpdateBound
from companion.training.deferred import DeferredUpdate, Undeferrable, writes_of_step
from companion.training.patches import ModelPatches
from companion.training.buffer import ON_READ, RecordBuffer
from companion.training.spikes import LossSpikes
from companion.training.values import SELECT_LIMIT, float_values as _float_values, read as _read
from companion.training.values import all_finite as _all_finite, entries as _entries

class _TraceSlot(threading.local):
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


class GuardedStep:
    """A guarded ``train_step`` for one (model, optimizer, strategy, options) set-up.

    Args:
        model: the compiled Keras model.
        strategy: its distribution strategy.
        capacity: the most steps one host call runs (``steps_per_execution``).
        guard: ``False`` for ``on_nonfinite="ignore"`` (records only, every step applied).
        clip: the ``clip_global_norm`` of :func:`train`, or ``None``.
        limit: the consecutive skipped steps after which nothing more is applied.
        spikes: the ``skip_loss_spikes`` of :func:`train` (a step whose loss is more
            than this many running standard deviations above the running mean of the
            loss is skipped), or ``None``.
    """

    def __init__(self, model, strategy, *, capacity: int, guard: bool, clip: float | None, limit: int,
                 defer: bool = True, watch_logs: bool = False, spikes: float | None = None) -> None:
        self.model = model
        self.optimizer = model.optimizer
        self.loss_scaler = self.optimizer if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer) else None
        self.inner = self.loss_scaler.inner_optimizer if self.loss_scaler is not None else self.optimizer
        self.strategy = strategy
        self.replicas = int(strategy.num_replicas_in_sync)
        self.multi_worker = _internal.in_multi_worker_mode(strategy)
        if self.replicas > 1 and not self.multi_worker:
            _internal.isolate_collective_keys(strategy)
        self.capacity = int(capacity)
        self.guard = guard
        self.clip = clip
        self.limit = int(limit)
        self.spikes = None if spikes is None or not guard else float(spikes)
        self.variables = list(model.trainable_variables)
        self.original_step = model.train_step
        self.optimizers = model_optimizers(model)
        self.original_test_step = model.test_step
        self.presummed = self.replicas > 1 and _internal.can_skip_optimizer_all_reduce(self.inner)
        self.masked = self.replicas == 1 and self.loss_scaler is None and guard
        # One replica, no loss scaler: the model optimizer's update is deferred to the
        # step's end and applied under one predicate, with no copy of what it writes
        # (DeferredUpdate); off for a step that reads the weights after its update or
        # writes them itself (found while tracing: the step is then traced again, masked).
        self.deferred = defer and self.masked and not model_cache(model).get("undeferrable")
        # The NaN doctor's step records which logged values were not finite (fit's logs
        # show a skipped step's values put back).
        self.watch_logs = watch_logs and self.replicas == 1
        self.bound = UpdateBound(self.inner, self.variables) if self.deferred and self.inner is not None else None
        self.mode = None  # how the update was compiled, known once traced
        self._slot = _TraceSlot()
        self.buffer = RecordBuffer(self.capacity, len(self.variables), strategy)
        with strategy.scope():
            self.loss_spikes = None if self.spikes is None else LossSpikes(self.spikes, self.replicas, ON_READ)
        self.state = None  # found when the step is traced (fit builds the metrics first)

    def _state(self) -> list:
        """The variables a skipped step must put back, read before the step.

        Every variable of the model (its weights, the non-trainable state the forward
        pass changes, the metrics) and of every optimizer the model holds
        (``model.optimizer`` and any other, e.g. a GAN's ``d_optimizer``), so that a
        skipped step changes nothing, whoever writes; under several replicas each
        replica reads and puts back its own copy. Never the random state (a
        ``SeedGenerator``'s): a skipped random draw is not drawn again. Never the
        dynamic loss scale: a skipped step halves it.
        """
        model = self.model
        if len(model.trainable_variables) != len(self.variables):
            self.variables = list(model.trainable_variables)
        if not self.guard:
            return []
        kept = {id(v) for v in _random_state(model)}
        if self.loss_scaler is not None:
            kept.update(id(v) for v in (self.loss_scaler.dynamic_scale, self.loss_scaler.step_counter))
        candidates = [*model.variables, *model.metrics_variables]
        for optimizer in self.optimizers:
            if optimizer.built:
                candidates.extend(optimizer.variables)
        state = []
        for v in candidates:
            if id(v) not in kept:
                kept.add(id(v))
                state.append(v)
        return state

    # -- installing ----------------------------------------------------------------------

    def install(self, patches: ModelPatches) -> None:
        """Make ``model.fit`` run the guarded step, until ``patches.restore()``."""
        model = self.model
        # Not converted by AutoGraph, as Keras' own step functions are not: under a
        # strategy, strategy.run would otherwise try to convert these and warn that it
        # cannot (the model's own train_step runs as fit runs it either way).
        patches.set(model, "train_step", types.MethodType(
            tf.autograph.experimental.do_not_convert(lambda _model, data: self.train_step(data)), model))
        self._intercept(patches)
        if self.multi_worker:
            patches.set(model, "test_step", types.MethodType(
                tf.autograph.experimental.do_not_convert(lambda _model, data: self.test_step(data)), model))
            patches.repair_symbolic_build(model)
        # fit builds its train function from model.train_step: the guarded one traced by
        # an earlier call of train, else a fresh one; the user's is put back afterwards,
        # and the guarded one kept for the next call.
        patches.set_step_functions(
            model, getattr(self, "_train_function", None),
            getattr(self, "_test_function", None) if self.multi_worker else None,
        )
        patches.before_restore(self._keep_functions)
        GUARDED.add(model)
        patches.before_restore(lambda: GUARDED.discard(model))
        if self.bound is not None:
            self.bound.measure()  # the weights and moments may have changed since the last call

    def undeferrable(self, patches: ModelPatches) -> None:
        """The step reads or writes what a deferred update writes: trace it again, masked
        (and remember it for this model)."""
        model_cache(self.model)["undeferrable"] = True
        self.deferred = False
        self.forget_functions(patches)

    def _keep_functions(self) -> None:
        self._train_function = getattr(self.model, "train_function", None)
        self._test_function = getattr(self.model, "test_function", None)

    @contextlib.contextmanager
    def unguarded_steps(self):
        """The model's own ``train_step`` and ``test_step`` for the duration (the doctor
        re-runs a skipped step with them): a re-run of the guarded step would count in the
        guard's records and consecutive skips, and halt the steps after it."""
        model = self.model
        installed = {name: vars(model).pop(name) for name in ("train_step", "test_step") if name in vars(model)}
        try:
            yield
        finally:
            for name, value in installed.items():
                setattr(model, name, value)

    def forget_functions(self, patches: ModelPatches) -> None:
        """Trace afresh at the next install (e.g. after ``jit_compile`` changed)."""
        self._train_function = self._test_function = None
        patches.set_step_functions(self.model, None, None)

    # -- the step ------------------------------------------------------------------------

    def test_step(self, data):
        return self._per_worker_logs(self.original_test_step(data))

    def _per_worker_logs(self, logs):
        if not self.multi_worker:
            return logs
        return tf.nest.map_structure(lambda v: tf.expand_dims(v, 0) if tf.is_tensor(v) else v, logs)

    def train_step(self, data):
        """The model's own ``train_step``, guarded (replica context).

        The step is non-finite when its loss, its gradients (any optimizer's), its
        logged values or anything it wrote (weights, optimizer state, non-trainable
        variables, metrics) are not finite; every variable of
        :meth:`_state` is then put back to its value before the step.
        """
        slot = self._slot
        if self.state is None and self.guard:
            # Without a strategy fit builds the compiled metrics inside the first traced
            # step; the guard must know their variables before the step runs. A model
            # that cannot be built symbolically (a VAE without call()) is left to fit,
            # which builds what the step uses while tracing it.
            spec = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype) if tf.is_tensor(t) else t, data)
            with tf.init_scope():
                try:
                    _internal.build_compiled_state(self.model, spec)
                except (RuntimeError, NotImplementedError):
                    pass
        self.state = state = self._state()
        one = self.replicas == 1
        # (Not in an eager step, run_eagerly: its ops run as they are made, none to read.)
        deferred = self.deferred and not self.model.jit_compile and tf.inside_function()
        direct: list = []
        if deferred:
            # What the deferred update writes is never copied: the model's trainable
            # variables and its optimizer's state.
            direct = self._direct()
            ids = {id(v) for v in direct}
            state = [v for v in state if id(v) not in ids]
        saved = [_read(v) for v in state]  # each replica its own copy
        buffer = self.buffer
        written = _read(buffer.written) if one else tf.convert_to_tensor(buffer.written)
        consecutive = _read(buffer.consecutive) if one else tf.convert_to_tensor(buffer.consecutive)
        halted = tf.raw_ops.GreaterEqual(x=consecutive, y=tf.constant(self.limit, tf.int32))
        slot.active, slot.loss, slot.multiplier_fn, slot.record, slot.halted = True, None, None, None, halted
        slot.late, slot.grads, slot.norms, slot.spike = [], {}, [], None
        slot.deferred, slot.after_apply = deferred, None
        graph = tf.compat.v1.get_default_graph()
        first = len(graph.get_operations())
        try:
            logs = self.original_step(data)
        finally:
            slot.active = False
        if deferred:
            # Only what the step itself wrote is put back (a batch-norm statistic, a
            # metric, another optimizer's state); the step must neither write what the
            # deferred update writes nor read it after its apply.
            touched = writes_of_step(graph, first, len(graph.get_operations()), slot.after_apply, state, direct)
            saved = [value for v, value in zip(state, saved) if id(v) in touched]
            state = [v for v in state if id(v) in touched]
        record = slot.record
        loss = self._global_loss(slot) if slot.loss is not None else self._logged_loss(logs)
        if record is None:  # the model's optimizer applied nothing (another one may have)
            applied = tf.raw_ops.LogicalNot(x=halted)
            record = (loss, tf.constant(0.0), applied, self._scale(), None)
        _, norm, applied, scale, _ = record
        if slot.norms:
            norm = tf.raw_ops.Sqrt(x=tf.raw_ops.AddN(inputs=[tf.raw_ops.Square(x=tf.cast(n, tf.float32))
                                                             for n in [norm, *slot.norms]]))
        restored = [*zip(state, saved), *slot.late]
        now = None
        if self.guard:
            # One test for the whole step: its loss, its gradients' norm, every float it
            # logs and every variable it may have written (each replica its own copy).
            now = [_read(v) for v, _ in restored]
            # (The doctor's step tests the gradients' entries instead of their norm: a norm
            # that overflows from finite entries is not a value fit makes non-finite.)
            gradients = list(slot.grads.values()) if self.watch_logs else [norm]
            finite = _all_finite([loss, *gradients, *_float_values(logs), *now], flatten=_entries(now) <= SELECT_LIMIT)
            if not one:
                # The same decision on every replica and worker.
                context = tf.distribute.get_replica_context()
                bad = tf.cast(tf.logical_not(finite), tf.float32)
                finite = context.all_reduce(tf.distribute.ReduceOp.SUM, bad) < 0.5
            applied = tf.raw_ops.LogicalAnd(x=applied, y=finite)
        spike = threshold = None
        if self.spikes is not None:
            # A finite loss far above the running mean of the applied steps' losses:
            # skipped like a non-finite step, decided on the device (no host round trip).
            if slot.spike is not None:
                # Tested before the update's conditional, which the spike skipped already.
                spike, threshold = slot.spike
                spike = tf.raw_ops.LogicalAnd(x=spike, y=finite)  # a non-finite step is not called a spike
            else:
                spike, threshold = self.loss_spikes.test(loss, halted)
                spike = tf.raw_ops.LogicalAnd(x=spike, y=applied)  # a non-finite step is not called a spike
                applied = tf.raw_ops.LogicalAnd(x=applied, y=tf.raw_ops.LogicalNot(x=spike))
        counts = self._counts(slot) if self.guard and self.variables else None
        if self.guard and isinstance(slot.deferred, DeferredUpdate):
            # The NaN/Inf counts of a step that may be skipped, written before the update
            # so that no gradient outlives its variable's update; then the update, only
            # if everything above is finite and it is proved (or, tested on a copy,
            # found) finite itself.
            on_skip = None
            if counts is not None and self._few_weights():
                buffer.write_counts(counts, written, applied, len(self.variables), True)  # at every step: a few ops
            elif counts is not None:
                def on_skip(counts=counts):  # inside the update's conditional: no gradient waits for it
                    buffer.write_counts(counts, written, None, len(self.variables), False)
            counts = None
            applied = slot.deferred.run(applied, self._direct(), on_skip)
        self._put_back(restored, applied, now)
        if spike is not None:
            self.loss_spikes.count(loss, spike, threshold, tf.raw_ops.LogicalOr(x=applied, y=spike))
        if self.watch_logs and isinstance(logs, dict):
            buffer.write_log_flags(logs, written)
        spiked = tf.constant(0.0) if spike is None else tf.cast(spike, tf.float32)
        row = tf.stack([tf.cast(loss, tf.float32), tf.cast(norm, tf.float32), tf.cast(applied, tf.float32), scale,
                        spiked])
        # A spike is a finite step: it ends a run of non-finite ones, as an applied step does.
        ended = applied if spike is None else tf.raw_ops.LogicalOr(x=applied, y=spike)
        if one:
            buffer.record_raw(row, counts, written, consecutive, halted, applied, ended, len(self.variables),
                              self._few_weights())
        else:
            buffer.record(row, counts, written, consecutive, halted, applied, ended, len(self.variables))
        if isinstance(logs, dict):
            # Re-read after the restore: a skipped step leaves no trace in the logs.
            fresh = self.model.get_metrics_result()
            if set(fresh) == set(logs):
                logs = fresh
            elif self.guard and one:
                logs = self._last_good_logs(logs, applied)
        return self._per_worker_logs(logs)

    def reset_loss_stats(self) -> None:
        """Forget the running loss statistics (after a rollback: the warm-up again)."""
        if self.loss_spikes is not None:
            self.loss_spikes.reset()

    def _put_back(self, restored, applied, now=None) -> None:
        """Every variable of ``restored`` to its value before the step, unless ``applied``.

        Raw reads and writes of the variables' handles (``now``: their values after the
        step; under several replicas each replica's handle is its own copy's, and the
        decision is the same on every replica). Under XLA, and without it for a small
        state, one select per variable: XLA fuses the selects into the step's
        element-wise work, and a small model's selects cost less to trace and to run
        than a conditional with every variable as its input. Without XLA, a state of
        more than :data:`SELECT_LIMIT` entries is put back under a conditional instead:
        there the selects, a pass over every weight and moment at every step, would
        cost more than the conditional's one trace. Unguarded (``now`` is ``None``),
        only an optimizer built during the step is put back, with Keras' ``assign``.
        """
        if not restored:
            return
        if now is None:
            for variable, value in restored:
                variable.assign(tf.where(applied, tf.convert_to_tensor(variable), value))
            return
        if not self.model.jit_compile and _entries(now) > SELECT_LIMIT:

            def put_back():
                for variable, value in restored:
                    tf.raw_ops.AssignVariableOp(resource=variable.handle, value=value)
                return tf.constant(0)

            tf.cond(applied, lambda: tf.constant(0), put_back)
            return
        for (variable, value), new in zip(restored, now):
            tf.raw_ops.AssignVariableOp(resource=variable.handle, value=tf.raw_ops.SelectV2(
                condition=applied, t=new, e=value))

    def _logged_loss(self, logs):
        """The step's loss when the step did not call ``scale_loss``: its logged ``loss``, or
        the first value it logs (a GAN's ``d_loss``); 0 when it logs nothing."""
        values = _float_values(logs, scalars=True)
        if isinstance(logs, dict) and tf.is_tensor(logs.get("loss")) and logs["loss"].dtype.is_floating:
            values = [logs["loss"]]
        loss = tf.reduce_mean(tf.cast(values[0], tf.float32)) if values else tf.constant(0.0)
        if self.replicas > 1:
            context = tf.distribute.get_replica_context()
            loss = context.all_reduce(tf.distribute.ReduceOp.SUM, loss) / self.replicas
        return loss

    def _last_good_logs(self, logs, applied):
        """``logs`` whose values are not metrics: a skipped step shows the last applied
        step's values, so that no log ever shows a skipped step."""
        if getattr(self, "_good_logs", None) is None:
            self._good_logs = {}
        out = dict(logs)
        for key, value in logs.items():
            if not (tf.is_tensor(value) and value.dtype.is_floating and value.shape.rank == 0):
                continue
            if key not in self._good_logs:
                with tf.init_scope():
                    self._good_logs[key] = tf.Variable(tf.zeros([], value.dtype), trainable=False, name=f"guard_{key}")
            memory = self._good_logs[key]
            kept = tf.where(applied, value, tf.convert_to_tensor(memory))
            memory.assign(kept)
            out[key] = kept
        return out

    def _counts(self, slot):
        grads = dict(slot.grads)
        flatten = self._few_weights()

        def counts():
            """NaN and Inf counts per trainable variable's gradient, ``[2, n]``."""
            gradients = [grads.get(id(v)) for v in self.variables]
            return tf.raw_ops.Pack(values=list(nonfinite_counts(gradients, flatten=flatten)))

        return counts

    def _few_weights(self) -> bool:
        """At most :data:`SELECT_LIMIT` trainable entries: the NaN/Inf counts are computed
        at every step (a few ops over all gradients at once), without a conditional, whose
        two traced branches cost a small model more than the counts."""
        return _entries(self.variables) <= SELECT_LIMIT

    def _metric_names(self):
        return [m.name for m in self.model.metrics]

    def _scale(self):
        if self.loss_scaler is None or not self.loss_scaler.built:
            return tf.constant(1.0)
        return tf.cast(tf.convert_to_tensor(self.loss_scaler.dynamic_scale), tf.float32)

    def _global_loss(self, slot):
        loss = tf.constant(float("nan")) if slot.loss is None else tf.cast(slot.loss, tf.float32)
        if self.replicas > 1 and slot.loss is not None:
            # fit's per-replica loss is already divided by the number of replicas.
            loss = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, loss)
        return loss

    # -- the optimizer calls the step makes ----------------------------------------------

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

    # -- the host side -------------------------------------------------------------------

    def reset(self, consecutive: int = 0) -> None:
        self.buffer.reset(consecutive)

    def drain(self) -> tuple[np.ndarray, np.ndarray | None]:
        """The records of the steps run since the last drain, and their NaN/Inf counts."""
        return self.buffer.drain(self.guard)

    def nonfinite_logs(self, row: int) -> list[str]:
        """The logged values that were not finite at ``row`` of the last drained records."""
        return self.buffer.nonfinite_logs(row)


def _random_state(model) -> list:
    """The state of every ``keras.random.SeedGenerator`` of ``model`` (moves on when skipped)."""
    found = []
    for layer in _internal.all_layers(model):
        for value in vars(layer).values():
            if isinstance(value, keras.random.SeedGenerator):
                found.append(value.state)
    found.extend(v for v in model.variables if v.name == "seed_generator_state")
    return found


def model_optimizers(model) -> list:
    """``model.optimizer`` and every other optimizer the model or one of its layers holds
    (a GAN's ``d_optimizer`` and ``g_optimizer``), each once; a loss-scale optimizer's
    inner optimizer is not listed apart from it."""
    found: list = []

    def add(value):
        if isinstance(value, keras.optimizers.Optimizer) and all(value is not o for o in found):
            inner = getattr(value, "inner_optimizer", None)
            found[:] = [o for o in found if o is not inner]
            if not any(getattr(o, "inner_optimizer", None) is value for o in found):
                found.append(value)

    add(getattr(model, "optimizer", None))
    for layer in _internal.all_layers(model):
        for value in list(vars(layer).values()):
            if isinstance(value, (list, tuple)):
                for item in value:
                    add(item)
            elif isinstance(value, dict):
                for item in value.values():
                    add(item)
            else:
                add(value)
    return found


#: The models whose ``fit`` runs a guarded step now (``train``'s, or the NaN doctor's).
GUARDED: "weakref.WeakSet[Any]" = weakref.WeakSet()

#: Per model: what train learnt about it (an optimizer whose update cannot be masked),
#: and the guarded steps built for it, so that calling ``train`` again does not retrace.
_CACHE: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def model_cache(model) -> dict:
    try:
        return _CACHE.setdefault(model, {})
    except TypeError:  # not weak-referenceable or unhashable: no cache
        return {}
